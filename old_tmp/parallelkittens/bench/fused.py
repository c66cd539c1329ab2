"""Fused GEMM + communication benchmarks: TFLOP/s per GPU for ours, torch.matmul + the torch.distributed
collective, and torch's fused_all_gather_matmul / fused_matmul_reduce_scatter where they run, over the paper's
sweep (local shapes for W ranks: all-gather + GEMM N x N/W x N; the others N x N x N/W), plus a sweep of
num_comm_sms at the largest N. At one rank the baseline that matters is our own GEMM on the same shape (issue
4: each fused op within 1.03x of it). Times are back to back (`_timeit`); up to N = 8192 also from CUDA graphs
(`vs_our_gemm_graph`: device time alone, where back-to-back calls of small shapes show the host's time)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from .collectives import _graph_ms, _timeit
from .plot import line_plot

SIZES = [2048, 4096, 8192, 16384, 32768]
COMM_SMS = [1, 2, 4, 8, 16, 32]


def _shapes(op: str, n: int, world: int) -> tuple[tuple[int, int], tuple[int, int]]:
    if op == "all_gather_matmul":  # local a: (N/W, N), b: (N, N/W)... the paper's N x N/W x N per rank
        return (n // world, n), (n, n // world)
    return (n, n // world), (n // world, n)  # a: (N, N/W), b: (N/W, N)


def _baseline(op: str, a: torch.Tensor, b: torch.Tensor, world: int):
    """torch.matmul with the collective before or after it (NCCL with a GPU per rank)."""
    group = None
    if op == "all_gather_matmul":
        full = torch.empty(a.shape[0] * world, a.shape[1], dtype=a.dtype, device=a.device)
        return lambda: (dist.all_gather_into_tensor(full, a, group=group), torch.matmul(full, b))
    if op == "matmul_reduce_scatter":
        out = torch.empty(a.shape[0] // world, b.shape[1], dtype=a.dtype, device=a.device)
        return lambda: dist.reduce_scatter_tensor(out, torch.matmul(a, b), group=group)
    return lambda: dist.all_reduce(torch.matmul(a, b), group=group)


def _torch_fused(op: str, a: torch.Tensor, b: torch.Tensor):
    """torch's symmetric-memory fused op, or None where it cannot run here."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        import parallelkittens as pk

        name = pk.context().group.group_name
        if op == "all_gather_matmul":
            fn = lambda: symm_mem.fused_all_gather_matmul(a, [b], gather_dim=0, group_name=name)  # noqa: E731
        elif op == "matmul_reduce_scatter":
            fn = lambda: symm_mem.fused_matmul_reduce_scatter(a, b, "sum", scatter_dim=0, group_name=name)  # noqa: E731
        else:
            return None
        fn()
        torch.cuda.synchronize()
        return fn
    except Exception:
        return None


def _rank(op: str) -> list[dict]:
    import parallelkittens as pk

    from ..ops import all_gather_matmul, matmul, matmul_all_reduce, matmul_reduce_scatter

    ops = {"all_gather_matmul": all_gather_matmul, "matmul_reduce_scatter": matmul_reduce_scatter,
           "matmul_all_reduce": matmul_all_reduce}
    ctx = pk.context()
    world = ctx.world_size
    rows = []
    sizes = SIZES if world > 1 else SIZES[:3]  # at one rank the local shapes are N^3: the small ones suffice
    for i, n in enumerate(sizes):
        (m, k), (k2, n2) = _shapes(op, n, world)
        a = torch.randn(m, k, device=ctx.device, dtype=torch.bfloat16)
        b = torch.randn(k2, n2, device=ctx.device, dtype=torch.bfloat16)
        flops = 2 * (m * world if op == "all_gather_matmul" else m) * k * n2  # per GPU
        nbytes = flops // 1000  # only sets the iteration count
        row = {"N": n, "a": [m, k], "b": [k2, n2], "ours_ms": _timeit(lambda: ops[op](a, b), nbytes)}  # noqa: B023
        row["our_gemm_ms"] = _timeit(lambda: matmul(a, b), nbytes) if op != "all_gather_matmul" else \
            _timeit(lambda: matmul(torch.empty(m * world, k, device=a.device, dtype=a.dtype), b), nbytes)  # noqa: B023
        row["torch_matmul_plus_dist_ms"] = _timeit(_baseline(op, a, b, world), nbytes)
        fused = _torch_fused(op, a, b)
        row["torch_fused_ms"] = _timeit(fused, nbytes) if fused else None
        for key in [k for k in row if k.endswith("_ms") and row[k]]:
            row[key.replace("_ms", "_tflops")] = flops / row[key] / 1e9
        row["vs_torch"] = row["torch_matmul_plus_dist_ms"] / row["ours_ms"]
        row["vs_our_gemm"] = row["ours_ms"] / row["our_gemm_ms"]
        if n <= 8192:  # device time alone, from CUDA graphs: where the host's time per call shows back to back
            full = torch.empty(m * world, k, device=a.device, dtype=a.dtype) if op == "all_gather_matmul" else a
            row["ours_graph_ms"] = _graph_ms(lambda: ops[op](a, b), 10)  # noqa: B023
            row["our_gemm_graph_ms"] = _graph_ms(lambda: matmul(full, b), 10)  # noqa: B023
            if row["ours_graph_ms"] and row["our_gemm_graph_ms"]:
                row["vs_our_gemm_graph"] = row["ours_graph_ms"] / row["our_gemm_graph_ms"]
        rows.append(row)
        del a, b
        torch.cuda.empty_cache()
        if ctx.rank == 0:
            print(f"\r{op} [{'#' * (i + 1)}{'.' * (len(sizes) - i - 1)}] N={n}", end="", file=sys.stderr, flush=True)
    if op != "matmul_reduce_scatter" and world > 1:
        n = 16384
        (m, k), (k2, n2) = _shapes(op, n, world)
        a = torch.randn(m, k, device=ctx.device, dtype=torch.bfloat16)
        b = torch.randn(k2, n2, device=ctx.device, dtype=torch.bfloat16)
        for sms in COMM_SMS:
            ms = _timeit(lambda: ops[op](a, b, num_comm_sms=sms), m * k)  # noqa: B023
            rows.append({"N": n, "num_comm_sms": sms, "ours_ms": ms})
    if ctx.rank == 0:
        print(file=sys.stderr)
    return rows


def bench_fused(op: str) -> dict:
    """Run the sweep for fused op `op` with one rank per GPU; print the table; return rows for JSON."""
    import parallelkittens as pk

    world = max(1, torch.cuda.device_count())
    rows = pk.spawn(_rank, world, op, backend="cuda", timeout=1800)[0]
    print(f"{'N':>6} {'ours TF/s':>10} {'our GEMM':>9} {'x GEMM':>7} {'graphs':>7} {'mm+dist':>8} "
          f"{'x mm+dist':>9} {'torch fused':>11}")
    for r in rows:
        if "num_comm_sms" in r:
            print(f"{r['N']:>6} num_comm_sms={r['num_comm_sms']:<3} {r['ours_ms']:.3f} ms")
            continue
        fused = f"{r['torch_fused_tflops']:.0f}" if r.get("torch_fused_tflops") else "-"
        graphs = f"{r['vs_our_gemm_graph']:.3f}" if r.get("vs_our_gemm_graph") else "-"
        print(f"{r['N']:>6} {r['ours_tflops']:>10.0f} {r['our_gemm_tflops']:>9.0f} {r['vs_our_gemm']:>7.3f} "
              f"{graphs:>7} {r['torch_matmul_plus_dist_tflops']:>8.0f} {r['vs_torch']:>9.2f} {fused:>11}")
    return {"world_size": world, "rows": rows}


def plot_fused(name: str, record: dict, path: str) -> bool:
    """TFLOP/s per GPU against N for ours and each baseline as a PNG, when matplotlib is installed; returns
    whether it wrote one."""
    rows = [r for r in record["rows"] if "num_comm_sms" not in r]
    series = {label: [(r["N"], r[key]) for r in rows if r.get(key)]
              for key, label in [("ours_tflops", "parallelkittens"), ("our_gemm_tflops", "our GEMM alone"),
                                 ("torch_matmul_plus_dist_tflops", "torch.matmul + torch.distributed"),
                                 ("torch_fused_tflops", "torch fused (symmetric memory)")]}
    return line_plot(path, f"{name}, {record['world_size']} x {record['gpu']}, {record['date'][:10]}", "N",
                     "TFLOP/s per GPU", series)

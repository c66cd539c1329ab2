"""Collective benchmarks, nccl-tests style: sizes from 4 KB to 1 GB, ours beside torch.distributed and torch
symmetric memory in the same run.

`size` follows nccl-tests: the per-rank buffer for all_reduce and all_to_all, the gathered output for
all_gather, the input for reduce_scatter. algbw = size / time; busbw = algbw x 2(W-1)/W for all_reduce and
(W-1)/W for the others. Every rank runs the same number of iterations (a collective cannot let each rank choose
its own), timed with CUDA events; the slowest rank's time counts. At world size 1 the `copy_` column is the
data-path ceiling: `copy_` of the same output bytes (the goal: ours at least 0.85 of it). Before timing, each of
ours is checked against torch.distributed's result (bit for bit where data only moves, by relative error where
it is summed), and every output is allocated before the timed region (ours write into `out=`).
all_to_all runs in the Ulysses layout, (1, N/W, 32, 128) -> (1, N, 32/W, 128); NCCL's all_to_all_single
needs a permute and copy before and after, which its time includes.

Up to 1 MB a call is bound by the host that issues it (tens of µs of Python and launch against a few µs on the
device), so there ours and torch.distributed are also timed inside a CUDA graph (``*_graph_ms``), as
nccl-tests' -G does: the latency a model gets when it captures its step, which is how small collectives are
run in production.
"""

from __future__ import annotations

import functools
import sys
import time

import torch
import torch.distributed as dist

from .plot import line_plot
from .settings import bench_settings

SIZES = [4 << 10 << (2 * i) for i in range(10)]  # 4 KB, 16 KB, ..., 1 GB
HEADS, HEAD_DIM = 32, 128
GRAPH_UP_TO = 1 << 20  # sizes also timed inside a CUDA graph


def _timeit(fn, nbytes: int) -> float:
    """Milliseconds per call, back to back: the same iteration count on every rank (20 or more unless
    PK_BENCH_MAX_ITERS says fewer, so that one slow first launch weighs little), a barrier first, CUDA events
    around the loop. A GPU sleep of about 1 ms queued before the start event keeps the GPU busy while the host
    queues the first calls, so the time is the device's whenever the device is the bottleneck (as nccl-tests
    measure). When the host is, its time shows, less the sleep spread over the calls (1 ms / iterations: 5 µs
    at 200 calls), for every column alike."""
    import parallelkittens as pk

    iters = min(bench_settings().max_iters, max(20, (16 << 30) // max(nbytes, 1)))
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier(group=pk.context().cpu_group)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(2_000_000)  # about a millisecond
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    ms = torch.tensor([start.elapsed_time(end) / iters])
    dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=pk.context().cpu_group)
    return float(ms)


def host_us(fn, calls: int = 200) -> float:
    """Host microseconds per call of `fn`, calls issued back to back after a few warm-ups: the host's share,
    for shapes whose device time is shorter."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    return issued * 1e6 / calls


def _graph_ms(fn, calls: int = 20) -> float | None:
    """Milliseconds per call of `fn` replayed from a CUDA graph of `calls` calls (the slowest rank's), or None
    where `fn` cannot be captured. Collective: every rank captures and replays the same number of times."""
    import parallelkittens as pk

    group = pk.context().cpu_group
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm up off the default stream, as capture requires
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        ok = torch.tensor([1.0])
    except Exception:
        ok = torch.tensor([0.0])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # every rank replays, or none
    if not ok.item():
        torch.cuda.synchronize()
        return None
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 10
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    ms = torch.tensor([start.elapsed_time(end) / (reps * calls)])
    dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
    del graph
    return float(ms)


def _symm_all_reduce(kind: str, numel: int, dtype: torch.dtype):
    """torch symmetric memory's one_shot / two_shot all_reduce, or None where this torch cannot run it."""
    import parallelkittens as pk

    try:
        import torch.distributed._symmetric_memory as symm_mem

        ctx = pk.context()
        buf = symm_mem.empty(numel, dtype=dtype, device=ctx.device)
        symm_mem.rendezvous(buf, ctx.group.group_name)
        buf.normal_()
        op = getattr(torch.ops.symm_mem, f"{kind}_all_reduce")
        op(buf, "sum", ctx.group.group_name)
        torch.cuda.synchronize()
        return lambda: op(buf, "sum", ctx.group.group_name)
    except Exception:  # not built, not this backend, not this size: the column stays empty
        return None


def _case(name: str, size: int, world: int, dtype: torch.dtype):
    """(ours on a parallel tensor, ours on a plain tensor, torch.distributed, output bytes, count, the
    parallel tensor to free, what checking ours against torch.distributed found)."""
    import parallelkittens as pk
    from parallelkittens.testing import first_mismatch, tolerance

    ctx = pk.context()
    elem = torch.empty(0, dtype=dtype).element_size()
    group = ctx.group
    if name == "all_reduce":
        n = size // elem
        x = pk.empty(n, dtype, name="bench.in")
        x.local.normal_()
        plain, out, ref = x.local.clone(), torch.empty(n, dtype=dtype, device=ctx.device), x.local.clone()
        dist.all_reduce(ref, group=group)
        ours, ours_plain = (lambda: pk.ops.all_reduce(x.local, out=out)), (lambda: pk.ops.all_reduce(plain, out=out))
        theirs, count, out_bytes = (lambda: dist.all_reduce(plain, group=group)), n, size
    elif name == "all_gather":
        n = size // elem // world
        x = pk.empty(n, dtype, name="bench.in")
        x.local.normal_()
        plain, out = x.local.clone(), torch.empty(n * world, dtype=dtype, device=ctx.device)
        ref = torch.empty_like(out)
        ours, ours_plain = (lambda: pk.ops.all_gather(x.local, out=out)), (lambda: pk.ops.all_gather(plain, out=out))
        theirs, count, out_bytes = (lambda: dist.all_gather_into_tensor(ref, plain, group=group)), n * world, size
    elif name == "reduce_scatter":
        n = size // elem // world * world
        x = pk.empty(n, dtype, name="bench.in")
        x.local.normal_()
        plain, out = x.local.clone(), torch.empty(n // world, dtype=dtype, device=ctx.device)
        ref = torch.empty_like(out)
        ours = lambda: pk.ops.reduce_scatter(x.local, out=out)  # noqa: E731
        ours_plain = lambda: pk.ops.reduce_scatter(plain, out=out)  # noqa: E731
        theirs, count, out_bytes = (lambda: dist.reduce_scatter_tensor(ref, plain, group=group)), n, size // world
    else:
        tokens = max(1, size // elem // (HEADS * HEAD_DIM))
        shape = (1, tokens, HEADS, HEAD_DIM)
        x = pk.empty(shape, dtype, name="bench.in")
        x.local.normal_()
        plain = x.local.clone()
        out = torch.empty(1, world * tokens, HEADS // world, HEAD_DIM, dtype=dtype, device=ctx.device)

        def nccl_ulysses():
            send = plain.reshape(1, tokens, world, HEADS // world, HEAD_DIM).permute(2, 0, 1, 3, 4).contiguous()
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=group)
            return recv.permute(1, 0, 2, 3, 4).reshape(1, world * tokens, HEADS // world, HEAD_DIM)

        ours = lambda: pk.ops.all_to_all(x.local, 2, 1, out=out)  # noqa: E731
        ours_plain = lambda: pk.ops.all_to_all(plain, 2, 1, out=out)  # noqa: E731
        theirs, count, out_bytes = nccl_ulysses, plain.numel(), plain.numel() * elem
    found = []
    for label, fn in (("parallel tensor", ours), ("plain tensor", ours_plain)):
        out.fill_(float("nan"))
        fn()
        if name == "all_to_all":
            expected = theirs()
        else:
            if name != "all_reduce":  # NCCL's all_reduce sums in place: `ref` holds its result already
                theirs()
            expected = ref
        if name in ("all_reduce", "reduce_scatter"):
            err = float((out.double() - expected.double()).norm() / expected.double().norm())
            if not err <= tolerance(dtype):
                found.append(f"{label}: relative error {err:.2e}")
        else:
            problem = first_mismatch(out, expected)
            if problem:
                found.append(f"{label}: {problem}")
    return ours, ours_plain, theirs, out_bytes, count, x, "; ".join(found) or "ok"


def _rank(name: str, dtype_name: str) -> list[dict]:
    import parallelkittens as pk

    ctx = pk.context()
    world, dtype = ctx.world_size, getattr(torch, dtype_name)
    factor = 2 * (world - 1) / world if name == "all_reduce" else (world - 1) / world
    rows = []
    for i, size in enumerate(SIZES):
        ours_pt, ours_plain, nccl, out_bytes, count, x, check = _case(name, size, world, dtype)
        src = torch.empty(out_bytes, dtype=torch.uint8, device=ctx.device)
        dst = torch.empty_like(src)
        row = {"size": size, "count": count, "dtype": dtype_name, "check": check, "pass": check == "ok",
               "ours_ms": _timeit(ours_pt, size), "ours_plain_tensor_ms": _timeit(ours_plain, size),
               "torch_distributed_ms": _timeit(nccl, size), "copy_ms": _timeit(functools.partial(dst.copy_, src), size)}
        if size <= GRAPH_UP_TO:  # the latency regime: also as a captured model step would see it
            row["ours_graph_ms"], row["torch_distributed_graph_ms"] = _graph_ms(ours_pt), _graph_ms(nccl)
            if row["ours_graph_ms"] and row["torch_distributed_graph_ms"]:
                row["vs_torch_distributed_graph"] = row["torch_distributed_graph_ms"] / row["ours_graph_ms"]
        if name == "all_reduce":
            from ..ops.collectives.all_reduce import algorithm

            row["algorithm"] = algorithm(size, world)
            for kind in ("one_shot", "two_shot"):
                fn = _symm_all_reduce(kind, size // torch.empty(0, dtype=dtype).element_size(), dtype)
                row[f"symm_mem_{kind}_ms"] = _timeit(fn, size) if fn else None
        row["algbw_GBps"] = size / row["ours_ms"] / 1e6
        row["busbw_GBps"] = row["algbw_GBps"] * factor
        row["vs_torch_distributed"] = row["torch_distributed_ms"] / row["ours_ms"]
        row["vs_copy"] = row["copy_ms"] / row["ours_ms"]
        rows.append(row)
        pk.sync()
        x.free()
        if ctx.rank == 0:
            done = i + 1
            bar = "#" * (2 * done) + "." * (2 * (len(SIZES) - done))
            print(f"\r{name} [{bar}] {done}/{len(SIZES)} sizes", end="" if done < len(SIZES) else "\n",
                  file=sys.stderr, flush=True)
    return rows


def bench_collective(name: str, dtype: str = "bfloat16") -> dict:
    """Run the sweep for `name` on one rank per GPU; print the table; return rows for JSON."""
    import parallelkittens as pk

    world = max(1, torch.cuda.device_count())
    rows = pk.spawn(_rank, world, name, dtype, backend="cuda", timeout=1800)[0]
    head = f"{'size':>10} {'count':>11} {'ours ms':>9} {'algbw':>7} {'busbw':>7} {'torch.dist':>10} {'x dist':>7} "
    print(head + f"{'copy_ ms':>9} {'x copy_':>7} {'graph ms':>9} {'x distG':>7}"
          + ("  symm one/two ms" if name == "all_reduce" else ""))
    for r in rows:
        line = (f"{r['size']:>10} {r['count']:>11} {r['ours_ms']:>9.4f} {r['algbw_GBps']:>7.1f} "
                f"{r['busbw_GBps']:>7.1f} {r['torch_distributed_ms']:>10.4f} {r['vs_torch_distributed']:>7.2f} "
                f"{r['copy_ms']:>9.4f} {r['vs_copy']:>7.2f} {_fmt(r.get('ours_graph_ms'), 9, 4)} "
                f"{_fmt(r.get('vs_torch_distributed_graph'), 7, 2)}")
        if name == "all_reduce":
            sm = [r.get(f"symm_mem_{k}_ms") for k in ("one_shot", "two_shot")]
            line += "  " + " / ".join("-" if v is None else f"{v:.4f}" for v in sm)
        print(line)
    return {"world_size": world, "rows": rows, "goal": _goal(rows, world)}


def _fmt(value: float | None, width: int, digits: int) -> str:
    return f"{value:>{width}.{digits}f}" if value else f"{'-':>{width}}"


def _goal(rows: list[dict], world: int) -> dict:
    """The goals as measured: at one rank, the data path against copy_ at the largest sizes."""
    if world == 1:  # the bandwidth regime: from 256 MB, where a call's fixed costs (host ~50-100 µs) weigh little
        large = [r["vs_copy"] for r in rows if r["size"] >= 256 << 20]
        return {"data_path_vs_copy_min_256MB_up": min(large), "target": 0.85, "pass": min(large) >= 0.85}
    graphed = [r["vs_torch_distributed_graph"] for r in rows if r.get("vs_torch_distributed_graph")]
    return {"min_vs_torch_distributed": min(r["vs_torch_distributed"] for r in rows),
            "min_vs_torch_distributed_graph_up_to_1MB": min(graphed) if graphed else None}


def plot(name: str, record: dict, path: str) -> bool:
    """Bus bandwidth against size as a PNG, when matplotlib is installed; returns whether it wrote one."""
    rows, world = record["rows"], record["world_size"]
    factor = 2 * (world - 1) / world if name == "all_reduce" else (world - 1) / world
    factor = factor or 1.0  # at one rank, plot algorithm bandwidth
    lines = [("ours_ms", "parallelkittens"), ("ours_plain_tensor_ms", "parallelkittens, staged"),
             ("torch_distributed_ms", "torch.distributed"), ("symm_mem_one_shot_ms", "symm_mem one_shot"),
             ("symm_mem_two_shot_ms", "symm_mem two_shot")]
    if world == 1:
        lines.append(("copy_ms", "torch copy_ (the one-rank ceiling)"))
    series = {label: [(r["size"], r["size"] / r[key] / 1e6 * factor) for r in rows if r.get(key)]
              for key, label in lines}
    return line_plot(path, f"{name}, {world} x {record['gpu']}, {record['date'][:10]}", "size (bytes)",
                     "bus bandwidth (GB/s)" if world > 1 else "algorithm bandwidth (GB/s)", series)

"""Attention benchmarks: TFLOP/s per GPU, forward and backward, ours beside the baselines in the same run.

* ``bench attention`` (one rank): our flash kernel against torch's scaled_dot_product_attention with each
  backend it has here (cuDNN, flash, efficient); B 16, H 16, D 128, N 4096 to 32768, causal and not. Goals:
  forward at least 0.8x the fastest backend, backward at least 0.7x.
* ``bench ring_attention`` (a rank per GPU): ours against K/V passed round the ring with torch.distributed
  point-to-point on a side stream while the same kernel computes each block (what xDiT and ring-flash-attn do);
  B 16, H 16, D 128, total sequence 12288 up, causal (zigzag) and not, and a sweep of communicator programs. At
  one rank the comparison is our kernel alone (goal: ring attention within 1.05x of it).
* ``bench ulysses_attention`` (a rank per GPU): ours against all_to_all_single with its reshapes around the same
  kernel; B 1, H 128, D 128.

FLOPs: the forward is 4·B·H·N²·D (half of it causal), the backward 2.5 times the forward (its five products
against two). Each case is checked against a float64-accumulated reference on a slice before it is timed.
`bench attention` times every side three times in turns and keeps each one's median.
Sequences whose forward would take over about a second per GPU are left out unless PK_BENCH_FULL=1.
"""

from __future__ import annotations

import gc
import statistics
import sys

import torch
import torch.distributed as dist

from .plot import line_plot
from .settings import bench_settings

B, H, D = 16, 16, 128
SEQS = [4096, 8192, 16384, 32768]
RING_SEQS = [12288, 24576, 49152, 98304, 196608, 393216]
ULYSSES_HEADS = 128
COMM_SMS = [1, 2, 4, 8, 16]
MAX_FWD_FLOP = 5e14  # per GPU; about a second of forward
ROUNDS = 3  # `bench attention`: each side timed this many times, in turns


def _time_ms(fn, target_ms: float = 200.0) -> float:
    """Milliseconds per call: a warm call, then enough back-to-back calls for about `target_ms` (the same count on
    every rank), CUDA events around them; the slowest rank's time."""
    import parallelkittens as pk

    group = pk.context().cpu_group
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    calls = torch.tensor([max(2, min(50, int(target_ms / max(start.elapsed_time(end), 1e-3))))])
    dist.all_reduce(calls, op=dist.ReduceOp.MIN, group=group)
    dist.barrier(group=group)
    torch.cuda._sleep(2_000_000)  # keep the GPU busy while the host queues the first calls
    start.record()
    for _ in range(int(calls)):
        fn()
    end.record()
    end.synchronize()
    ms = torch.tensor([start.elapsed_time(end) / int(calls)])
    dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
    return float(ms)


def _flops(b: int, h: int, n: int, causal: bool) -> float:
    return 4 * b * h * n * n * D / (2 if causal else 1)


def _backward_of(fn, *inputs: torch.Tensor):
    """A call that runs only the backward of `fn(*inputs)` (the forward's graph kept)."""
    leaves = [x.detach().requires_grad_() for x in inputs]
    out = fn(*leaves)
    do = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)


def _check(name: str, fn, q, k, v, causal: bool) -> str:
    """Compare `fn` with float64 attention on the first batch and head and its last 1024 query rows (they see every
    key even when causal): enough to catch a wrong kernel, and small at any length (the whole 32K x 32K score
    matrix in float64 is 8 GiB)."""
    from ..testing import check_close

    n, rows = q.shape[2], min(q.shape[2], 1024)
    out = fn(q, k, v)[:1, :1, -rows:]
    qs, ks, vs = (t[:1, :1].double() for t in (q[..., -rows:, :], k, v))
    scores = qs @ ks.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        later = torch.arange(n - rows, n, device=q.device)[:, None] < torch.arange(n, device=q.device)[None]
        scores.masked_fill_(later, float("-inf"))
    return check_close(name, out, scores.softmax(-1) @ vs, q.dtype, "gemm") or "ok"


def _sdpa_backends() -> dict:
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def _sdpa(backend, causal: bool):
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    def run(q, k, v):
        with sdpa_kernel(backend):
            return scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def _seqs(default: list[int]) -> list[int]:
    """The sweep's sequence lengths, or PK_BENCH_SEQS's."""
    import parallelkittens as pk

    chosen = bench_settings().seqs
    try:
        return [int(n) for n in chosen.split(",")] if chosen else default
    except ValueError:
        raise pk.PKError(f"PK_BENCH_SEQS={chosen!r} is not a comma-separated list of sequence lengths") from None


def _kernel_rank() -> list[dict]:
    return _run_cases("attention", [(n, c) for n in _seqs(SEQS) for c in (False, True)], _kernel_case)


def _kernel_case(n: int, causal: bool) -> dict:
    from ..ops import attention

    q, k, v = (torch.randn(B, H, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    impls = {"ours": lambda q, k, v: attention(q, k, v, causal=causal)}
    impls.update({name: _sdpa(backend, causal) for name, backend in _sdpa_backends().items()})
    flops = _flops(B, H, n, causal)
    row = {"N": n, "causal": causal, "rounds": ROUNDS}
    timed = {}  # (name, "fwd" | "bwd") -> the call to time
    for name, fn in impls.items():
        try:
            row[f"{name}_check"] = _check(name, fn, q, k, v, causal)
            timed[name, "fwd"] = lambda fn=fn: fn(q, k, v)
            timed[name, "bwd"] = _backward_of(fn, q, k, v)
            timed[name, "fwd"]()
            timed[name, "bwd"]()
        except RuntimeError as e:  # a backend that cannot run this shape or GPU
            row[f"{name}_check"] = f"unavailable: {str(e).splitlines()[0][:120]}"
            timed.pop((name, "fwd"), None)
            timed.pop((name, "bwd"), None)
    # rounds in turns, each side's median: a change of clocks during the run weighs on every side alike (cuDNN's
    # 4K forward alone moved between 547 and 616 TFLOP/s from run to run when each side was timed once)
    times = {key: [] for key in timed}
    for _ in range(ROUNDS):
        for key, call in timed.items():
            times[key].append(_time_ms(call))
    for (name, d), ms in times.items():
        row[f"{name}_{d}_ms"] = statistics.median(ms)
        row[f"{name}_{d}_tflops"] = (2.5 if d == "bwd" else 1) * flops / row[f"{name}_{d}_ms"] / 1e9
    best = {d: max((row[f"{b}_{d}_tflops"] for b in _sdpa_backends() if f"{b}_{d}_tflops" in row), default=None)
            for d in ("fwd", "bwd")}
    for d, goal in (("fwd", 0.8), ("bwd", 0.7)):
        if best[d]:
            row[f"vs_best_{d}"] = row[f"ours_{d}_tflops"] / best[d]
            row[f"goal_{d}"] = goal
    # a case whose baselines could not run is not a pass: nothing was compared
    row["pass"] = row["ours_check"] == "ok" and all(row.get(f"vs_best_{d}", 0) >= g
                                                     for d, g in (("fwd", 0.8), ("bwd", 0.7)))
    return row


def _run_cases(name: str, cases: list[tuple[int, bool]], measure) -> list[dict]:
    """`measure(n, causal)` of each case, memory given back between cases; a case that runs out of memory is
    recorded as such and the sweep goes on."""
    rows = []
    for i, (n, causal) in enumerate(cases):
        try:
            rows.append(measure(n, causal))
        except torch.OutOfMemoryError:
            rows.append({"N": n, "causal": causal, "error": "out of memory", "pass": False})
        gc.collect()
        torch.cuda.empty_cache()
        _progress(name, i, len(cases), f"N={n} causal={causal}")
    return rows


def _progress(name: str, i: int, total: int, what: str) -> None:
    import parallelkittens as pk

    if pk.context().rank == 0:
        end = "\n" if i + 1 == total else ""
        print(f"\r{name} [{'#' * (i + 1)}{'.' * (total - i - 1)}] {what:<40}", end=end, file=sys.stderr, flush=True)


def bench_attention() -> dict:
    """Flash attention forward and backward vs torch sdpa (cuDNN, flash, efficient), B16 H16 D128, bf16."""
    import parallelkittens as pk

    rows = pk.spawn(_kernel_rank, 1, backend="cuda", timeout=1800)[0]
    names = ["ours", *_sdpa_backends()]
    print(f"{'N':>6} {'causal':>6} " + " ".join(f"{n + ' fwd':>10} {n + ' bwd':>10}" for n in names)
          + f" {'x best fwd':>10} {'x best bwd':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['N']:>6} {r['causal']!s:>6} {r['error']}")
            continue
        cells = " ".join(f"{r.get(f'{n}_fwd_tflops', 0):>10.0f} {r.get(f'{n}_bwd_tflops', 0):>10.0f}" for n in names)
        ratios = f"{r.get('vs_best_fwd', 0):>10.3f} {r.get('vs_best_bwd', 0):>10.3f}"
        print(f"{r['N']:>6} {r['causal']!s:>6} {cells} {ratios}")
    return {"world_size": 1, "unit": "TFLOP/s per GPU", "rows": rows}


def _ring_baseline(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, layout: str):
    """Ring attention the usual way: each step's K/V go to the next rank with torch.distributed point-to-point on
    a side stream while our flash kernel merges the current block (the same kernel and merge as ours)."""
    import parallelkittens as pk

    from ..ops.attention.attention import AttentionPlan
    from ..ops.attention.ring import segments

    ctx = pk.context()
    world, me = ctx.local_world_size, ctx.local_rank
    n = q.shape[2]
    q_seg = segments(layout, world, me, n)
    steps = [AttentionPlan(q, k, v, causal, 1 / D ** 0.5, q_segments=q_seg,
                           k_segments=segments(layout, world, (me - s) % world, n)) for s in range(world)]
    side = torch.cuda.Stream()
    bufs = [(torch.empty_like(k), torch.empty_like(v)) for _ in range(2)]
    acc = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)

    def run() -> torch.Tensor:
        acc.zero_()
        lse.fill_(float("-inf"))
        cur_k, cur_v = k, v
        for s in range(world):
            nxt = bufs[s % 2]
            if s + 1 < world:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    ops = [dist.P2POp(dist.isend, t, (me + 1) % world) for t in (cur_k, cur_v)]
                    ops += [dist.P2POp(dist.irecv, t, (me - 1) % world) for t in nxt]
                    requests = dist.batch_isend_irecv(ops)
            steps[s].forward_into(q, cur_k, cur_v, acc, lse)
            if s + 1 < world:
                for r in requests:
                    r.wait()
                torch.cuda.current_stream().wait_stream(side)
                cur_k, cur_v = nxt
        return acc.to(q.dtype)

    return run


def _ring_rank() -> list[dict]:
    import parallelkittens as pk

    world = pk.context().local_world_size
    full = bench_settings().full
    return _run_cases("ring_attention", [(n, c) for n in _seqs(RING_SEQS) for c in (False, True)
                                         if full or _flops(B, H, n, c) / world <= MAX_FWD_FLOP], _ring_case)


def _ring_case(n: int, causal: bool) -> dict:
    import parallelkittens as pk

    from ..ops import attention, ring_attention

    ctx = pk.context()
    world = ctx.local_world_size
    layout = "zigzag" if causal else "contiguous"
    q, k, v = (torch.randn(B, H, n // world, D, device=ctx.device, dtype=torch.bfloat16) for _ in range(3))
    row = {"N": n, "causal": causal, "layout": layout}
    timed = {"ours_fwd_ms": lambda: ring_attention(q, k, v, causal, layout=layout),
             "ours_bwd_ms": _backward_of(lambda *t: ring_attention(*t, causal, layout=layout), q, k, v)}
    if world == 1:  # the same kernel on both sides: timed in turns, each side's median, as `bench attention`
        timed.update(kernel_fwd_ms=lambda: attention(q, k, v, causal),
                     kernel_bwd_ms=_backward_of(lambda *t: attention(*t, causal), q, k, v))
    times = {key: [] for key in timed}
    for _ in range(ROUNDS if world == 1 else 1):
        for key, call in timed.items():
            times[key].append(_time_ms(call))
    row.update({key: statistics.median(ms) for key, ms in times.items()})
    if world == 1:
        row["vs_kernel_fwd"] = row["ours_fwd_ms"] / row["kernel_fwd_ms"]
        row["vs_kernel_bwd"] = row["ours_bwd_ms"] / row["kernel_bwd_ms"]
        row["pass"] = max(row["vs_kernel_fwd"], row["vs_kernel_bwd"]) <= 1.05
    elif ctx.backend == "cuda":  # NCCL point-to-point needs a GPU per rank
        row["p2p_fwd_ms"] = _time_ms(_ring_baseline(q, k, v, causal, layout))
        row["vs_p2p_fwd"] = row["p2p_fwd_ms"] / row["ours_fwd_ms"]
        for sms in COMM_SMS:
            row[f"ours_fwd_ms_comm{sms}"] = _time_ms(
                lambda sms=sms: ring_attention(q, k, v, causal, layout=layout, num_comm_sms=sms))
    return _with_tflops(row, _flops(B, H, n, causal) / world)


def _with_tflops(row: dict, flops: float) -> dict:
    """Add a TFLOP/s column beside every time (the backward counted as 2.5 forwards)."""
    for key in [key for key in row if key.endswith("_ms") or "_ms_" in key]:
        scale = 2.5 if "_bwd_" in key else 1.0
        row[key.replace("_ms", "_tflops")] = scale * flops / row[key] / 1e9
    return row


def _ulysses_baseline(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    """all_to_all_single with the reshapes it needs around our flash kernel: (B, N/W, H, D) -> (B, H/W, N, D)."""
    import parallelkittens as pk

    from ..ops import attention

    world = pk.context().local_world_size

    def gather(x: torch.Tensor) -> torch.Tensor:  # (B, n, H, D) -> (B, H/W, n W, D)
        b, n, h, d = x.shape
        send = x.reshape(b, n, world, h // world, d).permute(2, 0, 3, 1, 4).contiguous()  # (W, B, H/W, n, D)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        return recv.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * n, d)

    def scatter(x: torch.Tensor) -> torch.Tensor:  # (B, H/W, N, D) -> (B, N/W, H, D)
        b, hw, n, d = x.shape
        send = x.reshape(b, hw, world, n // world, d).permute(2, 0, 3, 1, 4).contiguous()  # (W, B, n, H/W, D)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        return recv.permute(1, 2, 0, 3, 4).reshape(b, n // world, world * hw, d)

    return lambda: scatter(attention(gather(q), gather(k), gather(v), causal))


def _ulysses_rank() -> list[dict]:
    import parallelkittens as pk

    world = pk.context().local_world_size
    full = bench_settings().full
    return _run_cases("ulysses_attention", [(n, c) for n in _seqs(RING_SEQS) for c in (False, True)
                                            if full or _flops(1, ULYSSES_HEADS, n, c) / world <= MAX_FWD_FLOP],
                      _ulysses_case)


def _ulysses_case(n: int, causal: bool) -> dict:
    import parallelkittens as pk

    from ..ops import attention, ulysses_attention

    ctx = pk.context()
    world = ctx.local_world_size
    q, k, v = (torch.randn(1, n // world, ULYSSES_HEADS, D, device=ctx.device, dtype=torch.bfloat16)
               for _ in range(3))
    row = {"N": n, "causal": causal}
    row["ours_fwd_ms"] = _time_ms(lambda: ulysses_attention(q, k, v, causal))
    row["ours_bwd_ms"] = _time_ms(_backward_of(lambda *t: ulysses_attention(*t, causal), q, k, v))
    if world == 1:
        heads = [x.transpose(1, 2).contiguous() for x in (q, k, v)]
        row["kernel_fwd_ms"] = _time_ms(lambda: attention(*heads, causal))
        row["vs_kernel_fwd"] = row["ours_fwd_ms"] / row["kernel_fwd_ms"]
        row["pass"] = row["vs_kernel_fwd"] <= 1.05
    elif ctx.backend == "cuda":
        row["a2a_fwd_ms"] = _time_ms(_ulysses_baseline(q, k, v, causal))
        row["vs_a2a_fwd"] = row["a2a_fwd_ms"] / row["ours_fwd_ms"]
    return _with_tflops(row, _flops(1, ULYSSES_HEADS, n, causal) / world)


def _print_parallel(rows: list[dict], baseline: str) -> None:
    print(f"{'N':>7} {'causal':>6} {'ours fwd':>9} {'ours bwd':>9} {baseline + ' fwd':>12} {'x':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['N']:>7} {r['causal']!s:>6} {r['error']}")
            continue
        base = r.get(f"{baseline}_fwd_tflops")
        ratio = r.get(f"vs_{baseline}_fwd")
        print(f"{r['N']:>7} {r['causal']!s:>6} {r['ours_fwd_tflops']:>9.0f} {r['ours_bwd_tflops']:>9.0f} "
              f"{base or 0:>12.0f} {ratio or 0:>6.3f}")


def bench_ring_attention() -> dict:
    """Ring attention vs NCCL p2p on a side stream (vs our kernel alone at one GPU), B16 H16 D128, bf16."""
    import parallelkittens as pk

    world = max(1, torch.cuda.device_count())
    rows = pk.spawn(_ring_rank, world, backend="cuda", timeout=1800)[0]
    _print_parallel(rows, "p2p" if world > 1 else "kernel")
    return {"world_size": world, "unit": "TFLOP/s per GPU", "rows": rows}


def bench_ulysses_attention() -> dict:
    """Ulysses attention vs all_to_all_single around the same kernel, B1 H128 D128, bf16."""
    import parallelkittens as pk

    world = max(1, torch.cuda.device_count())
    rows = pk.spawn(_ulysses_rank, world, backend="cuda", timeout=1800)[0]
    _print_parallel(rows, "a2a" if world > 1 else "kernel")
    return {"world_size": world, "unit": "TFLOP/s per GPU", "rows": rows}


def plot_attention(name: str, record: dict, path: str) -> bool:
    """TFLOP/s per GPU against the sequence length, ours and the baselines, forward (and backward), as a PNG."""
    rows = record["rows"]
    keys = sorted({k[:-7] for r in rows for k in r if k.endswith("_tflops") and "comm" not in k})
    series = {f"{key} causal={c}": [(r["N"], r[f"{key}_tflops"]) for r in rows
                                    if r["causal"] == c and r.get(f"{key}_tflops")]
              for key in keys for c in (False, True)}
    return line_plot(path, f"{name}, {record['world_size']} x {record['gpu']}, {record['date'][:10]}",
                     "sequence length", "TFLOP/s per GPU", series)

"""Host time per call, ours beside torch's in one run: where the host, not the GPU, sets the pace.

Two numbers per op and implementation, each the median of five rounds taken in turns with the other side, after
one untimed round of each (the first case timed in a run was about 7 µs slower for every side):

* `eager_us`: 200 calls back to back, then `torch.cuda.synchronize()`, divided by 200: what a user's loop sees;
* `issue_us`: the same calls without the final synchronise: the time to issue one call (`host_us` in
  bench/collectives.py);
* `gpu_us`: in the eager rounds, the GPU's time from the first call's start to the last one's end (CUDA events)
  per call: near `eager_us` where the GPU sets the pace, below it where the host does.

Cases: `matmul` at 2048x256x2048 and 2048x2048x256 beside `torch.matmul`; each fused op at world 1 at 2048^3
beside `torch.matmul` (at one rank it is a GEMM); each collective at 4 KB and 1 MB, ours on a plain tensor and on a
parallel tensor (read in place), beside torch.distributed (NCCL) at world 1; then the collectives' issue time at 2
ranks sharing the GPU (their eager time there is set by the GPU's time slicing between processes, milliseconds per
call, and measures nothing of ours). Beside each collective, in the same turns, a floor: the issue time of one local
torch kernel (`torch.add(x, 1, out=y)` on a tensor of the input's size), what any launch costs on that host and, at
2 ranks, with another process launching on the same GPU. Every result is checked against its reference before it is
timed, and every output is allocated before the timing, except the outputs the ops themselves return (as torch's
do).

Goals: `matmul` eager time at most 1.3x `torch.matmul`'s at both shapes; each fused op at most 1.3x
`torch.matmul`'s eager time at 2048^3; each collective's issue time at most 20 µs, at world 1 and at 2 ranks
sharing the GPU.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time

import torch
import torch.distributed as dist

CALLS = 200
ROUNDS = 5
SIZES = (4 << 10, 1 << 20)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _round(fn, sync: bool, calls: int = CALLS) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start = time.perf_counter()
    first.record()
    for _ in range(calls):
        fn()
    last.record()
    if sync:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed * 1e6 / calls, first.elapsed_time(last) * 1e3 / calls


def _in_turns(fns: dict, sync: bool, calls: int = CALLS) -> dict:
    """Median µs per call of each fn, rounds taken in turns so that a change of clocks weighs on all alike:
    {name: (host µs, GPU µs)}, the GPU's from the first call's start to the last one's end (events): near the
    host's figure where the host sets the pace, above it where the GPU does."""
    times = {name: [] for name in fns}
    for fn in fns.values():  # one round untimed: the first timed case of a run was ~7 µs slower for every side
        if fn:
            _round(fn, True, calls)
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            times[name].append(_round(fn, sync, calls) if fn else None)
    return {name: tuple(statistics.median(x) for x in zip(*t, strict=True)) if t[0] is not None else (None, None)
            for name, t in times.items()}


def _row(op: str, shape: str, ours: dict, torch_fn, sync_too: bool = True, calls: int = CALLS) -> dict:
    fns = {**ours, "torch": torch_fn}
    row = {"op": op, "shape": shape}
    for kind, sync in (("eager", True), ("issue", False)):
        if kind == "eager" and not sync_too:
            continue
        for name, (us, gpu_us) in _in_turns(fns, sync, calls).items():
            row[f"{name}_{kind}_us"] = us
            if kind == "eager":
                row[f"{name}_gpu_us"] = gpu_us
    return row


def _collective(name: str, size: int, world: int):
    """(our call on a plain tensor, ours on a parallel tensor, torch.distributed's, a check of ours, the
    parallel tensor to free)."""
    import parallelkittens as pk
    from parallelkittens.testing import first_mismatch, tolerance

    ctx = pk.context()
    dtype = torch.bfloat16
    n = size // 2
    if name == "all_to_all":
        n = max(world * 128, n // (world * 128) * (world * 128))
        shape = (n // 128, 128)
    else:
        shape = (max(world, n // world * world),)
    pt = pk.empty(shape, dtype, name="bench.host")
    pt.local.normal_()
    x = pt.local.clone()
    op = getattr(pk.ops, name)
    args = {"all_to_all": (0, 0)}.get(name, ())  # rows to ranks and back, as all_to_all_single does
    ours = op(x, *args)
    group = ctx.group
    if name == "all_reduce":
        ref = x.clone()
        dist.all_reduce(ref, group=group)
        theirs = lambda: dist.all_reduce(x, group=group)  # noqa: E731
        ok = (ours.double() - ref.double()).norm() <= tolerance(dtype) * ref.double().norm()
    elif name == "all_gather":
        ref = torch.empty(shape[0] * world, dtype=dtype, device=x.device)
        dist.all_gather_into_tensor(ref, x, group=group)
        theirs = lambda: dist.all_gather_into_tensor(ref, x, group=group)  # noqa: E731
        ok = first_mismatch(ours, ref) is None
    elif name == "reduce_scatter":
        ref = torch.empty(shape[0] // world, dtype=dtype, device=x.device)
        dist.reduce_scatter_tensor(ref, x, group=group)
        theirs = lambda: dist.reduce_scatter_tensor(ref, x, group=group)  # noqa: E731
        ok = (ours.double() - ref.double()).norm() <= tolerance(dtype) * ref.double().norm()
    else:
        ref = torch.empty_like(x)
        dist.all_to_all_single(ref, x, group=group)
        theirs = lambda: dist.all_to_all_single(ref, x, group=group)  # noqa: E731
        ok = first_mismatch(ours, ref) is None
    return (lambda: op(x, *args)), (lambda: op(pt.local, *args)), theirs, bool(ok), pt


def _world_one() -> list[dict]:
    import parallelkittens as pk
    from parallelkittens.testing import check_close

    rows = []
    bf16 = torch.bfloat16
    for M, N, K in ((2048, 256, 2048), (2048, 2048, 256)):
        a, b = torch.randn(M, K, device="cuda", dtype=bf16), torch.randn(K, N, device="cuda", dtype=bf16)
        problem = check_close("matmul", pk.ops.matmul(a, b), a.double() @ b.double(), bf16, "gemm")
        row = _row("matmul", f"{M}x{N}x{K}", {"ours": lambda: pk.ops.matmul(a, b)},  # noqa: B023
                   lambda: torch.matmul(a, b))  # noqa: B023
        rows.append({**row, "check": problem or "ok"})
    a = torch.randn(2048, 2048, device="cuda", dtype=bf16)
    b = torch.randn(2048, 2048, device="cuda", dtype=bf16)
    for name in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
        op = getattr(pk.ops, name)
        problem = check_close(name, op(a, b), a.double() @ b.double(), bf16, "gemm")
        row = _row(name, "2048x2048x2048", {"ours": lambda op=op: op(a, b)}, lambda: torch.matmul(a, b))
        rows.append({**row, "check": problem or "ok"})
    rows += _collectives(sync_too=True)
    return rows


def _collectives(sync_too: bool) -> list[dict]:
    import parallelkittens as pk

    ctx = pk.context()
    rows = []
    for name in COLLECTIVES:
        for size in SIZES:
            plain, in_place, theirs, ok, pt = _collective(name, size, ctx.local_world_size)
            calls = CALLS
            if ctx.backend == "cuda-shared":
                theirs = None  # gloo between processes on one GPU: no comparable baseline
                calls = 50  # each call waits for the GPU to switch between the ranks' processes (about 4.5 ms)
            # the floor: one local torch kernel (x + 1, as large as the input), issued in the same turns
            x = torch.randn(size // 2, device=ctx.device, dtype=torch.bfloat16)
            floor = functools.partial(torch.add, x, 1, out=torch.empty_like(x))
            row = _row(name, f"{size} B", {"ours": plain, "ours_parallel_tensor": in_place, "floor": floor}, theirs,
                       sync_too, calls)
            rows.append({**row, "world_size": ctx.local_world_size, "backend": ctx.backend,
                         "check": "ok" if ok else "wrong result"})
            pk.sync()
            pt.free()
    return rows


def bench_host() -> dict:
    """Host µs per call: matmul, the fused ops and the collectives, ours beside torch's (eager and issue time)."""
    import parallelkittens as pk

    rows = pk.spawn(_world_one, 1, backend="cuda", timeout=900)[0]
    print("world 1 done; 2 ranks sharing the GPU", file=sys.stderr, flush=True)
    shared = pk.spawn(_collectives, 2, False, backend="cuda-shared", timeout=900)
    for r0, r1 in zip(shared[0], shared[1], strict=True):  # the slower rank's issue time counts
        rows.append({**r0, **{k: max(v, r1[k]) for k, v in r0.items() if k.endswith("_us") and v is not None},
                     "check": r0["check"] if r1["check"] == "ok" else r1["check"]})
    print(f"{'op':<22} {'shape':>15} {'ranks':>5} {'ours eager':>10} {'torch eager':>11} {'ratio':>6} "
          f"{'ours issue':>10} {'(pt)':>6} {'torch issue':>11} {'floor':>6} {'GPU: ours':>9} {'torch':>6} check")
    for r in rows:
        known = r.get("torch_eager_us") and r.get("ours_eager_us")
        ratio = r["ours_eager_us"] / r["torch_eager_us"] if known else None
        print(f"{r['op']:<22} {r['shape']:>15} {r.get('world_size', 1):>5} {_f(r.get('ours_eager_us')):>10} "
              f"{_f(r.get('torch_eager_us')):>11} {_f(ratio, 2):>6} {_f(r.get('ours_issue_us')):>10} "
              f"{_f(r.get('ours_parallel_tensor_issue_us')):>6} {_f(r.get('torch_issue_us')):>11} "
              f"{_f(r.get('floor_issue_us')):>6} "
              f"{_f(r.get('ours_gpu_us')):>9} {_f(r.get('torch_gpu_us')):>6} {r['check']}")
    return {"world_size": 1, "rows": rows, "goal": _goal(rows)}


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _goal(rows: list[dict]) -> dict:
    gemm = {f"{r['op']} {r['shape']}": r["ours_eager_us"] / r["torch_eager_us"] for r in rows if "matmul" in r["op"]}
    issue = {f"{r['op']} {r['shape']} w{r.get('world_size', 1)}": r["ours_issue_us"] for r in rows
             if r["op"] in COLLECTIVES}
    issue_pt = {f"{r['op']} {r['shape']} w{r.get('world_size', 1)}": r["ours_parallel_tensor_issue_us"] for r in rows
                if r["op"] in COLLECTIVES}
    checks = all(r["check"] == "ok" for r in rows)
    return {"eager_vs_torch_matmul": gemm, "eager_target": 1.3, "collective_issue_us": issue,
            "collective_issue_us_parallel_tensor": issue_pt, "issue_target_us": 20.0, "checks_pass": checks,
            "pass": checks and max(gemm.values()) <= 1.3 and max(issue.values()) <= 20.0}

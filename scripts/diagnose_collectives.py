"""Where a collective's time goes, on one GPU: host time per call against device time per call (from a CUDA
graph of the same calls), a profile of the host side, and the pull kernel's bandwidth against copy_ over tile
size, warps and programs per SM. A developer's tool for tuning `ops/_collective.py`; prints plain text.

    python scripts/diagnose_collectives.py
    PK_DIAG_ONLY=fused python scripts/diagnose_collectives.py   # only the fused ops at 2048^3
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats

import torch

import parallelkittens as pk
from parallelkittens.bench.collectives import _graph_ms, _timeit, host_us


def _device_us(fn, calls: int = 20) -> float:
    """Device time per call in µs: `calls` calls captured in one CUDA graph, replayed (the benchmark's timing)."""
    return 1000 * _graph_ms(fn, calls)


def _rank() -> None:
    dev = pk.context().device
    if os.environ.get("PK_DIAG_ONLY") == "fused":
        _fused(dev)
        return
    print("== per call, microseconds: host issue time vs device time (CUDA graph)")
    for nbytes in (4096, 1 << 20, 64 << 20):
        n = nbytes // 2
        x = pk.empty(n, torch.bfloat16, name="diag.x")
        x.local.normal_()
        src, dst = torch.randn(n, device=dev, dtype=torch.bfloat16), torch.empty(n, device=dev, dtype=torch.bfloat16)
        for name, fn in [("all_reduce", lambda: pk.ops.all_reduce(x.local)),  # noqa: B023
                         ("all_gather", lambda: pk.ops.all_gather(x.local)),  # noqa: B023
                         ("copy_", lambda: dst.copy_(src))]:  # noqa: B023
            print(f"{name:>12} {nbytes:>10} B  host {host_us(fn):8.1f}  device {_device_us(fn):8.1f}")
        x.free()

    from parallelkittens.runtime import launch as launching

    print("== host time per call, Triton's launch path against the direct launch (PK_FAST_LAUNCH, runtime/launch.py)")
    x = pk.empty(2048, torch.bfloat16, name="diag.x")
    x.local.normal_()
    for name, fn in [("all_reduce", lambda: pk.ops.all_reduce(x.local)),  # noqa: B023
                     ("all_gather", lambda: pk.ops.all_gather(x.local))]:  # noqa: B023
        times, results = [], []
        for fast in (False, True):
            launching._enabled = fast
            times.append(host_us(fn))
            results.append(fn())
        launching._enabled = None  # as PK_FAST_LAUNCH says
        same = torch.equal(results[0], results[1])
        print(f"{name:>12} 4096 B  Triton {times[0]:8.1f}  direct {times[1]:8.1f}  same result {same}")
    x.free()

    print("== host profile: 300 calls of all_reduce on 4 KB")
    x = pk.empty(2048, torch.bfloat16, name="diag.x")
    x.local.normal_()
    pk.ops.all_reduce(x.local)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        pk.ops.all_reduce(x.local)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
    print(text.getvalue()[-6000:])
    x.free()

    print("== GEMM per call, microseconds: host issue time vs device time (CUDA graph), ours against torch.matmul")
    for m, n, k in ((4096, 512, 4096), (4096, 4096, 512), (8192, 8192, 8192)):
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
        for name, fn in [("pk.matmul", lambda: pk.ops.matmul(a, b)), ("torch", lambda: a @ b)]:  # noqa: B023
            print(f"{name:>12} {m}x{n}x{k}  host {host_us(fn, 50):8.1f}  device {_device_us(fn, 5):8.1f}")

    _fused(dev)
    if os.environ.get("PK_DIAG_SWEEP", "1") != "1":
        return
    _pull_sweep(dev)


def _fused(dev: torch.device) -> None:
    print("== fused ops at one rank, 2048^3 bf16: host vs device per call (issue 4: within 1.03x of pk.matmul)")
    a = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
    b = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
    fused = [("pk.matmul", lambda: pk.ops.matmul(a, b)), ("torch", lambda: a @ b),
             ("mm_rs", lambda: pk.ops.matmul_reduce_scatter(a, b)), ("mm_ar", lambda: pk.ops.matmul_all_reduce(a, b)),
             ("ag_mm", lambda: pk.ops.all_gather_matmul(a, b))]
    for name, fn in fused:
        print(f"{name:>12} 2048^3  host {host_us(fn, 200):8.1f}  device {_device_us(fn, 10):8.1f}")
    for name, fn in fused[2:4]:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
        print(f"-- host profile, 300 calls of {name}\n" + text.getvalue()[-4000:])
    print("== the fused benchmark's timing (back to back, bench/collectives.py: _timeit), five rounds in turns, µs")
    for rnd in range(5):
        print(f"  round {rnd}: " + "  ".join(f"{name} {1000 * _timeit(fn, 2 << 20):6.1f}" for name, fn in fused))


def _pull_sweep(dev: torch.device) -> None:
    from parallelkittens.ops._collective import Copy, Workspace

    print("== pull kernel, 1 GiB bf16 copy at world 1: GB/s (algbw) and fraction of copy_")
    n = 1 << 29
    src = pk.empty(n, torch.bfloat16, name="diag.src")
    src.local.normal_()
    out = torch.empty(n, device=dev, dtype=torch.bfloat16)
    ref = torch.empty_like(out)
    copy_ms = _device_us(lambda: ref.copy_(src.local), 3) / 1000
    print(f"copy_ {2 * n / copy_ms / 1e6:7.0f} GB/s")
    for per_sm in (1, 2, 4, 8):
        for tile_bytes in (8192, 16384, 32768):
            for warps in (4, 8):
                ws = Workspace(f"diag{per_sm}.{tile_bytes}.{warps}", per_sm, tile_bytes, warps)
                move = Copy((1, 1, 1), n, (0, 0, 0), (0, 0, 0))
                red = Copy((1, 1, 1), n, (0, 0, 0), (0, 0, 0), reduce=True)
                ms = _device_us(lambda: ws.pull(src.local, src.handle, out, move, 7), 3) / 1000  # noqa: B023
                ms_r = _device_us(lambda: ws.pull(src.local, src.handle, out, red, 7), 3) / 1000  # noqa: B023
                print(f"per_sm {per_sm} tile {tile_bytes:>6} B warps {warps}: copy {2 * n / ms / 1e6:7.0f} GB/s "
                      f"({copy_ms / ms:.3f})  reduce {2 * n / ms_r / 1e6:7.0f} GB/s ({copy_ms / ms_r:.3f})")
                ws.counters.free()
                ws.meta.free()
    torch.testing.assert_close(out.float(), src.local.float())
    src.free()


if __name__ == "__main__":
    pk.spawn(_rank, 1, backend="cuda", timeout=600)

"""Where small GEMMs and the fused ops at one rank lose time, on one GPU. A developer's tool; prints plain text.

1. Descriptors made on the host (TMA maps passed as kernel parameters, as cuBLAS does; `ops.matmul` since
   2026-12-04) against descriptors made in the kernel (`tl.make_tensor_descriptor`: every program writes its
   maps to global memory and fences them before its first load), same tiles, at the W = 8 local shapes, and
   other tiles where the GEMM trails cuBLAS.
2. The fused ops at one rank against the plain GEMM at 2048^3: device time per call from a CUDA graph, and
   host time per call issued back to back.

    python scripts/diagnose_gemm.py
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import torch
import triton
import triton.language as tl

import parallelkittens as pk
from parallelkittens.bench.collectives import _graph_ms, host_us
from parallelkittens.ops.matmul import (
    MatmulConfig,
    mainloop,
    matmul,
    matmul_config,
    store_tile,
    tile_coords,
)
from parallelkittens.runtime.device import num_sms
from parallelkittens.runtime.sizes import cdiv

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None


@triton.jit
def _device_desc_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        GROUP_M: tl.constexpr, STAGES: tl.constexpr, FLATTEN: tl.constexpr):
    """ops.matmul's kernel as it was before 2026-12-04: descriptors made in the kernel."""
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, [K, N], [N, 1], [BK, BN])
    c_desc = tl.make_tensor_descriptor(c_ptr, [M, N], [N, 1], [BM, BN // 2])
    for tile in tl.range(tl.program_id(0), tl.cdiv(M, BM) * tl.cdiv(N, BN), tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = tile_coords(tile, M, N, BM, BN, GROUP_M)
        acc = mainloop(a_desc, b_desc, pid_m * BM, pid_n * BN, K, BM, BN, BK, STAGES)
        store_tile(c_desc, acc.to(c_ptr.dtype.element_ty), pid_m * BM, pid_n * BN, BM, BN)


def device_desc_matmul(a: torch.Tensor, b: torch.Tensor, cfg: MatmulConfig, c: torch.Tensor) -> torch.Tensor:
    M, K = a.shape
    N = b.shape[1]
    tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
    _device_desc_kernel[(min(num_sms(), tiles),)](a, b, c, M, N, K, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
                                                   GROUP_M=cfg.group_m, STAGES=cfg.num_stages, FLATTEN=cfg.flatten,
                                                   num_warps=cfg.num_warps)
    return c


def _do_bench_us(fn) -> float:
    return 1000 * triton.testing.do_bench(fn, return_mode="median")


def _descriptors(dev: torch.device) -> None:
    print("== 1. descriptors on the host vs in the kernel: do_bench median µs (L2 cleared), 3 rounds in turns, "
          "best round; ratio = cuBLAS time / ours")
    shapes = [(2048, 256, 2048), (2048, 2048, 256), (4096, 512, 4096), (4096, 4096, 512), (2048, 2048, 2048),
              (8192, 1024, 8192)]
    extra = {(2048, 256, 2048): [MatmulConfig(64, 64, 128, 8, s, 4, True) for s in (3, 5, 6)]
             + [MatmulConfig(64, 64, 256, 8, 3, 4, True), MatmulConfig(64, 64, 64, 8, 8, 4, True),
                MatmulConfig(64, 64, 64, 8, 12, 4, True), MatmulConfig(64, 64, 64, 4, 10, 4, True),
                MatmulConfig(64, 64, 128, 4, 4, 4, True), MatmulConfig(64, 64, 128, 16, 4, 4, True)],
             (4096, 512, 4096): [MatmulConfig(128, 128, 64, 8, 6, 4, True), MatmulConfig(128, 128, 128, 8, 3, 4, True),
                                 MatmulConfig(128, 128, 64, 8, 5, 4, pingpong=True)],
             (2048, 2048, 256): [MatmulConfig(128, 128, 64, 8, 4, 4, True), MatmulConfig(128, 256, 64, 8, 3, 8, True),
                                 MatmulConfig(64, 256, 64, 8, 4, 4, pingpong=True)],
             (4096, 4096, 512): [MatmulConfig(128, 128, 64, 8, 4, 4, pingpong=True)],
             (2048, 2048, 2048): [MatmulConfig(128, 128, 64, 8, 4, 4, pingpong=True)]}
    for M, N, K in shapes:
        a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        b = torch.randn(K, N, device=dev, dtype=torch.bfloat16)
        c = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        ref = a.float() @ b.float()
        chosen = matmul_config(M, N, K, a.dtype)
        tl_cfg = chosen if not chosen.pingpong else replace(chosen, pingpong=False, flatten=True)
        fns = {"cublas": lambda: torch.matmul(a, b), "pk.matmul": lambda: matmul(a, b),  # noqa: B023
               "device descriptors": lambda: device_desc_matmul(a, b, tl_cfg, c)}  # noqa: B023
        for cfg in extra.get((M, N, K), []):
            tag = (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.num_stages} w{cfg.num_warps} g{cfg.group_m}"
                   + (" pingpong" if cfg.pingpong else ""))
            fns[tag] = lambda cfg=cfg: matmul(a, b, cfg)  # noqa: B023
        best: dict[str, float] = {}
        for _ in range(3):
            for name, fn in list(fns.items()):
                try:
                    out = fn()
                    if name != "cublas":
                        torch.cuda.synchronize()
                        err = ((out.float() - ref).norm() / ref.norm()).item()
                        if err > 1e-2:
                            raise RuntimeError(f"wrong result, relative error {err:.3g}")
                    best[name] = min(best.get(name, 1e9), _do_bench_us(fn))
                except Exception as e:  # out of shared memory and the like: say so, drop it
                    print(f"  {M}x{N}x{K} {name}: {type(e).__name__}: {str(e)[:160]}")
                    fns.pop(name)
        print(f"{M}x{N}x{K}: chosen {chosen}")
        for name, us in best.items():
            print(f"   {name:<34} {us:8.2f} µs   ratio {best['cublas'] / us:6.3f}")


def _fused(dev: torch.device) -> None:
    print("== 2. one rank, 2048^3 bf16: device µs per call (CUDA graph of 20 calls, 3 rounds in turns, best)")
    n = 2048
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    plain = matmul_config(n, n, n, a.dtype)
    fns = {"pk.matmul (flatten)": lambda: matmul(a, b), "torch": lambda: a @ b,
           "tl not flattened": lambda: matmul(a, b, replace(plain, flatten=False)),
           "device descriptors": lambda: device_desc_matmul(a, b, plain, c),
           "mm_rs": lambda: pk.ops.matmul_reduce_scatter(a, b), "mm_ar": lambda: pk.ops.matmul_all_reduce(a, b),
           "ag_mm": lambda: pk.ops.all_gather_matmul(a, b)}
    best: dict[str, float] = {}
    for _ in range(3):
        for name, fn in list(fns.items()):
            try:
                best[name] = min(best.get(name, 1e9), 1000 * _graph_ms(fn, 20))
            except Exception as e:
                print(f"  {name}: {type(e).__name__}: {str(e)[:160]}")
                fns.pop(name)
    for name, us in best.items():
        print(f"   {name:<24} {us:7.2f} µs   vs pk.matmul {us / best['pk.matmul (flatten)']:6.3f}   host "
              f"{host_us(fns[name]):6.1f} µs per call")


def _cublas_kernels(dev: torch.device) -> None:
    print("== 0. the kernels cuBLAS runs (names carry tiles and clusters)")
    from torch.profiler import ProfilerActivity, profile

    for M, N, K in [(2048, 256, 2048), (2048, 2048, 256), (4096, 512, 4096), (4096, 4096, 512), (8192, 1024, 8192)]:
        a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        b = torch.randn(K, N, device=dev, dtype=torch.bfloat16)
        torch.matmul(a, b)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.matmul(a, b)
            torch.cuda.synchronize()
        names = {e.name for e in prof.events() if e.device_type.name == "CUDA"}
        print(f"   {M}x{N}x{K}: {'; '.join(sorted(names))}")


def _host(dev: torch.device) -> None:
    """Where a small GEMM's host time goes: a profile of back-to-back calls, and the descriptor steps alone."""
    import cProfile
    import io
    import pstats

    from triton.backends.nvidia import driver as nvidia_driver

    from parallelkittens.ops.matmul import descriptor

    print("== 3. host time of pk.matmul at 2048^3 (µs per call)")
    n = 2048
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    print(f"   pk.matmul {host_us(lambda: matmul(a, b)):6.1f}   torch {host_us(lambda: a @ b):6.1f}")
    start = time.perf_counter()
    for _ in range(1000):
        descriptor(a, [128, 64])
    print(f"   descriptor() {1000 * (time.perf_counter() - start):6.2f}")
    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [128, 64], "fp4_padded": False}
    desc = descriptor(a, [128, 64])
    try:
        make = nvidia_driver.make_tensordesc_arg
        args = (desc, meta) if make.__code__.co_argcount == 2 else (desc, meta, None)
        start = time.perf_counter()
        for _ in range(1000):
            make(*args)
        print(f"   make_tensordesc_arg {1000 * (time.perf_counter() - start):6.2f}")
    except Exception as e:
        print(f"   descriptor steps: {type(e).__name__}: {str(e)[:200]}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        matmul(a, b)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(16)
    print("-- profile, 300 calls of pk.matmul\n" + text.getvalue()[-5000:])


def _rank() -> None:
    dev = pk.context().device
    only = os.environ.get("PK_DIAG_ONLY", "")
    if only in ("", "cublas"):
        _cublas_kernels(dev)
    if only in ("", "descriptors"):
        _descriptors(dev)
    if only in ("", "fused"):
        _fused(dev)
    if only in ("", "host"):
        _host(dev)


if __name__ == "__main__":
    pk.spawn(_rank, 1, backend="cuda", timeout=600)

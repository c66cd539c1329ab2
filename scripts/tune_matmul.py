"""Sweep the GEMM core's configurations over the benchmark's shapes on one GPU and print TFLOP/s beside cuBLAS,
best first per shape. A developer's tool for choosing `ops.gemm.matmul.matmul_config`.

    python scripts/tune_matmul.py                      # every shape of bench/matmul.py
    TUNE_SHAPES=4096x512x4096,4096x4096x512 python scripts/tune_matmul.py
    TUNE_ONLY=pingpong TUNE_TOP=8 python scripts/tune_matmul.py   # some kinds of configuration, 8 best
"""

from __future__ import annotations

import os

import torch
import triton

import parallelkittens as pk
from parallelkittens.bench.matmul import SHAPES
from parallelkittens.ops.gemm.matmul import MatmulConfig, matmul

CONFIGS = [MatmulConfig(bm, bn, bk, 8, stages, warps, flatten) for bm, bn, bk, stages, warps, flatten in [
    (128, 256, 64, 3, 8, False), (128, 256, 64, 3, 8, True), (128, 256, 64, 4, 8, False), (128, 256, 64, 4, 8, True),
    (128, 128, 64, 5, 4, False), (128, 128, 64, 5, 4, True), (128, 128, 64, 4, 8, True), (64, 256, 64, 4, 4, True),
    (128, 128, 128, 3, 4, True), (128, 128, 128, 3, 8, True), (128, 256, 128, 2, 8, True),
    (256, 128, 64, 3, 8, True), (128, 128, 64, 6, 4, True), (64, 128, 64, 6, 4, True),
    # small tiles: N = 2048 local shapes have 16-64 big tiles
    (64, 64, 64, 6, 4, True), (64, 64, 128, 4, 4, True), (64, 64, 64, 3, 4, True), (64, 64, 32, 8, 4, True),
    (128, 64, 64, 5, 4, True), (128, 64, 128, 3, 4, True), (64, 128, 128, 3, 4, True), (64, 128, 64, 4, 4, False)]]
CONFIGS += [MatmulConfig(128, n, 64, g, s, w, True) for n, s, w in [(128, 5, 4), (256, 3, 8)] for g in (4, 16)]
# the warp-specialised ping-pong kernel (Hopper, Gluon): two consumer warp groups, 4 warps each
CONFIGS += [MatmulConfig(bm, bn, 64, 8, stages, 4, pingpong=True) for bm, bn, most in (
    (128, 128, 5), (64, 256, 4), (64, 128, 6), (128, 64, 6), (64, 64, 8)) for stages in range(4, most + 1)]

KINDS = {"pingpong": lambda c: c.pingpong, "tl": lambda c: not c.pingpong}


def _rank() -> None:
    only = os.environ.get("TUNE_ONLY")  # e.g. "pingpong": only those kinds of configuration
    configs = [c for c in CONFIGS if not only or any(KINDS[kind](c) for kind in only.split(","))]
    picked = os.environ.get("TUNE_SHAPES")
    shapes = [tuple(map(int, s.split("x"))) for s in picked.split(",")] if picked else SHAPES
    for M, N, K in shapes:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        flops = 2 * M * N * K
        cublas = flops / triton.testing.do_bench(lambda: torch.matmul(a, b), return_mode="median") / 1e9  # noqa: B023
        chosen = flops / triton.testing.do_bench(lambda: matmul(a, b), return_mode="median") / 1e9  # noqa: B023
        results = []
        for cfg in configs:
            try:
                ms = triton.testing.do_bench(lambda: matmul(a, b, cfg), return_mode="median")  # noqa: B023
                results.append((flops / ms / 1e9, cfg))
            except Exception as e:  # out of shared memory and the like: say so and go on
                print(f"  {cfg}: {type(e).__name__}: {str(e)[:100]}")
        results.sort(key=lambda r: -r[0])
        print(f"{M}x{N}x{K}: cuBLAS {cublas:.0f} TFLOP/s; matmul_config's choice {chosen:.0f} ({chosen / cublas:.3f})",
              flush=True)
        for tflops, cfg in results[:int(os.environ.get("TUNE_TOP", 4))]:
            print(f"   {tflops:6.0f} ({tflops / cublas:.3f})  {cfg.block_m}x{cfg.block_n}x{cfg.block_k} "
                  f"stages {cfg.num_stages} warps {cfg.num_warps} flatten {cfg.flatten} "
                  f"pingpong {cfg.pingpong}",
                  flush=True)


if __name__ == "__main__":
    pk.spawn(_rank, 1, backend="cuda", timeout=600)

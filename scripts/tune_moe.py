"""Sweep the MoE grouped GEMM's configurations (ops/moe/grouped.py) on one GPU and print TFLOP/s beside
torch._grouped_mm, best first per shape: a developer's tool for choosing `GroupedGemm`'s defaults (issue 17's goal:
at least 0.9x torch._grouped_mm on the DeepSeek-V3 expert shapes).

The kernel runs as `bench moe` times it alone: rows already in expert order, read straight, balanced routing.

    python scripts/tune_moe.py                        # both shapes, 8K tokens
    TUNE_SHAPES=deepseek TUNE_TOP=10 TUNE_BUDGET_S=200 python scripts/tune_moe.py
"""

from __future__ import annotations

import itertools
import os
import time

import torch
import triton

import parallelkittens as pk
from parallelkittens.bench.moe import SHAPES, _routing
from parallelkittens.ops.moe.grouped import GroupedGemm

# (BN, BK, stages, warps, programs per SM); BM is the layout's tile height (128 here)
DEFAULT = (256, 64, 3, 8, 1)
CONFIGS = [DEFAULT] + [c for c in itertools.product((128, 256), (64, 128), (3, 4, 5), (4, 8), (1, 2))
                       if c != DEFAULT and not (c[0] == 256 and c[3] == 4) and (c[0] * c[1] <= 128 * 64 or c[2] == 3)]
CONFIGS.sort(key=lambda c: sum(a != b for a, b in zip(c, DEFAULT, strict=True)))  # one change at a time first


def _rank() -> None:
    budget = float(os.environ.get("TUNE_BUDGET_S", 400))
    began = time.monotonic()
    for name in os.environ.get("TUNE_SHAPES", "deepseek,mixtral").split(","):
        cfg = SHAPES[name]
        H, inner, E, k = cfg["H"], cfg["I"], cfg["experts_per_gpu"], cfg["top_k"]
        tokens = int(os.environ.get("TUNE_TOKENS", 8192))
        gen = torch.Generator().manual_seed(7)
        layout = pk.ops.moe_layout(_routing(tokens, E, k, False, gen).cuda(), E)
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        w1 = torch.randn(E, H, inner, device="cuda", dtype=torch.bfloat16) / H ** 0.5
        rows = x[layout.row_recv.long()]
        pairs = rows.shape[0]
        identity = torch.arange(pairs, device="cuda", dtype=torch.int32)
        out = torch.empty(pairs, inner, device="cuda", dtype=torch.bfloat16)
        offs = torch.tensor(layout.expert_offsets[1:], device="cuda", dtype=torch.int32)
        reference = torch._grouped_mm(rows, w1, offs=offs)
        flops = 2 * pairs * H * inner
        theirs = flops / triton.testing.do_bench(lambda: torch._grouped_mm(rows, w1, offs=offs)) / 1e9  # noqa: B023

        results = []
        for config in CONFIGS:
            if time.monotonic() - began > budget:
                print(f"  (budget of {budget:.0f} s spent: the rest not tried)")
                break
            # the GEMM alone (no tokens to pull), on this configuration's tiles
            gemm = GroupedGemm("tune_moe", True, H, inner, 0, torch.bfloat16, layout.block_rows, 0, tiles=config)

            def run(gemm=gemm):
                gemm(a=rows, b=w1, out=out, row_index=identity, row_src=layout.row_src,  # noqa: B023
                     tile_expert=layout.tile_expert, tile_start=layout.tile_start, tile_end=layout.tile_end,  # noqa: B023
                     num_row_tiles=layout.num_row_tiles)  # noqa: B023

            bn, bk, stages, warps, per_sm = config
            try:
                out.fill_(float("nan"))
                run()
                err = float((out.float() - reference.float()).norm() / reference.float().norm())
                ms = triton.testing.do_bench(run)
                results.append((flops / ms / 1e9, err, config))
            except Exception as e:  # out of shared memory and the like: say so and go on
                print(f"  BN {bn} BK {bk} stages {stages} warps {warps} x{per_sm}: {type(e).__name__}: "
                      f"{str(e)[:90]}")
        default = next((r for r in results if r[2] == DEFAULT), None)
        print(f"{name} ({pairs} rows, K {H}, N {inner}, {E} experts, BM {layout.block_rows}): torch._grouped_mm "
              f"{theirs:.0f} TFLOP/s; default {default[0] if default else float('nan'):.0f}", flush=True)
        for tflops, err, (bn, bk, stages, warps, per_sm) in sorted(results, key=lambda r: -r[0])[
                :int(os.environ.get("TUNE_TOP", 6))]:
            print(f"   {tflops:6.0f} ({tflops / theirs:.3f})  BN {bn} BK {bk} stages {stages} warps {warps} "
                  f"programs/SM {per_sm}  rel.err {err:.1e}", flush=True)


if __name__ == "__main__":
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    pk.spawn(_rank, 1, backend="cuda", timeout=900)

"""The single-GPU GEMM core against cuBLAS (torch.matmul), one rank: 8192^3 and the local shapes of the
fused ops' sweep at W = 8, N from 2048 to 32768 (all-gather + GEMM: N x N/8 x N; GEMM + reduce-scatter /
all-reduce: N x N x N/8).
Issue 4's goal: at least 1.0x torch.matmul. bf16, random inputs. Ours and cuBLAS are timed in turns, three
rounds of do_bench medians each, and each keeps its median round, so that a change of clocks during the run
weighs on both alike (back-to-back single measurements moved cuBLAS by up to 15% between runs)."""

from __future__ import annotations

import torch
import triton

SHAPES = [(8192, 8192, 8192)] + [s for n in (2048, 4096, 8192, 16384, 32768) for s in ((n, n // 8, n), (n, n, n // 8))]


def _rank() -> list[dict]:
    from ..ops.matmul import matmul, matmul_config

    rows = []
    for M, N, K in SHAPES:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        ref = torch.matmul(a.float(), b.float())
        err = float((matmul(a, b).float() - ref).norm() / ref.norm())
        rounds = [(triton.testing.do_bench(lambda: matmul(a, b), return_mode="median"),  # noqa: B023
                   triton.testing.do_bench(lambda: torch.matmul(a, b), return_mode="median"))  # noqa: B023
                  for _ in range(3)]
        ours, cublas = (sorted(times)[1] for times in zip(*rounds, strict=True))
        flops = 2 * M * N * K
        rows.append({"M": M, "N": N, "K": K, "config": repr(matmul_config(M, N, K, a.dtype)), "ours_ms": ours,
                     "cublas_ms": cublas, "ours_tflops": flops / ours / 1e9,
                     "cublas_tflops": flops / cublas / 1e9, "vs_cublas": cublas / ours, "rel_error": err,
                     "pass": err < 1e-2 and cublas / ours >= 1.0})
    return rows


def bench_matmul() -> dict:
    """Persistent descriptor GEMM vs torch.matmul (cuBLAS), bf16, one GPU."""
    import parallelkittens as pk

    rows = pk.spawn(_rank, 1, backend="cuda", timeout=900)[0]
    print(f"{'M':>6} {'N':>6} {'K':>6} {'ours TFLOP/s':>13} {'cuBLAS':>8} {'x cuBLAS':>9} {'rel err':>8}")
    for r in rows:
        print(f"{r['M']:>6} {r['N']:>6} {r['K']:>6} {r['ours_tflops']:>13.0f} {r['cublas_tflops']:>8.0f} "
              f"{r['vs_cublas']:>9.3f} {r['rel_error']:>8.1e}")
    return {"world_size": 1, "rows": rows}

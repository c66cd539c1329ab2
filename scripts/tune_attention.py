"""Time the flash kernel's tile choices on this GPU, beside torch's sdpa backends, to pick `flash._tiles`.

    python scripts/tune_attention.py [N ...]      (default N = 8192; B 16, H 16, D 128, bf16)

Prints forward and backward TFLOP/s of each (BLOCK_M, BLOCK_N, warps, stages), causal and not. The backward's
dK/dV and dQ kernels are timed separately (their tiles are chosen separately).
"""

from __future__ import annotations

import sys

import torch
import triton

import parallelkittens as pk
from parallelkittens.ops.attention import flash

FWD = [(128, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3)]
BWD = [(64, 64, 4, 2), (64, 64, 8, 2), (32, 128, 4, 2), (32, 128, 8, 2), (64, 128, 8, 2), (128, 64, 8, 2),
       (128, 32, 4, 2), (128, 128, 8, 2)]


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


def main() -> None:
    pk.init()
    sizes = [int(a) for a in sys.argv[1:]] or [8192]
    B, H, D = 16, 16, 128
    for n in sizes:
        q, k, v, do = (torch.randn(B, H, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        for causal in (False, True):
            flops = 4 * B * H * n * n * D / (2 if causal else 1)
            from torch.nn.attention import SDPBackend, sdpa_kernel
            from torch.nn.functional import scaled_dot_product_attention as sdpa

            for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                with sdpa_kernel(backend):
                    ms = _ms(lambda: sdpa(q, k, v, is_causal=causal))  # noqa: B023
                print(f"N={n} causal={causal} sdpa {name} fwd {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
            for tiles in FWD:
                try:
                    plan = flash.AttentionPlan(q.shape, k.shape, q.dtype, causal, D ** -0.5,
                                               tiles={"fwd": tiles, "bwd": BWD[0]})
                    ms = _ms(lambda: plan.forward(q, k, v))  # noqa: B023
                    print(f"N={n} causal={causal} fwd {tiles} {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
                except Exception as e:  # noqa: BLE001 - a configuration that does not fit: say so, go on
                    print(f"N={n} causal={causal} fwd {tiles} failed: {str(e).splitlines()[0][:100]}")
            out, lse = flash.AttentionPlan(q.shape, k.shape, q.dtype, causal, D ** -0.5).forward(q, k, v)
            for tiles in BWD:
                try:
                    plan = flash.AttentionPlan(q.shape, k.shape, q.dtype, causal, D ** -0.5,
                                               tiles={"fwd": FWD[0], "bwd": tiles})
                    delta = plan.delta(out, do)
                    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                    args = (q, k, v, do, lse, delta, dq, dk, dv)
                    ms_kv = _ms(lambda: plan._dkdv[False](*args))  # noqa: B023
                    ms_q = _ms(lambda: plan._dq[False](*args))  # noqa: B023
                    # dK/dV does 4 of the backward's 5 products' worth (2 + 2 of 2.5 x forward), dQ 3 of them
                    print(f"N={n} causal={causal} bwd {tiles} dkdv {2.0 * flops / ms_kv / 1e9:.0f} "
                          f"dq {1.5 * flops / ms_q / 1e9:.0f} TFLOP/s (ms {ms_kv:.2f} + {ms_q:.2f})", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"N={n} causal={causal} bwd {tiles} failed: {str(e).splitlines()[0][:100]}")


if __name__ == "__main__":
    main()

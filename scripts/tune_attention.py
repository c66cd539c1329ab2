"""Time the flash kernel's tile choices on this GPU, beside torch's sdpa backends, to pick `attention.default_tiles`.

    python scripts/tune_attention.py [N ...]      (default N = 8192; B 16, H 16, D 128, bf16)

Prints forward and backward TFLOP/s of each (BLOCK_M, BLOCK_N, warps, stages), causal and not, and the best of each
kernel; each forward is first checked against torch's output (a wrong one is reported, not timed). The backward's
dK/dV and dQ kernels are timed separately (their tiles are chosen separately: `default_tiles`' "bwd" and "dq").
TUNE_BEFORE=module times another version of the plan too (a copy of ops/attention/attention.py kept under another
name, with its own tiles and no op declaration), for an A/B of a kernel change in one run. TUNE_FWD and TUNE_BWD
("128,128,8,3;64,64,4,2", or empty for none) replace the lists of configurations timed; a forward's may name its
kernel fifth ("128,128,4,2,gluon" for the warp-specialised Gluon forward: `attention.FWD_KERNELS`).
"""

from __future__ import annotations

import importlib
import os
import sys

import torch
import triton

import parallelkittens as pk
from parallelkittens.ops.attention import attention

# (BLOCK_M, BLOCK_N, warps, stages). Also tried on an H200 (2026-12-06) and dropped: starting the next key tile's
# scores before this tile's softmax (FA3's overlap, by hand) was 1-4% slower; (128, 64, 8, 2) 10-15% slower.
FWD = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (64, 64, 4, 3)]
# dK/dV holds BLOCK_N keys and streams BLOCK_M query rows; dQ holds BLOCK_M rows and streams BLOCK_N keys
BWD = [(64, 64, 4, 2), (64, 64, 4, 3), (32, 128, 4, 3), (32, 128, 4, 4), (64, 128, 8, 2), (128, 64, 8, 2),
       (128, 64, 8, 3), (128, 32, 4, 3)]


def _configs(variable: str, default: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The configurations named in `variable` ("128,128,8,3;64,64,4,2"; empty: none), else `default`."""
    text = os.environ.get(variable)
    if text is None:
        return default
    return [tuple(int(x) if x.strip().isdigit() else x.strip() for x in c.split(",")) for c in text.split(";")
            if c.strip()]


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


def _fwd_ms(module, shapes, causal: bool, tiles: dict | None, q, k, v, ref=None) -> float:
    """Milliseconds per forward; with `ref` (torch's output) checked first: a wrong kernel raises, is not timed."""
    plan = module.AttentionPlan(q, k, v, causal, q.shape[-1] ** -0.5, tiles=tiles)
    if ref is not None:
        out = plan(q, k, v)[0].float()
        err = float((out - ref).norm() / ref.norm())
        if not err < 1e-2:  # bf16 outputs of two correct kernels differ by about 3e-3
            raise ValueError(f"wrong result: relative error {err:.2e} against torch's sdpa")
    return _ms(lambda: plan(q, k, v))


def _bwd_ms(module, shapes, causal: bool, tiles: dict | None, q, k, v, do) -> tuple[float, float]:
    """(dK/dV ms, dQ ms) of `module`'s kernels with `tiles`."""
    plan = module.AttentionPlan(q, k, v, causal, q.shape[-1] ** -0.5, tiles=tiles)
    out, lse = plan(q, k, v)
    delta = plan.delta(out, do)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    args = (q, k, v, do, lse, delta, dq, dk, dv)
    return _ms(lambda: plan._dkdv[False](*args)), _ms(lambda: plan._dq[False](*args))


def main() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    pk.init()
    sizes = [int(a) for a in sys.argv[1:]] or [8192]
    fwd_configs, bwd_configs = _configs("TUNE_FWD", FWD), _configs("TUNE_BWD", BWD)
    B, H, D = 16, 16, 128
    # TUNE_BEFORE=module: also time another version of the kernels (its own tiles), for an A/B in one run
    before = importlib.import_module(os.environ["TUNE_BEFORE"]) if os.environ.get("TUNE_BEFORE") else None
    for n in sizes:
        q, k, v, do = (torch.randn(B, H, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        shapes = (q.shape, k.shape)
        for causal in (False, True):
            flops = 4 * B * H * n * n * D / (2 if causal else 1)
            say = f"N={n} causal={causal}"
            for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                with sdpa_kernel(backend):
                    ms = _ms(lambda: sdpa(q, k, v, is_causal=causal))  # noqa: B023
                print(f"{say} sdpa {name} fwd {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
            if before is not None:
                ms = _fwd_ms(before, shapes, causal, None, q, k, v)
                ms_kv, ms_q = _bwd_ms(before, shapes, causal, None, q, k, v, do)
                print(f"{say} before fwd {flops / ms / 1e9:.0f} dkdv {2.0 * flops / ms_kv / 1e9:.0f} "
                      f"dq {1.5 * flops / ms_q / 1e9:.0f} bwd {2.5 * flops / (ms_kv + ms_q) / 1e9:.0f} TFLOP/s")
            best = {}
            ref = sdpa(q, k, v, is_causal=causal).float()
            for tiles in fwd_configs:
                try:
                    ms = _fwd_ms(attention, shapes, causal, {"fwd": tiles, "bwd": BWD[0]}, q, k, v, ref)
                    print(f"{say} fwd {tiles} {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
                    best["fwd"] = min(best.get("fwd", (ms, tiles)), (ms, tiles))
                except Exception as e:  # noqa: BLE001 - a configuration that does not fit (or is wrong): say so, go on
                    print(f"{say} fwd {tiles} failed: {str(e).splitlines()[0][:100]}", flush=True)
            for tiles in bwd_configs:
                try:
                    ms_kv, ms_q = _bwd_ms(attention, shapes, causal, {"fwd": FWD[0], "bwd": tiles}, q, k, v, do)
                    # dK/dV does 4 of the backward's 5 products' worth (2 + 2 of 2.5 x forward), dQ 3 of them
                    print(f"{say} bwd {tiles} dkdv {2.0 * flops / ms_kv / 1e9:.0f} "
                          f"dq {1.5 * flops / ms_q / 1e9:.0f} TFLOP/s (ms {ms_kv:.2f} + {ms_q:.2f})", flush=True)
                    best["dkdv"] = min(best.get("dkdv", (ms_kv, tiles)), (ms_kv, tiles))
                    best["dq"] = min(best.get("dq", (ms_q, tiles)), (ms_q, tiles))
                except Exception as e:  # noqa: BLE001
                    print(f"{say} bwd {tiles} failed: {str(e).splitlines()[0][:100]}")
            if {"dkdv", "dq"} <= best.keys():
                bwd_ms = best["dkdv"][0] + best["dq"][0]
                print(f"{say} best: fwd {best.get('fwd', (0, None))[1]} dkdv {best['dkdv'][1]} dq {best['dq'][1]}: "
                      f"bwd {2.5 * flops / bwd_ms / 1e9:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()

"""Helpers for multi-rank tests, demos and benchmarks: shared random data, poison, tolerances, comparisons."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..runtime.context import context

# The one source of truth for tolerances: tests, the demo and the benchmarks all use these.
# Relative-error bounds (‖out − ref‖ / ‖ref‖ against a float64 reference): a small multiple of what one
# rounding to the dtype costs, since each op here rounds once or accumulates in fp32.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-12}
# GEMMs: 16-bit operands, fp32 accumulation, about one rounding of the output; fp32 runs as tf32 on a GPU (about
# 1e-3 per product), which the interpreter does not emulate.
GEMM_TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-3}
WORST_ELEMENT = 4  # the largest elementwise error, relative to max |ref|, may be this many times the bound


def tolerance(dtype: torch.dtype, kind: str = "sum") -> float:
    """The relative-error bound for `dtype`: ``"sum"`` for data moved or summed in fp32 and rounded once,
    ``"gemm"`` for matrix products."""
    return (GEMM_TOLERANCE if kind == "gemm" else TOLERANCE)[dtype]


def check_close(what: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, kind: str = "sum") -> str | None:
    """None when `out` is within `tolerance(dtype, kind)` of `ref` (by norm, and element by element within
    `WORST_ELEMENT` times that of max |ref|: a single wrong or unwritten tile shows there), else what is wrong."""
    bound = tolerance(dtype, kind)
    err = relative_error(out, ref)
    worst = max_abs_error(out, ref) / max(float(ref.detach().abs().max()), 1e-300) if ref.numel() else 0.0
    if err <= bound and worst <= WORST_ELEMENT * bound:
        return None
    return f"{what} {dtype}: relative error {err:.2e}, worst element {worst:.2e} of max |ref| (bound {bound:.0e})"


def shared_seed() -> int:
    """A fresh random seed, the same on every rank (drawn by rank 0, broadcast)."""
    ctx = context()
    seed = [int.from_bytes(os.urandom(4), "little")]
    dist.broadcast_object_list(seed, src=0, group=ctx.cpu_group)
    return seed[0]


def rank_data(shape, dtype: torch.dtype, seed: int, rank: int, device=None) -> torch.Tensor:
    """Random data that any rank can regenerate for `rank`: normal floats (never zeros) or ints in [1, 1000)."""
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype.is_floating_point:
        data = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    else:
        data = torch.randint(1, 1000, shape, generator=gen, dtype=torch.int64).to(dtype)
    return data.to(device or context().device)


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill `t` with a value no correct kernel writes: NaN for floats, -123456789 (truncated) for ints."""
    if t.dtype.is_floating_point:
        t.fill_(float("nan"))
    else:
        t.fill_(-123456789 if t.element_size() >= 4 else -123)
    return t


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; inf if `out` has NaN or inf anywhere (unwritten or poisoned elements)."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(out64).all():
        return float("inf")
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-300))


def max_abs_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest elementwise |out − ref| in float64 (inf if `out` is not finite)."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(out64).all():
        return float("inf")
    return float((out64 - ref64).abs().max()) if out64.numel() else 0.0


def first_mismatch(out: torch.Tensor, ref: torch.Tensor) -> str | None:
    """None when `out` equals `ref` bit for bit, else where and how the first difference shows."""
    a, b = out.detach().cpu(), ref.detach().cpu().to(out.dtype)
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    differ = (a != b) & ~(a.isnan() & b.isnan()) if a.is_floating_point() else a != b
    diff = torch.nonzero(differ)
    if diff.numel() == 0:
        return None
    index = tuple(int(i) for i in diff[0])
    return f"{diff.shape[0]} element(s) differ; first at {index}: got {a[index].item()}, expected {b[index].item()}"


@dataclass
class CheckResult:
    """One row of a self-check: what ran, how far from the reference, whether it passed, how long it took."""

    op: str
    shape: str
    error: float
    ok: bool
    time_ms: float
    detail: str = ""


class Timer:
    """Wall-clock timer around device work (synchronises the rank's device on exit)."""

    def __enter__(self) -> Timer:
        self._sync()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self._sync()
        self.ms = (time.perf_counter() - self.start) * 1e3

    @staticmethod
    def _sync() -> None:
        device = context().device
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def blocks_computed(layout: str, world: int, n_total: int, causal: bool, block_m: int, block_n: int) -> list[int]:
    """How many (query tile, key tile) pairs each rank computes over a ring attention forward, as the kernels
    count them (the tests check that zigzag balances causal work)."""
    from ..ops.attention.ring import segments

    def position(i: int, seg: tuple[int, int, int]) -> int:
        return seg[1] + i if i < seg[0] else seg[2] + i - seg[0]

    n_local = n_total // world
    counts = []
    for rank in range(world):
        q_seg = segments(layout, world, rank, n_local)
        q_pos = [position(i, q_seg) for i in range(n_local)]
        total = 0
        for step in range(world):
            k_seg = segments(layout, world, (rank - step) % world, n_local)
            if causal and position(0, k_seg) > q_pos[-1]:
                continue  # a block the rank does not see at all: not computed
            for start in range(0, n_local, block_m):
                last = q_pos[min(start + block_m, n_local) - 1]
                visible = n_local if not causal else sum(1 for j in range(n_local) if position(j, k_seg) <= last)
                total += -(-visible // block_n)
        counts.append(total)
    return counts

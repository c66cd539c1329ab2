"""all_gather: every rank ends with the concatenation of every rank's tensor along `dim`.

Schedule: each rank's input is in symmetric memory (its parallel tensor, or staged into the heap's staging
pool); after the meeting, every rank pulls each peer's tensor straight into its place in the output (a strided
copy, so gathering along any dim needs no reshape or copy afterwards). See `ops/collectives/_pull.py`.
"""

from __future__ import annotations

import math

import torch

from ...runtime.context import context
from ...runtime.memory import owner_of
from .. import plan as plans
from ._pull import MOVE_DTYPES, Copy, PullPlan, check_input, collapse, normalize_dim


def reference_all_gather(shards: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """The result from every rank's tensor, in plain PyTorch."""
    return torch.cat(shards, dim=dim)


def _build(shape: tuple[int, ...], dtype: torch.dtype, dim: int, zero_copy: bool) -> PullPlan:
    world = context().local_world_size
    dims = list(shape) or [1]
    out_shape = tuple(dims[:dim] + [dims[dim] * world] + dims[dim + 1:]) if shape else (world,)
    copy = None
    if math.prod(shape):
        outer, inner = math.prod(dims[:dim]), math.prod(dims[dim:])
        rows, cols, src_strides, dst_strides = collapse((outer, inner), (inner, 1), (world * inner, 1))
        copy = Copy(rows, cols, src_strides, dst_strides, dst_r=inner)
    return PullPlan("all_gather", shape, dtype, out_shape, copy, zero_copy, f"dim={dim}")


def plan(x: torch.Tensor, dim: int = 0, *, zero_copy: bool | None = None) -> PullPlan:
    """The plan for all_gather of tensors like `x` along `dim` (collective the first time: see `ops/plan.py`)."""
    if zero_copy is None:
        zero_copy = isinstance(x, torch.Tensor) and owner_of(x) is not None
    key = ("all_gather", getattr(x, "shape", None), getattr(x, "dtype", None), dim, zero_copy)
    found = plans.find(key)
    if found is not None:
        return found

    def check() -> str:
        check_input("all_gather", x, MOVE_DTYPES)
        d = normalize_dim("all_gather", dim, max(x.dim(), 1))
        return f"all_gather of {tuple(x.shape)} {x.dtype} along dim {d}, zero_copy={zero_copy}"

    return plans.get(key, lambda: _build(tuple(x.shape), x.dtype, dim % max(x.dim(), 1), zero_copy), check)


def all_gather(x: torch.Tensor, dim: int = 0, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Gather `x` from every rank of the node along `dim`; returns a new tensor (or fills `out`), its size
    along `dim` W times `x`'s.

    Collective: every rank calls it with the same shape, dtype and dim. Any dtype that moves without
    arithmetic (float32/16, bfloat16, fp8, ints). Pass a parallel tensor's `.local` to skip the staging copy.
    """
    return plan(x, dim)(x, out=out)


plans.attach(all_gather, plan)

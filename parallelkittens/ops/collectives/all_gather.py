"""all_gather: every rank ends with the concatenation of every rank's tensor along `dim`.

Schedule: each rank's input is in symmetric memory (its parallel tensor, or staged into the heap's staging
pool); after the meeting, every rank pulls each peer's tensor straight into its place in the output (a strided
copy, so gathering along any dim needs no reshape or copy afterwards). See `ops/collectives/_pull.py`.
"""

from __future__ import annotations

import math

import torch

from ...runtime.context import context
from ..plan import declare
from ._pull import Copy, PullPlan, collapse, tensor_key


def reference_all_gather(shards: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """The result from every rank's tensor, in plain PyTorch."""
    return torch.cat(shards, dim=dim)


def _gathered_shape(shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    world = context().local_world_size
    dims = list(shape) or [1]
    return tuple(dims[:dim] + [dims[dim] * world] + dims[dim + 1:]) if shape else (world,)


class AllGatherPlan(PullPlan):
    """all_gather of one shape and dtype along one dim: one pull."""

    op = "all_gather"

    @classmethod
    def key(cls, x: torch.Tensor, dim: int = 0, *, zero_copy: bool | None = None) -> tuple:
        return (*tensor_key(x, zero_copy), dim)

    @classmethod
    def check(cls, x: torch.Tensor, dim: int = 0, *, zero_copy: bool | None = None) -> str:
        d = cls.check_input(x, dim)
        return f"all_gather of {tuple(x.shape)} {x.dtype} along dim {d}, zero_copy={tensor_key(x, zero_copy)[2]}"

    def __init__(self, x: torch.Tensor, dim: int = 0, *, zero_copy: bool | None = None):
        shape, world = tuple(x.shape), context().local_world_size
        dim %= max(x.dim(), 1)
        dims = list(shape) or [1]
        copy = None
        if math.prod(shape):
            outer, inner = math.prod(dims[:dim]), math.prod(dims[dim:])
            rows, cols, src_strides, dst_strides = collapse((outer, inner), (inner, 1), (world * inner, 1))
            copy = Copy(rows, cols, src_strides, dst_strides, dst_r=inner)
        super().__init__(x, zero_copy, _gathered_shape(shape, dim), copy, f"dim={dim}")

    @staticmethod
    def fake(x: torch.Tensor, dim: int) -> torch.Tensor:
        return x.new_empty(_gathered_shape(tuple(x.shape), dim % max(x.dim(), 1)))


_all_gather = declare(AllGatherPlan, "(Tensor x, int dim) -> Tensor")


@_all_gather.public
def all_gather(x: torch.Tensor, dim: int = 0, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Gather `x` from every rank of the node along `dim`; returns a new tensor (or fills `out`), its size
    along `dim` W times `x`'s.

    Collective: every rank calls it with the same shape, dtype and dim. Any dtype that moves without
    arithmetic (float32/16, bfloat16, fp8, ints). Pass a parallel tensor's `.local` to skip the staging copy.
    """
    return _all_gather(x, dim, out=out)

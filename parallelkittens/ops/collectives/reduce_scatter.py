"""reduce_scatter: rank r ends with the r-th of W equal slices (along `dim`) of the sum over ranks.

Schedule: inputs in symmetric memory; after the meeting, every rank pulls its slice from every peer and sums in
fp32 in rank order (the paper's reduce, built from peer reads since NVLink multicast is off). See
`ops/collectives/_pull.py`.
"""

from __future__ import annotations

import math

import torch

from ...runtime.context import context
from ...runtime.errors import PKError
from ..plan import FLOAT_DTYPES, declare
from ._pull import Copy, PullPlan, collapse, normalize_dim, tensor_key


def reference_reduce_scatter(inputs: list[torch.Tensor], rank: int, dim: int = 0) -> torch.Tensor:
    """Rank `rank`'s result from every rank's input, summed in float64."""
    total = sum(x.double() for x in inputs)
    return total.chunk(len(inputs), dim=dim)[rank]


def _scattered_shape(shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    out_shape = list(shape)
    out_shape[dim] //= context().local_world_size
    return tuple(out_shape)


def check_sum(op: str, reduction: str) -> None:
    """The reductions the collectives run: only a sum."""
    if reduction != "sum":
        raise PKError(f"{op}: op {reduction!r} is not supported; only 'sum'")


class ReduceScatterPlan(PullPlan):
    """reduce_scatter of one shape and dtype along one dim: one pull that sums."""

    op = "reduce_scatter"
    dtypes = FLOAT_DTYPES

    @classmethod
    def key(cls, x: torch.Tensor, dim: int = 0, op: str = "sum", *, zero_copy: bool | None = None) -> tuple:
        check_sum(cls.op, op)
        return (*tensor_key(x, zero_copy), dim)

    @classmethod
    def check(cls, x: torch.Tensor, dim: int = 0, op: str = "sum", *, zero_copy: bool | None = None) -> str:
        cls.check_input(x)
        if x.dim() == 0:
            raise PKError(f"{cls.op}: needs at least one dimension to scatter")
        d = normalize_dim(cls.op, dim, x.dim())
        world = context().local_world_size
        if x.shape[d] % world:
            raise PKError(f"{cls.op}: size {x.shape[d]} of dim {d} does not divide by the world size {world}")
        return f"reduce_scatter of {tuple(x.shape)} {x.dtype} along dim {d}, zero_copy={tensor_key(x, zero_copy)[2]}"

    def __init__(self, x: torch.Tensor, dim: int = 0, op: str = "sum", *, zero_copy: bool | None = None):
        world = context().local_world_size
        dim %= x.dim()
        out_shape = _scattered_shape(tuple(x.shape), dim)
        copy = None
        if math.prod(out_shape):
            outer, inner = math.prod(out_shape[:dim]), math.prod(out_shape[dim:])
            rows, cols, src_strides, dst_strides = collapse((outer, inner), (world * inner, 1), (inner, 1))
            copy = Copy(rows, cols, src_strides, dst_strides, src_me=inner, reduce=True)
        super().__init__(x, zero_copy, out_shape, copy, f"dim={dim}")

    @staticmethod
    def fake(x: torch.Tensor, dim: int, op: str) -> torch.Tensor:
        return x.new_empty(_scattered_shape(tuple(x.shape), dim % x.dim()))


_reduce_scatter = declare(ReduceScatterPlan, "(Tensor x, int dim, str op) -> Tensor")


@_reduce_scatter.public
def reduce_scatter(x: torch.Tensor, dim: int = 0, op: str = "sum", *, out: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Sum `x` over the node's ranks and keep this rank's slice along `dim` (size along `dim` divided by W).

    Collective. float32, float16, bfloat16; accumulation in fp32. `dim`'s size must divide by the world size.
    """
    return _reduce_scatter(x, dim, op, out=out)

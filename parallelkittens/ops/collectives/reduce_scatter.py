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
from ...runtime.memory import owner_of
from .. import plan as plans
from ._pull import FLOAT_DTYPES, Copy, PullPlan, check_input, collapse, normalize_dim


def reference_reduce_scatter(inputs: list[torch.Tensor], rank: int, dim: int = 0) -> torch.Tensor:
    """Rank `rank`'s result from every rank's input, summed in float64."""
    total = sum(x.double() for x in inputs)
    return total.chunk(len(inputs), dim=dim)[rank]


def _build(shape: tuple[int, ...], dtype: torch.dtype, dim: int, zero_copy: bool) -> PullPlan:
    world = context().local_world_size
    out_shape = list(shape)
    out_shape[dim] //= world
    copy = None
    if math.prod(out_shape):
        outer, inner = math.prod(out_shape[:dim]), math.prod(out_shape[dim:])
        rows, cols, src_strides, dst_strides = collapse((outer, inner), (world * inner, 1), (inner, 1))
        copy = Copy(rows, cols, src_strides, dst_strides, src_me=inner, reduce=True)
    return PullPlan("reduce_scatter", shape, dtype, tuple(out_shape), copy, zero_copy, f"dim={dim}")


def plan(x: torch.Tensor, dim: int = 0, op: str = "sum", *, zero_copy: bool | None = None) -> PullPlan:
    """The plan for reduce_scatter of tensors like `x` along `dim` (collective the first time: `ops/plan.py`)."""
    if op != "sum":
        raise PKError(f"reduce_scatter: op {op!r} is not supported; only 'sum'")
    if zero_copy is None:
        zero_copy = isinstance(x, torch.Tensor) and owner_of(x) is not None
    key = ("reduce_scatter", getattr(x, "shape", None), getattr(x, "dtype", None), dim, zero_copy)
    found = plans.find(key)
    if found is not None:
        return found

    def check() -> str:
        name = "reduce_scatter"
        check_input(name, x, FLOAT_DTYPES)
        if x.dim() == 0:
            raise PKError(f"{name}: needs at least one dimension to scatter")
        d = normalize_dim(name, dim, x.dim())
        world = context().local_world_size
        if x.shape[d] % world:
            raise PKError(f"{name}: size {x.shape[d]} of dim {d} does not divide by the world size {world}")
        return f"reduce_scatter of {tuple(x.shape)} {x.dtype} along dim {d}, zero_copy={zero_copy}"

    return plans.get(key, lambda: _build(tuple(x.shape), x.dtype, dim % x.dim(), zero_copy), check)


def reduce_scatter(x: torch.Tensor, dim: int = 0, op: str = "sum", *, out: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Sum `x` over the node's ranks and keep this rank's slice along `dim` (size along `dim` divided by W).

    Collective. float32, float16, bfloat16; accumulation in fp32. `dim`'s size must divide by the world size.
    """
    return plan(x, dim, op)(x, out=out)


plans.attach(reduce_scatter, plan)

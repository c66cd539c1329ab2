"""all_to_all: split along `scatter_dim` into W chunks, send chunk j to rank j, and concatenate what arrives
along `gather_dim`.

The paper's generic form: with (B, N/W, H, D) inputs, ``all_to_all(x, scatter_dim=2, gather_dim=1)`` gives
Ulysses' (B, N, H/W, D) directly: each rank pulls chunk `me` of every peer's input into position r of the
output through strided addressing, so there is no reshape or copy before or after. See
`ops/collectives/_pull.py`.
"""

from __future__ import annotations

import math

import torch

from ...runtime.context import context
from ...runtime.errors import PKError
from ...runtime.memory import owner_of
from .. import plan as plans
from ._pull import MOVE_DTYPES, Copy, PullPlan, check_input, collapse, normalize_dim


def reference_all_to_all(inputs: list[torch.Tensor], rank: int, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Rank `rank`'s result from every rank's input, in plain PyTorch."""
    world = len(inputs)
    return torch.cat([x.chunk(world, dim=scatter_dim)[rank] for x in inputs], dim=gather_dim)


def _contiguous_strides(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.insert(0, step)
        step *= n
    return strides


def _build(shape: tuple[int, ...], dtype: torch.dtype, sd: int, gd: int, zero_copy: bool) -> PullPlan:
    world = context().local_world_size
    chunk = list(shape)
    chunk[sd] //= world
    out_shape = list(chunk)
    out_shape[gd] *= world
    copy = None
    if math.prod(out_shape):
        x_strides, out_strides = _contiguous_strides(list(shape)), _contiguous_strides(out_shape)
        rows, cols, src_strides, dst_strides = collapse(tuple(chunk), tuple(x_strides), tuple(out_strides))
        copy = Copy(rows, cols, src_strides, dst_strides, src_me=chunk[sd] * x_strides[sd],
                    dst_r=chunk[gd] * out_strides[gd])
    return PullPlan("all_to_all", shape, dtype, tuple(out_shape), copy, zero_copy, f"scatter_dim={sd}",
                    f"gather_dim={gd}")


def plan(x: torch.Tensor, scatter_dim: int, gather_dim: int, *, zero_copy: bool | None = None) -> PullPlan:
    """The plan for all_to_all of tensors like `x` (collective the first time: see `ops/plan.py`)."""
    if zero_copy is None:
        zero_copy = isinstance(x, torch.Tensor) and owner_of(x) is not None
    key = ("all_to_all", getattr(x, "shape", None), getattr(x, "dtype", None), scatter_dim, gather_dim, zero_copy)
    found = plans.find(key)
    if found is not None:
        return found

    def check() -> str:
        op = "all_to_all"
        check_input(op, x, MOVE_DTYPES)
        if x.dim() == 0:
            raise PKError(f"{op}: needs at least one dimension")
        sd, gd = normalize_dim(op, scatter_dim, x.dim()), normalize_dim(op, gather_dim, x.dim())
        world = context().local_world_size
        if x.shape[sd] % world:
            raise PKError(f"{op}: size {x.shape[sd]} of scatter_dim {sd} does not divide by the world size {world}")
        return f"all_to_all of {tuple(x.shape)} {x.dtype}, scatter_dim={sd}, gather_dim={gd}, zero_copy={zero_copy}"

    return plans.get(key, lambda: _build(tuple(x.shape), x.dtype, scatter_dim % x.dim(), gather_dim % x.dim(),
                                         zero_copy), check)


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, *, out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Exchange chunks of `x` among the node's ranks; returns a new tensor (or fills `out`) whose `scatter_dim`
    is W times smaller and whose `gather_dim` is W times larger (the same shape when the two are equal).

    Collective. Any dtype that moves without arithmetic; `scatter_dim`'s size must divide by the world size.
    """
    return plan(x, scatter_dim, gather_dim)(x, out=out)


plans.attach(all_to_all, plan)

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
from ..plan import declare
from ._pull import Copy, PullPlan, collapse, normalize_dim, tensor_key


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


def _exchanged_shape(shape: tuple[int, ...], sd: int, gd: int) -> tuple[list[int], list[int]]:
    """(each chunk's shape, the output's shape)."""
    world = context().local_world_size
    chunk = list(shape)
    chunk[sd] //= world
    out_shape = list(chunk)
    out_shape[gd] *= world
    return chunk, out_shape


class AllToAllPlan(PullPlan):
    """all_to_all of one shape and dtype between two dims: one pull."""

    op = "all_to_all"

    @classmethod
    def key(cls, x: torch.Tensor, scatter_dim: int, gather_dim: int, *, zero_copy: bool | None = None) -> tuple:
        return (*tensor_key(x, zero_copy), scatter_dim, gather_dim)

    @classmethod
    def check(cls, x: torch.Tensor, scatter_dim: int, gather_dim: int, *, zero_copy: bool | None = None) -> str:
        cls.check_input(x)
        if x.dim() == 0:
            raise PKError(f"{cls.op}: needs at least one dimension")
        sd, gd = normalize_dim(cls.op, scatter_dim, x.dim()), normalize_dim(cls.op, gather_dim, x.dim())
        world = context().local_world_size
        if x.shape[sd] % world:
            raise PKError(f"{cls.op}: size {x.shape[sd]} of scatter_dim {sd} does not divide by the world size {world}")
        return (f"all_to_all of {tuple(x.shape)} {x.dtype}, scatter_dim={sd}, gather_dim={gd}, "
                f"zero_copy={tensor_key(x, zero_copy)[2]}")

    def __init__(self, x: torch.Tensor, scatter_dim: int, gather_dim: int, *, zero_copy: bool | None = None):
        shape = tuple(x.shape)
        sd, gd = scatter_dim % x.dim(), gather_dim % x.dim()
        chunk, out_shape = _exchanged_shape(shape, sd, gd)
        copy = None
        if math.prod(out_shape):
            x_strides, out_strides = _contiguous_strides(list(shape)), _contiguous_strides(out_shape)
            rows, cols, src_strides, dst_strides = collapse(tuple(chunk), tuple(x_strides), tuple(out_strides))
            copy = Copy(rows, cols, src_strides, dst_strides, src_me=chunk[sd] * x_strides[sd],
                        dst_r=chunk[gd] * out_strides[gd])
        super().__init__(x, zero_copy, tuple(out_shape), copy, f"scatter_dim={sd}", f"gather_dim={gd}")

    @staticmethod
    def fake(x: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        return x.new_empty(_exchanged_shape(tuple(x.shape), scatter_dim % x.dim(), gather_dim % x.dim())[1])


_all_to_all = declare(AllToAllPlan, "(Tensor x, int scatter_dim, int gather_dim) -> Tensor")


@_all_to_all.public
def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, *, out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Exchange chunks of `x` among the node's ranks; returns a new tensor (or fills `out`) whose `scatter_dim`
    is W times smaller and whose `gather_dim` is W times larger (the same shape when the two are equal).

    Collective. Any dtype that moves without arithmetic; `scatter_dim`'s size must divide by the world size.
    """
    return _all_to_all(x, scatter_dim, gather_dim, out=out)

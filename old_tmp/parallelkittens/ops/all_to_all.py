"""all_to_all: split along `scatter_dim` into W chunks, send chunk j to rank j, and concatenate what arrives
along `gather_dim`.

The paper's generic form: with (B, N/W, H, D) inputs, ``all_to_all(x, scatter_dim=2, gather_dim=1)`` gives
Ulysses' (B, N, H/W, D) directly: each rank pulls chunk `me` of every peer's input into position r of the
output through strided addressing, so there is no reshape or copy before or after. See `ops/_collective.py`.
"""

from __future__ import annotations

import torch

from ..runtime.context import context
from ..runtime.errors import PKError
from ..runtime.memory import owner_of
from ._collective import MOVE_DTYPES, Copy, agree, check_input, collapse, normalize_dim, signature, workspace


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


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Exchange chunks of `x` among the node's ranks; returns a new tensor whose `scatter_dim` is W times
    smaller and whose `gather_dim` is W times larger (the same shape when the two are equal).

    Collective. Any dtype that moves without arithmetic; `scatter_dim`'s size must divide by the world size.
    """
    op = "all_to_all"
    check_input(op, x, MOVE_DTYPES)
    if x.dim() == 0:
        raise PKError(f"{op}: needs at least one dimension")
    sd, gd = normalize_dim(op, scatter_dim, x.dim()), normalize_dim(op, gather_dim, x.dim())
    world = context().local_world_size
    if x.shape[sd] % world:
        raise PKError(f"{op}: size {x.shape[sd]} of scatter_dim {sd} does not divide by the world size {world}")
    owner = owner_of(x)  # the parallel tensor x belongs to, if any: read in place
    sig = signature(op, tuple(x.shape), str(x.dtype), f"scatter_dim={sd}", f"gather_dim={gd}",
                    f"zero_copy={owner is not None}")
    agree(op, sig)
    chunk = list(x.shape)
    chunk[sd] //= world
    out_shape = list(chunk)
    out_shape[gd] *= world
    out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x_strides, out_strides = _contiguous_strides(list(x.shape)), _contiguous_strides(out_shape)
    rows, cols, src_strides, dst_strides = collapse(tuple(chunk), tuple(x_strides), tuple(out_strides))
    ws = workspace(op)
    src, handle = ws.source(x, owner)
    copy = Copy(rows, cols, src_strides, dst_strides, src_me=chunk[sd] * x_strides[sd],
                dst_r=chunk[gd] * out_strides[gd])
    ws.pull(src, handle, out, copy, sig)
    return out

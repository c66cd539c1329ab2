"""all_gather: every rank ends with the concatenation of every rank's tensor along `dim`.

Schedule: each rank's input is in symmetric memory (its parallel tensor, or staged once into the op's
workspace); after one signal per program, every rank pulls each peer's tensor straight into its place in the
output (a strided copy, so gathering along any dim needs no reshape or copy afterwards). See
`ops/_collective.py` for the protocol.
"""

from __future__ import annotations

import math

import torch

from ..runtime.context import context
from ..runtime.memory import owner_of
from ._collective import MOVE_DTYPES, Copy, agree, check_input, collapse, normalize_dim, signature, workspace


def reference_all_gather(shards: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """The result from every rank's tensor, in plain PyTorch."""
    return torch.cat(shards, dim=dim)


def all_gather(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Gather `x` from every rank of the node along `dim`; returns a new tensor, size along `dim` times W.

    Collective: every rank calls it with the same shape, dtype and dim. Any dtype that moves without
    arithmetic (float32/16, bfloat16, fp8, ints). Pass a parallel tensor's `.local` to skip the staging copy.
    """
    op = "all_gather"
    check_input(op, x, MOVE_DTYPES)
    dim = normalize_dim(op, dim, max(x.dim(), 1))
    world = context().local_world_size
    owner = owner_of(x)  # the parallel tensor x belongs to, if any: read in place
    sig = signature(op, tuple(x.shape), str(x.dtype), f"dim={dim}", f"zero_copy={owner is not None}")
    agree(op, sig)
    shape = list(x.shape) or [1]
    out = torch.empty(shape[:dim] + [shape[dim] * world] + shape[dim + 1:], dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    outer, inner = math.prod(shape[:dim]), math.prod(shape[dim:])
    rows, cols, src_strides, dst_strides = collapse((outer, inner), (inner, 1), (world * inner, 1))
    ws = workspace(op)
    src, handle = ws.source(x, owner)
    ws.pull(src, handle, out, Copy(rows, cols, src_strides, dst_strides, dst_r=inner), sig)
    return out if x.dim() else out.view(world)

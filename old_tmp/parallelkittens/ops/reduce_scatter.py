"""reduce_scatter: rank r ends with the r-th of W equal slices (along `dim`) of the sum over ranks.

Schedule: inputs in symmetric memory; after one signal per program, every rank pulls its slice from every
peer and sums in fp32 in rank order (the paper's reduce, built from peer reads since NVLink multicast is off).
See `ops/_collective.py` for the protocol.
"""

from __future__ import annotations

import math

import torch

from ..runtime.context import context
from ..runtime.errors import PKError
from ..runtime.memory import owner_of
from ._collective import FLOAT_DTYPES, Copy, agree, check_input, collapse, normalize_dim, signature, workspace


def reference_reduce_scatter(inputs: list[torch.Tensor], rank: int, dim: int = 0) -> torch.Tensor:
    """Rank `rank`'s result from every rank's input, summed in float64."""
    total = sum(x.double() for x in inputs)
    return total.chunk(len(inputs), dim=dim)[rank]


def reduce_scatter(x: torch.Tensor, dim: int = 0, op: str = "sum") -> torch.Tensor:
    """Sum `x` over the node's ranks and keep this rank's slice along `dim` (size along `dim` divided by W).

    Collective. float32, float16, bfloat16; accumulation in fp32. `dim`'s size must divide by the world size.
    """
    name = "reduce_scatter"
    if op != "sum":
        raise PKError(f"{name}: op {op!r} is not supported; only 'sum'")
    check_input(name, x, FLOAT_DTYPES)
    if x.dim() == 0:
        raise PKError(f"{name}: needs at least one dimension to scatter")
    dim = normalize_dim(name, dim, x.dim())
    world = context().local_world_size
    if x.shape[dim] % world:
        raise PKError(f"{name}: size {x.shape[dim]} of dim {dim} does not divide by the world size {world}")
    owner = owner_of(x)  # the parallel tensor x belongs to, if any: read in place
    sig = signature(name, tuple(x.shape), str(x.dtype), f"dim={dim}", f"zero_copy={owner is not None}")
    agree(name, sig)
    shape = list(x.shape)
    shape[dim] //= world
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    outer, inner = math.prod(shape[:dim]), math.prod(shape[dim:])
    rows, cols, src_strides, dst_strides = collapse((outer, inner), (world * inner, 1), (inner, 1))
    ws = workspace(name)
    src, handle = ws.source(x, owner)
    ws.pull(src, handle, out, Copy(rows, cols, src_strides, dst_strides, src_me=inner, reduce=True), sig)
    return out

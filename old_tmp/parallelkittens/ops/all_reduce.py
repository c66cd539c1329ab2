"""all_reduce: every rank ends with the sum over ranks.

Two algorithms, chosen by size, the same on every rank (the size is part of the call's signature):

* one-shot (up to PK_ONE_SHOT_BYTES, default 256 KiB): every rank pulls every peer's whole tensor and sums
  it (W - 1 reads of the full size per rank, one protocol round): lowest latency.
* two-shot (larger): reduce-scatter, each rank summing its 1/W slice from every peer into a symmetric
  buffer, then all-gather of those slices (2 (W - 1) / W of the size read per rank): bandwidth-optimal.

Sums run in fp32 in rank order, so every rank gets the same bits. The paper's version reduces inside the NVLink
switch (multimem); that stays off on our machines, so reductions are built from peer reads.
"""

from __future__ import annotations

import os

import torch

from ..runtime.context import context
from ..runtime.errors import PKError
from ..runtime.memory import ParallelTensor, owner_of
from ._collective import FLOAT_DTYPES, Copy, agree, check_input, signature, workspace

ALIGN = 16  # two-shot slices start on 16-element boundaries, so loads stay 16 bytes wide


def reference_all_reduce(inputs: list[torch.Tensor]) -> torch.Tensor:
    """The sum over every rank's input, in float64."""
    return sum(x.double() for x in inputs)


def one_shot_limit() -> int:
    """Largest size (bytes) reduced in one shot."""
    return int(os.environ.get("PK_ONE_SHOT_BYTES", 256 * 1024))


def algorithm(nbytes: int, world: int) -> str:
    """'one_shot' or 'two_shot' for a tensor of `nbytes` on `world` ranks."""
    return "one_shot" if world == 1 or nbytes <= one_shot_limit() else "two_shot"


def all_reduce(x: torch.Tensor | ParallelTensor, op: str = "sum") -> torch.Tensor:
    """Sum `x` over the node's ranks. A torch tensor gives a new tensor; a `ParallelTensor` is reduced in place
    (its `.local` is returned) with no staging copy.

    Collective. float32, float16, bfloat16; accumulation in fp32; any size and world size.
    """
    name = "all_reduce"
    if op != "sum":
        raise PKError(f"{name}: op {op!r} is not supported; only 'sum'")
    in_place = isinstance(x, ParallelTensor)
    local = x.local if in_place else x
    check_input(name, local, FLOAT_DTYPES)
    world = context().local_world_size
    n = local.numel()
    algo = algorithm(n * local.element_size(), world)
    owner = owner_of(local)  # the parallel tensor local belongs to, if any: read in place
    sig = signature(name, tuple(local.shape), str(local.dtype), algo, f"zero_copy={owner is not None}")
    agree(name, sig)
    if n == 0:
        return local if in_place else torch.empty_like(local)
    ws = workspace(name)
    src, handle = ws.source(local, owner)
    flat = src.view(-1)
    if algo == "one_shot":
        out = torch.empty_like(local)
        ws.pull(flat, handle, out.view(-1), Copy((1, 1, 1), n, (0, 0, 0), (0, 0, 0), reduce=True), sig)
        if in_place:  # peers read `local` until the kernel's end: write it only afterwards
            local.copy_(out)
            return local
        return out
    part = -(-n // world // ALIGN) * ALIGN  # this rank's slice of the sum, padded for alignment
    reduced = ws.staging(world * part * local.element_size(), slot=1)
    slices = reduced.local[: world * part * local.element_size()].view(local.dtype)
    # 1) reduce-scatter: my slice of every peer's input, summed, into my part of the symmetric buffer
    ws.pull(flat, handle, slices, Copy((1, 1, 1), part, (0, 0, 0), (0, 0, 0), src_me=part, dst_me=part,
                                       reduce=True, limit=n), sig)
    # 2) all-gather: every rank's slice into place (peers finished reading `local` in step 1)
    out = local if in_place else torch.empty_like(local)
    ws.pull(slices, reduced.handle, out.view(-1), Copy((1, 1, 1), part, (0, 0, 0), (0, 0, 0), src_r=part,
                                                       dst_r=part, limit=n), sig)
    return out

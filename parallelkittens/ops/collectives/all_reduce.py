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

import math

import torch

from ...runtime.context import context
from ...runtime.errors import PKError
from ...runtime.heap import heap
from ...runtime.memory import ParallelTensor, owner_of
from ...template.meeting import meeting, signature
from .. import plan as plans
from ._pull import FLOAT_DTYPES, Copy, Pull, Staging, check_call, check_input, check_out, source

ALIGN = 16  # two-shot slices start on 16-element boundaries, so loads stay 16 bytes wide


def reference_all_reduce(inputs: list[torch.Tensor]) -> torch.Tensor:
    """The sum over every rank's input, in float64."""
    return sum(x.double() for x in inputs)


def algorithm(nbytes: int, world: int) -> str:
    """'one_shot' or 'two_shot' for a tensor of `nbytes` on `world` ranks."""
    return "one_shot" if world == 1 or nbytes <= context().settings.one_shot_bytes else "two_shot"


class AllReducePlan:
    """all_reduce of one shape and dtype: the algorithm, its pull kernel, and its staging and reduced buffers.
    Every call is one launch."""

    op = "all_reduce"

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, zero_copy: bool):
        ctx = context()
        world = ctx.local_world_size
        self.shape, self.dtype, self.device, self.zero_copy = shape, dtype, ctx.device, zero_copy
        n = math.prod(shape)
        self.algorithm = algorithm(n * dtype.itemsize, world)
        sig = signature(self.op, shape, str(dtype), self.algorithm, f"zero_copy={zero_copy}")
        self._any_handle = meeting().handle  # at one rank the kernel reads only its own input, wherever it is
        self._staging = Staging(shape, dtype) if world > 1 and not zero_copy and n else None
        self._pull = self._in_place = None
        if n == 0:
            return
        if self.algorithm == "one_shot":
            copy = Copy((1, 1, 1), n, (0, 0, 0), (0, 0, 0), reduce=True)
            self._pull = Pull(copy, dtype, sig, staging=self._staging)
            if zero_copy and world > 1:  # out=x: peers read x until the end, so the sums wait in `mid`
                self._in_place = Pull(copy, dtype, sig, in_place=True, mid=torch.empty(n, dtype=dtype,
                                                                                       device=self.device))
            return
        part = -(-n // world // ALIGN) * ALIGN  # this rank's slice of the sum, padded for alignment
        reduced = heap().pool("collectives.reduced", world * part * dtype.itemsize)
        # the reduce-scatter (my slice of every rank's input, summed into my part of `mid`), then the all-gather of
        # the parts; in place needs nothing more: each program writes only what it alone reads, after the round
        copy = Copy((1, 1, 1), part, (0, 0, 0), (0, 0, 0), src_me=part, dst_me=part, reduce=True, limit=n)
        self._pull = Pull(copy, dtype, sig, staging=self._staging, two_shot=True, mid=reduced.view(world * part, dtype),
                          mid_handle=reduced.handle)

    def __call__(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The sum of `x` over ranks, into `out` (a new tensor by default; `out` may be `x` itself)."""
        try:
            check_call(self.op, x, self.shape, self.dtype, self.device)
            if out is None:
                out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            elif out is not x:
                check_out(self.op, out, self.shape, self.dtype)
            if self._pull is None:
                return out
            src, handle = source(self.op, x, (self.shape, self.dtype), self.zero_copy, self._staging, self._any_handle)
        except PKError as e:
            plans.refuse(int(self._pull is not None), e)
        pull = self._in_place if out is x and self._in_place is not None else self._pull
        pull(x, src, handle, out)
        return out


def plan(x: torch.Tensor, op: str = "sum", *, zero_copy: bool | None = None) -> AllReducePlan:
    """The plan for all_reduce of tensors like `x` (collective the first time: see `ops/plan.py`).
    `zero_copy` (default: whether `x` is a parallel tensor's local buffer) reads peers' inputs in place."""
    if op != "sum":
        raise PKError(f"all_reduce: op {op!r} is not supported; only 'sum'")
    if zero_copy is None:
        zero_copy = owner_of(x) is not None if isinstance(x, torch.Tensor) else False
    key = ("all_reduce", getattr(x, "shape", None), getattr(x, "dtype", None), zero_copy)
    found = plans.find(key)
    if found is not None:
        return found

    def check() -> str:
        check_input("all_reduce", x, FLOAT_DTYPES)
        return f"all_reduce of {tuple(x.shape)} {x.dtype}, zero_copy={zero_copy}"

    return plans.get(key, lambda: AllReducePlan(tuple(x.shape), x.dtype, zero_copy), check)


def all_reduce(x: torch.Tensor | ParallelTensor, op: str = "sum", *, out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Sum `x` over the node's ranks. A torch tensor gives a new tensor (or fills `out`); a `ParallelTensor` is
    reduced in place (its `.local` is returned) with no staging copy.

    Collective. float32, float16, bfloat16; accumulation in fp32; any size and world size.
    """
    if isinstance(x, ParallelTensor):
        return plan(x.local, op, zero_copy=True)(x.local, out=x.local)
    return plan(x, op)(x, out=out)


plans.attach(all_reduce, plan)

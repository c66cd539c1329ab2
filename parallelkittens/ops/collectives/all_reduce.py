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
from ...runtime.memory import ParallelTensor
from ..plan import FLOAT_DTYPES, check_out, declare, refuse
from ._pull import CollectivePlan, Copy, Pull, tensor_key
from .reduce_scatter import check_sum

ALIGN = 16  # two-shot slices start on 16-element boundaries, so loads stay 16 bytes wide


def reference_all_reduce(inputs: list[torch.Tensor]) -> torch.Tensor:
    """The sum over every rank's input, in float64."""
    return sum(x.double() for x in inputs)


def algorithm(nbytes: int, world: int) -> str:
    """'one_shot' or 'two_shot' for a tensor of `nbytes` on `world` ranks."""
    return "one_shot" if world == 1 or nbytes <= context().settings.one_shot_bytes else "two_shot"


class AllReducePlan(CollectivePlan):
    """all_reduce of one shape and dtype: the algorithm, its pull kernel, and its staging and reduced buffers.
    Every call is one launch."""

    op = "all_reduce"
    dtypes = FLOAT_DTYPES

    @classmethod
    def key(cls, x: torch.Tensor, op: str = "sum", *, zero_copy: bool | None = None) -> tuple:
        if op != "sum":
            check_sum(cls.op, op)
        return tensor_key(x, zero_copy)

    @classmethod
    def check(cls, x: torch.Tensor, op: str = "sum", *, zero_copy: bool | None = None) -> str:
        cls.check_input(x)
        return f"all_reduce of {tuple(x.shape)} {x.dtype}, zero_copy={tensor_key(x, zero_copy)[2]}"

    def __init__(self, x: torch.Tensor, op: str = "sum", *, zero_copy: bool | None = None):
        super().__init__(x, zero_copy)
        world, dtype = context().local_world_size, x.dtype
        n = math.prod(self.shape)
        self.algorithm = algorithm(n * dtype.itemsize, world)
        sig = self.signature(self.algorithm)
        self._pull = self._in_place = None
        if n == 0:
            return
        if self.algorithm == "one_shot":
            copy = Copy((1, 1, 1), n, (0, 0, 0), (0, 0, 0), reduce=True)
            self._pull = Pull(copy, dtype, sig, staging=self._staging)
            if self.zero_copy and world > 1:  # out=x: peers read x until the end, so the sums wait in `mid`
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
        meetings = self.check_x(x)
        try:
            if out is None:
                out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            elif out is not x:
                check_out(self.op, out, self.shape, self.dtype)
            if self._pull is None:
                return out
            src, handle = self.source(x)
        except PKError as e:
            refuse(meetings, e)
        pull = self._in_place if out is x and self._in_place is not None else self._pull
        pull(x, src, handle, out)
        return out

    @staticmethod
    def fake(x: torch.Tensor, op: str) -> torch.Tensor:
        return torch.empty_like(x)


_all_reduce = declare(AllReducePlan, "(Tensor x, str op) -> Tensor")


@_all_reduce.public
def all_reduce(x: torch.Tensor | ParallelTensor, op: str = "sum", *, out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Sum `x` over the node's ranks. A torch tensor gives a new tensor (or fills `out`); a `ParallelTensor` is
    reduced in place (its `.local` is returned) with no staging copy.

    Collective. float32, float16, bfloat16; accumulation in fp32; any size and world size.
    """
    if isinstance(x, ParallelTensor):
        return all_reduce.plan(x.local, op, zero_copy=True)(x.local, out=x.local)
    return _all_reduce(x, op, out=out)

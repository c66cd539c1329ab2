"""Worked example of the LCSC template: ``scaled_all_gather(x, alpha)`` = all_gather(alpha * x) along rows.

Each rank holds x, (M, N). Compute workers take one (BM, BN) tile of x per task: the loader reads it, the
consumer scales it, the storer writes it into this rank's row block of the output and signals a local
per-tile flag. Communicators take the same tiles as communication tasks: each waits for its tile's flag,
pushes the tile into every peer's output and bumps that peer's arrival counter. The last program of the rank
to finish waits until all (W - 1) * tiles pushes from peers have arrived and resets the counter, so the next
call can reuse every buffer. The multi-GPU part is the storer's signal, the communicator and the finisher,
about a dozen lines on top of a single-GPU scale kernel; the meeting (`template/meeting.py`) orders calls and
checks that the ranks agree. See docs/template.md for a walk through it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import language as pkl
from ..runtime.context import context
from ..runtime.errors import PKError
from ..runtime.heap import heap
from ..runtime.launch import Launcher
from ..runtime.memory import ParallelTensor, empty
from ..runtime.sizes import cdiv
from . import meeting
from .lcsc import grid, lcsc


def reference_scaled_all_gather(shards: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """The plain PyTorch result from every rank's shard, in float64."""
    return torch.cat([alpha * s.double() for s in shards], dim=0)


class Buffers(NamedTuple):
    """What a plan fixes: the output and the flags (parallel tensors) and the sizes."""

    out_ptr: object
    out_handle: object
    flags_ptr: object  # [tasks) per-tile ready flags, then the arrival counter
    flags_handle: object
    M: object
    N: object
    num_tasks: object


class Args(NamedTuple):
    """The roles' run-time values: the call's input and scale, the plan's `Buffers` and the meeting."""

    x_ptr: object
    alpha: object
    S: object
    call: object


class Tiles(NamedTuple):
    BM: tl.constexpr
    BN: tl.constexpr


@triton.jit
def _tile(G, C, task):
    tiles_n = tl.cdiv(G.S.N, C.BN)
    offs_m = (task // tiles_n) * C.BM + tl.arange(0, C.BM)
    offs_n = (task % tiles_n) * C.BN + tl.arange(0, C.BN)
    return offs_m, offs_n, (offs_m[:, None] < G.S.M) & (offs_n[None, :] < G.S.N)


@triton.jit
def _out_ptrs(G, C, task):
    offs_m, offs_n, mask = _tile(G, C, task)
    rows = G.call.rank * G.S.M + offs_m  # this rank's row block of the gathered output
    return G.S.out_ptr + rows[:, None] * G.S.N + offs_n[None, :], mask


@triton.jit
def _loader(G, C, task, k):
    offs_m, offs_n, mask = _tile(G, C, task)
    return tl.load(G.x_ptr + offs_m[:, None] * G.S.N + offs_n[None, :], mask=mask)


@triton.jit
def _consumer(G, C, task, loader):
    tile = loader(G, C, task, 0)
    return (tile.to(tl.float32) * G.alpha).to(tile.dtype)


@triton.jit
def _storer(G, C, task, tile):
    ptrs, mask = _out_ptrs(G, C, task)
    tl.store(ptrs, tile, mask=mask)
    pkl.signal(G.S.flags_ptr + task, G.S.flags_handle, G.call.rank)  # tile ready for this rank's communicators


@triton.jit
def _communicator(G, C, task):
    pkl.wait(G.S.flags_ptr + task, 1, G.S.flags_handle)
    tl.store(G.S.flags_ptr + task, 0)  # reset for the next call: only this rank's storer signals it
    ptrs, mask = _out_ptrs(G, C, task)
    tile = tl.load(ptrs, mask=mask)
    for i in range(1, G.call.world):
        peer = (G.call.rank + i) % G.call.world  # start at different peers so ranks do not all hit one link
        pkl.store(ptrs, tile, G.S.out_handle, peer, mask)
        pkl.signal(G.S.flags_ptr + G.S.num_tasks, G.S.flags_handle, peer)  # the arrival counter follows the flags


@triton.jit
def _finisher(G, C):
    arrived = G.S.flags_ptr + G.S.num_tasks
    pkl.wait(arrived, (G.call.world - 1) * G.S.num_tasks, G.S.flags_handle)  # every peer's tiles are in my output
    tl.store(arrived, 0)


@triton.jit(do_not_specialize=["num_comm"])
def _scaled_all_gather_kernel(x_ptr, alpha, S, num_comm, meet, C):
    call = meeting.begin(meet)
    lcsc(Args(x_ptr, alpha, S, call), C, S.num_tasks, S.num_tasks, num_comm, _loader, _consumer, _storer,
         _communicator, call, _finisher)


class ScaledAllGather:
    """A plan in miniature: what is collective and allocating (the output, the flags, the compiled launch) is made
    once for a shape and dtype; a call only checks its input and launches."""

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype, *, num_comm_programs: int = 1,
                 block: tuple[int, int] = (32, 64)):
        ctx = context()
        self.M, self.N = shape
        self.dtype = dtype
        world = ctx.local_world_size
        num_tasks = cdiv(self.M, block[0]) * cdiv(self.N, block[1])
        if world > 1 and num_comm_programs < 1:
            raise PKError(f"ScaledAllGather needs at least one communicator program with {world} ranks")
        num_comm = num_comm_programs if world > 1 else 0
        self.out: ParallelTensor = empty((world * self.M, self.N), dtype, name="scaled_all_gather.out")
        flags = heap().allocate(4 * (num_tasks + 1), "scaled_all_gather.flags")
        sig = meeting.signature("scaled_all_gather", shape, str(dtype), num_comm, block)
        buffers = Buffers(self.out.local, self.out.handle, flags.view(num_tasks + 1, torch.int32), flags.handle, self.M,
                          self.N, num_tasks)
        self._launch = Launcher(_scaled_all_gather_kernel, grid(num_tasks, num_comm), per_call=("x_ptr", "alpha"),
                                S=buffers, num_comm=num_comm, meet=meeting.meeting().group(sig), C=Tiles(*block))

    def __call__(self, x: torch.Tensor, alpha: float) -> torch.Tensor:
        """all_gather(alpha * x) along dim 0; returns this rank's output buffer (valid until the next call)."""
        if x.shape != (self.M, self.N) or x.dtype != self.dtype or x.device != self.out.device:
            meeting.meeting().refuse(1)  # the peers' kernels meet this rank's refusal instead of waiting for it
            raise PKError(f"expected a {self.dtype} tensor of shape {(self.M, self.N)} on {self.out.device}, got "
                          f"{x.dtype} {tuple(x.shape)} on {x.device}")
        self._launch(x.contiguous(), float(alpha))
        return self.out.local

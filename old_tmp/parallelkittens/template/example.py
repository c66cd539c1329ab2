"""Worked example of the LCSC template: ``scaled_all_gather(x, alpha)`` = all_gather(alpha * x) along rows.

Each rank holds x, (M, N). Compute workers take one (BM, BN) tile of x per task: the loader reads it, the
consumer scales it, the storer writes it into this rank's row block of the output and signals a local
per-tile flag. Communicators take the same tiles as communication tasks: each waits for its tile's flag,
pushes the tile into every peer's output and bumps that peer's arrival counter. A one-program kernel then
waits until all (W - 1) * tiles pushes from peers have arrived, resets the counter and passes a barrier, so
the next call can reuse every buffer. The multi-GPU part is the storer's signal and the communicator, about a
dozen lines on top of a single-GPU scale kernel. See docs/template.md for a walk through it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import language as pkl
from ..runtime.context import context
from ..runtime.errors import PKError
from ..runtime.memory import ParallelTensor, empty, zeros
from ..runtime.sizes import cdiv
from .lcsc import grid, lcsc


def reference_scaled_all_gather(shards: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """The plain PyTorch result from every rank's shard, in float64."""
    return torch.cat([alpha * s.double() for s in shards], dim=0)


@triton.jit
def _tile(G, C, task):
    M, N = G[6], G[7]
    tiles_n = tl.cdiv(N, C[1])  # C = (BM, BN)
    offs_m = (task // tiles_n) * C[0] + tl.arange(0, C[0])
    offs_n = (task % tiles_n) * C[1] + tl.arange(0, C[1])
    return offs_m, offs_n, (offs_m[:, None] < M) & (offs_n[None, :] < N)


@triton.jit
def _out_ptrs(G, C, task):
    out_ptr, h, M, N = G[1], G[2], G[6], G[7]
    offs_m, offs_n, mask = _tile(G, C, task)
    rows = pkl.rank(h) * M + offs_m  # this rank's row block of the gathered output
    return out_ptr + rows[:, None] * N + offs_n[None, :], mask


@triton.jit
def _loader(G, C, task, k):
    x_ptr, N = G[0], G[7]
    offs_m, offs_n, mask = _tile(G, C, task)
    return tl.load(x_ptr + offs_m[:, None] * N + offs_n[None, :], mask=mask)


@triton.jit
def _consumer(G, C, task, loader):
    tile = loader(G, C, task, 0)
    return (tile.to(tl.float32) * G[5]).to(tile.dtype)


@triton.jit
def _storer(G, C, task, tile):
    flags_ptr, hc = G[3], G[4]
    ptrs, mask = _out_ptrs(G, C, task)
    tl.store(ptrs, tile, mask=mask)
    pkl.signal(flags_ptr + task, hc, pkl.rank(hc))  # tile ready for this rank's communicators


@triton.jit
def _communicator(G, C, task):
    h, flags_ptr, hc, num_tasks = G[2], G[3], G[4], G[8]
    me = pkl.rank(h)
    pkl.wait(flags_ptr + task, 1, hc)
    tl.store(flags_ptr + task, 0)  # reset for the next call: only this rank's storer signals it
    ptrs, mask = _out_ptrs(G, C, task)
    tile = tl.load(ptrs, mask=mask)
    for i in range(1, pkl.world_size(h)):
        peer = (me + i) % pkl.world_size(h)  # start at different peers so ranks do not all hit one link
        pkl.store(ptrs, tile, h, peer, mask)
        pkl.signal(flags_ptr + num_tasks, hc, peer)  # the arrival counter follows the per-tile flags


@triton.jit(do_not_specialize=["num_comm"])
def _scaled_all_gather_kernel(x_ptr, out_ptr, h, counters_ptr, hc, alpha, M, N, num_tasks,
                              num_comm, BM: tl.constexpr, BN: tl.constexpr):
    G = (x_ptr, out_ptr, h, counters_ptr, hc, alpha, M, N, num_tasks)
    lcsc(G, (BM, BN), num_tasks, num_tasks, num_comm, _loader, _consumer, _storer, _communicator)


@triton.jit
def _finish_kernel(counters_ptr, hc, num_tasks, expected):
    arrived_ptr = counters_ptr + num_tasks
    pkl.wait(arrived_ptr, expected, hc)
    tl.store(arrived_ptr, 0)
    pkl.barrier_all(arrived_ptr + 1, hc)


class ScaledAllGather:
    """Set-up (collective, allocating) apart from the call (allocation-free): the output and counters are
    parallel tensors made once for a shape and dtype."""

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype, *, num_comm_programs: int = 1,
                 block: tuple[int, int] = (32, 64)):
        ctx = context()
        self.M, self.N = shape
        self.dtype = dtype
        self.block = block
        self.world = ctx.local_world_size
        self.num_tasks = cdiv(self.M, block[0]) * cdiv(self.N, block[1])
        if self.world > 1 and num_comm_programs < 1:
            raise PKError(f"ScaledAllGather needs at least one communicator program with {self.world} ranks")
        self.num_comm = num_comm_programs if self.world > 1 else 0
        self.out: ParallelTensor = empty((self.world * self.M, self.N), dtype, name="scaled_all_gather.out")
        # counters: [0, tasks) per-tile ready flags, then the arrival counter, then the barrier
        self.counters = zeros(self.num_tasks + 2, torch.int32, name="scaled_all_gather.counters")
        self.grid = grid(self.num_tasks, self.num_comm)

    def __call__(self, x: torch.Tensor, alpha: float) -> torch.Tensor:
        """all_gather(alpha * x) along dim 0; returns this rank's output buffer (valid until the next call)."""
        if x.shape != (self.M, self.N) or x.dtype != self.dtype or x.device != self.out.device:
            raise PKError(f"expected a {self.dtype} tensor of shape {(self.M, self.N)} on {self.out.device}, got "
                          f"{x.dtype} {tuple(x.shape)} on {x.device}")
        x = x.contiguous()
        c = self.counters
        _scaled_all_gather_kernel[self.grid](
            x, self.out.local, self.out.handle, c.local, c.handle, alpha, self.M, self.N, self.num_tasks,
            num_comm=self.num_comm, BM=self.block[0], BN=self.block[1])
        _finish_kernel[(1,)](c.local, c.handle, self.num_tasks, (self.world - 1) * self.num_tasks)
        return self.out.local

"""The one kernel under expert parallelism: a grouped GEMM over the rows of this rank's experts, run in one of two
directions (LCSC, inter-SM overlap).

* **dispatch** (``PULL``): communicator programs pull the tokens routed to this rank's experts, one copy per
  (token, this rank), from the source ranks' parallel token buffers into a local receive buffer, one block of
  rows at a time, and count each block in as it lands (per-block arrival counters). A compute program takes a
  tile of one expert's rows, waits for the blocks its rows sit in, gathers them by index, multiplies by the
  expert's weight and stores the tile locally (optionally scaled per row).
* **combine** (not ``PULL``): the A rows are local (one expert's rows of the activations); the epilogue stores
  each output row straight into the slot (token, k) it came from on its source rank (a peer store).

Row tiles never straddle experts: the layout gives each tile its expert and row range (`ops/moe/layout.py`), so
one tile reads one expert's weight. B is read through strides, so a transposed weight (the backward) costs no
copy. The kernel opens with the meeting; the last program of each rank zeroes the arrival counters and meets the
other ranks at a barrier, so that no rank's kernel ends while a peer still reads its tokens or writes its slots:
after the kernel, the slots are complete and the token buffer may be refilled.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ... import language as pkl
from ...runtime.context import context, use_triton_allocator
from ...runtime.device import num_sms
from ...runtime.heap import heap
from ...runtime.sizes import cdiv, next_power_of_2
from ...template import grid, lcsc, meeting


class Args(NamedTuple):
    a_ptr: object  # PULL: the receive buffer (rows, K); else the expert rows (rows, K)
    tokens_ptr: object  # PULL: this rank's parallel token buffer (Tmax, K)
    tokens_handle: object
    pull_src: object  # PULL: per received row, its source rank and token
    pull_tok: object
    pulled: object  # PULL: how many rows arrive (a device int32)
    arrived_ptr: object  # PULL: one counter per block of received rows
    arrived_handle: object
    b_ptr: object  # (experts, K, N) through strides
    stride_be: object
    stride_bk: object
    stride_bn: object
    num_experts: object  # experts in b (its first dimension)
    out_ptr: object  # PULL: expert rows (rows, N); else the slots (Tmax * k, N) of a parallel tensor
    out_handle: object
    row_index: object  # PULL: per expert row, its received row; else its slot on the source rank
    row_src: object  # per expert row, its source rank
    row_scale: object  # per expert row (fp32), when SCALE
    tile_expert: object  # per row tile: expert, first row, end row
    tile_start: object
    tile_end: object
    K: object
    N: object
    num_blocks: object  # PULL: blocks of received rows (0: nothing to pull, A is already here)
    done_ptr: object  # the finisher's barrier counter
    call: object


class Tiles(NamedTuple):
    BM: tl.constexpr
    BN: tl.constexpr
    BK: tl.constexpr
    BR: tl.constexpr  # received rows per block
    BK_COPY: tl.constexpr
    PULL: tl.constexpr
    SCALE: tl.constexpr
    TMA_B: tl.constexpr  # B through a tensor descriptor (b contiguous, K a multiple of BK), else pointer loads


@triton.jit
def _consumer(G, C, task, loader):
    tiles_n = tl.cdiv(G.N, C.BN)
    tile, pid_n = task // tiles_n, task % tiles_n
    expert = tl.load(G.tile_expert + tile)
    start, end = tl.load(G.tile_start + tile), tl.load(G.tile_end + tile)
    rows = start + tl.arange(0, C.BM)
    valid = rows < end
    if C.PULL:
        a_rows = tl.load(G.row_index + rows, mask=valid, other=0).to(tl.int64)
        if (G.num_blocks > 0) & meeting.verdict(G.call):  # the ranks agree (else nothing is pulled)
            first = tl.min(tl.where(valid, a_rows, 1 << 40)) // C.BR
            last = tl.max(tl.where(valid, a_rows, -1)) // C.BR
            for block in range(first, last + 1):
                pkl.wait(G.arrived_ptr + block, 1, G.arrived_handle)
    else:
        a_rows = rows.to(tl.int64)
    cols = pid_n * C.BN + tl.arange(0, C.BN)
    b_base = G.b_ptr + expert.to(tl.int64) * G.stride_be + cols[None, :] * G.stride_bn
    if C.TMA_B:  # the experts' weights as one (E*K, N) matrix; an expert's rows start at expert*K
        b_desc = tl.make_tensor_descriptor(G.b_ptr, [G.num_experts * G.K, G.N], [G.stride_bk, 1], [C.BK, C.BN])
    acc = tl.zeros([C.BM, C.BN], tl.float32)
    for k0 in range(0, G.K, C.BK):
        ks = k0 + tl.arange(0, C.BK)
        a = tl.load(G.a_ptr + a_rows[:, None] * G.K + ks[None, :], mask=valid[:, None] & (ks < G.K)[None, :],
                    other=0.0)
        if C.TMA_B:
            b = b_desc.load([expert * G.K + k0, pid_n * C.BN])
        else:
            b = tl.load(b_base + ks[:, None] * G.stride_bk, mask=(ks < G.K)[:, None] & (cols < G.N)[None, :],
                        other=0.0)
        acc = tl.dot(a, b, acc)
    if C.SCALE:
        acc = acc * tl.load(G.row_scale + rows, mask=valid, other=0.0)[:, None]
    return acc, rows, valid, cols


@triton.jit
def _storer(G, C, task, result):
    acc, rows, valid, cols = result
    mask = valid[:, None] & (cols < G.N)[None, :]
    tile = acc.to(G.out_ptr.dtype.element_ty)
    if C.PULL:
        tl.store(G.out_ptr + rows.to(tl.int64)[:, None] * G.N + cols[None, :], tile, mask=mask)
    else:  # each row back to its token's slot on its source rank
        slot = tl.load(G.row_index + rows, mask=valid, other=0).to(tl.int64)
        src = tl.load(G.row_src + rows, mask=valid, other=-1)
        ptrs = G.out_ptr + slot[:, None] * G.N + cols[None, :]
        for peer in range(G.call.world):
            pkl.store(ptrs, tile, G.out_handle, peer, mask & (src == peer)[:, None])


@triton.jit
def _communicator(G, C, task):
    """Pull received-row block `task` from the source ranks' token buffers, then count it in."""
    rows = task * C.BR + tl.arange(0, C.BR)
    valid = rows < tl.load(G.pulled)
    src = tl.load(G.pull_src + rows, mask=valid, other=-1)
    tok = tl.load(G.pull_tok + rows, mask=valid, other=0).to(tl.int64)
    for k0 in range(0, G.K, C.BK_COPY):
        cols = k0 + tl.arange(0, C.BK_COPY)
        inside = valid[:, None] & (cols < G.K)[None, :]
        ptrs = G.tokens_ptr + tok[:, None] * G.K + cols[None, :]
        tile = tl.zeros([C.BR, C.BK_COPY], G.tokens_ptr.dtype.element_ty)
        for peer in range(G.call.world):
            theirs = (src == peer)[:, None]
            tile = tl.where(theirs, pkl.load(ptrs, G.tokens_handle, peer, inside & theirs, 0.0), tile)
        tl.store(G.a_ptr + rows.to(tl.int64)[:, None] * G.K + cols[None, :], tile, mask=inside)
    pkl.arrive(G.arrived_ptr + task)


@triton.jit
def _finisher(G, C):
    """Every program of this rank is done: zero the arrival counters, then meet every rank, so that no kernel
    ends while a peer still reads this rank's tokens or writes its slots."""
    if C.PULL:
        for start in range(0, G.num_blocks, 1024):
            offs = start + tl.arange(0, 1024)
            tl.store(G.arrived_ptr + offs, 0, mask=offs < G.num_blocks)
    pkl.barrier_all(G.done_ptr, G.arrived_handle)


@triton.jit(do_not_specialize=["num_tasks", "num_comm_tasks", "num_comm", "rank", "num_blocks"])
def _moe_kernel(a_ptr, tokens_ptr, tokens_handle, pull_src, pull_tok, pulled, arrived_ptr, arrived_handle, b_ptr,
                stride_be, stride_bk, stride_bn, num_experts, out_ptr, out_handle, row_index, row_src, row_scale,
                tile_expert, tile_start, tile_end, K, N, num_blocks, done_ptr, num_tasks, num_comm_tasks, num_comm,
                meet_counters, meet_slots, meet_handle, sig, rank, world, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, BR: tl.constexpr, BK_COPY: tl.constexpr, PULL: tl.constexpr, SCALE: tl.constexpr,
                TMA_B: tl.constexpr):
    call = meeting.begin(meet_counters, meet_slots, meet_handle, sig, rank, world)
    G = Args(a_ptr, tokens_ptr, tokens_handle, pull_src, pull_tok, pulled, arrived_ptr, arrived_handle, b_ptr,
             stride_be, stride_bk, stride_bn, num_experts, out_ptr, out_handle, row_index, row_src, row_scale,
             tile_expert, tile_start, tile_end, K, N, num_blocks, done_ptr, call)
    lcsc(G, Tiles(BM, BN, BK, BR, BK_COPY, PULL, SCALE, TMA_B), num_tasks, num_comm_tasks, num_comm, None, _consumer,
         _storer, _communicator, call, _finisher)


class GroupedGemm:
    """What one direction of the kernel needs for one set of sizes (built once, in a plan): block sizes, the
    arrival counters (and the barrier counter after them) on the heap, the meeting's signature (with `plan`: what
    else of the calling plan the ranks must share, its buffers' sizes)."""

    def __init__(self, op: str, pull: bool, K: int, N: int, max_pulled: int, dtype: torch.dtype,
                 block_rows: int, num_comm: int, plan: tuple = ()):
        ctx = context()
        self.pull, self.K, self.N, self.dtype = pull, K, N, dtype
        self.world = ctx.local_world_size
        on_gpu = ctx.device.type == "cuda"
        self.BM = block_rows
        # GPU defaults from scripts/tune_moe.py on an H100 (2026-12-06): BN 256, BK 64, 3 stages, 8 warps was best on
        # both DeepSeek-V3 (K 7168, N 2048) and Mixtral (K 4096, N 14336) up-projections
        self.BN = min(256 if on_gpu else 32, max(16, next_power_of_2(N)))
        self.BK = min(64 if on_gpu else 32, max(16, next_power_of_2(K)))
        self.BR = 64 if on_gpu else 16
        self.BK_COPY = min(128 if on_gpu else 32, next_power_of_2(K))
        self.num_comm = num_comm if (pull and self.world > 1) else 0
        self.max_blocks = max_blocks = cdiv(max_pulled, self.BR)  # arrival counters: one per block of pulled rows
        counters = heap().allocate(4 * (max_blocks + 1), f"{op}.arrived")  # the barrier's, then one per block
        every = counters.view(max_blocks + 1, torch.int32)
        self.done, self.arrived, self.arrived_handle = every[:1], every[1:], counters.handle
        self.sig = meeting.signature(op, pull, K, N, str(dtype), block_rows, max_blocks, *plan)
        self.num_warps = 8 if on_gpu else 4
        self.num_stages = 3
        self.tma_b = False  # B through a tensor descriptor where it is contiguous: within 1% either way (tune_moe.py)
        # Two programs per SM (run one after the other: shared memory holds one) balance the tiles' waves better on
        # narrow outputs (N 2048: 0.91x torch._grouped_mm against 0.88x) and worse on wide ones (N 14336: 0.73x
        # against 0.79x); measured on those two shapes only.
        self.programs_per_sm = 2 if on_gpu and N <= 4096 else 1

    def __call__(self, *, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, out_handle, row_index: torch.Tensor,
                 row_src: torch.Tensor, tile_expert: torch.Tensor, tile_start: torch.Tensor, tile_end: torch.Tensor,
                 num_row_tiles: int, row_scale: torch.Tensor | None = None, tokens: torch.Tensor | None = None,
                 tokens_handle=None, pull_src: torch.Tensor | None = None, pull_tok: torch.Tensor | None = None,
                 pulled: torch.Tensor | None = None, num_blocks: int = 0) -> None:
        """One launch. `b` is (experts, K, N) with any strides. Collective (the meeting, the finisher's barrier)."""
        tiles = num_row_tiles * cdiv(self.N, self.BN)
        comm = self.num_comm if num_blocks else 0
        dummy = row_index
        use_triton_allocator()  # a backward runs in autograd's own thread
        _moe_kernel[grid(tiles, comm, self.programs_per_sm * num_sms())](
            a, tokens if tokens is not None else a, tokens_handle if tokens_handle is not None else self.arrived_handle,
            pull_src if pull_src is not None else dummy, pull_tok if pull_tok is not None else dummy,
            pulled if pulled is not None else dummy, self.arrived, self.arrived_handle, b, b.stride(0), b.stride(1),
            b.stride(2), b.shape[0], out, out_handle if out_handle is not None else self.arrived_handle, row_index,
            row_src, row_scale if row_scale is not None else out, tile_expert, tile_start, tile_end, self.K, self.N,
            num_blocks, self.done, tiles, num_blocks if comm else 0, comm, BM=self.BM, BN=self.BN, BK=self.BK,
            BR=self.BR, BK_COPY=self.BK_COPY, PULL=self.pull, SCALE=row_scale is not None,
            TMA_B=self._tma_fits(b), num_warps=self.num_warps,
            num_stages=self.num_stages, **meeting.meeting().args(self.sig))

    def _tma_fits(self, b: torch.Tensor) -> bool:
        """Whether `b` can be read through a tensor descriptor: asked for, contiguous (a transposed weight, as in
        the backward, is not), K a multiple of BK (no tile reads into the next expert) and 16-byte aligned."""
        return (self.tma_b and b.stride(2) == 1 and b.stride(0) == self.K * b.stride(1) and self.K % self.BK == 0
                and (b.stride(1) * b.element_size()) % 16 == 0 and b.data_ptr() % 16 == 0)

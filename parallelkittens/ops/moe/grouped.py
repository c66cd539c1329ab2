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
from ...runtime.context import context
from ...runtime.device import num_sms
from ...runtime.heap import heap
from ...runtime.launch import Launcher
from ...runtime.sizes import cdiv, next_power_of_2
from ...template import grid, lcsc, meeting


class Layout(NamedTuple):
    """A call's routing tables (`ops/moe/layout.py`), which the kernel reads per row and per tile."""

    row_index: object  # PULL: per expert row, its received row; else its slot on the source rank
    row_src: object  # per expert row, its source rank
    row_scale: object  # per expert row (fp32), when SCALE
    tile_expert: object  # per row tile: expert, first row, end row
    tile_start: object
    tile_end: object
    pull_src: object  # PULL: per received row, its source rank and token
    pull_tok: object
    pulled: object  # PULL: how many rows arrive (a device int32)


class Buffers(NamedTuple):
    """What a plan fixes: the token buffer and the arrival counters (parallel tensors), where the output's peers
    are (combine), and the GEMM's sizes."""

    tokens_ptr: object  # PULL: this rank's parallel token buffer (Tmax, K)
    tokens_handle: object
    arrived_ptr: object  # PULL: one counter per block of received rows
    arrived_handle: object
    done_ptr: object  # the finisher's barrier counter
    out_handle: object  # combine: the slots' parallel tensor (Tmax * k, N)
    K: object
    N: object


class Args(NamedTuple):
    """The roles' run-time values."""

    a_ptr: object  # PULL: the receive buffer (rows, K); else the expert rows (rows, K)
    b_ptr: object  # (experts, K, N) through strides
    out_ptr: object  # PULL: expert rows (rows, N); else the slots of a parallel tensor
    L: object
    stride_be: object
    stride_bk: object
    stride_bn: object
    num_blocks: object  # PULL: blocks of received rows (0: nothing to pull, A is already here)
    S: object
    call: object


class Tiles(NamedTuple):
    BM: tl.constexpr
    BN: tl.constexpr
    BK: tl.constexpr
    BR: tl.constexpr  # received rows per block
    BK_COPY: tl.constexpr
    PULL: tl.constexpr
    SCALE: tl.constexpr


@triton.jit
def _consumer(G, C, task, loader):
    tiles_n = tl.cdiv(G.S.N, C.BN)
    tile, pid_n = task // tiles_n, task % tiles_n
    expert = tl.load(G.L.tile_expert + tile)
    start, end = tl.load(G.L.tile_start + tile), tl.load(G.L.tile_end + tile)
    rows = start + tl.arange(0, C.BM)
    valid = rows < end
    if C.PULL:
        a_rows = tl.load(G.L.row_index + rows, mask=valid, other=0).to(tl.int64)
        if (G.num_blocks > 0) & meeting.verdict(G.call):  # the ranks agree (else nothing is pulled)
            first = tl.min(tl.where(valid, a_rows, 1 << 40)) // C.BR
            last = tl.max(tl.where(valid, a_rows, -1)) // C.BR
            for block in range(first, last + 1):
                pkl.wait(G.S.arrived_ptr + block, 1, G.S.arrived_handle)
    else:
        a_rows = rows.to(tl.int64)
    cols = pid_n * C.BN + tl.arange(0, C.BN)
    b_base = G.b_ptr + expert.to(tl.int64) * G.stride_be + cols[None, :] * G.stride_bn
    acc = tl.zeros([C.BM, C.BN], tl.float32)
    for k0 in range(0, G.S.K, C.BK):
        ks = k0 + tl.arange(0, C.BK)
        a = tl.load(G.a_ptr + a_rows[:, None] * G.S.K + ks[None, :], mask=valid[:, None] & (ks < G.S.K)[None, :],
                    other=0.0)
        b = tl.load(b_base + ks[:, None] * G.stride_bk, mask=(ks < G.S.K)[:, None] & (cols < G.S.N)[None, :],
                    other=0.0)
        acc = tl.dot(a, b, acc)
    if C.SCALE:
        acc = acc * tl.load(G.L.row_scale + rows, mask=valid, other=0.0)[:, None]
    return acc, rows, valid, cols


@triton.jit
def _storer(G, C, task, result):
    acc, rows, valid, cols = result
    mask = valid[:, None] & (cols < G.S.N)[None, :]
    tile = acc.to(G.out_ptr.dtype.element_ty)
    if C.PULL:
        tl.store(G.out_ptr + rows.to(tl.int64)[:, None] * G.S.N + cols[None, :], tile, mask=mask)
    else:  # each row back to its token's slot on its source rank
        slot = tl.load(G.L.row_index + rows, mask=valid, other=0).to(tl.int64)
        src = tl.load(G.L.row_src + rows, mask=valid, other=-1)
        ptrs = G.out_ptr + slot[:, None] * G.S.N + cols[None, :]
        for peer in range(G.call.world):
            pkl.store(ptrs, tile, G.S.out_handle, peer, mask & (src == peer)[:, None])


@triton.jit
def _communicator(G, C, task):
    """Pull received-row block `task` from the source ranks' token buffers, then count it in."""
    rows = task * C.BR + tl.arange(0, C.BR)
    valid = rows < tl.load(G.L.pulled)
    src = tl.load(G.L.pull_src + rows, mask=valid, other=-1)
    tok = tl.load(G.L.pull_tok + rows, mask=valid, other=0).to(tl.int64)
    for k0 in range(0, G.S.K, C.BK_COPY):
        cols = k0 + tl.arange(0, C.BK_COPY)
        inside = valid[:, None] & (cols < G.S.K)[None, :]
        ptrs = G.S.tokens_ptr + tok[:, None] * G.S.K + cols[None, :]
        tile = tl.zeros([C.BR, C.BK_COPY], G.S.tokens_ptr.dtype.element_ty)
        for peer in range(G.call.world):
            theirs = (src == peer)[:, None]
            tile = tl.where(theirs, pkl.load(ptrs, G.S.tokens_handle, peer, inside & theirs, 0.0), tile)
        tl.store(G.a_ptr + rows.to(tl.int64)[:, None] * G.S.K + cols[None, :], tile, mask=inside)
    pkl.arrive(G.S.arrived_ptr + task)


@triton.jit
def _finisher(G, C):
    """Every program of this rank is done: zero the arrival counters, then meet every rank, so that no kernel
    ends while a peer still reads this rank's tokens or writes its slots."""
    if C.PULL:
        for start in range(0, G.num_blocks, 1024):
            offs = start + tl.arange(0, 1024)
            tl.store(G.S.arrived_ptr + offs, 0, mask=offs < G.num_blocks)
    pkl.barrier_all(G.S.done_ptr, G.S.arrived_handle)


# every per-call integer: a forward and a backward pass B with other strides, and layouts other counts
@triton.jit(do_not_specialize=["stride_be", "stride_bk", "stride_bn", "num_blocks", "num_tasks", "num_comm_tasks",
                               "num_comm"])
def _moe_kernel(a_ptr, b_ptr, out_ptr, L, stride_be, stride_bk, stride_bn, num_blocks, num_tasks, num_comm_tasks,
                num_comm, S, meet, C):
    call = meeting.begin(meet)
    G = Args(a_ptr, b_ptr, out_ptr, L, stride_be, stride_bk, stride_bn, num_blocks, S, call)
    lcsc(G, C, num_tasks, num_comm_tasks, num_comm, None, _consumer, _storer, _communicator, call, _finisher)


class GroupedGemm:
    """What one direction of the kernel needs for one set of sizes (built once, in a plan): block sizes, the
    arrival counters (and the barrier counter after them) on the heap, the meeting's signature (with `plan`: what
    else of the calling plan the ranks must share, its buffers' sizes) and the bound kernel, scaled or not.
    `tokens` and `out_handle`: the dispatch's token buffer, the combine's slots (parallel tensors). `tiles` (BN, BK,
    stages, warps, programs per SM) overrides the defaults (scripts/tune_moe.py)."""

    def __init__(self, op: str, pull: bool, K: int, N: int, max_pulled: int, dtype: torch.dtype,
                 block_rows: int, num_comm: int, plan: tuple = (), tokens: torch.Tensor | None = None,
                 tokens_handle: torch.Tensor | None = None, out_handle: torch.Tensor | None = None,
                 tiles: tuple[int, int, int, int, int] | None = None):
        ctx = context()
        self.pull, self.K, self.N, self.dtype = pull, K, N, dtype
        self.world = ctx.local_world_size
        on_gpu = ctx.device.type == "cuda"
        self.BM = block_rows
        # BN 256, BK 64, 3 stages, 8 warps: the best of scripts/tune_moe.py on both DeepSeek-V3 (K 7168, N 2048) and
        # Mixtral (K 4096, N 14336) up-projections
        self.BN = min(256 if on_gpu else 32, max(16, next_power_of_2(N)))
        self.BK = min(64 if on_gpu else 32, max(16, next_power_of_2(K)))
        self.BR = 64 if on_gpu else 16
        self.BK_COPY = min(128 if on_gpu else 32, next_power_of_2(K))
        self.num_comm = num_comm if (pull and self.world > 1) else 0
        self.max_blocks = max_blocks = cdiv(max_pulled, self.BR)  # arrival counters: one per block of pulled rows
        counters = heap().allocate(4 * (max_blocks + 1), f"{op}.arrived")  # the barrier's, then one per block
        every = counters.view(max_blocks + 1, torch.int32)
        sig = meeting.signature(op, pull, K, N, str(dtype), block_rows, max_blocks, *plan)
        # Two programs per SM (run one after the other: shared memory holds one) balance the tiles' waves better on
        # narrow outputs and worse on wide ones (N 14336)
        self.programs_per_sm = 2 if on_gpu and N <= 4096 else 1
        stages, warps = 3, 8 if on_gpu else 4
        if tiles is not None:
            self.BN, self.BK, stages, warps, self.programs_per_sm = tiles
        if tokens is None:  # nothing to pull from: a placeholder of the tokens' dtype
            tokens = torch.empty(1, dtype=dtype, device=ctx.device)
        buffers = Buffers(tokens, counters.handle if tokens_handle is None else
                          tokens_handle, every[1:], counters.handle, every[:1], counters.handle if out_handle is None
                          else out_handle, K, N)
        per_call = ("a_ptr", "b_ptr", "out_ptr", "L", "stride_be", "stride_bk", "stride_bn", "num_blocks",
                    "num_tasks", "num_comm_tasks", "num_comm")
        self._launch = {scale: Launcher(
            _moe_kernel, (1,), per_call, S=buffers, meet=meeting.meeting().group(sig),
            C=Tiles(self.BM, self.BN, self.BK, self.BR, self.BK_COPY, pull, scale), num_warps=warps,
            num_stages=stages) for scale in (False, True)}

    def __call__(self, *, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, row_index: torch.Tensor,
                 row_src: torch.Tensor, tile_expert: torch.Tensor, tile_start: torch.Tensor, tile_end: torch.Tensor,
                 num_row_tiles: int, row_scale: torch.Tensor | None = None, pull_src: torch.Tensor | None = None,
                 pull_tok: torch.Tensor | None = None, pulled: torch.Tensor | None = None, num_blocks: int = 0) -> None:
        """One launch. `b` is (experts, K, N) with any strides. Collective (the meeting, the finisher's barrier)."""
        tiles = num_row_tiles * cdiv(self.N, self.BN)
        comm = self.num_comm if num_blocks else 0
        dummy = row_index
        layout = Layout(row_index, row_src, row_scale if row_scale is not None else out, tile_expert, tile_start,
                        tile_end, pull_src if pull_src is not None else dummy,
                        pull_tok if pull_tok is not None else dummy, pulled if pulled is not None else dummy)
        launch = self._launch[row_scale is not None]
        launch(a, b, out, layout, b.stride(0), b.stride(1), b.stride(2), num_blocks, tiles, num_blocks if comm else 0,
               comm, grid=grid(tiles, comm, self.programs_per_sm * num_sms()))


@triton.jit
def _weighted_sum_kernel(slots_ptr, weights_ptr, kept_ptr, out_ptr, T, H, TOP_K: tl.constexpr, BT: tl.constexpr,
                         BH: tl.constexpr, WEIGHTED: tl.constexpr):
    tokens = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    inside = (tokens < T)[:, None] & (cols < H)[None, :]
    acc = tl.zeros([BT, BH], tl.float32)
    for j in tl.static_range(TOP_K):  # slot order 0 .. k-1: the same sum every run
        pair = tokens.to(tl.int64) * TOP_K + j
        keep = tl.load(kept_ptr + pair, mask=tokens < T, other=0) != 0
        row = tl.load(slots_ptr + pair[:, None] * H + cols[None, :], mask=inside & keep[:, None], other=0.0)
        row = row.to(tl.float32)
        if WEIGHTED:
            row = row * tl.load(weights_ptr + pair, mask=tokens < T, other=0.0).to(tl.float32)[:, None]
        acc += tl.where(keep[:, None], row, 0.0)
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * H + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=inside)


def sum_slots(slots: torch.Tensor, kept: torch.Tensor, weights: torch.Tensor | None, dtype: torch.dtype
              ) -> torch.Tensor:
    """out[t] = sum over kept j, in order, of weights[t, j] (or 1) * slots[t, j]: (T, k, H) -> (T, H)."""
    T, k, H = slots.shape
    out = torch.empty(T, H, dtype=dtype, device=slots.device)
    if T == 0 or H == 0:
        return out
    BT, BH = 16, min(256, next_power_of_2(H))
    _weighted_sum_kernel[(cdiv(T, BT), cdiv(H, BH))](
        slots, weights.contiguous() if weights is not None else slots, kept.view(torch.uint8), out, T, H, TOP_K=k,
        BT=BT, BH=BH, WEIGHTED=weights is not None)
    return out

"""matmul_reduce_scatter: this rank's row block of sum over ranks of a @ b (the paper's GEMM+RS).

Schedule (intra-SM, no communicator, one kernel). The output rows are split into W row blocks, block r owned by
rank r, and each block is tiled on its own. A rank sweeps the blocks starting at the next rank's and ending with
its own, so that at any moment the ranks write to different owners. A tile of another rank's block is rounded to
the input dtype and stored with TMA into this rank's slot of the owner's symmetric buffer (one slot per rank),
and the owner's counter for that tile is signalled. A tile of this rank's own block comes last: its fp32 partial
stays in registers, the program waits until the W - 1 peers' shares of the tile are in, adds them in fp32 in
rank order and writes the output tile. No accumulator pass, no finish kernel; at one rank it is the plain
persistent GEMM with the output tile written once.

Each share crosses NVLink once, in the input dtype, as NCCL's bf16 reduce-scatter sends bf16 (half the bytes of
an fp32 share); the sum is fp32, in the same order at every call, so results are bitwise reproducible however
the shares' arrivals interleave. The price is memory: the buffer holds W slots of the block (M x N elements in
all, the size of the whole product). (Shares reduce-added into one slot in arrival order, tried first, rounded the
bf16 sums at each add, and at 3 ranks or more results changed in the last bits between calls.)

The kernel opens with the meeting (`template/meeting.py`), which is also what orders one call after the previous
one (no rank overwrites a share before its owner has read it). If the ranks disagree on the call,
every rank skips its shares and stores and `pk.sync()` raises `MismatchError`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ... import language as pkl
from ...runtime.context import context
from ...runtime.errors import PKError
from ...runtime.heap import heap
from ...runtime.launch import Launcher
from ...runtime.sizes import cdiv
from ...template import grid, lcsc, meeting
from ..descriptors import descriptor
from ..plan import declare
from .matmul import (
    FusedPlan,
    MatmulConfig,
    MatmulPlan,
    column_halves,
    default_config,
    gemm_describers,
    mainloop,
    tile_coords,
    tiles,
    transposed,
)


def reference_matmul_reduce_scatter(a_parts: list[torch.Tensor], b_parts: list[torch.Tensor], rank: int
                                    ) -> torch.Tensor:
    """Rank `rank`'s row block of sum_r a_r @ b_r, in float64."""
    total = sum(a.double() @ b.double() for a, b in zip(a_parts, b_parts, strict=True))
    return total.chunk(len(a_parts))[rank]


class Buffers(NamedTuple):
    """What a plan fixes: the shares' buffer and counters (symmetric memory) and the sizes."""

    buf_ptr: object  # (W * slot_rows, N): slot r holds rank r's shares of this rank's tiles
    buf_handle: object
    ctr_ptr: object  # per tile of this rank's block: shares in; owners reset them
    ctr_handle: object
    M: object
    N: object
    K: object
    m_block: object
    slot_rows: object  # m_block rounded up to whole tiles
    per_owner: object  # tiles in one rank's row block


class Args(NamedTuple):
    """The roles' run-time values: the call's operands and output, the shares' descriptor, `Buffers`, the meeting."""

    a_desc: object
    b_desc: object
    out_desc: object
    buf_desc: object
    S: object
    call: object


@triton.jit
def push_share(left, right, buf_ptr, hb, owner, me, world, counter, hc, slot_rows, N, row, col, BM: tl.constexpr,
               HALF: tl.constexpr):
    """Store this rank's share of a tile (its fp32 column halves, rounded to the buffer's dtype) into slot `me` of
    `owner`'s buffer (`world` slots of `slot_rows` rows, a multiple of BM, so a tile never spills into the next
    slot) with two TMA stores, then signal the tile's counter on `owner`."""
    dtype = buf_ptr.dtype.element_ty
    slots = pkl.peer_descriptor(buf_ptr, hb, owner, [world * slot_rows, N], [N, 1], [BM, HALF])
    slots.store([me * slot_rows + row, col], left.to(dtype))
    slots.store([me * slot_rows + row, col + HALF], right.to(dtype))
    pkl.signal(counter, hc, owner)


@triton.jit
def take_shares(left, right, buf, counter, hc, me, world, slot_rows, row, col, BM: tl.constexpr, HALF: tl.constexpr):
    """The owner's side: wait for the `world` - 1 peers' shares of the tile (`buf`: the local buffer's descriptor,
    (BM, HALF) blocks), add them to its own fp32 halves in rank order, the same order at every call, so the sum is
    bitwise reproducible, and leave the counter at zero for the next call. Returns the summed halves."""
    if world > 1:
        pkl.wait(counter, world - 1, hc)
        tl.store(counter, 0)
        for peer in range(world):
            if peer != me:
                left += buf.load([peer * slot_rows + row, col]).to(tl.float32)
                right += buf.load([peer * slot_rows + row, col + HALF]).to(tl.float32)
    return left, right


@triton.jit
def _consumer(G, C, task, loader):
    owner = (G.call.rank + 1 + task // G.S.per_owner) % G.call.world  # the next rank's block first, its own last
    pid_m, pid_n = tile_coords(task % G.S.per_owner, G.S.m_block, G.S.N, C.BM, C.BN, C.GROUP_M)
    # A's descriptor covers all of A: a tile past the end of the owner's block reads the next block's rows,
    # whose results the clipped stores below drop.
    acc = mainloop(G.a_desc, G.b_desc, owner * G.S.m_block + pid_m * C.BM, pid_n * C.BN, G.S.K, C.BM, C.BN, C.BK,
                   C.STAGES, 0, C.B_T)
    return acc, owner, pid_m * C.BM, pid_n * C.BN


@triton.jit
def _storer(G, C, task, result):
    acc, owner, row, col = result
    counter = G.S.ctr_ptr + task % G.S.per_owner
    left, right = column_halves(acc, C.BM, C.BN)
    half: tl.constexpr = C.BN // 2
    if owner != G.call.rank:
        push_share(left, right, G.S.buf_ptr, G.S.buf_handle, owner, G.call.rank, G.call.world, counter, G.S.ctr_handle,
                   G.S.slot_rows, G.S.N, row, col, C.BM, half)
    else:
        left, right = take_shares(left, right, G.buf_desc, counter, G.S.ctr_handle, G.call.rank, G.call.world,
                                  G.S.slot_rows, row, col, C.BM, half)
        G.out_desc.store([row, col], left.to(G.out_desc.dtype))
        G.out_desc.store([row, col + half], right.to(G.out_desc.dtype))


@triton.jit
def _mm_rs_kernel(a_desc, b_desc, out_desc, buf_desc, S, meet, C):
    call = meeting.begin(meet)
    lcsc(Args(a_desc, b_desc, out_desc, buf_desc, S, call), C, call.world * S.per_owner, 0, 0, None, _consumer,
         _storer, None, call)


class MatmulReduceScatterPlan(FusedPlan):
    """sum over ranks of a @ b, scattered by rows, for one shape, dtype and configuration: the shares' buffer and
    counters on the heap, descriptors and the bound kernel. A plan made for a transposed view b
    (`matmul.transposed`) reads it in place."""

    op = "matmul_reduce_scatter"

    @classmethod
    def key(cls, a: torch.Tensor, b: torch.Tensor, config: MatmulConfig | None = None) -> tuple:
        return getattr(a, "shape", None), getattr(b, "shape", None), getattr(a, "dtype", None), config, transposed(b)

    @classmethod
    def check(cls, a: torch.Tensor, b: torch.Tensor, config: MatmulConfig | None = None) -> str:
        description = cls.check_gemm(a, b, config)
        world = context().local_world_size
        if a.shape[0] % world:
            raise PKError(f"{cls.op}: M={a.shape[0]} rows do not divide by the world size {world}")
        return description

    def __init__(self, a: torch.Tensor, b: torch.Tensor, config: MatmulConfig | None = None):
        world = context().local_world_size
        self.dtype, self.b_t = a.dtype, transposed(b)
        (self.M, self.K), self.N = a.shape, b.shape[1]
        self.m_block = self.M // world
        self.out_shape = (self.m_block, self.N)
        self.remember(a=a, b=b)
        self.config = cfg = (config or default_config(a.dtype)).validate()
        if world == 1:  # nothing to exchange: the plan is the plain GEMM's, on tiles chosen for its shape
            self._alone = MatmulPlan(a, b, config, op=self.op)
            self.config = self._alone.config
            return
        sig = meeting.signature(self.op, tuple(a.shape), tuple(b.shape), str(a.dtype), cfg, self.b_t)
        if self.m_block * self.N == 0:
            return
        per_owner = cdiv(self.m_block, cfg.block_m) * cdiv(self.N, cfg.block_n)
        slot_rows = cdiv(self.m_block, cfg.block_m) * cfg.block_m
        shares = heap().pool("fused.shares", world * slot_rows * self.N * a.dtype.itemsize)
        buf = shares.view((world * slot_rows, self.N), a.dtype)
        ctr = heap().allocate(4 * per_owner, f"{self.op}.counters")
        buffers = Buffers(buf, shares.handle, ctr.view(per_owner, torch.int32), ctr.handle, self.M, self.N, self.K,
                          self.m_block, slot_rows, per_owner)
        self._launch = Launcher(
            _mm_rs_kernel, grid(world * per_owner, 0), ("a_desc", "b_desc", "out_desc"),
            gemm_describers(cfg, self.b_t, ("a_desc", "b_desc", "out_desc")),
            buf_desc=descriptor(buf, [cfg.block_m, cfg.block_n // 2]), S=buffers, meet=meeting.meeting().group(sig),
            C=tiles(cfg, self.b_t), num_warps=cfg.num_warps)

    @staticmethod
    def fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a.new_empty(a.shape[0] // context().local_world_size, b.shape[1])


_matmul_reduce_scatter = declare(MatmulReduceScatterPlan, "(Tensor a, Tensor b) -> Tensor")


@_matmul_reduce_scatter.public
def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, *, config: MatmulConfig | None = None,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over ranks of a @ b, scattered by rows: `a` is (M, K/W), `b` (K/W, N); returns (M/W, N).

    `b` may be the transposed view of a contiguous (N, K/W) matrix (``weight.t()``): it is read in place.
    Collective. bf16, fp16 or fp32 (tf32 on a GPU); fp32 accumulation in the GEMM; other ranks' shares sent in
    the input dtype (as NCCL does) and summed in fp32 in rank order: bitwise reproducible; M must divide by the
    world size; K/W and N multiples of 8 (TMA rows). At one rank it is `matmul`.
    """
    return _matmul_reduce_scatter(a, b, config, out=out)

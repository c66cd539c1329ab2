"""matmul_all_reduce: sum over ranks of a @ b on every rank (the paper's GEMM+AR, on the LCSC template).

Schedule. The output tiles (grouped order) are split into W contiguous ranges, range r owned by rank r. Compute
programs sweep all tiles starting at the next rank's range and ending with their own. A tile of another rank's
range is stored, in the input dtype, into this rank's slot of its owner's symmetric buffer (one slot per rank),
and the owner's counter for the tile is signalled. A tile of this rank's own range keeps its fp32 partial in
registers, waits for the W - 1 peers' shares, adds them in fp32 in rank order (the same order at every call:
bitwise reproducible), writes the sum to the output and to this rank's symmetric result buffer, and signals
every peer that the tile is ready. Communicator programs take the tiles this rank does not own, wait for each
to be ready and read it from its owner into the output, so moving results runs on their own SMs while the
compute programs keep the tensor cores busy.

No wait depends on a program that waits itself except through the owners, whose waits depend only on shares
that are pushed unconditionally: no cycle, so ranks time-sliced on one GPU cannot deadlock. At one rank it is
the persistent GEMM with no communicator. This is the paper's figure 18, with the NVLink-switch reduction
replaced by stores into the owner and reads from it; shares cross NVLink in the input dtype (as NCCL's do) and
are summed in fp32. The share buffer holds a slot per rank of the owner's tiles, each a (BM, BN) block:
about M x N elements in all.

The kernel opens with the meeting (`template/meeting.py`), which also orders calls (no rank overwrites a share,
or overwrites a result a peer still reads, before the previous call ended everywhere). If the ranks disagree on
the call, every rank skips its shares, stores and reads and `pk.sync()` raises `MismatchError`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ... import language as pkl
from ...runtime.context import context
from ...runtime.heap import heap
from ...runtime.launch import Launcher
from ...runtime.sizes import cdiv
from ...template import grid, lcsc, meeting
from ..descriptors import descriptor
from ..plan import declare
from ._tuning import choose
from .matmul import (
    FusedPlan,
    MatmulConfig,
    MatmulPlan,
    column_halves,
    default_config,
    gemm_describers,
    gemm_tile,
    tile_coords,
    tiles,
)
from .matmul_reduce_scatter import push_share, take_shares


def reference_matmul_all_reduce(a_parts: list[torch.Tensor], b_parts: list[torch.Tensor]) -> torch.Tensor:
    """sum_r a_r @ b_r in float64."""
    return sum(a.double() @ b.double() for a, b in zip(a_parts, b_parts, strict=True))


class Buffers(NamedTuple):
    """What a plan fixes: the shares', results' and counters' buffers (symmetric memory) and the sizes."""

    buf_ptr: object  # (W * slot_rows, BN): slot r holds rank r's shares of this rank's tiles
    buf_handle: object
    res_ptr: object  # (M, N): the sums of this rank's tiles, which peers read
    res_handle: object
    ctr_ptr: object  # per tile: shares in (reset by the owner), then result ready (reset by the reader)
    ctr_handle: object
    M: object
    N: object
    K: object
    slot_rows: object  # BM rows per tile of the longest range
    tiles: object
    num_comm_tasks: object


class Args(NamedTuple):
    """The roles' run-time values: the call's operands and output, the plan's descriptors and `Buffers`, the
    meeting."""

    a_desc: object
    b_desc: object
    out_desc: object
    buf_desc: object
    res_desc: object
    S: object
    call: object


@triton.jit
def _first_tile(rank, world, tiles):
    """Where rank `rank`'s range of tiles starts (ranges differ in length by one at most)."""
    return rank * tiles // world


@triton.jit
def _owner(tile, world, tiles):
    """The rank whose range holds `tile`: the largest r with _first_tile(r) <= tile."""
    return ((tile + 1) * world - 1) // tiles


@triton.jit
def _swept_tile(i, rank, world, tiles):
    """The i-th tile of `rank`'s sweep: from the next rank's range round to the end of its own."""
    return (i + _first_tile(rank + 1, world, tiles)) % tiles


@triton.jit
def _consumer(G, C, task, loader):
    tile = _swept_tile(task, G.call.rank, G.call.world, G.S.tiles)
    acc, pid_m, pid_n = gemm_tile(G.a_desc, G.b_desc, G.S.M, G.S.N, G.S.K, tile, C)
    return acc, tile, pid_m * C.BM, pid_n * C.BN


@triton.jit
def _storer(G, C, task, result):
    acc, tile, row, col = result
    dtype = G.out_desc.dtype
    half: tl.constexpr = C.BN // 2
    world = G.call.world
    owner = _owner(tile, world, G.S.tiles)
    left, right = column_halves(acc, C.BM, C.BN)
    # a slot holds the owner's tiles only, each a (BM, BN) block at the tile's place in the owner's range
    at = (tile - _first_tile(owner, world, G.S.tiles)) * C.BM
    if owner != G.call.rank:
        push_share(left, right, G.S.buf_ptr, G.S.buf_handle, owner, G.call.rank, world, G.S.ctr_ptr + tile,
                   G.S.ctr_handle, G.S.slot_rows, C.BN, at, 0, C.BM, half)
    else:
        left, right = take_shares(left, right, G.buf_desc, G.S.ctr_ptr + tile, G.S.ctr_handle, G.call.rank, world,
                                  G.S.slot_rows, at, 0, C.BM, half)
        if world > 1:  # the sum for the peers to read
            G.res_desc.store([row, col], left.to(dtype))
            G.res_desc.store([row, col + half], right.to(dtype))
            ready = G.S.ctr_ptr + G.S.tiles + tile
            pkl.signal_all(ready, G.S.ctr_handle)  # ready, on every rank
            tl.debug_barrier()
            tl.atomic_add(ready, -1, sem="relaxed", scope="gpu")  # except this one
        G.out_desc.store([row, col], left.to(dtype))
        G.out_desc.store([row, col + half], right.to(dtype))


@triton.jit
def _communicator(G, C, task):
    """Read the task-th tile this rank does not own from its owner, once it is ready, into the output."""
    world = G.call.world
    tile = _swept_tile(task, G.call.rank, world, G.S.tiles)  # the others' ranges, in the order their owners finish
    ready = G.S.ctr_ptr + G.S.tiles + tile
    pkl.wait(ready, 1, G.S.ctr_handle)
    tl.store(ready, 0)
    pid_m, pid_n = tile_coords(tile, G.S.M, G.S.N, C.BM, C.BN, C.GROUP_M)
    half: tl.constexpr = C.BN // 2
    src = pkl.peer_descriptor(G.S.res_ptr, G.S.res_handle, _owner(tile, world, G.S.tiles), [G.S.M, G.S.N], [G.S.N, 1],
                              [C.BM, half])
    for j in range(2):
        G.out_desc.store([pid_m * C.BM, pid_n * C.BN + j * half], src.load([pid_m * C.BM, pid_n * C.BN + j * half]))


@triton.jit(do_not_specialize=["num_comm"])  # tuning tries several counts: one binary
def _mm_ar_kernel(a_desc, b_desc, out_desc, buf_desc, res_desc, S, num_comm, meet, C):
    call = meeting.begin(meet)
    lcsc(Args(a_desc, b_desc, out_desc, buf_desc, res_desc, S, call), C, S.tiles, S.num_comm_tasks, num_comm, None,
         _consumer, _storer, _communicator, call)


class MatmulAllReducePlan(FusedPlan):
    """sum over ranks of a @ b for one shape, dtype and configuration: the shares' and results' buffers and the
    counters on the heap, the communicator count (tuned once), descriptors and the bound kernel."""

    op = "matmul_all_reduce"

    def __init__(self, a: torch.Tensor, b: torch.Tensor, num_comm_sms: int | None = None,
                 config: MatmulConfig | None = None):
        ctx = context()
        world = ctx.local_world_size
        self.dtype, self.b_t = a.dtype, False
        (self.M, self.K), self.N = a.shape, b.shape[1]
        self.out_shape = (self.M, self.N)
        self.remember(a=a, b=b)
        self.config = cfg = (config or default_config(a.dtype)).validate()
        if world == 1:  # nothing to exchange: the plan is the plain GEMM's, on tiles chosen for its shape
            self._alone = MatmulPlan(a, b.contiguous(), config, op=self.op)
            self.config = self._alone.config
            return
        sig = meeting.signature(self.op, tuple(a.shape), tuple(b.shape), str(a.dtype), num_comm_sms, cfg)
        if self.M * self.N == 0:
            return
        M, N = self.M, self.N
        num_tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
        slot_rows = cdiv(num_tiles, world) * cfg.block_m  # the longest range's tiles, stacked
        shares = heap().pool("fused.shares", world * slot_rows * cfg.block_n * a.dtype.itemsize)
        results = heap().pool("fused.scratch", M * N * a.dtype.itemsize)
        buf, res = shares.view((world * slot_rows, cfg.block_n), a.dtype), results.view((M, N), a.dtype)
        ctr = heap().allocate(8 * num_tiles, f"{self.op}.counters")
        half = [cfg.block_m, cfg.block_n // 2]
        me = ctx.local_rank
        not_mine = num_tiles - ((me + 1) * num_tiles // world - me * num_tiles // world)
        buffers = Buffers(buf, shares.handle, res, results.handle, ctr.view(2 * num_tiles, torch.int32), ctr.handle,
                          M, N, self.K, slot_rows, num_tiles, not_mine)

        def bound(num_comm: int) -> Launcher:
            return Launcher(_mm_ar_kernel, grid(num_tiles, num_comm), ("a_desc", "b_desc", "out_desc"),
                            gemm_describers(cfg, False, ("a_desc", "b_desc", "out_desc")),
                            buf_desc=descriptor(buf, half), res_desc=descriptor(res, half), S=buffers,
                            num_comm=num_comm, meet=meeting.meeting().group(sig), C=tiles(cfg),
                            num_warps=cfg.num_warps)

        a, b = self.operands(0, a, b)  # what a call passes
        outputs: list[torch.Tensor] = []  # made only if tuning runs

        def run(launch: Launcher) -> None:
            if not outputs:
                outputs.append(torch.empty(self.M, self.N, dtype=a.dtype, device=self.device))
            launch(a, b, outputs[0])

        self._launch = choose(bound, num_comm_sms, run)


_matmul_all_reduce = declare(MatmulAllReducePlan, "(Tensor a, Tensor b) -> Tensor")


@_matmul_all_reduce.public
def matmul_all_reduce(a: torch.Tensor, b: torch.Tensor, *, num_comm_sms: int | None = None,
                      config: MatmulConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """sum over ranks of a @ b: `a` is (M, K/W), `b` (K/W, N); returns the full (M, N) sum on every rank.

    Collective. bf16, fp16 or fp32 (tf32 on a GPU); fp32 accumulation in the GEMM; other ranks' shares sent in
    the input dtype (as NCCL does) and summed in fp32 in rank order: bitwise reproducible; K/W and N multiples
    of 8. `num_comm_sms` communicator programs read the results of other ranks' tiles; None picks the count by
    timing the candidates once per plan (`ops/gemm/_tuning.py`), the same on every rank. At one rank it is
    `matmul` (no communicators).
    """
    return _matmul_all_reduce(a, b, num_comm_sms, config, out=out)

"""all_gather_matmul: all_gather(a) @ b, with the gather overlapped by the GEMM (the paper's AG+GEMM).

Schedule (LCSC, inter-SM). Communicator programs push this rank's shard of A, one row chunk (BM rows of the
gathered A) per task, into every rank's symmetric copy of the gathered A, and signal that chunk's flag on
every rank. Compute programs start with this rank's own row tiles, which they read straight from the local
shard with no wait, then go round the other ranks' blocks, waiting for each row chunk's flag before its
k-loop. The last program of the rank to finish zeroes the flags for the next call. The kernel opens with the
meeting (`template/meeting.py`): no rank pushes rows before every rank's previous kernel, and so every read of
the gathered rows, has ended; if the ranks disagree on the call, nobody pushes, nobody waits for rows, no tile
is stored, and `pk.sync()` raises `MismatchError`.

Chunks are aligned to the gathered A's rows, so a chunk may hold rows of two ranks when the shard height is
not a multiple of BM: its flag then expects two signals. Pushes use the register path with masks (any shape);
a TMA variant for aligned shards is the next step for speed.
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
from ...runtime.sizes import cdiv, next_power_of_2
from ...template import grid, lcsc, meeting
from ..descriptors import descriptor
from ..plan import declare
from ._tuning import choose
from .matmul import (
    FusedPlan,
    MatmulConfig,
    MatmulPlan,
    default_config,
    gemm_describers,
    mainloop,
    store_tile,
    tile_coords,
    tiles,
    transposed,
)


def reference_all_gather_matmul(shards: list[torch.Tensor], b: torch.Tensor) -> torch.Tensor:
    """all_gather(a) @ b in float64."""
    return torch.cat([s.double() for s in shards]) @ b.double()


class Buffers(NamedTuple):
    """What a plan fixes: the gathered A and its flags (symmetric memory) and the sizes."""

    a_full_ptr: object  # the gathered A, (M, K)
    a_full_handle: object
    flags_ptr: object  # one per row chunk of the gathered A: how many ranks pushed their rows of it
    flags_handle: object
    m_local: object
    M: object
    N: object
    K: object
    num_tasks: object
    num_comm_tasks: object


class Args(NamedTuple):
    """The roles' run-time values: the call's operands, the gathered A's descriptor, the `Buffers`, the meeting."""

    a_desc: object  # this rank's shard, (m_local, K)
    a_ptr: object
    b_desc: object
    c_desc: object
    a_full_desc: object
    S: object
    call: object


@triton.jit
def _chunk_writers(chunk, m_local, M, BM):
    """How many ranks write rows of gathered row chunk `chunk` (1, or more when shards are not BM-aligned)."""
    first = (chunk * BM) // m_local
    last = (tl.minimum(chunk * BM + BM, M) - 1) // m_local
    return last - first + 1


@triton.jit
def _consumer(G, C, task, loader):
    me = G.call.rank
    tiles_m = tl.cdiv(G.S.M, C.BM)
    pid_m, pid_n = tile_coords(task, G.S.M, G.S.N, C.BM, C.BN, C.GROUP_M)
    pid_m = (pid_m + (me * G.S.m_local) // C.BM) % tiles_m  # rotate rows so that this rank's own block comes first
    row0 = pid_m * C.BM
    # rows wholly mine come straight from the local shard; others from the gathered A once their chunk is in.
    # One k-loop for both: two k-loops would each hold their own shared-memory pipeline.
    a_desc, first = G.a_full_desc, row0
    if (row0 >= me * G.S.m_local) & (tl.minimum(row0 + C.BM, G.S.M) <= (me + 1) * G.S.m_local):
        a_desc, first = G.a_desc, row0 - me * G.S.m_local
    elif meeting.verdict(G.call):  # the ranks agree (else nobody pushes rows: compute on what is there, store none)
        pkl.wait(G.S.flags_ptr + pid_m, _chunk_writers(pid_m, G.S.m_local, G.S.M, C.BM), G.S.flags_handle)
    acc = mainloop(a_desc, G.b_desc, first, pid_n * C.BN, G.S.K, C.BM, C.BN, C.BK, C.STAGES, 0, C.B_T)
    return acc, pid_m, pid_n


@triton.jit
def _storer(G, C, task, result):
    acc, pid_m, pid_n = result
    store_tile(G.c_desc, acc.to(G.c_desc.dtype), pid_m * C.BM, pid_n * C.BN, C.BM, C.BN)


@triton.jit
def _communicator(G, C, task):
    """Push this rank's rows of gathered row chunk `first_chunk + task` to every rank, then signal it."""
    me, world = G.call.rank, G.call.world
    chunk = (me * G.S.m_local) // C.BM + task
    rows = chunk * C.BM + tl.arange(0, C.BM).to(tl.int64)  # int64: rows * K may pass 2^31
    mine = (rows >= me * G.S.m_local) & (rows < (me + 1) * G.S.m_local)
    for k0 in range(0, G.S.K, C.BK_COPY):
        cols = k0 + tl.arange(0, C.BK_COPY)
        mask = mine[:, None] & (cols < G.S.K)[None, :]
        tile = tl.load(G.a_ptr + (rows - me * G.S.m_local)[:, None] * G.S.K + cols[None, :], mask=mask)
        for i in range(world):
            peer = (me + i) % world
            pkl.store(G.S.a_full_ptr + rows[:, None] * G.S.K + cols[None, :], tile, G.S.a_full_handle, peer, mask)
    for i in range(world):
        pkl.signal(G.S.flags_ptr + chunk, G.S.flags_handle, (me + i) % world)


@triton.jit
def _finisher(G, C):
    """Zero the flags for the next call: every program of this rank is done waiting on them, and no peer pushes
    the next call's rows before this rank has begun it."""
    chunks = tl.cdiv(G.S.M, C.BM)
    for start in range(0, chunks, 1024):
        offs = start + tl.arange(0, 1024)
        tl.store(G.S.flags_ptr + offs, 0, mask=offs < chunks)


@triton.jit(do_not_specialize=["num_comm"])  # tuning tries several counts: one binary
def _ag_matmul_kernel(a_desc, a_ptr, b_desc, c_desc, a_full_desc, S, num_comm, meet, C):
    call = meeting.begin(meet)
    lcsc(Args(a_desc, a_ptr, b_desc, c_desc, a_full_desc, S, call), C, S.num_tasks, S.num_comm_tasks, num_comm, None,
         _consumer, _storer, _communicator, call, _finisher)


class AllGatherMatmulPlan(FusedPlan):
    """all_gather(a) @ b for one shard shape, b shape, dtype and configuration: the gathered A's buffer and its
    flags on the heap, the communicator count (tuned once), descriptors and the bound kernel. A plan made for a
    transposed view b (`matmul.transposed`) reads it in place."""

    op = "all_gather_matmul"

    def __init__(self, a: torch.Tensor, b: torch.Tensor, num_comm_sms: int | None = None,
                 config: MatmulConfig | None = None):
        ctx = context()
        world = ctx.local_world_size
        self.dtype, self.b_t = a.dtype, transposed(b)
        (self.m_local, self.K), self.N = a.shape, b.shape[1]
        self.M = M = world * self.m_local
        self.out_shape = (M, self.N)
        self.remember(a=a, b=b)
        self.config = cfg = (config or default_config(a.dtype)).validate()
        if world == 1:  # nothing to exchange: the plan is the plain GEMM's, on tiles chosen for its shape
            self._alone = MatmulPlan(a, b, config, op=self.op)
            self.config = self._alone.config  # what runs (num_comm_sms has nothing to do here)
            return
        sig = meeting.signature(self.op, tuple(a.shape), tuple(b.shape), str(a.dtype), num_comm_sms, cfg, self.b_t)
        if M == 0 or self.N == 0:
            return
        num_chunks = cdiv(M, cfg.block_m)
        gathered = heap().pool("fused.scratch", M * self.K * a.dtype.itemsize)
        self._a_full = gathered.view((M, self.K), a.dtype)
        flags = heap().allocate(4 * num_chunks, f"{self.op}.flags")  # zeroed; the finisher re-zeroes them
        me = ctx.local_rank
        my_chunks = ((me + 1) * self.m_local - 1) // cfg.block_m - (me * self.m_local) // cfg.block_m + 1
        num_tasks = num_chunks * cdiv(self.N, cfg.block_n)
        buffers = Buffers(self._a_full, gathered.handle, flags.view(num_chunks, torch.int32), flags.handle,
                          self.m_local, M, self.N, self.K, num_tasks, my_chunks if self.m_local > 0 else 0)

        def bound(num_comm: int) -> Launcher:
            return Launcher(_ag_matmul_kernel, grid(num_tasks, num_comm), ("a_desc", "a_ptr", "b_desc", "c_desc"),
                            gemm_describers(cfg, self.b_t), a_full_desc=descriptor(self._a_full, [cfg.block_m,
                                                                                                  cfg.block_k]),
                            S=buffers, num_comm=num_comm, meet=meeting.meeting().group(sig),
                            C=tiles(cfg, self.b_t, min(64, next_power_of_2(self.K))), num_warps=cfg.num_warps)

        a, b = self.operands(0, a, b)  # what a call passes
        outputs: list[torch.Tensor] = []  # made only if tuning runs

        def run(launch: Launcher) -> None:
            if not outputs:
                outputs.append(torch.empty(self.M, self.N, dtype=a.dtype, device=self.device))
            launch(a, a, b, outputs[0])

        self._launch = choose(bound, num_comm_sms, run)

    def gathered(self, a: torch.Tensor, copy: bool = True) -> torch.Tensor:
        """The last call's gathered A (M, K): the kernel leaves every rank's rows in this rank's scratch, which
        the next fused op overwrites, so a backward that keeps it takes a copy; `copy=False` gives the scratch
        itself, to use at once. At one rank it is `a`."""
        full = a if self._launch is None or context().local_world_size == 1 else self._a_full
        return full.contiguous().clone() if copy else full

    def values(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return a, a, b, c  # the shard through its descriptor and its pointer (the communicators push it)

    @staticmethod
    def fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a.new_empty(a.shape[0] * context().local_world_size, b.shape[1])


_all_gather_matmul = declare(AllGatherMatmulPlan, "(Tensor a, Tensor b) -> Tensor")


@_all_gather_matmul.public
def all_gather_matmul(a: torch.Tensor, b: torch.Tensor, *, num_comm_sms: int | None = None,
                      config: MatmulConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """all_gather(a) @ b: `a` is this rank's (M/W, K) row shard, `b` (K, N); returns (M, N) on every rank.
    `b` may be the transposed view of a contiguous (N, K) matrix (``weight.t()``): it is read in place.

    Collective. bf16 or fp16 with fp32 accumulation; K and N multiples of 8 (TMA rows), M/W anything.
    `num_comm_sms` communicator programs push the shard; None picks the count by timing the candidates once per
    plan (`ops/gemm/_tuning.py`), the same on every rank. At one rank it is `matmul` (no communicators).
    """
    return _all_gather_matmul(a, b, num_comm_sms, config, out=out)

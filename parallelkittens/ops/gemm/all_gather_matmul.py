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
from ...runtime.errors import PKError
from ...runtime.heap import heap
from ...runtime.launch import Launcher
from ...runtime.sizes import cdiv, next_power_of_2
from ...template import grid, lcsc, meeting
from .. import plan as plans
from ._tuning import check_comm_sms, choose
from .matmul import (
    MatmulConfig,
    MatmulPlan,
    check_operands,
    default_config,
    descriptor,
    gemm_describers,
    mainloop,
    new_output,
    operands,
    store_tile,
    tile_coords,
    transposed,
)


def reference_all_gather_matmul(shards: list[torch.Tensor], b: torch.Tensor) -> torch.Tensor:
    """all_gather(a) @ b in float64."""
    return torch.cat([s.double() for s in shards]) @ b.double()


class Args(NamedTuple):
    a_desc: object  # this rank's shard, (m_local, K)
    a_ptr: object
    a_full_ptr: object  # the gathered A, (M, K), in symmetric memory
    a_full_handle: object
    a_full_desc: object
    b_desc: object
    c_desc: object
    flags_ptr: object  # one per row chunk of the gathered A: how many ranks pushed their rows of it
    flags_handle: object
    m_local: object
    M: object
    N: object
    K: object
    call: object  # the meeting


class Tiles(NamedTuple):
    BM: tl.constexpr
    BN: tl.constexpr
    BK: tl.constexpr
    GROUP_M: tl.constexpr
    STAGES: tl.constexpr
    BK_COPY: tl.constexpr  # columns a communicator pushes at a time
    B_T: tl.constexpr  # b is the transpose of a contiguous (N, K) matrix (a weight read in place)


@triton.jit
def _chunk_writers(chunk, m_local, M, BM):
    """How many ranks write rows of gathered row chunk `chunk` (1, or more when shards are not BM-aligned)."""
    first = (chunk * BM) // m_local
    last = (tl.minimum(chunk * BM + BM, M) - 1) // m_local
    return last - first + 1


@triton.jit
def _consumer(G, C, task, loader):
    me = G.call.rank
    tiles_m = tl.cdiv(G.M, C.BM)
    pid_m, pid_n = tile_coords(task, G.M, G.N, C.BM, C.BN, C.GROUP_M)
    pid_m = (pid_m + (me * G.m_local) // C.BM) % tiles_m  # rotate rows so that this rank's own block comes first
    row0 = pid_m * C.BM
    # rows wholly mine come straight from the local shard; others from the gathered A once their chunk is in.
    # One k-loop for both: two k-loops would each hold their own shared-memory pipeline.
    a_desc, first = G.a_full_desc, row0
    if (row0 >= me * G.m_local) & (tl.minimum(row0 + C.BM, G.M) <= (me + 1) * G.m_local):
        a_desc, first = G.a_desc, row0 - me * G.m_local
    elif meeting.verdict(G.call):  # the ranks agree (else nobody pushes rows: compute on what is there, store none)
        pkl.wait(G.flags_ptr + pid_m, _chunk_writers(pid_m, G.m_local, G.M, C.BM), G.flags_handle)
    acc = mainloop(a_desc, G.b_desc, first, pid_n * C.BN, G.K, C.BM, C.BN, C.BK, C.STAGES, 0, C.B_T)
    return acc, pid_m, pid_n


@triton.jit
def _storer(G, C, task, result):
    acc, pid_m, pid_n = result
    store_tile(G.c_desc, acc.to(G.c_desc.dtype), pid_m * C.BM, pid_n * C.BN, C.BM, C.BN)


@triton.jit
def _communicator(G, C, task):
    """Push this rank's rows of gathered row chunk `first_chunk + task` to every rank, then signal it."""
    me, world = G.call.rank, G.call.world
    chunk = (me * G.m_local) // C.BM + task
    rows = chunk * C.BM + tl.arange(0, C.BM).to(tl.int64)  # int64: rows * K may pass 2^31
    mine = (rows >= me * G.m_local) & (rows < (me + 1) * G.m_local)
    for k0 in range(0, G.K, C.BK_COPY):
        cols = k0 + tl.arange(0, C.BK_COPY)
        mask = mine[:, None] & (cols < G.K)[None, :]
        tile = tl.load(G.a_ptr + (rows - me * G.m_local)[:, None] * G.K + cols[None, :], mask=mask)
        for i in range(world):
            peer = (me + i) % world
            pkl.store(G.a_full_ptr + rows[:, None] * G.K + cols[None, :], tile, G.a_full_handle, peer, mask)
    for i in range(world):
        pkl.signal(G.flags_ptr + chunk, G.flags_handle, (me + i) % world)


@triton.jit
def _finisher(G, C):
    """Zero the flags for the next call: every program of this rank is done waiting on them, and no peer pushes
    the next call's rows before this rank has begun it."""
    chunks = tl.cdiv(G.M, C.BM)
    for start in range(0, chunks, 1024):
        offs = start + tl.arange(0, 1024)
        tl.store(G.flags_ptr + offs, 0, mask=offs < chunks)


@triton.jit(do_not_specialize=["num_comm", "num_comm_tasks", "rank"])  # one binary for every rank
def _ag_matmul_kernel(a_desc, a_ptr, a_full_ptr, a_full_handle, a_full_desc, b_desc, c_desc, flags_ptr, flags_handle,
                      m_local, M, N, K, num_tasks, num_comm_tasks, num_comm, meet_counters, meet_slots, meet_handle,
                      sig, rank, world, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      GROUP_M: tl.constexpr, STAGES: tl.constexpr, BK_COPY: tl.constexpr, B_T: tl.constexpr):
    call = meeting.begin(meet_counters, meet_slots, meet_handle, sig, rank, world)
    G = Args(a_desc, a_ptr, a_full_ptr, a_full_handle, a_full_desc, b_desc, c_desc, flags_ptr, flags_handle, m_local,
             M, N, K, call)
    lcsc(G, Tiles(BM, BN, BK, GROUP_M, STAGES, BK_COPY, B_T), num_tasks, num_comm_tasks, num_comm, None, _consumer,
         _storer, _communicator, call, _finisher)


class AllGatherMatmulPlan:
    """all_gather(a) @ b for one shard shape, b shape, dtype and configuration: the gathered A's buffer and its
    flags on the heap, the communicator count (tuned once), descriptors and the bound kernel. A plan made for a
    transposed view b (`matmul.transposed`) reads it in place."""

    op = "all_gather_matmul"

    def __init__(self, a: torch.Tensor, b: torch.Tensor, num_comm_sms: int | None, config: MatmulConfig | None):
        ctx = context()
        world = ctx.local_world_size
        self.dtype, self.device = a.dtype, ctx.device
        (self.m_local, self.K), self.N = a.shape, b.shape[1]
        self.M = M = world * self.m_local
        self.config = cfg = (config or default_config(a.dtype)).validate()
        self.b_t = transposed(b)
        self._launch = None
        if world == 1:  # nothing to exchange: the plan is the plain GEMM's, on tiles chosen for its shape
            self._alone = MatmulPlan(M, self.N, self.K, self.dtype, config, self.b_t, self.op)
            self.config = self._alone.config  # what runs (num_comm_sms has nothing to do here)
            return
        self._alone = None
        sig = meeting.signature(self.op, tuple(a.shape), tuple(b.shape), str(a.dtype), num_comm_sms, cfg, self.b_t)
        if M == 0 or self.N == 0:
            return
        num_chunks = cdiv(M, cfg.block_m)
        gathered = heap().pool("fused.scratch", M * self.K * a.dtype.itemsize)
        self._a_full = gathered.view((M, self.K), a.dtype)
        flags = heap().allocate(4 * num_chunks, f"{self.op}.flags")  # zeroed; the finisher re-zeroes them
        me = ctx.local_rank
        my_chunks = ((me + 1) * self.m_local - 1) // cfg.block_m - (me * self.m_local) // cfg.block_m + 1
        tiles = num_chunks * cdiv(self.N, cfg.block_n)

        def bound(num_comm: int) -> Launcher:
            return Launcher(
                _ag_matmul_kernel, grid(tiles, num_comm), per_call=("a_desc", "a_ptr", "b_desc", "c_desc"),
                descriptors=gemm_describers(cfg, self.b_t), a_full_ptr=self._a_full, a_full_handle=gathered.handle,
                a_full_desc=descriptor(self._a_full, [cfg.block_m, cfg.block_k]),
                flags_ptr=flags.view(num_chunks, torch.int32), flags_handle=flags.handle, m_local=self.m_local,
                M=M, N=self.N, K=self.K, num_tasks=tiles,
                num_comm_tasks=my_chunks if world > 1 and self.m_local > 0 else 0, num_comm=num_comm,
                BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, STAGES=cfg.num_stages,
                BK_COPY=min(64, next_power_of_2(self.K)), B_T=self.b_t, num_warps=cfg.num_warps,
                **meeting.meeting().args(sig))

        a, b = operands(self.op, a, b, a.shape, b.shape, a.dtype, self.device, self.b_t)  # what a call passes
        outputs: list[torch.Tensor] = []  # made only if tuning runs

        def run(launch: Launcher) -> None:
            if not outputs:
                outputs.append(torch.empty(self.M, self.N, dtype=a.dtype, device=self.device))
            self._run(launch, a, b, outputs[0])

        self._launch = choose(bound, num_comm_sms, run)

    def gathered(self, a: torch.Tensor, copy: bool = True) -> torch.Tensor:
        """The last call's gathered A (M, K): the kernel leaves every rank's rows in this rank's scratch, which
        the next fused op overwrites, so a backward that keeps it takes a copy; `copy=False` gives the scratch
        itself, to use at once. At one rank it is `a`."""
        full = a if self._launch is None or context().local_world_size == 1 else self._a_full
        return full.contiguous().clone() if copy else full

    def _run(self, launch: Launcher, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
        launch(a, a, b, c)

    def __call__(self, a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """all_gather(a) @ b into `out` (a new (M, N) tensor by default)."""
        if self._alone is not None:
            return self._alone(a, b, out=out)
        try:
            a, b = operands(self.op, a, b, (self.m_local, self.K), (self.K, self.N), self.dtype, self.device,
                            self.b_t)
            c = new_output(self.op, out, (self.M, self.N), self.dtype, self.device)
        except PKError as e:
            plans.refuse(int(self._launch is not None), e)
        if self._launch is not None:
            self._run(self._launch, a, b, c)
        return c


def plan(a: torch.Tensor, b: torch.Tensor, *, num_comm_sms: int | None = None,
         config: MatmulConfig | None = None) -> AllGatherMatmulPlan:
    """The plan for all_gather(a) @ b with operands like `a` and `b` (collective the first time: `ops/plan.py`)."""
    op = "all_gather_matmul"
    key = (op, getattr(a, "shape", None), getattr(b, "shape", None), getattr(a, "dtype", None), num_comm_sms, config,
           transposed(b))
    found = plans.find(key)
    if found is not None:
        return found

    def check() -> str:
        check_operands(op, a, b)
        if config is not None:
            config.validate()
        check_comm_sms(op, num_comm_sms)
        return f"{op} with {tuple(a.shape)}, {tuple(b.shape)}, {a.dtype}, num_comm_sms={num_comm_sms}, {config}"

    return plans.get(key, lambda: AllGatherMatmulPlan(a, b, num_comm_sms, config), check)


def all_gather_matmul(a: torch.Tensor, b: torch.Tensor, *, num_comm_sms: int | None = None,
                      config: MatmulConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """all_gather(a) @ b: `a` is this rank's (M/W, K) row shard, `b` (K, N); returns (M, N) on every rank.
    `b` may be the transposed view of a contiguous (N, K) matrix (``weight.t()``): it is read in place.

    Collective. bf16 or fp16 with fp32 accumulation; K and N multiples of 8 (TMA rows), M/W anything.
    `num_comm_sms` communicator programs push the shard; None picks the count by timing the candidates once per
    plan (`ops/gemm/_tuning.py`), the same on every rank. At one rank it is `matmul` (no communicators).
    """
    return plan(a, b, num_comm_sms=num_comm_sms, config=config)(a, b, out=out)


plans.attach(all_gather_matmul, plan)


@torch.library.custom_op("parallelkittens::all_gather_matmul", mutates_args=())
def _all_gather_matmul_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`all_gather_matmul` as a torch custom op (default configuration), for code compiled with torch.compile."""
    return all_gather_matmul(a, b)


@_all_gather_matmul_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0] * context().local_world_size, b.shape[1])

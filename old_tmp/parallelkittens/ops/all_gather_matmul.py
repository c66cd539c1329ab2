"""all_gather_matmul: all_gather(a) @ b, with the gather overlapped by the GEMM (the paper's AG+GEMM).

Schedule (LCSC, inter-SM). Communicator programs push this rank's shard of A, one row chunk (BM rows of the
gathered A) per task, into every rank's symmetric copy of the gathered A, and signal that chunk's flag on
every rank. Compute programs start with this rank's own row tiles, which they read straight from the local
shard with no wait, then go round the other ranks' blocks, waiting for each row chunk's flag before its
k-loop. After the kernel the flags are zeroed for the next call. Before the kernel, the ranks compare the call
on the device (`Agreement`); that meeting also orders calls: no rank pushes rows of the next call before every
rank's previous kernel, and so every read of the gathered rows, has ended. If the ranks disagree, every rank
skips the call and `pk.sync()` raises `MismatchError`.

Chunks are aligned to the gathered A's rows, so a chunk may hold rows of two ranks when the shard height is
not a multiple of BM: its flag then expects two signals. Pushes use the register path with masks (any shape);
a TMA variant for aligned shards is the next step for speed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import language as pkl
from ..runtime.context import context
from ..runtime.launch import launch
from ..runtime.sizes import cdiv, next_power_of_2
from ..template import grid, lcsc
from ._collective import agree, agreed, agreement, signature, workspace
from ._tuning import comm_programs
from .matmul import MatmulConfig, descriptor, mainloop, prepare, store_tile, tile_coords


def reference_all_gather_matmul(shards: list[torch.Tensor], b: torch.Tensor) -> torch.Tensor:
    """all_gather(a) @ b in float64."""
    return torch.cat([s.double() for s in shards]) @ b.double()


@triton.jit
def _chunk_writers(chunk, m_local, M, BM):
    """How many ranks write rows of gathered row chunk `chunk` (1, or more when shards are not BM-aligned)."""
    first = (chunk * BM) // m_local
    last = (tl.minimum(chunk * BM + BM, M) - 1) // m_local
    return last - first + 1


@triton.jit
def _consumer(G, C, task, loader):
    flags_ptr, hf, m_local, M, N, K, me = G[4], G[5], G[7], G[8], G[9], G[10], G[13]
    tiles_m = tl.cdiv(M, C[0])
    pid_m, pid_n = tile_coords(task, M, N, C[0], C[1], C[3])
    # rotate rows so that this rank's own block comes first
    pid_m = (pid_m + (me * m_local) // C[0]) % tiles_m
    row0 = pid_m * C[0]
    # rows wholly mine come straight from the local shard; others from the gathered A once their chunk is in.
    # One k-loop for both: two k-loops would each hold their own shared-memory pipeline.
    a_desc, first = G[11], row0
    if (row0 >= me * m_local) & (tl.minimum(row0 + C[0], M) <= (me + 1) * m_local):
        a_desc, first = G[0], row0 - me * m_local
    elif G[15]:  # the ranks agreed on this call (else nobody pushes rows: compute on what is there, store nothing)
        pkl.wait(flags_ptr + pid_m, _chunk_writers(pid_m, m_local, M, C[0]), hf)
    acc = mainloop(a_desc, G[2], first, pid_n * C[1], K, C[0], C[1], C[2], C[4])
    return acc, pid_m, pid_n


@triton.jit
def _storer(G, C, task, result):
    acc, pid_m, pid_n = result
    store_tile(G[3], acc.to(G[3].dtype), pid_m * C[0], pid_n * C[1], C[0], C[1])


@triton.jit
def _communicator(G, C, task):
    """Push this rank's rows of gathered row chunk `first_chunk + task` to every rank, then signal it."""
    a_ptr, a_full_ptr, flags_ptr, hf, h, m_local, K = G[12], G[1], G[4], G[5], G[6], G[7], G[10]
    me, world = G[13], G[14]
    chunk = (me * m_local) // C[0] + task
    rows = chunk * C[0] + tl.arange(0, C[0]).to(tl.int64)  # int64: rows * K may pass 2^31
    mine = (rows >= me * m_local) & (rows < (me + 1) * m_local)
    for k0 in range(0, K, C[5]):
        cols = k0 + tl.arange(0, C[5])
        mask = mine[:, None] & (cols < K)[None, :]
        tile = tl.load(a_ptr + (rows - me * m_local)[:, None] * K + cols[None, :], mask=mask)
        for i in range(world):
            peer = (me + i) % world
            pkl.store(a_full_ptr + rows[:, None] * K + cols[None, :], tile, h, peer, mask)
    for i in range(world):
        pkl.signal(flags_ptr + chunk, hf, (me + i) % world)


@triton.jit(do_not_specialize=["num_comm", "rank"])
def _ag_matmul_kernel(a_desc, a_ptr, a_full_ptr, a_full_desc, b_desc, c_desc, flags_ptr, hf, h, m_local, M, N, K,
                      num_tasks, num_comm_tasks, num_comm, skip_ptr, rank, world, BM: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr,
                      BK_COPY: tl.constexpr):
    # G[0]: the local shard's descriptor, G[11] the gathered A's, G[12] and G[1] their pointers (communicators)
    go = agreed(skip_ptr)
    G = (a_desc, a_full_ptr, b_desc, c_desc, flags_ptr, hf, h, m_local, M, N, K, a_full_desc, a_ptr, rank, world, go)
    lcsc(G, (BM, BN, BK, GROUP_M, STAGES, BK_COPY), num_tasks, num_comm_tasks, num_comm, None, _consumer, _storer,
         _communicator, go)


def all_gather_matmul(a: torch.Tensor, b: torch.Tensor, *, num_comm_sms: int | None = None,
                      config: MatmulConfig | None = None) -> torch.Tensor:
    """all_gather(a) @ b: `a` is this rank's (M/W, K) row shard, `b` (K, N); returns (M, N) on every rank.

    Collective. bf16 or fp16 with fp32 accumulation; K and N multiples of 8 (TMA rows), M/W anything.
    `num_comm_sms` communicator programs push the shard; None picks the count by timing the candidates
    (`ops._tuning`), the same on every rank.
    """
    op = "all_gather_matmul"
    a, b, cfg = prepare(op, a, b, config, num_comm_sms)
    ctx = context()
    world = ctx.local_world_size
    m_local, K = a.shape
    N = b.shape[1]
    M = world * m_local
    sig = signature(op, tuple(a.shape), tuple(b.shape), str(a.dtype), num_comm_sms, cfg)
    agree(op, sig)
    skip = agreement()(sig)  # first: what follows may be a host step all ranks take together (confirm_agreement)
    ws = workspace(op)
    a_full, a_full_handle = ws.view((M, K), a.dtype, slot=0)  # the gathered A
    num_chunks = cdiv(M, cfg.block_m)
    flags, flags_handle = ws.view((num_chunks,), torch.int32, slot=1, zero=True)  # one per row chunk
    num_comm = comm_programs(num_comm_sms, (op, tuple(a.shape), tuple(b.shape), a.dtype, cfg),
                             lambda count: all_gather_matmul(a, b, num_comm_sms=count, config=cfg))
    my_chunks = (((ctx.local_rank + 1) * m_local - 1) // cfg.block_m) - (ctx.local_rank * m_local) // cfg.block_m + 1
    num_comm_tasks = my_chunks if world > 1 and m_local > 0 else 0
    tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
    c = torch.empty(M, N, dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:  # only after the agreement: a rank that left before it would leave its peers waiting
        return c
    a_block = [cfg.block_m, cfg.block_k]
    launch(_ag_matmul_kernel, grid(tiles, num_comm), descriptor(a, a_block), a, a_full, descriptor(a_full, a_block),
           descriptor(b, [cfg.block_k, cfg.block_n]), descriptor(c, [cfg.block_m, cfg.block_n // 2]), flags,
           flags_handle, a_full_handle, m_local, M, N, K, tiles, num_comm_tasks, num_comm=num_comm, skip_ptr=skip,
           rank=ctx.local_rank, world=world, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m,
           STAGES=cfg.num_stages, BK_COPY=min(64, next_power_of_2(K)), num_warps=cfg.num_warps, key=sig)
    if world > 1:
        flags.zero_()  # a memset: cheaper to issue than a kernel of ours
    return c


@torch.library.custom_op("parallelkittens::all_gather_matmul", mutates_args=())
def _all_gather_matmul_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`all_gather_matmul` as a torch custom op (default configuration), for code compiled with torch.compile."""
    return all_gather_matmul(a, b)


@_all_gather_matmul_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0] * context().local_world_size, b.shape[1])

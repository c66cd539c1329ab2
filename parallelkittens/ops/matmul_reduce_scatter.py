"""matmul_reduce_scatter: this rank's row block of sum over ranks of a @ b (the paper's GEMM+RS).

Schedule (intra-SM, no communicator). Each rank computes its partial product tile by tile, starting its sweep
at a different row block (the next rank's), so that ranks do not all add into one owner at once. The epilogue
adds each fp32 tile straight into its owner's fp32 accumulator: one tensor-descriptor reduce-add (TMA,
``cp.reduce.async.bulk``) when row blocks align with tiles, masked per-element atomics otherwise. After its
last tile a program signals every rank. A finish kernel waits for all programs of all ranks, rounds the
accumulator into the output and zeroes it for the next call; its last program closes the call with a
barrier. Before the main kernel, the ranks compare the call on the device (`Agreement`): if they disagree,
every rank skips it and `pk.sync()` raises `MismatchError`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import language as pkl
from ..runtime.context import context
from ..runtime.device import num_sms
from ..runtime.errors import PKError
from ..runtime.launch import launch
from ..runtime.sizes import cdiv
from ..template import grid, lcsc
from ._collective import agree, agreement, signature, workspace
from .matmul import MatmulConfig, column_halves, gemm_tile, prepare


def reference_matmul_reduce_scatter(a_parts: list[torch.Tensor], b_parts: list[torch.Tensor], rank: int
                                    ) -> torch.Tensor:
    """Rank `rank`'s row block of sum_r a_r @ b_r, in float64."""
    total = sum(a.double() @ b.double() for a, b in zip(a_parts, b_parts, strict=True))
    return total.chunk(len(a_parts))[rank]


@triton.jit
def _consumer(G, C, task, loader):
    hc, num_tasks = G[4], G[9]
    rotated = (task + pkl.rank(hc) * num_tasks // pkl.world_size(hc)) % num_tasks  # start at another owner's block
    return gemm_tile(G[0], G[1], G[6], G[7], G[8], rotated, C)


@triton.jit
def _storer(G, C, task, result):
    acc, pid_m, pid_n = result
    acc_ptr, h, ctr_ptr, hc, m_block, N, num_tasks = G[2], G[3], G[5], G[4], G[10], G[7], G[9]
    row0 = pid_m * C[0]
    if C[5]:  # row blocks align with tiles: one bulk reduce-add into the owner
        owner = row0 // m_block
        dst = pkl.peer_descriptor(acc_ptr, h, owner, [m_block, N], [N, 1], [C[0], C[1] // 2])
        left, right = column_halves(acc, C[0], C[1])
        dst.atomic_add([row0 - owner * m_block, pid_n * C[1]], left)
        dst.atomic_add([row0 - owner * m_block, pid_n * C[1] + C[1] // 2], right)
    else:
        rows = row0 + tl.arange(0, C[0]).to(tl.int64)
        cols = pid_n * C[1] + tl.arange(0, C[1])
        for owner in range(row0 // m_block, tl.minimum((row0 + C[0] - 1) // m_block + 1, pkl.world_size(h))):
            mask = ((rows >= owner * m_block) & (rows < (owner + 1) * m_block))[:, None] & (cols < N)[None, :]
            ptrs = acc_ptr + (rows - owner * m_block)[:, None] * N + cols[None, :]
            pkl.store_add(ptrs, acc, h, owner, mask)
    if task + tl.num_programs(0) >= num_tasks:  # this program's last tile: tell every rank
        pkl.signal_all(ctr_ptr, hc)


@triton.jit
def _mm_rs_kernel(a_ptr, b_ptr, acc_ptr, h, hc, ctr_ptr, M, N, K, num_tasks, m_block, skip_ptr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr,
                  ALIGNED: tl.constexpr):
    G = (a_ptr, b_ptr, acc_ptr, h, hc, ctr_ptr, M, N, K, num_tasks, m_block)
    if tl.load(skip_ptr) == 0:  # the ranks agreed on the call (ops/_collective.py: Agreement)
        lcsc(G, (BM, BN, BK, GROUP_M, STAGES, ALIGNED), num_tasks, 0, 0, None, _consumer, _storer, None)


@triton.jit
def _finish_kernel(acc_ptr, out_ptr, n, ctr_ptr, hc, expected, skip_ptr, barrier_ptr, hb, BLOCK: tl.constexpr):
    """Once every program of every rank has added its tiles here, round this rank's accumulator into the output
    and zero it, a slice per program; the last program out resets the counters and meets the other ranks at a
    barrier, so that no rank adds into an accumulator before its owner has read and zeroed it."""
    if tl.load(skip_ptr) == 0:
        pkl.wait(ctr_ptr, expected, hc)
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < n
        tl.store(out_ptr + offs, tl.load(acc_ptr + offs, mask=mask).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(acc_ptr + offs, tl.zeros([BLOCK], tl.float32), mask=mask)
    if tl.atomic_add(ctr_ptr + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:  # the last one out
        tl.store(ctr_ptr, 0)
        tl.store(ctr_ptr + 1, 0)
        pkl.barrier_all(barrier_ptr, hb)



def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, *, config: MatmulConfig | None = None) -> torch.Tensor:
    """Sum over ranks of a @ b, scattered by rows: `a` is (M, K/W), `b` (K/W, N); returns (M/W, N).

    Collective. bf16 or fp16, fp32 accumulation (across ranks too); M must divide by the world size; K/W and N
    multiples of 8 (TMA rows).
    """
    op = "matmul_reduce_scatter"
    a, b, cfg = prepare(op, a, b, config)
    ctx = context()
    world = ctx.local_world_size
    M, K = a.shape
    N = b.shape[1]
    if M % world:
        raise PKError(f"{op}: M={M} rows do not divide by the world size {world}")
    sig = signature(op, tuple(a.shape), tuple(b.shape), str(a.dtype), cfg)
    agree(op, sig)
    m_block = M // world
    out = torch.empty(m_block, N, dtype=a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    ws = workspace(op)
    acc, acc_handle = ws.view((m_block, N), torch.float32, slot=0, zero=True)  # zero between calls
    done, done_handle = ws.view((2,), torch.int32, slot=1, zero=True)  # tiles added here, programs finished
    tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
    g = grid(tiles, 0)
    agreed = agreement()
    skip = agreed(sig)
    launch(_mm_rs_kernel, g, a, b, acc, acc_handle, done_handle, done, M, N, K, tiles, m_block, skip,
           BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, STAGES=cfg.num_stages,
           ALIGNED=m_block % cfg.block_m == 0, num_warps=cfg.num_warps)
    launch(_finish_kernel, (num_sms(),), acc, out, out.numel(), done, done_handle, world * g[0], skip,
           agreed.barrier, agreed.handle, BLOCK=4096, num_warps=4)
    return out


@torch.library.custom_op("parallelkittens::matmul_reduce_scatter", mutates_args=())
def _matmul_reduce_scatter_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`matmul_reduce_scatter` as a torch custom op (default configuration), for code compiled with torch.compile."""
    return matmul_reduce_scatter(a, b)


@_matmul_reduce_scatter_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0] // context().local_world_size, b.shape[1])

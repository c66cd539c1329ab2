"""matmul_reduce_scatter: this rank's row block of sum over ranks of a @ b (the paper's GEMM+RS).

Schedule (intra-SM, no communicator). The output rows are split into W row blocks, block r owned by rank r,
and each block is tiled on its own (so that no tile straddles two owners, whatever M/W is). Every rank sweeps
the tiles of the other owners' blocks first, starting at the next rank's, and its own block last. A tile of
another owner's block is rounded to the input dtype and added into that owner's symmetric buffer with one
tensor-descriptor reduce-add (TMA, ``cp.reduce.async.bulk``), then the owner's counter for the tile is
signalled. A tile of its own block the rank keeps in registers: it waits for the tile's W - 1 contributions,
adds them to its own fp32 tile, writes the sum into the output (a plain tensor) and zeroes the buffer's tile
for the next call. So the own part never crosses the wire and no accumulator pass runs after the GEMM; one rank
is a plain GEMM.

Since a rank's own tiles come after all of its other tiles, a program waits only once it has sent everything
it owes, which rules out a cycle of waits. Between calls, `Agreement` (all ranks have finished the previous
call before any starts this one) orders one call's zeroing before the next call's adds; if the ranks
disagree on the call, every rank skips it and `pk.sync()` raises `MismatchError`.

Precision: each rank's tile is accumulated in fp32; the contributions of other ranks are summed on the owner
in the input dtype (as NCCL's reduce-scatter does) and added to the owner's fp32 tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import language as pkl
from ..runtime.context import context
from ..runtime.errors import PKError
from ..runtime.launch import launch
from ..runtime.sizes import cdiv
from ..template import grid, lcsc
from ._collective import agree, agreement, signature, workspace
from .matmul import MatmulConfig, column_halves, gemm_tile, prepare, store_tile


def reference_matmul_reduce_scatter(a_parts: list[torch.Tensor], b_parts: list[torch.Tensor], rank: int
                                    ) -> torch.Tensor:
    """Rank `rank`'s row block of sum_r a_r @ b_r, in float64."""
    total = sum(a.double() @ b.double() for a, b in zip(a_parts, b_parts, strict=True))
    return total.chunk(len(a_parts))[rank]


@triton.jit
def _consumer(G, C, task, loader):
    a_ptr, b_ptr, hc, m_block, N, K, per_block, num_tasks = G[0], G[1], G[6], G[7], G[8], G[9], G[10], G[11]
    t = (task + (pkl.rank(hc) + 1) * per_block) % num_tasks  # the next rank's block first, this rank's last
    owner = t // per_block
    acc, pid_m, pid_n = gemm_tile(a_ptr + owner.to(tl.int64) * m_block * K, b_ptr, m_block, N, K, t % per_block, C)
    return acc, pid_m, pid_n, owner, t % per_block


@triton.jit
def _storer(G, C, task, result):
    acc, pid_m, pid_n, owner, tile = result
    part_ptr, h, out_ptr, ctr_ptr, hc, m_block, N = G[2], G[3], G[4], G[5], G[6], G[7], G[8]
    row, col = pid_m * C[0], pid_n * C[1]
    world = pkl.world_size(hc)
    if owner != pkl.rank(hc):  # another owner's tile: add it into theirs, then tell them
        dst = pkl.peer_descriptor(part_ptr, h, owner, [m_block, N], [N, 1], [C[0], C[1] // 2])
        left, right = column_halves(acc.to(part_ptr.dtype.element_ty), C[0], C[1])
        dst.atomic_add([row, col], left)
        dst.atomic_add([row, col + C[1] // 2], right)
        pkl.signal(ctr_ptr + tile, hc, owner)
    else:
        out = tl.make_tensor_descriptor(out_ptr, [m_block, N], [N, 1], [C[0], C[1] // 2])
        if world > 1:  # the other W - 1 ranks' share of this tile is in the buffer: add it, zero the buffer
            pkl.wait(ctr_ptr + tile, world - 1, hc)
            tl.store(ctr_ptr + tile, 0)
            part = tl.make_tensor_descriptor(part_ptr, [m_block, N], [N, 1], [C[0], C[1] // 2])
            left, right = column_halves(acc, C[0], C[1])
            left += part.load([row, col]).to(tl.float32)
            right += part.load([row, col + C[1] // 2]).to(tl.float32)
            out.store([row, col], left.to(out_ptr.dtype.element_ty))
            out.store([row, col + C[1] // 2], right.to(out_ptr.dtype.element_ty))
            zeros = tl.zeros([C[0], C[1] // 2], part_ptr.dtype.element_ty)
            part.store([row, col], zeros)
            part.store([row, col + C[1] // 2], zeros)
        else:
            store_tile(out, acc.to(out_ptr.dtype.element_ty), row, col, C[0], C[1])


@triton.jit
def _mm_rs_kernel(a_ptr, b_ptr, part_ptr, h, out_ptr, ctr_ptr, hc, m_block, N, K, per_block, num_tasks, skip_ptr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                  STAGES: tl.constexpr):
    G = (a_ptr, b_ptr, part_ptr, h, out_ptr, ctr_ptr, hc, m_block, N, K, per_block, num_tasks)
    if tl.load(skip_ptr) == 0:  # the ranks agreed on the call (ops/_collective.py: Agreement)
        lcsc(G, (BM, BN, BK, GROUP_M, STAGES), num_tasks, 0, 0, None, _consumer, _storer, None)


def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, *, config: MatmulConfig | None = None) -> torch.Tensor:
    """Sum over ranks of a @ b, scattered by rows: `a` is (M, K/W), `b` (K/W, N); returns (M/W, N).

    Collective. bf16, fp16 or fp32; each rank's product is accumulated in fp32, the other ranks' shares of
    a tile reach its owner in the input dtype (see the module's note on precision). M must divide by the world
    size; K/W and N are multiples of 8 (16-bit types) or 4 (fp32) for TMA.
    """
    op = "matmul_reduce_scatter"
    a, b, cfg = prepare(op, a, b, config)
    world = context().local_world_size
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
    part, part_handle = ws.view((m_block, N), a.dtype, slot=0, zero=True)  # others' shares; zero between calls
    per_block = cdiv(m_block, cfg.block_m) * cdiv(N, cfg.block_n)  # tiles of one owner's row block
    ctr, ctr_handle = ws.view((per_block,), torch.int32, slot=1, zero=True)  # arrivals per tile, zero between
    skip = agreement()(sig)
    launch(_mm_rs_kernel, grid(world * per_block, 0),
        a, b, part, part_handle, out, ctr, ctr_handle, m_block, N, K, per_block, world * per_block, skip,
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, STAGES=cfg.num_stages,
        num_warps=cfg.num_warps)
    return out


@torch.library.custom_op("parallelkittens::matmul_reduce_scatter", mutates_args=())
def _matmul_reduce_scatter_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`matmul_reduce_scatter` as a torch custom op (default configuration), for code compiled with torch.compile."""
    return matmul_reduce_scatter(a, b)


@_matmul_reduce_scatter_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0] // context().local_world_size, b.shape[1])

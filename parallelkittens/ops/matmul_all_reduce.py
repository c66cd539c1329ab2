"""matmul_all_reduce: sum over ranks of a @ b on every rank (the paper's GEMM+AR, on the LCSC template).

Schedule (inter-SM). Compute programs store each fp32 partial tile into this rank's symmetric partial buffer
and signal the tile's owner (tile % W). The owner's communicator programs wait until all W partials of a tile
are in, sum them from every rank (fp32, rank order), and write the rounded result into every rank's output
buffer, signalling each. A one-program finish kernel waits for every tile of the result, resets the counters
and passes a barrier. Before the main kernel, the ranks compare the call on the device (`Agreement`): if they
disagree, every rank skips it and `pk.sync()` raises `MismatchError`. This is the paper's figure 18, with the
NVLink-switch reduction replaced by peer reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import language as pkl
from ..runtime.context import context
from ..runtime.launch import launch
from ..runtime.sizes import cdiv
from ..template import grid, lcsc
from ._collective import agree, agreement, signature, workspace
from ._tuning import tuned
from .matmul import MatmulConfig, gemm_tile, prepare, store_tile


def reference_matmul_all_reduce(a_parts: list[torch.Tensor], b_parts: list[torch.Tensor]) -> torch.Tensor:
    """sum_r a_r @ b_r in float64."""
    return sum(a.double() @ b.double() for a, b in zip(a_parts, b_parts, strict=True))


@triton.jit
def _consumer(G, C, task, loader):
    return gemm_tile(G[0], G[1], G[7], G[8], G[9], task, C)


@triton.jit
def _storer(G, C, task, result):
    acc, pid_m, pid_n = result
    part_ptr, ctr_ptr, hc, M, N = G[2], G[5], G[6], G[7], G[8]
    tiles_n = tl.cdiv(N, C[1])
    part = tl.make_tensor_descriptor(part_ptr, [M, N], [N, 1], [C[0], C[1] // 2])
    store_tile(part, acc, pid_m * C[0], pid_n * C[1], C[0], C[1])
    tile = pid_m * tiles_n + pid_n
    pkl.signal(ctr_ptr + tile, hc, tile % pkl.world_size(hc))  # to the tile's owner


@triton.jit
def _communicator(G, C, task):
    part_ptr, h_part, out_ptr, h_out, ctr_ptr, hc, M, N = G[2], G[3], G[10], G[11], G[5], G[6], G[7], G[8]
    me = pkl.rank(hc)
    world = pkl.world_size(hc)
    tiles_n = tl.cdiv(N, C[1])
    num_tiles = tl.cdiv(M, C[0]) * tiles_n
    tile = me + task * world
    pkl.wait(ctr_ptr + tile, world, hc)  # every rank's partial is in
    tl.store(ctr_ptr + tile, 0)
    rows = (tile // tiles_n) * C[0] + tl.arange(0, C[0]).to(tl.int64)  # int64: rows * N may pass 2^31
    for c0 in range(0, C[1], C[5]):  # column strips keep the communicator's registers small
        cols = (tile % tiles_n) * C[1] + c0 + tl.arange(0, C[5])
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        offs = rows[:, None] * N + cols[None, :]
        total = tl.zeros([C[0], C[5]], tl.float32)
        for r in range(world):
            total += pkl.load(part_ptr + offs, h_part, r, mask, 0)
        result = total.to(out_ptr.dtype.element_ty)
        for i in range(world):
            pkl.store(out_ptr + offs, result, h_out, (me + i) % world, mask)
    for i in range(world):
        pkl.signal(ctr_ptr + num_tiles, hc, (me + i) % world)  # one more result tile on that rank


@triton.jit(do_not_specialize=["num_comm"])
def _mm_ar_kernel(a_ptr, b_ptr, part_ptr, h_part, out_ptr, h_out, ctr_ptr, hc, M, N, K, num_tasks, num_comm_tasks,
                  num_comm, skip_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  GROUP_M: tl.constexpr, STAGES: tl.constexpr, STRIP: tl.constexpr):
    G = (a_ptr, b_ptr, part_ptr, h_part, 0, ctr_ptr, hc, M, N, K, out_ptr, h_out)
    if tl.load(skip_ptr) == 0:  # the ranks agreed on the call (ops/_collective.py: Agreement)
        lcsc(G, (BM, BN, BK, GROUP_M, STAGES, STRIP), num_tasks, num_comm_tasks, num_comm, None, _consumer,
             _storer, _communicator)


@triton.jit
def _finish_kernel(ctr_ptr, hc, num_tiles, skip_ptr, barrier_ptr, hb):
    if tl.load(skip_ptr) == 0:
        pkl.wait(ctr_ptr + num_tiles, num_tiles, hc)
    tl.store(ctr_ptr + num_tiles, 0)
    pkl.barrier_all(barrier_ptr, hb)



def matmul_all_reduce(a: torch.Tensor, b: torch.Tensor, *, num_comm_sms: int | None = None,
                      config: MatmulConfig | None = None) -> torch.Tensor:
    """sum over ranks of a @ b: `a` is (M, K/W), `b` (K/W, N); returns the full (M, N) sum on every rank.

    Collective. bf16 or fp16, fp32 accumulation (partials are kept in fp32); K/W and N multiples of 8.
    `num_comm_sms` communicator programs reduce; None picks the count by timing the candidates
    (`ops._tuning`), the same on every rank.
    """
    op = "matmul_all_reduce"
    a, b, cfg = prepare(op, a, b, config, num_comm_sms)
    ctx = context()
    world = ctx.local_world_size
    M, K = a.shape
    N = b.shape[1]
    sig = signature(op, tuple(a.shape), tuple(b.shape), str(a.dtype), num_comm_sms, cfg)
    agree(op, sig)
    if M == 0 or N == 0:
        return torch.empty(M, N, dtype=a.dtype, device=a.device)
    tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
    ws = workspace(op)
    part, part_handle = ws.view((M, N), torch.float32, slot=0)  # this rank's partial product
    out, out_handle = ws.view((M, N), a.dtype, slot=1)  # the sum, written by every tile's owner
    ctr, ctr_handle = ws.view((tiles + 1,), torch.int32, slot=2, zero=True)  # per tile, then arrivals
    num_comm = num_comm_sms if num_comm_sms is not None else tuned(
        (op, tuple(a.shape), tuple(b.shape), a.dtype, cfg),
        lambda count: matmul_all_reduce(a, b, num_comm_sms=count, config=cfg))
    owned = len(range(ctx.local_rank, tiles, world))
    agreed = agreement()
    skip = agreed(sig)
    launch(_mm_ar_kernel, grid(tiles, num_comm),
        a, b, part, part_handle, out, out_handle, ctr, ctr_handle, M, N, K, tiles, owned,
        num_comm=num_comm, skip_ptr=skip, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m,
        STAGES=cfg.num_stages, STRIP=min(64, cfg.block_n), num_warps=cfg.num_warps)
    launch(_finish_kernel, (1,), ctr, ctr_handle, tiles, skip, agreed.barrier, agreed.handle)
    return out.clone()  # the buffer is rewritten by the next call


@torch.library.custom_op("parallelkittens::matmul_all_reduce", mutates_args=())
def _matmul_all_reduce_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`matmul_all_reduce` as a torch custom op (default configuration), for code compiled with torch.compile."""
    return matmul_all_reduce(a, b)


@_matmul_all_reduce_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[1])

"""matmul_all_reduce: sum over ranks of a @ b on every rank (the paper's GEMM+AR, on the LCSC template).

Schedule (inter-SM). Compute programs store each partial tile, rounded to the input dtype, into this rank's
symmetric partial buffer and signal the tile's owner (tile % W). Communicator programs take every tile. For a
tile it owns, a communicator waits until all W partials are in, sums them from every rank in fp32 (in rank
order, so every rank gets the same bits), writes the sum into this rank's output and over its own partial, and
signals every other rank. For a tile of another owner, it waits for that signal and reads the sum from the
owner's buffer into this rank's output. A rank's communicators take its own tiles first, which wait only for
compute work (which waits for nothing), then the others' tiles, whose owners finish them without waiting for
this rank's communicators: no chain of waits between ranks' communicators, which ranks time-sliced on one GPU
would pay for with a switch per tile. The output is a plain tensor that each rank's own communicators fill, so
nothing is copied after the kernel, and `Agreement` (every rank has finished the previous call) keeps the next
call from overwriting a partial a peer still reads. If the ranks disagree on the call, every rank skips it and
`pk.sync()` raises `MismatchError`.

This is the paper's figure 18 with the NVLink-switch reduction replaced by peer reads, and the owner's
broadcast by peers reading the owner's sum (the same bytes over the links; no copy out of a shared buffer).
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
    part = tl.make_tensor_descriptor(part_ptr, [M, N], [N, 1], [C[0], C[1] // 2])
    store_tile(part, acc.to(part_ptr.dtype.element_ty), pid_m * C[0], pid_n * C[1], C[0], C[1])
    tile = pid_m * tl.cdiv(N, C[1]) + pid_n
    pkl.signal(ctr_ptr + tile, hc, tile % pkl.world_size(hc))  # to the tile's owner


@triton.jit
def _communicator(G, C, task):
    part_ptr, h_part, out_ptr, ctr_ptr, hc, M, N = G[2], G[3], G[4], G[5], G[6], G[7], G[8]
    me = pkl.rank(hc)
    world = pkl.world_size(hc)
    tiles_n = tl.cdiv(N, C[1])
    num_tiles = tl.cdiv(M, C[0]) * tiles_n
    owned = tl.maximum(tl.cdiv(num_tiles - me, world), 0)  # tiles me, me + W, ...
    if task < owned:  # this rank's tiles first: they wait only for compute work
        tile = me + task * world
    else:  # then the others', whose owners sum them without waiting for this rank's communicators
        i = task - owned
        others = tl.maximum(world - 1, 1)  # (never 0: one rank owns every tile and never comes here)
        tile = (i // others) * world + (me + 1 + i % others) % world
    owner = tile % world
    ready_ptr = ctr_ptr + num_tiles + tile  # the owner's "sum is in" for this tile
    if tile < num_tiles:
        if owner == me:
            pkl.wait(ctr_ptr + tile, world, hc)  # every rank's partial is in
            tl.store(ctr_ptr + tile, 0)
        else:
            pkl.wait(ready_ptr, 1, hc)
            tl.store(ready_ptr, 0)
        rows = (tile // tiles_n) * C[0] + tl.arange(0, C[0]).to(tl.int64)  # int64: rows * N may pass 2^31
        for c0 in range(0, C[1], C[5]):  # column strips keep the communicator's registers small
            cols = (tile % tiles_n) * C[1] + c0 + tl.arange(0, C[5])
            mask = (rows < M)[:, None] & (cols < N)[None, :]
            offs = rows[:, None] * N + cols[None, :]
            if owner == me:
                total = tl.zeros([C[0], C[5]], tl.float32)
                for r in range(world):
                    total += pkl.load(part_ptr + offs, h_part, r, mask, 0).to(tl.float32)
                result = total.to(out_ptr.dtype.element_ty)
                if world > 1:  # the others read the sum from here
                    tl.store(part_ptr + offs, result, mask=mask)
            else:
                result = pkl.load(part_ptr + offs, h_part, owner, mask, 0)
            tl.store(out_ptr + offs, result, mask=mask)
        if owner == me:
            for i in range(1, world):
                pkl.signal(ready_ptr, hc, (me + i) % world)


@triton.jit(do_not_specialize=["num_comm"])
def _mm_ar_kernel(a_ptr, b_ptr, part_ptr, h_part, out_ptr, ctr_ptr, hc, M, N, K, num_tasks, num_comm_tasks,
                  num_comm, skip_ptr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                  STAGES: tl.constexpr, STRIP: tl.constexpr):
    G = (a_ptr, b_ptr, part_ptr, h_part, out_ptr, ctr_ptr, hc, M, N, K)
    if tl.load(skip_ptr) == 0:  # the ranks agreed on the call (ops/_collective.py: Agreement)
        lcsc(G, (BM, BN, BK, GROUP_M, STAGES, STRIP), num_tasks, num_comm_tasks, num_comm, None, _consumer,
             _storer, _communicator)


def matmul_all_reduce(a: torch.Tensor, b: torch.Tensor, *, num_comm_sms: int | None = None,
                      config: MatmulConfig | None = None) -> torch.Tensor:
    """sum over ranks of a @ b: `a` is (M, K/W), `b` (K/W, N); returns the full (M, N) sum on every rank.

    Collective. bf16, fp16 or fp32; each rank's product is accumulated in fp32 and rounded to the input dtype
    once, then the W partials are summed in fp32 (as NCCL's all-reduce of the rounded products, with one
    rounding of the sum); every rank gets the same bits. K/W and N are multiples of 8 (16-bit types) or 4
    (fp32) for TMA. `num_comm_sms` communicator programs reduce and copy; None picks the count by timing the
    candidates (`ops._tuning`), the same on every rank.
    """
    op = "matmul_all_reduce"
    a, b, cfg = prepare(op, a, b, config, num_comm_sms)
    M, K = a.shape
    N = b.shape[1]
    sig = signature(op, tuple(a.shape), tuple(b.shape), str(a.dtype), num_comm_sms, cfg)
    agree(op, sig)
    out = torch.empty(M, N, dtype=a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
    ws = workspace(op)
    part, part_handle = ws.view((M, N), a.dtype, slot=0)  # this rank's partial product, then the owner's sums
    ctr, ctr_handle = ws.view((2 * tiles,), torch.int32, slot=1, zero=True)  # partials in, sum in; per tile
    num_comm = num_comm_sms if num_comm_sms is not None else tuned(
        (op, tuple(a.shape), tuple(b.shape), a.dtype, cfg),
        lambda count: matmul_all_reduce(a, b, num_comm_sms=count, config=cfg))
    world = context().local_world_size
    # this rank's tiles, then a slot for each other owner's tile in every round of W tiles (some past the end)
    comm_tasks = len(range(context().local_rank, tiles, world)) + cdiv(tiles, world) * (world - 1)
    skip = agreement()(sig)
    launch(_mm_ar_kernel, grid(tiles, num_comm),
        a, b, part, part_handle, out, ctr, ctr_handle, M, N, K, tiles, comm_tasks, num_comm=num_comm, skip_ptr=skip,
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, STAGES=cfg.num_stages,
        STRIP=min(64, cfg.block_n), num_warps=cfg.num_warps)
    return out


@torch.library.custom_op("parallelkittens::matmul_all_reduce", mutates_args=())
def _matmul_all_reduce_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`matmul_all_reduce` as a torch custom op (default configuration), for code compiled with torch.compile."""
    return matmul_all_reduce(a, b)


@_matmul_all_reduce_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[1])

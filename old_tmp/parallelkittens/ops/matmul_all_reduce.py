"""matmul_all_reduce: sum over ranks of a @ b on every rank (the paper's GEMM+AR, on the LCSC template).

Schedule. The output tiles (grouped order) are split into W contiguous ranges, range r owned by rank r. Compute
programs sweep all tiles starting at the next rank's range and ending with their own. A tile of another rank's
range is added into its owner's symmetric buffer with one tensor-descriptor reduce-add in the input dtype, and
the owner's counter for the tile is signalled. A tile of this rank's own range keeps its fp32 partial in
registers, waits for the W - 1 peers' shares, adds them in fp32, zeroes the buffer tile, writes the sum to the
output and to this rank's symmetric result buffer, and signals every peer that the tile is ready. Communicator
programs take the tiles this rank does not own, wait for each to be ready and read it from its owner into the
output, so moving results runs on their own SMs while the compute programs keep the tensor cores busy.

No wait depends on a program that waits itself except through the owners, whose waits depend only on shares
that are pushed unconditionally: no cycle, so ranks time-sliced on one GPU cannot deadlock. At one rank it is
the persistent GEMM with no communicator. This is the paper's figure 18, with the NVLink-switch reduction
replaced by reduce-adds into the owner and reads from it; shares of other ranks are summed in the input dtype
(as NCCL does), the owner's own share and the final add in fp32.

Before the kernel the ranks compare the call on the device (`Agreement`); that meeting also orders calls (no
rank adds into a buffer, or overwrites a result a peer still reads, before the previous call ended everywhere).
If they disagree, every rank skips the call and `pk.sync()` raises `MismatchError`.
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
from ._collective import agree, agreed, agreement, signature, workspace
from ._tuning import comm_programs
from .matmul import MatmulConfig, column_halves, descriptor, gemm_tile, prepare, tile_coords
from .matmul_reduce_scatter import push_share, take_shares


def reference_matmul_all_reduce(a_parts: list[torch.Tensor], b_parts: list[torch.Tensor]) -> torch.Tensor:
    """sum_r a_r @ b_r in float64."""
    return sum(a.double() @ b.double() for a, b in zip(a_parts, b_parts, strict=True))


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
    tile = _swept_tile(task, G[15], G[16], G[12])
    acc, pid_m, pid_n = gemm_tile(G[0], G[1], G[8], G[9], G[10], tile, C)
    return acc, tile, pid_m * C[0], pid_n * C[1]


@triton.jit
def _storer(G, C, task, result):
    acc, tile, row, col = result
    buf_ptr, hb, out, ctr_ptr, hc, M, N, tiles, res = G[2], G[3], G[6], G[11], G[7], G[8], G[9], G[12], G[14]
    dtype = out.dtype
    half: tl.constexpr = C[1] // 2
    world = G[16]
    owner = _owner(tile, world, tiles)
    left, right = column_halves(acc, C[0], C[1])
    if owner != G[15]:
        push_share(left, right, buf_ptr, hb, owner, ctr_ptr + tile, hc, M, N, row, col, C[0], half)
    else:
        left, right = take_shares(left, right, G[13], ctr_ptr + tile, hc, world, row, col, C[0], half)
        if world > 1:  # the sum for the peers to read
            res.store([row, col], left.to(dtype))
            res.store([row, col + half], right.to(dtype))
            pkl.signal_all(ctr_ptr + tiles + tile, hc)  # ready, on every rank
            tl.debug_barrier()
            tl.atomic_add(ctr_ptr + tiles + tile, -1, sem="relaxed", scope="gpu")  # except this one
        out.store([row, col], left.to(dtype))
        out.store([row, col + half], right.to(dtype))


@triton.jit
def _communicator(G, C, task):
    """Read the task-th tile this rank does not own from its owner, once it is ready, into the output."""
    res_ptr, hr, out, ctr_ptr, hc, M, N, tiles = G[4], G[5], G[6], G[11], G[7], G[8], G[9], G[12]
    world = G[16]
    tile = _swept_tile(task, G[15], world, tiles)  # the others' ranges, in the order their owners finish them
    ready = ctr_ptr + tiles + tile
    pkl.wait(ready, 1, hc)
    tl.store(ready, 0)
    pid_m, pid_n = tile_coords(tile, M, N, C[0], C[1], C[3])
    half: tl.constexpr = C[1] // 2
    src = pkl.peer_descriptor(res_ptr, hr, _owner(tile, world, tiles), [M, N], [N, 1], [C[0], half])
    for j in range(2):
        out.store([pid_m * C[0], pid_n * C[1] + j * half], src.load([pid_m * C[0], pid_n * C[1] + j * half]))


@triton.jit(do_not_specialize=["num_comm", "rank"])
def _mm_ar_kernel(a_desc, b_desc, buf_ptr, hb, buf_desc, res_ptr, hr, res_desc, out_desc, hc, M, N, K, ctr_ptr,
                  tiles, num_comm_tasks, num_comm, skip_ptr, rank, world, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr):
    G = (a_desc, b_desc, buf_ptr, hb, res_ptr, hr, out_desc, hc, M, N, K, ctr_ptr, tiles, buf_desc, res_desc, rank,
         world)
    lcsc(G, (BM, BN, BK, GROUP_M, STAGES), tiles, num_comm_tasks, num_comm, None, _consumer, _storer, _communicator,
         agreed(skip_ptr))


def matmul_all_reduce(a: torch.Tensor, b: torch.Tensor, *, num_comm_sms: int | None = None,
                      config: MatmulConfig | None = None) -> torch.Tensor:
    """sum over ranks of a @ b: `a` is (M, K/W), `b` (K/W, N); returns the full (M, N) sum on every rank.

    Collective. bf16, fp16 or fp32 (tf32 on a GPU); fp32 accumulation in the GEMM, shares of other ranks summed
    in the input dtype (as NCCL does); K/W and N multiples of 8. `num_comm_sms` communicator programs read
    the results of other ranks' tiles; None picks the count by timing the candidates (`ops._tuning`), the same
    on every rank (none at one rank).
    """
    op = "matmul_all_reduce"
    a, b, cfg = prepare(op, a, b, config, num_comm_sms)
    ctx = context()
    world = ctx.local_world_size
    M, K = a.shape
    N = b.shape[1]
    sig = signature(op, tuple(a.shape), tuple(b.shape), str(a.dtype), num_comm_sms, cfg)
    agree(op, sig)
    skip = agreement()(sig)  # first: what follows may be a host step all ranks take together (confirm_agreement)
    out = torch.empty(M, N, dtype=a.dtype, device=a.device)
    tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
    ws = workspace(op)
    buf, buf_handle = ws.view((M, N), a.dtype, slot=0, zero=True)  # shares added in by peers; owners re-zero
    res, res_handle = ws.view((M, N), a.dtype, slot=1)  # the sums of this rank's tiles, read by peers
    ctr, ctr_handle = ws.view((2 * tiles,), torch.int32, slot=2, zero=True)  # shares in, result ready; per tile
    num_comm = comm_programs(num_comm_sms, (op, tuple(a.shape), tuple(b.shape), a.dtype, cfg),
                             lambda count: matmul_all_reduce(a, b, num_comm_sms=count, config=cfg))
    not_mine = tiles - ((ctx.local_rank + 1) * tiles // world - ctx.local_rank * tiles // world)
    if M == 0 or N == 0:  # only after the agreement: a rank that left before it would leave its peers waiting
        return out
    half = [cfg.block_m, cfg.block_n // 2]
    launch(_mm_ar_kernel, grid(tiles, num_comm), descriptor(a, [cfg.block_m, cfg.block_k]),
           descriptor(b, [cfg.block_k, cfg.block_n]), buf, buf_handle, descriptor(buf, half), res, res_handle,
           descriptor(res, half), descriptor(out, half), ctr_handle, M, N, K, ctr, tiles, not_mine,
           num_comm=num_comm, skip_ptr=skip, rank=ctx.local_rank, world=world, BM=cfg.block_m, BN=cfg.block_n,
           BK=cfg.block_k, GROUP_M=cfg.group_m, STAGES=cfg.num_stages, num_warps=cfg.num_warps, key=sig)
    return out


@torch.library.custom_op("parallelkittens::matmul_all_reduce", mutates_args=())
def _matmul_all_reduce_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`matmul_all_reduce` as a torch custom op (default configuration), for code compiled with torch.compile."""
    return matmul_all_reduce(a, b)


@_matmul_all_reduce_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[1])

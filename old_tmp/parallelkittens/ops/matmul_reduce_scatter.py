"""matmul_reduce_scatter: this rank's row block of sum over ranks of a @ b (the paper's GEMM+RS).

Schedule (intra-SM, no communicator, one kernel). The output rows are split into W row blocks, block r owned by
rank r, and each block is tiled on its own. A rank sweeps the blocks starting at the next rank's and ending with
its own, so that at any moment the ranks add into different owners. A tile of another rank's block is added
into the owner's symmetric buffer with one tensor-descriptor reduce-add (TMA ``cp.reduce.async.bulk``) in the
input dtype, and the owner's counter for that tile is signalled. A tile of this rank's own block comes last: its
fp32 partial stays in registers, the program waits until the W - 1 peers' shares of the tile are in, adds them
in fp32, writes the output tile and zeroes the buffer tile for the next call. No accumulator pass, no finish
kernel; at one rank it is the plain persistent GEMM with the output tile written once.

Across ranks the shares are summed in the input dtype, as NCCL's reduce-scatter sums bf16 in bf16 (half the
bytes on NVLink of an fp32 share); the owner's own share and the final add are fp32. The order in which shares
land varies, so bf16 results may differ in the last bit from call to call.

Before the kernel the ranks compare the call on the device (`Agreement`); that meeting is also what orders one
call after the previous one (no rank adds into a buffer before its owner has read and zeroed it). If they
disagree, every rank skips the call and `pk.sync()` raises `MismatchError`.
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
from ._collective import agree, agreed, agreement, signature, workspace
from .matmul import MatmulConfig, column_halves, descriptor, mainloop, prepare, tile_coords


def reference_matmul_reduce_scatter(a_parts: list[torch.Tensor], b_parts: list[torch.Tensor], rank: int
                                    ) -> torch.Tensor:
    """Rank `rank`'s row block of sum_r a_r @ b_r, in float64."""
    total = sum(a.double() @ b.double() for a, b in zip(a_parts, b_parts, strict=True))
    return total.chunk(len(a_parts))[rank]


@triton.jit
def push_share(left, right, buf_ptr, hb, owner, counter, hc, rows, N, row, col, BM: tl.constexpr,
               HALF: tl.constexpr):
    """Add this rank's share of a tile (its fp32 column halves, rounded to the buffer's dtype) into `owner`'s
    (rows, N) buffer with two TMA reduce-adds, then signal the tile's counter on `owner`."""
    dtype = buf_ptr.dtype.element_ty
    dst = pkl.peer_descriptor(buf_ptr, hb, owner, [rows, N], [N, 1], [BM, HALF])
    dst.atomic_add([row, col], left.to(dtype))
    dst.atomic_add([row, col + HALF], right.to(dtype))
    pkl.signal(counter, hc, owner)


@triton.jit
def take_shares(left, right, buf, counter, hc, world, row, col, BM: tl.constexpr, HALF: tl.constexpr):
    """The owner's side: wait for the `world` - 1 peers' shares of the tile, add them to its own fp32 halves, and
    leave the buffer tile (`buf`: the local buffer's descriptor, (BM, HALF) blocks) and the counter at zero for
    the next call. Returns the summed halves."""
    if world > 1:
        pkl.wait(counter, world - 1, hc)
        tl.store(counter, 0)
        left += buf.load([row, col]).to(tl.float32)
        right += buf.load([row, col + HALF]).to(tl.float32)
        buf.store([row, col], tl.zeros([BM, HALF], buf.dtype))
        buf.store([row, col + HALF], tl.zeros([BM, HALF], buf.dtype))
    return left, right


@triton.jit
def _consumer(G, C, task, loader):
    a_desc, b_desc, N, K, m_block, per_owner = G[0], G[1], G[8], G[9], G[10], G[11]
    owner = (G[13] + 1 + task // per_owner) % G[14]  # the next rank's block first, its own last
    pid_m, pid_n = tile_coords(task % per_owner, m_block, N, C[0], C[1], C[3])
    # A's descriptor covers all of A: a tile past the end of the owner's block reads the next block's rows,
    # whose results the clipped stores below drop.
    acc = mainloop(a_desc, b_desc, owner * m_block + pid_m * C[0], pid_n * C[1], K, C[0], C[1], C[2], C[4])
    return acc, owner, pid_m * C[0], pid_n * C[1]


@triton.jit
def _storer(G, C, task, result):
    acc, owner, row, col = result
    buf_ptr, hb, ctr_ptr, hc, out, N, m_block, per_owner = G[2], G[3], G[4], G[5], G[6], G[8], G[10], G[11]
    counter = ctr_ptr + task % per_owner
    left, right = column_halves(acc, C[0], C[1])
    half: tl.constexpr = C[1] // 2
    if owner != G[13]:
        push_share(left, right, buf_ptr, hb, owner, counter, hc, m_block, N, row, col, C[0], half)
    else:
        left, right = take_shares(left, right, G[12], counter, hc, G[14], row, col, C[0], half)
        out.store([row, col], left.to(out.dtype))
        out.store([row, col + half], right.to(out.dtype))


@triton.jit(do_not_specialize=["rank"])  # one binary for every rank (Triton would fold rank 1 into a constant)
def _mm_rs_kernel(a_desc, b_desc, buf_ptr, hb, buf_desc, ctr_ptr, hc, out_desc, M, N, K, m_block, per_owner,
                  skip_ptr, rank, world, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  GROUP_M: tl.constexpr, STAGES: tl.constexpr):
    G = (a_desc, b_desc, buf_ptr, hb, ctr_ptr, hc, out_desc, M, N, K, m_block, per_owner, buf_desc, rank, world)
    lcsc(G, (BM, BN, BK, GROUP_M, STAGES), world * per_owner, 0, 0, None, _consumer, _storer, None,
         agreed(skip_ptr))


def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, *, config: MatmulConfig | None = None) -> torch.Tensor:
    """Sum over ranks of a @ b, scattered by rows: `a` is (M, K/W), `b` (K/W, N); returns (M/W, N).

    Collective. bf16, fp16 or fp32 (tf32 on a GPU); fp32 accumulation in the GEMM, shares of other ranks summed
    in the input dtype (as NCCL does); M must divide by the world size; K/W and N multiples of 8 (TMA rows).
    """
    op = "matmul_reduce_scatter"
    a, b, cfg = prepare(op, a, b, config)
    world = context().local_world_size
    M, K = a.shape
    N = b.shape[1]
    sig = signature(op, tuple(a.shape), tuple(b.shape), str(a.dtype), cfg)
    agree(op, sig)
    skip = agreement()(sig)  # first: what follows may be a host step all ranks take together (confirm_agreement)
    # Errors that may hold on some ranks only, and empty calls, leave only after the agreement: a rank that left
    # before it would leave its peers waiting there; after it, they skip their kernels and raise MismatchError.
    if M % world:
        raise PKError(f"{op}: M={M} rows do not divide by the world size {world}")
    m_block = M // world
    out = torch.empty(m_block, N, dtype=a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    per_owner = cdiv(m_block, cfg.block_m) * cdiv(N, cfg.block_n)  # tiles in one rank's row block
    ws = workspace(op)
    buf, buf_handle = ws.view((m_block, N), a.dtype, slot=0, zero=True)  # the peers' shares; owners re-zero it
    ctr, ctr_handle = ws.view((per_owner,), torch.int32, slot=1, zero=True)  # shares in, per tile; owners reset
    half = [cfg.block_m, cfg.block_n // 2]
    launch(_mm_rs_kernel, grid(world * per_owner, 0), descriptor(a, [cfg.block_m, cfg.block_k]),
           descriptor(b, [cfg.block_k, cfg.block_n]), buf, buf_handle, descriptor(buf, half), ctr, ctr_handle,
           descriptor(out, half), M, N, K, m_block, per_owner, skip, context().local_rank, world, BM=cfg.block_m,
           BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, STAGES=cfg.num_stages, num_warps=cfg.num_warps,
           key=sig)
    return out


@torch.library.custom_op("parallelkittens::matmul_reduce_scatter", mutates_args=())
def _matmul_reduce_scatter_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`matmul_reduce_scatter` as a torch custom op (default configuration), for code compiled with torch.compile."""
    return matmul_reduce_scatter(a, b)


@_matmul_reduce_scatter_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0] // context().local_world_size, b.shape[1])

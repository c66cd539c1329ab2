"""The attention forward's Hopper variant, written in Gluon: warp-specialised, FA3's layout.

Triton's `tl` forward (`flash._fwd_kernel`) runs a query tile's products and its softmax in the same warps, one
after the other, so the tensor cores wait while the exponentials run (docs/performance.md has how far that stays
from cuDNN). Triton's automatic warp specialisation of that loop hung on a GPU (docs/attention.md). Here, written
out:

* a producer warp loads the query tile once and each key tile's K and V through TMA into a ring of stages;
* two consumer warp groups each own 64 of the tile's 128 query rows. They take turns issuing their products
  (`turns`), so one group's softmax runs while the other's products keep the tensor cores busy; and each issues
  the next tile's scores (S = Q K^T) before the previous tile's P V, so that its softmax overlaps its own P V.

Stages pass on mbarriers: `k_ready[s]` / `v_ready[s]` complete when stage s's K / V land (the TMA's byte count);
`k_free[s]` when both groups have their scores from it, `v_free[s]` when both have used its V. Key tile j uses
stage j % STAGES, so every side computes stages and phases from j: no shared counters.

Scope: Hopper, bf16 and fp16, head dims 64 and 128, either layout, grouped-query heads, causal or not, a plain
call's positions (the ring's segments go through `flash`). K and V are read per head through 3-D TMA descriptors
(zeros past a head's last key), Q as a matrix of D-wide rows (rows past a head's end are computed and never stored)
(`views`). Gluon has no interpreter: the CPU tests run `flash`'s kernel, `tests/test_compile.py` compiles this one
for sm_90, and the GPU tests compare it with float64.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..descriptors import GLUON, gluon_descriptor, hopper_gluon, shared_layout

BLOCK_M = 128  # query rows per program: two consumer warp groups of 64
HEAD_DIMS = (64, 128)


class Sizes(NamedTuple):
    """The kernel's run-time sizes: heads, rows, where each head's rows lie in the TMA views (`views`), the output's
    strides and the softmax scale (with log2(e))."""

    H: object
    GROUP: object
    N_Q: object
    N_K: object
    q_rows_b: object
    q_rows_h: object
    kv_outer_b: object
    kv_outer_h: object
    q_cols: object
    kv_cols: object
    stride_ob: object
    stride_oh: object
    stride_on: object
    qk_scale: object

if GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

    from ..descriptors import tma_load as _tma_load

    @gluon.jit
    def _tile_and_head(CAUSAL: gl.constexpr):
        """(query tile, batch x head) of this program; under the causal mask the heaviest tiles start first."""
        tile = gl.program_id(0)
        if CAUSAL:
            tile = gl.num_programs(0) - 1 - tile
        return tile, gl.program_id(1)

    @gluon.jit
    def _rows(bufs, stage):
        """Stage `stage` of a K or V ring, (1, BLOCK_N, HEAD_DIM) as TMA wrote it, as the (BLOCK_N, HEAD_DIM) tile."""
        return bufs.index(stage).reshape([bufs.type.shape[2], bufs.type.shape[3]])

    @gluon.jit
    def _key_tiles(tile, N_K, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
        """How many key tiles the query tile `tile` sees (query i sees key j <= i when CAUSAL)."""
        end = N_K
        if CAUSAL:
            end = gl.minimum(N_K, (tile + 1) * 128)
        return gl.cdiv(end, BLOCK_N)

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, k_free, v_free, S,
                  CAUSAL: gl.constexpr):
        """One warp: the query tile's two halves, then every key tile's K and V, each into the next free stage."""
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
        STAGES: gl.constexpr = k_bufs.type.shape[0]
        tile, bh = _tile_and_head(CAUSAL)
        b, h = bh // S.H, bh % S.H
        kv_h = h // S.GROUP
        q_row = b * S.q_rows_b + h * S.q_rows_h + tile * 128
        mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
        _tma_load(q_desc, [q_row, h * S.q_cols], q_ready, q_smem.index(0))
        _tma_load(q_desc, [q_row + 64, h * S.q_cols], q_ready, q_smem.index(1))
        kv_outer = b * S.kv_outer_b + kv_h * S.kv_outer_h
        for j in range(_key_tiles(tile, S.N_K, CAUSAL, BLOCK_N)):
            s = j % STAGES
            free_phase = (j // STAGES & 1) ^ 1  # a fresh barrier counts as freed once
            mbarrier.wait(k_free.index(s), free_phase)
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            _tma_load(k_desc, [kv_outer, j * BLOCK_N, kv_h * S.kv_cols], k_ready.index(s), k_bufs.index(s))
            mbarrier.wait(v_free.index(s), free_phase)
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            _tma_load(v_desc, [kv_outer, j * BLOCK_N, kv_h * S.kv_cols], v_ready.index(s), v_bufs.index(s))

    @gluon.jit
    def _softmax(s, m, denom, j, first_row, N_K, qk_scale, p_layout: gl.constexpr, dtype: gl.constexpr,
                 CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
        """Key tile j's scores `s` (64, BLOCK_N) into probabilities (unnormalised, base 2; in `dtype` and
        `p_layout`, P V's register operand), with the rows' new running maxima and sums, and the factor that
        rescales what came before."""
        s_layout: gl.constexpr = s.type.layout
        hidden = (j + 1) * BLOCK_N > N_K  # the tile holds keys some row may not see
        if CAUSAL:
            hidden = hidden | ((j + 1) * BLOCK_N > first_row + 1)
        if hidden:
            cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            keep = gl.expand_dims(cols < N_K, 0)
            if CAUSAL:
                rows = first_row + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
                keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1))
            s = gl.where(keep, s, float("-inf"))
        # every row sees key 0 in tile 0, so its maximum is finite from the first tile on
        m_new = gl.maximum(m, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m - m_new)
        return gl.convert_layout(p.to(dtype), p_layout), m_new, denom * alpha + gl.sum(p, 1), alpha

    @gluon.jit
    def _consumer(q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, k_free, v_free, turns, o_ptr, lse_ptr, S,
                  HALF: gl.constexpr, CAUSAL: gl.constexpr):
        """One warp group: query rows [64 HALF, 64 HALF + 64) of the tile, over every key tile it sees."""
        BLOCK_N: gl.constexpr = k_bufs.type.shape[2]
        HEAD_DIM: gl.constexpr = k_bufs.type.shape[3]
        STAGES: gl.constexpr = k_bufs.type.shape[0]
        dtype: gl.constexpr = k_bufs.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        tile, bh = _tile_and_head(CAUSAL)
        first_row = tile * 128 + HALF * 64
        n = _key_tiles(tile, S.N_K, CAUSAL, BLOCK_N)
        q = q_smem.index(HALF)
        zeros = gl.zeros([64, BLOCK_N], gl.float32, s_layout)
        acc = gl.zeros([64, HEAD_DIM], gl.float32, o_layout)
        m = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        denom = gl.zeros([64], gl.float32, gl.SliceLayout(1, s_layout))
        mbarrier.wait(q_ready, 0)

        # key tile 0: its scores alone
        mbarrier.wait(k_ready.index(0), 0)
        mbarrier.wait(turns.index(HALF), HALF ^ 1)  # group 0 has the first turn
        s = warpgroup_mma(q, _rows(k_bufs, 0).permute((1, 0)), zeros, use_acc=False, is_async=True)
        mbarrier.arrive(turns.index(1 - HALF))
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        mbarrier.arrive(k_free.index(0))
        p, m, denom, alpha = _softmax(s, m, denom, 0, first_row, S.N_K, S.qk_scale, p_layout, dtype, CAUSAL, BLOCK_N)
        # then each tile j's scores issued before tile j - 1's P V: the softmax of j overlaps that product
        for j in range(1, n):
            s_idx, prev = j % STAGES, (j - 1) % STAGES
            mbarrier.wait(k_ready.index(s_idx), j // STAGES & 1)
            mbarrier.wait(v_ready.index(prev), (j - 1) // STAGES & 1)
            mbarrier.wait(turns.index(HALF), (j & 1) ^ HALF ^ 1)
            s = warpgroup_mma(q, _rows(k_bufs, s_idx).permute((1, 0)), zeros, use_acc=False, is_async=True)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            acc = warpgroup_mma(p, _rows(v_bufs, prev), acc, is_async=True)
            mbarrier.arrive(turns.index(1 - HALF))
            s, p = warpgroup_mma_wait(num_outstanding=1, deps=(s, p))  # the scores (issued first) are done
            mbarrier.arrive(k_free.index(s_idx))
            p, m, denom, alpha = _softmax(s, m, denom, j, first_row, S.N_K, S.qk_scale, p_layout, dtype, CAUSAL,
                                          BLOCK_N)
            acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p))
            mbarrier.arrive(v_free.index(prev))
        # the last tile's P V
        last = (n - 1) % STAGES
        mbarrier.wait(v_ready.index(last), (n - 1) // STAGES & 1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        acc = warpgroup_mma(p, _rows(v_bufs, last), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(v_free.index(last))

        # out = acc / denom, lse = m + log2(denom) (natural log in memory); rows past S.N_Q are not written
        out = acc / gl.expand_dims(gl.convert_layout(denom, gl.SliceLayout(1, o_layout)), 1)
        rows = first_row + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
        dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        b, h = (bh // S.H).to(gl.int64), (bh % S.H).to(gl.int64)
        o_rows = b * S.stride_ob + h * S.stride_oh + rows.to(gl.int64) * S.stride_on
        o_ptrs = o_ptr + gl.expand_dims(o_rows, 1) + gl.expand_dims(dims, 0)
        gl.store(o_ptrs, out.to(dtype), mask=gl.expand_dims(rows < S.N_Q, 1))
        lse_rows = first_row + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
        lse = (m + gl.log2(denom)) * 0.6931471805599453
        gl.store(lse_ptr + bh.to(gl.int64) * S.N_Q + lse_rows, lse, mask=lse_rows < S.N_Q)

    @gluon.jit
    def _second_consumer(q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, k_free, v_free, turns, o_ptr, lse_ptr,
                         S, CAUSAL: gl.constexpr):
        _consumer(q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, k_free, v_free, turns, o_ptr, lse_ptr, S, 1,
                  CAUSAL)

    @gluon.jit
    def _fwd_ws_kernel(q_desc, k_desc, v_desc, o_ptr, lse_ptr, S, CAUSAL: gl.constexpr, STAGES: gl.constexpr):
        dtype: gl.constexpr = q_desc.dtype
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
        HEAD_DIM: gl.constexpr = k_desc.block_type.shape[2]
        q_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], q_desc.layout)
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_ready, count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(s), count=1)
            mbarrier.init(v_ready.index(s), count=1)
            mbarrier.init(k_free.index(s), count=2)  # both consumer groups read every stage
            mbarrier.init(v_free.index(s), count=2)
        for c in gl.static_range(2):
            mbarrier.init(turns.index(c), count=1)
        gl.warp_specialize([
            (_consumer, (q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, k_free, v_free, turns, o_ptr, lse_ptr,
                         S, 0, CAUSAL)),
            (_second_consumer, (q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, k_free, v_free, turns, o_ptr,
                                lse_ptr, S, CAUSAL)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, k_free, v_free,
                         S, CAUSAL)),
        ], [4, 1], [232, 40])


@functools.cache  # asked at every plan build: the driver query costs microseconds
def usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether this kernel can run here: Gluon, a Hopper GPU, a 16-bit dtype, head dim 64 or 128."""
    return hopper_gluon(device, dtype) and head_dim in HEAD_DIMS


def views(shape: tuple[int, ...], layout: str) -> dict:
    """How the kernel reads a q of `shape` (B, H, N, D), or (B, N, H, D) with layout "BSHD", and k and v of that
    shape: q as a 2-D matrix of D-wide rows (rows past a head's end come from the next head and are never
    written back), k and v as 3-D (outer, N, columns) so that TMA gives zeros past a head's last key. Returns the
    views' (shape, strides), where head h of batch b starts (rows or outer index per b and per h) and its
    column (per h)."""
    if layout == "BHND":
        B, H, N, D = shape
        return {"matrix": ([B * H * N, D], [D, 1]), "rows": ([B * H, N, D], [N * D, D, 1]), "per_b": H * N,
                "per_h": N, "outer_b": H, "outer_h": 1, "cols": 0}
    B, N, H, D = shape
    return {"matrix": ([B * N, H * D], [H * D, 1]), "rows": ([B, N, H * D], [N * H * D, H * D, 1]), "per_b": N,
            "per_h": 0, "outer_b": 1, "outer_h": 0, "cols": D}


def describer(dtype: torch.dtype, block: tuple[int, ...], view: tuple[list[int], list[int]]):
    """The function making a TMA descriptor over a contiguous q, k or v read as `view` (shape, strides; `views`)
    in blocks of `block`, for `Launcher`'s `descriptors` (the plan checked the tensors)."""
    return functools.partial(gluon_descriptor, block=list(block), layout=shared_layout(dtype, tuple(block)),
                             view=view)


def shared_bytes(head_dim: int, block_n: int, stages: int, itemsize: int = 2) -> int:
    """Shared memory the kernel needs: the query tile's two halves, K and V per stage, and the barriers."""
    return itemsize * (BLOCK_M * head_dim + stages * 2 * block_n * head_dim) + 1024

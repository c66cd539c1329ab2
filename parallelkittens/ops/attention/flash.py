"""Flash attention in Triton, forward and backward: the single-GPU core that ring and Ulysses attention run.

``attention(q, k, v, causal=False, softmax_scale=None, return_lse=False)`` on (B, H, N, D) tensors: bf16, fp16
or fp32, head dims 64 and 128 (and 16, 32 for small tests), grouped-query heads (k and v with Hkv heads, Hq a
multiple of Hkv: query head h reads key/value head h // (Hq / Hkv)), any sequence lengths. The forward returns
the output and the log-sum-exp of each row (fp32, natural log); the backward recomputes the probabilities from
the log-sum-exp (no N x N matrix is ever stored).

**Positions.** Every kernel places its queries and keys on the sequence through two segments: local index i is at
``seg0 + i`` for i < seg_len, else at ``seg1 + i - seg_len``. One segment is a contiguous block (the plain op,
and ring attention's contiguous layout); two are ring attention's zigzag layout, where a rank holds chunks r and
2W - 1 - r. Positions grow with the index in both, so the keys a query tile sees under the causal mask are a
prefix of any key block: the loops stop at the last key tile any query of the tile sees (fully masked tiles are
never computed) and mask only where a tile straddles the diagonal.

**Forward** (`_fwd_kernel`): one program per (query tile, batch x head), online softmax in base 2 over the key
tiles, fp32 accumulation. With `MERGE`, the tile's partial result is merged by log-sum-exp into a running fp32
accumulator and log-sum-exp instead of being written out: ring attention's steps.
**Backward**: `_bwd_preprocess` computes delta = rowsum(dO * O); `_bwd_dkdv_kernel` gives one program per
(key tile, batch x key/value head), which loops over the group's query heads and the query tiles that see it and
writes dK and dV (no atomics: the GQA sum happens inside the program); `_bwd_dq_kernel` gives one program per
query tile and writes dQ. With `ACCUMULATE` the gradients are added into fp32 buffers (ring attention).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...runtime.context import context
from ...runtime.errors import PKError
from ...runtime.launch import Launcher
from ...runtime.sizes import cdiv
from .. import plan as plans
from ..gemm.matmul import descriptor
from . import flash_hopper

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HEAD_DIMS = (16, 32, 64, 128)
LOG2E = 1.4426950408889634
_LOG2E, _LN2 = tl.constexpr(LOG2E), tl.constexpr(1 / LOG2E)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                        softmax_scale: float | None = None, q_positions: torch.Tensor | None = None,
                        k_positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp) in float64, the plain way; positions default to 0..N-1 (a query sees keys at or
    before its position when `causal`). Rows that see no key give zeros and -inf."""
    q64, k64, v64 = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k64, v64 = k64.repeat_interleave(group, dim=1), v64.repeat_interleave(group, dim=1)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = (q64 @ k64.transpose(-1, -2)) * scale
    if causal:
        qp = q_positions if q_positions is not None else torch.arange(q.shape[2])
        kp = k_positions if k_positions is not None else torch.arange(k.shape[2])
        visible = kp.to(q64.device)[None, :] <= qp.to(q64.device)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse[..., None].masked_fill(lse[..., None] == float("-inf"), 0))
    return p @ v64, lse


@triton.jit
def position(idx, seg_len, seg0, seg1):
    """Where local index `idx` sits on the sequence: segment 0 holds the first `seg_len` indices."""
    return tl.where(idx < seg_len, seg0 + idx, seg1 + idx - seg_len)


@triton.jit
def _visible_end(q_last_pos, n_k, k_seg_len, k_seg0, k_seg1, CAUSAL: tl.constexpr):
    """One past the last local key index a query at `q_last_pos` may see (all `n_k` keys when not causal)."""
    if CAUSAL:
        in_seg0 = tl.minimum(tl.maximum(q_last_pos - k_seg0 + 1, 0), k_seg_len)
        in_seg1 = tl.minimum(tl.maximum(q_last_pos - k_seg1 + 1, 0), n_k - k_seg_len)
        return tl.where(in_seg0 < k_seg_len, in_seg0, k_seg_len + in_seg1)
    else:
        return n_k


@triton.jit
def key_bounds(q_pos, n_k, k_seg_len, k_seg0, k_seg1, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """(whole, end) of a query tile at positions `q_pos`: key indices [0, whole) are whole tiles every query of
    the tile sees (no mask needed); [whole, end) hold the diagonal and the ragged end; keys from `end` on are
    seen by none."""
    end = _visible_end(tl.max(q_pos, 0), n_k, k_seg_len, k_seg0, k_seg1, CAUSAL)
    whole = tl.minimum(_visible_end(tl.min(q_pos, 0), n_k, k_seg_len, k_seg0, k_seg1, CAUSAL), end)
    return (whole // BLOCK_N) * BLOCK_N, end


@triton.jit
def attend(q, k_src, v_src, b, kv_h, stride_kn, stride_vn, n_k, q_pos, k_seg_len, k_seg0, k_seg1, qk_scale,
           CAUSAL: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           HEAD_DIM: tl.constexpr):
    """The unnormalised attention of one query tile `q` (BLOCK_M, HEAD_DIM) over the keys and values of batch `b`,
    head `kv_h` (`_kv_rows`): (acc, m, denom) with acc = sum_j exp2(s_j - m) v_j, denom = sum_j exp2(s_j - m), m
    the rows' running maxima, all fp32 and in base 2 (s = q.k * qk_scale, qk_scale including log2(e)). Key tiles
    every query of the tile sees whole run without masks; the rest (the diagonal, the ragged end) with them."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    whole, end = key_bounds(q_pos, n_k, k_seg_len, k_seg0, k_seg1, CAUSAL, BLOCK_N)
    acc, m, denom = _attend_keys(acc, m, denom, q, k_src, v_src, b, kv_h, stride_kn, stride_vn, n_k, q_pos,
                                 k_seg_len, k_seg0, k_seg1, qk_scale, 0, whole, False, CAUSAL, TMA, BLOCK_N, HEAD_DIM)
    return _attend_keys(acc, m, denom, q, k_src, v_src, b, kv_h, stride_kn, stride_vn, n_k, q_pos, k_seg_len, k_seg0,
                        k_seg1, qk_scale, whole, end, True, CAUSAL, TMA, BLOCK_N, HEAD_DIM)


@triton.jit
def _kv_rows(src, b, kv_h, start, stride_n, n_k, MASKED: tl.constexpr, TMA: tl.constexpr, BLOCK_N: tl.constexpr,
             HEAD_DIM: tl.constexpr):
    """Key (or value) rows [start, start + BLOCK_N) of batch `b`, head `kv_h`: with TMA, through the descriptor
    `src` over (B, H_KV, N_K, HEAD_DIM) (rows past the end come as zeros); else `src` points at that head's first
    row and the rows are `stride_n` apart (masked past the end when MASKED)."""
    if TMA:
        return src.load([b.to(tl.int32), kv_h.to(tl.int32), start, 0]).reshape(BLOCK_N, HEAD_DIM)
    else:
        offs_n = start + tl.arange(0, BLOCK_N)
        ptrs = src + offs_n[:, None] * stride_n + tl.arange(0, HEAD_DIM)[None, :]
        if MASKED:
            return tl.load(ptrs, mask=(offs_n < n_k)[:, None], other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def _attend_keys(acc, m, denom, q, k_src, v_src, b, kv_h, stride_kn, stride_vn, n_k, q_pos, k_seg_len, k_seg0,
                 k_seg1, qk_scale, lo, hi, MASKED: tl.constexpr, CAUSAL: tl.constexpr, TMA: tl.constexpr,
                 BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """`attend`'s online softmax over key indices [lo, hi), with the masks only when MASKED."""
    for start in range(lo, hi, BLOCK_N):
        k = _kv_rows(k_src, b, kv_h, start, stride_kn, n_k, MASKED, TMA, BLOCK_N, HEAD_DIM)
        s = tl.dot(q, tl.trans(k))  # unscaled: the scale goes into the rows' maxima and one fused multiply-add
        if MASKED:
            offs_n = start + tl.arange(0, BLOCK_N)
            keep = (offs_n < n_k)[None, :]
            if CAUSAL:
                keep = keep & (position(offs_n, k_seg_len, k_seg0, k_seg1)[None, :] <= q_pos[:, None])
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1) * qk_scale)  # qk_scale > 0: the scaled maximum is the maximum scaled
        if MASKED:  # a row that has seen no key yet keeps m = -inf; unmasked scores are all finite
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_safe = m_new
        p = tl.math.exp2(s * qk_scale - m_safe[:, None])
        alpha = tl.math.exp2(m - m_safe)
        v = _kv_rows(v_src, b, kv_h, start, stride_vn, n_k, MASKED, TMA, BLOCK_N, HEAD_DIM)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])  # the product accumulates in place (no 2nd tile)
        denom = denom * alpha + tl.sum(p, 1)
        m = m_new
    return acc, m, denom


class Fwd(NamedTuple):
    """The forward's run-time values in a kernel: pointers, sizes, strides and positions."""

    q_ptr: object
    k_ptr: object  # a pointer, or with FwdTiles.TMA a descriptor
    v_ptr: object
    o_ptr: object  # the output (dtype), or None while merging into `acc_ptr`
    lse_ptr: object  # (B, H, N_Q) fp32, natural log
    acc_ptr: object  # (B, H, N_Q, D) fp32 running result (MERGE), or None
    H: object
    GROUP: object
    N_Q: object
    N_K: object
    stride_qb: object
    stride_qh: object
    stride_qn: object
    stride_kb: object
    stride_kh: object
    stride_kn: object
    stride_ob: object
    stride_oh: object
    stride_on: object
    q_seg_len: object
    q_seg0: object
    q_seg1: object
    k_seg_len: object
    k_seg0: object
    k_seg1: object
    qk_scale: object


class FwdTiles(NamedTuple):
    CAUSAL: tl.constexpr
    TMA: tl.constexpr  # q_ptr, k_ptr and v_ptr are TMA descriptors over (B, heads, rows, HEAD_DIM) (`_kv_rows`)
    MERGE: tl.constexpr  # merge into the running fp32 result instead of writing the output
    FINAL: tl.constexpr  # merging, and this is the last block: write the merged result to the output
    BLOCK_M: tl.constexpr
    BLOCK_N: tl.constexpr
    HEAD_DIM: tl.constexpr


@triton.jit
def fwd_task(F, C, tile, bh):
    """Attention of query tile `tile` of batch x head `bh` over all of F's keys (see the module's docstring)."""
    bh = bh.to(tl.int64)
    b, h = bh // F.H, bh % F.H
    kv_h = h // F.GROUP
    offs_m = tile * C.BLOCK_M + tl.arange(0, C.BLOCK_M)
    dims = tl.arange(0, C.HEAD_DIM)
    rows = offs_m < F.N_Q
    if C.TMA:  # rows past the end come as zeros
        q = F.q_ptr.load([b.to(tl.int32), h.to(tl.int32), tile * C.BLOCK_M, 0]).reshape(C.BLOCK_M, C.HEAD_DIM)
    else:
        q = tl.load(F.q_ptr + b * F.stride_qb + h * F.stride_qh + offs_m[:, None] * F.stride_qn + dims[None, :],
                    mask=rows[:, None], other=0.0)
    q_pos = position(offs_m, F.q_seg_len, F.q_seg0, F.q_seg1)
    q_pos = tl.where(rows, q_pos, tl.min(q_pos, 0))  # rows past the end see no more than the tile's first
    if C.TMA:  # descriptors over every head
        k_src, v_src = F.k_ptr, F.v_ptr
    else:
        k_src, v_src = F.k_ptr + b * F.stride_kb + kv_h * F.stride_kh, F.v_ptr + b * F.stride_kb + kv_h * F.stride_kh
    acc, m, denom = attend(q, k_src, v_src, b, kv_h, F.stride_kn, F.stride_kn, F.N_K, q_pos, F.k_seg_len, F.k_seg0,
                           F.k_seg1, F.qk_scale, C.CAUSAL, C.TMA, C.BLOCK_M, C.BLOCK_N, C.HEAD_DIM)
    # log-sum-exp in base 2, -inf for rows that saw no key
    seen = denom > 0
    lse2 = tl.where(seen, m + tl.math.log2(tl.where(seen, denom, 1.0)), float("-inf"))
    out = acc / tl.where(seen, denom, 1.0)[:, None]
    lse_rows = F.lse_ptr + bh * F.N_Q + offs_m  # natural log in memory
    o_ptrs = F.o_ptr + b * F.stride_ob + h * F.stride_oh + offs_m[:, None] * F.stride_on + dims[None, :]
    if C.MERGE:  # into the running fp32 result: o = (o e^lse_old + out e^lse_new) / e^lse, lse = log-add-exp
        acc_ptrs = F.acc_ptr + bh * F.N_Q * C.HEAD_DIM + offs_m[:, None] * C.HEAD_DIM + dims[None, :]
        old = tl.load(lse_rows, mask=rows, other=float("-inf")) * _LOG2E
        top = tl.maximum(old, lse2)
        top_safe = tl.where(top == float("-inf"), 0.0, top)
        w_old, w_new = tl.math.exp2(old - top_safe), tl.math.exp2(lse2 - top_safe)
        total = w_old + w_new
        merged = tl.load(acc_ptrs, mask=rows[:, None], other=0.0) * w_old[:, None] + out * w_new[:, None]
        merged = merged / tl.where(total > 0, total, 1.0)[:, None]
        if C.FINAL:
            tl.store(o_ptrs, merged.to(F.o_ptr.dtype.element_ty), mask=rows[:, None])
        else:
            tl.store(acc_ptrs, merged, mask=rows[:, None])
        merged_lse = tl.where(total > 0, top_safe + tl.math.log2(tl.where(total > 0, total, 1.0)), float("-inf"))
        tl.store(lse_rows, merged_lse * _LN2, mask=rows)
    else:
        tl.store(o_ptrs, out.to(F.o_ptr.dtype.element_ty), mask=rows[:, None])
        tl.store(lse_rows, lse2 * _LN2, mask=rows)


@triton.jit
def _heavy_first(CAUSAL: tl.constexpr):
    """The query tile of this program: under the causal mask the last tiles see the most keys, so they start
    first and the light ones fill the end of the grid."""
    if CAUSAL:
        return tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        return tl.program_id(0)


@triton.jit
def _fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, acc_ptr, H, GROUP, N_Q, N_K, stride_qb, stride_qh, stride_qn,
                stride_kb, stride_kh, stride_kn, stride_ob, stride_oh, stride_on, q_seg_len, q_seg0, q_seg1,
                k_seg_len, k_seg0, k_seg1, qk_scale, CAUSAL: tl.constexpr, MERGE: tl.constexpr,
                FINAL: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    F = Fwd(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, acc_ptr, H, GROUP, N_Q, N_K, stride_qb, stride_qh, stride_qn,
            stride_kb, stride_kh, stride_kn, stride_ob, stride_oh, stride_on, q_seg_len, q_seg0, q_seg1, k_seg_len,
            k_seg0, k_seg1, qk_scale)
    fwd_task(F, FwdTiles(CAUSAL, TMA, MERGE, FINAL, BLOCK_M, BLOCK_N, HEAD_DIM), _heavy_first(CAUSAL),
             tl.program_id(1))


@triton.jit
def _bwd_preprocess(o_ptr, do_ptr, delta_ptr, N, stride_ob, stride_oh, stride_on, H, BLOCK_M: tl.constexpr,
                    HEAD_DIM: tl.constexpr):
    """delta = rowsum(dO * O), fp32: the softmax's Jacobian term of every row."""
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    rows = offs_m < N
    at = b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + dims[None, :]
    o = tl.load(o_ptr + at, mask=rows[:, None], other=0.0).to(tl.float32)
    do = tl.load(do_ptr + at, mask=rows[:, None], other=0.0).to(tl.float32)
    tl.store(delta_ptr + bh * N + offs_m, tl.sum(o * do, 1), mask=rows)


class Bwd(NamedTuple):
    """The backward's run-time values in a kernel. q, dO and dQ share strides, as k, v, dK and dV do; lse
    (natural log) and delta are (B, H, N_Q) fp32."""

    q_ptr: object
    k_ptr: object
    v_ptr: object
    do_ptr: object
    lse_ptr: object
    delta_ptr: object
    dq_ptr: object
    dk_ptr: object
    dv_ptr: object
    H: object
    GROUP: object
    N_Q: object
    N_K: object
    stride_qb: object
    stride_qh: object
    stride_qn: object
    stride_kb: object
    stride_kh: object
    stride_kn: object
    q_seg_len: object
    q_seg0: object
    q_seg1: object
    k_seg_len: object
    k_seg0: object
    k_seg1: object
    qk_scale: object
    sm_scale: object


class BwdTiles(NamedTuple):
    CAUSAL: tl.constexpr
    ACCUMULATE: tl.constexpr  # add the gradients into fp32 buffers instead of writing them
    BLOCK_M: tl.constexpr
    BLOCK_N: tl.constexpr
    HEAD_DIM: tl.constexpr


@triton.jit
def dkdv_task(B, C, tile, bh_kv):
    """dK and dV of key tile `tile` of batch x key/value head `bh_kv`: over the group's query heads and the query
    tiles that see it (the GQA sum inside the program: no atomics)."""
    bh_kv = bh_kv.to(tl.int64)
    H_KV = B.H // B.GROUP
    b, kv_h = bh_kv // H_KV, bh_kv % H_KV
    offs_n = tile * C.BLOCK_N + tl.arange(0, C.BLOCK_N)
    dims = tl.arange(0, C.HEAD_DIM)
    cols = offs_n < B.N_K
    at = b * B.stride_kb + kv_h * B.stride_kh + offs_n[:, None] * B.stride_kn + dims[None, :]
    k = tl.load(B.k_ptr + at, mask=cols[:, None], other=0.0)
    v = tl.load(B.v_ptr + at, mask=cols[:, None], other=0.0)
    k_pos = position(offs_n, B.k_seg_len, B.k_seg0, B.k_seg1)
    first_pos = position(tile * C.BLOCK_N, B.k_seg_len, B.k_seg0, B.k_seg1)  # the tile's first key exists
    start_m = _first_seeing(first_pos, B.N_Q, B.q_seg_len, B.q_seg0, B.q_seg1, C.CAUSAL) // C.BLOCK_M * C.BLOCK_M
    dk = tl.zeros([C.BLOCK_N, C.HEAD_DIM], tl.float32)
    dv = tl.zeros([C.BLOCK_N, C.HEAD_DIM], tl.float32)
    # One loop with the causal test in every step: a masked loop for the diagonal and an unmasked one after it
    # restart the pipeline at every head (measured 8% slower on an H200). Keys past the end need no mask: they
    # reach only their own rows of dK and dV, which are not stored.
    for g in range(B.GROUP):
        h = kv_h * B.GROUP + g
        q_base = B.q_ptr + b * B.stride_qb + h * B.stride_qh
        do_base = B.do_ptr + b * B.stride_qb + h * B.stride_qh
        rows_base = (b * B.H + h) * B.N_Q
        for start in range(start_m, B.N_Q, C.BLOCK_M):
            offs_m = start + tl.arange(0, C.BLOCK_M)
            rows = offs_m < B.N_Q
            q = tl.load(q_base + offs_m[:, None] * B.stride_qn + dims[None, :], mask=rows[:, None], other=0.0)
            do = tl.load(do_base + offs_m[:, None] * B.stride_qn + dims[None, :], mask=rows[:, None], other=0.0)
            lse, delta = _row_stats(B, rows_base, offs_m, rows)
            p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * B.qk_scale - lse[None, :])  # transposed: keys along rows
            if C.CAUSAL:
                keep = k_pos[:, None] <= position(offs_m, B.q_seg_len, B.q_seg0, B.q_seg1)[None, :]
                p_t = tl.where(keep, p_t, 0.0)
            dv = tl.dot(p_t.to(do.dtype), do, dv)
            dp_t = tl.dot(v, tl.trans(do)).to(tl.float32)
            ds_t = p_t * (dp_t - delta[None, :])
            dk = tl.dot(ds_t.to(q.dtype), q, dk)
    dk = dk * B.sm_scale
    if C.ACCUMULATE:
        dk += tl.load(B.dk_ptr + at, mask=cols[:, None], other=0.0)
        dv += tl.load(B.dv_ptr + at, mask=cols[:, None], other=0.0)
    tl.store(B.dk_ptr + at, dk.to(B.dk_ptr.dtype.element_ty), mask=cols[:, None])
    tl.store(B.dv_ptr + at, dv.to(B.dv_ptr.dtype.element_ty), mask=cols[:, None])


@triton.jit
def _row_stats(B, rows_base, offs_m, rows):
    """Log-sum-exp (base 2) and delta of query rows. A row past the end, or one that sees no key (lse = -inf),
    reads lse = +inf, so that its probabilities exp2(s - lse) are 0 without a mask."""
    lse = tl.load(B.lse_ptr + rows_base + offs_m, mask=rows, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * _LOG2E
    return lse, tl.load(B.delta_ptr + rows_base + offs_m, mask=rows, other=0.0)


@triton.jit
def _first_seeing(k_pos, n_q, q_seg_len, q_seg0, q_seg1, CAUSAL: tl.constexpr):
    """The first local query index that sees a key at position `k_pos` (every later one does too)."""
    if CAUSAL:
        # queries before the key's position see nothing of it; positions grow with the index
        in_seg0 = tl.minimum(tl.maximum(k_pos - q_seg0, 0), q_seg_len)
        in_seg1 = tl.minimum(tl.maximum(k_pos - q_seg1, 0), n_q - q_seg_len)
        return tl.where(in_seg0 < q_seg_len, in_seg0, q_seg_len + in_seg1)
    else:
        return 0


@triton.jit
def dq_task(B, C, tile, bh):
    """dQ of query tile `tile` of batch x head `bh`, over the key tiles it sees: whole tiles that every query of
    the tile sees without masks, the diagonal and the ragged end with them."""
    bh = bh.to(tl.int64)
    b, h = bh // B.H, bh % B.H
    kv_h = h // B.GROUP
    offs_m = tile * C.BLOCK_M + tl.arange(0, C.BLOCK_M)
    dims = tl.arange(0, C.HEAD_DIM)
    rows = offs_m < B.N_Q
    at = b * B.stride_qb + h * B.stride_qh + offs_m[:, None] * B.stride_qn + dims[None, :]
    q = tl.load(B.q_ptr + at, mask=rows[:, None], other=0.0)
    do = tl.load(B.do_ptr + at, mask=rows[:, None], other=0.0)
    lse, delta = _row_stats(B, bh * B.N_Q, offs_m, rows)
    q_pos = position(offs_m, B.q_seg_len, B.q_seg0, B.q_seg1)
    q_pos = tl.where(rows, q_pos, tl.min(q_pos, 0))
    k_base = B.k_ptr + b * B.stride_kb + kv_h * B.stride_kh
    v_base = B.v_ptr + b * B.stride_kb + kv_h * B.stride_kh
    dq = tl.zeros([C.BLOCK_M, C.HEAD_DIM], tl.float32)
    whole, end = key_bounds(q_pos, B.N_K, B.k_seg_len, B.k_seg0, B.k_seg1, C.CAUSAL, C.BLOCK_N)
    dq = _dq_keys(dq, q, do, lse, delta, q_pos, k_base, v_base, B, C, 0, whole, False)
    dq = _dq_keys(dq, q, do, lse, delta, q_pos, k_base, v_base, B, C, whole, end, True)
    dq = dq * B.sm_scale
    if C.ACCUMULATE:
        dq += tl.load(B.dq_ptr + at, mask=rows[:, None], other=0.0)
    tl.store(B.dq_ptr + at, dq.to(B.dq_ptr.dtype.element_ty), mask=rows[:, None])


@triton.jit
def _dq_keys(dq, q, do, lse, delta, q_pos, k_base, v_base, B, C, lo, hi, MASKED: tl.constexpr):
    """`dq_task`'s sum over key indices [lo, hi), with the masks (the ragged end, the causal diagonal) only when
    MASKED. Rows past the end have lse = +inf: their probabilities are 0 without a mask."""
    dims = tl.arange(0, C.HEAD_DIM)
    for start in range(lo, hi, C.BLOCK_N):
        offs_n = start + tl.arange(0, C.BLOCK_N)
        k_ptrs = k_base + offs_n[:, None] * B.stride_kn + dims[None, :]
        v_ptrs = v_base + offs_n[:, None] * B.stride_kn + dims[None, :]
        if MASKED:
            cols = offs_n < B.N_K
            k = tl.load(k_ptrs, mask=cols[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=cols[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * B.qk_scale - lse[:, None])
        if MASKED:
            keep = cols[None, :]
            if C.CAUSAL:
                keep = keep & (position(offs_n, B.k_seg_len, B.k_seg0, B.k_seg1)[None, :] <= q_pos[:, None])
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v)).to(tl.float32)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


BWD_PARAMS = ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "lse_ptr", "delta_ptr", "dq_ptr", "dk_ptr", "dv_ptr", "H", "GROUP",
              "N_Q", "N_K", "stride_qb", "stride_qh", "stride_qn", "stride_kb", "stride_kh", "stride_kn", "q_seg_len",
              "q_seg0", "q_seg1", "k_seg_len", "k_seg0", "k_seg1", "qk_scale", "sm_scale")


@triton.jit
def _bwd_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, H, GROUP, N_Q, N_K,
                stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, q_seg_len, q_seg0, q_seg1,
                k_seg_len, k_seg0, k_seg1, qk_scale, sm_scale, DKDV: tl.constexpr, CAUSAL: tl.constexpr,
                ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One program per key tile (DKDV) or per query tile (dQ)."""
    B = Bwd(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, H, GROUP, N_Q, N_K, stride_qb,
            stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, q_seg_len, q_seg0, q_seg1, k_seg_len, k_seg0,
            k_seg1, qk_scale, sm_scale)
    # the tiles' tuple is built where it is passed: a tuple assigned to a name loses its constexprs when compiled
    if DKDV:
        dkdv_task(B, BwdTiles(CAUSAL, ACCUMULATE, BLOCK_M, BLOCK_N, HEAD_DIM), tl.program_id(0), tl.program_id(1))
    else:
        dq_task(B, BwdTiles(CAUSAL, ACCUMULATE, BLOCK_M, BLOCK_N, HEAD_DIM), _heavy_first(CAUSAL), tl.program_id(1))


def check_qkv(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str = "BHND") -> None:
    """Refuse what the kernels cannot take, naming what is required (layout: which dim holds the heads)."""
    device = context().device
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise PKError(f"{op}: {name} must be a 4-D {layout} tensor, got {getattr(t, 'shape', type(t).__name__)}")
        if t.device != device:
            raise PKError(f"{op}: {name} is on {t.device}, but this rank's device is {device}")
        if t.dtype not in DTYPES:
            raise PKError(f"{op}: {name} has dtype {t.dtype}; use bfloat16, float16 or float32")
    if not (q.dtype == k.dtype == v.dtype):
        raise PKError(f"{op}: q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise PKError(f"{op}: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    head = 1 if layout == "BHND" else 2
    seq = 2 if layout == "BHND" else 1
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise PKError(f"{op}: q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head dim ({layout})")
    if q.shape[3] not in HEAD_DIMS:
        raise PKError(f"{op}: head dim {q.shape[3]} is not supported; use one of {HEAD_DIMS}")
    if k.shape[head] == 0 or q.shape[head] % k.shape[head]:
        raise PKError(f"{op}: {q.shape[head]} query heads do not divide into {k.shape[head]} key/value heads "
                      "(grouped-query attention needs Hq divisible by Hkv)")
    del seq


FWD_LOADS = ("pointers", "tma", "gluon")  # how the forward reads Q, K and V, or its Gluon variant (`AttentionPlan`)


def _tiles(device: torch.device, head_dim: int, dtype: torch.dtype) -> dict:
    """Block sizes and launch options of the forward and the backward kernels: (BLOCK_M, BLOCK_N, warps, stages),
    the forward's with one of FWD_LOADS as a fifth value where it is not "pointers"."""
    if device.type != "cuda":  # the interpreter: every block op is a numpy call, small tiles keep it quick
        return {"fwd": (16, 16, 4, 1), "bwd": (16, 16, 4, 1)}
    if dtype == torch.float32:  # twice the bytes per tile: smaller tiles fit shared memory
        return {"fwd": (64, 32, 4, 2), "bwd": (32, 32, 4, 1)}
    if head_dim <= 64:  # not re-tuned since 2026-12-04
        return {"fwd": (128, 64, 4, 3), "bwd": (64, 64, 4, 2)}
    # measured on an H200, 2026-12-06 (scripts/tune_attention.py, B 16, H 16, N 4096 and 8192, D 128, bf16): the
    # forward's 128-key tiles gain 2-4% under the causal mask at 4K and tie elsewhere; dQ on its own tiles 8-11%.
    # On an H100, 2026-12-07, N 4096: the Gluon forward with 3 stages of 128 keys 660 TFLOP/s non-causal and 570
    # causal, against 509 and 459 for the Triton one; where Gluon cannot run, the Triton one takes these tiles.
    fwd = "gluon" if flash_hopper.usable(device, dtype, head_dim) else "pointers"
    return {"fwd": (128, 128, 8, 3, fwd), "bwd": (64, 64, 4, 2), "dq": (128, 64, 8, 3)}


def _segments(segments: tuple[int, int, int] | None, n: int) -> tuple[int, int, int]:
    """Positions as (seg_len, seg0, seg1), those of one block from 0 written (n, 0, 0) whatever their spelling
    (zigzag at world 1 is chunks 0 and 1: one block), so that such a call takes the plain call's kernel."""
    if segments is None or (segments[1] == 0 and segments[2] == segments[0]):
        return n, 0, 0
    return tuple(segments)


def _strides(t: torch.Tensor, layout: str) -> tuple[int, int, int]:
    """(batch, head, row) strides of a (B, H, N, D) tensor, or of a (B, N, H, D) one read as heads-major."""
    s = t.stride()
    return (s[0], s[1], s[2]) if layout == "BHND" else (s[0], s[2], s[1])


class AttentionPlan:
    """Flash attention for one set of shapes, dtype, mask and scale: the bound forward and backward kernels.

    `forward(q, k, v)` returns (out, lse); `backward(do, q, k, v, out, lse, dlse=None)` returns (dq, dk, dv).
    Positions (`q_segments`, `k_segments`: (seg_len, seg0, seg1), see the module's docstring) default to one
    contiguous block from 0. With `layout="BSHD"` the tensors are (B, N, H, D) (Ulysses' layout), read in place.
    `tiles` overrides the block sizes and launch options (`scripts/tune_attention.py`).
    """

    op = "attention"

    def __init__(self, q_shape: tuple, kv_shape: tuple, dtype: torch.dtype, causal: bool, scale: float,
                 q_segments: tuple[int, int, int] | None = None, k_segments: tuple[int, int, int] | None = None,
                 layout: str = "BHND", tiles: dict | None = None):
        ctx = context()
        self.q_shape, self.kv_shape, self.dtype, self.device = tuple(q_shape), tuple(kv_shape), dtype, ctx.device
        self.causal, self.scale, self.layout = causal, scale, layout
        if layout == "BHND":
            B, H, N_Q, D = q_shape
            H_KV, N_K = kv_shape[1], kv_shape[2]
        else:
            B, N_Q, H, D = q_shape
            N_K, H_KV = kv_shape[1], kv_shape[2]
        self.B, self.H, self.H_KV, self.N_Q, self.N_K, self.D = B, H, H_KV, N_Q, N_K, D
        q_seg, k_seg = _segments(q_segments, N_Q), _segments(k_segments, N_K)
        positions = dict(q_seg_len=q_seg[0], q_seg0=q_seg[1], q_seg1=q_seg[2], k_seg_len=k_seg[0], k_seg0=k_seg[1],
                         k_seg1=k_seg[2])
        q_strides = _contiguous_strides(q_shape, layout)
        kv_strides = _contiguous_strides(kv_shape, layout)
        self.sizes = dict(H=H, GROUP=H // H_KV, N_Q=N_Q, N_K=N_K, stride_qb=q_strides[0], stride_qh=q_strides[1],
                          stride_qn=q_strides[2], stride_kb=kv_strides[0], stride_kh=kv_strides[1],
                          stride_kn=kv_strides[2], **positions, qk_scale=scale * LOG2E)
        self.tiles = tiles = tiles or _tiles(ctx.device, D, dtype)
        self.empty = B * H * N_Q == 0
        if self.empty:
            return
        bm, bn, warps, stages, *loads = tiles["fwd"]
        loads = loads[0] if loads else "pointers"
        if loads not in FWD_LOADS:
            raise PKError(f"{self.op}: the forward's loads must be one of {FWD_LOADS}, got {loads!r}")
        fwd = dict(self.sizes, stride_ob=q_strides[0], stride_oh=q_strides[1], stride_on=q_strides[2],
                   CAUSAL=causal, FINAL=False, BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=D, num_warps=warps,
                   num_stages=stages)
        grid = (cdiv(N_Q, bm), B * H)
        # "tma": Q, K and V through TMA host descriptors, from Hopper on (`_Encoded` encodes them once per
        # address); the interpreter runs the same path. "gluon": the warp-specialised forward (`flash_hopper`) where
        # it can run (a plain call's positions, keys to read), else the Triton one with pointers.
        hopper = ctx.device.type != "cuda" or torch.cuda.get_device_capability(ctx.device)[0] >= 9
        self.gluon = loads == "gluon" and flash_hopper.usable(ctx.device, dtype, D) and N_K > 0 \
            and q_seg == (N_Q, 0, 0) and k_seg == (N_K, 0, 0)
        self.tma = hopper and loads == "tma"
        # over (B, heads, rows, D) in either layout
        describe_q = functools.partial(descriptor, block=[1, 1, bm, D], view=([B, H, N_Q, D], [*q_strides, 1]))
        describe_kv = functools.partial(descriptor, block=[1, 1, bn, D], view=([B, H_KV, N_K, D], [*kv_strides, 1]))
        descriptors = {"q_ptr": describe_q, "k_ptr": describe_kv, "v_ptr": describe_kv}
        self._fwd = self._gluon_forward(bn, stages, q_strides) if self.gluon else \
            Launcher(_fwd_kernel, grid, ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "lse_ptr"),
                     descriptors=descriptors if self.tma else None, acc_ptr=None, MERGE=False, TMA=self.tma, **fwd)
        self._merge = Launcher(_fwd_kernel, grid, ("q_ptr", "k_ptr", "v_ptr", "lse_ptr", "acc_ptr"), o_ptr=None,
                               MERGE=True, TMA=False, **fwd)
        self._pre = Launcher(_bwd_preprocess, (cdiv(N_Q, 64), B * H), ("o_ptr", "do_ptr", "delta_ptr"), N=N_Q,
                             stride_ob=q_strides[0], stride_oh=q_strides[1], stride_on=q_strides[2], H=H, BLOCK_M=64,
                             HEAD_DIM=D, num_warps=4)
        per_call = ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "lse_ptr", "delta_ptr", "dq_ptr", "dk_ptr", "dv_ptr")

        def bwd(kind: str, dkdv: bool) -> dict[bool, Launcher]:  # dK/dV and dQ may take different tiles
            bm, bn, warps, stages = tiles.get(kind, tiles["bwd"])
            programs = (cdiv(N_K, bn), B * H_KV) if dkdv else (cdiv(N_Q, bm), B * H)
            return {acc: Launcher(_bwd_kernel, programs, per_call, DKDV=dkdv, ACCUMULATE=acc, sm_scale=scale,
                                  CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=D, num_warps=warps,
                                  num_stages=stages, **self.sizes) for acc in (False, True)}

        self._dkdv, self._dq = bwd("dkdv", True), bwd("dq", False)

    def _gluon_forward(self, block_n: int, stages: int, out_strides: tuple[int, int, int]) -> Launcher:
        """The warp-specialised forward (`flash_hopper`): q read as a matrix of D-wide rows, k and v per head."""
        D = self.D
        smem = flash_hopper.shared_bytes(D, block_n, stages)
        if smem > 227 * 1024:
            raise PKError(f"{self.op}: the Gluon forward's {stages} stages of {block_n}-key tiles at head dim {D} "
                          f"need {smem // 1024} KB of shared memory (at most 227 KB): fewer stages or keys")
        qv, kvv = flash_hopper.views(self.q_shape, self.layout), flash_hopper.views(self.kv_shape, self.layout)
        kv = flash_hopper.describer(self.dtype, (1, block_n, D), kvv["rows"])
        descriptors = {"q_desc": flash_hopper.describer(self.dtype, (64, D), qv["matrix"]), "k_desc": kv,
                       "v_desc": kv}
        grid = (cdiv(self.N_Q, flash_hopper.BLOCK_M), self.B * self.H)
        # 4 warps per consumer group and a producer warp: three warp groups sharing the SM's 64K registers
        return Launcher(flash_hopper._fwd_ws_kernel, grid, ("q_desc", "k_desc", "v_desc", "o_ptr", "lse_ptr"),
                        descriptors, H=self.H, GROUP=self.H // self.H_KV, N_Q=self.N_Q, N_K=self.N_K,
                        q_rows_b=qv["per_b"], q_rows_h=qv["per_h"], kv_outer_b=kvv["outer_b"],
                        kv_outer_h=kvv["outer_h"], q_cols=qv["cols"], kv_cols=kvv["cols"], stride_ob=out_strides[0],
                        stride_oh=out_strides[1], stride_on=out_strides[2], qk_scale=self.scale * LOG2E,
                        CAUSAL=self.causal, STAGES=stages, num_warps=4, maxnreg=168)

    def _check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if q.shape != self.q_shape or k.shape != self.kv_shape or v.shape != self.kv_shape or q.dtype != self.dtype \
                or k.dtype != self.dtype or v.dtype != self.dtype or q.device != self.device:
            raise PKError(f"{self.op}: this plan was built for q {self.q_shape} and k, v {self.kv_shape} of "
                          f"{self.dtype} on {self.device}; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} "
                          f"of {q.dtype} on {q.device}")
        return q.contiguous(), k.contiguous(), v.contiguous()

    def lse_shape(self) -> tuple[int, int, int]:
        """(B, H, N) of the log-sum-exp, whatever the layout."""
        return self.B, self.H, self.N_Q

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse): out like q, lse (B, H, N) fp32 natural log (-inf for rows that see no key)."""
        q, k, v = self._check(q, k, v)
        if self.tma:  # TMA reads from 16-byte aligned addresses only
            q, k, v = (t if t.data_ptr() % 16 == 0 else t.clone() for t in (q, k, v))
        out = torch.empty_like(q)
        lse = torch.empty(self.lse_shape(), dtype=torch.float32, device=self.device)
        if not self.empty:
            self._fwd(q, k, v, out, lse)
        return out, lse

    def forward_into(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, acc: torch.Tensor,
                     lse: torch.Tensor) -> None:
        """Merge attention over these keys into the running fp32 `acc` (B, H, N, D) and `lse` (ring steps)."""
        if not self.empty:
            self._merge(q, k, v, lse, acc)

    def delta(self, out: torch.Tensor, do: torch.Tensor, dlse: torch.Tensor | None = None) -> torch.Tensor:
        """rowsum(dO * O) (B, H, N) fp32, less the log-sum-exp's own gradient where it has one."""
        delta = torch.empty(self.lse_shape(), dtype=torch.float32, device=self.device)
        if not self.empty:
            self._pre(out, do, delta)
        if dlse is not None:
            delta -= dlse
        return delta

    def backward_into(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                      delta: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                      accumulate: bool) -> None:
        """dq, dk, dv of attention over these keys, written (or, with `accumulate`, added: fp32 buffers)."""
        if self.empty or self.N_K == 0:
            return
        self._dkdv[accumulate](q, k, v, do, lse, delta, dq, dk, dv)
        self._dq[accumulate](q, k, v, do, lse, delta, dq, dk, dv)

    def backward(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, dlse: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """(dq, dk, dv) like q, k, v."""
        q, k, v = self._check(q, k, v)
        do, out = do.contiguous(), out.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if self.empty or self.N_K == 0:
            return dq.zero_(), dk.zero_(), dv.zero_()
        self.backward_into(do, q, k, v, lse, self.delta(out, do, dlse), dq, dk, dv, accumulate=False)
        return dq, dk, dv


def _contiguous_strides(shape: tuple, layout: str) -> tuple[int, int, int]:
    B, X, Y, D = shape  # BHND: X = heads, Y = rows; BSHD: X = rows, Y = heads
    if layout == "BHND":
        return X * Y * D, Y * D, D
    return X * Y * D, D, Y * D


def default_scale(head_dim: int, softmax_scale: float | None) -> float:
    """The softmax scale: `softmax_scale`, or 1 / sqrt(head dim)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise PKError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    return float(softmax_scale)


def plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
         softmax_scale: float | None = None) -> AttentionPlan:
    """The plan for attention over tensors like q, k, v (not collective)."""
    scale = default_scale(q.shape[-1] if isinstance(q, torch.Tensor) else 0, softmax_scale)
    key = ("attention", getattr(q, "shape", None), getattr(k, "shape", None), getattr(q, "dtype", None),
           bool(causal), scale)
    found = plans.find(key)
    if found is not None:
        return found

    def check() -> str:
        check_qkv("attention", q, k, v)
        return ""

    return plans.get(key, lambda: AttentionPlan(q.shape, k.shape, q.dtype, bool(causal), scale), check,
                     collective=False)


@torch.library.custom_op("parallelkittens::attention_forward", mutates_args=())
def _attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    return plan(q, k, v, causal, softmax_scale).forward(q, k, v)


@_attention_forward.register_fake
def _(q, k, v, causal, softmax_scale):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("parallelkittens::attention_backward", mutates_args=())
def _attention_backward(do: torch.Tensor, dlse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, causal: bool, softmax_scale: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return plan(q, k, v, causal, softmax_scale).backward(do, q, k, v, out, lse, dlse)


@_attention_backward.register_fake
def _(do, dlse, q, k, v, out, lse, causal, softmax_scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output) -> None:
    q, k, v, causal, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, do, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(out)
    if dlse is None:
        dlse = torch.zeros_like(lse)
    dq, dk, dv = _attention_backward(do, dlse, q, k, v, out, lse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


_attention_forward.register_autograd(_backward, setup_context=_setup)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              softmax_scale: float | None = None, return_lse: bool = False
              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Flash attention on (B, H, N, D) tensors: softmax(q k^T * scale) v, with the causal mask if asked.

    q is (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) with Hq a multiple of Hkv (grouped-query attention). bf16, fp16
    or fp32; D in 16, 32, 64, 128. `softmax_scale` defaults to 1/sqrt(D). With `return_lse`, also the rows'
    log-sum-exp (B, Hq, Nq) in fp32. Differentiable (q, k, v; the log-sum-exp too), a torch custom op
    (``torch.ops.parallelkittens.attention_forward``) that torch.compile traces. Not collective.
    """
    scale = default_scale(q.shape[-1] if isinstance(q, torch.Tensor) else 0, softmax_scale)
    if not torch.compiler.is_compiling():  # traced, the custom op builds it when it runs
        plan(q, k, v, causal, scale)  # checks the inputs (and builds the plan) before the custom op's dispatch
    out, lse = _attention_forward(q, k, v, bool(causal), scale)
    return (out, lse) if return_lse else out


plans.attach(attention, plan)

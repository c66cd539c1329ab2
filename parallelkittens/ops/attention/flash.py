"""The flash-attention kernels in Triton, forward and backward: the single-GPU core that `attention`, ring and
Ulysses attention run (their plans are in `attention.py`, `ring.py` and `ulysses.py`; the Hopper forward in Gluon
is `flash_hopper.py`).

(B, H, N, D) tensors (or (B, N, H, D), read in place through the strides): bf16, fp16 or fp32, head dims 64 and
128 (and 16, 32 for small tests), grouped-query heads (k and v with Hkv heads, Hq a multiple of Hkv: query head h
reads key/value head h // (Hq / Hkv)), any sequence lengths. The forward writes the output and the log-sum-exp of
each row (fp32, natural log); the backward recomputes the probabilities from the log-sum-exp (no N x N matrix is
ever stored). A kernel takes its pointers one by one and the plan's sizes as one group (`Shape`).

**Positions.** Every kernel places its queries and keys on the sequence through two segments: local index i is at
``seg0 + i`` for i < seg_len, else at ``seg1 + i - seg_len``. One segment is a contiguous block (the plain op,
and ring attention's contiguous layout); two are ring attention's zigzag layout, where a rank holds chunks r and
2W - 1 - r. Positions grow with the index in both, so the keys a query tile sees under the causal mask are a
prefix of any key block: the loops stop at the last key tile any query of the tile sees (fully masked tiles are
never computed) and mask only where a tile straddles the diagonal.

**Forward** (`_fwd_kernel`): one program per (query tile, batch x head), online softmax in base 2 over the key
tiles, fp32 accumulation. With `MERGE`, the tile's partial result is merged by log-sum-exp into a running fp32
accumulator and log-sum-exp instead of being written out: ring attention's steps.
**Backward**: `_bwd_preprocess` computes delta = rowsum(dO * O); `_bwd_kernel` with DKDV gives one program per
(key tile, batch x key/value head), which loops over the group's query heads and the query tiles that see it and
writes dK and dV (no atomics: the GQA sum happens inside the program); without DKDV, one program per query tile,
which writes dQ. With `ACCUMULATE` the gradients are added into fp32 buffers (ring attention).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

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
def attend(q, k_src, v_src, q_pos, S, C):
    """The unnormalised attention of one query tile `q` (BLOCK_M, HEAD_DIM) over the keys and values at `k_src` and
    `v_src` (one head's first row; rows S.stride_kn apart): (acc, m, denom) with acc = sum_j exp2(s_j - m) v_j,
    denom = sum_j exp2(s_j - m), m the rows' running maxima, all fp32 and in base 2 (s = q.k * qk_scale, qk_scale
    including log2(e)). Key tiles every query of the tile sees whole run without masks; the rest (the diagonal,
    the ragged end) with them."""
    m = tl.full([C.BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([C.BLOCK_M], tl.float32)
    acc = tl.zeros([C.BLOCK_M, C.HEAD_DIM], tl.float32)
    whole, end = key_bounds(q_pos, S.N_K, S.k_seg_len, S.k_seg0, S.k_seg1, C.CAUSAL, C.BLOCK_N)
    acc, m, denom = _attend_keys(acc, m, denom, q, k_src, v_src, q_pos, S, C, 0, whole, False)
    return _attend_keys(acc, m, denom, q, k_src, v_src, q_pos, S, C, whole, end, True)


@triton.jit
def _kv_rows(src, start, S, C, MASKED: tl.constexpr):
    """Key (or value) rows [start, start + BLOCK_N) of the head whose first row `src` points at (masked past the
    end when MASKED)."""
    offs_n = start + tl.arange(0, C.BLOCK_N)
    ptrs = src + offs_n[:, None] * S.stride_kn + tl.arange(0, C.HEAD_DIM)[None, :]
    if MASKED:
        return tl.load(ptrs, mask=(offs_n < S.N_K)[:, None], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _attend_keys(acc, m, denom, q, k_src, v_src, q_pos, S, C, lo, hi, MASKED: tl.constexpr):
    """`attend`'s online softmax over key indices [lo, hi), with the masks only when MASKED."""
    for start in range(lo, hi, C.BLOCK_N):
        k = _kv_rows(k_src, start, S, C, MASKED)
        s = tl.dot(q, tl.trans(k))  # unscaled: the scale goes into the rows' maxima and one fused multiply-add
        if MASKED:
            offs_n = start + tl.arange(0, C.BLOCK_N)
            keep = (offs_n < S.N_K)[None, :]
            if C.CAUSAL:
                keep = keep & (position(offs_n, S.k_seg_len, S.k_seg0, S.k_seg1)[None, :] <= q_pos[:, None])
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1) * S.qk_scale)  # qk_scale > 0: the scaled maximum is the maximum scaled
        if MASKED:  # a row that has seen no key yet keeps m = -inf; unmasked scores are all finite
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_safe = m_new
        p = tl.math.exp2(s * S.qk_scale - m_safe[:, None])
        alpha = tl.math.exp2(m - m_safe)
        v = _kv_rows(v_src, start, S, C, MASKED)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])  # the product accumulates in place (no 2nd tile)
        denom = denom * alpha + tl.sum(p, 1)
        m = m_new
    return acc, m, denom


class Shape(NamedTuple):
    """A plan's run-time sizes in the kernels: heads, rows, strides (q, dO and dQ share q's; k, v, dK and dV
    share k's), positions (see the module's docstring) and the softmax scale (with log2(e), and without)."""

    H: object
    GROUP: object  # query heads per key/value head
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
    sm_scale: object


class Fwd(NamedTuple):
    """The forward's per-call pointers in a kernel."""

    q_ptr: object
    k_ptr: object
    v_ptr: object
    o_ptr: object  # the output (dtype), or None while merging into `acc_ptr`
    lse_ptr: object  # (B, H, N_Q) fp32, natural log
    acc_ptr: object  # (B, H, N_Q, D) fp32 running result (MERGE), or None


class FwdTiles(NamedTuple):
    CAUSAL: tl.constexpr
    MERGE: tl.constexpr  # merge into the running fp32 result instead of writing the output
    FINAL: tl.constexpr  # merging, and this is the last block: write the merged result to the output
    BLOCK_M: tl.constexpr
    BLOCK_N: tl.constexpr
    HEAD_DIM: tl.constexpr


@triton.jit
def _query_tile(S, C, tile, bh):
    """Query tile `tile` of batch x head `bh`: (bh, b, h, its key/value head, its rows, which rows exist, the rows'
    offsets in q, their positions; rows past the end see no more than the tile's first)."""
    bh = bh.to(tl.int64)
    b, h = bh // S.H, bh % S.H
    offs_m = tile * C.BLOCK_M + tl.arange(0, C.BLOCK_M)
    rows = offs_m < S.N_Q
    at = b * S.stride_qb + h * S.stride_qh + offs_m[:, None] * S.stride_qn + tl.arange(0, C.HEAD_DIM)[None, :]
    q_pos = position(offs_m, S.q_seg_len, S.q_seg0, S.q_seg1)
    return bh, b, h, h // S.GROUP, offs_m, rows, at, tl.where(rows, q_pos, tl.min(q_pos, 0))


@triton.jit
def fwd_task(F, S, C, tile, bh):
    """Attention of query tile `tile` of batch x head `bh` over all of the keys (see the module's docstring)."""
    bh, b, h, kv_h, offs_m, rows, at, q_pos = _query_tile(S, C, tile, bh)
    dims = tl.arange(0, C.HEAD_DIM)
    q = tl.load(F.q_ptr + at, mask=rows[:, None], other=0.0)
    kv = b * S.stride_kb + kv_h * S.stride_kh
    acc, m, denom = attend(q, F.k_ptr + kv, F.v_ptr + kv, q_pos, S, C)
    # log-sum-exp in base 2, -inf for rows that saw no key
    seen = denom > 0
    lse2 = tl.where(seen, m + tl.math.log2(tl.where(seen, denom, 1.0)), float("-inf"))
    out = acc / tl.where(seen, denom, 1.0)[:, None]
    lse_rows = F.lse_ptr + bh * S.N_Q + offs_m  # natural log in memory
    o_ptrs = F.o_ptr + b * S.stride_ob + h * S.stride_oh + offs_m[:, None] * S.stride_on + dims[None, :]
    if C.MERGE:  # into the running fp32 result: o = (o e^lse_old + out e^lse_new) / e^lse, lse = log-add-exp
        acc_ptrs = F.acc_ptr + bh * S.N_Q * C.HEAD_DIM + offs_m[:, None] * C.HEAD_DIM + dims[None, :]
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
def _fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, acc_ptr, S, C):
    F = Fwd(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, acc_ptr)
    fwd_task(F, S, C, _heavy_first(C.CAUSAL), tl.program_id(1))


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
    """The backward's per-call pointers in a kernel. lse (natural log) and delta are (B, H, N_Q) fp32."""

    q_ptr: object
    k_ptr: object
    v_ptr: object
    do_ptr: object
    lse_ptr: object
    delta_ptr: object
    dq_ptr: object
    dk_ptr: object
    dv_ptr: object


class BwdTiles(NamedTuple):
    CAUSAL: tl.constexpr
    ACCUMULATE: tl.constexpr  # add the gradients into fp32 buffers instead of writing them
    BLOCK_M: tl.constexpr
    BLOCK_N: tl.constexpr
    HEAD_DIM: tl.constexpr


@triton.jit
def dkdv_task(B, S, C, tile, bh_kv):
    """dK and dV of key tile `tile` of batch x key/value head `bh_kv`: over the group's query heads and the query
    tiles that see it (the GQA sum inside the program: no atomics)."""
    bh_kv = bh_kv.to(tl.int64)
    H_KV = S.H // S.GROUP
    b, kv_h = bh_kv // H_KV, bh_kv % H_KV
    offs_n = tile * C.BLOCK_N + tl.arange(0, C.BLOCK_N)
    dims = tl.arange(0, C.HEAD_DIM)
    cols = offs_n < S.N_K
    at = b * S.stride_kb + kv_h * S.stride_kh + offs_n[:, None] * S.stride_kn + dims[None, :]
    k = tl.load(B.k_ptr + at, mask=cols[:, None], other=0.0)
    v = tl.load(B.v_ptr + at, mask=cols[:, None], other=0.0)
    k_pos = position(offs_n, S.k_seg_len, S.k_seg0, S.k_seg1)
    first_pos = position(tile * C.BLOCK_N, S.k_seg_len, S.k_seg0, S.k_seg1)  # the tile's first key exists
    start_m = _first_seeing(first_pos, S.N_Q, S.q_seg_len, S.q_seg0, S.q_seg1, C.CAUSAL) // C.BLOCK_M * C.BLOCK_M
    dk = tl.zeros([C.BLOCK_N, C.HEAD_DIM], tl.float32)
    dv = tl.zeros([C.BLOCK_N, C.HEAD_DIM], tl.float32)
    # One loop with the causal test in every step: a masked loop for the diagonal and an unmasked one after it
    # restart the pipeline at every head (slower, measured). Keys past the end need no mask: they
    # reach only their own rows of dK and dV, which are not stored.
    for g in range(S.GROUP):
        h = kv_h * S.GROUP + g
        q_base = B.q_ptr + b * S.stride_qb + h * S.stride_qh
        do_base = B.do_ptr + b * S.stride_qb + h * S.stride_qh
        rows_base = (b * S.H + h) * S.N_Q
        for start in range(start_m, S.N_Q, C.BLOCK_M):
            offs_m = start + tl.arange(0, C.BLOCK_M)
            rows = offs_m < S.N_Q
            q = tl.load(q_base + offs_m[:, None] * S.stride_qn + dims[None, :], mask=rows[:, None], other=0.0)
            do = tl.load(do_base + offs_m[:, None] * S.stride_qn + dims[None, :], mask=rows[:, None], other=0.0)
            lse, delta = _row_stats(B, rows_base, offs_m, rows)
            p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * S.qk_scale - lse[None, :])  # transposed: keys along rows
            if C.CAUSAL:
                keep = k_pos[:, None] <= position(offs_m, S.q_seg_len, S.q_seg0, S.q_seg1)[None, :]
                p_t = tl.where(keep, p_t, 0.0)
            dv = tl.dot(p_t.to(do.dtype), do, dv)
            dp_t = tl.dot(v, tl.trans(do)).to(tl.float32)
            ds_t = p_t * (dp_t - delta[None, :])
            dk = tl.dot(ds_t.to(q.dtype), q, dk)
    dk = dk * S.sm_scale
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
def dq_task(B, S, C, tile, bh):
    """dQ of query tile `tile` of batch x head `bh`, over the key tiles it sees: whole tiles that every query of
    the tile sees without masks, the diagonal and the ragged end with them."""
    bh, b, h, kv_h, offs_m, rows, at, q_pos = _query_tile(S, C, tile, bh)
    q = tl.load(B.q_ptr + at, mask=rows[:, None], other=0.0)
    do = tl.load(B.do_ptr + at, mask=rows[:, None], other=0.0)
    lse, delta = _row_stats(B, bh * S.N_Q, offs_m, rows)
    k_base = B.k_ptr + b * S.stride_kb + kv_h * S.stride_kh
    v_base = B.v_ptr + b * S.stride_kb + kv_h * S.stride_kh
    dq = tl.zeros([C.BLOCK_M, C.HEAD_DIM], tl.float32)
    whole, end = key_bounds(q_pos, S.N_K, S.k_seg_len, S.k_seg0, S.k_seg1, C.CAUSAL, C.BLOCK_N)
    dq = _dq_keys(dq, q, do, lse, delta, q_pos, k_base, v_base, S, C, 0, whole, False)
    dq = _dq_keys(dq, q, do, lse, delta, q_pos, k_base, v_base, S, C, whole, end, True)
    dq = dq * S.sm_scale
    if C.ACCUMULATE:
        dq += tl.load(B.dq_ptr + at, mask=rows[:, None], other=0.0)
    tl.store(B.dq_ptr + at, dq.to(B.dq_ptr.dtype.element_ty), mask=rows[:, None])


@triton.jit
def _dq_keys(dq, q, do, lse, delta, q_pos, k_base, v_base, S, C, lo, hi, MASKED: tl.constexpr):
    """`dq_task`'s sum over key indices [lo, hi), with the masks (the ragged end, the causal diagonal) only when
    MASKED. Rows past the end have lse = +inf: their probabilities are 0 without a mask."""
    dims = tl.arange(0, C.HEAD_DIM)
    for start in range(lo, hi, C.BLOCK_N):
        offs_n = start + tl.arange(0, C.BLOCK_N)
        k_ptrs = k_base + offs_n[:, None] * S.stride_kn + dims[None, :]
        v_ptrs = v_base + offs_n[:, None] * S.stride_kn + dims[None, :]
        if MASKED:
            cols = offs_n < S.N_K
            k = tl.load(k_ptrs, mask=cols[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=cols[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * S.qk_scale - lse[:, None])
        if MASKED:
            keep = cols[None, :]
            if C.CAUSAL:
                keep = keep & (position(offs_n, S.k_seg_len, S.k_seg0, S.k_seg1)[None, :] <= q_pos[:, None])
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v)).to(tl.float32)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def _bwd_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, S, C, DKDV: tl.constexpr):
    """One program per key tile (DKDV) or per query tile (dQ)."""
    B = Bwd(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr)
    if DKDV:
        dkdv_task(B, S, C, tl.program_id(0), tl.program_id(1))
    else:
        dq_task(B, S, C, _heavy_first(C.CAUSAL), tl.program_id(1))

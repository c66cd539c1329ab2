"""`attention`: flash attention on one rank, the plan that binds `flash`'s kernels (and the Gluon forward of
`flash_hopper` on Hopper) to one set of shapes, and the op.

``attention(q, k, v, causal=False, softmax_scale=None, return_lse=False)`` on (B, H, N, D) tensors, as
`torch.nn.functional.scaled_dot_product_attention` takes them. Ring and Ulysses attention build the same plan
for their steps (`AttentionPlan` with positions, or with the (B, N, H, D) layout read in place).
"""

from __future__ import annotations

import math

import torch

from ...runtime.context import context
from ...runtime.errors import PKError
from ...runtime.launch import Launcher
from ...runtime.sizes import cdiv
from ..plan import Plan, check_same_dtype, check_tensor, declare, refuse
from . import flash, flash_hopper

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HEAD_DIMS = (16, 32, 64, 128)


def check_qkv(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str = "BHND") -> None:
    """Refuse what the kernels cannot take, naming what is required (layout: which dim holds the heads)."""
    dims = "(B, H, N, D)" if layout == "BHND" else "(B, N, H, D)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(op, name, t, DTYPES, 4, what=dims)
    check_same_dtype(op, q=q, k=k, v=v)
    if k.shape != v.shape:
        raise PKError(f"{op}: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    head = 1 if layout == "BHND" else 2
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise PKError(f"{op}: q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head dim ({layout})")
    if q.shape[3] not in HEAD_DIMS:
        raise PKError(f"{op}: head dim {q.shape[3]} is not supported; use one of {HEAD_DIMS}")
    if k.shape[head] == 0 or q.shape[head] % k.shape[head]:
        raise PKError(f"{op}: {q.shape[head]} query heads do not divide into {k.shape[head]} key/value heads "
                      "(grouped-query attention needs Hq divisible by Hkv)")


def default_scale(head_dim: int, softmax_scale: float | None) -> float:
    """The softmax scale: `softmax_scale`, or 1 / sqrt(head dim)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise PKError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    return float(softmax_scale)


FWD_KERNELS = ("triton", "gluon")  # the forward's kernels: `flash`'s, or the warp-specialised one (`flash_hopper`)


def default_tiles(device: torch.device, head_dim: int, dtype: torch.dtype) -> dict:
    """Block sizes and launch options of the forward and the backward kernels: (BLOCK_M, BLOCK_N, warps, stages),
    the forward's with its kernel (one of FWD_KERNELS) as a fifth value. The figures behind them are in
    docs/performance.md and bench/results/tune_attention-*."""
    if device.type != "cuda":  # the interpreter: every block op is a numpy call, small tiles keep it quick
        return {"fwd": (16, 16, 4, 1, "triton"), "bwd": (16, 16, 4, 1)}
    if dtype == torch.float32:  # twice the bytes per tile: smaller tiles fit shared memory
        return {"fwd": (64, 32, 4, 2, "triton"), "bwd": (32, 32, 4, 1)}
    if head_dim <= 64:  # the Gluon forward runs here when the tiles ask for it; not yet timed against Triton's
        return {"fwd": (128, 64, 4, 3, "triton"), "bwd": (64, 64, 4, 2)}
    fwd = "gluon" if flash_hopper.usable(device, dtype, head_dim) else "triton"
    # the forward's 128-key tiles gain under the causal mask and tie elsewhere; dQ gains on its own tiles; the
    # Gluon forward runs 3 stages of 128 keys, and where it cannot run the Triton one takes these tiles
    return {"fwd": (128, 128, 8, 3, fwd), "bwd": (64, 64, 4, 2), "dq": (128, 64, 8, 3)}


def segments_of(segments: tuple[int, int, int] | None, n: int) -> tuple[int, int, int]:
    """Positions as (seg_len, seg0, seg1), those of one block from 0 written (n, 0, 0) whatever their spelling
    (zigzag at world 1 is chunks 0 and 1: one block), so that such a call takes the plain call's kernel."""
    if segments is None or (segments[1] == 0 and segments[2] == segments[0]):
        return n, 0, 0
    return tuple(segments)


def _contiguous_strides(shape: tuple, layout: str) -> tuple[int, int, int]:
    B, X, Y, D = shape  # BHND: X = heads, Y = rows; BSHD: X = rows, Y = heads
    if layout == "BHND":
        return X * Y * D, Y * D, D
    return X * Y * D, D, Y * D


class AttentionPlan(Plan):
    """Flash attention for one set of shapes, dtype, mask and scale: the bound forward and backward kernels.

    A call ``plan(q, k, v)`` returns (out, lse); `gradients(do, q, k, v, out, lse, dlse=None)` returns (dq, dk,
    dv). Ring and Ulysses attention build it with positions (`q_segments`, `k_segments`: (seg_len, seg0, seg1),
    see `flash`; one contiguous block from 0 by default) or with `layout="BSHD"`: (B, N, H, D) tensors, read in
    place. `tiles` overrides the block sizes and launch options (`scripts/tune_attention.py`). Only q's and k's
    shapes and dtype are read when building: ring and Ulysses pass meta tensors of the shapes they will call with.
    """

    op = "attention"
    collective = False
    arity = 3
    differentiable = 2  # the output, and the log-sum-exp
    saves = (0, 1)

    @classmethod
    def key(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
            softmax_scale: float | None = None) -> tuple:
        scale = default_scale(q.shape[-1] if isinstance(q, torch.Tensor) else 0, softmax_scale)
        return getattr(q, "shape", None), getattr(k, "shape", None), getattr(q, "dtype", None), bool(causal), scale

    @classmethod
    def check(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              softmax_scale: float | None = None) -> str:
        check_qkv(cls.op, q, k, v)
        return ""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                 softmax_scale: float | None = None, *, q_segments: tuple[int, int, int] | None = None,
                 k_segments: tuple[int, int, int] | None = None, layout: str = "BHND", tiles: dict | None = None):
        ctx = context()
        self.q_shape, self.kv_shape, self.dtype = tuple(q.shape), tuple(k.shape), q.dtype
        self.remember(q=q, k=k, v=k)
        self.causal, self.scale, self.layout = bool(causal), default_scale(q.shape[-1], softmax_scale), layout
        if layout == "BHND":
            B, H, N_Q, D = self.q_shape
            H_KV, N_K = self.kv_shape[1], self.kv_shape[2]
        else:
            B, N_Q, H, D = self.q_shape
            N_K, H_KV = self.kv_shape[1], self.kv_shape[2]
        self.B, self.H, self.H_KV, self.N_Q, self.N_K, self.D = B, H, H_KV, N_Q, N_K, D
        q_seg, k_seg = segments_of(q_segments, N_Q), segments_of(k_segments, N_K)
        q_strides, kv_strides = _contiguous_strides(self.q_shape, layout), _contiguous_strides(self.kv_shape, layout)
        self.shape = flash.Shape(H, H // H_KV, N_Q, N_K, *q_strides, *kv_strides, *q_strides, *q_seg, *k_seg,
                                 self.scale * flash.LOG2E, self.scale)
        self.tiles = made = tiles or default_tiles(ctx.device, D, q.dtype)
        self.empty = B * H * N_Q == 0
        if self.empty:
            return
        bm, bn, warps, stages, *kernel = made["fwd"]
        kernel = kernel[0] if kernel else "triton"
        if kernel not in FWD_KERNELS:
            raise PKError(f"{self.op}: the forward's kernel must be one of {FWD_KERNELS}, got {kernel!r}")
        # the Gluon forward where it can run: a plain call's positions, keys to read
        self.gluon = (kernel == "gluon" and flash_hopper.usable(ctx.device, q.dtype, D) and N_K > 0
                      and q_seg == (N_Q, 0, 0) and k_seg == (N_K, 0, 0))
        grid = (cdiv(N_Q, bm), B * H)
        options = dict(num_warps=warps, num_stages=stages)
        fwd = (self.causal, False, False, bm, bn, D)
        self._fwd = self._gluon_forward(bn, stages, q_strides) if self.gluon else Launcher(
            flash._fwd_kernel, grid, ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "lse_ptr"), acc_ptr=None, S=self.shape,
            C=flash.FwdTiles(*fwd), **options)
        self._merge = Launcher(flash._fwd_kernel, grid, ("q_ptr", "k_ptr", "v_ptr", "lse_ptr", "acc_ptr"), o_ptr=None,
                               S=self.shape, C=flash.FwdTiles(self.causal, True, False, bm, bn, D), **options)
        self._pre = Launcher(flash._bwd_preprocess, (cdiv(N_Q, 64), B * H), ("o_ptr", "do_ptr", "delta_ptr"), N=N_Q,
                             stride_ob=q_strides[0], stride_oh=q_strides[1], stride_on=q_strides[2], H=H, BLOCK_M=64,
                             HEAD_DIM=D, num_warps=4)
        self._dkdv, self._dq = self._backward_kernels("dkdv", True), self._backward_kernels("dq", False)

    def _backward_kernels(self, kind: str, dkdv: bool) -> dict[bool, Launcher]:
        """dK/dV's (`dkdv`) or dQ's kernel, writing or adding (ring attention) its gradients; the two may take
        different tiles."""
        bm, bn, warps, stages = self.tiles.get(kind, self.tiles["bwd"])
        programs = (cdiv(self.N_K, bn), self.B * self.H_KV) if dkdv else (cdiv(self.N_Q, bm), self.B * self.H)
        per_call = ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "lse_ptr", "delta_ptr", "dq_ptr", "dk_ptr", "dv_ptr")
        return {acc: Launcher(flash._bwd_kernel, programs, per_call, S=self.shape, DKDV=dkdv,
                              C=flash.BwdTiles(self.causal, acc, bm, bn, self.D), num_warps=warps, num_stages=stages)
                for acc in (False, True)}

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
        sizes = flash_hopper.Sizes(self.H, self.H // self.H_KV, self.N_Q, self.N_K, qv["per_b"], qv["per_h"],
                                   kvv["outer_b"], kvv["outer_h"], qv["cols"], kvv["cols"], *out_strides,
                                   self.scale * flash.LOG2E)
        # 4 warps per consumer group and a producer warp: three warp groups sharing the SM's 64K registers
        return Launcher(flash_hopper._fwd_ws_kernel, grid, ("q_desc", "k_desc", "v_desc", "o_ptr", "lse_ptr"),
                        descriptors, S=sizes, CAUSAL=self.causal, STAGES=stages, num_warps=4, maxnreg=168)

    def tensors(self, meetings: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A call's q, k, v, checked against the plan's shapes and dtype (else refused: `refuse`), contiguous."""
        for name, t, shape in (("q", q, self.q_shape), ("k", k, self.kv_shape), ("v", v, self.kv_shape)):
            if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != self.dtype or t.device != self.device:
                refuse(meetings, PKError(self.mismatch({"q": q, "k": k, "v": v}) + f" ({name} differs)"))
        return q.contiguous(), k.contiguous(), v.contiguous()

    def lse_shape(self) -> tuple[int, int, int]:
        """(B, H, N) of the log-sum-exp, whatever the layout."""
        return self.B, self.H, self.N_Q

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse): out like q, lse (B, H, N) fp32 natural log (-inf for rows that see no key)."""
        q, k, v = self.tensors(0, q, k, v)
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

    def gradients(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, dlse: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """(dq, dk, dv) like q, k, v."""
        q, k, v = self.tensors(0, q, k, v)
        do, out = do.contiguous(), out.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if self.empty or self.N_K == 0:
            return dq.zero_(), dk.zero_(), dv.zero_()
        self.backward_into(do, q, k, v, lse, self.delta(out, do, dlse), dq, dk, dv, accumulate=False)
        return dq, dk, dv

    def backward(self, grads: list[torch.Tensor], saved: list[torch.Tensor], needs: list[bool], q: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float) -> tuple[torch.Tensor, ...]:
        (do, dlse), (out, lse) = grads, saved
        return self.gradients(do, q, k, v, out, lse, dlse)

    @staticmethod
    def fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *options: object) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


_attention = declare(AttentionPlan, "(Tensor q, Tensor k, Tensor v, bool causal, float softmax_scale) -> "
                                    "(Tensor, Tensor)")


@_attention.public
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              softmax_scale: float | None = None, return_lse: bool = False
              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Flash attention on (B, H, N, D) tensors: softmax(q k^T * scale) v, with the causal mask if asked.

    q is (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) with Hq a multiple of Hkv (grouped-query attention). bf16, fp16
    or fp32; D in 16, 32, 64, 128. `softmax_scale` defaults to 1/sqrt(D). With `return_lse`, also the rows'
    log-sum-exp (B, Hq, Nq) in fp32. Differentiable (q, k, v; the log-sum-exp too), a torch custom op
    (``torch.ops.parallelkittens.attention``) that torch.compile traces. Not collective.
    """
    scale = default_scale(q.shape[-1] if isinstance(q, torch.Tensor) else 0, softmax_scale)
    out, lse = _attention(q, k, v, bool(causal), scale)
    return (out, lse) if return_lse else out

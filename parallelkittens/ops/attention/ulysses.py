"""Ulysses attention: trade the sequence for heads, attend on whole sequences, trade back.

Each rank holds q, k, v of (B, N/W, H, D): its part of the sequence, every head. One `all_to_all` per tensor
(scatter the heads, gather the sequence) gives (B, N, H/W, D): every position, this rank's H/W heads, in rank
order along the sequence. The flash kernel reads that (B, N, H, D) layout in place (`flash.AttentionPlan` with
layout "BSHD"), and a last `all_to_all` (scatter the sequence, gather the heads) returns (B, N/W, H, D). The
backward is the same walk: dO goes out like q, dQ, dK, dV come back like the output.

With grouped-query heads, rank j receives query heads j·H/W … and key/value heads j·Hkv/W …, which are the
groups of those query heads, so both H and Hkv must divide by W.
"""

from __future__ import annotations

import torch

from ...runtime.context import context
from ...runtime.errors import PKError
from .. import plan as plans
from ..collectives.all_to_all import plan as all_to_all_plan
from . import flash

SEQ, HEADS = 1, 2  # (B, N, H, D)


class UlyssesPlan:
    """Ulysses attention for one set of shapes, dtype, mask and scale: the five all_to_all plans and the flash
    plan over the gathered layout."""

    op = "ulysses_attention"

    def __init__(self, q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float):
        world = context().local_world_size
        self.q_shape, self.kv_shape, self.dtype, self.device = tuple(q.shape), tuple(k.shape), q.dtype, q.device
        B, n, H, D = q.shape
        H_KV = k.shape[HEADS]
        self.full_q = (B, n * world, H // world, D)
        self.full_kv = (B, n * world, H_KV // world, D)
        self.local = flash.AttentionPlan(self.full_q, self.full_kv, q.dtype, causal, scale, layout="BSHD")
        # all_to_all's plans are collective: every rank builds the same ones in the same order, here
        self._gather_q = all_to_all_plan(q, HEADS, SEQ, zero_copy=False)
        self._gather_kv = all_to_all_plan(k, HEADS, SEQ, zero_copy=False)
        out_full = torch.empty(self.full_q, dtype=q.dtype, device=q.device)
        kv_full = torch.empty(self.full_kv, dtype=q.dtype, device=q.device)
        self._scatter_q = all_to_all_plan(out_full, SEQ, HEADS, zero_copy=False)
        self._scatter_kv = all_to_all_plan(kv_full, SEQ, HEADS, zero_copy=False)

    def _check(self, meetings: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = tensors[:3]
        try:
            self.local_check(q, k, v)
        except PKError as e:
            plans.refuse(meetings, e)
        return tuple(t.contiguous() for t in tensors)

    def local_check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """This call's tensors are what the plan was built for."""
        if q.shape != self.q_shape or k.shape != self.kv_shape or v.shape != self.kv_shape or \
                not (q.dtype == k.dtype == v.dtype == self.dtype) or q.device != self.device:
            raise PKError(f"{self.op}: this plan was built for q {self.q_shape} and k, v {self.kv_shape} of "
                          f"{self.dtype} on {self.device}; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} "
                          f"of {q.dtype} on {q.device}")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(out, and for the backward: q, k, v, out gathered over the sequence and the log-sum-exp)."""
        q, k, v = self._check(4, q, k, v)
        q_full, k_full, v_full = self._gather_q(q), self._gather_kv(k), self._gather_kv(v)
        out_full, lse = self.local.forward(q_full, k_full, v_full)
        return self._scatter_q(out_full), q_full, k_full, v_full, out_full, lse

    def backward(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_full: torch.Tensor,
                 k_full: torch.Tensor, v_full: torch.Tensor, out_full: torch.Tensor, lse: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv) of this rank's q, k, v, from the forward's gathered tensors."""
        (q, k, v, do) = self._check(4, q, k, v, do)
        do_full = self._gather_q(do)
        dq, dk, dv = self.local.backward(do_full, q_full, k_full, v_full, out_full, lse)
        return self._scatter_q(dq), self._scatter_kv(dk), self._scatter_kv(dv)


def check_ulysses(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """Refuse what Ulysses cannot run, before anything collective happens; a description for the agreement."""
    flash.check_qkv(op, q, k, v, layout="BSHD")
    if q.shape[SEQ] != k.shape[SEQ]:
        raise PKError(f"{op}: q holds {q.shape[SEQ]} positions of the sequence but k and v {k.shape[SEQ]}: every "
                      "rank holds the same part of q's and k's sequence")
    world = context().local_world_size
    for name, heads in (("q", q.shape[HEADS]), ("k and v", k.shape[HEADS])):
        if heads % world:
            raise PKError(f"{op}: {name} have {heads} heads, which do not divide among {world} ranks (Ulysses gives "
                          f"each rank H/W whole heads); use a world size that divides the head counts, or "
                          "ring_attention")
    return f"{op} of q {tuple(q.shape)}, k/v {tuple(k.shape)}, {q.dtype}"


def plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
         softmax_scale: float | None = None) -> UlyssesPlan:
    """The plan for Ulysses attention over tensors like q, k, v (collective the first time: `ops/plan.py`)."""
    scale = flash.default_scale(q.shape[-1] if isinstance(q, torch.Tensor) else 0, softmax_scale)
    key = ("ulysses_attention", getattr(q, "shape", None), getattr(k, "shape", None), getattr(q, "dtype", None),
           bool(causal), scale)
    found = plans.find(key)
    if found is not None:
        return found

    def check() -> str:
        return f"{check_ulysses('ulysses_attention', q, k, v)}, causal={bool(causal)}, scale={scale}"

    return plans.get(key, lambda: UlyssesPlan(q, k, bool(causal), scale), check)


@torch.library.custom_op("parallelkittens::ulysses_attention_forward", mutates_args=())
def _ulysses_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return plan(q, k, v, causal, softmax_scale).forward(q, k, v)


@_ulysses_forward.register_fake
def _(q, k, v, causal, softmax_scale):
    world = context().local_world_size
    B, n, H, D = q.shape
    full_q = q.new_empty(B, n * world, H // world, D)
    full_kv = k.new_empty(B, n * world, k.shape[HEADS] // world, D)
    return (torch.empty_like(q), full_q, full_kv, torch.empty_like(full_kv), torch.empty_like(full_q),
            q.new_empty(B, H // world, n * world, dtype=torch.float32))


@torch.library.custom_op("parallelkittens::ulysses_attention_backward", mutates_args=())
def _ulysses_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_full: torch.Tensor,
                      k_full: torch.Tensor, v_full: torch.Tensor, out_full: torch.Tensor, lse: torch.Tensor,
                      causal: bool, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return plan(q, k, v, causal, softmax_scale).backward(do, q, k, v, q_full, k_full, v_full, out_full, lse)


@_ulysses_backward.register_fake
def _(do, q, k, v, q_full, k_full, v_full, out_full, lse, causal, softmax_scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output) -> None:
    q, k, v, causal, scale = inputs
    ctx.save_for_backward(q, k, v, *output[1:])
    ctx.args = (causal, scale)


def _backward(ctx, do, *unused):
    q, k, v, *saved = ctx.saved_tensors
    do = torch.zeros_like(q) if do is None else do
    return (*_ulysses_backward(do, q, k, v, *saved, *ctx.args), None, None)


_ulysses_forward.register_autograd(_backward, setup_context=_setup)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                      softmax_scale: float | None = None) -> torch.Tensor:
    """This rank's rows of attention over the whole sequence, by trading sequence for heads (DeepSpeed-Ulysses).

    q is (B, N/W, Hq, D), k and v (B, N/W, Hkv, D): this rank's contiguous part of the sequence (block r of W), all
    heads; Hq and Hkv must divide by the world size. Returns (B, N/W, Hq, D). Collective; differentiable (q, k,
    v); a torch custom op. Holds the gathered q, k, v and output (each W/1 of a part's heads over the whole
    sequence: the same bytes as q, k, v, out) for the backward.
    """
    scale = flash.default_scale(q.shape[-1] if isinstance(q, torch.Tensor) else 0, softmax_scale)
    if not torch.compiler.is_compiling():  # traced, the custom op builds it when it runs
        plan(q, k, v, causal, scale)  # every rank checks and agrees before the custom op runs
    return _ulysses_forward(q, k, v, bool(causal), scale)[0]


plans.attach(ulysses_attention, plan)

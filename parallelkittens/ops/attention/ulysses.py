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
from ..collectives.all_to_all import all_to_all
from ..plan import Plan, declare, refuse
from .attention import AttentionPlan, check_qkv, default_scale

SEQ, HEADS = 1, 2  # (B, N, H, D)


def check_ulysses(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """Refuse what Ulysses cannot run, before anything collective happens; a description for the agreement."""
    check_qkv(op, q, k, v, layout="BSHD")
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


class UlyssesPlan(Plan):
    """Ulysses attention for one set of shapes, dtype, mask and scale: the four all_to_all plans and the flash
    plan over the gathered layout."""

    op = "ulysses_attention"
    arity = 3
    differentiable = 1
    saves = (1, 2, 3, 4, 5)  # the gathered q, k, v and output, and the log-sum-exp

    key = AttentionPlan.key  # the same arguments as attention's

    @classmethod
    def check(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              softmax_scale: float | None = None) -> str:
        scale = default_scale(q.shape[-1], softmax_scale)
        return f"{check_ulysses(cls.op, q, k, v)}, causal={bool(causal)}, scale={scale}"

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                 softmax_scale: float | None = None):
        world = context().local_world_size
        B, n, H, D = q.shape
        full_q = torch.empty((B, n * world, H // world, D), dtype=q.dtype, device=q.device)
        full_kv = torch.empty((B, n * world, k.shape[HEADS] // world, D), dtype=q.dtype, device=q.device)
        self.local = AttentionPlan(full_q, full_kv, full_kv, causal, softmax_scale, layout="BSHD")
        # all_to_all's plans are collective: every rank builds the same ones in the same order, here
        self._gather_q = all_to_all.plan(q, HEADS, SEQ, zero_copy=False)
        self._gather_kv = all_to_all.plan(k, HEADS, SEQ, zero_copy=False)
        self._scatter_q = all_to_all.plan(full_q, SEQ, HEADS, zero_copy=False)
        self._scatter_kv = all_to_all.plan(full_kv, SEQ, HEADS, zero_copy=False)
        self.q_shape, self.kv_shape = tuple(q.shape), tuple(k.shape)
        self.remember(q=q, k=k, v=k)

    def _tensors(self, meetings: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This call's tensors, checked against what the plan was built for (else refused), contiguous."""
        q, k, v = tensors[:3]
        try:
            for t, shape in ((q, self.q_shape), (k, self.kv_shape), (v, self.kv_shape)):
                if t.shape != shape or t.dtype != self.local.dtype or t.device != self.device:
                    raise PKError(self.mismatch({"q": q, "k": k, "v": v}))
        except PKError as e:
            refuse(meetings, e)
        return tuple(t.contiguous() for t in tensors)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(out, and for the backward: q, k, v, out gathered over the sequence and the log-sum-exp)."""
        q, k, v = self._tensors(4, q, k, v)
        q_full, k_full, v_full = self._gather_q(q), self._gather_kv(k), self._gather_kv(v)
        out_full, lse = self.local(q_full, k_full, v_full)
        return self._scatter_q(out_full), q_full, k_full, v_full, out_full, lse

    def backward(self, grads: list[torch.Tensor], saved: list[torch.Tensor], needs: list[bool], q: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, *options: object) -> tuple[torch.Tensor, ...]:
        """(dq, dk, dv) of this rank's q, k, v, from the forward's gathered tensors."""
        q_full, k_full, v_full, out_full, lse = saved
        q, k, v, do = self._tensors(4, q, k, v, grads[0])
        do_full = self._gather_q(do)
        dq, dk, dv = self.local.gradients(do_full, q_full, k_full, v_full, out_full, lse)
        return self._scatter_q(dq), self._scatter_kv(dk), self._scatter_kv(dv)

    @staticmethod
    def fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float
             ) -> tuple[torch.Tensor, ...]:
        world = context().local_world_size
        B, n, H, D = q.shape
        full_q = q.new_empty(B, n * world, H // world, D)
        full_kv = k.new_empty(B, n * world, k.shape[HEADS] // world, D)
        return (torch.empty_like(q), full_q, full_kv, torch.empty_like(full_kv), torch.empty_like(full_q),
                q.new_empty(B, H // world, n * world, dtype=torch.float32))


_ulysses_attention = declare(UlyssesPlan, "(Tensor q, Tensor k, Tensor v, bool causal, float softmax_scale) -> "
                                          "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


@_ulysses_attention.public
def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                      softmax_scale: float | None = None) -> torch.Tensor:
    """This rank's rows of attention over the whole sequence, by trading sequence for heads (DeepSpeed-Ulysses).

    q is (B, N/W, Hq, D), k and v (B, N/W, Hkv, D): this rank's contiguous part of the sequence (block r of W), all
    heads; Hq and Hkv must divide by the world size. Returns (B, N/W, Hq, D). Collective; differentiable (q, k,
    v); a torch custom op. Holds the gathered q, k, v and output (each W/1 of a part's heads over the whole
    sequence: the same bytes as q, k, v, out) for the backward.
    """
    scale = default_scale(q.shape[-1] if isinstance(q, torch.Tensor) else 0, softmax_scale)
    return _ulysses_attention(q, k, v, bool(causal), scale)[0]

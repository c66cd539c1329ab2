"""`moe_dispatch_gemm` and `moe_gemm_combine` as torch custom ops with autograd, each backward built from the other
op's kernel run the other way:

* dispatch: a = rows(x) @ w1. Backward: dx = the combine kernel on da with w1 transposed (each row's gradient goes
  back to its token's slot), summed over the token's kept slots; dw1[e] = rows(x)ᵀ da over expert e's rows.
* combine: out[t] = sum_j w[t, j] · (h @ w2)[pair (t, j)]. Backward: dh = the dispatch kernel on dout with w2
  transposed, each row scaled by its pair's weight (the weights are gathered from their ranks); dw2[e] =
  hᵀ (w · rows(dout)) over expert e's rows; dw[t, j] = <dout[t], out row of pair (t, j)> (the forward keeps the
  slots when the weights need a gradient).

A custom op cannot take a Python object, so the ops name the layout by its id (`layout.id`); autograd holds the
layout until the backward has run. Under torch.compile the id is a constant of the graph: a new layout (a new
routing) means a new graph, so compile a function that takes the routing's layout as built outside it only
where the layout is reused (serving with a fixed capacity layout captured in a CUDA graph is the fast path).
"""

from __future__ import annotations

import torch

from ...runtime.context import context
from ...runtime.errors import PKError
from ..collectives.all_gather import all_gather
from . import combine, dispatch
from .layout import MoeLayout, layouts


def _layout(layout_id: int) -> MoeLayout:
    layout = layouts().get(layout_id)
    if layout is None:
        raise PKError(f"moe: layout {layout_id} no longer exists (keep the layout until the backward has run)")
    return layout


def _rows_of(source: torch.Tensor, layout: MoeLayout) -> torch.Tensor:
    """Each expert row's token row, from the received tokens (or x at one rank); zero for rows of no pair (a
    select, not a product: those rows may read received rows never written, which may hold inf or NaN)."""
    if source.shape[0] == 0:  # nothing was pulled (no tokens anywhere): every row is a row of no pair
        return source.new_zeros(layout.rows, source.shape[1])
    return torch.where(layout.row_valid[:, None], source[layout.row_recv.long()], 0)


def _per_expert(a: torch.Tensor, b: torch.Tensor, layout: MoeLayout) -> torch.Tensor:
    """(epr, K, N): for each local expert, aᵀ b over its rows (a (rows, K), b (rows, N))."""
    if layout.capacity is not None:
        cap, epr = layout.capacity, layout.experts_per_rank
        return torch.bmm(a.view(epr, cap, -1).transpose(1, 2), b.view(epr, cap, -1))
    out = a.new_empty(layout.experts_per_rank, a.shape[1], b.shape[1])
    for e, (start, end) in enumerate(layout.expert_rows()):
        torch.matmul(a[start:end].t(), b[start:end], out=out[e])
    return out


@torch.library.custom_op("parallelkittens::moe_dispatch_gemm", mutates_args=())
def _dispatch(x: torch.Tensor, w1: torch.Tensor, layout_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    layout = _layout(layout_id)
    a, received = dispatch.plan(x, w1, layout)(x, w1, layout)
    return a, received if context().local_world_size > 1 else x.new_empty(0)


@_dispatch.register_fake
def _(x, w1, layout_id):
    layout = _layout(layout_id)
    pulled = (layout.max_pulled, x.shape[1]) if context().local_world_size > 1 else (0,)
    return x.new_empty(layout.rows, w1.shape[2]), x.new_empty(pulled)


@torch.library.custom_op("parallelkittens::moe_dispatch_gemm_backward", mutates_args=())
def _dispatch_backward(da: torch.Tensor, x: torch.Tensor, received: torch.Tensor, w1: torch.Tensor, layout_id: int,
                       needs: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    layout = _layout(layout_id)
    da = da.contiguous().to(w1.dtype)
    dx = x.new_empty(0)
    if needs[0] or layout.world > 1:  # collective: every rank runs it, whether or not its x needs a gradient
        slots = combine.plan(da, w1.transpose(1, 2), layout)(da, w1.transpose(1, 2), layout)
        dx = combine.sum_slots(slots, layout.kept, None, x.dtype) if needs[0] else dx
    dw1 = w1.new_empty(0)
    if needs[1]:
        dw1 = _per_expert(_rows_of(received if layout.world > 1 else x, layout), da, layout)
    return dx, dw1


@_dispatch_backward.register_fake
def _(da, x, received, w1, layout_id, needs):
    return x.new_empty(x.shape if needs[0] else (0,)), w1.new_empty(w1.shape if needs[1] else (0,))


def _dispatch_setup(ctx, inputs, output) -> None:
    x, w1, layout_id = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, output[1], w1)
    ctx.layout_id = layout_id
    ctx.layout = _layout(layout_id)  # held until the backward has run, however the caller keeps it


def _dispatch_grads(ctx, da, _received):
    if da is None:
        return None, None, None
    x, received, w1 = ctx.saved_tensors
    needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1]]
    dx, dw1 = _dispatch_backward(da, x, received, w1, ctx.layout_id, needs)
    return (dx if needs[0] else None), (dw1 if needs[1] else None), None


_dispatch.register_autograd(_dispatch_grads, setup_context=_dispatch_setup)


@torch.library.custom_op("parallelkittens::moe_gemm_combine", mutates_args=())
def _combine(h: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, layout_id: int, keep_slots: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
    layout = _layout(layout_id)
    slots = combine.plan(h, w2, layout, weights)(h, w2, layout, weights)
    out = combine.sum_slots(slots, layout.kept, weights, h.dtype)
    return out, slots.clone() if keep_slots else h.new_empty(0)


@_combine.register_fake
def _(h, w2, weights, layout_id, keep_slots):
    layout = _layout(layout_id)
    slots = (layout.tokens, layout.top_k, w2.shape[2]) if keep_slots else (0,)
    return h.new_empty(layout.tokens, w2.shape[2]), h.new_empty(slots)


def _gathered_weights(weights: torch.Tensor, layout: MoeLayout) -> torch.Tensor:
    """Every rank's routing weights, (W * Tmax * k,) fp32, in the layout's pair order."""
    padded = weights.new_zeros(layout.max_tokens, layout.top_k, dtype=torch.float32)
    padded[:layout.tokens] = weights
    return (all_gather(padded, 0) if layout.world > 1 else padded).reshape(-1)


@torch.library.custom_op("parallelkittens::moe_gemm_combine_backward", mutates_args=())
def _combine_backward(dout: torch.Tensor, h: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      slots: torch.Tensor, layout_id: int, needs: list[bool]
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    layout = _layout(layout_id)
    dout = dout.contiguous().to(h.dtype)
    scale = _gathered_weights(weights, layout)[layout.row_pair]
    w2_t = w2.transpose(1, 2)
    dh, received = dispatch.plan(dout, w2_t, layout)(dout, w2_t, layout, row_scale=scale)
    dw2 = w2.new_empty(0)
    if needs[1]:
        dw2 = _per_expert(h, _rows_of(received if layout.world > 1 else dout, layout) * scale[:, None].to(h.dtype),
                          layout)
    dweights = weights.new_empty(0)
    if needs[2]:
        products = torch.bmm(slots, dout[:, :, None]).squeeze(-1).float()  # no (T, k, H) fp32 temporaries
        dweights = torch.where(layout.kept, products, 0).to(weights.dtype)  # a dropped pair's slot is never written
    return dh, dw2, dweights


@_combine_backward.register_fake
def _(dout, h, w2, weights, slots, layout_id, needs):
    return h.new_empty(h.shape), w2.new_empty(w2.shape if needs[1] else (0,)), weights.new_empty(
        weights.shape if needs[2] else (0,))


def _combine_setup(ctx, inputs, output) -> None:
    h, w2, weights, layout_id, keep_slots = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(h, w2, weights, output[1])
    ctx.layout_id, ctx.kept_slots = layout_id, keep_slots
    ctx.layout = _layout(layout_id)  # held until the backward has run, however the caller keeps it


def _combine_grads(ctx, dout, _slots):
    if dout is None:
        return None, None, None, None, None
    h, w2, weights, slots = ctx.saved_tensors
    needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2] and ctx.kept_slots]
    dh, dw2, dweights = _combine_backward(dout, h, w2, weights, slots, ctx.layout_id, needs)
    return dh, (dw2 if needs[1] else None), (dweights if needs[2] else None), None, None


_combine.register_autograd(_combine_grads, setup_context=_combine_setup)


def moe_dispatch_gemm(x: torch.Tensor, routing: torch.Tensor | MoeLayout, w1: torch.Tensor, *,
                      capacity: int | None = None) -> tuple[torch.Tensor, MoeLayout]:
    """Dispatch this rank's tokens to their experts and run each expert's first GEMM.

    `x` (T, H) this rank's tokens; `routing` their top-k expert ids (T, k), or a layout built by `moe_layout`;
    `w1` (E/W, H, I) this rank's experts. Returns (activations, layout): activations (rows, I) hold this rank's
    experts' rows, expert after expert (`layout.expert_rows()`), each row its token times the expert's weight.
    `capacity` rows per expert: a static, synchronisation-free layout (see `moe_layout`). Collective,
    differentiable (x and w1), a torch custom op.
    """
    op = "moe_dispatch_gemm"
    layout = dispatch.layout_of(op, routing, getattr(w1, "shape", (0,))[0] * context().local_world_size, capacity)
    return _dispatch(x, w1, layout.id)[0], layout


def moe_gemm_combine(h: torch.Tensor, w2: torch.Tensor, layout: MoeLayout, topk_weights: torch.Tensor
                     ) -> torch.Tensor:
    """Run each expert's second GEMM on its rows `h` (rows, I) and send every output row back to its token: returns
    this rank's (T, H), each token the sum over its kept k experts, in order, of topk_weights[t, j] times the
    expert's output. `w2` (E/W, I, H). Bitwise reproducible. Collective, differentiable (h, w2 and
    topk_weights), a torch custom op."""
    op = "moe_gemm_combine"
    if not isinstance(layout, MoeLayout):
        raise PKError(f"{op}: layout must be the MoeLayout moe_dispatch_gemm returned, got {type(layout).__name__}")
    keep = torch.is_grad_enabled() and getattr(topk_weights, "requires_grad", False)
    return _combine(h, w2, topk_weights, layout.id, keep)[0]

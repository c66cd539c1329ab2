"""`moe_dispatch_gemm` and `moe_gemm_combine`: the ops, torch custom ops with autograd, each backward built from
the other op's kernel run the other way (`dispatch.DispatchPlan.backward`, `combine.CombinePlan.backward`).

A custom op cannot take a Python object, so the ops name the layout by its id (`layout.id`); autograd holds the
layout until the backward has run. Under torch.compile the id is a constant of the graph: a new layout (a new
routing) means a new graph, so compile a function that takes the routing's layout as built outside it only
where the layout is reused (serving with a fixed capacity layout captured in a CUDA graph is the fast path).
"""

from __future__ import annotations

import torch

from ...runtime.context import context
from ...runtime.errors import PKError
from .combine import moe_gemm_combine_op
from .dispatch import layout_of, moe_dispatch_gemm_op
from .layout import MoeLayout


@moe_dispatch_gemm_op.public
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
    layout = layout_of(op, routing, getattr(w1, "shape", (0,))[0] * context().local_world_size, capacity)
    return moe_dispatch_gemm_op(x, w1, layout.id)[0], layout


@moe_gemm_combine_op.public
def moe_gemm_combine(h: torch.Tensor, w2: torch.Tensor, layout: MoeLayout, topk_weights: torch.Tensor
                     ) -> torch.Tensor:
    """Run each expert's second GEMM on its rows `h` (rows, I) and send every output row back to its token: returns
    this rank's (T, H), each token the sum over its kept k experts, in order, of topk_weights[t, j] times the
    expert's output. `w2` (E/W, I, H). Bitwise reproducible. Collective, differentiable (h, w2 and
    topk_weights), a torch custom op."""
    if not isinstance(layout, MoeLayout):
        raise PKError(f"moe_gemm_combine: layout must be the MoeLayout moe_dispatch_gemm returned, got "
                      f"{type(layout).__name__}")
    keep = torch.is_grad_enabled() and getattr(topk_weights, "requires_grad", False)
    return moe_gemm_combine_op(h, w2, topk_weights, layout.id, keep)[0]

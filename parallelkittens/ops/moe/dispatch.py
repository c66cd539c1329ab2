"""moe_dispatch_gemm: pull the tokens routed to this rank's experts and run each expert's first GEMM on them, the
GEMM of a block of rows starting as soon as its tokens have landed (the paper's expert-parallel kernel).

Each rank copies its tokens into its parallel token buffer; the kernel (`ops/moe/grouped.py`, direction PULL)
pulls them, one copy per (token, destination rank), and multiplies. At one rank nothing moves: the GEMM reads x.
The result is one (rows, I) tensor of this rank's experts' rows, expert after expert (`layout.expert_rows()`).
"""

from __future__ import annotations

import torch

from ...runtime.context import context
from ...runtime.errors import PKError
from ...runtime.heap import heap
from ...runtime.sizes import cdiv
from ..plan import OPS, Plan, check_tensor, declare, refuse
from .grouped import GroupedGemm, sum_slots
from .layout import MoeLayout, layout_by_id, moe_layout, per_expert, rows_of

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_weight(op: str, name: str, w: torch.Tensor, x_dtype: torch.dtype, epr: int, k_dim: int) -> None:
    check_tensor(op, name, w, ndim=3, what="(experts on this rank, in, out)")
    if w.shape[0] != epr or w.shape[1] != k_dim:
        raise PKError(f"{op}: {name} is {tuple(w.shape)}; expected ({epr}, {k_dim}, ·): {epr} experts per rank")
    if w.dtype != x_dtype:
        raise PKError(f"{op}: {name} is {w.dtype}; expected {x_dtype} as the tokens are")


def check_tokens(op: str, x: torch.Tensor, layout: MoeLayout) -> None:
    check_tensor(op, "x", x, DTYPES, 2, what="(tokens, hidden)")
    if x.shape[0] != layout.tokens:
        raise PKError(f"{op}: x has {x.shape[0]} tokens but the routing {layout.tokens}")


def layout_of(op: str, routing: torch.Tensor | MoeLayout, num_experts: int, capacity: int | None) -> MoeLayout:
    """The layout given, or the layout of the top-k ids given."""
    if isinstance(routing, MoeLayout):
        if capacity is not None and capacity != routing.capacity:
            raise PKError(f"{op}: capacity={capacity} but the layout was built with {routing.capacity}")
        return routing
    return moe_layout(routing, num_experts, capacity=capacity)


class DispatchPlan(Plan):
    """moe_dispatch_gemm for one (max tokens, H, I, experts per rank, dtype, rows per tile): the parallel token
    buffer on the heap and the kernel's PULL direction. The op's custom op names its layout by id (`api.py`)."""

    op = "moe_dispatch_gemm"
    differentiable = 1
    saves = (1,)  # the received tokens

    @classmethod
    def key(cls, x: torch.Tensor, w: torch.Tensor, layout_id: int) -> tuple:
        layout = layout_by_id(layout_id)
        return (layout.buffer_tokens, getattr(x, "shape", (0, 0))[-1], tuple(getattr(w, "shape", ())),
                getattr(x, "dtype", None), layout.block_rows)

    @classmethod
    def check(cls, x: torch.Tensor, w: torch.Tensor, layout_id: int) -> str:
        layout = layout_by_id(layout_id)
        check_tokens(cls.op, x, layout)
        check_weight(cls.op, "w1", w, x.dtype, layout.experts_per_rank, x.shape[1])
        return (f"{cls.op} of up to {layout.buffer_tokens} tokens of {x.shape[1]} {x.dtype} into "
                f"{layout.experts_per_rank} experts per rank of ({x.shape[1]}, {w.shape[2]}), tiles of "
                f"{layout.block_rows} rows")

    def __init__(self, x: torch.Tensor, w: torch.Tensor, layout_id: int):
        ctx = context()
        layout = layout_by_id(layout_id)
        max_tokens, hidden, inner, epr = layout.buffer_tokens, x.shape[1], w.shape[2], layout.experts_per_rank
        self.world, self.hidden, self.inner, self.dtype = ctx.local_world_size, hidden, inner, x.dtype
        self.tokens = tokens_handle = None
        if self.world > 1:
            buffer = heap().allocate(max(1, max_tokens * hidden) * x.dtype.itemsize, f"{self.op}.tokens")
            self.tokens, tokens_handle = buffer.view((max_tokens, hidden), x.dtype), buffer.handle
        num_comm = 8 if ctx.device.type == "cuda" else 1
        self.gemm = GroupedGemm(self.op, True, hidden, inner, self.world * max_tokens, x.dtype, layout.block_rows,
                                num_comm, plan=(max_tokens, epr), tokens=self.tokens, tokens_handle=tokens_handle)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, layout: MoeLayout, row_scale: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(activations (rows, I), received tokens (pulled rows, H); x itself at one rank). `w` (epr, H, I), any
        strides; `row_scale` (rows,) fp32 multiplies each output row."""
        try:
            check_tokens(self.op, x, layout)
            check_weight(self.op, "w1", w, self.dtype, layout.experts_per_rank, self.hidden)
            if w.shape[2] != self.inner or x.dtype != self.dtype:
                raise PKError(f"{self.op}: called with {x.dtype} and w {tuple(w.shape)}, the plan was built for "
                              f"{self.dtype} and (·, {self.hidden}, {self.inner})")
        except PKError as e:
            refuse(1, e)
        alloc = torch.zeros if layout.capacity is not None else torch.empty  # rows past a count stay zero
        out = alloc(layout.rows, self.inner, dtype=self.dtype, device=x.device)
        if self.world == 1:
            received = x.contiguous()
        else:
            self.tokens[:x.shape[0]].copy_(x)
            received = torch.empty(layout.max_pulled, self.hidden, dtype=self.dtype, device=x.device)
        self.gemm(a=received, b=w, out=out, row_index=layout.row_recv, row_src=layout.row_src,
                  tile_expert=layout.tile_expert, tile_start=layout.tile_start, tile_end=layout.tile_end,
                  num_row_tiles=layout.num_row_tiles, row_scale=row_scale, pull_src=layout.pull_src,
                  pull_tok=layout.pull_tok, pulled=layout.pulled,
                  num_blocks=cdiv(layout.max_pulled, self.gemm.BR) if self.world > 1 else 0)
        return out, received

    def forward(self, x: torch.Tensor, w: torch.Tensor, layout_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, received = self(x, w, layout_by_id(layout_id))
        return a, received if self.world > 1 else x.new_empty(0)

    @staticmethod
    def fake(x: torch.Tensor, w: torch.Tensor, layout_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        layout = layout_by_id(layout_id)
        pulled = (layout.max_pulled, x.shape[1]) if context().local_world_size > 1 else (0,)
        return x.new_empty(layout.rows, w.shape[2]), x.new_empty(pulled)

    @staticmethod
    def keep(x: torch.Tensor, w: torch.Tensor, layout_id: int) -> MoeLayout:
        return layout_by_id(layout_id)  # held until the backward has run, however the caller keeps it

    def backward(self, grads: list[torch.Tensor], saved: list[torch.Tensor], needs: list[bool], x: torch.Tensor,
                 w: torch.Tensor, layout_id: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """dx = the combine kernel on da with w1 transposed (each row's gradient back to its token's slot), summed
        over the token's kept slots; dw1[e] = rows(x)ᵀ da over expert e's rows."""
        layout = layout_by_id(layout_id)
        da, (received,) = grads[0].contiguous().to(w.dtype), saved
        dx = dw = None
        if needs[0] or layout.world > 1:  # collective: every rank runs it, whether or not its x needs a gradient
            w_t = w.transpose(1, 2)
            slots = OPS["moe_gemm_combine"].plan(da, w_t, None, layout_id, False)(da, w_t, layout)
            dx = sum_slots(slots, layout.kept, None, x.dtype) if needs[0] else None
        if needs[1]:
            dw = per_expert(rows_of(received if layout.world > 1 else x, layout), da, layout)
        return dx, dw


moe_dispatch_gemm_op = declare(DispatchPlan, "(Tensor x, Tensor w1, int layout_id) -> (Tensor, Tensor)")

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
from .. import plan as plans
from .grouped import GroupedGemm
from .layout import MoeLayout, moe_layout

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def reference_moe_dispatch_gemm(xs: list[torch.Tensor], kept: list[torch.Tensor], ids: list[torch.Tensor],
                                w1_all: torch.Tensor, rank: int, world: int) -> list[torch.Tensor]:
    """Rank `rank`'s per-expert activations in float64: expert e's rows are its kept (rank, token, k) pairs in that
    order, each its token times w1[e]. `w1_all` holds every expert's weight (E, H, I)."""
    epr = w1_all.shape[0] // world
    out = []
    for e in range(rank * epr, (rank + 1) * epr):
        rows = [xs[s][t].double() for s in range(world) for t in range(xs[s].shape[0])
                for j in range(ids[s].shape[1]) if kept[s][t, j] and int(ids[s][t, j]) == e]
        x = torch.stack(rows) if rows else torch.zeros(0, w1_all.shape[1], dtype=torch.float64)
        out.append(x @ w1_all[e].double())
    return out


def check_weight(op: str, name: str, w: torch.Tensor, x_dtype: torch.dtype, epr: int, k_dim: int) -> None:
    ctx = context()
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        raise PKError(f"{op}: {name} must be (experts on this rank, in, out), got {getattr(w, 'shape', w)}")
    if w.shape[0] != epr or w.shape[1] != k_dim:
        raise PKError(f"{op}: {name} is {tuple(w.shape)}; expected ({epr}, {k_dim}, ·): {epr} experts per rank")
    if w.dtype != x_dtype or w.device != ctx.device:
        raise PKError(f"{op}: {name} is {w.dtype} on {w.device}; expected {x_dtype} on {ctx.device}")


class DispatchPlan:
    """moe_dispatch_gemm for one (max tokens, H, I, experts per rank, dtype, rows per tile): the parallel token
    buffer on the heap and the kernel's PULL direction."""

    op = "moe_dispatch_gemm"

    def __init__(self, max_tokens: int, hidden: int, inner: int, epr: int, dtype: torch.dtype, block: int):
        ctx = context()
        self.world, self.hidden, self.inner, self.dtype = ctx.local_world_size, hidden, inner, dtype
        self.tokens = self.tokens_handle = None
        if self.world > 1:
            buffer = heap().allocate(max(1, max_tokens * hidden) * dtype.itemsize, f"{self.op}.tokens")
            self.tokens, self.tokens_handle = buffer.view((max_tokens, hidden), dtype), buffer.handle
        num_comm = 8 if ctx.device.type == "cuda" else 1
        self.gemm = GroupedGemm(self.op, True, hidden, inner, self.world * max_tokens, dtype, block, num_comm,
                                plan=(max_tokens, epr))

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
            plans.refuse(1, e)
        alloc = torch.zeros if layout.capacity is not None else torch.empty  # rows past a count stay zero
        out = alloc(layout.rows, self.inner, dtype=self.dtype, device=x.device)
        if self.world == 1:
            received = x.contiguous()
        else:
            self.tokens[:x.shape[0]].copy_(x)
            received = torch.empty(layout.max_pulled, self.hidden, dtype=self.dtype, device=x.device)
        self.gemm(a=received, b=w, out=out, out_handle=None, row_index=layout.row_recv, row_src=layout.row_src,
                  tile_expert=layout.tile_expert, tile_start=layout.tile_start, tile_end=layout.tile_end,
                  num_row_tiles=layout.num_row_tiles, row_scale=row_scale, tokens=self.tokens,
                  tokens_handle=self.tokens_handle, pull_src=layout.pull_src, pull_tok=layout.pull_tok,
                  pulled=layout.pulled, num_blocks=cdiv(layout.max_pulled, self.gemm.BR) if self.world > 1 else 0)
        return out, received


def plan(x: torch.Tensor, w: torch.Tensor, layout: MoeLayout) -> DispatchPlan:
    """The plan for dispatches of tokens like `x` into experts like `w` (collective the first time)."""
    op = "moe_dispatch_gemm"
    key = (op, layout.buffer_tokens, getattr(x, "shape", (0, 0))[-1], tuple(getattr(w, "shape", ())),
           getattr(x, "dtype", None), layout.block_rows)
    found = plans.find(key)
    if found is not None:
        return found

    def check() -> str:
        check_tokens(op, x, layout)
        check_weight(op, "w1", w, x.dtype, layout.experts_per_rank, x.shape[1])
        return (f"{op} of up to {layout.buffer_tokens} tokens of {x.shape[1]} {x.dtype} into {layout.experts_per_rank}"
                f" experts per rank of ({x.shape[1]}, {w.shape[2]}), tiles of {layout.block_rows} rows")

    return plans.get(key, lambda: DispatchPlan(layout.buffer_tokens, x.shape[1], w.shape[2], layout.experts_per_rank,
                                               x.dtype, layout.block_rows), check)


def check_tokens(op: str, x: torch.Tensor, layout: MoeLayout) -> None:
    ctx = context()
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise PKError(f"{op}: x must be a (tokens, hidden) tensor, got {getattr(x, 'shape', x)}")
    if x.shape[0] != layout.tokens:
        raise PKError(f"{op}: x has {x.shape[0]} tokens but the routing {layout.tokens}")
    if x.dtype not in DTYPES or x.device != ctx.device:
        raise PKError(f"{op}: x is {x.dtype} on {x.device}; use bfloat16, float16 or float32 on {ctx.device}")


def layout_of(op: str, routing: torch.Tensor | MoeLayout, num_experts: int, capacity: int | None) -> MoeLayout:
    """The layout given, or the layout of the top-k ids given."""
    if isinstance(routing, MoeLayout):
        if capacity is not None and capacity != routing.capacity:
            raise PKError(f"{op}: capacity={capacity} but the layout was built with {routing.capacity}")
        return routing
    return moe_layout(routing, num_experts, capacity=capacity)

"""moe_gemm_combine: each expert's second GEMM, whose epilogue sends every output row back to the rank and the
(token, k) slot it came from; then each rank sums its tokens' k rows, weighted, in a fixed order.

The kernel (`ops/moe/grouped.py`, direction combine) stores each row into its source rank's parallel slot buffer
(T_max * k, H) and ends with a barrier, so every slot is in when it returns. The sum reads slot 0 to k-1 of a
token in that order, in fp32, skipping dropped pairs: the result is bitwise the same run to run, however the
tiles were scheduled (no atomics).
"""

from __future__ import annotations

import torch

from ...runtime.errors import PKError
from ...runtime.heap import heap
from ..collectives.all_gather import all_gather
from ..plan import Plan, check_tensor, declare, refuse
from .dispatch import check_weight, moe_dispatch_gemm_op
from .grouped import GroupedGemm, sum_slots
from .layout import MoeLayout, layout_by_id, per_expert, rows_of


def check_rows(op: str, h: torch.Tensor, layout: MoeLayout) -> None:
    check_tensor(op, "the expert rows", h, (torch.bfloat16, torch.float16, torch.float32), 2)
    if h.shape[0] != layout.rows:
        raise PKError(f"{op}: the expert rows must be ({layout.rows}, inner) as the layout has them, got "
                      f"{tuple(h.shape)}")


def check_weights(op: str, weights: torch.Tensor, layout: MoeLayout) -> None:
    check_tensor(op, "topk_weights", weights, ndim=2)
    if tuple(weights.shape) != (layout.tokens, layout.top_k):
        raise PKError(f"{op}: topk_weights must be ({layout.tokens}, {layout.top_k}) like the routing, got "
                      f"{tuple(weights.shape)}")
    if not weights.is_floating_point():
        raise PKError(f"{op}: topk_weights must be floating point, got {weights.dtype}")


def _gathered_weights(weights: torch.Tensor, layout: MoeLayout) -> torch.Tensor:
    """Every rank's routing weights, (W * Tmax * k,) fp32, in the layout's pair order."""
    padded = weights.new_zeros(layout.max_tokens, layout.top_k, dtype=torch.float32)
    padded[:layout.tokens] = weights
    return (all_gather(padded, 0) if layout.world > 1 else padded).reshape(-1)


class CombinePlan(Plan):
    """moe_gemm_combine for one (max tokens, k, I, H, experts per rank, dtype, rows per tile): the parallel slot
    buffer on the heap and the kernel's combine direction. The op's custom op names its layout by id and says
    whether to keep the slots (for the routing weights' gradient)."""

    op = "moe_gemm_combine"
    differentiable = 1
    saves = (1,)  # the slots, where kept

    @classmethod
    def key(cls, h: torch.Tensor, w: torch.Tensor, weights: torch.Tensor | None, layout_id: int,
            keep_slots: bool = False) -> tuple:
        layout = layout_by_id(layout_id)
        return (layout.buffer_tokens, layout.top_k, tuple(getattr(w, "shape", ())), getattr(h, "dtype", None),
                layout.block_rows)

    @classmethod
    def check(cls, h: torch.Tensor, w: torch.Tensor, weights: torch.Tensor | None, layout_id: int,
              keep_slots: bool = False) -> str:
        layout = layout_by_id(layout_id)
        check_rows(cls.op, h, layout)
        check_weight(cls.op, "w2", w, h.dtype, layout.experts_per_rank, h.shape[1])
        if weights is not None:
            check_weights(cls.op, weights, layout)
        return (f"{cls.op} of up to {layout.buffer_tokens} tokens, top-{layout.top_k}, {layout.experts_per_rank} "
                f"experts per rank of ({h.shape[1]}, {w.shape[2]}) {h.dtype}, tiles of {layout.block_rows} rows")

    def __init__(self, h: torch.Tensor, w: torch.Tensor, weights: torch.Tensor | None, layout_id: int,
                 keep_slots: bool = False):
        layout = layout_by_id(layout_id)
        max_tokens, top_k, hidden = layout.buffer_tokens, layout.top_k, w.shape[2]
        self.top_k, self.hidden, self.dtype = top_k, hidden, h.dtype
        buffer = heap().allocate(max(1, max_tokens * top_k * hidden) * h.dtype.itemsize, f"{self.op}.slots")
        self.slots = buffer.view((max_tokens * top_k, hidden), h.dtype)
        self.gemm = GroupedGemm(self.op, False, h.shape[1], hidden, 0, h.dtype, layout.block_rows, 0,
                                plan=(max_tokens, top_k, layout.experts_per_rank), out_handle=buffer.handle)

    def __call__(self, h: torch.Tensor, w: torch.Tensor, layout: MoeLayout, weights: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """This rank's (T, k, H) slots, every kept pair's output row in place (the plan's buffer: read it before
        the next call). `w` (epr, I, H), any strides; `weights`, if given, are checked against the layout."""
        try:
            check_rows(self.op, h, layout)
            check_weight(self.op, "w2", w, self.dtype, layout.experts_per_rank, h.shape[1])
            if w.shape[2] != self.hidden or h.dtype != self.dtype:
                raise PKError(f"{self.op}: called with {h.dtype} and w {tuple(w.shape)}, the plan was built for "
                              f"{self.dtype} and (·, ·, {self.hidden})")
            if weights is not None:
                check_weights(self.op, weights, layout)
        except PKError as e:
            refuse(1, e)
        self.gemm(a=h.contiguous(), b=w, out=self.slots, row_index=layout.row_slot, row_src=layout.row_src,
                  tile_expert=layout.tile_expert, tile_start=layout.tile_start, tile_end=layout.tile_end,
                  num_row_tiles=layout.num_row_tiles)
        return self.slots[:layout.tokens * self.top_k].view(layout.tokens, self.top_k, self.hidden)

    def forward(self, h: torch.Tensor, w: torch.Tensor, weights: torch.Tensor, layout_id: int, keep_slots: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
        layout = layout_by_id(layout_id)
        slots = self(h, w, layout, weights)
        out = sum_slots(slots, layout.kept, weights, h.dtype)
        return out, slots.clone() if keep_slots else h.new_empty(0)

    @staticmethod
    def fake(h: torch.Tensor, w: torch.Tensor, weights: torch.Tensor, layout_id: int, keep_slots: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
        layout = layout_by_id(layout_id)
        slots = (layout.tokens, layout.top_k, w.shape[2]) if keep_slots else (0,)
        return h.new_empty(layout.tokens, w.shape[2]), h.new_empty(slots)

    @staticmethod
    def keep(h: torch.Tensor, w: torch.Tensor, weights: torch.Tensor, layout_id: int, keep_slots: bool) -> MoeLayout:
        return layout_by_id(layout_id)  # held until the backward has run, however the caller keeps it

    def backward(self, grads: list[torch.Tensor], saved: list[torch.Tensor], needs: list[bool], h: torch.Tensor,
                 w: torch.Tensor, weights: torch.Tensor, layout_id: int, keep_slots: bool) -> tuple:
        """dh = the dispatch kernel on dout with w2 transposed, each row scaled by its pair's weight (the weights
        are gathered from their ranks); dw2[e] = hᵀ (w · rows(dout)) over expert e's rows; dw[t, j] = <dout[t],
        out row of pair (t, j)> (the forward keeps the slots when the weights need a gradient)."""
        layout = layout_by_id(layout_id)
        dout, (slots,) = grads[0].contiguous().to(h.dtype), saved
        scale = _gathered_weights(weights, layout)[layout.row_pair]
        w_t = w.transpose(1, 2)
        dh, received = moe_dispatch_gemm_op.plan(dout, w_t, layout_id)(dout, w_t, layout, row_scale=scale)
        dw = dweights = None
        if needs[1]:
            dw = per_expert(h, rows_of(received if layout.world > 1 else dout, layout) * scale[:, None].to(h.dtype),
                            layout)
        if needs[2] and keep_slots:
            products = torch.bmm(slots, dout[:, :, None]).squeeze(-1).float()  # no (T, k, H) fp32 temporaries
            dweights = torch.where(layout.kept, products, 0).to(weights.dtype)  # a dropped pair's slot: not written
        return dh, dw, dweights


moe_gemm_combine_op = declare(CombinePlan, "(Tensor h, Tensor w2, Tensor weights, int layout_id, bool keep_slots) "
                                           "-> (Tensor, Tensor)")

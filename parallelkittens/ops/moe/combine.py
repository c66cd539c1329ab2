"""moe_gemm_combine: each expert's second GEMM, whose epilogue sends every output row back to the rank and the
(token, k) slot it came from; then each rank sums its tokens' k rows, weighted, in a fixed order.

The kernel (`ops/moe/grouped.py`, direction combine) stores each row into its source rank's parallel slot buffer
(T_max * k, H) and ends with a barrier, so every slot is in when it returns. The sum reads slot 0 to k-1 of a
token in that order, in fp32, skipping dropped pairs: the result is bitwise the same run to run, however the
tiles were scheduled (no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...runtime.context import context
from ...runtime.errors import PKError
from ...runtime.heap import heap
from ...runtime.sizes import cdiv, next_power_of_2
from .. import plan as plans
from .dispatch import check_weight
from .grouped import GroupedGemm
from .layout import MoeLayout


def reference_moe_gemm_combine(rows_by_pair: dict, weights: torch.Tensor, kept: torch.Tensor,
                               hidden: int) -> torch.Tensor:
    """One rank's (T, H) in float64: for each token, the sum over its kept k pairs of weight times the pair's
    output row (`rows_by_pair[(t, j)]`)."""
    out = torch.zeros(weights.shape[0], hidden, dtype=torch.float64)
    for t in range(weights.shape[0]):
        for j in range(weights.shape[1]):
            if kept[t, j]:
                out[t] += weights[t, j].double() * rows_by_pair[(t, j)]
    return out


@triton.jit
def _weighted_sum_kernel(slots_ptr, weights_ptr, kept_ptr, out_ptr, T, H, TOP_K: tl.constexpr, BT: tl.constexpr,
                         BH: tl.constexpr, WEIGHTED: tl.constexpr):
    tokens = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    inside = (tokens < T)[:, None] & (cols < H)[None, :]
    acc = tl.zeros([BT, BH], tl.float32)
    for j in tl.static_range(TOP_K):  # slot order 0 .. k-1: the same sum every run
        pair = tokens.to(tl.int64) * TOP_K + j
        keep = tl.load(kept_ptr + pair, mask=tokens < T, other=0) != 0
        row = tl.load(slots_ptr + pair[:, None] * H + cols[None, :], mask=inside & keep[:, None], other=0.0)
        row = row.to(tl.float32)
        if WEIGHTED:
            row = row * tl.load(weights_ptr + pair, mask=tokens < T, other=0.0).to(tl.float32)[:, None]
        acc += tl.where(keep[:, None], row, 0.0)
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * H + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=inside)


def sum_slots(slots: torch.Tensor, kept: torch.Tensor, weights: torch.Tensor | None, dtype: torch.dtype
              ) -> torch.Tensor:
    """out[t] = sum over kept j, in order, of weights[t, j] (or 1) * slots[t, j]: (T, k, H) -> (T, H)."""
    T, k, H = slots.shape
    out = torch.empty(T, H, dtype=dtype, device=slots.device)
    if T == 0 or H == 0:
        return out
    BT, BH = 16, min(256, next_power_of_2(H))
    _weighted_sum_kernel[(cdiv(T, BT), cdiv(H, BH))](
        slots, weights.contiguous() if weights is not None else slots, kept.view(torch.uint8), out, T, H, TOP_K=k,
        BT=BT, BH=BH, WEIGHTED=weights is not None)
    return out


class CombinePlan:
    """moe_gemm_combine for one (max tokens, k, I, H, experts per rank, dtype, rows per tile): the parallel slot
    buffer on the heap and the kernel's combine direction."""

    op = "moe_gemm_combine"

    def __init__(self, max_tokens: int, top_k: int, inner: int, hidden: int, epr: int, dtype: torch.dtype,
                 block: int):
        self.top_k, self.hidden, self.dtype = top_k, hidden, dtype
        buffer = heap().allocate(max(1, max_tokens * top_k * hidden) * dtype.itemsize, f"{self.op}.slots")
        self.slots, self.slots_handle = buffer.view((max_tokens * top_k, hidden), dtype), buffer.handle
        self.gemm = GroupedGemm(self.op, False, inner, hidden, 0, dtype, block, 0, plan=(max_tokens, top_k, epr))

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
            plans.refuse(1, e)
        self.gemm(a=h.contiguous(), b=w, out=self.slots, out_handle=self.slots_handle, row_index=layout.row_slot,
                  row_src=layout.row_src, tile_expert=layout.tile_expert, tile_start=layout.tile_start,
                  tile_end=layout.tile_end, num_row_tiles=layout.num_row_tiles)
        return self.slots[:layout.tokens * self.top_k].view(layout.tokens, self.top_k, self.hidden)


def plan(h: torch.Tensor, w: torch.Tensor, layout: MoeLayout, weights: torch.Tensor | None = None) -> CombinePlan:
    """The plan for combines of expert rows like `h` through experts like `w` (collective the first time)."""
    op = "moe_gemm_combine"
    key = (op, layout.buffer_tokens, layout.top_k, tuple(getattr(w, "shape", ())), getattr(h, "dtype", None),
           layout.block_rows)
    found = plans.find(key)
    if found is not None:
        return found

    def check() -> str:
        check_rows(op, h, layout)
        check_weight(op, "w2", w, h.dtype, layout.experts_per_rank, h.shape[1])
        if weights is not None:
            check_weights(op, weights, layout)
        return (f"{op} of up to {layout.buffer_tokens} tokens, top-{layout.top_k}, {layout.experts_per_rank} experts "
                f"per rank of ({h.shape[1]}, {w.shape[2]}) {h.dtype}, tiles of {layout.block_rows} rows")

    return plans.get(key, lambda: CombinePlan(layout.buffer_tokens, layout.top_k, h.shape[1], w.shape[2],
                                              layout.experts_per_rank, h.dtype, layout.block_rows), check)


def check_rows(op: str, h: torch.Tensor, layout: MoeLayout) -> None:
    ctx = context()
    if not isinstance(h, torch.Tensor) or h.dim() != 2 or h.shape[0] != layout.rows:
        raise PKError(f"{op}: the expert rows must be ({layout.rows}, inner) as the layout has them, got "
                      f"{getattr(h, 'shape', h)}")
    if h.dtype not in (torch.bfloat16, torch.float16, torch.float32) or h.device != ctx.device:
        raise PKError(f"{op}: the expert rows are {h.dtype} on {h.device}; use bfloat16, float16 or float32 on "
                      f"{ctx.device}")


def check_weights(op: str, weights: torch.Tensor, layout: MoeLayout) -> None:
    if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != (layout.tokens, layout.top_k):
        raise PKError(f"{op}: topk_weights must be ({layout.tokens}, {layout.top_k}) like the routing, got "
                      f"{getattr(weights, 'shape', weights)}")
    if not weights.is_floating_point() or weights.device != context().device:
        raise PKError(f"{op}: topk_weights must be floating point on {context().device}, got {weights.dtype} on "
                      f"{weights.device}")

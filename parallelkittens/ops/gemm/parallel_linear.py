"""The tensor-parallel linear maps under `pk.nn`'s layers, sequence-parallel style, as torch custom ops with
autograd: each direction is one of the fused GEMMs.

Tokens are the rows of a 2-D input; ranks hold contiguous blocks of rows, in rank order.

* column: x (T/W, in) -> all_gather(x) @ w_t + b = (T, out/W), with `all_gather_matmul`. Backward: dx =
  `matmul_reduce_scatter`(dy, w_t^T) (T/W, in); dw_t = gathered^T @ dy; db = the column sums of dy. The gathered
  input is kept from the forward (the fused kernel leaves it in this rank's scratch; copied out), or, with
  `save_gathered=False`, gathered again in the backward.
* row: x (T, in/W) -> reduce_scatter(x @ w_t) + b = (T/W, out), with `matmul_reduce_scatter`; the bias is added
  once, after the reduction. Backward: dx = `all_gather_matmul`(dy, w_t^T) (T, in/W); dw_t = x^T @
  all_gather(dy) (the gathered dy again from the fused kernel's scratch); db = the column sums of dy over every
  rank's rows (an all_reduce: each rank holds only its rows' share).

`w_t` is the weight stored transposed, (in, out) of this rank's shard: `pk.nn`'s layers keep their (out, in)
weight parameter as a transposed view of such a buffer, so the forward GEMM reads it with no copy. The backward's
input-gradient GEMM reads it the other way round, also in place: the fused GEMMs take a transposed B through a
descriptor over its transpose (`matmul.transposed`). The weight-gradient products run in torch.matmul (cuBLAS on
a GPU), which takes transposed operands.
"""

from __future__ import annotations

import torch

from ...runtime.context import context
from ...runtime.errors import PKError
from ..collectives.all_gather import all_gather
from ..collectives.all_reduce import all_reduce
from ..collectives.all_to_all import all_to_all
from ..plan import Plan, check_tensor, declare
from .all_gather_matmul import all_gather_matmul
from .matmul_reduce_scatter import matmul_reduce_scatter

DTYPES = (torch.bfloat16, torch.float16, torch.float64)  # float64: the exact, unfused path (for gradcheck)


# float64 has no fused GEMM: the exact path moves its bytes with the collectives (as int64) and sums in float64.
def _gather64(x: torch.Tensor) -> torch.Tensor:
    return all_gather(x.contiguous().view(torch.int64), 0).view(torch.float64)


def _reduce_scatter64(y: torch.Tensor) -> torch.Tensor:
    world = context().local_world_size
    parts = all_to_all(y.contiguous().view(torch.int64), 0, 0).view(torch.float64)
    return parts.view(world, y.shape[0] // world, *y.shape[1:]).sum(0)


def _all_reduce64(v: torch.Tensor) -> torch.Tensor:
    return _gather64(v[None]).sum(0)


def _side_stream() -> torch.cuda.Stream | None:
    """The stream a backward's weight-gradient GEMM runs on, beside the input gradient's fused kernel (CUDA)."""
    if not torch.cuda.is_available() or context().device.type != "cuda":
        return None
    cache = context().cache
    if "linear.side_stream" not in cache:
        cache["linear.side_stream"] = torch.cuda.Stream(context().device)
    return cache["linear.side_stream"]


def _overlapped(product, communicate):
    """Run `product()` (a weight-gradient GEMM, torch.matmul) on a side stream while `communicate()` (the input
    gradient's fused GEMM + reduce-scatter) runs on this one; returns (product's, communicate's) results.

    The fused kernel is queued first: the peers' kernels wait for this rank's shares, so it takes the SMs before
    the GEMM does, and the GEMM's blocks fill the SMs its programs leave while they wait."""
    side = _side_stream()
    if side is None:
        return product(), communicate()
    main = torch.cuda.current_stream()
    ready = torch.cuda.Event()
    ready.record(main)  # the product's inputs are made: it may start from here
    result = communicate()
    side.wait_event(ready)
    with torch.cuda.stream(side):
        done = product()
    main.wait_stream(side)
    if isinstance(done, torch.Tensor):
        done.record_stream(main)
    return done, result


def check_linear(layer: str, x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None, rows_divide: bool
                 ) -> None:
    """Refuse, naming the layer, what the fused GEMMs cannot take."""
    ctx = context()
    check_tensor(layer, "the input", x, ndim=2, what="(tokens, features)")
    if x.dtype != w_t.dtype:
        raise PKError(f"{layer}: the input is {x.dtype} but the weight {w_t.dtype}")
    if x.dtype not in DTYPES:
        raise PKError(f"{layer}: dtype {x.dtype} is not supported; use bfloat16 or float16 (float64: an exact, "
                      "unfused path, for checking gradients)")
    if x.shape[1] != w_t.shape[0]:
        raise PKError(f"{layer}: the input has {x.shape[1]} features, the layer's shard takes {w_t.shape[0]}")
    if bias is not None and (bias.shape != (w_t.shape[1],) or bias.dtype != x.dtype or bias.device != x.device):
        raise PKError(f"{layer}: the bias must be a ({w_t.shape[1]},) {x.dtype} tensor on {x.device}, got "
                      f"{tuple(bias.shape)} {bias.dtype} on {bias.device}")
    if rows_divide and x.shape[0] % ctx.local_world_size:
        raise PKError(f"{layer}: {x.shape[0]} rows do not divide among {ctx.local_world_size} ranks (each rank's "
                      "output holds T/W of them)")


def _bias_added(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y.add_(bias)


class LinearPlan(Plan):
    """The base of the two maps' plans: nothing is built here (the fused GEMMs' own plans are, when first called),
    and the layers check their inputs with their own names (`check_linear`) before the call."""

    collective = False
    differentiable = 1

    @classmethod
    def key(cls, x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None, *options: bool) -> tuple:
        return x.shape, w_t.shape, x.dtype, bias is None, *options

    def __init__(self, x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None, *options: bool):
        self.exact = x.dtype == torch.float64


class ColumnLinearPlan(LinearPlan):
    """all_gather(x) @ w_t + bias, and its backward (see the module's docstring)."""

    op = "column_parallel_linear"
    saves = (1,)  # the gathered input

    def forward(self, x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None, save_gathered: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.exact:
            full = _gather64(x)
            return _bias_added(full @ w_t, bias), full if save_gathered else x.new_empty(0)
        plan = all_gather_matmul.plan(x, w_t)
        y = _bias_added(plan(x, w_t), bias)
        return y, plan.gathered(x) if save_gathered else x.new_empty(0)

    @staticmethod
    def fake(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None, save_gathered: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = x.shape[0] * context().local_world_size
        return x.new_empty(rows, w_t.shape[1]), x.new_empty((rows, x.shape[1]) if save_gathered else (0,))

    def backward(self, grads: list[torch.Tensor], saved: list[torch.Tensor], needs: list[bool], x: torch.Tensor,
                 w_t: torch.Tensor, bias: torch.Tensor | None, save_gathered: bool) -> tuple:
        (dy,), (gathered,) = grads, saved
        # the input gradient's reduce-scatter is collective: every rank runs it when there are peers
        need_dx, need_dw, need_db = needs[0] or context().local_world_size > 1, needs[1], needs[2]
        dy = dy.contiguous()
        if need_dw and not save_gathered:  # the forward kept only this rank's rows
            gathered = _gather64(x) if self.exact else all_gather(x.contiguous(), 0)

        def input_gradient() -> torch.Tensor | None:
            if not need_dx:
                return None
            return _reduce_scatter64(dy @ w_t.t()) if self.exact else matmul_reduce_scatter(dy, w_t.t())

        # the weight gradient on a side stream while the input gradient's reduce-scatter runs
        dw_t, dx = _overlapped(lambda: torch.matmul(gathered.t(), dy) if need_dw else None, input_gradient)
        db = dy.sum(0, dtype=torch.float32).to(dy.dtype) if need_db else None
        return dx, dw_t, db


class RowLinearPlan(LinearPlan):
    """reduce_scatter(x @ w_t) + bias, and its backward (see the module's docstring)."""

    op = "row_parallel_linear"

    def forward(self, x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.exact:
            return _bias_added(_reduce_scatter64(x @ w_t), bias)
        return _bias_added(matmul_reduce_scatter(x, w_t), bias)

    @staticmethod
    def fake(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty(x.shape[0] // context().local_world_size, w_t.shape[1])

    def backward(self, grads: list[torch.Tensor], saved: list[torch.Tensor], needs: list[bool], x: torch.Tensor,
                 w_t: torch.Tensor, bias: torch.Tensor | None) -> tuple:
        """The gather of dy runs on every rank (collective); dw_t reads it straight from the fused kernel's
        scratch."""
        need_dx, need_dw, need_db = needs
        dy = grads[0].contiguous()
        if self.exact:
            full = _gather64(dy)
            db = _all_reduce64(dy.sum(0)) if need_db else None
            return full @ w_t.t(), x.t() @ full, db
        w = w_t.t()  # a transposed view: the fused GEMM reads it in place
        plan = all_gather_matmul.plan(dy, w)
        dx = plan(dy, w)
        dw_t = torch.matmul(x.t(), plan.gathered(dy, copy=False)) if need_dw else None
        db = all_reduce(dy.sum(0, dtype=torch.float32)).to(dy.dtype) if need_db else None
        return dx, dw_t, db


_column = declare(ColumnLinearPlan, "(Tensor x, Tensor w_t, Tensor? bias, bool save_gathered) -> (Tensor, Tensor)")
_row = declare(RowLinearPlan, "(Tensor x, Tensor w_t, Tensor? bias) -> Tensor")


def column_parallel_linear(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None, *,
                           save_gathered: bool = True, layer: str = "column_parallel_linear") -> torch.Tensor:
    """all_gather(x) @ w_t + bias: x (T/W, in) this rank's rows, w_t (in, out/W) this rank's shard of the
    transposed weight, bias (out/W,); returns (T, out/W). Collective, differentiable, a torch custom op."""
    if not torch.compiler.is_compiling():
        check_linear(layer, x, w_t, bias, rows_divide=False)
    return _column(x, w_t, bias, save_gathered)[0]


def row_parallel_linear(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None, *,
                        layer: str = "row_parallel_linear") -> torch.Tensor:
    """reduce_scatter(x @ w_t) + bias: x (T, in/W), w_t (in/W, out) this rank's shard of the transposed weight,
    bias (out,) added once after the reduction; returns this rank's (T/W, out). Collective, differentiable, a
    torch custom op."""
    if not torch.compiler.is_compiling():
        check_linear(layer, x, w_t, bias, rows_divide=True)
    return _row(x, w_t, bias)

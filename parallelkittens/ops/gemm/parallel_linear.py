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
from . import all_gather_matmul as agmm
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
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise PKError(f"{layer}: the input must be a 2-D (tokens, features) tensor (flatten batch and sequence "
                      f"first), got {getattr(x, 'shape', type(x).__name__)}")
    if x.device != ctx.device:
        raise PKError(f"{layer}: the input is on {x.device}, but this rank's device is {ctx.device}")
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


@torch.library.custom_op("parallelkittens::column_parallel_linear", mutates_args=())
def _column(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None, save_gathered: bool
            ) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dtype == torch.float64:
        full = _gather64(x)
        return _bias_added(full @ w_t, bias), full if save_gathered else x.new_empty(0)
    plan = agmm.plan(x, w_t)
    y = _bias_added(plan(x, w_t), bias)
    gathered = plan.gathered(x) if save_gathered else x.new_empty(0)
    return y, gathered


@_column.register_fake
def _(x, w_t, bias, save_gathered):
    world = context().local_world_size
    rows = x.shape[0] * world
    return x.new_empty(rows, w_t.shape[1]), x.new_empty((rows, x.shape[1]) if save_gathered else (0,))


@torch.library.custom_op("parallelkittens::column_parallel_linear_backward", mutates_args=())
def _column_backward(dy: torch.Tensor, x: torch.Tensor, gathered: torch.Tensor, w_t: torch.Tensor,
                     needs: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """needs: [dx, dw_t, db, regather (the forward kept only this rank's rows)]; a gradient not needed is an
    empty tensor. dx's reduce-scatter is collective, so every rank runs it alike."""
    need_dx, need_dw, need_db, regather = needs
    dy = dy.contiguous()
    exact = dy.dtype == torch.float64
    if need_dw and regather:
        gathered = _gather64(x) if exact else all_gather(x.contiguous(), 0)

    def input_gradient() -> torch.Tensor:
        if not need_dx:
            return dy.new_empty(0)
        return _reduce_scatter64(dy @ w_t.t()) if exact else matmul_reduce_scatter(dy, w_t.t())

    # the weight gradient on a side stream while the input gradient's reduce-scatter runs
    dw_t, dx = _overlapped(lambda: torch.matmul(gathered.t(), dy) if need_dw else dy.new_empty(0), input_gradient)
    db = dy.sum(0, dtype=torch.float32).to(dy.dtype) if need_db else dy.new_empty(0)
    return dx, dw_t, db


@_column_backward.register_fake
def _(dy, x, gathered, w_t, needs):
    sizes = ((dy.shape[0] // context().local_world_size, w_t.shape[0]), w_t.shape, (dy.shape[1],))
    return tuple(dy.new_empty(size if need else (0,)) for size, need in zip(sizes, needs[:3], strict=True))


def _column_setup(ctx, inputs, output) -> None:
    x, w_t, bias, save_gathered = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x.new_empty(0) if save_gathered else x, output[1], w_t)
    ctx.has_bias, ctx.regather = bias is not None, not save_gathered


def _column_grads(ctx, dy, _gathered):
    if dy is None:  # the output took no part in the loss
        return None, None, None, None
    x, gathered, w_t = ctx.saved_tensors
    # the input gradient's reduce-scatter is collective: every rank runs it when there are peers
    needs = [ctx.needs_input_grad[0] or context().local_world_size > 1, ctx.needs_input_grad[1],
             ctx.has_bias and ctx.needs_input_grad[2], ctx.regather]
    dx, dw_t, db = _column_backward(dy, x, gathered, w_t, needs)
    return (dx if ctx.needs_input_grad[0] else None), (dw_t if needs[1] else None), (db if needs[2] else None), None


_column.register_autograd(_column_grads, setup_context=_column_setup)


@torch.library.custom_op("parallelkittens::row_parallel_linear", mutates_args=())
def _row(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.dtype == torch.float64:
        return _bias_added(_reduce_scatter64(x @ w_t), bias)
    return _bias_added(matmul_reduce_scatter(x, w_t), bias)


@_row.register_fake
def _(x, w_t, bias):
    return x.new_empty(x.shape[0] // context().local_world_size, w_t.shape[1])


@torch.library.custom_op("parallelkittens::row_parallel_linear_backward", mutates_args=())
def _row_backward(dy: torch.Tensor, x: torch.Tensor, w_t: torch.Tensor, needs: list[bool]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """needs: [dx, dw_t, db]; a gradient not needed is an empty tensor. The gather of dy runs on every rank
    (collective); dw_t reads it straight from the fused kernel's scratch."""
    need_dx, need_dw, need_db = needs
    dy = dy.contiguous()
    if dy.dtype == torch.float64:
        full = _gather64(dy)
        dx, dw_t = full @ w_t.t(), x.t() @ full
        db = _all_reduce64(dy.sum(0)) if need_db else dy.new_empty(0)
        return (dx if need_dx else dy.new_empty(0)), (dw_t if need_dw else dy.new_empty(0)), db
    w = w_t.t()  # a transposed view: the fused GEMM reads it in place
    plan = agmm.plan(dy, w)
    dx = plan(dy, w)
    dw_t = torch.matmul(x.t(), plan.gathered(dy, copy=False)) if need_dw else dy.new_empty(0)
    db = all_reduce(dy.sum(0, dtype=torch.float32)).to(dy.dtype) if need_db else dy.new_empty(0)
    return (dx if need_dx else dy.new_empty(0)), dw_t, db


@_row_backward.register_fake
def _(dy, x, w_t, needs):
    sizes = (x.shape, w_t.shape, (dy.shape[1],))
    return tuple(dy.new_empty(size if need else (0,)) for size, need in zip(sizes, needs, strict=True))


def _row_setup(ctx, inputs, output) -> None:
    x, w_t, bias = inputs
    ctx.save_for_backward(x, w_t)
    ctx.has_bias = bias is not None


def _row_grads(ctx, dy):
    x, w_t = ctx.saved_tensors
    needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]]
    dx, dw_t, db = _row_backward(dy, x, w_t, needs)
    return (dx if needs[0] else None), (dw_t if needs[1] else None), (db if needs[2] else None)


_row.register_autograd(_row_grads, setup_context=_row_setup)


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

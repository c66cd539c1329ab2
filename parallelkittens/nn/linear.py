"""Tensor-parallel linear layers, sequence-parallel style (Megatron's ColumnParallelLinear / RowParallelLinear
with sequence parallelism), on the fused GEMMs (`ops/gemm/parallel_linear.py`), and `parallelize`.

Tokens are the rows of a 2-D input (callers flatten batch and sequence); each rank holds a contiguous block of
them, in rank order. A column layer holds rows r·out/W … (r+1)·out/W of the full (out, in) weight and maps this
rank's (T/W, in) rows to (T, out/W); a row layer holds columns r·in/W … (r+1)·in/W and maps (T, in/W) to this
rank's (T/W, out). A column layer followed by a row layer (an MLP, attention's projections) therefore passes
(T/W, ·) in and out, and needs no other communication.

Each layer's `weight` is the (out, in) shard as torch.nn.Linear has it (`state_dict` holds the shard), stored as
the transpose of an (in, out) buffer so that the forward's GEMM reads it without a copy. A parameter given an
fp32 `main_grad` buffer (Megatron's convention) accumulates its gradients there instead of in `.grad`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from ..ops.collectives.all_reduce import all_reduce
from ..ops.gemm.parallel_linear import column_parallel_linear, row_parallel_linear
from ..runtime.context import context
from ..runtime.errors import PKError


class _SumOverRanks(torch.autograd.Function):
    """Forward: the sum of every rank's partial result (all_reduce). Backward: each rank's partial took part once
    in the result every rank holds, so its gradient is the result's gradient, as is."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(x.contiguous())

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> torch.Tensor:
        return dy


class _SameOnEveryRank(torch.autograd.Function):
    """Forward: the input, which every rank holds whole. Backward: each rank's use of it produced a part of its
    gradient, so the gradient is the sum over the ranks (all_reduce)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> torch.Tensor:
        return all_reduce(dy.contiguous())


def _into_main_grad(param: nn.Parameter) -> None:
    """Megatron's convention: a parameter with an fp32 `main_grad` buffer accumulates its gradients there."""
    main = getattr(param, "main_grad", None)
    if main is not None and param.grad is not None:
        main.add_(param.grad)
        param.grad = None


def _accumulate_into_main_grad(module: nn.Module) -> None:
    for param in module.parameters(recurse=False):
        param.register_post_accumulate_grad_hook(_into_main_grad)


def _shard(total: int, world: int, layer: str, what: str) -> int:
    if total % world:
        raise PKError(f"{layer}: {what} {total} do not divide among {world} ranks")
    return total // world


def _transposed_parameter(rows: int, cols: int, device, dtype) -> nn.Parameter:
    """An uninitialised (rows, cols) parameter stored as the transpose of a contiguous (cols, rows) buffer."""
    return nn.Parameter(torch.empty(cols, rows, device=device, dtype=dtype).t())


def _uniform(shape: tuple[int, ...], fan_in: int, device, dtype) -> torch.Tensor:
    """torch.nn.Linear's initialisation (uniform in ±1/sqrt(fan_in), the full layer's fan-in) of a full,
    unsharded tensor: with the same seed on every rank, the ranks' shards come from one draw, as if the unsharded
    layer had been built and split; with different seeds, from independent draws."""
    bound = 1 / math.sqrt(fan_in) if fan_in else 0
    return torch.empty(shape, device=device, dtype=dtype).uniform_(-bound, bound)


def _rank_zero(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's value of a replicated tensor on every rank (ranks may have drawn it with different seeds)."""
    if context().local_world_size == 1:
        return t
    mine = t.float() if context().local_rank == 0 else torch.zeros_like(t, dtype=torch.float32)
    return all_reduce(mine).to(t.dtype)


def _with_layer_name(e: PKError, name: str) -> PKError:
    """The error, its message led by the layer's name (same class and attributes)."""
    if e.args and not str(e.args[0]).startswith(name):
        e.args = (f"{name}: {e.args[0]}",) + e.args[1:]
    return e


class ColumnParallelLinear(nn.Module):
    """y = x Aᵀ + b with A's rows split across the node's ranks: (T/W, in) -> (T, out/W).

    `out_features` may be a sequence (fused QKV, gate and up of a gated MLP): every part is split across the ranks,
    the input is gathered once, and `forward` returns a tuple with one (T, part/W) tensor per part.
    `gather_input=False` takes an input every rank already holds whole, (T, in) (then no gather happens).
    `save_gathered_input=False` keeps only this rank's rows for the backward and gathers them again there.
    bfloat16 or float16. Collective: every rank calls it with the same shapes.
    """

    def __init__(self, in_features: int, out_features: int | Sequence[int], bias: bool = True, *,
                 gather_input: bool = True, save_gathered_input: bool = True, device=None, dtype=None):
        super().__init__()
        ctx = context()
        world = ctx.local_world_size
        name = type(self).__name__
        self.parts = tuple(out_features) if isinstance(out_features, Sequence) else (out_features,)
        self.fused = isinstance(out_features, Sequence)
        self.in_features, self.out_features = in_features, sum(self.parts)
        self.local_parts = tuple(_shard(p, world, name, "output features") for p in self.parts)
        self.gather_input, self.save_gathered_input = gather_input, save_gathered_input
        device, dtype = device or ctx.device, dtype or torch.bfloat16
        self.weight = _transposed_parameter(sum(self.local_parts), in_features, device, dtype)
        self.bias = nn.Parameter(torch.empty(sum(self.local_parts), device=device, dtype=dtype)) if bias else None
        me = ctx.local_rank
        with torch.no_grad():  # each part's rows r·p/W … (r+1)·p/W of a full draw
            self.weight.copy_(torch.cat([_uniform((p, in_features), in_features, device, dtype)[me * n:(me + 1) * n]
                                         for p, n in zip(self.parts, self.local_parts, strict=True)]))
            if self.bias is not None:
                self.bias.copy_(torch.cat([_uniform((p,), in_features, device, dtype)[me * n:(me + 1) * n]
                                           for p, n in zip(self.parts, self.local_parts, strict=True)]))
        _accumulate_into_main_grad(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """(T, out/W), or a tuple of (T, part/W) when the layer has several outputs."""
        name = type(self).__name__
        try:
            if self.gather_input:
                y = column_parallel_linear(x, self.weight.t(), self.bias, save_gathered=self.save_gathered_input,
                                           layer=name)
            else:
                y = torch.nn.functional.linear(_SameOnEveryRank.apply(x), self.weight, self.bias)
        except PKError as e:
            raise _with_layer_name(e, name) from None
        return y.split(self.local_parts, dim=1) if self.fused else y

    @classmethod
    def from_linear(cls, linear: nn.Linear | Sequence[nn.Linear], **kwargs) -> ColumnParallelLinear:
        """This rank's shard of an unsharded torch.nn.Linear (or of several, fused into one layer: their outputs
        become the parts). Keyword arguments go to the constructor."""
        several = isinstance(linear, (Sequence, nn.ModuleList))
        linears = list(linear) if several else [linear]
        if not linears or not all(isinstance(m, nn.Linear) for m in linears):
            raise PKError("ColumnParallelLinear.from_linear: takes a torch.nn.Linear or a non-empty list of them")
        first = linears[0]
        if any(m.in_features != first.in_features for m in linears):
            raise PKError("ColumnParallelLinear.from_linear: the layers to fuse take different input sizes")
        parts = [m.out_features for m in linears]
        layer = cls(first.in_features, parts if several else parts[0],
                    bias=first.bias is not None, device=kwargs.pop("device", None),
                    dtype=kwargs.pop("dtype", first.weight.dtype if first.weight.dtype in (torch.bfloat16,
                                                                                        torch.float16) else None),
                    **kwargs)
        me, world = context().local_rank, context().local_world_size
        with torch.no_grad():
            rows = [m.weight[me * p // world:(me + 1) * p // world] for m, p in zip(linears, parts, strict=True)]
            layer.weight.copy_(torch.cat(rows))
            if layer.bias is not None:
                layer.bias.copy_(torch.cat([m.bias[me * p // world:(me + 1) * p // world]
                                            for m, p in zip(linears, parts, strict=True)]))
        return layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.parts if self.fused else self.out_features}, "
                f"local={self.local_parts}, bias={self.bias is not None}, gather_input={self.gather_input}")


class RowParallelLinear(nn.Module):
    """y = x Aᵀ + b with A's columns split across the node's ranks: (T, in/W) -> this rank's (T/W, out).

    The bias is added once, after the reduction; its gradient sums every rank's rows. `scatter_output=False`
    returns the whole (T, out) on every rank (a GEMM and an all-reduce). bfloat16 or float16. Collective.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, scatter_output: bool = True,
                 device=None, dtype=None):
        super().__init__()
        ctx = context()
        self.in_features, self.out_features = in_features, out_features
        self.local_in = _shard(in_features, ctx.local_world_size, type(self).__name__, "input features")
        self.scatter_output = scatter_output
        device, dtype = device or ctx.device, dtype or torch.bfloat16
        self.weight = _transposed_parameter(out_features, self.local_in, device, dtype)
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        me, n = ctx.local_rank, self.local_in
        with torch.no_grad():  # columns r·in/W … (r+1)·in/W of a full draw; the bias, replicated, is rank 0's
            self.weight.copy_(_uniform((out_features, in_features), in_features, device, dtype)[:, me * n:(me + 1) * n])
            if self.bias is not None:
                self.bias.copy_(_rank_zero(_uniform((out_features,), in_features, device, dtype)))
        _accumulate_into_main_grad(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's (T/W, out), or (T, out) on every rank with `scatter_output=False`."""
        name = type(self).__name__
        try:
            if self.scatter_output:
                return row_parallel_linear(x, self.weight.t(), self.bias, layer=name)
            y = _SumOverRanks.apply(torch.matmul(x, self.weight.t()))
            return y if self.bias is None else y + self.bias
        except PKError as e:
            raise _with_layer_name(e, name) from None

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> RowParallelLinear:
        """This rank's shard (its block of input columns) of an unsharded torch.nn.Linear."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    device=kwargs.pop("device", None),
                    dtype=kwargs.pop("dtype", linear.weight.dtype if linear.weight.dtype in (torch.bfloat16,
                                                                                          torch.float16) else None),
                    **kwargs)
        me, n = context().local_rank, layer.local_in
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, me * n:(me + 1) * n])
            if layer.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, local_in={self.local_in}, "
                f"bias={self.bias is not None}, scatter_output={self.scatter_output}")


STYLES = {"colwise": ColumnParallelLinear, "rowwise": RowParallelLinear}


def parallelize(module: nn.Module, plan: dict[str, str | tuple[str, dict]], **kwargs) -> nn.Module:
    """Replace the named torch.nn.Linear submodules of `module` by this rank's shards: {name: style} with style
    "colwise" or "rowwise", or (style, {keyword arguments for that layer}); dotted names, as `named_modules` gives
    them; like torch's `parallelize_module`. Returns `module`, changed in place. Keyword arguments given here
    (device, dtype) go to every new layer's `from_linear`."""
    for name, entry in plan.items():
        style, own = (entry, {}) if isinstance(entry, str) else entry
        if style not in STYLES:
            raise PKError(f"parallelize: {name!r} has style {style!r}; use 'colwise' or 'rowwise'")
        parent_name, _, child = name.rpartition(".")
        try:
            parent = module.get_submodule(parent_name) if parent_name else module
            old = getattr(parent, child)
        except AttributeError:
            raise PKError(f"parallelize: the module has no submodule {name!r}") from None
        if not isinstance(old, nn.Linear):
            raise PKError(f"parallelize: {name!r} is a {type(old).__name__}, not a torch.nn.Linear")
        setattr(parent, child, STYLES[style].from_linear(old, **kwargs, **own))
    return module

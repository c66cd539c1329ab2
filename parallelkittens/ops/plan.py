"""The op recipe: a plan class (what one call signature builds once) and one declaration (`declare`).

A call signature is (op, shapes, dtypes, options): everything the set-up depends on. The first call of a
signature builds its plan, collectively: every rank checks its own arguments (`Plan.check`), then the ranks agree
on the host (every rank's description of the call, or its error, is compared), and only then does anything
collective or allocating happen (symmetric workspace from the heap, tuning, compiling: the plan's `__init__`). A
rank whose arguments are bad, or differ from its peers', raises on every rank before any buffer grows or kernel
starts. Later calls of a signature do no host agreement; the device still checks every call
(`template/meeting.py`), so ranks that call built plans in different orders get a `MismatchError` (at their next
launch, `pk.sync()` or their end: `runtime/sync.py`) instead of a hang or a wrong result. `Context.stats` counts
plans built, agreements, tunings and heap allocations.

**Writing an op** is its kernel, its plan class and one declaration (docs/plans.md shows one whole):

* the plan class (a `Plan`) names the op (`op`), says how a call's arguments make the plan's key (`key`, cheap and
  hashable: shapes, dtypes, options), refuses bad arguments and describes the call for the agreement (`check`),
  builds in `__init__` and launches in `__call__`, the call a user holding the plan makes (`pk.ops.<op>.plan(...)`:
  no lookup at all, as cuFFT and cuBLASLt users hold theirs). A plan's call checks its tensors against what it
  was built for (`expect`), and a rank that refuses a call still meets its peers (`refuse`).
* `declare(PlanClass, schema)` makes the op: the lookup and build (`Op.plan`), a torch custom op named after the
  op whose fake implementation is the plan class's `fake`, and, for a plan class with `differentiable` outputs,
  the autograd wiring (a second custom op, ``<op>_backward``, runs the plan's `backward`). `Op.__call__` builds
  the plan and calls it directly in eager code (no dispatcher in the way of a small call's host time) and goes
  through the custom op under torch.compile, or where autograd must record the call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NoReturn, TypeVar

import torch
from torch.compiler import is_compiling as _compiling

from ..runtime.context import context, exchange
from ..runtime.device import num_sms
from ..runtime.errors import MismatchError, PKError
from ..template.meeting import Meet, meeting, signature

P = TypeVar("P")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def find(key: tuple) -> Any:
    """The plan built for `key`, or None: what every call does first, before making anything it might need to build
    one. After a wait gave up, the job's counters are out of step: every call is refused."""
    ctx = context()
    if ctx.broken:
        raise PKError(f"rank {ctx.rank}: this job can no longer run ops: {ctx.broken}")
    return ctx.plans.get(key)


def get(key: tuple, build: Callable[[], P], check: Callable[[], str] | None = None, collective: bool = True) -> P:
    """The plan for `key` (its first element names the op), built by `build()` on first use.

    `check()` validates this rank's arguments (raising `PKError`) and returns a readable description of the call
    for the agreement; with `collective`, the ranks compare their descriptions and errors before building.
    """
    ctx = context()
    plan = ctx.plans.get(key)
    if plan is not None:
        return plan
    op = key[0]
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        # building agrees on the host, takes symmetric memory and may tune (synchronising): none of it can be
        # captured, and the failure CUDA would give is far from its cause
        raise PKError(f"{op}: no plan exists yet for this call ({_shapes(key)}), and one cannot be built while a "
                      "CUDA graph is being captured: run the same calls once eagerly (a warm-up step) before "
                      "capturing")
    error = None
    try:
        description = check() if check is not None else repr(key[1:])
    except Exception as e:  # noqa: BLE001 - whatever it is, the peers must hear of it before this rank leaves
        error, description = e, None
    if collective and ctx.local_world_size > 1:
        agree(op, description, error)
    if error is not None:
        raise error
    if collective:
        meeting()  # the first heap block, whichever op or barrier comes first on a rank
    plan = build()
    ctx.stats["plans"] += 1
    ctx.plans[key] = plan
    return plan


def _shapes(key: tuple) -> str:
    return ", ".join(str(tuple(k)) if isinstance(k, torch.Size) else repr(k) for k in key[1:])


def agree(op: str, description: str | None, error: Exception | None = None) -> None:
    """Compare every rank's description of a call on the host; raise on every rank if any rank's is an error or
    differs from the others'."""
    ctx = context()
    ctx.stats["agreements"] += 1
    everyone = exchange(f"building a plan ({op})", (description, None if error is None else str(error)))
    if error is not None:
        return  # the caller raises its own error
    failed = [(r, e) for r, (_, e) in enumerate(everyone) if e is not None]
    if failed:
        raise PKError(f"{op}: " + "; ".join(f"rank {r} refused its arguments: {e}" for r, e in failed))
    if any(d != description for d, _ in everyone):
        calls = "; ".join(f"rank {r}: {d}" for r, (d, _) in enumerate(everyone))
        raise MismatchError(f"{op}: ranks called it differently: {calls}")


def refuse(meetings: int, error: Exception) -> NoReturn:
    """A plan's call failed its checks on this rank: meet as often as the call would have (so the peers' kernels
    learn of it and every rank's epoch stays in step; `template/meeting.py`), then raise `error`."""
    if meetings:
        meeting().refuse(meetings)
    raise error


def check_tensor(op: str, name: str, t: Any, dtypes: Sequence[torch.dtype] | None = None, ndim: int | None = None,
                 *, contiguous: bool = False, what: str = "") -> None:
    """Refuse, in the words every op uses, a `t` that is no tensor, has the wrong number of dimensions, lies on
    another device than this rank's (a meta tensor included), has a dtype outside `dtypes`, or is not contiguous
    where that is asked. `what` says what the dimensions are, as "(B, H, N, D)"."""
    device = context().device
    if not isinstance(t, torch.Tensor) or (ndim is not None and t.dim() != ndim):
        shape = f"{ndim}-D {what + ' ' if what else ''}" if ndim is not None else ""
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise PKError(f"{op}: {name} must be a {shape}torch.Tensor, got {got}")
    if t.device != device:
        raise PKError(f"{op}: {name} is on {t.device}, but this rank's device is {device}")
    if dtypes is not None and t.dtype not in dtypes:
        raise PKError(f"{op}: {name}: dtype {t.dtype} is not supported; use one of {', '.join(map(str, dtypes))}")
    if contiguous and not t.is_contiguous():
        raise PKError(f"{op}: {name} must be contiguous (call .contiguous() first); strides {t.stride()}")


def check_comm_sms(op: str, num_comm_sms: int | None) -> None:
    """A count of communicator programs this device can run: None (the op chooses), or 1 to one less than its SMs."""
    limit = num_sms() - 1
    if num_comm_sms is not None and not (isinstance(num_comm_sms, int) and 1 <= num_comm_sms <= limit):
        raise PKError(f"{op}: num_comm_sms must be in [1, {limit}] on this device, got {num_comm_sms!r}")


def check_same_dtype(op: str, **tensors: torch.Tensor) -> None:
    """Refuse tensors that should share a dtype and do not: "a is X but b is Y", or "q, k and v must share a
    dtype"."""
    if len({t.dtype for t in tensors.values()}) > 1:
        names, dtypes = list(tensors), [str(t.dtype) for t in tensors.values()]
        if len(names) == 2:
            raise PKError(f"{op}: {names[0]} is {dtypes[0]} but {names[1]} is {dtypes[1]}")
        raise PKError(f"{op}: {', '.join(names[:-1])} and {names[-1]} must share a dtype, got {', '.join(dtypes)}")


def _built_for(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)} on {t.device}" + ("" if t.is_contiguous() else " (not contiguous)")


class Plan:
    """What one call signature of an op builds once; the base of every op's plan (see the module's docstring).

    A subclass sets `op` and defines `check` (classmethod), `__init__` (the build, taking the op's arguments) and
    `__call__` (a call with the tensors the plan works on); `key` (classmethod) where the tensors' shapes and dtypes
    and the other arguments as they are do not say all the build depends on. For
    `declare`'s custom op it defines `fake` (the outputs' shapes from the op's arguments, under tracing); an op
    with gradients sets `differentiable` (how many leading outputs carry them), `saves` (which outputs its backward
    reads besides the op's tensor arguments) and defines `backward`.
    """

    op: ClassVar[str] = ""
    collective: ClassVar[bool] = True  # False: no agreement among ranks when built (a local op)
    arity: ClassVar[int] = 1  # how many leading arguments of the op `__call__` takes (`forward`)
    differentiable: ClassVar[int] = 0
    saves: ClassVar[tuple[int, ...]] = ()

    @classmethod
    def key(cls, *args: Any, **options: Any) -> tuple:
        """What makes this call's plan differ from another's: hashable, and cheap (every call computes it). By
        default each tensor argument's shape and dtype, and every other argument as it is."""
        return (*((a.shape, a.dtype) if isinstance(a, torch.Tensor) else a for a in args), *sorted(options.items()))

    @classmethod
    def check(cls, *args: Any, **options: Any) -> str:
        """Refuse what this rank cannot run (a `PKError`); return the call's description for the agreement."""
        return ""

    @staticmethod
    def fake(*args: Any) -> Any:
        """Empty outputs shaped as the custom op's would be (torch.compile's tracing)."""
        raise NotImplementedError

    @staticmethod
    def keep(*args: Any) -> Any:
        """What autograd must hold from the forward until the backward has run, besides tensors (None: nothing)."""
        return None

    def forward(self, *args: Any, **per_call: Any) -> Any:
        """The op's call with all its arguments (as `key` takes them): by default `self(*args[:arity])`."""
        return self(*args[:self.arity], **per_call)

    def backward(self, grads: list[torch.Tensor], saved: list[torch.Tensor], needs: list[bool], *args: Any
                 ) -> Sequence[torch.Tensor | None]:
        """The gradients of the op's tensor arguments (in order; None or an empty tensor where `needs` is False),
        from the differentiable outputs' gradients `grads` (zeros where an output took no part) and the outputs
        named in `saves`. Collective ops compute what their peers need whatever `needs` says."""
        raise NotImplementedError(f"{self.op} has no backward")

    def expect(self, meetings: int, **tensors: Any) -> None:
        """A call's check of its tensors against the plan's `built`: the same shape and dtype, on this rank's
        device, contiguous; else refuse the call (meeting `meetings` times: `refuse`)."""
        built = self.built
        for name, t in tensors.items():
            shape, dtype = built[name]
            if (not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != dtype or t.device != self.device
                    or not t.is_contiguous()):
                refuse(meetings, PKError(self.mismatch(tensors)))

    def mismatch(self, tensors: dict[str, Any]) -> str:
        """Why `tensors` do not fit this plan, in the words every plan uses."""
        was = ", ".join(f"{n} {dtype} {tuple(shape)}" for n, (shape, dtype) in self.built.items() if n in tensors)
        got = ", ".join(f"{n} {_built_for(t)}" for n, t in tensors.items())
        return f"{self.op}: this plan was built for contiguous {was} on {self.device}; got {got}"

    def meet(self, *details: object) -> Meet:
        """A kernel's meeting argument (`template/meeting.py`) for this plan's calls: the call's signature is the op
        and `details` (shapes, dtypes, options: what every rank's call must share)."""
        return meeting().group(signature(self.op, *details))

    def remember(self, **tensors: torch.Tensor | tuple[tuple[int, ...], torch.dtype]) -> None:
        """Record what the plan is built for (`expect` checks calls against it): tensors, or (shape, dtype)."""
        self.device = context().device
        self.built = {n: (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else (tuple(t[0]), t[1])
                      for n, t in tensors.items()}


def check_out(op: str, out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, aligned: bool = False
              ) -> None:
    """`out` can receive the result: same shape and dtype, contiguous, on this rank's device (and, where the kernel
    writes it through TMA, `aligned` to 16 bytes)."""
    device = context().device
    if (not isinstance(out, torch.Tensor) or out.shape != shape or out.dtype != dtype or not out.is_contiguous()
            or out.device != device or (aligned and out.data_ptr() % 16)):
        raise PKError(f"{op}: out must be a contiguous{', 16-byte aligned' if aligned else ''} {dtype} tensor of "
                      f"shape {tuple(shape)} on {device}; got {_built_for(out)}")


def new_output(op: str, out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, aligned: bool = False
               ) -> torch.Tensor:
    """`out`, checked (`check_out`), or a new tensor of `shape`."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=context().device)
    check_out(op, out, shape, dtype, aligned)
    return out


class Op:
    """An op made by `declare`: ``op(*args, **per_call)`` runs it, ``op.plan(*args)`` hands out its plan."""

    def __init__(self, plan: type[Plan], schema: str | None):
        self.name, self.plan_class = plan.op, plan
        self._key = plan.key
        self._differentiable = plan.differentiable > 0
        # a plan whose `forward` is the default is called directly (one Python call less per op call)
        self._arity = plan.arity if plan.forward is Plan.forward else 0
        self.custom_op = _custom_op(plan, schema, self) if schema is not None else None
        self._traced = len(_arguments(schema)) if schema is not None else 0  # the arguments the custom op takes

    def plan(self, *args: Any, **options: Any) -> Plan:
        """The plan for a call with these arguments (built the first time: collective where the op is)."""
        key = (self.name, *self._key(*args, **options))
        found = find(key)
        if found is not None:
            return found
        cls = self.plan_class
        return get(key, lambda: cls(*args, **options), lambda: cls.check(*args, **options), cls.collective)

    def __call__(self, *args: Any, out: torch.Tensor | None = None) -> Any:
        """Run the op: the plan's call in eager code (with `out`, where given); the custom op under torch.compile, or
        where autograd records the call (`out` must then be left out)."""
        if _compiling():
            return self.traced(*args)
        ctx = context()  # `plan`'s lookup, written out: a small op's host time is counted in hundreds of ns
        if ctx.broken:
            raise PKError(f"rank {ctx.rank}: this job can no longer run ops: {ctx.broken}")
        plan = ctx.plans.get((self.name, *self._key(*args))) or self.plan(*args)
        if self._differentiable and torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return self.traced(*args)
        if out is not None:
            return plan.forward(*args, out=out)
        if self._arity:
            return plan(*args[:self._arity])
        return plan.forward(*args)

    def traced(self, *args: Any) -> Any:
        """The custom op's call: the arguments its schema lists; the op's further options must be left unset."""
        if self.custom_op is None:
            raise PKError(f"{self.name}: this op cannot be traced by torch.compile")
        extra = [a for a in args[self._traced:] if a is not None]
        if extra:
            raise PKError(f"{self.name}: under torch.compile only its default options run; got {extra}")
        return self.custom_op(*args[:self._traced])

    def public(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Give the op's public function its plan (``pk.ops.<op>.plan(...)``) and this op (``.op``)."""
        fn.plan = self.plan
        fn.op = self
        return fn


OPS: dict[str, Op] = {}  # every declared op by name


def declare(plan: type[Plan], schema: str | None = None) -> Op:
    """The op of `plan`: its lookup and build, and, given the custom op's `schema` (torch.library's, without the
    name: ``"(Tensor x, int dim) -> Tensor"``), the custom op ``torch.ops.parallelkittens.<op>`` with its fake and,
    for a plan with `differentiable` outputs, its autograd. The op is also found by name in `OPS` (an op whose
    backward runs another op's plan, which runs its own the other way, names it there)."""
    op = OPS[plan.op] = Op(plan, schema)
    return op


def _arguments(schema: str) -> list[tuple[str, str]]:
    """[(type, name)] of a schema's arguments."""
    inside = schema[schema.index("(") + 1:schema.index(")")]
    return [tuple(a.strip().rsplit(" ", 1)) for a in inside.split(",") if a.strip()]


def _custom_op(plan: type[Plan], schema: str, op: Op) -> Callable[..., Any]:
    """torch.ops.parallelkittens.<op> for `plan` (see `declare`)."""
    name = f"parallelkittens::{plan.op}"

    def run(*args: Any) -> Any:
        return op.plan(*args).forward(*args)

    lib_op = torch.library.custom_op(name, run, mutates_args=(), schema=schema)
    lib_op.register_fake(plan.fake)
    if plan.differentiable:
        _autograd(plan, lib_op, _arguments(schema), op)
    return lib_op


def _autograd(plan: type[Plan], lib_op: Any, arguments: list[tuple[str, str]], op: Op) -> None:
    """Wire `lib_op`'s backward to ``<op>_backward``, a custom op that runs the plan's `backward` (see `Plan`)."""
    tensors = [i for i, (kind, _) in enumerate(arguments) if kind.startswith("Tensor")]
    outputs = plan.differentiable
    listed = ", ".join(f"{kind} {name}" for kind, name in arguments)
    schema = f"(Tensor[] grads, Tensor[] saved, bool[] needs, {listed}) -> Tensor[]"

    def run_backward(grads, saved, needs, *args):
        made = op.plan(*args).backward(list(grads), list(saved), list(needs), *args)
        return [_gradient(g, args[i], need, grads[0]) for g, i, need in zip(made, tensors, needs, strict=True)]

    def fake_backward(grads, saved, needs, *args):
        return [_gradient(None, args[i], need, grads[0]) for i, need in zip(tensors, needs, strict=True)]

    backward = torch.library.custom_op(f"parallelkittens::{plan.op}_backward", run_backward, mutates_args=(),
                                       schema=schema)
    backward.register_fake(fake_backward)

    def setup_context(ctx, inputs, output) -> None:
        results = output if isinstance(output, tuple) else (output,)
        if len(results) > outputs:
            ctx.mark_non_differentiable(*results[outputs:])
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*(inputs[i] for i in tensors), *(results[i] for i in plan.saves))
        ctx.args = [None if i in tensors else a for i, a in enumerate(inputs)]
        ctx.shapes = [(r.shape, r.dtype, r.device) for r in results[:outputs]]
        ctx.kept = plan.keep(*inputs)  # held until the backward has run

    def gradients(ctx, *grads):
        grads = grads[:outputs]
        if all(g is None for g in grads):  # the outputs took no part in the loss
            return (None,) * len(arguments)
        grads = [torch.zeros(s, dtype=d, device=v) if g is None else g
                 for g, (s, d, v) in zip(grads, ctx.shapes, strict=True)]
        saved = ctx.saved_tensors
        args = list(ctx.args)
        for i, t in zip(tensors, saved[:len(tensors)], strict=True):
            args[i] = t
        needs = [ctx.needs_input_grad[i] and args[i] is not None for i in tensors]
        made = backward(grads, list(saved[len(tensors):]), needs, *args)
        result: list[torch.Tensor | None] = [None] * len(arguments)
        for i, g, need in zip(tensors, made, needs, strict=True):
            result[i] = g if need else None
        return tuple(result)

    lib_op.register_autograd(gradients, setup_context=setup_context)


def _gradient(g: torch.Tensor | None, like: torch.Tensor | None, need: bool, anchor: torch.Tensor
              ) -> torch.Tensor:
    """A backward's result for an argument like `like`: `g` (an empty tensor like it under tracing), or an empty
    tensor where none is needed or the argument was None."""
    if like is None or not need:
        return anchor.new_empty(0)
    return like.new_empty(like.shape) if g is None else g

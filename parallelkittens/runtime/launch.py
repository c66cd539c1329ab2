"""`Launcher`: a Triton kernel bound, in a plan, to one grid and one set of fixed arguments.

A kernel takes its fixed arguments in a few named groups (NamedTuples: its sizes, its parallel tensors, its
tiles) rather than one parameter each: the plan builds each group once, and the kernel reads ``S.N_Q`` or
``C.BLOCK_M``. Fields of a group annotated ``tl.constexpr`` are compile-time values (`Launcher` wraps them);
Triton's launcher flattens the groups. Per-call values (the call's tensors, host descriptors) stay parameters of
their own, so that a call replaces them in place.

Small collectives and GEMMs are bound by the host's time per call, and most of a launch's arguments never change
between calls of one signature (sizes, block sizes, workspace pointers, counts). A plan makes a `Launcher` once,
naming every kernel parameter: the fixed ones by value, the ones that change at each call (input and output
tensors) in `per_call`. The first call goes through Triton, which binds and specialises the arguments, compiles
if needed and returns the compiled kernel; later calls put the new values into the argument list made at the
start and call that kernel's C launcher directly, skipping Triton's binding, specialisation, cache lookup and
Python launcher. Tensors go in as their addresses: given a tensor, the C launcher asks the driver about the
pointer (`cuPointerGetAttribute`) at every launch, once per tensor, and a collective passes eleven.

Host tensor descriptors (TMA maps) are the other per-call cost: Triton's launcher encodes each one at every call
(a driver call each), and a GEMM passes three to five. A parameter named in
`descriptors` takes a tensor per call, with the function that describes it; the direct path keeps each encoded
map, keyed by the tensor's address and shape (its layout is the plan's, the same at every call), and calls the
compiled kernel's C launcher with it (`_Encoded`). A loop calling an op on the same tensors, or on outputs that
the caching allocator hands back at the same address, encodes nothing after its first call (docs/performance.md
has the host time per call this gives).

What the direct path assumes: the values passed per call specialise as the first call's did. Tensors are
checked for it (16-byte aligned, as the first call's were, or Triton's path is taken); integers passed per call
must be listed in the kernel's ``do_not_specialize``. PK_FAST_LAUNCH=0 turns the direct path off; it is never
taken under the interpreter, or while a Triton launch hook (a profiler) is installed. The C launcher's arguments
differ between Triton releases (3.6 and 3.9 are known here: `KNOWN_LAUNCHERS`); under another release, or for a
kernel that needs global scratch or has a descriptor inside a group, the compiled kernel's Python launcher is
called (and encodes descriptors at every call) instead. A group passed per call (a NamedTuple of tensors) goes in
with its tensors as addresses, checked for alignment like any other.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime import driver

from .context import context, interpreting, use_triton_allocator
from .sync import raise_recorded, start_watchdog

OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
ENCODED_PER_SLOT = 256  # maps kept per descriptor parameter (128 bytes each), the oldest dropped first
# Triton releases whose C launcher's arguments `_Encoded` knows (checked against their sources): 3.6 has a
# launcher per kernel, behind a Python wrapper; 3.9 one launcher for every kernel, the arguments in one list.
# Under any other release descriptors are encoded by Triton's own launcher, at every call, as before.
TRITON = ".".join(triton.__version__.split(".")[:2])
KNOWN_LAUNCHERS = {"3.6": "per_kernel", "3.9": "shared"}


class Launcher:
    """``kernel[grid](**fixed, **per_call values)``, cheaply after the first call (see the module's docstring).

    `named` holds every kernel parameter not in `per_call`, and launch options (num_warps, maxnreg, ...).
    `descriptors` maps per-call parameters that the kernel takes as host tensor descriptors to the function that
    makes the descriptor from the tensor passed for it. That function may depend only on the tensor's address
    and shape: its layout (strides) and dtype must be the same at every call, as a plan's operands are.
    """

    def __init__(self, kernel: Any, grid: Sequence[int], per_call: Sequence[str] = (),
                 descriptors: dict[str, Callable[[torch.Tensor], Any]] | None = None, **named: Any):
        self.kernel = kernel
        self.grid = tuple(grid)
        self.options = {k: named.pop(k) for k in OPTIONS if k in named}
        names = list(kernel.arg_names)
        unknown = set(named) - set(names)
        missing = [n for n in names if n not in named and n not in per_call]
        self.descriptors = dict(descriptors or {})
        if unknown or missing or set(per_call) & set(named) or set(self.descriptors) - set(per_call):
            raise TypeError(f"Launcher({getattr(kernel, '__name__', kernel)}): unknown {sorted(unknown)}, missing "
                            f"{missing}, given twice {sorted(set(per_call) & set(named))}, descriptors not per "
                            f"call {sorted(set(self.descriptors) - set(per_call))}")
        self.fixed = named = {n: _constexprs(v) for n, v in named.items()}
        self.per_call = tuple(per_call)
        self._args = [_address(named.get(n)) for n in names]  # the direct path's: tensors as addresses
        self._slots = [names.index(n) for n in per_call]
        self._describe = [self.descriptors.get(n) for n in per_call]
        self._grid3 = (self.grid + (1, 1))[:3]
        ctx = context()
        self._flag = ctx.error_flag  # an error a kernel recorded: the next launch raises it (`runtime/sync.py`)
        if ctx.world_size > 1 and "watchdog" not in ctx.cache:
            start_watchdog()
        self._direct_ok = ctx.settings.fast_launch and ctx.device.type == "cuda" and not interpreting()
        self._device = ctx.device.index if ctx.device.type == "cuda" else None
        self._compiled: Any = None
        self._encoded: _Encoded | None = None
        self._stream: Callable[[int | None], int] | None = None  # the driver's, bound at the first call
        self.launches = 0  # calls through Triton's path: the first, and any the direct path could not take

    def __call__(self, *values: Any, grid: Sequence[int] | None = None) -> None:
        """Launch with `values` for the `per_call` parameters, in that order (a group among them: a NamedTuple of
        tensors), on the bound grid or on `grid`."""
        if self._flag.value:
            raise_recorded()
        use_triton_allocator()  # this thread may be new (autograd runs backwards on its own)
        grid3 = self._grid3 if grid is None else (tuple(grid) + (1, 1))[:3]
        fast = self._encoded
        if fast is not None and not _hooks_installed():
            if fast(grid3, self._stream(self._device), values):
                return
        compiled = self._compiled
        if compiled is None or not self._direct(values):
            self._through_triton(values, grid3)
            return
        args = self._args
        for slot, value, describe in zip(self._slots, values, self._describe, strict=True):
            args[slot] = _address(value) if describe is None else describe(value)
        x, y, z = grid3
        compiled.run(x, y, z, self._stream(self._device), compiled.function, compiled.packed_metadata, None, None,
                     None, *args)

    def _through_triton(self, values: Sequence[Any], grid: tuple[int, int, int]) -> None:
        named = dict(self.fixed)
        for name, value, describe in zip(self.per_call, values, self._describe, strict=True):
            named[name] = value if describe is None else describe(value)
        self.launches += 1
        result = self.kernel[grid](**named, **self.options)
        if (self._direct_ok and self._compiled is None and hasattr(result, "packed_metadata")
                and self._aligned(values)):
            self._compiled = result
            self._stream = driver.active.get_current_stream
            args = [named[n] for n in self.kernel.arg_names]
            self._encoded = _Encoded.make(result, args, self._slots, self._describe)

    def _direct(self, values: Sequence[Any]) -> bool:
        return self._aligned(values) and not _hooks_installed()

    @staticmethod
    def _aligned(values: Sequence[Any]) -> bool:
        # Triton specialises pointers by 16-byte alignment; the direct path reuses the first call's choice.
        return all(_aligned(v) for v in values)


class _Place(NamedTuple):
    """Where a per-call value goes in the C launcher's arguments, and, for a descriptor, how it is encoded."""

    start: int  # index in the argument list
    width: int  # entries: 1, or a descriptor's (map, shape..., strides...)
    encode: Callable[[torch.Tensor], list[Any]] | None  # None: the value itself goes in
    encoded: dict[tuple, list[Any]]  # the tensors seen, by (address, shape): their encoded entries


class _Encoded:
    """A compiled kernel's C launcher, called with its tensors as addresses and its host descriptors encoded once
    per (address, shape) rather than at every call, as Triton's Python launcher does.

    The C launcher takes the kernel's arguments with each descriptor spread into (encoded map, shape..., strides
    ...): `template` is that list as the first call made it, and a call overwrites the per-call entries in place.
    A tensor passed for a descriptor keeps its layout and dtype from call to call (`Launcher`'s `descriptors`),
    so the strides are not part of the key.
    """

    def __init__(self, launch: Callable[..., Any], template: list[Any], places: list[_Place]):
        self._launch, self._template, self._places = launch, template, places
        # no descriptor passed per call (the collectives): the values' places alone, a shorter loop per launch
        self._starts = tuple(p.start for p in places) if all(p.encode is None for p in places) else None

    @classmethod
    def make(cls, compiled: Any, args: list[Any], slots: list[int], describe: list[Any]) -> _Encoded | None:
        """The encoded launcher of `compiled`, first called with `args`; None under a Triton release whose
        launcher is not known here, or for a kernel that needs what this path does not give (global scratch,
        tuples among its arguments)."""
        layout = KNOWN_LAUNCHERS.get(TRITON)
        run = compiled.run
        if (layout is None or not hasattr(run, "launch_cooperative_grid") or getattr(run, "global_scratch_size", 1)
                or getattr(run, "profile_scratch_size", 1) or getattr(run, "gsan_enabled", False)):
            return None
        metas = list(getattr(getattr(compiled, "metadata", None), "tensordesc_meta", None) or ())
        if None in metas or sum(map(_is_descriptor, args)) != len(metas):
            return None  # (without metadata Triton passes the tensor itself, which a kept encoding would hold)
        if any(isinstance(a, tuple) and any(map(_is_descriptor, a)) for a in args):
            return None  # a descriptor inside a group: Triton's own launcher encodes it
        from triton.backends.nvidia import driver as nvidia

        base_args = (None,) if layout == "shared" else ()  # 3.9's encoder also takes the launch's base arguments

        def encode(desc: Any, meta: dict) -> list[Any]:
            return nvidia.make_tensordesc_arg(desc, meta, *base_args)

        coop, pdl = run.launch_cooperative_grid, run.launch_pdl
        packed, function = compiled.packed_metadata, compiled.function
        if layout == "shared":  # (grid, stream, function, coop, pdl, metadata, hooks, scratch, signature, args)
            c_launch, annotations, signature = driver.active.utils.launch, run.arg_annotations, run.kernel_signature

            def launch(x: int, y: int, z: int, stream: int, kernel_args: list[Any]) -> None:
                c_launch(x, y, z, stream, function, coop, pdl, packed, None, None, None, None, None, annotations,
                         signature, kernel_args)
        else:  # (grid, stream, function, coop, pdl, scratch, metadata, hooks, *args)
            # the kernel's own launcher, or the one Triton's descriptor-encoding wrapper closes over, as `launcher`
            c_launch = run.launch
            if not inspect.isbuiltin(c_launch):
                try:
                    c_launch = inspect.getclosurevars(c_launch).nonlocals.get("launcher")
                except TypeError:  # not a Python function: a launcher this path does not know
                    return None
            if c_launch is None:
                return None

            def launch(x: int, y: int, z: int, stream: int, kernel_args: list[Any]) -> None:
                c_launch(x, y, z, stream, function, coop, pdl, None, None, packed, None, None, None, *kernel_args)

        template: list[Any] = []
        spans: list[tuple[int, int, Any]] = []  # per kernel parameter: (start in template, width, its metadata)
        metas_left = iter(metas)
        for a in args:
            if _is_descriptor(a):
                meta = next(metas_left)
                entries = encode(a, meta)
                spans.append((len(template), len(entries), meta))
                template.extend(entries)
            else:
                spans.append((len(template), 1, None))
                template.append(_address(a))
        places = []
        for slot, d in zip(slots, describe, strict=True):
            start, width, meta = spans[slot]
            encoder = None if d is None else (lambda t, d=d, meta=meta: encode(d(t), meta))
            places.append(_Place(start, width, encoder, {}))
        return cls(launch, template, places)

    def __call__(self, grid: tuple[int, int, int], stream: int, values: Sequence[Any]) -> bool:
        """Launch with `values` for the per-call parameters; False, launching nothing, where a tensor passed by
        pointer is not 16-byte aligned (Triton specialised the first call's on it)."""
        args = self._template
        if self._starts is not None:
            # not strict (a check per launch): the plans pass as many values as they named per call
            for start, value in zip(self._starts, values, strict=False):
                if isinstance(value, torch.Tensor):
                    value = value.data_ptr()
                    if value % 16:
                        return False
                elif isinstance(value, tuple):
                    if not _aligned(value):
                        return False
                    value = _address(value)
                args[start] = value
            self._launch(grid[0], grid[1], grid[2], stream, args)
            return True
        for (start, width, encode, encoded), value in zip(self._places, values, strict=True):
            if encode is None:
                if isinstance(value, torch.Tensor):
                    value = value.data_ptr()
                    if value % 16:
                        return False
                args[start] = value
                continue
            key = (value.data_ptr(), value.shape)
            entries = encoded.get(key)
            if entries is None:
                if len(encoded) >= ENCODED_PER_SLOT:
                    del encoded[next(iter(encoded))]  # the oldest
                entries = encoded[key] = encode(value)
            args[start:start + width] = entries
        self._launch(grid[0], grid[1], grid[2], stream, args)
        return True


def _address(value: Any) -> Any:
    """A tensor's address, which Triton's C launcher takes as it is; for a tensor it asks the driver to check the
    pointer (`cuPointerGetAttribute`, at every launch, for every tensor). A group: its tensors' addresses, in a
    group of the same type (the C launcher flattens it). Anything else: itself."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr()
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*map(_address, value))
    return value


def _aligned(value: Any) -> bool:
    """Whether every tensor in `value` (a tensor, a group, anything else) starts on a 16-byte boundary."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    if isinstance(value, tuple):
        return all(map(_aligned, value))
    return True


def _constexprs(value: Any) -> Any:
    """A group (NamedTuple) with its fields annotated ``tl.constexpr`` wrapped as Triton constants (how Triton
    tells a compile-time value inside a tuple); anything else as it is."""
    if not (isinstance(value, tuple) and hasattr(value, "_fields")):
        return value
    hints = getattr(type(value), "__annotations__", {})
    return type(value)(*(tl.constexpr(v) if _is_constexpr_hint(hints.get(f)) and not isinstance(v, tl.constexpr)
                         else v for f, v in zip(value._fields, value, strict=True)))


def _is_constexpr_hint(hint: Any) -> bool:
    """Whether a field's annotation is ``tl.constexpr``: the class, or its name (a string or a forward reference
    under ``from __future__ import annotations``)."""
    if hint is tl.constexpr:
        return True
    name = getattr(hint, "__forward_arg__", hint)
    return isinstance(name, str) and name.split(".")[-1] == "constexpr"


def _is_descriptor(value: Any) -> bool:
    """A host tensor descriptor, `tl`'s or Gluon's."""
    return hasattr(value, "block_shape") and hasattr(value, "base") and hasattr(value, "strides")


def _hooks_installed() -> bool:
    """Whether a Triton launch hook (a profiler) is installed; an empty `HookChain` is not one (Triton 3.6 to
    3.9)."""
    hooks = knobs.runtime
    return bool(getattr(hooks.launch_enter_hook, "calls", hooks.launch_enter_hook)
                or getattr(hooks.launch_exit_hook, "calls", hooks.launch_exit_hook))

"""`Launcher`: a Triton kernel bound, in a plan, to one grid and one set of fixed arguments.

Small collectives and GEMMs are bound by the host's time per call, and most of a launch's arguments never change
between calls of one signature (sizes, block sizes, workspace pointers, counts). A plan makes a `Launcher` once,
naming every kernel parameter: the fixed ones by value, the ones that change at each call (input and output
tensors, their descriptors) in `per_call`. The first call goes through Triton, which binds and specialises the
arguments, compiles if needed and returns the compiled kernel; later calls put the new values into the argument
list made at the start and call that kernel's launcher directly, skipping Triton's binding, specialisation
and cache lookup.

What the direct path assumes: the values passed per call specialise as the first call's did. Tensors are
checked for it (16-byte aligned, as the first call's were, or Triton's path is taken); integers passed per call
must be listed in the kernel's ``do_not_specialize``. PK_FAST_LAUNCH=0 turns the direct path off; it is never
taken under the interpreter, or while a Triton launch hook (a profiler) is installed.

Measured on an H200 with Triton 3.6 (2026-12-02): Triton's own launch path took 54-60 µs of host time per 4 KB
collective, the direct one 35-41 µs, before plans took the rest of the per-call set-up away.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from triton import knobs
from triton.runtime import driver

from .context import context, interpreting, use_triton_allocator

OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


class Launcher:
    """``kernel[grid](**fixed, **per_call values)``, cheaply after the first call (see the module's docstring).

    `named` holds every kernel parameter not in `per_call`, and launch options (num_warps, maxnreg, ...).
    """

    def __init__(self, kernel: Any, grid: Sequence[int], per_call: Sequence[str] = (), **named: Any):
        self.kernel = kernel
        self.grid = tuple(grid)
        self.options = {k: named.pop(k) for k in OPTIONS if k in named}
        names = list(kernel.arg_names)
        unknown = set(named) - set(names)
        missing = [n for n in names if n not in named and n not in per_call]
        if unknown or missing or set(per_call) & set(named):
            raise TypeError(f"Launcher({getattr(kernel, '__name__', kernel)}): unknown {sorted(unknown)}, missing "
                            f"{missing}, given twice {sorted(set(per_call) & set(named))}")
        self.fixed = named
        self.per_call = tuple(per_call)
        self._args = [named.get(n) for n in names]
        self._slots = [names.index(n) for n in per_call]
        self._grid3 = (self.grid + (1, 1))[:3]
        ctx = context()
        self._direct_ok = ctx.settings.fast_launch and ctx.device.type == "cuda" and not interpreting()
        self._device = ctx.device.index if ctx.device.type == "cuda" else None
        self._compiled: Any = None
        self.launches = 0  # calls through Triton's path: the first, and any the direct path could not take

    def __call__(self, *values: Any) -> None:
        """Launch with `values` for the `per_call` parameters, in that order."""
        use_triton_allocator()  # this thread may be new (autograd runs backwards on its own)
        compiled = self._compiled
        if compiled is None or not self._direct(values):
            named = dict(self.fixed)
            named.update(zip(self.per_call, values, strict=True))
            self.launches += 1
            result = self.kernel[self.grid](**named, **self.options)
            if self._direct_ok and compiled is None and hasattr(result, "packed_metadata") and self._aligned(values):
                self._compiled = result
            return
        args = self._args
        for slot, value in zip(self._slots, values, strict=True):
            args[slot] = value
        stream = driver.active.get_current_stream(self._device)
        x, y, z = self._grid3
        compiled.run(x, y, z, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)

    def _direct(self, values: Sequence[Any]) -> bool:
        hooks = knobs.runtime
        return self._aligned(values) and not (_hooked(hooks.launch_enter_hook) or _hooked(hooks.launch_exit_hook))

    @staticmethod
    def _aligned(values: Sequence[Any]) -> bool:
        # Triton specialises pointers by 16-byte alignment; the direct path reuses the first call's choice.
        return all(v.data_ptr() % 16 == 0 for v in values if isinstance(v, torch.Tensor))


def _hooked(hook: Any) -> bool:
    """Whether a Triton launch hook is installed (an empty `HookChain` is not one; Triton 3.6 to 3.9)."""
    return bool(getattr(hook, "calls", hook))

"""Launching a Triton kernel with less host work per call: collectives of a few KB are bound by it.

`launch(kernel, grid, *args, **kwargs)` does what ``kernel[grid](*args, **kwargs)`` does. With
PK_FAST_LAUNCH=1 on a GPU, the first launch for each key goes through Triton, which binds and specialises the
arguments, compiles if needed and returns the compiled kernel; later launches with the same key call that
kernel's launcher directly, skipping the binding, specialisation and cache lookup (about half of a small
collective's host time on an H200, `bench/results/diagnose_collectives-*.txt`). The key is finer than
Triton's own specialisation: every integer's and float's exact value, every tensor's dtype, device and
16-byte alignment, every keyword, so a kernel is reused only where Triton would have chosen the same one.

Experimental and off by default: it calls the compiled kernel's launcher as Triton 3.6 to 3.9 do inside
`JITFunction.run`. Measured on an H200 with Triton 3.6 (2026-12-02), it gave the same results but was not
faster: 72 µs against 65 µs of host time per 4 KB all_reduce (Triton's own path already specialises
natively), so it stays off; whether it pays on newer Triton versions is unmeasured.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..language import signals
from .context import interpreting

_compiled: dict[tuple, tuple[Any, tuple[str, ...]]] = {}


def fast_launch_enabled() -> bool:
    """Whether `launch` may bypass Triton's launch path (PK_FAST_LAUNCH=1, compiled kernels only)."""
    return os.environ.get("PK_FAST_LAUNCH", "0") == "1" and not interpreting()


def launch_key(kernel: Any, grid: tuple[int, ...], args: tuple, kwargs: dict) -> tuple | None:
    """What decides which compiled kernel a launch runs, or None when an argument is of a kind this module
    does not reason about (then Triton launches it)."""
    parts: list = [id(kernel), tuple(grid), bool(signals.DEBUG)]
    for value in list(args) + [kwargs[name] for name in sorted(kwargs)]:
        if isinstance(value, torch.Tensor):
            parts.append((value.dtype, value.device, value.data_ptr() % 16 == 0))
        elif isinstance(value, (bool, int, float, str)) or value is None:
            parts.append((type(value), value))
        else:
            return None
    parts.append(tuple(sorted(kwargs)))
    return tuple(parts)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``, through the compiled kernel's own launcher when allowed (above)."""
    key = launch_key(kernel, grid, args, kwargs) if fast_launch_enabled() else None
    hit = _compiled.get(key) if key is not None else None
    if hit is None:
        compiled = kernel[grid](*args, **kwargs)
        names = tuple(kernel.arg_names)
        if key is not None and hasattr(compiled, "packed_metadata") and all(n in kwargs for n in names[len(args):]):
            _compiled[key] = (compiled, names)  # every parameter given: the launcher can be called with them
        return
    compiled, names = hit
    values = list(args) + [kwargs[name] for name in names[len(args):]]  # every parameter, in order
    from triton import knobs

    stream = torch.cuda.current_stream().cuda_stream
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    metadata = compiled.launch_metadata(grid, stream, *values) if enter is not None else None
    grid = tuple(grid) + (1, 1)
    compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, metadata, enter,
                 leave, *values)

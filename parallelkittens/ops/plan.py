"""Plans: what one call signature of an op needs, built once, so that a call only checks its inputs and launches.

A call signature is (op, shapes, dtypes, options): everything the set-up depends on. The first call of a
signature builds its plan, collectively: every rank checks its own arguments, then the ranks agree on the host
(every rank's description of the call, or its error, is compared), and only then does anything collective or
allocating happen (symmetric workspace from the heap, tuning, compiling). A rank whose arguments are bad, or
differ from its peers', raises on every rank before any buffer grows or kernel starts. The plan keeps its slice
of the heap, the configuration, its tensor descriptors and its bound launchers (`runtime/launch.py`).

`pk.ops.<op>(...)` looks the plan up by signature in the context's `plans` and calls it; `pk.ops.<op>.plan(...)`
returns it, for callers who want no lookup at all (as cuFFT and cuBLASLt users hold theirs). A plan's call is
checked against the signature it was built for: a call with other shapes is an error, not a silent misuse.

Later calls of a signature do no host agreement; the device still checks every call (`template/meeting.py`), so
ranks that call built plans in different orders get a `MismatchError` from `pk.sync()` instead of a hang.
`Context.stats` counts plans built, agreements, tunings and heap allocations, which the tests use to show that
a second call of a signature does none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..runtime.context import context, exchange
from ..runtime.errors import MismatchError, PKError
from ..template.meeting import meeting

P = TypeVar("P")


def find(key: tuple):
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


def refuse(meetings: int, error: Exception) -> None:
    """A plan's call failed its checks on this rank: meet as often as the call would have (so the peers' kernels
    learn of it and every rank's epoch stays in step; `template/meeting.py`), then raise `error`."""
    meeting().refuse(meetings)
    raise error


def attach(op: Callable[..., Any], plan: Callable[..., Any]) -> None:
    """Give `op` its plan function as ``op.plan`` (``pk.ops.all_gather_matmul.plan(a, b)``)."""
    op.plan = plan

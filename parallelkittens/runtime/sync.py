"""Host-side synchronisation: `sync()` waits for the device and for every rank, and raises on every rank what
any rank's kernels recorded (a wait that gave up, ranks that called an op differently)."""

from __future__ import annotations

import torch

from .context import context, exchange
from .errors import MismatchError, PKError, WaitTimeoutError, error_from_record
from .heap import heap
from .memory import describe_address


def check_errors() -> None:
    """Raise what a kernel of this rank recorded: `WaitTimeoutError` for a wait that gave up, `MismatchError` for
    a call whose ranks disagreed. Synchronises with the device."""
    ctx = context()
    record = ctx.debug_record.tolist()
    if record[0] != 0:
        ctx.debug_record.zero_()
        in_heap = heap().describe(record[2]) if "heap" in ctx.cache else None
        error = error_from_record(record, lambda address: f"counter {in_heap}" if in_heap else
                                  describe_address(address))
        if isinstance(error, WaitTimeoutError) and in_heap:
            # an op's own counters (the meeting's, flags): the ranks are out of step for good
            ctx.broken = f"a wait of an op gave up ({error}); finalize the ranks and start the job again"
        raise error


def sync() -> None:
    """Wait for this rank's device work, then for every rank. An error a kernel recorded on any rank (a wait
    that timed out, an op called differently) raises on every rank."""
    ctx = context()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    error = None
    try:
        check_errors()
    except PKError as e:
        error = e
    try:
        errors = exchange("pk.sync()", None if error is None else (type(error).__name__, str(error)), ctx.cpu_group)
    except PKError as missing:  # a peer never came: this rank's own error, if it has one, is the news
        if error is None:
            raise
        raise type(error)(f"{error}; then {missing}") from None
    found = [e for e in errors if e is not None]
    if found:
        message = "; ".join(message for _, message in found)
        kind = MismatchError if any(name == "MismatchError" for name, _ in found) else WaitTimeoutError
        raise kind(message)

"""Errors the runtime raises. Each says which rank, and what it saw against what it expected."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable


class PKError(RuntimeError):
    """A misuse or a failure of the runtime, reported on the rank where it was found."""


class WaitTimeoutError(PKError):
    """A wait on a counter gave up (after PK_WAIT_TIMEOUT with PK_DEBUG=1, else PK_TIMEOUT): the counter never
    reached the value a kernel waited for."""


class MismatchError(PKError):
    """Ranks called an op with different shapes, dtypes or arguments, or were at different steps of the job."""


# What ops register for each call signature they send to the device, for MismatchError's message.
SIGNATURES: dict[int, str] = {}

# The kinds of a kernel's debug record: [kind, rank, a, b, c, program, d, flag]
RECORD_WAIT_TIMEOUT = 1  # a = counter address, b = seen, c = expected, d = timeout in ns
RECORD_MISMATCH = 2  # a = the rank that differs (-1: a wait gave up), b = its signature, c = this rank's
FLAG = 7  # the record's last slot: the address of the host's flag, which a kernel sets to the kind it recorded


def error_from_record(record: list[int], describe: Callable[[int], str]) -> PKError:
    """The exception a kernel's debug record describes; `describe` names a counter's address."""
    kind, rank, address, b, c, program, d = record[:7]
    if kind == RECORD_MISMATCH:
        other = f"rank {address}" if address >= 0 else "another rank"
        return MismatchError(
            f"rank {rank}: ranks disagree on a call: this rank called {SIGNATURES.get(c, f'signature {c}')}, "
            f"{other} {SIGNATURES.get(b, 'something else (another op, shape, dtype or argument)')}")
    return WaitTimeoutError(f"rank {rank}: wait on {describe(address)} timed out after {d / 1e9:g} s in program "
                            f"{program}: saw {b}, expected {c}")


class RankError(PKError):
    """A rank started by `pk.spawn` raised; `.rank` is the rank, `.original` the exception (when picklable)."""

    def __init__(self, rank: int, message: str, original: BaseException | None = None, remote_traceback: str = ""):
        super().__init__(f"rank {rank} failed: {message}" + (f"\n--- rank {rank} traceback ---\n{remote_traceback}"
                                                            if remote_traceback else ""))
        self.rank = rank
        self.original = original
        self.remote_traceback = remote_traceback


# What a rank says when it failed because another rank did: its transport broke, or a wait for a peer gave up.
CONSEQUENCES = ("Connection closed", "Connection reset", "Connection refused", "Broken pipe", "Read error",
                "Socket Timeout", "Timed out waiting", "DistBackendError", "WaitTimeoutError", "did not arrive within",
                "EOFError", "ConnectionResetError", "ranks are at different steps")


def is_consequence(message: str) -> bool:
    """Whether a rank's error reads as a consequence of another rank's failure rather than a cause."""
    return any(c in message for c in CONSEQUENCES)


# A consequence's error file is dated this much later, so that torchrun names a cause within it as the root cause.
CONSEQUENCE_DELAY_S = 60


def report_to_torchrun() -> None:
    """Under torchrun (TORCHELASTIC_ERROR_FILE set), write an uncaught exception to this rank's error file, which
    torchrun reads to name the root cause: the failure with the earliest time. A consequence of another rank's
    failure (a peer gone, a wait given up) is dated CONSEQUENCE_DELAY_S later, so that the rank that failed first
    on its own is named, not the first rank whose transport broke."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or getattr(sys.excepthook, "pk_reports", False):
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        message = f"{kind.__name__}: {value}"
        when = int(time.time()) + (CONSEQUENCE_DELAY_S if is_consequence(message) else 0)
        record = {"message": {"message": message, "extraInfo": {
            "py_callstack": "".join(traceback.format_exception(kind, value, tb)), "timestamp": str(when)}}}
        try:
            with open(path, "w") as f:
                json.dump(record, f)
        except OSError:
            pass
        previous(kind, value, tb)

    hook.pk_reports = True
    sys.excepthook = hook

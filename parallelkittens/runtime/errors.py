"""Errors the runtime raises. Each says which rank, and what it saw against what it expected."""

from __future__ import annotations

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

# The kinds of a kernel's debug record: [kind, rank, a, b, c, program, d]
RECORD_WAIT_TIMEOUT = 1  # a = counter address, b = seen, c = expected, d = timeout in ns
RECORD_MISMATCH = 2  # b = a peer's signature, c = this rank's


def error_from_record(record: list[int], describe: Callable[[int], str]) -> PKError:
    """The exception a kernel's debug record describes; `describe` names a counter's address."""
    kind, rank, address, b, c, program, d = record[:7]
    if kind == RECORD_MISMATCH:
        return MismatchError(
            f"rank {rank}: ranks disagree on a call: this rank called {SIGNATURES.get(c, f'signature {c}')}, "
            f"another rank {SIGNATURES.get(b, 'something else (another op, shape, dtype or argument)')}")
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

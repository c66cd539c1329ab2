"""Errors the runtime raises. Each says which rank, and what it saw against what it expected."""

from __future__ import annotations


class PKError(RuntimeError):
    """A misuse or a failure of the runtime, reported on the rank where it was found."""


class WaitTimeoutError(PKError):
    """A bounded wait (PK_DEBUG=1) gave up: a counter never reached the value a kernel waited for."""

    @classmethod
    def from_record(cls, record: list[int]) -> WaitTimeoutError:
        """Build the message from a kernel's debug record:
        [flag, rank, address, seen, expected, program, timeout_ns]."""
        from .memory import describe_address

        _, rank, address, seen, expected, program, timeout_ns = record[:7]
        timeout_s = timeout_ns / 1e9
        where = describe_address(address)
        return cls(
            f"rank {rank}: wait on {where} timed out after {timeout_s:g} s in program {program}: "
            f"saw {seen}, expected {expected}"
        )


class MismatchError(PKError):
    """Ranks called one collective with different shapes, dtypes or dimensions (found on the device)."""


# Collectives register a readable description for each signature they send, for MismatchError's message.
SIGNATURES: dict[int, str] = {}


def error_from_record(record: list[int]) -> PKError:
    """The exception a kernel's debug record describes: [kind, rank, a, b, c, program, d]; kind 1 is a wait
    that timed out (a = counter address, b = seen, c = expected, d = timeout ns), kind 2 a collective whose
    ranks disagreed (b = a peer's signature, c = this rank's)."""
    if record[0] == 2:
        _, rank, _, theirs, mine, _, _ = record[:7]
        return MismatchError(
            f"rank {rank}: ranks disagree on a collective: this rank called "
            f"{SIGNATURES.get(mine, f'signature {mine}')}, another rank "
            f"{SIGNATURES.get(theirs, 'something else (another shape, dtype or dimension)')}")
    return WaitTimeoutError.from_record(record)


class RankError(PKError):
    """A rank started by `pk.spawn` raised; `.rank` is the rank, `.original` the exception (when picklable)."""

    def __init__(self, rank: int, message: str, original: BaseException | None = None, remote_traceback: str = ""):
        super().__init__(f"rank {rank} failed: {message}" + (f"\n--- rank {rank} traceback ---\n{remote_traceback}"
                                                            if remote_traceback else ""))
        self.rank = rank
        self.original = original
        self.remote_traceback = remote_traceback

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


class RankError(PKError):
    """A rank started by `pk.spawn` raised; `.rank` is the rank, `.original` the exception (when picklable)."""

    def __init__(self, rank: int, message: str, original: BaseException | None = None, remote_traceback: str = ""):
        super().__init__(f"rank {rank} failed: {message}" + (f"\n--- rank {rank} traceback ---\n{remote_traceback}"
                                                            if remote_traceback else ""))
        self.rank = rank
        self.original = original
        self.remote_traceback = remote_traceback

"""Host-side synchronisation and recorded errors: `sync()` waits for the device and for every rank, and raises on
every rank what any rank's kernels recorded (a wait that gave up, ranks that called an op differently).

**No error stays silent.** A kernel that records an error also sets the host's flag (`pkl.raise_flag`: pinned host
memory on a GPU), which costs the host one load to read. Whoever reads it first raises the error, naming its
cause: the rank's next launch of any op (`runtime/launch.py`: the op's output of the call that failed was not
written, and the job must not go on with it), `pk.sync()`, the end of a rank started by `pk.spawn` (which then
reports the rank as failed, not "ok"), or, where none of these comes within a second (ten under the interpreter,
whose kernels run on the host), the watchdog: a thread that reports the error as the rank's failure (to `pk.spawn`'s
parent, to torchrun's error file, on stderr) and ends the process, as NCCL's asynchronous error handling does.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable

import torch

from .context import context, exchange, is_initialized
from .errors import FLAG, MismatchError, PKError, WaitTimeoutError, error_from_record
from .heap import heap
from .memory import describe_address


def check_errors() -> None:
    """Raise what a kernel of this rank recorded: `WaitTimeoutError` for a wait that gave up, `MismatchError` for
    a call whose ranks disagreed. Synchronises with the device."""
    ctx = context()
    error = recorded_error(ctx.debug_record.tolist())
    if error is not None:
        ctx.debug_record[:FLAG].zero_()  # the last slot holds the flag's address
        ctx.error_flag.value = 0
        raise error


def raise_recorded() -> None:
    """`check_errors` where the host's flag says a kernel recorded an error; nothing (one load) where it does not."""
    if context().error_flag.value:
        check_errors()


def recorded_error(record: list[int], read: Callable[[torch.Tensor], list[int]] | None = None) -> PKError | None:
    """The error a debug record describes (None for an empty one), naming, for a wait for the ranks' arrivals at a
    call, the call and the ranks that never came (`read` copies a tensor to the host); a wait on an op's own
    counters that gave up leaves the ranks out of step for good: no op may run again (`Context.broken`)."""
    if record[0] == 0:
        return None
    ctx = context()
    in_heap = heap().describe(record[2]) if "heap" in ctx.cache else None
    if in_heap and in_heap.startswith("meeting[2]") and "describe_wait" in ctx.cache:
        in_heap += ctx.cache["describe_wait"](read or (lambda t: t.tolist()))
    error = error_from_record(record, lambda address: f"counter {in_heap}" if in_heap else describe_address(address))
    if isinstance(error, WaitTimeoutError) and in_heap:
        ctx.broken = f"a wait of an op gave up ({error}); finalize the ranks and start the job again"
    return error


def check_at_exit() -> None:
    """What a rank's end checks: its device work done, no error recorded that nobody raised (else it is raised)."""
    ctx = context()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    raise_recorded()


# How the watchdog reports an error: `pk.spawn` sets its own (the rank's pipe to the parent) before `init()`.
report_error: Callable[[BaseException], None] | None = None


def _report_and_exit(error: BaseException) -> None:
    """The watchdog's report where `pk.spawn` set none: stderr, and torchrun's error file when there is one."""
    message = f"{type(error).__name__}: {error} (found by the watchdog: the rank raised no error of its own)"
    print(f"parallelkittens: rank {context().rank}: {message}", file=sys.stderr, flush=True)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        import json

        record = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
        with open(path, "w") as f:
            json.dump(record, f)
    os._exit(1)


def read(t: torch.Tensor) -> list[int]:
    """`t` copied to the host on the current stream only (the watchdog's: not behind the rank's kernels)."""
    return t.to("cpu").tolist()


def start_watchdog() -> None:
    """Watch the host's flag: an error no call raised within the grace period is reported, and the process ends."""
    ctx = context()
    grace = 1.0 if ctx.device.type == "cuda" else 10.0
    stop = threading.Event()
    ctx.cache["watchdog"] = stop
    ctx.on_finalize(stop.set)

    def watch(flag: torch.Tensor = ctx.cache["error_flag"]) -> None:  # the flag's memory lives as long as the thread
        since = None
        while not stop.wait(0.2):
            if not ctx.error_flag.value:
                since = None
                continue
            since = since or time.monotonic()
            if time.monotonic() - since < grace:
                continue
            if ctx.device.type == "cuda":  # read beside the rank's stream, which may still run
                with torch.cuda.device(ctx.device), torch.cuda.stream(torch.cuda.Stream(ctx.device)):
                    error = recorded_error(read(ctx.debug_record), read)
            else:
                error = recorded_error(ctx.debug_record.tolist())
            error = error or PKError("a kernel set the error flag and recorded nothing")
            (report_error or _report_and_exit)(error)
            return

    threading.Thread(target=watch, daemon=True, name="pk-watchdog").start()
    atexit.register(_at_exit)  # holds no context: the context's threads and store end with `finalize`


def _at_exit() -> None:
    """A process that ends (torchrun's, a lone one) with an error no call raised fails with it, not "ok"."""
    if is_initialized() and context().error_flag.value:
        try:
            check_at_exit()
        except PKError as error:
            _report_and_exit(error)


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

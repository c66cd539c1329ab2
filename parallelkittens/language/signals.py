"""Signal primitives: `signal`, `signal_all`, `wait`, `barrier_all`, on int32 counters of a parallel tensor.

Memory model (PTX terms). `signal` makes every write this program issued before it (register stores by any of
its threads, and bulk tensor-descriptor stores once complete) visible at system scope before the counter
changes: each thread waits for its bulk copies and runs ``fence.acq_rel.sys``, the program meets at a barrier,
then one thread adds with release semantics at system scope. `wait` polls with ``ld.acquire.sys``, so what the
signaller wrote before signalling is visible to every thread of the waiting program after it returns.

Bounded waits. Every wait gives up after the counter's handle says (PK_WAIT_TIMEOUT with PK_DEBUG=1, else
PK_TIMEOUT), records rank, counter address, value seen and value expected in the rank's debug record, and
returns; `pk.sync()` / `pk.check_errors()` raise `WaitTimeoutError`. The clock is read only once a first poll
has failed, so a wait whose counter is already there costs one load; a spinning one reads the clock at each
poll, which is cheap beside a system-scope acquire load.

Under Triton's interpreter the three inline-asm snippets below are emulated (`runtime.interpreter`).
"""

import time

import numpy as np
import torch
import triton
import triton.language as tl

from ..runtime import handle as _handle
from ..runtime import interpreter
from ..runtime.errors import FLAG, RECORD_WAIT_TIMEOUT
from .peer import translate, world_size

_TIMEOUT, _RECORD, _FLAG = (tl.constexpr(_handle.WAIT_TIMEOUT_NS), tl.constexpr(_handle.DEBUG_RECORD),
                            tl.constexpr(FLAG))
_KIND_TIMEOUT = tl.constexpr(RECORD_WAIT_TIMEOUT)


def _bulk_copies_exist() -> bool:
    # cp.async.bulk exists from sm_90; without a GPU we build for Hopper (the compile tests target sm_90).
    if torch.cuda.is_available():
        return torch.cuda.get_device_capability()[0] >= 9
    return True


_LOAD_ACQUIRE = "ld.global.acquire.sys.b32 $0, [$1];"
_NOW_NS = "mov.u64 $0, %globaltimer;"
_FENCE = "fence.acq_rel.sys;\n\tmov.u32 $0, 0;"
# Hopper's bulk copies (TMA) run in the async proxy: a signal first waits for them to complete and orders them
# with generic accesses; after a wait, the proxy fence lets TMA loads see what generic stores published.
_BULK_WAIT_FENCE = "cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tfence.acq_rel.sys;\n\tmov.u32 $0, 0;"
_NOTHING = "mov.u32 $0, 0;"
_PROXY_FENCE = "fence.proxy.async.global;\n\tmov.u32 $0, 0;"
# a barrier of the whole program that ORs one predicate over its threads (bar.red): a decision all threads share
_VOTE_ANY = ("{\n\t.reg .pred vote_in, vote_out;\n\tsetp.ne.u32 vote_in, $1, 0;\n\t"
             "bar.red.or.pred vote_out, 0, vote_in;\n\tselp.u32 $0, 1, 0, vote_out;\n\t}")
RELEASE_FENCE = tl.constexpr(_BULK_WAIT_FENCE if _bulk_copies_exist() else _FENCE)
ACQUIRE_PROXY_FENCE = tl.constexpr(_PROXY_FENCE if _bulk_copies_exist() else _NOTHING)

interpreter.register_asm(_LOAD_ACQUIRE, lambda ptrs: interpreter.read_memory(ptrs, np.int32))
interpreter.register_asm(_NOW_NS, lambda: np.array(time.monotonic_ns(), dtype=np.int64))
VOTE_ANY = tl.constexpr(_VOTE_ANY)
interpreter.register_asm(_VOTE_ANY, lambda flag: flag)  # a program is one thread in the interpreter
for _asm in (_FENCE, _BULK_WAIT_FENCE, _NOTHING, _PROXY_FENCE):  # the CPU is coherent; the interpreter in order
    interpreter.register_asm(_asm, lambda: np.array(0, dtype=np.int32))


@triton.jit
def _load_acquire(ptr):
    return tl.inline_asm_elementwise("ld.global.acquire.sys.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _now_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _release_fence():
    tl.inline_asm_elementwise(RELEASE_FENCE, "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()


@triton.jit
def _vote_any(flag):
    """A barrier of the program's threads that returns, in every thread, whether the int32 `flag` was nonzero in
    any of them."""
    return tl.inline_asm_elementwise(VOTE_ANY, "=r,r", [flag], dtype=tl.int32, is_pure=False, pack=1) != 0


@triton.jit
def _reached(seen, value, AT_LEAST: tl.constexpr):
    if AT_LEAST:  # compared as a difference, so that counters may wrap around 2^31
        return (seen - value) >= 0
    else:
        return seen == value


@triton.jit
def _report_timeout(ptr, h, seen, value):
    record = tl.load(h + _RECORD).to(tl.pointer_type(tl.int64))
    if tl.atomic_cas(record, tl.full([], 0, tl.int64), tl.full([], _KIND_TIMEOUT, tl.int64)) == 0:  # first wins
        tl.store(record + 1, tl.load(h))
        tl.store(record + 2, ptr.to(tl.int64, bitcast=True))
        tl.store(record + 3, tl.cast(seen, tl.int64))
        tl.store(record + 4, tl.cast(value, tl.int64))
        tl.store(record + 5, tl.program_id(0).to(tl.int64))
        tl.store(record + 6, tl.load(h + _TIMEOUT))
        raise_flag(record, _KIND_TIMEOUT)


@triton.jit
def raise_flag(record, kind):
    """Tell the host that the rank's debug record holds an error of `kind`: the host's flag (pinned host memory on a
    GPU) sits at the address in the record's last slot, so a launch and the watchdog see it without waiting for the
    device (`runtime/sync.py`)."""
    tl.store(tl.load(record + _FLAG).to(tl.pointer_type(tl.int64)), tl.full([], kind, tl.int64))


@triton.jit
def _wait(ptr, value, h, AT_LEAST: tl.constexpr):
    seen = _load_acquire(ptr)
    if not _reached(seen, value, AT_LEAST):  # the clock only once the counter is not there yet
        deadline = _now_ns() + tl.load(h + _TIMEOUT)
        while (not _reached(seen, value, AT_LEAST)) and (_now_ns() < deadline):
            seen = _load_acquire(ptr)
    tl.inline_asm_elementwise(ACQUIRE_PROXY_FENCE, "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    # Every thread polls on its own, so they may disagree on whether time ran out: the program's barrier votes,
    # and the report (which meets the threads again) runs in all of them or none. The barrier also keeps a warp
    # that saw the value from resetting the counter (the usual next step) while another still polls.
    gave_up = _vote_any(1 - _reached(seen, value, AT_LEAST).to(tl.int32))
    if gave_up:
        _report_timeout(ptr, h, seen, value)
    return gave_up


@triton.jit
def wait(ptr, value, h):
    """Spin until this rank's int32 counter at `ptr` equals `value` (acquire, system scope), then meet the
    program's other threads, so that every one of them has seen it before any resets it.

    `ptr` points into this rank's buffer of the parallel tensor whose handle is `h`. Leaves the counter as it
    is: the caller resets it (a plain store once no peer will signal it again in this round). Returns, alike in
    every thread, whether it gave up: the wait timed out, and the rank's debug record says where.
    """
    return _wait(ptr, value, h, False)


@triton.jit
def wait_at_least(ptr, value, h):
    """Like `wait`, until the counter is at least `value`: for counters that only grow, where a fast peer may
    already have signalled the next round (not one of the paper's eight; `barrier_all` and the meeting's
    arrivals use it)."""
    return _wait(ptr, value, h, True)


@triton.jit
def signal(ptr, h, peer, value=1):
    """Add `value` to rank `peer`'s int32 counter at the offset `ptr` has in this rank's buffer.

    Release at system scope: every write of this program before the call is visible to `peer` once it sees
    the new count. One atomic per program; all threads of the program must call it.
    """
    _release_fence()
    tl.atomic_add(translate(ptr, h, peer), value, sem="release", scope="sys")


@triton.jit
def signal_all(ptr, h, value=1):
    """`signal` every rank, this one included: each rank's counter at `ptr`'s offset grows by `value`."""
    _release_fence()
    for r in range(world_size(h)):
        tl.atomic_add(translate(ptr, h, r), value, sem="release", scope="sys")


@triton.jit
def arrive(ptr, value=1):
    """Add `value` to this rank's int32 counter at `ptr` and return what it held before: the per-block arrival
    count for work split across programs of one kernel, where the last to arrive finishes the work (the meeting's end).

    Release, then acquire: this program's writes (bulk copies included) are visible before the count changes,
    and a program that sees the others' counts sees their writes, tensor-descriptor loads included. Not one of
    the paper's eight; local, so nothing waits on a program that may not be resident.
    """
    _release_fence()
    before = tl.atomic_add(ptr, value, sem="acq_rel", scope="gpu")
    tl.inline_asm_elementwise(ACQUIRE_PROXY_FENCE, "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    return before


@triton.jit
def barrier_all(ptr, h):
    """Wait until every rank has reached this barrier on the counter at `ptr` (one program per rank).

    Each rank adds one to every rank's counter, waits until its own counter reaches the world size, then
    takes the world size off again. The counter returns to zero once all ranks are through, so the same
    counter serves any number of consecutive barriers (a rank already in the next round makes it exceed the
    world size, which is why the wait is "at least"). Orders memory like `signal` then `wait`.
    """
    signal_all(ptr, h, 1)
    world = world_size(h)
    _wait(ptr, world, h, True)
    tl.atomic_add(ptr, -world, sem="relaxed", scope="sys")
    tl.debug_barrier()

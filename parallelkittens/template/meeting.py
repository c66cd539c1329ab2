"""The meeting every op's kernel opens with: the ranks check that they run the same call, and learn that every
rank's previous kernel has ended.

One set of counters per context, shared by every op (host side: `Meeting`):
``[epoch, finished, arrivals]`` (int32) and two sets of W signature slots (int64). In a kernel:

* `begin`: every program reads the call's epoch (the count of calls so far, plus one). Program 0 writes the
  call's signature into its slot on every rank and adds one arrival on every rank (release, system scope).
  A rank's kernel starts only after its previous kernels ended, so an arrival also says "my previous call is
  over, and what it wrote is visible".
* `verdict`: wait until all W ranks have arrived for this epoch (arrivals >= W * epoch), then compare the slots.
  Every rank sees the same slots, so every rank reaches the same verdict: if any differs, every program of
  every rank skips its peer work (nothing hangs, nothing is written out of bounds) and the rank records a
  `MismatchError`, which `pk.sync()` raises. Call it before a program's first access to a peer; it may be
  called again (the wait is then satisfied at once). A wait that gave up (a rank never came) is a "disagree".
* `Meeting.refuse`: a rank whose call fails its plan's checks (wrong shape, dtype, output) still meets, with a
  signature that matches nobody's, once for each kernel the call would have launched: its peers' kernels skip
  their peer work and raise `MismatchError` at `pk.sync()`, and every rank's epoch stays in step.
* `end`: every program counts itself out; the last one resets the count and stores the epoch for the next call,
  and learns that it is last (to reset per-call state). Every program also waits for the verdict here: no rank
  finishes a call before every rank has begun it, so a rank is at most one call ahead of any other, which is
  why two sets of slots (by epoch parity) suffice.

Arrivals only grow (compared as differences, so they may wrap), and a CUDA graph replays a call with no host
work: the epoch lives on the device. At one rank every step is skipped. Ops of one rank must be issued on one
stream at a time (they share the counters).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import language as pkl
from ..runtime import handle as _handle
from ..runtime.context import context
from ..runtime.errors import RECORD_MISMATCH, SIGNATURES
from ..runtime.heap import aligned, heap
from ..runtime.launch import Launcher

_EPOCH, _FINISHED, _ARRIVALS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
BARRIER = 3  # the fourth counter: `pk.barrier()`'s
# the signature of a call a rank refused; real ones have bit 61 and 58 hash bits set, so none is this one
REFUSED = (1 << 61) | 1
SIGNATURES[REFUSED] = "a call it refused (its arguments did not fit the op's plan)"
_RECORD, _KIND = tl.constexpr(_handle.DEBUG_RECORD), tl.constexpr(RECORD_MISMATCH)


class Call(NamedTuple):
    """One call's meeting, in a kernel: the shared counters and slots, this call's signature and epoch."""

    counters: object  # int32 pointer: epoch, finished, arrivals
    slots: object  # int64 pointer: 2 x W signature slots
    handle: object  # the counters' parallel-tensor handle
    sig: object  # int64: this call's signature
    rank: object
    world: object
    epoch: object


class Meet(NamedTuple):
    """A kernel's meeting argument (`Meeting.group`): the shared counters and slots, and this call's signature."""

    counters: object  # int32 pointer: epoch, finished, arrivals
    slots: object  # int64 pointer: 2 x W signature slots
    handle: object  # the counters' parallel-tensor handle (it holds this rank's index)
    sig: object  # int64: this call's signature
    world: object


@triton.jit
def begin(meet):
    """Open the call (see the module's docstring); returns the `Call` the other steps take. The rank is read from
    the handle, not passed: every rank runs the same binary (Triton would fold a rank of 1 into a constant)."""
    rank = pkl.rank(meet.handle)
    epoch = tl.load(meet.counters + _EPOCH) + 1
    if meet.world > 1:
        if tl.program_id(0) == 0:
            slot = meet.slots + (epoch & 1) * meet.world  # & 1: may wrap
            for r in range(meet.world):  # the signature marked with the epoch: a slot left from two calls back differs
                pkl.store(slot + rank, meet.sig ^ epoch.to(tl.int64), meet.handle, r)
            pkl.signal_all(meet.counters + _ARRIVALS, meet.handle)
    return Call(meet.counters, meet.slots, meet.handle, meet.sig, rank, meet.world, epoch)


@triton.jit
def verdict(call):
    """True when every rank runs the same call (waits for every rank's arrival first)."""
    theirs = call.sig
    if call.world > 1:
        expected = call.world * call.epoch
        gave_up = pkl.wait_at_least(call.counters + _ARRIVALS, expected, call.handle)
        slot = call.slots + (call.epoch & 1) * call.world
        differs = -1  # the last rank whose call differs from this rank's
        for r in range(call.world):
            other = tl.load(slot + r, volatile=True) ^ call.epoch.to(tl.int64)
            theirs = tl.where(other != call.sig, other, theirs)
            differs = tl.where(other != call.sig, r, differs)
        # a wait that gave up (its record says so) leaves stale slots, which must not agree; the vote is the same
        # in every thread, so the branch below (which meets the threads) runs in all of them or none
        theirs = tl.where(gave_up, ~call.sig, theirs)
        if theirs != call.sig:
            _record_mismatch(call.handle, theirs, call.sig, differs)
    return theirs == call.sig


@triton.jit
def end(call):
    """Close the call; True in the one program of this rank that ends it last."""
    verdict(call)
    last = pkl.arrive(call.counters + _FINISHED) == tl.num_programs(0) - 1
    if last:
        tl.store(call.counters + _FINISHED, 0)
        tl.store(call.counters + _EPOCH, call.epoch)
    return last


@triton.jit
def _refuse_kernel(meet):
    """Only the meeting: a rank's stand-in for a call it refused."""
    call = begin(meet)
    end(call)


@triton.jit
def _record_mismatch(h, theirs, mine, differs):
    record = tl.load(h + _RECORD).to(tl.pointer_type(tl.int64))
    if tl.atomic_cas(record, tl.full([], 0, tl.int64), tl.full([], _KIND, tl.int64)) == 0:  # the first one wins
        tl.store(record + 1, tl.load(h))
        tl.store(record + 2, tl.cast(differs, tl.int64))
        tl.store(record + 3, theirs)
        tl.store(record + 4, mine)
        tl.store(record + 5, tl.program_id(0).to(tl.int64))
        pkl.raise_flag(record, _KIND)


class Meeting:
    """The host side: the context's counters and slots (made once, on the heap) as kernel arguments."""

    def __init__(self):
        ctx = context()
        self.world = ctx.local_world_size
        block = heap().allocate(aligned(16) + aligned(16 * self.world), "meeting")
        heap().label("meeting", ["the calls this rank has made", "the programs of a call that have ended",
                                 "the ranks' arrivals at a call: a rank that never began it is missing",
                                 "pk.barrier()'s arrivals"])
        counters, slots = block.split(16, 16 * self.world)
        self.counters = counters.view(4, torch.int32)
        self.slots = slots.view(2 * self.world, torch.int64)
        self.handle = block.handle
        self._refuse = Launcher(_refuse_kernel, (1,), meet=self.group(REFUSED))
        ctx.cache["describe_wait"] = self.describe_wait  # how `runtime/sync.py` names a call whose ranks never came

    def describe_wait(self, read: Callable[[torch.Tensor], list[int]]) -> str:
        """Which call a wait for the ranks' arrivals was at, and which ranks never came to it, from this rank's
        epoch and signature slots (`read` copies a tensor to the host)."""
        ctx = context()
        epoch, slots, me, world = read(self.counters)[0], read(self.slots), ctx.local_rank, self.world
        for e in (epoch + 1, epoch):  # the call may have ended (its epoch stored) or not
            mine = slots[(e & 1) * world:(e & 1) * world + world]
            sig = mine[me] ^ e
            if sig in SIGNATURES:
                missing = [r for r in range(world) if mine[r] != mine[me]]
                return f" at {SIGNATURES[sig]}; rank(s) {missing} never arrived at that call"
        return ""

    def refuse(self, count: int) -> None:
        """Meet `count` times with a signature nobody's call has (see the module's docstring)."""
        if self.world > 1:
            for _ in range(count):
                self._refuse()

    def group(self, sig: int) -> Meet:
        """The argument a kernel passes to `begin` for a call of signature `sig`."""
        return Meet(self.counters, self.slots, self.handle, sig, self.world)


def meeting() -> Meeting:
    """This context's `Meeting`, made on first use (collective: first plans are built by every rank together)."""
    cache = context().cache
    if "meeting" not in cache:
        cache["meeting"] = Meeting()
    return cache["meeting"]


def signature(*parts: object) -> int:
    """A 62-bit id of a call (op, shapes, dtypes, arguments), registered so a mismatch can be described."""
    return _signature(parts)


@functools.lru_cache(maxsize=4096)
def _signature(parts: tuple) -> int:
    text = repr(parts)
    # bit 61 set: never 0, and always past 2^31, so that Triton passes every signature as an int64 (a kernel
    # compiled for a small one would take int32 and could not take the next)
    sig = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 3 | 1 << 61
    SIGNATURES[sig] = f"{parts[0]} with {', '.join(map(str, parts[1:]))}"
    return sig

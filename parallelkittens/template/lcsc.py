"""The LCSC template (load, compute, store, communicate): one persistent kernel, two kinds of program.

The first `num_comm_programs` programs of the grid are communicators; the others are compute workers. A compute
worker takes tasks ``pid, pid + P, pid + 2P, ...`` (P compute programs) and for each runs
``acc = consumer(G, C, task, loader)`` then ``storer(G, C, task, acc)``; the consumer calls
``loader(G, C, task, k)`` for each step of its main loop. The loader is where a worker reads peer memory or
waits for data to arrive, the storer where it writes to peers or signals. A communicator takes communication
tasks the same way and runs ``communicator(G, C, task)``: bulk peer copies, waiting for compute workers and
reducing, so that data movement runs on its own SMs while the compute workers keep the tensor cores busy (the
paper's inter-SM overlap; loads and stores to peers inside the compute worker are its intra-SM overlap).

`G` is a named tuple of the op's run-time values (pointers, handles, sizes), so that roles read ``G.m_local``,
and `C` a named tuple of its compile-time values (block sizes, flags), read in place (``tl.arange(0, C.BM)``):
Triton keeps a constexpr a constexpr only inside a tuple of constexprs, and only where it is read in place
(assigning ``BM = C.BM`` makes it a run-time value; Triton 3.6 and 3.9). Roles are `@triton.jit` functions
passed by name; `loader` and `communicator` may be None when unused. `num_comm_programs` is a run-time value, so
trying several counts (tuning) compiles the kernel once; list its argument in the kernel's
``do_not_specialize``, or a count of 1 compiles a second variant.

`call`, from `meeting.begin` (see `template/meeting.py`), makes the kernel a collective call: a compute worker
asks for the meeting's verdict after its first consumer, so that the wait for the other ranks hides behind
that tile's k-loop, and runs no storer if the ranks disagree; communicators run only if they agree. A consumer
that waits for peers (a loader) must ask for the verdict itself, first. At the end the last program of the rank
runs `finisher(G, C)` (where the ranks agreed), where an op resets what one call used (flags), knowing every
program is done with it.

Every program of the grid must be resident at once, since compute workers and communicators wait on each
other: launch with `grid(...)`, which never asks for more programs than the device has SMs.
"""

import triton
import triton.language as tl

from ..runtime.device import num_sms
from . import meeting


@triton.jit
def lcsc(G, C, num_tasks, num_comm_tasks, num_comm_programs, loader, consumer, storer, communicator, call=None,
         finisher=None):
    """Run the op's roles over `num_tasks` compute tasks and `num_comm_tasks` communication tasks."""
    pid = tl.program_id(0)
    num_compute = tl.num_programs(0) - num_comm_programs
    # Communicators take the lowest program ids: the hardware starts programs in id order, so when some SMs
    # are busy (another stream, NCCL) the programs left waiting are compute workers, never the communicators
    # the workers wait for.
    if pid >= num_comm_programs:
        for task in range(pid - num_comm_programs, num_tasks, num_compute):
            acc = consumer(G, C, task, loader)
            if _agreed(call):  # a wait only at the first task; later ones find every rank arrived
                storer(G, C, task, acc)
    else:
        if communicator is not None:
            if _agreed(call):
                for task in range(pid, num_comm_tasks, num_comm_programs):
                    communicator(G, C, task)
    if call is not None:
        if meeting.end(call):
            if finisher is not None:
                if meeting.verdict(call):  # a call the ranks disagreed on used nothing to reset
                    finisher(G, C)


@triton.jit
def _agreed(call):
    """The meeting's verdict, or True for a kernel that is no collective call."""
    if call is None:
        return True
    else:
        return meeting.verdict(call)


def grid(num_tasks: int, num_comm_programs: int, max_programs: int | None = None) -> tuple[int]:
    """The persistent grid for `lcsc`: at most one program per SM, `num_comm_programs` of them communicators.

    Raises ValueError when the split cannot run (no compute program left, or communicators asked for none).
    """
    limit = max_programs or num_sms()
    if num_comm_programs < 0 or num_comm_programs >= limit:
        raise ValueError(f"num_comm_programs must be in [0, {limit - 1}] on this device ({limit} SMs), "
                         f"got {num_comm_programs}")
    compute = max(1, min(limit - num_comm_programs, num_tasks))
    return (compute + num_comm_programs,)

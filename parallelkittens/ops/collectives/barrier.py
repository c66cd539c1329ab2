"""A device-side barrier across the node's ranks: one program runs `barrier_all` on a counter of the context.

Unlike `pk.sync()` it does not involve the host: it queues on the rank's stream and orders device work
across ranks (writes made before it are visible to every rank after it). Collective. Its counter is the
meeting's fourth (`template/meeting.py`), so it takes nothing from the heap that the ranks' plans could not agree
on.
"""

import triton

from ... import language as pkl
from ...runtime.context import context
from ...runtime.launch import Launcher
from ...template import meeting


@triton.jit
def _barrier_kernel(counter_ptr, h):
    pkl.barrier_all(counter_ptr, h)


def barrier() -> None:
    """Queue a barrier of every rank of the node on this rank's device stream (asynchronous on a GPU)."""
    cache = context().cache
    launch = cache.get("barrier")
    if launch is None:  # the first call is collective on every rank, like every later one
        made = meeting.meeting()
        launch = cache["barrier"] = Launcher(_barrier_kernel, (1,), counter_ptr=made.counters[meeting.BARRIER:],
                                             h=made.handle)
    launch()

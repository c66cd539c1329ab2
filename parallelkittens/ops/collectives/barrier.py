"""A device-side barrier across the node's ranks: one program runs `barrier_all` on a counter of the context.

Unlike `pk.sync()` it does not involve the host: it queues on the rank's stream and orders device work
across ranks (writes made before it are visible to every rank after it). Collective.
"""

import torch
import triton

from ... import language as pkl
from ...runtime.context import context
from ...runtime.heap import heap
from ...runtime.launch import Launcher


@triton.jit
def _barrier_kernel(counter_ptr, h):
    pkl.barrier_all(counter_ptr, h)


def barrier() -> None:
    """Queue a barrier of every rank of the node on this rank's device stream (asynchronous on a GPU)."""
    cache = context().cache
    launch = cache.get("barrier")
    if launch is None:  # the first call is collective on every rank, like every later one
        block = heap().allocate(4, "barrier")
        launch = cache["barrier"] = Launcher(_barrier_kernel, (1,), counter_ptr=block.view(1, torch.int32),
                                             h=block.handle)
    launch()

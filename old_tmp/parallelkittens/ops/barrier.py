"""A device-side barrier across the node's ranks: one program runs `barrier_all` on a counter of the context.

Unlike `pk.sync()` it does not involve the host: it queues on the rank's stream and orders device work
across ranks (writes made before it are visible to every rank after it). Collective.
"""

import torch
import triton

from .. import language as pkl
from ..runtime import context as _context
from ..runtime.memory import zeros


@triton.jit
def _barrier_kernel(counter_ptr, h):
    pkl.barrier_all(counter_ptr, h)


def barrier() -> None:
    """Queue a barrier of every rank of the node on this rank's device stream (asynchronous on a GPU)."""
    ctx = _context.context()
    if ctx._barrier is None:  # first call is collective on every rank, like every later one
        ctx._barrier = zeros(1, torch.int32, name="pk.barrier")
    counter = ctx._barrier
    _barrier_kernel[(1,)](counter.local, counter.handle)

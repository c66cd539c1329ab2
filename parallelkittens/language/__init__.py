"""Device-side primitives, called from `@triton.jit` kernels: ``import parallelkittens.language as pkl``.

Peer tiles: `load`, `store`, `store_add`, `reduce`, `all_reduce`, `peer_descriptor` (bulk/TMA), `translate`.
Signals: `signal`, `signal_all`, `wait`, `barrier_all` (and `wait_at_least`, and `arrive` for counters local to a
kernel). Handle fields: `rank`, `world_size`. A recorded error: `raise_flag`.
"""

from .peer import all_reduce, load, peer_descriptor, rank, reduce, store, store_add, translate, world_size
from .signals import arrive, barrier_all, raise_flag, signal, signal_all, wait, wait_at_least

__all__ = [
    "all_reduce", "arrive", "barrier_all", "load", "peer_descriptor", "raise_flag", "rank", "reduce", "signal",
    "signal_all", "store", "store_add", "translate", "wait", "wait_at_least", "world_size",
]

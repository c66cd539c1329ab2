"""The layout of a parallel tensor's handle: the one place it is written.

A kernel takes a parallel tensor as a pointer into its local buffer and its handle, an int64 tensor on the
rank's device::

    [rank, world_size, debug_record_address, wait_timeout_ns, base_0, ..., base_{W-1}]

base_r is the address of rank r's buffer in this process. The host builds it (`make`); the device language
(`language/peer.py`, `language/signals.py`) reads it through these indices.
"""

from __future__ import annotations

import torch

RANK = 0
WORLD = 1
DEBUG_RECORD = 2  # address of the rank's debug record: where a wait that gave up, or a mismatch, is written
WAIT_TIMEOUT_NS = 3  # how long a wait on a counter lasts before it gives up
BASES = 4


def make(rank: int, bases: list[int], debug_record: int, wait_timeout_ns: int, device: torch.device
         ) -> torch.Tensor:
    """The handle of a parallel tensor whose buffers start at `bases` (one per rank, in this process)."""
    return torch.tensor([rank, len(bases), debug_record, wait_timeout_ns, *bases], dtype=torch.int64, device=device)

"""Choosing `num_comm_sms` by measurement, the same on every rank.

Every rank times every candidate in the same order (each call is collective), the times are reduced to their
maximum over ranks, and the fastest candidate wins: the reduced list is identical everywhere, so every rank
picks the same count without another message. Choices are cached per op and shape in the context.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..runtime.context import context
from ..runtime.device import num_sms
from ._collective import confirm_agreement


def candidates() -> list[int]:
    """Communicator counts worth trying on this device: powers of two below a quarter of its SMs."""
    limit = max(2, num_sms() // 4)
    return [c for c in (1, 2, 4, 8, 16, 32) if c < limit] or [1]


def comm_programs(num_comm_sms: int | None, key: tuple, run: Callable[[int], object]) -> int:
    """The communicator count an LCSC op launches with: none at one rank (nothing to move), else the caller's
    `num_comm_sms`, else the `tuned` choice."""
    if context().local_world_size == 1:
        return 0
    return num_comm_sms if num_comm_sms is not None else tuned(key, run)


def tuned(key: tuple, run: Callable[[int], object], reps: int = 3) -> int:
    """The fastest `num_comm_sms` for `run(num_comm_sms)` (a collective call), agreed by all ranks."""
    ctx = context()
    key = ("num_comm_sms",) + key
    if key in ctx.cache:
        return ctx.cache[key]
    options = candidates()
    if len(options) == 1:
        ctx.cache[key] = options[0]
        return options[0]
    confirm_agreement()  # every rank must tune together: only if the ranks agreed on this call
    times = []
    for count in options:
        run(count)  # compiles, allocates
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        start = time.perf_counter()
        for _ in range(reps):
            run(count)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        times.append(time.perf_counter() - start)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=ctx.node_group)  # the op's ranks
    ctx.cache[key] = options[int(torch.argmin(slowest))]
    return ctx.cache[key]

"""Choosing `num_comm_sms` by measurement, the same on every rank, once per plan.

Every rank times every candidate in the same order (each call is collective), the times are reduced to their
maximum over ranks, and the fastest candidate wins: the reduced list is identical everywhere, so every rank
picks the same count without another message. A plan tunes when it is built (after the ranks agreed on the
call), so later calls of its signature never tune again.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ...runtime.context import context
from ...runtime.device import num_sms
from ...runtime.launch import Launcher


def candidates() -> list[int]:
    """Communicator counts worth trying on this device: powers of two below a quarter of its SMs."""
    limit = max(2, num_sms() // 4)
    return [c for c in (1, 2, 4, 8, 16, 32) if c < limit] or [1]


def fastest(run: Callable[[int], object], options: list[int], reps: int = 3) -> int:
    """The option for which `run(option)` (a collective call) is fastest, agreed by all ranks."""
    ctx = context()
    if len(options) == 1:
        return options[0]
    ctx.stats["tunings"] += 1
    times = []
    for option in options:
        run(option)  # compiles
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        start = time.perf_counter()
        for _ in range(reps):
            run(option)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        times.append(time.perf_counter() - start)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=ctx.node_group)  # the op's ranks
    return options[int(torch.argmin(slowest))]


def choose(bound: Callable[[int], Launcher], num_comm_sms: int | None, run: Callable[[Launcher], object]
           ) -> Launcher:
    """The launch an LCSC op keeps: no communicator at one rank, the caller's count, or the `fastest` of the
    `candidates`, each timed by `run(launch)` with the plan's first operands."""
    if context().local_world_size == 1:
        return bound(0)
    if num_comm_sms is not None:
        return bound(num_comm_sms)
    options = {count: bound(count) for count in candidates()}
    return options[fastest(lambda count: run(options[count]), list(options))]

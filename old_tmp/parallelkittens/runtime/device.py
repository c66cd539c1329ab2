"""Facts about this rank's device that kernels are sized by."""

import functools
import os

import torch

from .context import context


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms() -> int:
    """Programs a persistent kernel may launch at once on this rank's device: its SM count on a GPU, or this
    rank's share of it when several ranks share the GPU (backend ``cuda-shared``). Those ranks' persistent
    kernels wait on each other: without MPS the GPU time-slices between them, and with MPS they run side by
    side, which is safe only if all of them fit at once. Under the interpreter PK_INTERPRET_SMS (default 4),
    since every program runs on its own thread there."""
    ctx = context()
    if ctx.device.type == "cuda":
        return _cuda_share(ctx.device.index, ctx.backend, ctx.local_world_size)
    return int(os.environ.get("PK_INTERPRET_SMS", "4"))


@functools.cache  # called on every GEMM launch: ask the driver once
def _cuda_share(index: int, backend: str, local_world_size: int) -> int:
    sharing = -(-local_world_size // torch.cuda.device_count()) if backend == "cuda-shared" else 1
    return max(1, _cuda_sms(index) // sharing)

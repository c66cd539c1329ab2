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
    rank's share of it when several ranks share the GPU (backend ``cuda-shared``): their persistent kernels wait
    on each other, so all of them must be resident at once. Under the interpreter PK_INTERPRET_SMS (default 4),
    since every program runs on its own thread there."""
    ctx = context()
    if ctx.device.type == "cuda":
        sharing = -(-ctx.local_world_size // torch.cuda.device_count()) if ctx.backend == "cuda-shared" else 1
        return max(1, _cuda_sms(ctx.device.index) // sharing)
    return int(os.environ.get("PK_INTERPRET_SMS", "4"))

"""Facts about this rank's device that kernels are sized by."""

import functools
import os

import torch

from .context import context


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms() -> int:
    """Programs a persistent kernel may launch at once on this rank's device: its SM count on a GPU; under the
    interpreter PK_INTERPRET_SMS (default 4), since every program runs on its own thread there."""
    device = context().device
    if device.type == "cuda":
        return _cuda_sms(device.index)
    return int(os.environ.get("PK_INTERPRET_SMS", "4"))

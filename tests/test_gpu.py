"""GPU-only checks (skipped without CUDA): backend choice, compiled kernels, symmetric memory given back."""

import gc

import pytest
import torch

import parallelkittens as pk
from parallelkittens.runtime.context import choose_backend, interpreting

pytestmark = pytest.mark.gpu


def test_backend_choice_on_this_machine():
    gpus = torch.cuda.device_count()
    assert choose_backend(1) == "cuda"
    assert choose_backend(2) == ("cuda" if gpus >= 2 else "cuda-shared")


def _describe() -> tuple:
    ctx = pk.init()
    return ctx.backend, ctx.device.type, interpreting(), pk.num_sms()


def test_ranks_compile_their_kernels():
    for backend, device, interpreted, sms in pk.spawn(_describe, 2):
        assert device == "cuda" and backend in ("cuda", "cuda-shared") and not interpreted and sms > 1


def _cycles(cycles: int) -> tuple[int, int]:
    pk.init()
    pk.zeros(1 << 20, torch.float32, name="warm").free()
    gc.collect()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    for i in range(cycles):
        pk.zeros((1 << 20) + 256 * i, torch.bfloat16, name="cycle").free()
    gc.collect()
    torch.cuda.synchronize()
    return start, torch.cuda.memory_allocated()


def test_allocate_free_cycles_give_memory_back():
    for start, end in pk.spawn(_cycles, 2, 20):
        assert end - start <= 4 << 20, f"{(end - start) >> 20} MiB still allocated after 20 cycles of 2 MiB"

"""`runtime/launch.py`: when a compiled kernel is launched again directly, and the direct launch's argument order
(with stand-ins for Triton's kernel objects and driver: the real launcher needs a GPU)."""

import types

import pytest
import torch

from parallelkittens.runtime import launch as launching


class _Compiled:
    packed_metadata, function = "meta", "fn"

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


class _Kernel:
    arg_names = ["a", "n", "BLOCK"]

    def __init__(self):
        self.compiled, self.slow = _Compiled(), 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.slow += 1
            return self.compiled
        return run


@pytest.fixture
def direct(monkeypatch):
    monkeypatch.setattr(launching, "_enabled", True)
    monkeypatch.setattr(launching, "_compiled", {})
    active = types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 5)
    monkeypatch.setattr(launching, "driver", types.SimpleNamespace(active=active))


def test_second_launch_with_a_key_calls_the_compiled_launcher_with_every_parameter_in_order(direct):
    kernel = _Kernel()
    for n in (9, 9):
        launching.launch(kernel, (3,), "x", n, BLOCK=64, num_warps=4, key=("shape", 1))
    assert kernel.slow == 1
    (call,) = kernel.compiled.calls
    assert call == (3, 1, 1, 5, "fn", "meta", None, None, None, "x", 9, 64)


def test_other_keys_and_no_key_go_through_triton(direct):
    kernel = _Kernel()
    launching.launch(kernel, (3,), "x", 9, BLOCK=64, key=("shape", 1))
    launching.launch(kernel, (3,), "x", 9, BLOCK=64, key=("shape", 2))  # another specialisation
    launching.launch(kernel, (4,), "x", 9, BLOCK=64, key=("shape", 1))  # another grid
    launching.launch(kernel, (3,), "x", 9, BLOCK=64)  # no promise from the caller
    assert kernel.slow == 4 and not kernel.compiled.calls


def test_a_parameter_left_to_its_default_keeps_triton_in_charge(direct):
    kernel = _Kernel()
    for _ in range(2):
        launching.launch(kernel, (3,), "x", 9, key="k")  # BLOCK not given: the launcher needs every value
    assert kernel.slow == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs where there is no GPU")
def test_the_interpreter_never_launches_directly(monkeypatch):
    monkeypatch.setattr(launching, "_enabled", None)
    monkeypatch.setenv("PK_FAST_LAUNCH", "1")
    assert launching.fast_launch_enabled() is False  # the CPU tests run under TRITON_INTERPRET=1


def test_an_installed_launch_hook_keeps_triton_in_charge(direct, monkeypatch):
    from triton import knobs

    kernel = _Kernel()
    monkeypatch.setattr(knobs.runtime.launch_enter_hook, "calls", [lambda *a: None])  # a profiler, say
    for _ in range(2):
        launching.launch(kernel, (3,), "x", 9, BLOCK=64, key="k")
    assert kernel.slow == 2

"""`runtime/launch.py`: when a bound kernel is launched again directly, and the direct launch's argument order
(with stand-ins for Triton's kernel objects and driver: the real launcher needs a GPU)."""

import types

import pytest
import torch

import parallelkittens as pk
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
        self.compiled, self.slow = _Compiled(), []

    def __getitem__(self, grid):
        def run(**kwargs):
            self.slow.append((grid, kwargs))
            return self.compiled
        return run


def _bound(monkeypatch, direct: bool = True, **named):
    monkeypatch.setattr(launching, "driver", types.SimpleNamespace(active=types.SimpleNamespace(
        get_current_stream=lambda device: 5)))
    kernel = _Kernel()
    launcher = launching.Launcher(kernel, (3,), per_call=("a",), **named)
    launcher._direct_ok = direct  # as on a GPU with PK_FAST_LAUNCH=1
    return kernel, launcher


def _in_a_rank(test: str) -> list:
    import _pytest.monkeypatch

    mp = _pytest.monkeypatch.MonkeyPatch()
    try:
        return globals()[test](mp)
    finally:
        mp.undo()


def _second_call_is_direct(mp) -> list:
    kernel, launcher = _bound(mp, n=9, BLOCK=64, num_warps=4)
    x = torch.zeros(4)
    launcher(x)
    launcher(x)
    first = {k: v for k, v in kernel.slow[0][1].items() if k != "a"}
    calls = [tuple("x" if v is x else v for v in call) for call in kernel.compiled.calls]
    return [len(kernel.slow), first, calls]


def _misaligned_goes_through_triton(mp) -> list:
    kernel, launcher = _bound(mp, n=9, BLOCK=64)
    x = torch.zeros(8)
    launcher(x)
    launcher(x[1:])  # 4 bytes in: Triton specialises pointers by 16-byte alignment
    return [len(kernel.slow), len(kernel.compiled.calls)]


def _hook_keeps_triton_in_charge(mp) -> list:
    from triton import knobs

    kernel, launcher = _bound(mp, n=9, BLOCK=64)
    mp.setattr(knobs.runtime.launch_enter_hook, "calls", [lambda *a: None])  # a profiler, say
    for _ in range(2):
        launcher(torch.zeros(4))
    return [len(kernel.slow)]


def _interpreter_never_direct(mp) -> list:
    return [launching.Launcher(_Kernel(), (1,), per_call=("a",), n=1, BLOCK=2)._direct_ok]


def _every_parameter_is_named(mp) -> list:
    try:
        launching.Launcher(_Kernel(), (1,), per_call=("a",), n=1)
    except TypeError as e:
        return [str(e)]
    return ["no error"]


def _new_thread_gets_the_allocator(mp) -> list:
    import threading

    from triton.runtime import _allocation

    from parallelkittens.runtime import context as ctx_module

    def ours(size, alignment, stream):  # stands in for the allocator pk.init installs on a GPU
        raise AssertionError("not called here")

    mp.setattr(ctx_module, "_ALLOCATOR", ours)
    kernel, launcher = _bound(mp, n=9, BLOCK=64)
    seen = []
    kernel.compiled.run = lambda *args: seen.append(_allocation._allocator.get() is ours)

    def backward_thread():  # autograd runs a backward's kernels in a thread of its own, as here
        seen.append(_allocation._allocator.get() is ours)  # a new thread starts without it
        launcher(torch.zeros(4))  # Triton's path (the stub's run is not called)
        launcher(torch.zeros(4))  # the direct path: the compiled kernel asks for the allocator
        seen.append(_allocation._allocator.get() is ours)

    thread = threading.Thread(target=backward_thread)
    thread.start()
    thread.join()
    return seen


def test_second_call_goes_straight_to_the_compiled_launcher_with_every_parameter_in_order():
    slow, first_kwargs, direct = pk.spawn(_in_a_rank, 1, "_second_call_is_direct")[0]
    assert slow == 1 and first_kwargs["n"] == 9 and first_kwargs["num_warps"] == 4
    (call,) = direct
    assert call == (3, 1, 1, 5, "fn", "meta", None, None, None, "x", 9, 64)


def test_a_misaligned_tensor_takes_tritons_path():
    assert pk.spawn(_in_a_rank, 1, "_misaligned_goes_through_triton")[0] == [2, 0]


def test_an_installed_launch_hook_keeps_triton_in_charge():
    assert pk.spawn(_in_a_rank, 1, "_hook_keeps_triton_in_charge")[0] == [2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs where there is no GPU")
def test_the_interpreter_never_launches_directly():
    assert pk.spawn(_in_a_rank, 1, "_interpreter_never_direct")[0] == [False]


def test_a_launch_from_a_new_thread_installs_our_triton_allocator_there():
    # Triton keeps its allocator in a context variable, unset in a new thread: TMA kernels in a backward failed
    # with "no allocator was set" on the GPU until launches installed it.
    assert pk.spawn(_in_a_rank, 1, "_new_thread_gets_the_allocator")[0] == [False, True, True]


def test_a_parameter_left_out_is_an_error():
    (message,) = pk.spawn(_in_a_rank, 1, "_every_parameter_is_named")[0]
    assert "missing ['BLOCK']" in message

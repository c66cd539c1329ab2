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


def _in_a_rank(test: str, *args) -> list:
    import _pytest.monkeypatch

    mp = _pytest.monkeypatch.MonkeyPatch()
    try:
        return globals()[test](mp, *args)
    finally:
        mp.undo()


def _second_call_is_direct(mp) -> list:
    kernel, launcher = _bound(mp, n=9, BLOCK=64, num_warps=4)
    x = torch.zeros(4)
    launcher(x)
    launcher(x)
    first = {k: v for k, v in kernel.slow[0][1].items() if k != "a"}
    calls = [tuple("x" if v == x.data_ptr() else v for v in call) for call in kernel.compiled.calls]
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


class _Desc:  # a host tensor descriptor's fields, as the encoder reads them
    def __init__(self, t, block=(2,)):
        self.base, self.shape, self.strides, self.block_shape = t, t.shape, t.stride(), block


class _DescKernel(_Kernel):
    arg_names = ["a_desc", "n", "w_desc", "BLOCK"]


def _encoded_launch(mp, triton_36: bool, release: str | None = None) -> list:
    """A kernel with a per-call and a fixed descriptor, launched four times with stand-ins for the compiled
    kernel, its C launcher (Triton 3.6's layout or 3.9's) and Triton's descriptor encoder."""
    from triton.backends.nvidia import driver as nvidia

    mp.setattr(launching, "TRITON", release or ("3.6" if triton_36 else "3.9"))
    encoded, c_calls = [], []

    def encode(desc, meta, *base_args):
        encoded.append(desc.base.data_ptr())
        return [f"map{len(encoded)}:{meta}", *desc.shape, *desc.strides]

    if triton_36:
        mp.setattr(nvidia, "make_tensordesc_arg", lambda desc, meta: encode(desc, meta))
    else:
        mp.setattr(nvidia, "make_tensordesc_arg", encode)
    kernel = _DescKernel()
    compiled = kernel.compiled
    compiled.metadata = types.SimpleNamespace(tensordesc_meta=["A", "W"])
    run = types.SimpleNamespace(global_scratch_size=0, profile_scratch_size=0, launch_cooperative_grid=False,
                                launch_pdl=True)
    if triton_36:
        launcher = lambda *args: c_calls.append(args)  # noqa: E731  (the name Triton 3.6's wrapper closes over)

        def wrapper(*args):  # Triton's wrapper, which would encode at every call
            return launcher(*args)
        run.launch = wrapper
        utils = None
    else:
        run.kernel_signature, run.arg_annotations = b"sig", "annotations"
        utils = types.SimpleNamespace(launch=lambda *args: c_calls.append(args[:-1] + (list(args[-1]),)))
    compiled.run = run
    mp.setattr(launching, "driver", types.SimpleNamespace(active=types.SimpleNamespace(
        get_current_stream=lambda device: 5, utils=utils)))
    w = torch.zeros(8)
    bound = launching.Launcher(kernel, (3,), per_call=("a_desc",), descriptors={"a_desc": _Desc}, n=9,
                               w_desc=_Desc(w, (4,)), BLOCK=64)
    bound._direct_ok = True
    x, y = torch.zeros(4), torch.zeros(2, 6)
    for t in (x, x, x, y):
        if release:  # a release whose launcher is not known: Triton's path, not the encoded one
            bound(t)
            return [bound._encoded is None, bound.launches]
        bound(t)
    names = {x.data_ptr(): "x", y.data_ptr(): "y", w.data_ptr(): "w"}
    first = kernel.slow[0][1]
    return [len(kernel.slow), type(first["a_desc"]).__name__, [names[p] for p in encoded], c_calls]


def test_descriptors_are_encoded_once_per_tensor_and_passed_to_tritons_c_launcher():
    for triton_36 in (True, False):
        slow, first_type, encoded, calls = pk.spawn(_in_a_rank, 1, "_encoded_launch", triton_36)[0]
        # Triton's path once, with the descriptor made from the tensor passed
        assert slow == 1 and first_type == "_Desc"
        # at the first direct call: the first call's and the fixed descriptor (the template), then x's; then y's
        assert encoded == ["x", "w", "x", "y"]
        x_args = ["map3:A", 4, 1, 9, "map2:W", 8, 1, 64]  # descriptors spread into (map, shape, strides)
        y_args = ["map4:A", 2, 6, 6, 1, 9, "map2:W", 8, 1, 64]
        if triton_36:  # (grid, stream, function, coop, pdl, scratch x2, metadata, hooks x3, *arguments)
            prefix = (3, 1, 1, 5, "fn", False, True, None, None, "meta", None, None, None)
            assert calls == [prefix + tuple(x_args)] * 2 + [prefix + tuple(y_args)]
        else:  # (grid, stream, function, coop, pdl, metadata, hooks x3, scratch x2, annotations, signature, args)
            prefix = (3, 1, 1, 5, "fn", False, True, "meta", None, None, None, None, None, "annotations", b"sig")
            assert calls == [prefix + (x_args,)] * 2 + [prefix + (y_args,)]


class _PlainKernel(_Kernel):
    arg_names = ["a", "n", "w", "BLOCK"]


def _plain_launch(mp, triton_36: bool) -> list:
    """A kernel without descriptors, a per-call tensor and a fixed one, launched three times with stand-ins for
    the compiled kernel and its C launcher (Triton 3.6's layout or 3.9's)."""
    mp.setattr(launching, "TRITON", "3.6" if triton_36 else "3.9")
    c_calls = []
    kernel = _PlainKernel()
    compiled = kernel.compiled
    compiled.metadata = types.SimpleNamespace(tensordesc_meta=None)
    run = types.SimpleNamespace(global_scratch_size=0, profile_scratch_size=0, launch_cooperative_grid=False,
                                launch_pdl=True)
    utils = None
    if triton_36:
        launcher = lambda *args: c_calls.append(args[13:])  # noqa: E731  (past grid, stream, ..., hooks)

        def wrapper(*args):
            return launcher(*args)
        run.launch = wrapper
    else:
        run.kernel_signature, run.arg_annotations = b"sig", "annotations"
        utils = types.SimpleNamespace(launch=lambda *args: c_calls.append(tuple(args[-1])))
    compiled.run = run
    mp.setattr(launching, "driver", types.SimpleNamespace(active=types.SimpleNamespace(
        get_current_stream=lambda device: 5, utils=utils)))
    w = torch.zeros(8)
    bound = launching.Launcher(kernel, (3,), per_call=("a",), n=9, w=w, BLOCK=64)
    bound._direct_ok = True
    x, y = torch.zeros(4), torch.zeros(6)
    for t in (x, x, y, torch.zeros(8)[1:]):  # the last 4 bytes in: Triton's path again, which specialises it
        bound(t)
    names = {x.data_ptr(): "x", y.data_ptr(): "y", w.data_ptr(): "w"}
    return [len(kernel.slow), [[names.get(a, a) for a in call] for call in c_calls]]


def test_a_kernel_without_descriptors_goes_to_the_c_launcher_with_tensors_as_addresses():
    # an address needs no driver call in the launcher; a tensor costs one (cuPointerGetAttribute) at every launch
    for triton_36 in (True, False):
        slow, calls = pk.spawn(_in_a_rank, 1, "_plain_launch", triton_36)[0]
        assert slow == 2 and calls == [["x", 9, "w", 64], ["y", 9, "w", 64]], (triton_36, slow, calls)


def test_under_a_triton_release_not_known_descriptors_are_left_to_triton():
    assert pk.spawn(_in_a_rank, 1, "_encoded_launch", False, "3.99")[0] == [True, 1]


def _scratch_kernel_encodes_through_triton(mp) -> list:
    kernel, launcher = _bound(mp, descriptors={"a": _Desc}, n=9, BLOCK=64)
    compiled = kernel.compiled
    compiled.metadata = types.SimpleNamespace(tensordesc_meta=["A"])
    calls = compiled.calls
    compiled.run = lambda *args: calls.append(args)
    compiled.run.global_scratch_size, compiled.run.profile_scratch_size = 128, 0  # device-made descriptors too
    x = torch.zeros(4)
    launcher(x)
    launcher(x)
    (call,) = calls
    return [type(call[-3]).__name__, call[-3].base is x]


def test_a_kernel_the_encoded_path_cannot_take_gets_descriptors_made_at_each_call():
    assert pk.spawn(_in_a_rank, 1, "_scratch_kernel_encodes_through_triton")[0] == ["_Desc", True]


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

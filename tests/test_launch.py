"""`runtime/launch.py`: the key that decides when a compiled kernel may be launched again directly, and the
direct launch's argument order (with a stand-in for Triton's kernel objects: the real launcher needs a GPU)."""

import types

import torch

from parallelkittens.runtime import launch as launching


def test_key_separates_what_triton_specialises_on():
    x = torch.zeros(64, dtype=torch.float32)
    key = launching.launch_key("k", (4,), (x, 7), {"B": 16})
    assert key == launching.launch_key("k", (4,), (torch.ones(64), 7), {"B": 16})  # same dtype and alignment
    assert key != launching.launch_key("k", (4,), (x[1:], 7), {"B": 16})  # 4 bytes off: not 16-byte aligned
    assert key != launching.launch_key("k", (4,), (x.half(), 7), {"B": 16})
    assert key != launching.launch_key("k", (4,), (x, 1), {"B": 16})  # Triton makes a 1 a constant
    assert key != launching.launch_key("k", (4,), (x, 7), {"B": 32})
    assert key != launching.launch_key("k", (8,), (x, 7), {"B": 16})
    assert launching.launch_key("k", (1,), (True,), {}) != launching.launch_key("k", (1,), (1,), {})
    assert launching.launch_key("k", (1,), (object(),), {}) is None  # unknown kinds go through Triton


class _Compiled:
    packed_metadata, function = "meta", "fn"

    def __init__(self):
        self.calls = []

    def launch_metadata(self, grid, stream, *args):
        return None

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


def test_second_launch_calls_the_compiled_launcher_with_every_parameter_in_order(monkeypatch):
    monkeypatch.setattr(launching, "fast_launch_enabled", lambda: True)
    monkeypatch.setattr(launching, "_compiled", {})
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: types.SimpleNamespace(cuda_stream=5))
    kernel, x = _Kernel(), torch.zeros(8)
    launching.launch(kernel, (3,), x, 9, BLOCK=64, num_warps=4)
    launching.launch(kernel, (3,), x, 9, BLOCK=64, num_warps=4)
    launching.launch(kernel, (3,), x, 10, BLOCK=64, num_warps=4)  # another key: through Triton again
    assert kernel.slow == 2
    (call,) = kernel.compiled.calls
    assert call[:7] == (3, 1, 1, 5, "fn", "meta", None) and call[9:] == (x, 9, 64)

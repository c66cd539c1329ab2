"""Test settings: every wait bounded (PK_DEBUG=1), kernels interpreted where there is no GPU."""

import os

os.environ.setdefault("PK_DEBUG", "1")
os.environ.setdefault("PK_WAIT_TIMEOUT", "20")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # ranks forked, as `auto` does until the test process has run a parallel op of its own (then a fork server,
    # slower to start: tests/test_faults.py checks `auto` from a fresh parent)
    os.environ.setdefault("PK_SPAWN_METHOD", "fork")

import parallelkittens  # noqa: E402, F401  (sets TRITON_INTERPRET=1 on machines without CUDA)


def worlds(default: str = "1,2,3,4,8") -> list[int]:
    """World sizes to test: PK_TEST_WORLDS (e.g. "2,4" on the GPU machine), else `default`."""
    return [int(w) for w in os.environ.get("PK_TEST_WORLDS", default).split(",")]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

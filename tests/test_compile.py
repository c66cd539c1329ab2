"""Compile the primitives for sm_90 without a GPU and check the PTX: release/acquire at system scope, bulk
copies waited for before a signal, TMA where asked for, and every wait loop bounded (a timer read inside it)."""

import json
import os
import subprocess
import sys

import pytest

SIGNALLING = ("signal_wait", "signal_all", "barrier_all", "lcsc_example", "collective_pull", "collective_pull_copy",
              "collective_two_shot_staged", "collective_pull_in_place",
              "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")


def _markers() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-m", "parallelkittens.testing.compile_check", "--arch", "90"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def compiled():
    return _markers()


@pytest.fixture(scope="module")
def hot(compiled):
    return compiled["markers"]


@pytest.mark.parametrize("kernel", SIGNALLING)
def test_signals_order_memory_at_system_scope(hot, kernel):
    for marker in ("release_sys_atomic", "acquire_sys_load", "fence_sys", "bulk_wait", "proxy_fence"):
        assert marker in hot[kernel], f"{kernel}: no {marker} in PTX ({hot[kernel]})"


@pytest.mark.parametrize("kernel", SIGNALLING)
def test_every_wait_is_bounded(compiled, kernel):
    # every loop polling memory at system scope reads the clock inside it; the clock is read only after a first
    # poll fails (language/signals.py), so a met counter costs one load
    polling, timed = compiled["polling_loops"][kernel]
    assert polling > 0 and timed == polling, f"{kernel}: {polling - timed} of {polling} polling loops read no clock"


def test_the_bound_check_sees_a_loop_without_a_clock():
    from parallelkittens.testing.compile_check import polling_loops

    loop = "$L__BB0_1:\n  ld.global.acquire.sys.b32 %r1, [%rd1];\n  @%p1 bra $L__BB0_1;\n"
    timed = ("$L__BB0_2:\n  ld.global.acquire.sys.b32 %r1, [%rd1];\n  mov.u64 %rd2, %globaltimer;\n"
             "  @%p1 bra $L__BB0_2;\n")
    assert polling_loops(loop) == (1, 0) and polling_loops(timed) == (1, 1) and polling_loops(loop + timed) == (2, 1)


@pytest.mark.parametrize("kernel", ["collective_pull", "collective_pull_copy", "collective_two_shot_staged"])
def test_collectives_read_peers_16_bytes_at_a_time(hot, kernel):
    assert "vector_loads" in hot[kernel], hot[kernel]


def test_tensor_descriptors_use_tma(hot):
    assert "tma_store" in hot["tma_store"]
    assert "tma_reduce" in hot["tma_store_add"]


def test_attention_forward_uses_wgmma(hot):
    assert "wgmma" in hot["attention_forward"] and "tma_load" not in hot["attention_forward"]


def test_store_add_is_a_system_scope_atomic(hot):
    assert "relaxed_sys_add" in hot["store_add"]


def test_gemm_core_uses_wgmma_and_tma(hot):
    assert "wgmma" in hot["matmul"] and "tma_store" in hot["matmul"]


def test_pingpong_gemm_is_warp_specialised(hot, compiled):
    from parallelkittens.ops.descriptors import GLUON

    if not GLUON:
        pytest.skip("this Triton has no Gluon warp specialisation")
    assert "wgmma" in hot["matmul_pingpong"] and "tma_store" in hot["matmul_pingpong"], hot["matmul_pingpong"]
    assert "setmaxnreg" in hot["matmul_pingpong"], "no register reallocation between the roles"


def test_gluon_attention_forward_is_warp_specialised(hot, compiled):
    from parallelkittens.ops.descriptors import GLUON

    if not GLUON:
        pytest.skip("this Triton has no Gluon warp specialisation")
    marks = hot["attention_forward_ws"]
    assert "wgmma" in marks and "tma_load" in marks and "setmaxnreg" in marks, marks
    assert compiled["shared"]["attention_forward_ws"] <= 227 * 1024  # 3 stages of 128-key K and V tiles fit


@pytest.mark.parametrize("kernel", ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce",
                                    "matmul_reduce_scatter_b_t"])
def test_fused_gemms_use_wgmma_and_tma(hot, kernel):
    assert "wgmma" in hot[kernel] and "tma_store" in hot[kernel] and "release_sys_atomic" in hot[kernel]
    # the shares go to their owners as TMA stores into per-rank slots, not reduce-adds (whose order varies)
    assert "tma_reduce" not in hot[kernel]


def test_every_kernel_fits_in_shared_memory(compiled):
    limit = 232448  # bytes of shared memory one block may use on an H100 / H200 SM
    too_big = {name: size for name, size in compiled["shared"].items() if size > limit}
    assert not too_big, f"need more shared memory than an SM has ({limit} B): {too_big}"

"""Tests of parallelkittens.runtime.interpreter: each one fails on the stock Triton interpreter."""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":  # set by conftest's import of the package on machines without CUDA
    pytest.skip("interpreter tests run where kernels are interpreted", allow_module_level=True)

import multiprocessing
import threading
import time

import numpy as np
import torch
import triton
import triton.language as tl

from parallelkittens.runtime import interpreter as pki

pytestmark = pytest.mark.timeout(60)

# asm texts that the package itself does not emulate (tests must not unregister the package's emulations)
LD_RELAXED = "ld.global.relaxed.gpu.b32 $0, [$1];"
SMID = "mov.u32 $0, %smid;"


@pytest.fixture(scope="module", autouse=True)
def patched():
    was_installed = pki.is_installed()
    pki.install()
    yield
    if not was_installed:
        pki.uninstall()


def rand_bf16(*shape, seed=0):
    """Random bf16 values of both signs with magnitudes in [0.5, 2): never zero."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.rand(*shape, generator=g) * 1.5 + 0.5
    sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
    return (mag * sign).to(torch.bfloat16)


def _offset_to(other, base):  # element offset from base to a tensor that is not a kernel argument
    return (other.data_ptr() - base.data_ptr()) // base.element_size()


# ----------------------------------------------------------------------------------------------- threads
@triton.jit
def write_pid_kernel(out, ITERS: tl.constexpr):
    acc = tl.zeros((16,), tl.int32)
    for _ in range(ITERS):  # give other threads time to run between the launch's setup and program_id
        acc += 1
    tl.store(out + tl.program_id(0), tl.program_id(0) + tl.sum(acc) * 0)


def test_concurrent_launches_from_threads():
    outs = [torch.full((32,), -1, dtype=torch.int32) for _ in range(4)]
    errors = []

    def rank(out):
        try:
            write_pid_kernel[(32,)](out, ITERS=20)
        except Exception as exc:  # collected: an exception in a thread would not fail the test
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(out,)) for out in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for out in outs:
        assert torch.equal(out, torch.arange(32, dtype=torch.int32))


@triton.jit
def wait_on_higher_program_kernel(flag, data, out, MAX_SPIN: tl.constexpr):
    if tl.program_id(0) == 1:  # producer: publish data, then the flag
        tl.store(data, 42)
        tl.atomic_xchg(flag, 1, sem="release", scope="gpu")
    else:  # consumer, bounded so that a failure cannot hang
        seen = tl.atomic_add(flag, 0, sem="acquire", scope="gpu")
        for _ in range(MAX_SPIN):
            if seen == 0:
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="gpu")
        tl.store(out, seen)
        tl.store(out + 1, tl.load(data, volatile=True))


def test_program_waits_on_higher_numbered_program():
    flag = torch.zeros(1, dtype=torch.int32)
    data = torch.zeros(1, dtype=torch.int32)
    out = torch.zeros(2, dtype=torch.int32)
    wait_on_higher_program_kernel[(2,)](flag, data, out, MAX_SPIN=500)
    assert out.tolist() == [1, 42]


@triton.jit
def store_ones(p, offs):  # a device function: errors raised in it reach the launcher with their own type too
    tl.store(p + offs, 1.0)


@triton.jit
def fail_while_waited_on_kernel(flag, x, victim_off, MAX_SPIN: tl.constexpr):
    if tl.program_id(0) == 0:  # waits for a flag that program 1 never sets
        seen = tl.atomic_add(flag, 0)
        for _ in range(MAX_SPIN):
            if seen == 0:
                seen = tl.atomic_add(flag, 0)
    else:
        store_ones(x + victim_off, tl.arange(0, 64))  # outside every argument


def test_failing_program_stops_the_launch():
    x, victim = torch.zeros(16), torch.zeros(64)
    start = time.monotonic()
    with pytest.raises(MemoryError, match=r"store of 64 element.*\[in program \(1, 0, 0\)\]"):
        fail_while_waited_on_kernel[(2,)](torch.zeros(1, dtype=torch.int32), x, _offset_to(victim, x), MAX_SPIN=100_000)
    assert time.monotonic() - start < 10  # program 0 was stopped, not left spinning for ~30 s


# ------------------------------------------------------------------------------------------ bounds checks
@triton.jit
def load_store_kernel(src, dst, src_off, dst_off, n, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n if MASKED else None
    tl.store(dst + dst_off + offs, tl.load(src + src_off + offs, mask=mask), mask=mask)


def test_out_of_bounds_load_raises():
    src, dst = torch.rand(16), torch.zeros(64)
    with pytest.raises(MemoryError, match=r"interpreter bounds check: load of 48 element\(s\) outside"):
        load_store_kernel[(1,)](src, dst, 0, 0, 16, BLOCK=64, MASKED=False)
    load_store_kernel[(1,)](src, dst, 0, 0, 16, BLOCK=64, MASKED=True)  # the mask keeps it in bounds
    assert torch.equal(dst[:16], src)


def test_out_of_bounds_store_raises():
    src, dst = torch.rand(64), torch.zeros(64)
    victim = torch.zeros(64)  # not an argument: a stock interpreter writes into it silently
    with pytest.raises(MemoryError, match=r"store of 64 element\(s\)") as info:
        load_store_kernel[(1,)](src, dst, 0, _offset_to(victim, dst), 64, BLOCK=64, MASKED=False)
    assert "program (0, 0, 0)" in str(info.value)
    assert torch.count_nonzero(victim) == 0


@triton.jit
def descriptor_load_kernel(src, dst, N: tl.constexpr):
    desc = tl.make_tensor_descriptor(src, shape=[N], strides=[1], block_shape=[N])
    tl.store(dst + tl.arange(0, N), desc.load([0]))


def test_out_of_bounds_descriptor_load_raises():
    src, dst = torch.rand(16), torch.zeros(64)
    with pytest.raises(MemoryError, match="load of 48 element"):
        descriptor_load_kernel[(1,)](src, dst, N=64)


@triton.jit
def put_to_peers_kernel(table, src, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    peer = tl.load(table + pid).to(tl.pointer_type(tl.float32))  # raw address of a peer heap
    offs = tl.arange(0, BLOCK)
    tl.store(peer + offs, tl.load(src + offs))


def test_registered_buffers_via_address_table():
    peers = [torch.zeros(32) for _ in range(3)]
    src = torch.rand(32)
    table = torch.tensor([p.data_ptr() for p in peers], dtype=torch.int64)
    for p in peers:
        pki.register_buffer(p)
    pki.register_buffer(peers[2])  # registering the same storage twice is fine
    try:
        put_to_peers_kernel[(3,)](table, src, BLOCK=32)
        assert all(torch.equal(p, src) for p in peers)
        pki.unregister_buffer(peers[2])  # still registered once
        put_to_peers_kernel[(3,)](table, src, BLOCK=32)
    finally:
        for p in peers:
            pki.unregister_buffer(p)
    with pytest.raises(MemoryError, match="store of 32 element") as info:
        put_to_peers_kernel[(3,)](table, src, BLOCK=32)
    assert "program (" in str(info.value)
    with pytest.raises(ValueError, match="not registered"):
        pki.unregister_buffer(peers[0])


# -------------------------------------------------------------------------------------------------- bf16
@triton.jit
def bf16_math_kernel(a, b, c, out, N: tl.constexpr):
    offs = tl.arange(0, N)
    x, y, z = tl.load(a + offs), tl.load(b + offs), tl.load(c + offs)
    tl.store(out + offs, x * y + z)
    tl.store(out + N + offs, x / y)
    tl.store(out + 2 * N + offs, tl.fma(x, y, z))
    tl.store(out + 3 * N + offs, tl.where(x < y, tl.maximum(-x, z), x - y))
    tl.store(out + 4 * N + offs, tl.exp(x.to(tl.float32)).to(tl.bfloat16))  # tl.exp itself rejects bf16


def test_bf16_elementwise():
    a, b, c = rand_bf16(128, seed=1), rand_bf16(128, seed=2), rand_bf16(128, seed=3)
    out = torch.empty(5, 128, dtype=torch.bfloat16)
    bf16_math_kernel[(1,)](a, b, c, out, N=128)
    x, y, z = a.double(), b.double(), c.double()
    torch.testing.assert_close(out[0].double(), x * y + z, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out[1].double(), x / y, rtol=8e-3, atol=0)
    torch.testing.assert_close(out[2].double(), x * y + z, rtol=8e-3, atol=1e-2)
    torch.testing.assert_close(out[3].double(), torch.where(x < y, torch.maximum(-x, z), x - y), rtol=8e-3, atol=0)
    torch.testing.assert_close(out[4].double(), torch.exp(x), rtol=8e-3, atol=0)
    # one bf16 op is float32 math rounded to nearest even, as torch does it
    assert torch.equal(out[1], a / b) and torch.equal(out[4], torch.exp(a.float()).to(torch.bfloat16))


@triton.jit
def bf16_reduce_kernel(x, sums, maxs, argmaxs, mins, N: tl.constexpr):
    offs = tl.arange(0, N)
    v = tl.load(x + offs[:, None] * N + offs[None, :])
    tl.store(sums + offs, tl.sum(v, axis=1))
    m, i = tl.max(v, axis=1, return_indices=True)
    tl.store(maxs + offs, m)
    tl.store(argmaxs + offs, i)
    tl.store(mins + offs, tl.min(v * v, axis=1))


def test_bf16_reductions():
    x = rand_bf16(32, 32, seed=4)
    sums, maxs, mins = (torch.empty(32, dtype=torch.bfloat16) for _ in range(3))
    argmaxs = torch.empty(32, dtype=torch.int32)
    bf16_reduce_kernel[(1,)](x, sums, maxs, argmaxs, mins, N=32)
    x64 = x.double()
    torch.testing.assert_close(sums.double(), x64.sum(1), rtol=1e-2, atol=4e-2)
    assert torch.equal(maxs, x.max(1).values)
    assert torch.equal(argmaxs.long(), x64.argmax(1))
    torch.testing.assert_close(mins.double(), (x64 * x64).min(1).values, rtol=8e-3, atol=0)


@triton.jit
def bf16_dot_kernel(a, b, c, N: tl.constexpr):
    offs = tl.arange(0, N)
    idx = offs[:, None] * N + offs[None, :]
    acc = tl.zeros((N, N), tl.float32)
    acc = tl.dot(tl.load(a + idx), tl.load(b + idx), acc)
    tl.store(c + idx, acc)


def test_bf16_dot():
    a, b = rand_bf16(64, 64, seed=5), rand_bf16(64, 64, seed=6)
    c = torch.empty(64, 64)
    bf16_dot_kernel[(1,)](a, b, c, N=64)
    torch.testing.assert_close(c.double(), a.double() @ b.double(), rtol=1e-4, atol=1e-4)


@triton.jit
def bf16_cast_kernel(f32_in, i32_in, bf_in, to_bf, from_int, to_f16, to_int, to_f32, N: tl.constexpr):
    offs = tl.arange(0, N)
    f, i, h = tl.load(f32_in + offs), tl.load(i32_in + offs), tl.load(bf_in + offs)
    tl.store(to_bf + offs, f.to(tl.bfloat16))
    tl.store(from_int + offs, i.to(tl.bfloat16))
    tl.store(to_f16 + offs, h.to(tl.float16))
    tl.store(to_int + offs, (h * 100).to(tl.int32))
    tl.store(to_f32 + offs, h.to(tl.float32))


def test_bf16_casts():
    g = torch.Generator().manual_seed(7)
    f32 = torch.randn(128, generator=g) * 100
    i32 = torch.randint(-100000, 100000, (128,), generator=g, dtype=torch.int32)
    bf = rand_bf16(128, seed=8)
    to_bf, from_int = torch.empty(128, dtype=torch.bfloat16), torch.empty(128, dtype=torch.bfloat16)
    to_f16, to_int, to_f32 = (
        torch.empty(128, dtype=torch.float16),
        torch.empty(128, dtype=torch.int32),
        torch.empty(128),
    )
    bf16_cast_kernel[(1,)](f32, i32, bf, to_bf, from_int, to_f16, to_int, to_f32, N=128)
    assert torch.equal(to_bf, f32.to(torch.bfloat16))  # round to nearest even
    assert torch.equal(from_int, i32.to(torch.bfloat16))
    assert torch.equal(to_f16, bf.to(torch.float16))
    assert torch.equal(to_int, (bf * 100).to(torch.int32))
    assert torch.equal(to_f32, bf.float())


@triton.jit
def bf16_atomic_add_kernel(acc, vals, N: tl.constexpr, SLOTS: tl.constexpr):
    offs = tl.arange(0, N)
    v = tl.load(vals + tl.program_id(0) * N + offs)
    tl.atomic_add(acc + offs % SLOTS, v, sem="relaxed")  # N / SLOTS lanes collide on each slot


def test_bf16_atomic_add_pointer():
    vals = rand_bf16(8, 64, seed=9)
    acc = torch.ones(16, dtype=torch.bfloat16)
    bf16_atomic_add_kernel[(8,)](acc, vals, N=64, SLOTS=16)
    expected = 1 + vals.double().reshape(8, 4, 16).sum((0, 1))
    torch.testing.assert_close(acc.double(), expected, rtol=0, atol=0.25)  # 32 bf16 roundings of values < 64


@triton.jit
def bf16_count_kernel(acc, N: tl.constexpr, ITERS: tl.constexpr):
    for _ in range(ITERS):
        tl.atomic_add(acc + tl.arange(0, N), tl.full((N,), 1.0, tl.bfloat16))


def _count_in_child(acc):
    bf16_count_kernel[(4,)](acc, N=8, ITERS=20)


def test_bf16_atomic_add_is_atomic_across_processes():
    acc = torch.zeros(8, dtype=torch.bfloat16).share_memory_()  # adjacent bf16 share 32-bit words too
    children = [multiprocessing.get_context("fork").Process(target=_count_in_child, args=(acc,)) for _ in range(2)]
    for child in children:
        child.start()
    _count_in_child(acc)
    for child in children:
        child.join(30)
    assert [c.exitcode for c in children] == [0, 0]
    assert acc.tolist() == [240.0] * 8  # 3 processes x 4 programs x 20 adds, exact in bf16 (no lost updates)


@triton.jit
def descriptor_atomic_add_kernel(acc, vals, M, N: tl.constexpr, BM: tl.constexpr):
    desc = tl.make_tensor_descriptor(acc, shape=[M, N], strides=[N, 1], block_shape=[BM, N])
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    v = tl.load(vals + rows[:, None] * N + tl.arange(0, N)[None, :])
    desc.atomic_add([tl.program_id(0) * BM, 0], v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_descriptor_atomic_add(dtype):
    M, N, BM = 24, 32, 16  # the second block hangs over the end: its masked-off rows are neither added nor checked
    vals = rand_bf16(2 * BM, N, seed=10).to(dtype)
    acc = rand_bf16(M, N, seed=11).to(dtype)
    expected = acc.double() + vals[:M].double()
    for _ in range(2):  # two launches of two programs
        descriptor_atomic_add_kernel[(2,)](acc, vals, M, N=N, BM=BM)
    expected += vals[:M].double()
    torch.testing.assert_close(acc.double(), expected, rtol=1e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------------- inline asm
@triton.jit
def asm_kernel(x, out, smid, N: tl.constexpr, ASM: tl.constexpr, ASM0: tl.constexpr):
    offs = tl.arange(0, N)
    v = tl.inline_asm_elementwise(ASM, "=r,l", [x + offs], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(out + offs, v)
    tl.store(smid, tl.inline_asm_elementwise(ASM0, "=r", [], dtype=tl.int32, is_pure=True, pack=1))


def test_register_asm():
    pki.register_asm(LD_RELAXED, lambda ptrs: pki.read_memory(ptrs, np.int32))
    pki.register_asm(SMID, lambda: np.array(7))
    try:
        x = torch.randint(1, 1 << 30, (64,), dtype=torch.int32)
        out, smid = torch.zeros(64, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        asm_kernel[(1,)](x, out, smid, N=64, ASM=LD_RELAXED, ASM0=SMID)
        assert torch.equal(out, x) and smid.item() == 7
        with pytest.raises(NotImplementedError, match="unknown.asm"):
            asm_kernel[(1,)](x, out, smid, N=64, ASM="unknown.asm $0, [$1];", ASM0=SMID)
    finally:
        pki.unregister_asm(LD_RELAXED)
        pki.unregister_asm(SMID)


# ------------------------------------------------------------------------------------------- device_assert
@triton.jit
def assert_kernel(x, N: tl.constexpr):
    tl.device_assert(tl.load(x + tl.arange(0, N)) < 0, "x must be negative")


def test_device_assert_raises():
    assert_kernel[(1,)](-torch.rand(16) - 1, N=16)
    with pytest.raises(AssertionError, match="x must be negative"):
        assert_kernel[(2,)](torch.rand(16) + 1, N=16)


# ------------------------------------------------------------------------------------------ install/uninstall
def test_uninstall_restores_the_interpreter():
    from triton.runtime import interpreter as interp

    pki.install()  # idempotent
    patched_call = interp.GridExecutor.__call__
    pki.uninstall()
    try:
        assert not pki.is_installed()
        assert interp.GridExecutor.__call__ is not patched_call
        assert "grid_idx" not in vars(interp.InterpreterBuilder)
        assert not hasattr(interp.InterpreterBuilder, "create_descriptor_reduce")
        assert not interp.interpreter_builder.options.debug
    finally:
        pki.install()
    assert pki.is_installed() and interp.GridExecutor.__call__ is patched_call

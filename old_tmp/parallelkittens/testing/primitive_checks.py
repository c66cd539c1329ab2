"""Self-checks of the eight primitives (and `load`), run inside a rank: by the tests, by `python -m
parallelkittens demo` and by the GPU suite. Each draws fresh data shared by seed, poisons its outputs first,
and compares with a PyTorch reference: bit-exact for data movement, by relative error for sums."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import language as pkl
from ..ops.barrier import barrier
from ..runtime.context import context, sync
from ..runtime.errors import WaitTimeoutError
from ..runtime.memory import empty, zeros
from . import TOLERANCE, CheckResult, Timer, first_mismatch, poison, rank_data, relative_error, shared_seed

N = 1000  # elements per rank: not a multiple of BLOCK, so masks matter
BLOCK = 256
MOVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _load_kernel(x_ptr, h, out_ptr, n, shift, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    peer = (pkl.rank(h) + shift) % pkl.world_size(h)
    tl.store(out_ptr + offs, pkl.load(x_ptr + offs, h, peer, mask), mask=mask)


@triton.jit
def _store_kernel(src_ptr, y_ptr, h, n, shift, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    me = pkl.rank(h)
    peer = (me + shift) % pkl.world_size(h)
    pkl.store(y_ptr + me * n + offs, tl.load(src_ptr + offs, mask=mask), h, peer, mask)


@triton.jit
def _store_add_kernel(src_ptr, acc_ptr, h, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    value = tl.load(src_ptr + offs, mask=mask)
    for r in range(pkl.world_size(h)):
        pkl.store_add(acc_ptr + offs, value, h, r, mask)


@triton.jit
def _reduce_kernel(out_ptr, x_ptr, h, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    pkl.reduce(out_ptr + offs, x_ptr + offs, h, offs < n)


@triton.jit
def _all_reduce_kernel(x_ptr, h, n, BLOCK: tl.constexpr):
    tile = tl.program_id(0)
    if tile % pkl.world_size(h) == pkl.rank(h):  # each tile belongs to one rank
        offs = tile * BLOCK + tl.arange(0, BLOCK)
        pkl.all_reduce(x_ptr + offs, h, offs < n)


@triton.jit
def _signal_wait_kernel(src_ptr, inbox_ptr, h, flags_ptr, hf, out_ptr, n, BLOCK: tl.constexpr):
    tile = tl.program_id(0)
    offs = tile * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    me = pkl.rank(h)
    nxt = (me + 1) % pkl.world_size(h)
    pkl.store(inbox_ptr + offs, tl.load(src_ptr + offs, mask=mask), h, nxt, mask)
    pkl.signal(flags_ptr + tile, hf, nxt)
    pkl.wait(flags_ptr + tile, 1, hf)
    tl.store(out_ptr + offs, tl.load(inbox_ptr + offs, mask=mask), mask=mask)


@triton.jit
def _signal_all_kernel(flags_ptr, hf):
    pkl.signal_all(flags_ptr, hf, 1)
    pkl.wait(flags_ptr, pkl.world_size(hf), hf)


@triton.jit
def _barrier_rounds_kernel(slots_ptr, h, counter_ptr, hc, errors_ptr, ROUNDS: tl.constexpr, WORLD_P2: tl.constexpr):
    me = pkl.rank(h)
    world = pkl.world_size(h)
    ranks = tl.arange(0, WORLD_P2)
    bad = tl.zeros([WORLD_P2], tl.int32)
    for i in range(ROUNDS):
        for r in range(world):
            pkl.store(slots_ptr + me, i + 1, h, r)
        pkl.barrier_all(counter_ptr, hc)
        seen = tl.load(slots_ptr + ranks, mask=ranks < world, other=i + 1, volatile=True)
        bad += (seen != i + 1).to(tl.int32)
        pkl.barrier_all(counter_ptr, hc)  # nobody writes round i+1 before everyone has read round i
    tl.store(errors_ptr + ranks, bad, mask=ranks < world)


@triton.jit
def _wait_forever_kernel(flags_ptr, hf):
    pkl.wait(flags_ptr + 3, 7, hf)


@triton.jit
def _tma_kernel(src_ptr, y_ptr, h, M, N, ADD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    me = pkl.rank(h)
    src = tl.make_tensor_descriptor(src_ptr, [M, N], [N, 1], [BM, BN])
    tile = src.load([pid_m * BM, pid_n * BN])
    if ADD:
        for r in range(pkl.world_size(h)):
            dst = pkl.peer_descriptor(y_ptr, h, r, [M, N], [N, 1], [BM, BN])
            dst.atomic_add([pid_m * BM, pid_n * BN], tile)
    else:
        peer = (me + 1) % pkl.world_size(h)
        dst = pkl.peer_descriptor(y_ptr, h, peer, [M, N], [N, 1], [BM, BN])
        dst.store([pid_m * BM, pid_n * BN], tile)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK),)


def _result(op: str, shape, error: float, ok: bool, ms: float, detail: str = "") -> CheckResult:
    return CheckResult(op, "x".join(map(str, shape)) if isinstance(shape, tuple) else str(shape), error, ok, ms,
                       detail)


def _move(op: str, checks: list[tuple[torch.dtype, str | None]], ms: float, shape=(N,)) -> CheckResult:
    failures = [f"{dtype}: {msg}" for dtype, msg in checks if msg]
    return _result(op, shape, 0.0 if not failures else float("inf"), not failures, ms, "; ".join(failures))


def check_load() -> CheckResult:
    """Every rank reads the next rank's buffer."""
    ctx, seed, checks = context(), shared_seed(), []
    with Timer() as t:
        for dtype in MOVE_DTYPES:
            x = empty(N, dtype, name="x")
            x.local.copy_(rank_data(N, dtype, seed, ctx.local_rank))
            out = poison(torch.empty(N, dtype=dtype, device=ctx.device))
            barrier()
            _load_kernel[_grid(N)](x.local, x.handle, out, N, 1, BLOCK=BLOCK)
            expected = rank_data(N, dtype, seed, (ctx.local_rank + 1) % ctx.local_world_size)
            checks.append((dtype, first_mismatch(out, expected)))
            barrier()
            x.free()
    return _move("pkl.load", checks, t.ms)


def check_store() -> CheckResult:
    """Every rank writes its data into its own slot of the next rank's buffer; other slots stay untouched."""
    ctx, seed, checks = context(), shared_seed(), []
    world, me = ctx.local_world_size, ctx.local_rank
    with Timer() as t:
        for dtype in MOVE_DTYPES:
            y = empty((world, N), dtype, name="y")
            poison(y.local)
            src = rank_data(N, dtype, seed, me)
            barrier()  # every rank poisoned before anyone writes
            _store_kernel[_grid(N)](src, y.local, y.handle, N, 1, BLOCK=BLOCK)
            barrier()
            expected = poison(torch.empty((world, N), dtype=dtype, device=ctx.device))
            prev = (me - 1) % world
            expected[prev] = rank_data(N, dtype, seed, prev)
            checks.append((dtype, first_mismatch(y.local, expected)))
            y.free()
    return _move("pkl.store", checks, t.ms, (world, N))


def check_store_add() -> CheckResult:
    """Every rank atomically adds its data into every rank's accumulator."""
    ctx, seed = context(), shared_seed()
    world, me = ctx.local_world_size, ctx.local_rank
    errors, details = [], []
    with Timer() as t:
        for dtype in (torch.float32, torch.bfloat16):
            acc = empty(N, dtype, name="acc")
            start = rank_data(N, dtype, seed + 1, me)
            acc.local.copy_(start)
            barrier()
            _store_add_kernel[_grid(N)](rank_data(N, dtype, seed, me), acc.local, acc.handle, N, BLOCK=BLOCK)
            barrier()
            ref = start.double() + sum(rank_data(N, dtype, seed, r).double() for r in range(world))
            # one rounding per addition in the accumulator's dtype
            err = relative_error(acc.local, ref)
            errors.append(err)
            if not err <= TOLERANCE[dtype] * world:
                details.append(f"{dtype}: relative error {err:.2e}")
            acc.free()
    return _result("pkl.store_add", (N,), max(errors), not details, t.ms, "; ".join(details))


def check_reduce() -> CheckResult:
    """Every rank sums the tile over all ranks into a local output."""
    ctx, seed = context(), shared_seed()
    world, me = ctx.local_world_size, ctx.local_rank
    errors, details = [], []
    with Timer() as t:
        for dtype in MOVE_DTYPES:
            x = empty(N, dtype, name="x")
            x.local.copy_(rank_data(N, dtype, seed, me))
            out = poison(torch.empty(N, dtype=dtype, device=ctx.device))
            barrier()
            _reduce_kernel[_grid(N)](out, x.local, x.handle, N, BLOCK=BLOCK)
            ref = sum(rank_data(N, dtype, seed, r).double() for r in range(world))
            err = relative_error(out, ref)
            errors.append(err)
            if not err <= TOLERANCE[dtype]:
                details.append(f"{dtype}: relative error {err:.2e}")
            barrier()
            x.free()
    return _result("pkl.reduce", (N,), max(errors), not details, t.ms, "; ".join(details))


def check_all_reduce() -> CheckResult:
    """Tiles are split among ranks; each owner writes the sum of its tiles to every rank."""
    ctx, seed = context(), shared_seed()
    world, me = ctx.local_world_size, ctx.local_rank
    errors, details = [], []
    with Timer() as t:
        for dtype in MOVE_DTYPES:
            x = empty(N, dtype, name="x")
            x.local.copy_(rank_data(N, dtype, seed, me))
            barrier()
            _all_reduce_kernel[_grid(N)](x.local, x.handle, N, BLOCK=BLOCK)
            barrier()
            ref = sum(rank_data(N, dtype, seed, r).double() for r in range(world))
            err = relative_error(x.local, ref)
            errors.append(err)
            if not err <= TOLERANCE[dtype]:
                details.append(f"{dtype}: relative error {err:.2e}")
            x.free()
    return _result("pkl.all_reduce", (N,), max(errors), not details, t.ms, "; ".join(details))


def check_signal_wait() -> CheckResult:
    """Each rank pushes tiles to the next rank and signals per tile; the receiver waits per tile, then reads."""
    ctx, seed = context(), shared_seed()
    world, me = ctx.local_world_size, ctx.local_rank
    num_tiles = triton.cdiv(N, BLOCK)
    with Timer() as t:
        inbox = empty(N, torch.float32, name="inbox")
        flags = zeros(num_tiles, torch.int32, name="flags")
        poison(inbox.local)
        out = poison(torch.empty(N, device=ctx.device))
        barrier()
        _signal_wait_kernel[(num_tiles,)](rank_data(N, torch.float32, seed, me), inbox.local, inbox.handle,
                                          flags.local, flags.handle, out, N, BLOCK=BLOCK)
        sync()
    msgs = [first_mismatch(out, rank_data(N, torch.float32, seed, (me - 1) % world)),
            first_mismatch(flags.local, torch.ones(num_tiles, dtype=torch.int32))]
    detail = "; ".join(m for m in msgs if m)
    inbox.free()
    flags.free()
    return _result("signal+wait", (N,), 0.0 if not detail else float("inf"), not detail, t.ms, detail)


def check_signal_all() -> CheckResult:
    """Each rank signals every rank once and waits for the count to reach the world size; it stays there."""
    ctx = context()
    with Timer() as t:
        flags = zeros(1, torch.int32, name="flags")
        _signal_all_kernel[(1,)](flags.local, flags.handle)
        sync()
    detail = first_mismatch(flags.local, torch.full((1,), ctx.local_world_size, dtype=torch.int32)) or ""
    flags.free()
    return _result("signal_all", (1,), 0.0 if not detail else float("inf"), not detail, t.ms, detail)


def check_barrier_all(rounds: int = 100) -> CheckResult:
    """`rounds` round trips through one self-resetting barrier counter, every round checking that every rank's
    write of that round is visible everywhere; the counter must end at zero."""
    ctx = context()
    world = ctx.local_world_size
    with Timer() as t:
        slots = zeros(world, torch.int32, name="slots")
        counter = zeros(1, torch.int32, name="barrier")
        errors = poison(torch.empty(world, dtype=torch.int32, device=ctx.device))
        _barrier_rounds_kernel[(1,)](slots.local, slots.handle, counter.local, counter.handle, errors,
                                     ROUNDS=rounds, WORLD_P2=triton.next_power_of_2(world))
        sync()
    msgs = [first_mismatch(errors, torch.zeros(world, dtype=torch.int32)),
            first_mismatch(counter.local, torch.zeros(1, dtype=torch.int32))]
    detail = "; ".join(m for m in msgs if m)
    slots.free()
    counter.free()
    return _result(f"barrier_all x{rounds}", (world,), 0.0 if not detail else float("inf"), not detail, t.ms, detail)


def check_wait_timeout() -> CheckResult:
    """A wait that can never be met must end in a WaitTimeoutError naming rank, counter, index, seen, expected.
    Needs PK_DEBUG=1; without it the check reports itself as skipped (passing)."""
    ctx = context()
    if not ctx.debug:
        return _result("wait timeout", (8,), 0.0, True, 0.0, "skipped: PK_DEBUG is not 1")
    flags = zeros(8, torch.int32, name="flags")
    flags.set_wait_timeout(1.0)
    message = ""
    with Timer() as t:
        _wait_forever_kernel[(1,)](flags.local, flags.handle)
        try:
            sync()
        except WaitTimeoutError as e:
            message = str(e)
    expected = [f"rank {ctx.local_rank}", "'flags'[3]", "saw 0", "expected 7"]
    missing = [s for s in expected if s not in message]
    detail = f"message {message!r} lacks {missing}" if missing else ""
    flags.free()
    return _result("wait timeout", (8,), 0.0 if not detail else float("inf"), not detail, t.ms, detail)


def check_tma() -> CheckResult:
    """Bulk tiles through tensor descriptors on a peer's buffer: store to the next rank, atomic add to all."""
    ctx, seed = context(), shared_seed()
    world, me = ctx.local_world_size, ctx.local_rank
    M, Ncols, BM, BN = 96, 80, 64, 64  # ragged on both axes: the descriptor clips the edge tiles
    grid = (triton.cdiv(M, BM), triton.cdiv(Ncols, BN))
    details, errors = [], [0.0]
    with Timer() as t:
        for dtype in (torch.float32, torch.bfloat16):
            y = empty((M, Ncols), dtype, name="y")
            poison(y.local)
            barrier()
            _tma_kernel[grid](rank_data((M, Ncols), dtype, seed, me), y.local, y.handle, M, Ncols, ADD=False,
                              BM=BM, BN=BN)
            barrier()
            msg = first_mismatch(y.local, rank_data((M, Ncols), dtype, seed, (me - 1) % world))
            if msg:
                details.append(f"store {dtype}: {msg}")
            y.local.copy_(rank_data((M, Ncols), dtype, seed + 1, me))
            barrier()
            _tma_kernel[grid](rank_data((M, Ncols), dtype, seed, me), y.local, y.handle, M, Ncols, ADD=True,
                              BM=BM, BN=BN)
            barrier()
            ref = rank_data((M, Ncols), dtype, seed + 1, me).double() + sum(
                rank_data((M, Ncols), dtype, seed, r).double() for r in range(world))
            err = relative_error(y.local, ref)
            errors.append(err)
            if not err <= TOLERANCE[dtype] * world:
                details.append(f"store_add {dtype}: relative error {err:.2e}")
            y.free()
    return _result("tma store/store_add", (M, Ncols), max(errors), not details, t.ms, "; ".join(details))


CHECKS = {
    "load": check_load,
    "store": check_store,
    "store_add": check_store_add,
    "reduce": check_reduce,
    "all_reduce": check_all_reduce,
    "signal_wait": check_signal_wait,
    "signal_all": check_signal_all,
    "barrier_all": check_barrier_all,
    "wait_timeout": check_wait_timeout,
    "tma": check_tma,
}


def run_checks(names: list[str] | None = None) -> list[CheckResult]:
    """Run the named checks (all by default) on this rank, in order; every rank must run the same list."""
    return [CHECKS[name]() for name in (names or list(CHECKS))]

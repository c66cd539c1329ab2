"""Collectives against torch.distributed on gloo as the oracle: every op, dtype and dim, odd shapes, world
sizes 1 to 8; back-to-back calls; bad input on every rank."""

import os

import pytest
import torch
import torch.distributed as dist
from conftest import worlds

import parallelkittens as pk
from parallelkittens.ops.collectives.all_reduce import algorithm
from parallelkittens.testing import TOLERANCE, first_mismatch, rank_data, relative_error, shared_seed

FP8 = getattr(torch, "float8_e4m3fn", None)


def _gloo_all_gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    ctx = pk.context()
    parts = [torch.empty_like(x, device="cpu") for _ in range(ctx.world_size)]
    dist.all_gather(parts, x.cpu().contiguous(), group=ctx.cpu_group)
    return torch.cat(parts, dim)


def _gloo_sum(x: torch.Tensor) -> torch.Tensor:
    total = x.detach().cpu().double()
    dist.all_reduce(total, group=pk.context().cpu_group)
    return total


def _gloo_all_to_all(x: torch.Tensor, sd: int, gd: int) -> torch.Tensor:
    # gloo has no alltoall in every torch (2.11 lacks it): gather everything, keep what this rank receives
    ctx = pk.context()
    inputs = [torch.empty_like(x, device="cpu") for _ in range(ctx.world_size)]
    dist.all_gather(inputs, x.cpu().contiguous(), group=ctx.cpu_group)
    return torch.cat([t.chunk(ctx.world_size, dim=sd)[ctx.rank] for t in inputs], dim=gd)


def _check_all(world: int) -> list[str]:
    """Every case on this rank; returns the failures (an empty list when all pass)."""
    ctx = pk.context()
    me, failures = ctx.rank, []
    seed = shared_seed()

    def fail(what: str, msg: str | None) -> None:
        if msg:
            failures.append(f"{what}: {msg}")

    move_dtypes = [torch.float32, torch.bfloat16, torch.float16] + ([FP8] if FP8 else []) + [torch.int32]
    for dtype in move_dtypes:
        for shape in [(7,), (3, 5, 6), (2, 1, 9)]:
            base = (rank_data(shape, torch.float32, seed, me).to(dtype) if dtype != torch.int32 else
                    rank_data(shape, dtype, seed, me))
            for dim in range(len(shape)):
                fail(f"all_gather {dtype} {shape} dim {dim}",
                     first_mismatch(pk.ops.all_gather(base, dim), _gloo_all_gather(base.view(torch.uint8)
                                    if dtype == FP8 else base, dim).view(dtype)))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for shape in [(world * 3,), (2, world * 5, 3), (world, 7)]:
            x = rank_data(shape, dtype, seed + 1, me)
            total = _gloo_sum(x)
            for dim in [d for d in range(len(shape)) if shape[d] % world == 0]:
                err = relative_error(pk.ops.reduce_scatter(x, dim), total.chunk(world, dim)[me])
                if not err <= TOLERANCE[dtype]:
                    fail(f"reduce_scatter {dtype} {shape} dim {dim}", f"relative error {err:.2e}")
        for n in (1, 33, 1000, 70_001):  # 70 001 fp32 elements take the two-shot path
            x = rank_data((n,), dtype, seed + 2, me)
            total = _gloo_sum(x)
            err = relative_error(pk.ops.all_reduce(x), total)
            if not err <= TOLERANCE[dtype]:
                fail(f"all_reduce {dtype} n={n} ({algorithm(n * x.element_size(), world)})", f"error {err:.2e}")
    for shape in [(5, 13), (70_001,)]:  # one-shot and two-shot, in place on a parallel tensor read by peers
        pt = pk.empty(shape, torch.float32, name="in_place")
        pt.local.copy_(rank_data(shape, torch.float32, seed + 3, me))
        total = _gloo_sum(pt.local)
        pk.sync()
        err = relative_error(pk.ops.all_reduce(pt), total)
        if not err <= TOLERANCE[torch.float32]:
            fail(f"all_reduce in place {shape}", f"relative error {err:.2e}")
        pt.free()
    for n in (100, 70_001):  # a plain tensor into itself: the kernel stages it before writing over it
        x = rank_data((n,), torch.float32, seed + 5, me)
        total = _gloo_sum(x)
        err = relative_error(pk.ops.all_reduce(x, out=x), total)
        if not err <= TOLERANCE[torch.float32]:
            fail(f"all_reduce out=x n={n}", f"relative error {err:.2e}")
    # more tiles than programs, each program staging its tiles for every reader
    x = rank_data((world * 20_000,), torch.float32, seed + 6, me)
    err = relative_error(pk.ops.reduce_scatter(x), _gloo_sum(x).chunk(world)[me])
    if not err <= TOLERANCE[torch.float32]:
        fail("reduce_scatter of 5 tiles per rank", f"relative error {err:.2e}")
    x = rank_data((world * 5, 4096), torch.float32, seed + 7, me)
    fail("all_to_all of 5 tiles per rank", first_mismatch(pk.ops.all_to_all(x, 0, 0), _gloo_all_to_all(x, 0, 0)))
    fail("all_gather of 5 tiles", first_mismatch(pk.ops.all_gather(x[:5], 0), _gloo_all_gather(x[:5], 0)))
    for dtype in (torch.float32, torch.bfloat16):
        for shape, sd, gd in [((2, 3, world * 2, 4), 2, 1), ((world * 3, 5), 0, 1), ((4, world), 1, 0),
                              ((world * 2, 3), 0, 0)]:
            x = rank_data(shape, dtype, seed + 4, me)
            fail(f"all_to_all {dtype} {shape} {sd}->{gd}", first_mismatch(pk.ops.all_to_all(x, sd, gd),
                                                                          _gloo_all_to_all(x, sd, gd)))
    pk.sync()
    return failures


_results: dict = {}


@pytest.mark.parametrize("world", worlds())
def test_collectives_match_gloo(world):
    for rank, failures in enumerate(pk.spawn(_check_all, world, world, timeout=900)):
        assert not failures, f"rank {rank}: " + "\n".join(failures)


def _back_to_back_launching(calls: int, fast: bool) -> list[str]:
    bad = _back_to_back(calls)
    # how often each plan's kernel went through Triton's launch path (`Launcher.launches`): the first call only,
    # where later calls go straight to the compiled kernel; every call with PK_FAST_LAUNCH=0
    counts = {key[0]: p._pull.launch.launches for key, p in pk.context().plans.items()
              if key[0] in ("all_gather", "all_reduce")}
    wrong = {op: n for op, n in counts.items() if (n != 1 if fast else n <= 1)}
    return bad + ([f"launches through Triton's path: {wrong}"] if wrong or not counts else [])


@pytest.mark.gpu
@pytest.mark.parametrize("fast", ["0", "1"])
def test_direct_launch_gives_the_same_results(monkeypatch, fast):
    monkeypatch.setenv("PK_FAST_LAUNCH", fast)  # runtime/launch.py: compiled kernels launched again directly
    for rank, bad in enumerate(pk.spawn(_back_to_back_launching, 2, 200, fast == "1")):
        assert not bad, f"rank {rank}: {bad[:5]}"


def _back_to_back(calls: int) -> list[str]:
    ctx = pk.context()
    seed = shared_seed()
    x = rank_data((64,), torch.float32, seed, ctx.rank)
    first_sum, first_gather = pk.ops.all_reduce(x), pk.ops.all_gather(x)
    bad = []
    for i in range(calls):
        if i % 2:
            out, ref = pk.ops.all_gather(x), first_gather
        else:
            out, ref = pk.ops.all_reduce(x), first_sum
        if not torch.equal(out, ref):
            bad.append(f"call {i} differs")
    pk.sync()
    return bad


def test_back_to_back_calls_do_not_hang_and_agree():
    calls = int(os.environ.get("PK_TEST_CALLS", "1000"))
    for rank, bad in enumerate(pk.spawn(_back_to_back, 2, calls, timeout=900)):
        assert not bad, f"rank {rank}: {bad[:5]}"


def _expect(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
        pk.sync()
    except pk.PKError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _bad_inputs() -> dict:
    ctx = pk.context()
    me, world = ctx.rank, ctx.world_size
    x = torch.ones(world * 4, 6, device=ctx.device)
    return {
        "shape": _expect(pk.ops.all_gather, torch.ones(3 + me, device=ctx.device)),
        "dtype": _expect(pk.ops.all_reduce, torch.ones(8, device=ctx.device,
                                                       dtype=torch.float16 if me == 1 else torch.float32)),
        "dim": _expect(pk.ops.all_gather, x, me % 2),
        "strided": _expect(pk.ops.all_gather, x.t()),
        "int sum": _expect(pk.ops.all_reduce, torch.ones(8, dtype=torch.int32, device=ctx.device)),
        "indivisible": _expect(pk.ops.reduce_scatter, torch.ones(world * 4 + 1, device=ctx.device)),
        "op": _expect(pk.ops.all_reduce, x, op="max"),
        "bad dim": _expect(pk.ops.all_to_all, x, 5, 0),
        "after": _expect(pk.ops.all_reduce, x),  # the op still works after all of the above
    }


def test_bad_input_fails_on_every_rank():
    for rank, msgs in enumerate(pk.spawn(_bad_inputs, 2)):
        assert "ranks called it differently" in msgs["shape"] and "(3,)" in msgs["shape"], (rank, msgs["shape"])
        assert "MismatchError" in msgs["dtype"] and "MismatchError" in msgs["dim"], (rank, msgs)
        assert "must be contiguous" in msgs["strided"]
        assert "dtype torch.int32 is not supported" in msgs["int sum"]
        assert "does not divide by the world size 2" in msgs["indivisible"]
        assert "only 'sum'" in msgs["op"] and "out of range" in msgs["bad dim"]
        assert msgs["after"] == "no error", (rank, msgs["after"])


def _device_side_mismatch() -> str:
    """Plans built on every rank, then called differently: the kernel itself must notice, finish, and report on
    every rank."""
    ctx = pk.context()
    small, large = torch.ones(4, device=ctx.device), torch.ones(6, device=ctx.device)
    pk.ops.all_gather(small), pk.ops.all_gather(large)
    pk.sync()
    try:
        out = pk.ops.all_gather(small if ctx.rank == 0 else large)
        del out
        pk.sync()
    except pk.PKError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_device_side_mismatch_is_reported_not_hung():
    for msg in pk.spawn(_device_side_mismatch, 3):
        assert msg.startswith("MismatchError") and "all_gather with (4,)" in msg and "(6,)" in msg, msg


def _compiled() -> list[str]:
    ctx = pk.context()
    x = rank_data((64,), torch.float32, shared_seed(), ctx.rank)
    failures = []
    for name, fn in [("all_reduce", lambda t: pk.ops.all_reduce(t) * 2),
                     ("all_gather", lambda t: pk.ops.all_gather(t) * 2),
                     ("reduce_scatter", lambda t: pk.ops.reduce_scatter(t) * 2),
                     ("all_to_all", lambda t: pk.ops.all_to_all(t.view(8, 8), 0, 1) * 2)]:
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
        if not torch.equal(compiled(x), fn(x)):
            failures.append(f"{name}: the compiled call differs from the eager one")
    pk.sync()
    return failures


def test_collectives_trace_with_torch_compile():
    """Every collective is a torch custom op (declared with its plan): torch.compile(fullgraph=True) traces it."""
    for rank, failures in enumerate(pk.spawn(_compiled, 2)):
        assert not failures, (rank, failures)

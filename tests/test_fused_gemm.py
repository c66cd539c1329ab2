"""The GEMM core and the three fused ops against float64 references: world sizes 1 to 4, ragged shapes,
bf16 / fp16 / fp32, back-to-back calls; bad input on every rank."""

import pytest
import torch
from conftest import worlds

import parallelkittens as pk
from parallelkittens.ops.gemm.all_gather_matmul import all_gather_matmul, reference_all_gather_matmul
from parallelkittens.ops.gemm.matmul import MatmulConfig, matmul, reference_matmul
from parallelkittens.ops.gemm.matmul_all_reduce import matmul_all_reduce, reference_matmul_all_reduce
from parallelkittens.ops.gemm.matmul_reduce_scatter import matmul_reduce_scatter, reference_matmul_reduce_scatter
from parallelkittens.testing import check_close, max_abs_error, rank_data, relative_error, shared_seed, tolerance

BOUND = {dtype: tolerance(dtype, "gemm") for dtype in (torch.bfloat16, torch.float16, torch.float32)}


def _run(m: int, k: int, n: int) -> list[str]:
    ctx = pk.context()
    world, me = ctx.local_world_size, ctx.local_rank
    seed, failures = shared_seed(), []

    def check(what: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
        problem = check_close(what, out, ref, dtype, "gemm")
        if problem:
            failures.append(problem)

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        check("matmul", matmul(rank_data((m, k), dtype, seed, me), rank_data((k, n), dtype, seed, 100)),
              reference_matmul(rank_data((m, k), dtype, seed, me), rank_data((k, n), dtype, seed, 100)), dtype)
        for call in range(2):  # the second call reuses every buffer and counter, with new data: a tile it
            # skipped would still hold the first call's (correct for the first call, wrong for this one)
            a_parts = [rank_data((m, k), dtype, seed + call, r) for r in range(world)]
            b_parts = [rank_data((k, n), dtype, seed + call, 100 + r) for r in range(world)]
            check(f"all_gather_matmul #{call}", all_gather_matmul(a_parts[me], b_parts[0]),
                  reference_all_gather_matmul(a_parts, b_parts[0]), dtype)
            check(f"matmul_all_reduce #{call}", matmul_all_reduce(a_parts[me], b_parts[me]),
                  reference_matmul_all_reduce(a_parts, b_parts), dtype)
            if m % world == 0:
                check(f"matmul_reduce_scatter #{call}", matmul_reduce_scatter(a_parts[me], b_parts[me]),
                      reference_matmul_reduce_scatter(a_parts, b_parts, me), dtype)
            # b as weight.t() of (n, k) weights (the layers' backward): read in place, through its transpose
            w_t = [rank_data((n, k), dtype, seed + call, 200 + r).t() for r in range(world)]
            check(f"matmul, b transposed #{call}", matmul(a_parts[me], w_t[me]), reference_matmul(a_parts[me], w_t[me]),
                  dtype)
            in_place = all_gather_matmul.plan(a_parts[me], w_t[0]).b_t and matmul.plan(a_parts[me], w_t[me]).b_t
            if m % world == 0:
                in_place &= matmul_reduce_scatter.plan(a_parts[me], w_t[me]).b_t
            if not in_place:
                failures.append("a transposed b was not read in place")
            check(f"all_gather_matmul, b transposed #{call}", all_gather_matmul(a_parts[me], w_t[0]),
                  reference_all_gather_matmul(a_parts, w_t[0]), dtype)
            if m % world == 0:
                check(f"matmul_reduce_scatter, b transposed #{call}", matmul_reduce_scatter(a_parts[me], w_t[me]),
                      reference_matmul_reduce_scatter(a_parts, w_t, me), dtype)
    pk.sync()
    return failures


# on a GPU also shapes of several full 128x256 tiles with ragged edges (too slow for the interpreter)
# (4104 x 2056 gives the plain GEMM more 128x256 tiles than SMs, so its flattened loop runs ragged edges too)
GPU_SHAPES = [(520, 392, 776), (2048, 1024, 1536), (4104, 264, 2056)] if torch.cuda.is_available() else []


@pytest.mark.parametrize("world", worlds("1,2,3,4"))
@pytest.mark.parametrize("m, k, n", [(48, 40, 72), (60, 24, 40)] + GPU_SHAPES)
def test_fused_gemms_match_float64(world, m, k, n):
    if m % world and world == 4:
        m = 64
    for rank, failures in enumerate(pk.spawn(_run, world, m, k, n, timeout=900)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)


def _pingpong() -> list[str]:
    from parallelkittens.ops.gemm import pingpong

    failures = [] if pingpong.usable(pk.context().device, torch.bfloat16) else ["ping-pong GEMM not usable"]
    seed = shared_seed()
    # one tile; ragged edges in every dimension; more tiles than SMs (both consumers, several tiles each)
    for m, k, n in [(64, 64, 64), (200, 1000, 400), (130, 4096, 136), (4104, 264, 2056), (2048, 1024, 1536)]:
        for cfg in (MatmulConfig(128, 128, 64, 8, 5, 4, pingpong=True), MatmulConfig(64, 256, 64, 8, 4, 4,
                                                                                       pingpong=True)):
            for dtype in (torch.bfloat16, torch.float16):
                for call in range(2):
                    a, b = rank_data((m, k), dtype, seed + call, 0), rank_data((k, n), dtype, seed + call, 1)
                    problem = check_close(f"{m}x{k}x{n} {cfg.block_m}x{cfg.block_n} call {call}", matmul(a, b, cfg),
                                          reference_matmul(a, b), dtype, "gemm")
                    if problem:
                        failures.append(problem)
    return failures


@pytest.mark.gpu
def test_pingpong_gemm_matches_float64():
    """The warp-specialised Hopper GEMM (Gluon, no interpreter: GPU only)."""
    failures = pk.spawn(_pingpong, 1, backend="cuda", timeout=600)[0]
    assert not failures, "; ".join(failures)


def _choices() -> list[str]:
    from parallelkittens.ops.gemm.matmul import _gpu_matmul_config, matmul_config

    seed, failures, seen = shared_seed(), [], set()
    # W = 8 local shapes of the benchmark (each of matmul_config's classes), then ragged ones of the same classes
    for m, n, k in [(2048, 256, 2048), (2048, 2048, 256), (4096, 512, 4096), (2048, 2048, 2048), (1000, 264, 1032),
                    (1048, 1032, 200), (4000, 520, 2056)]:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            cfg = matmul_config(m, n, k, dtype)
            seen.update(shape for shape in ("tiny", "short_k", "few_tiles", "large")
                        if cfg == _gpu_matmul_config(shape, dtype))
            for call in range(2):
                a, b = rank_data((m, k), dtype, seed + call, 0), rank_data((k, n), dtype, seed + call, 1)
                problem = check_close(f"{m}x{n}x{k} {cfg} call {call}", matmul(a, b), reference_matmul(a, b), dtype,
                                      "gemm")
                if problem:
                    failures.append(problem)
    if len(seen) < 4:
        failures.append(f"only these configurations ran: {sorted(seen)}")
    return failures


@pytest.mark.gpu
def test_matmul_config_choices_match_float64():
    """Every configuration `matmul_config` picks on a GPU (one-wave 64x64 tiles, ping-pong for short k-loops,
    128x128 where tiles are few, 128x256 elsewhere), at the benchmark's shapes and ragged ones."""
    failures = pk.spawn(_choices, 1, backend="cuda", timeout=600)[0]
    assert not failures, "; ".join(failures)


def _empty() -> list[str]:
    dev, failures = pk.context().device, []
    for m, k, n in [(0, 16, 8), (8, 16, 0), (24, 0, 16)]:  # no rows, no columns, an empty k-loop (zeros)
        for dtype in (torch.bfloat16, torch.float32):
            out = matmul(torch.ones(m, k, device=dev, dtype=dtype), torch.ones(k, n, device=dev, dtype=dtype))
            if out.shape != (m, n) or out.dtype != dtype or bool(out.ne(0).any()):
                failures.append(f"{m}x{k} @ {k}x{n} {dtype}: got {tuple(out.shape)} {out.dtype}, "
                                f"{int(out.ne(0).sum())} nonzero")
    return failures


def test_matmul_of_empty_operands():
    failures = pk.spawn(_empty, 1, timeout=300)[0]
    assert not failures, "; ".join(failures)


def _bad() -> list[str]:
    ctx = pk.context()
    dev = ctx.device
    out = []
    for fn, a, b in [
        (all_gather_matmul, torch.ones(8, 16, device=dev, dtype=torch.bfloat16),
         torch.ones(24, 16, device=dev, dtype=torch.bfloat16)),  # inner dims differ
        (matmul_all_reduce, torch.ones(8, 16, device=dev, dtype=torch.bfloat16),
         torch.ones(16, 16, device=dev, dtype=torch.float16)),  # dtypes differ
        (matmul_reduce_scatter, torch.ones(8, 12, device=dev, dtype=torch.bfloat16),
         torch.ones(12, 16, device=dev, dtype=torch.bfloat16)),  # rows not 16-byte aligned
        (matmul_reduce_scatter, torch.ones(9, 16, device=dev, dtype=torch.bfloat16),
         torch.ones(16, 16, device=dev, dtype=torch.bfloat16)),  # M does not divide by 2
        (all_gather_matmul, torch.ones(8 + ctx.rank * 8, 16, device=dev, dtype=torch.bfloat16),
         torch.ones(16, 16, device=dev, dtype=torch.bfloat16)),  # shapes differ between ranks
    ]:
        try:
            fn(a, b)
            pk.sync()
            out.append("no error")
        except pk.PKError as e:
            out.append(str(e))
    return out


def test_bad_input_fails_on_every_rank():
    for msgs in pk.spawn(_bad, 2):
        assert "inner dimensions differ" in msgs[0]
        assert "a is torch.bfloat16 but b is torch.float16" in msgs[1]
        assert "must be multiples of 8" in msgs[2]
        assert "do not divide by the world size 2" in msgs[3]
        assert "ranks called it differently" in msgs[4]


def _compiled() -> list[float]:
    ctx = pk.context()
    seed = shared_seed()
    a = rank_data((32, 16), torch.float16, seed, ctx.rank)
    b = rank_data((16, 24), torch.float16, seed, 7)
    errors = []
    for op in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
        fn = getattr(torch.ops.parallelkittens, op)
        compiled = torch.compile(lambda x, y, fn=fn: fn(x, y) * 2, backend="aot_eager", fullgraph=True)
        errors.append(relative_error(compiled(a, b), 2 * fn(a, b).double()))
    pk.sync()
    return errors


def test_custom_ops_compile_with_torch_compile():
    for errors in pk.spawn(_compiled, 2):
        assert all(e < 1e-3 for e in errors), errors


def _changing_shapes() -> list[str]:
    """One set of symmetric buffers serves every shape: small, larger, small again, all correct."""
    ctx = pk.context()
    world, me = ctx.local_world_size, ctx.local_rank
    seed, failures = shared_seed(), []
    for m, k, n in [(32, 16, 24), (96, 40, 56), (32, 16, 24)]:
        a_parts = [rank_data((m, k), torch.float16, seed + m, r) for r in range(world)]
        b_parts = [rank_data((k, n), torch.float16, seed + n, r) for r in range(world)]
        for what, out, ref in [
            ("all_gather_matmul", all_gather_matmul(a_parts[me], b_parts[0]),
             reference_all_gather_matmul(a_parts, b_parts[0])),
            ("matmul_reduce_scatter", matmul_reduce_scatter(a_parts[me], b_parts[me]),
             reference_matmul_reduce_scatter(a_parts, b_parts, me)),
            ("matmul_all_reduce", matmul_all_reduce(a_parts[me], b_parts[me]),
             reference_matmul_all_reduce(a_parts, b_parts)),
        ]:
            err = relative_error(out, ref)
            if not err <= BOUND[torch.float16]:
                failures.append(f"{what} {(m, k, n)}: relative error {err:.2e}")
    pk.sync()
    return failures


def test_buffers_are_reused_across_shapes():
    for rank, failures in enumerate(pk.spawn(_changing_shapes, 2)):
        assert not failures, f"rank {rank}: {failures}"


def _host_side_mismatch() -> list[str]:
    """Ranks whose first call of a signature differs learn it when the plan is built, on the host, on every rank,
    before any buffer grows or kernel starts; the ops work again afterwards."""
    ctx = pk.context()
    world, me, dev = ctx.local_world_size, ctx.local_rank, ctx.device

    def ones(*shape):
        return torch.ones(shape, device=dev, dtype=torch.float16)

    out = []
    for name, call in [
        ("all_gather_matmul", lambda: all_gather_matmul(ones(8 + 8 * me, 16), ones(16, 24), num_comm_sms=1)),
        ("matmul_reduce_scatter", lambda: matmul_reduce_scatter(ones(8 * world, 16 + 8 * me), ones(16 + 8 * me, 24))),
        ("matmul_all_reduce", lambda: matmul_all_reduce(ones(16, 16), ones(16, 24 + 8 * me), num_comm_sms=1)),
        ("different ops", lambda: matmul_all_reduce(ones(16, 16), ones(16, 24), num_comm_sms=1) if me else
         all_gather_matmul(ones(16, 16), ones(16, 24), num_comm_sms=1)),
        ("empty on one rank", lambda: matmul_all_reduce(ones(0 if me == 1 else 16, 16), ones(16, 24),
                                                        num_comm_sms=1)),
        ("empty shard on one rank", lambda: all_gather_matmul(ones(0 if me == 1 else 8, 16), ones(16, 24),
                                                              num_comm_sms=1)),
        ("rows not divisible on one rank", lambda: matmul_reduce_scatter(ones(8 * world + (me == 1), 16),
                                                                         ones(16, 24))),
        # what would make only rank 0 grow the heap (its 2 MiB output against the 1 MiB pools), or tune
        ("buffers grow on one rank", lambda: matmul_all_reduce(ones(16, 16), ones(16, 65536 if me == 0 else 24),
                                                               num_comm_sms=1)),
        ("tuning on one rank", lambda: matmul_all_reduce(ones(16, 16), ones(16, 24),
                                                         num_comm_sms=None if me == 0 else 1)),
    ]:
        before = dict(ctx.stats)
        error = None
        try:
            call()
        except pk.PKError as e:
            error = e
        try:
            pk.sync()
        except pk.PKError as e:
            error = error or e
        grew = {k: ctx.stats[k] - before.get(k, 0) for k in ("heap_pools", "heap_blocks", "tunings", "plans")
                if ctx.stats[k] != before.get(k, 0)}
        out.append(f"{name}: {type(error).__name__}: {error}" + (f" (yet grew {grew})" if grew else ""))
    out += _still_correct()
    pk.sync()
    return out


def _still_correct() -> list[str]:
    ctx = pk.context()
    world, me = ctx.local_world_size, ctx.local_rank
    seed = shared_seed()
    a_parts = [rank_data((8 * world, 16), torch.float16, seed, r) for r in range(world)]
    b_parts = [rank_data((16, 24), torch.float16, seed, 50 + r) for r in range(world)]
    out = []
    for what, result, ref in [
        ("all_gather_matmul", all_gather_matmul(a_parts[me], b_parts[0], num_comm_sms=1),
         reference_all_gather_matmul(a_parts, b_parts[0])),
        ("matmul_reduce_scatter", matmul_reduce_scatter(a_parts[me], b_parts[me]),
         reference_matmul_reduce_scatter(a_parts, b_parts, me)),
        ("matmul_all_reduce", matmul_all_reduce(a_parts[me], b_parts[me], num_comm_sms=1),
         reference_matmul_all_reduce(a_parts, b_parts)),
    ]:
        worst = max_abs_error(result, ref) / float(ref.abs().max())
        out.append(f"{what} afterwards: relative error {max(relative_error(result, ref), worst / 4):.1e}")
    return out


def test_host_side_mismatch_is_reported_on_every_rank():
    for msgs in pk.spawn(_host_side_mismatch, 3, timeout=300):
        for op, msg in zip(("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"), msgs, strict=False):
            assert msg.startswith(f"{op}: MismatchError") and "ranks called it differently" in msg, msg
        assert msgs[3].startswith("different ops: MismatchError") and "different steps" in msgs[3], msgs[3]
        for i, case in ((4, "empty on one rank"), (5, "empty shard on one rank"), (7, "buffers grow on one rank"),
                        (8, "tuning on one rank")):
            assert msgs[i].startswith(f"{case}: MismatchError"), msgs[i]
        assert (msgs[6].startswith("rows not divisible on one rank: PKError")
                and "do not divide by the world size 3" in msgs[6]), msgs[6]
        assert not any("yet grew" in m for m in msgs[:9]), msgs[:9]
        for msg in msgs[9:]:
            assert float(msg.rsplit(" ", 1)[1]) <= BOUND[torch.float16], msg


def _device_side_mismatch() -> list[str]:
    """Plans every rank built together, then called in different orders: the kernels' meeting finds the calls
    differ, every rank skips its peer work, and `pk.sync()` raises MismatchError on every rank."""
    ctx = pk.context()
    world, me, dev = ctx.local_world_size, ctx.local_rank, ctx.device

    def ones(*shape):
        return torch.ones(shape, device=dev, dtype=torch.float16)

    shapes = {"small": (ones(8, 16), ones(16, 24)), "large": (ones(16, 16), ones(16, 40))}
    ops = {"all_gather_matmul": lambda a, b: all_gather_matmul(a, b, num_comm_sms=1),
           "matmul_reduce_scatter": lambda a, b: matmul_reduce_scatter(torch.cat([a] * world), b),
           "matmul_all_reduce": lambda a, b: matmul_all_reduce(a, b, num_comm_sms=1)}
    for fn in ops.values():  # every plan built on every rank, in the same order
        for a, b in shapes.values():
            fn(a, b)
    pk.sync()
    built = ctx.stats["plans"]
    out = []
    cases = [(name, fn, shapes["small" if me == 0 else "large"]) for name, fn in ops.items()]
    cases.append(("different ops", ops["matmul_all_reduce"] if me else ops["all_gather_matmul"], shapes["small"]))
    for name, fn, (a, b) in cases:
        error = None
        try:
            fn(a, b)
            pk.sync()
        except pk.PKError as e:
            error = e
        out.append(f"{name}: {type(error).__name__}: {error}")
    if ctx.stats["plans"] != built:
        out.append(f"plans were built during the mismatched calls: {ctx.stats['plans'] - built}")
    out += _still_correct()
    pk.sync()
    return out


def test_device_side_mismatch_is_reported_not_hung():
    for msgs in pk.spawn(_device_side_mismatch, 3, timeout=300):
        for op, msg in zip(("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"), msgs, strict=False):
            assert msg.startswith(f"{op}: MismatchError") and f"{op} with" in msg, msg
        assert msgs[3].startswith("different ops: MismatchError"), msgs[3]
        assert len(msgs) == 7, msgs  # no plan was built by the mismatched calls
        for msg in msgs[4:]:
            assert float(msg.rsplit(" ", 1)[1]) <= BOUND[torch.float16], msg

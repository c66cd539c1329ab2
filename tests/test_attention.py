"""Attention against float64 references of full attention over the whole sequence: the flash kernel alone, ring
attention (both layouts) and Ulysses, outputs, log-sum-exp and the gradients of q, k and v; world sizes 1 to 4,
grouped-query heads, head dims 64 and 128, sequence lengths that are not powers of two; bad input on every rank."""

import itertools

import pytest
import torch
from conftest import worlds

import parallelkittens as pk
from parallelkittens.ops.attention.flash import reference_attention
from parallelkittens.ops.attention.ring import LAYOUTS
from parallelkittens.testing import (
    blocks_computed,
    check_close,
    first_mismatch,
    poison,
    rank_data,
    relative_error,
    shared_seed,
)

DTYPES = (torch.bfloat16, torch.float16, torch.float32) if torch.cuda.is_available() else (torch.float32,
                                                                                               torch.bfloat16)


def check_attention(what: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> str | None:
    """Attention is two products per tile (fp32 accumulation, P rounded to the dtype in between): the GEMM
    bounds, except fp32 on a GPU, where both products run in TF32 (as the GEMMs' do) and their errors add up
    (2.0e-3 measured on an H200 for dQ and dK)."""
    if dtype == torch.float32 and out.is_cuda:
        err = relative_error(out, ref)
        return None if err <= 5e-3 else f"{what} {dtype}: relative error {err:.2e} (bound 5e-3, TF32)"
    return check_close(what, out, ref, dtype, "gemm")


def _grad_check(what: str, got: list[torch.Tensor], ref: list[torch.Tensor], dtype: torch.dtype) -> list[str]:
    names = ("out", "lse", "dq", "dk", "dv")
    problems = [check_attention(f"{what} {name}", g, r, dtype) for name, g, r in zip(names, got, ref, strict=True)]
    return [p for p in problems if p]


def _full(seed: int, dtype: torch.dtype, B: int, Hq: int, Hkv: int, N: int, D: int) -> list[torch.Tensor]:
    """q, k, v, dO and dLSE over the whole sequence (B, H, N, D), the same on every rank."""
    shapes = [(B, Hq, N, D), (B, Hkv, N, D), (B, Hkv, N, D), (B, Hq, N, D), (B, Hq, N)]
    return [rank_data(s, torch.float32, seed, i, device="cpu").to(dtype) for i, s in enumerate(shapes)]


def _reference(q, k, v, do, dlse, causal: bool) -> list[torch.Tensor]:
    """(out, lse, dq, dk, dv) in float64 of the loss sum(out * dO) + sum(lse * dLSE)."""
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    out, lse = reference_attention(q, k, v, causal)
    ((out * do.double()).sum() + (lse * dlse.double()).sum()).backward()
    return [out.detach(), lse.detach(), q.grad, k.grad, v.grad]


def _ours(fn, q, k, v, do, dlse, **kwargs) -> list[torch.Tensor]:
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = fn(q, k, v, return_lse=True, **kwargs)
    ((out.float() * do.float()).sum() + (lse * dlse.float()).sum()).backward()
    return [out.detach(), lse.detach(), q.grad, k.grad, v.grad]


def _flash_cases() -> list[str]:
    pk.init()
    dev, failures = pk.context().device, []
    for dtype in DTYPES:
        for B, Hq, Hkv, Nq, Nk, D, causal in [(2, 4, 2, 37, 37, 64, True), (1, 2, 1, 19, 45, 64, False),
                                              (1, 2, 2, 21, 21, 128, True), (1, 3, 1, 40, 24, 32, True)]:
            seed = shared_seed()
            q, do = (rank_data((B, Hq, Nq, D), torch.float32, seed, i, device=dev).to(dtype) for i in (0, 1))
            k, v = (rank_data((B, Hkv, Nk, D), torch.float32, seed, i, device=dev).to(dtype) for i in (2, 3))
            dlse = rank_data((B, Hq, Nq), torch.float32, seed, 4, device=dev)
            what = f"attention B{B} Hq{Hq} Hkv{Hkv} Nq{Nq} Nk{Nk} D{D} causal={causal}"
            failures += _grad_check(what, _ours(pk.ops.attention, q, k, v, do, dlse, causal=causal),
                                    _reference(q, k, v, do, dlse, causal), dtype)
    return failures


def test_flash_attention_matches_float64():
    failures = pk.spawn(_flash_cases, 1)[0]
    assert not failures, "; ".join(failures)


def _load_paths() -> list[str]:
    """The forward's kernels, Triton's and the warp-specialised Gluon one (FWD_KERNELS; on the CPU "gluon" falls
    back to Triton's), each against float64: grouped-query heads, ragged ends, both layouts, causal or not; on a GPU
    also sequences of many key tiles (the stages' ring wraps)."""
    from parallelkittens.ops.attention import attention

    pk.init()
    dev, failures = pk.context().device, []
    cases = [(2, 4, 2, 37, 37, 64, True, "BHND"), (1, 2, 1, 19, 45, 64, False, "BHND"),
             (1, 4, 2, 48, 64, 128, False, "BHND"), (1, 4, 2, 40, 40, 128, True, "BSHD")]
    if dev.type == "cuda":
        cases += [(2, 4, 1, 700, 1100, 128, False, "BHND"), (1, 4, 2, 1000, 1000, 128, True, "BSHD"),
                  (1, 2, 2, 1100, 700, 64, True, "BHND")]
    for dtype in DTYPES[:2]:
        for B, Hq, Hkv, Nq, Nk, D, causal, layout in cases:
            seed = shared_seed()
            q = rank_data((B, Hq, Nq, D), torch.float32, seed, 0, device=dev).to(dtype)
            k, v = (rank_data((B, Hkv, Nk, D), torch.float32, seed, i, device=dev).to(dtype) for i in (1, 2))
            ref_out, ref_lse = reference_attention(q.double(), k.double(), v.double(), causal)
            if layout == "BSHD":  # (B, N, H, D), read in place
                q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
            tiles = attention.default_tiles(dev, D, dtype)
            for loads in attention.FWD_KERNELS:
                plan = attention.AttentionPlan(q, k, v, causal, D ** -0.5, layout=layout,
                                               tiles={**tiles, "fwd": (*tiles["fwd"][:4], loads)})
                # poison: the forward's outputs come from the blocks these free, so a row never written stays NaN
                torch.full_like(q, float("nan")), torch.full(plan.lse_shape(), float("nan"), device=dev)
                out, lse = plan(q, k, v)
                out = out.transpose(1, 2) if layout == "BSHD" else out
                what = f"{loads} B{B} Hq{Hq} Hkv{Hkv} Nq{Nq} Nk{Nk} D{D} causal={causal} {layout}"
                failures += [p for p in (check_attention(f"{what} out", out, ref_out, dtype),
                                         check_attention(f"{what} lse", lse, ref_lse, torch.float32)) if p]
    return failures


@pytest.mark.parametrize("layout", ["BHND", "BSHD"])
def test_gluon_forward_reads_each_head_where_it_lies(layout):
    """The Gluon forward's TMA views (`flash_hopper.views`): q's row of (b, h, n) and k's (outer, n) of (b, h) are
    that element's row, in either layout (the kernel itself runs only on a GPU)."""
    from parallelkittens.ops.attention import flash_hopper

    B, H, N, D = 2, 3, 5, 4
    t = torch.arange(B * H * N * D, dtype=torch.float32).reshape((B, H, N, D) if layout == "BHND" else (B, N, H, D))
    v = flash_hopper.views(tuple(t.shape), layout)
    matrix, rows = (t.as_strided(*v[name]) for name in ("matrix", "rows"))
    for b, h, n in itertools.product(range(B), range(H), range(N)):
        want = t[b, h, n] if layout == "BHND" else t[b, n, h]
        cols = slice(h * v["cols"], h * v["cols"] + D)
        assert torch.equal(matrix[b * v["per_b"] + h * v["per_h"] + n, cols], want)
        assert torch.equal(rows[b * v["outer_b"] + h * v["outer_h"], n, cols], want)


def test_forward_load_paths_match_float64():
    failures = pk.spawn(_load_paths, 1)[0]
    assert not failures, "; ".join(failures)


def _ring_cases(D: int, Hq: int, Hkv: int, dtype: torch.dtype) -> list[str]:
    ctx = pk.context()
    world, failures = ctx.local_world_size, []
    n_local = 18  # per rank: not a power of two, and zigzag chunks of 9 rows straddle the 16-row tiles
    for layout in LAYOUTS:
        for causal in (False, True):
            full = _full(shared_seed(), dtype, 2, Hq, Hkv, n_local * world, D)  # two batches: B is in the tasks
            ref = _reference(*full, causal)
            parts = [pk.ops.shard_sequence(x.to(ctx.device), 2, layout) for x in full]
            got = _ours(pk.ops.ring_attention, *parts, causal=causal, layout=layout)
            mine = [pk.ops.shard_sequence(r, 2, layout) for r in ref]
            failures += _grad_check(f"ring {layout} causal={causal} D{D} Hq{Hq} Hkv{Hkv}", got, mine, dtype)
            whole = pk.ops.unshard_sequence(got[0], 2, layout)
            problem = check_attention(f"unshard_sequence {layout}", whole, ref[0], dtype)
            failures += [problem] if problem else []
    pk.sync()
    return failures


@pytest.mark.parametrize("world", worlds("1,2,3,4"))
def test_ring_attention_matches_float64(world):
    cases = {1: (64, 2, 1, torch.float32), 2: (64, 4, 2, torch.float32), 3: (128, 2, 2, torch.bfloat16),
             4: (64, 4, 1, torch.float32)}
    for rank, failures in enumerate(pk.spawn(_ring_cases, world, *cases.get(world, cases[4]), timeout=900)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)


def _ulysses_cases(Hq: int, Hkv: int, D: int, dtype: torch.dtype) -> list[str]:
    ctx = pk.context()
    world, me, failures = ctx.local_world_size, ctx.local_rank, []
    n = 13  # positions per rank
    for causal in (False, True):
        full = _full(shared_seed(), dtype, 2, Hq, Hkv, n * world, D)
        out_ref, _, dq_ref, dk_ref, dv_ref = _reference(*full[:4], torch.zeros_like(full[4]), causal)

        def mine(x: torch.Tensor) -> torch.Tensor:  # (B, H, N, D) -> this rank's (B, N/W, H, D)
            return x.transpose(1, 2)[:, me * n:(me + 1) * n].contiguous().to(ctx.device)

        q, k, v = (mine(x).requires_grad_() for x in full[:3])
        out = pk.ops.ulysses_attention(q, k, v, causal=causal)
        (out.float() * mine(full[3]).float()).sum().backward()
        for name, got, ref in [("out", out, out_ref), ("dq", q.grad, dq_ref), ("dk", k.grad, dk_ref),
                               ("dv", v.grad, dv_ref)]:
            problem = check_attention(f"ulysses causal={causal} {name}", got.detach(), mine(ref), dtype)
            failures += [problem] if problem else []
    pk.sync()
    return failures


@pytest.mark.parametrize("world", worlds("1,2,3,4"))
def test_ulysses_attention_matches_float64(world):
    Hq, Hkv = (2 * world, world) if world != 3 else (3, 3)
    for rank, failures in enumerate(pk.spawn(_ulysses_cases, world, Hq, Hkv, 64, torch.float32, timeout=900)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)


def _world_one_is_the_kernel() -> list[str]:
    pk.init()
    dev, seed, failures = pk.context().device, shared_seed(), []
    q, k, v, do, dlse = _full(seed, torch.float32, 1, 4, 2, 40, 64)
    q, k, v, do, dlse = (x.to(dev) for x in (q, k, v, do, dlse))
    for causal in (False, True):
        plain = _ours(pk.ops.attention, q, k, v, do, dlse, causal=causal)
        for layout in LAYOUTS:
            ring = _ours(pk.ops.ring_attention, q, k, v, do, dlse, causal=causal, layout=layout)
            failures += [f"ring {layout} {m}" for m in map(first_mismatch, ring, plain) if m]

        def bshd(x: torch.Tensor) -> torch.Tensor:
            return x.transpose(1, 2).contiguous().requires_grad_()

        qs, ks, vs = bshd(q), bshd(k), bshd(v)
        out = pk.ops.ulysses_attention(qs, ks, vs, causal=causal)
        (out * do.transpose(1, 2)).sum().backward()
        plain = _ours(pk.ops.attention, q, k, v, do, torch.zeros_like(dlse), causal=causal)
        for name, a, b in [("out", out, plain[0]), ("dq", qs.grad, plain[2]), ("dk", ks.grad, plain[3]),
                           ("dv", vs.grad, plain[4])]:
            m = first_mismatch(a.detach().transpose(1, 2), b)
            failures += [f"ulysses {name}: {m}"] if m else []
    return failures


def test_world_one_equals_the_plain_kernel_exactly():
    failures = pk.spawn(_world_one_is_the_kernel, 1)[0]
    assert not failures, "; ".join(failures)


def test_one_block_of_positions_is_the_plain_call():
    """Zigzag at one rank (chunks 0 and 1) is one block from 0, however spelled: the plan takes the plain call's
    positions, hence its kernel (on Hopper the Gluon forward); two real segments stay as they are."""
    from parallelkittens.ops.attention import attention
    from parallelkittens.ops.attention.ring import segments

    assert attention.segments_of(segments("zigzag", 1, 0, 18), 18) == (18, 0, 0)
    assert attention.segments_of(segments("contiguous", 1, 0, 18), 18) == (18, 0, 0)
    assert attention.segments_of(None, 7) == (7, 0, 0)
    assert attention.segments_of(segments("zigzag", 2, 0, 18), 18) == (9, 0, 27)
    assert attention.segments_of(segments("contiguous", 2, 1, 18), 18) == (18, 18, 0)


def _exchange_is_real() -> list[bool]:
    """Rank 0 changes its K; does each rank's output change? (It must, without the causal mask.)"""
    ctx = pk.context()
    seed = shared_seed()
    q, k, v = (rank_data((1, 3, 16, 64), torch.float32, seed, 10 * i + ctx.rank) for i in range(3))
    changed = []
    for op, layout in ((pk.ops.ring_attention, lambda x: x), (pk.ops.ulysses_attention,
                                                             lambda x: x.transpose(1, 2).contiguous())):
        before = op(layout(q), layout(k), layout(v))
        k2 = k + 1.0 if ctx.rank == 0 else k
        changed.append(not torch.equal(before, op(layout(q), layout(k2), layout(v))))
    pk.sync()
    return changed


def test_the_exchange_is_real():
    for rank, changed in enumerate(pk.spawn(_exchange_is_real, 3)):
        assert changed == [True, True], f"rank {rank}: rank 0's K change did not reach it (ring, ulysses): {changed}"


def _bad() -> list[str]:
    ctx = pk.context()
    dev, me = ctx.device, ctx.rank

    def t(*shape, dtype=torch.float32):
        return torch.ones(shape, dtype=dtype, device=dev)

    messages = []
    for op, args, kwargs in [
        (pk.ops.ring_attention, (t(1, 2, 16 + 2 * me, 64), t(1, 2, 16 + 2 * me, 64), t(1, 2, 16 + 2 * me, 64)),
         {}),  # sequence lengths differ between ranks
        (pk.ops.ring_attention, (t(1, 2, 17, 64),) * 3, {"layout": "zigzag"}),  # 17 rows do not split in two
        (pk.ops.ring_attention, (t(1, 3, 16, 64), t(1, 2, 16, 64), t(1, 2, 16, 64)), {}),  # Hq % Hkv
        (pk.ops.ring_attention, (t(1, 2, 16, 48),) * 3, {}),  # head dim
        (pk.ops.ring_attention, (t(1, 2, 16, 64), t(1, 2, 16, 64, dtype=torch.bfloat16), t(1, 2, 16, 64)), {}),
        (pk.ops.ring_attention, (t(1, 2, 16, 64), t(1, 2, 16, 64), t(1, 2, 8, 64)), {}),  # k and v differ
        (pk.ops.ulysses_attention, (t(1, 16, 3, 64),) * 3, {}),  # 3 heads among 2 ranks
        (pk.ops.ulysses_attention, (t(1, 8, 2, 64), t(1, 16, 2, 64), t(1, 16, 2, 64)), {}),  # q and k rows differ
        (pk.ops.attention, (t(1, 2, 16, 64), t(1, 2, 16, 32), t(1, 2, 16, 32)), {}),  # head dims differ
        (pk.ops.ring_attention, (t(1, 2, 16, 64),) * 3, {"layout": "striped"}),
    ]:
        try:
            op(*args, **kwargs)
            pk.sync()
            messages.append("no error")
        except pk.PKError as e:
            messages.append(str(e))
    x = t(1, 2, 16, 64)
    messages.append("works" if pk.ops.ring_attention(x, x, x).isfinite().all() else "broken")  # nothing left over
    pk.sync()
    return messages


def test_bad_input_fails_on_every_rank_before_any_kernel():
    expected = ["ranks called it differently", "(the sequence must split into 2W equal chunks)",
                "grouped-query attention needs Hq divisible by Hkv", "head dim 48 is not supported",
                "q, k and v must share a dtype", "k and v must have the same shape", "q have 3 heads, which do not "
                "divide among 2 ranks", "q holds 8 positions of the sequence but k and v 16",
                "differ in batch or head dim", "layout must be one of", "works"]
    for rank, messages in enumerate(pk.spawn(_bad, 2)):
        for want, got in zip(expected, messages, strict=True):
            assert want in got, f"rank {rank}: expected {want!r} in {got!r}"


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_zigzag_balances_causal_work(world):
    for n_total in (4096 * world, 32768):
        counts = blocks_computed("zigzag", world, n_total, True, 128, 64)
        mean = sum(counts) / world
        assert max(counts) <= 1.1 * mean, f"zigzag work per rank {counts} (mean {mean:.0f})"
        contiguous = blocks_computed("contiguous", world, n_total, True, 128, 64)
        assert max(contiguous) > 1.4 * (sum(contiguous) / world)  # what the zigzag layout is for


def _compiled() -> list[str]:
    pk.init()
    seed, dev, failures = shared_seed(), pk.context().device, []
    q, k, v = (rank_data((1, 2, 24, 64), torch.float32, seed, i, device=dev) for i in range(3))
    for name, fn, args in [("attention", pk.ops.attention, (q, k, v)),
                           ("ring_attention", pk.ops.ring_attention, (q, k, v)),
                           ("ulysses_attention", pk.ops.ulysses_attention, tuple(x.transpose(1, 2).contiguous()
                                                                                  for x in (q, k, v)))]:
        leaves = [x.clone().requires_grad_() for x in args]
        compiled = torch.compile(lambda *xs, fn=fn: fn(*xs, causal=True) * 2, backend="aot_eager", fullgraph=True)
        compiled(*leaves).sum().backward()
        eager = [x.clone().requires_grad_() for x in args]
        (fn(*eager, causal=True) * 2).sum().backward()
        failures += [f"{name} compiled grad {m}" for m in map(first_mismatch, [x.grad for x in leaves],
                                                              [x.grad for x in eager]) if m]
    return failures


def test_torch_compile_traces_attention_ops():
    failures = pk.spawn(_compiled, 1)[0]
    assert not failures, "; ".join(failures)


def _gpu_bf16_and_graph(replays: int) -> list[str]:
    """bf16 against float64 at sizes of several full tiles, forward and backward; then forward and backward
    captured in one CUDA graph and replayed with new inputs."""
    ctx = pk.context()
    world, dev, failures = ctx.local_world_size, ctx.device, []
    B, Hq, Hkv, D, n_local = 2, 8, 4, 128, 392  # zigzag chunks of 196 rows: ragged against every tile
    bf16 = torch.bfloat16

    def ring(layout, causal):
        return lambda q, k, v: pk.ops.ring_attention(q, k, v, causal, layout=layout)

    def ulysses(q, k, v):
        return pk.ops.ulysses_attention(q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(),
                                        v.transpose(1, 2).contiguous(), True).transpose(1, 2)

    cases = [("ring zigzag causal", ring("zigzag", True), "zigzag", True),
             ("ring contiguous", ring("contiguous", False), "contiguous", False),
             ("ulysses causal", ulysses, "contiguous", True)]
    for name, fn, layout, causal in cases:
        full = [x.to(dev) for x in _full(shared_seed(), bf16, B, Hq, Hkv, n_local * world, D)]
        ref = [pk.ops.shard_sequence(r, 2, layout) for r in _reference(*full[:4], torch.zeros_like(full[4]),
                                                                         causal)]
        q, k, v, do = (pk.ops.shard_sequence(x, 2, layout) for x in full[:4])
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, do)
        names = ("out", "dq", "dk", "dv")
        failures += [p for p in (check_close(f"{name} {n}", g, r, bf16, "gemm")
                                 for n, g, r in zip(names, (out, *grads), (ref[0], *ref[2:]), strict=True)) if p]
        # captured: static inputs, forward and backward in one graph (warmed up on a side stream first)
        static = [x.clone() for x in (q, k, v, do)]
        leaves = [x.requires_grad_() for x in static[:3]]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.autograd.grad(fn(*leaves), leaves, static[3])
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fn(*leaves)
            outs = (captured, *torch.autograd.grad(captured, leaves, static[3]))
        for step in range(replays):
            fresh = [x.to(dev) for x in _full(shared_seed(), bf16, B, Hq, Hkv, n_local * world, D)]
            for buf, x in zip(static, fresh[:4], strict=True):
                buf.detach().copy_(pk.ops.shard_sequence(x, 2, layout))
            for o in outs:
                poison(o.detach())
            graph.replay()
            if step % 25 == 24:
                ref = [pk.ops.shard_sequence(r, 2, layout)
                       for r in _reference(*fresh[:4], torch.zeros_like(fresh[4]), causal)]
                failures += [f"replay {step}: {p}" for p in (
                    check_close(f"{name} {n}", g, r, bf16, "gemm")
                    for n, g, r in zip(names, outs, (ref[0], *ref[2:]), strict=True)) if p]
        del graph
    pk.sync()
    return failures


@pytest.mark.gpu
@pytest.mark.parametrize("world", worlds("2,4"))
def test_gpu_bf16_and_graph_replays(world):
    for rank, failures in enumerate(pk.spawn(_gpu_bf16_and_graph, world, 100, timeout=600)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)

"""Expert parallelism against a float64 reference that gathers every token and applies every expert: the layout,
moe_dispatch_gemm -> SiLU -> moe_gemm_combine, outputs and the gradients of x, w1, w2 and the routing weights;
worlds 1 to 4; random routing, every token to one expert, empty experts, a token's k experts on one rank, a
different number of tokens on each rank (none on one); capacity with and without overflow; bitwise repeats;
bad input on every rank."""

import pytest
import torch
from conftest import worlds

import parallelkittens as pk
from parallelkittens.ops.moe.layout import reference_routing
from parallelkittens.testing import check_close, relative_error, shared_seed

CASES = ("random", "one_expert", "empty_experts", "one_rank", "ragged")
H, INNER, TOP_K, EXPERTS_PER_RANK = 32, 48, 2, 3


def _check(what: str, got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, on_gpu: bool) -> str | None:
    """The GEMM bounds; float32 on a GPU runs as TF32 on the tensor cores (as the project's GEMMs do), and two
    chained products add their errors: 5e-3 there."""
    if dtype == torch.float32 and on_gpu:
        err = relative_error(got, ref)
        return None if err <= 5e-3 else f"{what} {dtype}: relative error {err:.2e} (bound 5e-3, TF32)"
    return check_close(what, got, ref, dtype, "gemm")


def _routing(case: str, gen: torch.Generator, world: int, tokens: list[int]) -> list[torch.Tensor]:
    E = EXPERTS_PER_RANK * world
    ids = []
    for T in tokens:
        if case == "one_rank":  # both experts of a token on one rank
            rank = torch.randint(0, world, (T, 1), generator=gen)
            first = torch.randint(0, EXPERTS_PER_RANK - 1, (T, 1), generator=gen)
            pick = torch.cat([first, first + 1], 1) + rank * EXPERTS_PER_RANK
        else:
            pick = (torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(T)]) if T else
                    torch.zeros(0, TOP_K, dtype=torch.long))
            if case == "one_expert":
                pick[:, 0] = E - 1
                pick[:, 1] = torch.where(pick[:, 1] == E - 1, 0, pick[:, 1])
            elif case == "empty_experts":  # only experts 1 and E-2: the others, and whole ranks, get nothing
                pick = torch.stack([torch.full((T,), 1), torch.full((T,), E - 2)], 1)
        ids.append(pick)
    return ids


def _reference(xs, ids, weights, kept, w1, w2, dys, me):
    """Every rank's output and this rank's gradients, float64, by autograd over the whole job."""
    xs = [x.detach().double().requires_grad_() for x in xs]
    weights = [w.detach().double().requires_grad_() for w in weights]
    w1, w2 = w1.detach().double().requires_grad_(), w2.detach().double().requires_grad_()
    outs = []
    for x, idx, wt, keep in zip(xs, ids, weights, kept, strict=True):
        out = torch.zeros(x.shape[0], H, dtype=torch.float64)
        for j in range(TOP_K):
            y = torch.stack([torch.nn.functional.silu(x[t] @ w1[idx[t, j]]) @ w2[idx[t, j]] for t in
                             range(x.shape[0])]) if x.shape[0] else out
            out = out + torch.where(keep[:, j:j + 1], wt[:, j:j + 1] * y, 0.0)
        outs.append(out)
    sum((o * dy.double()).sum() for o, dy in zip(outs, dys, strict=True)).backward()
    epr = EXPERTS_PER_RANK
    return (outs[me], xs[me].grad, w1.grad[me * epr:(me + 1) * epr], w2.grad[me * epr:(me + 1) * epr],
            weights[me].grad)


def _case(case: str, dtype: torch.dtype, capacity: int | None) -> list[str]:
    ctx = pk.context()
    world, me, dev, failures = ctx.local_world_size, ctx.local_rank, ctx.device, []
    gen = torch.Generator().manual_seed(shared_seed())
    E = EXPERTS_PER_RANK * world
    tokens = [[5, 0, 9, 3][r % 4] if case == "ragged" else 8 for r in range(world)]
    ids = _routing(case, gen, world, tokens)
    xs = [torch.randn(T, H, generator=gen).to(dtype) for T in tokens]
    weights = [torch.rand(T, TOP_K, generator=gen) + 0.1 for T in tokens]
    dys = [torch.randn(T, H, generator=gen).to(dtype) for T in tokens]
    w1_all = (torch.randn(E, H, INNER, generator=gen) / H ** 0.5).to(dtype)
    w2_all = (torch.randn(E, INNER, H, generator=gen) / INNER ** 0.5).to(dtype)
    kept = reference_routing(ids, E, capacity)
    mine = slice(me * EXPERTS_PER_RANK, (me + 1) * EXPERTS_PER_RANK)

    x = xs[me].to(dev).requires_grad_()
    w1 = w1_all[mine].to(dev).requires_grad_()
    w2 = w2_all[mine].to(dev).requires_grad_()
    wt = weights[me].to(dev).requires_grad_()
    outs = []
    for _ in range(2):  # the same inputs twice: bitwise the same
        a, layout = pk.ops.moe_dispatch_gemm(x, ids[me].to(dev), w1, capacity=capacity)
        outs.append(pk.ops.moe_gemm_combine(torch.nn.functional.silu(a), w2, layout, wt))
    if not torch.equal(outs[0], outs[1]):
        failures.append("two runs on the same inputs differ")
    outs[1].backward(dys[me].to(dev))
    ref = _reference(xs, ids, weights, kept, w1_all, w2_all, dys, me)
    got = [outs[1], x.grad, w1.grad, w2.grad, wt.grad]
    for name, g, r in zip(["out", "dx", "dw1", "dw2", "dweights"], got, ref, strict=True):
        if g is None:
            failures.append(f"{case}: {name} is None")
            continue
        if r is None:  # a rank with no tokens: the reference never used its (empty) x or weights
            r = torch.zeros(g.shape, dtype=torch.float64)
        problem = _check(f"{case} {name}", g.detach().float().cpu(), r.detach(), dtype, dev.type == "cuda")
        if problem and r.numel():
            failures.append(problem)
    if not torch.equal(layout.dropped.cpu(), ~kept[me]):
        failures.append(f"{case}: dropped pairs differ from the reference's")
    counts = torch.bincount(torch.cat([i.reshape(-1) for i in ids]), minlength=E)[mine]
    want = (counts - capacity).clamp(min=0) if capacity is not None else torch.zeros_like(counts)
    if not torch.equal(layout.overflow.cpu().long(), want):
        failures.append(f"{case}: overflow {layout.overflow.tolist()}, expected {want.tolist()}")
    pk.sync()
    return failures


@pytest.mark.parametrize("world", worlds("1,2,3,4"))
@pytest.mark.parametrize("case", CASES)
def test_moe_matches_the_reference(world, case):
    dtype = torch.float32 if case != "random" else torch.bfloat16
    for rank, failures in enumerate(pk.spawn(_case, world, case, dtype, None, timeout=900)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)


@pytest.mark.parametrize("world", worlds("1,2,3"))
@pytest.mark.parametrize("capacity", [3, 16])  # 8 tokens x 2 of 3W experts: some over 3, none over 16
def test_moe_capacity(world, capacity):
    for rank, failures in enumerate(pk.spawn(_case, world, "one_expert", torch.float32, capacity, timeout=900)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)


def _bad() -> list[str]:
    ctx = pk.context()
    dev, me, epr = ctx.device, ctx.local_rank, EXPERTS_PER_RANK
    E = epr * ctx.local_world_size
    gen = torch.Generator().manual_seed(7)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(6)]).to(dev)
    x = torch.randn(6, H, generator=gen).to(dev)
    w1, w2 = torch.randn(epr, H, INNER).to(dev), torch.randn(epr, INNER, H).to(dev)
    wt = torch.rand(6, TOP_K).to(dev)

    def out_of_range():
        bad = ids.clone()
        bad[0, 0] = E if me == 1 else bad[0, 0]
        pk.ops.moe_dispatch_gemm(x, bad, w1)

    def negative():
        bad = ids.clone()
        bad[1, 1] = -1 if me == 1 else bad[1, 1]
        pk.ops.moe_layout(bad, E)

    def hidden_differs():
        h = H + 8 * me
        pk.ops.moe_dispatch_gemm(torch.randn(6, h).to(dev), ids, torch.randn(epr, h, INNER).to(dev))

    def weights_shape():
        a, layout = pk.ops.moe_dispatch_gemm(x, ids, w1)
        pk.ops.moe_gemm_combine(a, w2, layout, wt[:, :1] if me == 1 else wt)

    messages = []
    for make in [out_of_range, negative, lambda: pk.ops.moe_layout(ids, E + 1), hidden_differs,
                 lambda: pk.ops.moe_dispatch_gemm(x.half() if me == 1 else x, ids, w1.half() if me == 1 else w1),
                 weights_shape, lambda: pk.ops.moe_dispatch_gemm(x[:5], ids, w1)]:
        try:
            make()
            pk.sync()
            messages.append("no error")
        except pk.PKError as e:
            messages.append(f"{type(e).__name__}: {e}")
    a, layout = pk.ops.moe_dispatch_gemm(x, ids, w1)  # and the job goes on
    out = pk.ops.moe_gemm_combine(a, w2, layout, wt)
    pk.sync()
    messages.append(f"shape {tuple(out.shape)}")
    return messages


def test_bad_input_raises_on_every_rank():
    expected = ["rank 1's topk_ids hold ids outside [0, 6)", "rank 1's topk_ids hold ids outside [0, 6)",
                "7 experts do not split evenly among 2 ranks", "ranks called it differently",
                "ranks called it differently", "topk_weights must be (6, 2)", "x has 5 tokens but the routing 6",
                "shape (6, 32)"]
    for rank, messages in enumerate(pk.spawn(_bad, 2, timeout=600)):
        for want, got in zip(expected, messages, strict=True):
            assert want in got, f"rank {rank}: expected {want!r} in {got!r}"


def _compiled() -> list[str]:
    ctx = pk.context()
    dev, epr = ctx.device, EXPERTS_PER_RANK
    gen = torch.Generator().manual_seed(shared_seed())
    E = epr * ctx.local_world_size
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(6)]).to(dev)
    x, wt = torch.randn(6, H, generator=gen).to(dev), torch.rand(6, TOP_K, generator=gen).to(dev)
    w1 = torch.randn(epr, H, INNER, generator=gen).to(dev).requires_grad_()
    w2 = torch.randn(epr, INNER, H, generator=gen).to(dev).requires_grad_()
    layout = pk.ops.moe_layout(ids, E)

    def layer(inp):
        a, _ = pk.ops.moe_dispatch_gemm(inp, layout, w1)
        return pk.ops.moe_gemm_combine(torch.nn.functional.silu(a), w2, layout, wt).square().sum()

    grads = []
    for fn in (torch.compile(layer, backend="aot_eager", fullgraph=True), layer):
        w1.grad = w2.grad = None
        leaf = x.clone().requires_grad_()
        fn(leaf).backward()
        grads.append([leaf.grad, w1.grad, w2.grad])
    pk.sync()
    return [f"compiled gradient {i} differs" for i, (a, b) in enumerate(zip(*grads, strict=True))
            if not torch.equal(a, b)]


def test_torch_compile_traces_the_ops():
    for rank, failures in enumerate(pk.spawn(_compiled, 2, timeout=600)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)


def _fast_reference(xs, ids, weights, kept, w1, w2):
    """Every rank's output in float64 on the device, expert by expert (for the GPU's larger sizes); autograd
    gives the gradients."""
    x, idx = torch.cat(xs), torch.cat(ids)
    wt, keep = torch.cat(weights), torch.cat(kept).to(x.device)
    out = torch.zeros(x.shape[0], w2.shape[2], dtype=torch.float64, device=x.device)
    for e in range(w1.shape[0]):
        tok, j = torch.nonzero((idx == e) & keep, as_tuple=True)
        y = torch.nn.functional.silu(x[tok] @ w1[e]) @ w2[e]
        out = out.index_add(0, tok, wt[tok, j][:, None] * y)
    return out.split([t.shape[0] for t in xs])


def _gpu_moe(replays: int) -> list[str]:
    """bf16 against float64 at sizes of many tiles, forward and every gradient, dropless; then the capacity mode
    (layout, dispatch, SiLU, combine) captured in one CUDA graph and replayed with new routings and tokens."""
    ctx = pk.context()
    world, me, dev, failures = ctx.local_world_size, ctx.local_rank, ctx.device, []
    bf16, epr, k, hid, inner, T = torch.bfloat16, 4, 2, 256, 384, 300
    E = epr * world
    mine = slice(me * epr, (me + 1) * epr)

    def draw(skewed: bool):
        gen = torch.Generator().manual_seed(shared_seed())
        probs = torch.arange(1, E + 1, dtype=torch.float64) ** (-1.2 if skewed else 0.0)
        ids = [torch.stack([torch.multinomial(probs, k, generator=gen) for _ in range(T)]) for _ in range(world)]
        xs = [torch.randn(T, hid, generator=gen).to(bf16) for _ in range(world)]
        weights = [torch.rand(T, k, generator=gen) + 0.1 for _ in range(world)]
        return [i.to(dev) for i in ids], [x.to(dev) for x in xs], [w.to(dev) for w in weights]

    gen = torch.Generator().manual_seed(shared_seed())
    w1_all = (torch.randn(E, hid, inner, generator=gen) / hid ** 0.5).to(bf16).to(dev)
    w2_all = (torch.randn(E, inner, hid, generator=gen) / inner ** 0.5).to(bf16).to(dev)
    ids, xs, weights = draw(skewed=True)
    gen = torch.Generator().manual_seed(shared_seed())
    dys = [torch.randn(T, hid, generator=gen).to(bf16).to(dev) for _ in range(world)]
    x, wt = xs[me].clone().requires_grad_(), weights[me].clone().requires_grad_()
    w1, w2 = w1_all[mine].clone().requires_grad_(), w2_all[mine].clone().requires_grad_()
    a, layout = pk.ops.moe_dispatch_gemm(x, ids[me], w1)
    out = pk.ops.moe_gemm_combine(torch.nn.functional.silu(a), w2, layout, wt)
    out.backward(dys[me])
    leaves = [t.double().requires_grad_() for t in (*xs, w1_all, w2_all, *weights)]
    ref_xs, (rw1, rw2), ref_wt = leaves[:world], leaves[world:world + 2], leaves[world + 2:]
    kept = [torch.ones(T, k, dtype=torch.bool) for _ in range(world)]
    refs = _fast_reference(ref_xs, ids, ref_wt, kept, rw1, rw2)
    sum((r * d.double()).sum() for r, d in zip(refs, dys, strict=True)).backward()
    for name, got, ref in [("out", out, refs[me]), ("dx", x.grad, ref_xs[me].grad), ("dw1", w1.grad, rw1.grad[mine]),
                           ("dw2", w2.grad, rw2.grad[mine]), ("dweights", wt.grad, ref_wt[me].grad)]:
        problem = check_close(f"bf16 {name}", got.float(), ref.detach(), bf16, "gemm")
        if problem:
            failures.append(problem)

    # serving: a static capacity, captured once, replayed with new routings
    capacity = T * k * world // E  # the balanced share: skewed routings overflow
    static_ids, static_x, static_wt = ids[me].clone(), xs[me].clone(), weights[me].clone()
    w1d, w2d = w1_all[mine].contiguous(), w2_all[mine].contiguous()

    def serve():
        lay = pk.ops.moe_layout(static_ids, E, capacity=capacity)
        act, _ = pk.ops.moe_dispatch_gemm(static_x, lay, w1d)
        return pk.ops.moe_gemm_combine(torch.nn.functional.silu(act), w2d, lay, static_wt), lay

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        serve()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        served, lay = serve()
    for step in range(replays):
        ids, xs, weights = draw(skewed=step % 2 == 1)
        for buf, new in ((static_ids, ids[me]), (static_x, xs[me]), (static_wt, weights[me])):
            buf.copy_(new)
        served.fill_(float("nan"))
        graph.replay()
        if step % 10 in (0, 1):
            kept = reference_routing([i.cpu() for i in ids], E, capacity)
            with torch.no_grad():
                ref = _fast_reference([t.double() for t in xs], ids, [w.double() for w in weights], kept,
                                      w1_all.double(), w2_all.double())[me]
            problem = check_close(f"replay {step} out", served.float(), ref, bf16, "gemm")
            if problem:
                failures.append(problem)
            if not torch.equal(lay.dropped.cpu(), ~kept[me]):
                failures.append(f"replay {step}: dropped pairs differ from the reference's")
    del graph
    pk.sync()
    return failures


@pytest.mark.gpu
@pytest.mark.parametrize("world", worlds("2,4"))
def test_gpu_bf16_and_capacity_graph_replays(world):
    for rank, failures in enumerate(pk.spawn(_gpu_moe, world, 100, timeout=600)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)


def _inside_a_module() -> list[str]:
    """A module that builds its layout in forward and returns only the output (the layout is not held by the
    caller), with x needing a gradient on rank 0 only: the backward still runs on every rank, and w1's gradient
    equals the one from a run where every x needs one."""
    ctx = pk.context()
    dev, me, epr = ctx.device, ctx.local_rank, EXPERTS_PER_RANK
    gen = torch.Generator().manual_seed(shared_seed())
    E = epr * ctx.local_world_size
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(6)]).to(dev)
    x, wt = torch.randn(6, H, generator=gen).to(dev), torch.rand(6, TOP_K, generator=gen).to(dev)

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = torch.nn.Parameter(torch.randn(epr, H, INNER, generator=gen).to(dev))
            self.w2 = torch.nn.Parameter(torch.randn(epr, INNER, H, generator=gen).to(dev))

        def forward(self, tokens):
            a, _ = pk.ops.moe_dispatch_gemm(tokens, ids, self.w1)
            return pk.ops.moe_gemm_combine(torch.nn.functional.silu(a), self.w2, _, wt)

    model, grads = Experts(), []
    for everyone in (True, False):
        model.zero_grad()
        model(x.clone().requires_grad_(everyone or me == 0)).square().sum().backward()
        grads.append(model.w1.grad.clone())
    pk.sync()
    return [] if torch.equal(grads[0], grads[1]) else ["w1's gradient changed with who needs dx"]


@pytest.mark.parametrize("world", worlds("2"))
def test_layout_held_by_autograd_and_collective_backward(world):
    for rank, failures in enumerate(pk.spawn(_inside_a_module, world, timeout=600)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)

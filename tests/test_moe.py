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
from parallelkittens.testing import check_close, shared_seed

CASES = ("random", "one_expert", "empty_experts", "one_rank", "ragged")
H, I, TOP_K, EXPERTS_PER_RANK = 32, 48, 2, 3


def _routing(case: str, gen: torch.Generator, world: int, tokens: list[int]) -> list[torch.Tensor]:
    E = EXPERTS_PER_RANK * world
    ids = []
    for T in tokens:
        if case == "one_rank":  # both experts of a token on one rank
            rank = torch.randint(0, world, (T, 1), generator=gen)
            first = torch.randint(0, EXPERTS_PER_RANK - 1, (T, 1), generator=gen)
            pick = torch.cat([first, first + 1], 1) + rank * EXPERTS_PER_RANK
        else:
            pick = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(T)]) if T else \
                torch.zeros(0, TOP_K, dtype=torch.long)
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
    return outs[me], xs[me].grad, w1.grad[me * epr:(me + 1) * epr], w2.grad[me * epr:(me + 1) * epr], \
        weights[me].grad


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
    w1_all = (torch.randn(E, H, I, generator=gen) / H ** 0.5).to(dtype)
    w2_all = (torch.randn(E, I, H, generator=gen) / I ** 0.5).to(dtype)
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
        problem = check_close(f"{case} {name}", g.detach().float().cpu(), r.detach(), dtype, "gemm")
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

"""pk.nn's tensor-parallel layers against the unsharded model in float64: forward and every gradient (input,
weights, biases) of an MLP, of a fused two-output column layer (gated MLP), of the variants without the gather or
the scatter; state_dict; from_linear and parallelize; torch.compile; bad input naming the layer. Worlds 1 to 4."""

import pytest
import torch
from conftest import worlds

import parallelkittens as pk
from parallelkittens.testing import check_close, shared_seed

BF16 = torch.bfloat16


def _linear(seed: int, i: int, din: int, dout: int) -> torch.nn.Linear:
    """A float32 torch.nn.Linear whose values are bf16 numbers, the same on every rank."""
    gen = torch.Generator().manual_seed(seed * 31 + i)
    layer = torch.nn.Linear(din, dout)
    with torch.no_grad():
        layer.weight.copy_((torch.randn(dout, din, generator=gen) / din ** 0.5).to(BF16).float())
        layer.bias.copy_(torch.randn(dout, generator=gen).to(BF16).float())
    return layer


def _data(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(BF16)


def _mine(x: torch.Tensor) -> torch.Tensor:
    ctx = pk.context()
    n = x.shape[0] // ctx.local_world_size
    return x[ctx.local_rank * n:(ctx.local_rank + 1) * n]


def _compare(failures: list[str], what: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    problem = check_close(what, got.detach().float().cpu(), ref.detach(), BF16, "gemm")
    if problem:
        failures.append(problem)


def _mlp_cases() -> list[str]:
    ctx = pk.context()
    world, me, dev, failures = ctx.local_world_size, ctx.local_rank, ctx.device, []
    seed = shared_seed()
    T, d, h = 12 * world, 32, 16 * world  # T/W = 12 rows per rank: not a multiple of any tile
    up, down, gate = _linear(seed, 0, d, h), _linear(seed, 1, h, d), _linear(seed, 2, d, h)
    x, dy = _data(seed + 1, T, d), _data(seed + 2, T, d)
    part = slice(me * h // world, (me + 1) * h // world)

    def reference(gated: bool):
        u, dn, g = (torch.nn.Linear(m.in_features, m.out_features).double() for m in (up, down, gate))
        for dst, src in ((u, up), (dn, down), (g, gate)):
            dst.load_state_dict({k: v.double() for k, v in src.state_dict().items()})
        xr = x.detach().double().requires_grad_()
        hidden = torch.nn.functional.silu(g(xr)) * u(xr) if gated else torch.nn.functional.silu(u(xr))
        out = dn(hidden)
        (out * dy.double()).sum().backward()
        return out, xr.grad, u, dn, g

    # column -> silu -> row, with every option of the column layer (a smooth activation: relu's mask would flip
    # where the bf16 pre-activation and the float64 one straddle zero, which no bound covers)
    for options in ({}, {"save_gathered_input": False}):
        col = pk.nn.ColumnParallelLinear.from_linear(up, **options)
        row = pk.nn.RowParallelLinear.from_linear(down)
        xl = _mine(x).clone().to(dev).requires_grad_()
        out = row(torch.nn.functional.silu(col(xl)))
        (out.float() * _mine(dy).to(dev).float()).sum().backward()
        ref, dx, u, dn, _ = reference(False)
        what = f"mlp {options}"
        _compare(failures, f"{what} out", out, _mine(ref))
        _compare(failures, f"{what} dx", xl.grad, _mine(dx))
        _compare(failures, f"{what} up.weight.grad", col.weight.grad, u.weight.grad[part])
        _compare(failures, f"{what} up.bias.grad", col.bias.grad, u.bias.grad[part])
        _compare(failures, f"{what} down.weight.grad", row.weight.grad, dn.weight.grad[:, part])
        _compare(failures, f"{what} down.bias.grad", row.bias.grad, dn.bias.grad)

    # gate and up fused into one column layer (one gather): silu(gate) * up -> row
    fused = pk.nn.ColumnParallelLinear.from_linear([gate, up])
    row = pk.nn.RowParallelLinear.from_linear(down)
    xl = _mine(x).clone().to(dev).requires_grad_()
    g_out, u_out = fused(xl)
    out = row(torch.nn.functional.silu(g_out) * u_out)
    (out.float() * _mine(dy).to(dev).float()).sum().backward()
    ref, dx, u, dn, g = reference(True)
    _compare(failures, "gated out", out, _mine(ref))
    _compare(failures, "gated dx", xl.grad, _mine(dx))
    local = h // world
    _compare(failures, "gated gate.weight.grad", fused.weight.grad[:local], g.weight.grad[part])
    _compare(failures, "gated up.weight.grad", fused.weight.grad[local:], u.weight.grad[part])
    _compare(failures, "gated fused bias grad", fused.bias.grad, torch.cat([g.bias.grad[part], u.bias.grad[part]]))
    _compare(failures, "gated down.weight.grad", row.weight.grad, dn.weight.grad[:, part])

    # the input whole on every rank, the output whole on every rank
    col = pk.nn.ColumnParallelLinear.from_linear(up, gather_input=False)
    row = pk.nn.RowParallelLinear.from_linear(down, scatter_output=False)
    xw = x.clone().to(dev).requires_grad_()
    out = row(torch.nn.functional.silu(col(xw)))
    (out.float() * dy.to(dev).float()).sum().backward()
    ref, dx, u, dn, _ = reference(False)
    _compare(failures, "whole out", out, ref)
    _compare(failures, "whole dx", xw.grad, dx)
    _compare(failures, "whole up.weight.grad", col.weight.grad, u.weight.grad[part])
    _compare(failures, "whole down.bias.grad", row.bias.grad, dn.bias.grad)
    pk.sync()
    return failures


@pytest.mark.parametrize("world", worlds("1,2,3,4"))
def test_layers_match_the_unsharded_model_in_float64(world):
    for rank, failures in enumerate(pk.spawn(_mlp_cases, world, timeout=900)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)


def _state_and_parallelize() -> list[str]:
    ctx = pk.context()
    world, dev, failures = ctx.local_world_size, ctx.device, []
    seed = shared_seed()
    model = torch.nn.Sequential(_linear(seed, 0, 16, 8 * world), torch.nn.SiLU(), _linear(seed, 1, 8 * world, 16))
    x = _data(seed + 1, 4 * world, 16)
    ref = model.double()(x.double())
    model.float()
    pk.nn.parallelize(model, {"0": "colwise", "2": "rowwise"})
    if not isinstance(model[0], pk.nn.ColumnParallelLinear) or not isinstance(model[2], pk.nn.RowParallelLinear):
        failures.append(f"parallelize left {model}")
    out = model(_mine(x).to(dev))
    _compare(failures, "parallelized", out, _mine(ref))
    state = model.state_dict()
    if state["0.weight"].shape != (8, 16) or state["2.weight"].shape != (16, 8):
        failures.append(f"state_dict shapes {state['0.weight'].shape}, {state['2.weight'].shape}: not the shards")
    fresh = torch.nn.Sequential(pk.nn.ColumnParallelLinear(16, 8 * world), torch.nn.SiLU(),
                                pk.nn.RowParallelLinear(8 * world, 16))
    fresh.load_state_dict(state)
    if any(not torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), state.values(), strict=True)):
        failures.append("load_state_dict did not restore the shards")
    _compare(failures, "loaded from the state_dict", fresh(_mine(x).to(dev)), _mine(ref))
    pk.sync()
    return failures


@pytest.mark.parametrize("world", worlds("1,2,4"))
def test_state_dict_round_trip_and_parallelize(world):
    for rank, failures in enumerate(pk.spawn(_state_and_parallelize, world, timeout=600)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)


def _compiled() -> list[str]:
    ctx = pk.context()
    seed = shared_seed()
    col = pk.nn.ColumnParallelLinear.from_linear(_linear(seed, 0, 16, 16))
    row = pk.nn.RowParallelLinear.from_linear(_linear(seed, 1, 16, 16))
    x = _data(seed, 8, 16).to(ctx.device)

    def step(inp):
        return row(torch.nn.functional.silu(col(inp))).float().square().sum()

    grads = []
    for fn in (torch.compile(step, backend="aot_eager", fullgraph=True), step):
        for p in (*col.parameters(), *row.parameters()):
            p.grad = None
        leaf = x.clone().requires_grad_()
        fn(leaf).backward()
        grads.append([leaf.grad, col.weight.grad, row.weight.grad, row.bias.grad])
    pk.sync()
    return [f"compiled gradient {i} differs" for i, (a, b) in enumerate(zip(*grads, strict=True))
            if not torch.equal(a, b)]


def test_torch_compile_traces_the_layers():
    for rank, failures in enumerate(pk.spawn(_compiled, 2)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)


def _bad() -> list[str]:
    ctx = pk.context()
    dev, me = ctx.device, ctx.rank
    col = pk.nn.ColumnParallelLinear(16, 16)
    row = pk.nn.RowParallelLinear(16, 16)
    messages = []
    for make in [lambda: pk.nn.ColumnParallelLinear(16, 15), lambda: pk.nn.RowParallelLinear(15, 16),
                 lambda: col(torch.ones(4, 16, device="meta", dtype=BF16)),
                 lambda: col(torch.ones(4, 16, device=dev)),  # float32 into a bf16 layer
                 lambda: col(torch.ones(4 + 2 * me, 16, device=dev, dtype=BF16)),  # rows differ between ranks
                 lambda: row(torch.ones(5, 8, device=dev, dtype=BF16)),  # 5 rows do not divide among 2 ranks
                 lambda: col(torch.ones(2, 4, 16, device=dev, dtype=BF16)),  # not 2-D
                 lambda: pk.nn.parallelize(torch.nn.Sequential(torch.nn.ReLU()), {"0": "colwise"})]:
        try:
            make()
            pk.sync()
            messages.append("no error")
        except pk.PKError as e:
            messages.append(f"{type(e).__name__}: {e}")
    return messages


def test_bad_input_names_the_layer_on_every_rank():
    expected = ["ColumnParallelLinear: output features 15 do not divide among 2 ranks",
                "RowParallelLinear: input features 15 do not divide among 2 ranks",
                "ColumnParallelLinear: the input is on meta", "ColumnParallelLinear: the input is torch.float32",
                "ColumnParallelLinear: all_gather_matmul: ranks called it differently",
                "RowParallelLinear: 5 rows do not divide among 2 ranks",
                "ColumnParallelLinear: the input must be a 2-D",
                "'0' is a ReLU, not a torch.nn.Linear"]
    for rank, messages in enumerate(pk.spawn(_bad, 2)):
        for want, got in zip(expected, messages, strict=True):
            assert want in got, f"rank {rank}: expected {want!r} in {got!r}"


def _main_grad() -> list[str]:
    ctx = pk.context()
    seed = shared_seed()
    col = pk.nn.ColumnParallelLinear.from_linear(_linear(seed, 0, 16, 16))
    x = _data(seed, 8, 16).to(ctx.device)
    col(x).float().sum().backward()
    plain = col.weight.grad.float().clone()
    col.weight.grad = None
    col.weight.main_grad = torch.zeros(col.weight.shape, dtype=torch.float32, device=ctx.device)
    for _ in range(2):
        col(x).float().sum().backward()
    failures = [] if col.weight.grad is None else ["the gradient went to .grad too"]
    if not torch.equal(col.weight.main_grad, 2 * plain):
        failures.append("main_grad does not hold the two steps' gradients")
    pk.sync()
    return failures


def test_gradients_accumulate_into_main_grad():
    for rank, failures in enumerate(pk.spawn(_main_grad, 2)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)


def _init_and_frozen() -> list[str]:
    ctx = pk.context()
    me, world, failures = ctx.local_rank, ctx.local_world_size, []
    seed = shared_seed()
    torch.manual_seed(seed)  # the same seed on every rank: the shards come from one full draw
    col = pk.nn.ColumnParallelLinear(16, 8 * world)
    torch.manual_seed(seed)
    full = torch.empty(8 * world, 16, dtype=BF16, device=ctx.device).uniform_(-0.25, 0.25)
    if not torch.equal(col.weight.detach(), full[me * 8:(me + 1) * 8]):
        failures.append("the column shard is not its rows of the full draw")
    torch.manual_seed(seed + me)  # different seeds: the replicated bias is still rank 0's on every rank
    row = pk.nn.RowParallelLinear(8 * world, 16)
    biases = [torch.empty_like(row.bias) for _ in range(world)]
    torch.distributed.all_gather(biases, row.bias.detach(), group=ctx.cpu_group)
    if not all(torch.equal(b, biases[0]) for b in biases):
        failures.append("the row layer's bias differs between ranks")
    # frozen weights: only the input and the biases get gradients, the same as with trainable weights
    x = _data(seed, 4 * world, 16).to(ctx.device)
    grads = []
    for frozen in (False, True):
        for p in (col.weight, row.weight):
            p.requires_grad_(not frozen)
            p.grad = None
        leaf = x.clone().requires_grad_()
        row(torch.nn.functional.silu(col(leaf))).float().square().sum().backward()
        grads.append((leaf.grad, col.bias.grad.clone(), row.bias.grad.clone()))
        col.bias.grad = row.bias.grad = None
    if col.weight.grad is not None or row.weight.grad is not None:
        failures.append("a frozen weight got a gradient")
    # bit for bit: the fused reduce-scatter sums its shares in rank order, whatever order they land in
    for name, a, b in zip(("input", "column bias", "row bias"), *grads, strict=True):
        if not torch.equal(a, b):
            off = check_close(name, b, a, BF16) or "in the last bits"
            failures.append(f"freezing the weights changed the {name} gradient: {off}")
    pk.sync()
    return failures


@pytest.mark.parametrize("world", worlds("1,2"))
def test_initialisation_and_frozen_weights(world):
    for rank, failures in enumerate(pk.spawn(_init_and_frozen, world, timeout=600)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)


def _against_dtensor() -> list[str]:
    """torch's own tensor parallelism (DTensor's ColwiseParallel / RowwiseParallel, sequence-sharded input and
    output) on the same sharded MLP: outputs and gradients agree to bf16 precision."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    ctx = pk.context()
    world, failures = ctx.local_world_size, []
    seed = shared_seed()
    T, d, h = 8 * world, 32, 16 * world
    full = torch.nn.Sequential(_linear(seed, 0, d, h), torch.nn.SiLU(), _linear(seed, 1, h, d)).to(BF16)
    ours = pk.nn.parallelize(torch.nn.Sequential(*[m for m in full]), {"0": "colwise", "2": "rowwise"})
    x, dy = _mine(_data(seed + 1, T, d)), _mine(_data(seed + 2, T, d))
    theirs = torch.nn.Sequential(_linear(seed, 0, d, h), torch.nn.SiLU(), _linear(seed, 1, h, d)).to(BF16)
    mesh = DeviceMesh(ctx.device.type, list(range(world)))
    parallelize_module(theirs, mesh, {"0": ColwiseParallel(input_layouts=Shard(0)),
                                      "2": RowwiseParallel(output_layouts=Shard(0), use_local_output=True)})
    outs = []
    for model in (ours, theirs):
        leaf = x.to(ctx.device).requires_grad_()
        out = model(leaf)
        out.backward(dy.to(ctx.device))
        grads = [p.grad for p in (model[0].weight, model[0].bias, model[2].weight, model[2].bias)]
        outs.append([out, leaf.grad] + [g.to_local() if hasattr(g, "to_local") else g for g in grads])
    names = ["output", "input gradient", "column weight gradient", "column bias gradient", "row weight gradient",
             "row bias gradient"]
    for name, a, b in zip(names, *outs, strict=True):
        problem = check_close(name, a.detach().float().cpu(), b.detach().double().cpu(), BF16, "gemm")
        if problem:
            failures.append(problem)
    pk.sync()
    return failures


@pytest.mark.skipif(torch.cuda.is_available(), reason="DTensor on gloo: the CPU run checks it")
@pytest.mark.parametrize("world", worlds("2,4"))
def test_layers_agree_with_torch_tensor_parallel(world):
    for rank, failures in enumerate(pk.spawn(_against_dtensor, world, timeout=600)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)


def _graph_step(replays: int) -> list[str]:
    """A training step (forward and backward of column -> SiLU -> row) captured in one CUDA graph, replayed with
    new inputs: every replay's output and gradients match an eager step's on the same inputs, within bf16's bound
    (the weight gradients are cuBLAS's, which need not pick the same algorithm under capture)."""
    ctx = pk.context()
    seed, failures = shared_seed(), []
    d, h, T = 256, 512 * ctx.local_world_size // 2, 384
    col = pk.nn.ColumnParallelLinear.from_linear(_linear(seed, 0, d, h).to(BF16))
    row = pk.nn.RowParallelLinear.from_linear(_linear(seed, 1, h, d).to(BF16))
    params = [*col.parameters(), *row.parameters()]
    x = torch.randn(T // ctx.local_world_size, d, device=ctx.device, dtype=BF16, requires_grad=True)

    def step():
        for p in params:
            p.grad = None
        x.grad = None
        out = row(torch.nn.functional.silu(col(x)))
        out.float().square().sum().backward()
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    captured = [out, x.grad, *[p.grad for p in params]]
    for i in range(replays):
        with torch.no_grad():
            x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + i)).to(x.device, BF16))
        graph.replay()
        if i % 20 == 0:
            got = [t.clone() for t in captured]
            eager = [step(), x.grad, *[p.grad for p in params]]
            names = ["out", "dx", "column dw", "column db", "row dw", "row db"]
            failures += [f"replay {i}: {p}" for p in (check_close(n, a.float(), b.double(), BF16, "gemm")
                                                      for n, a, b in zip(names, got, eager, strict=True)) if p]
    del graph
    pk.sync()
    return failures


@pytest.mark.gpu
@pytest.mark.parametrize("world", worlds("2,4"))
def test_gpu_training_step_in_a_cuda_graph(world):
    for rank, failures in enumerate(pk.spawn(_graph_step, world, 100, timeout=600)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)


class _MyRows(torch.autograd.Function):
    """Forward: this rank's block of rows (dim 0) or columns (dim 1) of a tensor every rank holds whole. Backward:
    the whole tensor's gradient, every rank's block in place (an all_reduce of the zero-padded block)."""

    @staticmethod
    def forward(ctx, full: torch.Tensor, dim: int) -> torch.Tensor:
        c = pk.context()
        n = full.shape[dim] // c.local_world_size
        ctx.dim, ctx.start, ctx.shape = dim, c.local_rank * n, full.shape
        return full.narrow(dim, ctx.start, n).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        padded = grad.new_zeros(ctx.shape)
        padded.narrow(ctx.dim, ctx.start, grad.shape[ctx.dim]).copy_(grad)
        return _gather_sum(padded), None


def _gather_sum(t: torch.Tensor) -> torch.Tensor:
    return pk.ops.all_gather(t.contiguous().view(torch.int64)[None], 0).view(torch.float64).sum(0)


class _EveryRanksRows(torch.autograd.Function):
    """Forward: every rank's (T/W, n) block, concatenated (the whole output, the same on every rank). Backward:
    this rank's block of the gradient."""

    @staticmethod
    def forward(ctx, mine: torch.Tensor) -> torch.Tensor:
        ctx.rows, ctx.me = mine.shape[0], pk.context().local_rank
        return pk.ops.all_gather(mine.contiguous().view(torch.int64), 0).view(torch.float64)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.me * ctx.rows:(ctx.me + 1) * ctx.rows]


def _gradcheck() -> list[str]:
    """torch.autograd.gradcheck of each layer, float64, as one function of every rank's inputs (the same on every
    rank, so that every rank perturbs the same element at once): it checks the backward formulas, collectives
    included."""
    from parallelkittens.ops.gemm.parallel_linear import column_parallel_linear, row_parallel_linear

    world, failures = pk.context().local_world_size, []
    gen = torch.Generator().manual_seed(shared_seed())
    T, din, dout = 2 * world, 3, 2 * world
    f64 = torch.float64

    def column(x, w_t, b):  # x (T, in) whole; w_t (in, out), b (out,): this rank's columns of each
        return _EveryRanksRows.apply(column_parallel_linear(_MyRows.apply(x, 0), _MyRows.apply(w_t, 1),
                                                            _MyRows.apply(b, 0)))

    def row(x, w_t, b):  # x (T, in): this rank's columns; w_t (in, out): its rows; b (out,) replicated
        return _EveryRanksRows.apply(row_parallel_linear(_MyRows.apply(x, 1), _MyRows.apply(w_t, 0), b))

    for name, fn, shapes in (("column", column, ((T, din), (din, dout), (dout,))),
                             ("row", row, ((T, dout), (dout, din), (din,)))):
        inputs = [torch.randn(s, generator=gen, dtype=f64).to(pk.context().device).requires_grad_() for s in shapes]
        try:
            torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)
        except Exception as e:  # noqa: BLE001 - report, do not leave the other ranks waiting
            failures.append(f"{name}: {str(e).splitlines()[0]}")
    pk.sync()
    return failures


@pytest.mark.parametrize("world", worlds("1,2"))
def test_gradcheck_in_float64(world):
    for rank, failures in enumerate(pk.spawn(_gradcheck, world, timeout=600)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)

"""Tensor-parallel MLP training step: ours beside torch's in the same run.

A Llama-3-70B MLP (hidden 8192, intermediate 28672, gated, no bias), sequence parallel: each rank holds T/W tokens.
One step is forward and backward (given the output's gradient). Ours: `pk.nn.ColumnParallelLinear` (gate and up
fused, one gather) -> SiLU(gate) * up -> `pk.nn.RowParallelLinear`. Torch's: torch.nn.Linear shards with
torch.distributed's autograd collectives around them (all-gather before, reduce-scatter after); at one rank,
plain torch.nn.Linear. And, at more than one rank where it runs, torch.compile with async tensor parallelism
(DTensor's ColwiseParallel / RowwiseParallel with inductor's micro-pipelining; symmetric memory, multicast off).
One rank per GPU. Goal on one GPU (issue 18): our step at most 1.03x torch.nn.Linear's.
"""

from __future__ import annotations

import gc

import torch

from .attention import _progress, _time_ms
from .plot import line_plot

HIDDEN, INTER = 8192, 28672
TOKENS = [4096, 8192, 16384, 32768]


class _Ours(torch.nn.Module):
    def __init__(self):
        super().__init__()
        import parallelkittens as pk

        self.gate_up = pk.nn.ColumnParallelLinear(HIDDEN, [INTER, INTER], bias=False)
        self.down = pk.nn.RowParallelLinear(INTER, HIDDEN, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x)
        return self.down(torch.nn.functional.silu(gate) * up)


class _Torch(torch.nn.Module):
    """The same shards as torch.nn.Linear, with torch.distributed's autograd collectives."""

    def __init__(self, world: int, device):
        super().__init__()
        self.world = world
        self.gate_up = torch.nn.Linear(HIDDEN, 2 * INTER // world, bias=False, device=device, dtype=torch.bfloat16)
        self.down = torch.nn.Linear(INTER // world, HIDDEN, bias=False, device=device, dtype=torch.bfloat16)

    def forward(self, x):
        if self.world > 1:
            from torch.distributed import _functional_collectives as fc

            x = fc.all_gather_tensor_autograd(x, 0, torch.distributed.group.WORLD)
        gate, up = self.gate_up(x).chunk(2, dim=1)
        y = self.down(torch.nn.functional.silu(gate) * up)
        if self.world > 1:
            from torch.distributed import _functional_collectives as fc

            y = fc.reduce_scatter_tensor_autograd(y, "sum", 0, torch.distributed.group.WORLD)
        return y


def _async_tp(world: int, device):
    """(model, step) of torch.compile with async tensor parallelism on DTensor shards: gate and up fused in one
    column layer as ours and torch's are, compiled for this token count alone (no dynamic shapes)."""
    import torch._dynamo
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cuda", (world,))
    enable_symm_mem_for_group(mesh.get_group().group_name)
    torch._dynamo.reset()  # each token count compiles afresh, so the micro-pipelining pass sees static shapes
    model = torch.nn.ModuleDict({
        "gate_up": torch.nn.Linear(HIDDEN, 2 * INTER, bias=False, device=device, dtype=torch.bfloat16),
        "down": torch.nn.Linear(INTER, HIDDEN, bias=False, device=device, dtype=torch.bfloat16)})
    parallelize_module(model, mesh, {"gate_up": ColwiseParallel(input_layouts=Shard(0)),
                                     "down": RowwiseParallel(output_layouts=Shard(0))})

    def forward(x):
        gate, up = model["gate_up"](x).chunk(2, dim=-1)
        return model["down"](torch.nn.functional.silu(gate) * up)

    compiled = torch.compile(forward, dynamic=False)

    def step(x, dy) -> None:
        for p in model.parameters():
            p.grad = None
        compiled(x).backward(dy)

    return model, step


def _step(model: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor):
    def run() -> None:
        for p in model.parameters():
            p.grad = None
        model(x).backward(dy)

    return run


def _case(tokens: int) -> dict:
    import parallelkittens as pk

    ctx = pk.context()
    world, dev = ctx.local_world_size, ctx.device
    x = torch.randn(tokens // world, HIDDEN, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens // world, HIDDEN, device=dev, dtype=torch.bfloat16)
    flops = 3 * 2 * tokens * HIDDEN * 3 * INTER / world  # three GEMMs forward, twice that backward
    row = {"tokens": tokens, "hidden": HIDDEN, "intermediate": INTER}
    ours = _Ours()
    row["ours_ms"] = _time_ms(_step(ours, x, dy))
    del ours
    theirs = _Torch(world, dev)
    row["torch_ms"] = _time_ms(_step(theirs, x, dy))
    del theirs
    if world > 1:
        from torch._inductor import config as inductor

        before, inductor._micro_pipeline_tp = inductor._micro_pipeline_tp, True
        try:
            model, step = _async_tp(world, dev)
            row["async_tp_ms"] = _time_ms(lambda: step(x, dy))
            del model, step
        except Exception as e:  # noqa: BLE001 - recorded: where it does not run, the row says why
            row["async_tp_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        finally:
            inductor._micro_pipeline_tp = before
    row["ours_tflops"] = flops / row["ours_ms"] / 1e9
    row["torch_tflops"] = flops / row["torch_ms"] / 1e9
    row["ours_vs_torch"] = row["ours_ms"] / row["torch_ms"]
    return row


def _rank() -> list[dict]:
    import parallelkittens as pk

    rows = []
    for i, tokens in enumerate(TOKENS):
        try:
            rows.append(_case(tokens))
        except torch.OutOfMemoryError:
            rows.append({"tokens": tokens, "error": "out of memory"})
        gc.collect()
        torch.cuda.empty_cache()
        _progress("tp_mlp", i, len(TOKENS), f"T={tokens}")
    pk.sync()
    return rows


def bench_tp_mlp() -> dict:
    """Tensor-parallel Llama-3-70B MLP training step vs torch.nn.Linear + torch.distributed (and async TP)."""
    import parallelkittens as pk

    world = max(1, torch.cuda.device_count())
    rows = pk.spawn(_rank, world, backend="cuda", timeout=1800)[0]
    print(f"{'tokens':>7} {'ours ms':>9} {'torch ms':>9} {'asyncTP ms':>10} {'ours/torch':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['tokens']:>7} {r['error']}")
            continue
        print(f"{r['tokens']:>7} {r['ours_ms']:>9.2f} {r['torch_ms']:>9.2f} {r.get('async_tp_ms') or 0:>10.2f} "
              f"{r['ours_vs_torch']:>10.3f}")
    done = [r for r in rows if "ours_vs_torch" in r]
    goal = {}
    if world == 1 and done:
        worst = max(r["ours_vs_torch"] for r in done)
        goal = {"ours_vs_torch_max": worst, "target": 1.03, "pass": worst <= 1.03}
    return {"world_size": world, "unit": "ms per training step", "rows": rows, "goal": goal}


def plot_tp_mlp(record: dict, path: str) -> bool:
    series = {who: [(r["tokens"], r[f"{who}_tflops"]) for r in record["rows"] if f"{who}_tflops" in r]
              for who in ("ours", "torch")}
    return line_plot(path, f"TP MLP training step, {record['gpu']}, {record['world_size']} GPU(s)",
                     "tokens per step", "TFLOP/s per GPU", series)

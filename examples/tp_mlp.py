"""Train a tensor-parallel Llama-style MLP block (RMSNorm, gated MLP, residual) for a few steps with pk.nn's
layers, beside the same block built from torch.nn.Linear shards and torch.distributed collectives; print both
losses per step, whether they agree to bf16 precision, and the time per step of each.

    python examples/tp_mlp.py [--ranks 2] [--steps 5] [--tokens 64] [--hidden 64] [--intermediate 128]

Runs on whatever the machine has: CPU ranks (the interpreter), ranks sharing one GPU, or a GPU per rank.
Sequence parallel: each rank holds tokens/ranks rows. The RMSNorm weight is the same on every rank, so its
gradient is summed over the ranks after each backward (as data parallelism would), in both versions.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn

import parallelkittens as pk

# torch.distributed.nn.functional's collectives (the baseline's, differentiable on every backend) are deprecated
# in favour of functional collectives that not every backend and version here offers
warnings.filterwarnings("ignore", category=FutureWarning, message="torch.distributed.nn.functional")


class Block(nn.Module):
    """x + down(silu(gate(norm(x))) * up(norm(x))), on this rank's rows; gate and up fused in one column layer."""

    def __init__(self, norm: nn.RMSNorm, gate: nn.Linear, up: nn.Linear, down: nn.Linear):
        super().__init__()
        self.norm = norm
        self.gate_up = pk.nn.ColumnParallelLinear.from_linear([gate, up])
        self.down = pk.nn.RowParallelLinear.from_linear(down)

    def replicated(self) -> list[nn.Parameter]:
        return [self.norm.weight]  # (the row layer sums its bias's gradient itself)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(self.norm(x))
        return x + self.down(nn.functional.silu(gate) * up)


class TorchBlock(nn.Module):
    """The same block from torch.nn.Linear shards and torch.distributed's differentiable collectives."""

    def __init__(self, norm: nn.RMSNorm, gate: nn.Linear, up: nn.Linear, down: nn.Linear):
        super().__init__()
        ctx = pk.context()
        self.world, me = ctx.world_size, ctx.rank
        rows = slice(me * gate.out_features // self.world, (me + 1) * gate.out_features // self.world)
        self.norm = norm
        self.gate = nn.Linear(gate.in_features, rows.stop - rows.start, device=ctx.device, dtype=torch.bfloat16)
        self.up = nn.Linear(up.in_features, rows.stop - rows.start, device=ctx.device, dtype=torch.bfloat16)
        self.down = nn.Linear(rows.stop - rows.start, down.out_features, bias=False, device=ctx.device,
                              dtype=torch.bfloat16)
        self.down_bias = nn.Parameter(down.bias.detach().to(ctx.device, torch.bfloat16).clone())
        with torch.no_grad():
            for mine, full in ((self.gate, gate), (self.up, up)):
                mine.weight.copy_(full.weight[rows])
                mine.bias.copy_(full.bias[rows])
            self.down.weight.copy_(down.weight[:, rows])

    def replicated(self) -> list[nn.Parameter]:
        return [self.norm.weight, self.down_bias]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, me = x.shape[0], pk.context().rank
        h = torch.cat(dist_nn.all_gather(self.norm(x).contiguous()), 0)  # every rank's rows
        partial = self.down(nn.functional.silu(self.gate(h)) * self.up(h))
        return x + dist_nn.all_reduce(partial)[me * n:(me + 1) * n] + self.down_bias


def _train(model: nn.Module, x: torch.Tensor, target: torch.Tensor, steps: int, total_elements: int
           ) -> tuple[list[float], float]:
    """(the global loss before each step, seconds per step after the first)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, start = [], 0.0
    for step in range(steps):
        if step == 1:
            pk.sync()
            start = time.perf_counter()
        opt.zero_grad()
        loss = (model(x).float() - target.float()).square().sum() / total_elements  # this rank's share
        loss.backward()
        for p in model.replicated():  # the same on every rank, each rank's gradient from its rows: sum them
            dist.all_reduce(p.grad, group=pk.context().group)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=pk.context().group)
        losses.append(float(total))
    pk.sync()
    return losses, (time.perf_counter() - start) / max(steps - 1, 1)


def main(steps: int, tokens: int, hidden: int, intermediate: int) -> dict:
    ctx = pk.init()
    world, me, dev = ctx.world_size, ctx.rank, ctx.device
    gen = torch.Generator().manual_seed(0)  # the same full model and data on every rank

    def linear(din: int, dout: int) -> nn.Linear:
        layer = nn.Linear(din, dout)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(dout, din, generator=gen) / din ** 0.5)
            layer.bias.copy_(torch.randn(dout, generator=gen) / 10)
        return layer.to(torch.bfloat16)

    gate, up, down = linear(hidden, intermediate), linear(hidden, intermediate), linear(intermediate, hidden)
    x_full = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    target_full = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    rows = slice(me * tokens // world, (me + 1) * tokens // world)
    x, target = x_full[rows].to(dev), target_full[rows].to(dev)

    def norm() -> nn.RMSNorm:
        return nn.RMSNorm(hidden, device=dev, dtype=torch.bfloat16)

    ours = _train(Block(norm(), gate, up, down), x, target, steps, tokens * hidden)
    theirs = _train(TorchBlock(norm(), gate, up, down), x, target, steps, tokens * hidden)
    return {"ours": ours, "torch": theirs}


def _rank(steps: int, tokens: int, hidden: int, intermediate: int) -> dict:
    return main(steps, tokens, hidden, intermediate)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=128)
    args = parser.parse_args()
    if args.tokens % args.ranks:
        parser.error(f"--tokens {args.tokens} must divide among --ranks {args.ranks} (each rank holds tokens/ranks)")
    result = pk.spawn(_rank, args.ranks, args.steps, args.tokens, args.hidden, args.intermediate, timeout=1800)[0]
    (ours, ours_s), (theirs, theirs_s) = result["ours"], result["torch"]
    print(f"{'step':>4} {'pk.nn loss':>12} {'torch loss':>12}")
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        print(f"{step:>4} {a:>12.6f} {b:>12.6f}")
    agree = all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(ours, theirs, strict=True))
    print(f"time per step: pk.nn {ours_s * 1e3:.1f} ms, torch.nn.Linear + torch.distributed {theirs_s * 1e3:.1f} ms")
    print(f"losses agree to bf16 precision: {agree}")
    raise SystemExit(0 if agree else 1)

"""Where a small op's host time goes, on a GPU machine: each layer of `pk.ops.matmul` timed alone beside
`torch.matmul`, and of `pk.ops.all_gather` at 1 and 2 ranks, in µs of host time per call (median of rounds of
1000 calls, 50 at 2 ranks, `bench.collectives.host_us`).

    python scripts/diagnose_host.py [--out DIR]

Rows, from the whole call down: `pk.ops.matmul(a, b)`; the held plan with a new output and with `out=`; the
plan's bound launcher alone (encoded descriptors, C launcher); the plan's Python with the launch taken out;
`torch.empty` of the output; `torch.matmul` with and without `out=`. The differences say what each layer costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from parallelkittens.bench.collectives import host_us

ROUNDS, CALLS = 7, 1000


def _host_us(fn) -> float:
    return statistics.median(host_us(fn, CALLS) for _ in range(ROUNDS))


def _diagnose() -> list[dict]:
    import parallelkittens as pk

    rows = []
    for M, N, K in ((2048, 256, 2048), (2048, 2048, 256)):
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        plan = pk.ops.matmul.plan(a, b)
        launch = plan._launch
        cases = {
            "pk.ops.matmul(a, b)": lambda: pk.ops.matmul(a, b),  # noqa: B023
            "plan(a, b)": lambda: plan(a, b),  # noqa: B023
            "plan(a, b, out=c)": lambda: plan(a, b, out=c),  # noqa: B023
            "launcher(a, b, c)": lambda: launch(a, b, c),  # noqa: B023
            "torch.empty": lambda: torch.empty(M, N, device="cuda", dtype=torch.bfloat16),  # noqa: B023
            "torch.matmul(a, b)": lambda: torch.matmul(a, b),  # noqa: B023
            "torch.matmul(a, b, out=c)": lambda: torch.matmul(a, b, out=c),  # noqa: B023
        }
        row = {"shape": f"{M}x{N}x{K}"}
        for name, fn in cases.items():
            row[name] = _host_us(fn)
        plan._launch = lambda *values: None
        row["plan(a, b, out=c), no launch"] = _host_us(lambda: plan(a, b, out=c))  # noqa: B023
        plan._launch = launch
        rows.append(row)
    return rows


def _diagnose_collective() -> list[dict]:
    """all_gather of 4 KB on a plain tensor, layer by layer: at one rank, or at 2 sharing the GPU (where each call
    waits for the GPU to switch between the ranks' processes, so fewer calls per round)."""
    import parallelkittens as pk

    ctx = pk.context()
    calls = CALLS if ctx.local_world_size == 1 else 50
    x = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(2048 * ctx.local_world_size, device="cuda", dtype=torch.bfloat16)
    plan = pk.ops.all_gather.plan(x)
    pull = plan._pull
    src, handle = plan.source(x)  # as the plan's call does
    cases = {
        "pk.ops.all_gather(x)": lambda: pk.ops.all_gather(x),
        "plan(x)": lambda: plan(x),
        "plan(x, out=o)": lambda: plan(x, out=out),
        "launcher(x, src, handle, o)": lambda: pull(x, src, handle, out),
        "torch.empty": lambda: torch.empty(2048 * ctx.local_world_size, device="cuda", dtype=torch.bfloat16),
    }
    row = {"shape": f"all_gather 4096 B, {ctx.local_world_size} rank(s), {ctx.backend}"}
    for name, fn in cases.items():
        row[name] = statistics.median(host_us(fn, calls) for _ in range(ROUNDS))
    plan._pull = lambda *values: None
    row["plan(x, out=o), no launch"] = statistics.median(host_us(lambda: plan(x, out=out), calls)
                                                         for _ in range(ROUNDS))
    plan._pull = pull
    pk.sync()
    return [row]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for diagnose_host.json")
    args = parser.parse_args()
    import parallelkittens as pk

    rows = pk.spawn(_diagnose, 1, backend="cuda")[0]
    rows += pk.spawn(_diagnose_collective, 1, backend="cuda")[0]
    rows += max(pk.spawn(_diagnose_collective, 2, backend="cuda-shared"),
                key=lambda ranks: ranks[0]["pk.ops.all_gather(x)"])  # the slower rank's
    for row in rows:
        print(f"== {row['shape']} (host µs per call)")
        for name, us in row.items():
            if name != "shape":
                print(f"  {name:<34} {us:6.2f}")
    if args.out:
        import pathlib

        pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(args.out) / "diagnose_host.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

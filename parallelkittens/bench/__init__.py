"""Benchmarks: ours beside the baselines in one run, results as JSON (machine, versions, date, world size).

``python -m parallelkittens bench <name>``; `BENCHMARKS` lists them. Timings are medians of
`triton.testing.do_bench` on the GPU (events, warm-up, L2 cleared between runs); with several ranks the
slowest rank's time counts. Benchmarks refuse to run without a GPU: interpreter timings mean nothing.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from collections.abc import Callable

from .attention import bench_attention, bench_ring_attention, bench_ulysses_attention, plot_attention
from .collectives import bench_collective, plot
from .fused import bench_fused, plot_fused
from .host import bench_host
from .matmul import bench_matmul
from .moe import bench_moe, plot_moe
from .runtime import bench_p2p, bench_runtime
from .settings import bench_settings
from .tp_mlp import bench_tp_mlp, plot_tp_mlp


def _collective(name: str) -> Callable[[], dict]:
    def run() -> dict:
        return bench_collective(name)

    run.__doc__ = f"{name}: 4 KB to 1 GB, ours beside torch.distributed (and symmetric memory), bf16"
    return run


def _fused(name: str) -> Callable[[], dict]:
    def run() -> dict:
        return bench_fused(name)

    run.__doc__ = f"{name}: TFLOP/s per GPU over the paper's sweep, beside torch.matmul + torch.distributed"
    return run


BENCHMARKS: dict[str, Callable[[], dict]] = {
    "runtime": bench_runtime,
    "host": bench_host,
    "p2p": bench_p2p,
    "matmul": bench_matmul,
    **{name: _collective(name) for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")},
    **{name: _fused(name) for name in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")},
    "attention": bench_attention,
    "ring_attention": bench_ring_attention,
    "ulysses_attention": bench_ulysses_attention,
    "moe": bench_moe,
    "tp_mlp": bench_tp_mlp,
}


def environment(world_size: int) -> dict:
    """Who ran what where: GPU, versions, date, world size; stored with every result."""
    import torch
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    return {
        "gpu": gpu, "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "world_size": world_size, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda, "nccl": nccl,
        "python": platform.python_version(), "host": platform.node(),
    }


def plot_record(record: dict, path: str) -> bool:
    """Draw a result's PNG (bandwidth against size for collectives, TFLOP/s against N for fused GEMMs) when
    matplotlib is installed; returns whether it wrote one."""
    name = record["benchmark"]
    if name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        done = plot(name, record, path)
    elif name in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
        done = plot_fused(name, record, path)
    elif name in ("attention", "ring_attention", "ulysses_attention"):
        done = plot_attention(name, record, path)
    elif name == "moe":
        done = plot_moe(record, path)
    elif name == "tp_mlp":
        done = plot_tp_mlp(record, path)
    else:
        return False
    if done:
        print(f"wrote {path}")
    return done


def run_benchmark(name: str, out_dir: str) -> int:
    """Run benchmark `name`, print its table, write ``<out_dir>/<name>-w<world>-<date>.json``."""
    import torch

    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    bench_settings()  # a bad benchmark variable fails here, before any rank starts
    if not torch.cuda.is_available():
        print("benchmarks need a GPU: interpreter timings mean nothing", file=sys.stderr)
        return 2
    result = BENCHMARKS[name]()
    env = environment(result.pop("world_size", 1))
    record = {"benchmark": name, **env, **result}
    os.makedirs(out_dir, exist_ok=True)
    stamp = env["date"][:10]
    path = os.path.join(out_dir, f"{name}-w{env['world_size']}-{stamp}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {path}")
    plot_record(record, path[:-5] + ".png")
    ok = all(row.get("pass", True) for row in record.get("rows", [])) and record.get("goal", {}).get("pass", True)
    return 0 if ok else 1

"""`python -m parallelkittens demo`: every primitive and op on 4 ranks at a small size, against PyTorch.

Uses what the machine has: a GPU per rank, else ranks sharing one GPU, else CPU ranks under the interpreter.
Rank 0 prints a progress line per check; the table comes last; the exit status is non-zero on any failure.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch

from .runtime.context import choose_backend, context
from .runtime.spawn import spawn
from .testing import TOLERANCE, CheckResult, Timer, rank_data, relative_error, shared_seed
from .testing.primitive_checks import CHECKS


def check_lcsc_example() -> CheckResult:
    """The template's worked example, all_gather(alpha * x), in bf16 with two communicator programs."""
    from .template.example import ScaledAllGather, reference_scaled_all_gather

    ctx = context()
    shape, dtype, alpha = (64, 96), torch.bfloat16, 1.5
    op = ScaledAllGather(shape, dtype, num_comm_programs=2)
    seed = shared_seed()
    with Timer() as t:
        out = op(rank_data(shape, dtype, seed, ctx.local_rank), alpha)
    ref = reference_scaled_all_gather([rank_data(shape, dtype, seed, r) for r in range(ctx.local_world_size)], alpha)
    err = relative_error(out, ref)
    return CheckResult("lcsc scaled_all_gather", f"{ctx.local_world_size * shape[0]}x{shape[1]}", err,
                       err <= TOLERANCE[dtype], t.ms)


def _collective_check(name: str, shape: tuple, dtype: torch.dtype, run, reference, exact: bool) -> CheckResult:
    ctx = context()
    seed = shared_seed()
    inputs = [rank_data(shape, dtype, seed, r) for r in range(ctx.local_world_size)]
    run(inputs[ctx.local_rank])  # warm-up: compiles, allocates the workspace
    with Timer() as t:
        out = run(inputs[ctx.local_rank])
    ref = reference(inputs, ctx.local_rank)
    err = relative_error(out, ref)
    ok = torch.equal(out.cpu(), ref.to(out.dtype).cpu()) if exact else err <= TOLERANCE[dtype]
    return CheckResult(name, "x".join(map(str, shape)), err, bool(ok), t.ms)


def check_all_reduce_op() -> CheckResult:
    """pk.ops.all_reduce, two-shot size, bf16."""
    from .ops import all_reduce
    from .ops.all_reduce import reference_all_reduce

    return _collective_check("ops.all_reduce", (300_001,), torch.bfloat16, all_reduce,
                             lambda xs, r: reference_all_reduce(xs), False)


def check_all_gather_op() -> CheckResult:
    """pk.ops.all_gather along dim 1."""
    from .ops import all_gather
    from .ops.all_gather import reference_all_gather

    return _collective_check("ops.all_gather dim 1", (8, 33, 16), torch.float32, lambda x: all_gather(x, 1),
                             lambda xs, r: reference_all_gather(xs, 1), True)


def check_reduce_scatter_op() -> CheckResult:
    """pk.ops.reduce_scatter along dim 1, fp16."""
    from .ops import reduce_scatter
    from .ops.reduce_scatter import reference_reduce_scatter

    return _collective_check("ops.reduce_scatter dim 1", (8, 4 * 24, 16), torch.float16,
                             lambda x: reduce_scatter(x, 1), lambda xs, r: reference_reduce_scatter(xs, r, 1), False)


def check_all_to_all_op() -> CheckResult:
    """pk.ops.all_to_all in the Ulysses layout (B, N/W, H, D) -> (B, N, H/W, D)."""
    from .ops import all_to_all
    from .ops.all_to_all import reference_all_to_all

    return _collective_check("ops.all_to_all ulysses", (2, 16, 8, 32), torch.bfloat16,
                             lambda x: all_to_all(x, 2, 1), lambda xs, r: reference_all_to_all(xs, r, 2, 1), True)


def _gemm_check(name: str, run, reference) -> CheckResult:
    ctx = context()
    seed = shared_seed()
    m, k, n, dtype = 64, 48, 80, torch.bfloat16
    a_parts = [rank_data((m, k), dtype, seed, r) for r in range(ctx.local_world_size)]
    b_parts = [rank_data((k, n), dtype, seed, 100 + r) for r in range(ctx.local_world_size)]
    run(a_parts, b_parts, ctx.local_rank)  # warm-up: compiles, allocates, tunes
    with Timer() as t:
        out = run(a_parts, b_parts, ctx.local_rank)
    err = relative_error(out, reference(a_parts, b_parts, ctx.local_rank))
    return CheckResult(name, "x".join(map(str, out.shape)), err, err <= 1e-2, t.ms)


def check_matmul_ops() -> list[CheckResult]:
    """The GEMM core and the three fused GEMMs, bf16."""
    from .ops import all_gather_matmul, matmul, matmul_all_reduce, matmul_reduce_scatter
    from .ops.all_gather_matmul import reference_all_gather_matmul
    from .ops.matmul_all_reduce import reference_matmul_all_reduce
    from .ops.matmul_reduce_scatter import reference_matmul_reduce_scatter

    return [
        _gemm_check("ops.matmul", lambda a, b, r: matmul(a[r], b[0]), lambda a, b, r: a[r].double() @ b[0].double()),
        _gemm_check("ops.all_gather_matmul", lambda a, b, r: all_gather_matmul(a[r], b[0]),
                    lambda a, b, r: reference_all_gather_matmul(a, b[0])),
        _gemm_check("ops.matmul_reduce_scatter", lambda a, b, r: matmul_reduce_scatter(a[r], b[r]),
                    reference_matmul_reduce_scatter),
        _gemm_check("ops.matmul_all_reduce", lambda a, b, r: matmul_all_reduce(a[r], b[r]),
                    lambda a, b, r: reference_matmul_all_reduce(a, b)),
    ]


CASES = {**CHECKS, "lcsc_example": check_lcsc_example, "ops.all_reduce": check_all_reduce_op,
         "ops.all_gather": check_all_gather_op, "ops.reduce_scatter": check_reduce_scatter_op,
         "ops.all_to_all": check_all_to_all_op, "ops.matmul*": check_matmul_ops}


def _rank(names: list[str]) -> list[dict]:
    ctx = context()
    rows = []
    for i, name in enumerate(names, 1):
        got = CASES[name]()
        for row in got if isinstance(got, list) else [got]:
            rows.append(dataclasses.asdict(row))
            if ctx.rank == 0:
                print(f"[{i}/{len(names)}] {row.op:<26} {'ok' if row.ok else 'FAIL'}  {row.time_ms:8.1f} ms",
                      file=sys.stderr, flush=True)
    return rows


def run(ranks: int = 4, backend: str | None = None) -> int:
    """Run every case on `ranks` ranks, print the table, return the exit status (0 when all pass)."""
    backend = choose_backend(ranks, backend)
    os.environ["PK_DEBUG"] = "1"  # every wait bounded: a protocol bug shows as an error, not a hang
    names = list(CASES)
    print(f"parallelkittens demo: {len(names)} groups of checks on {ranks} ranks, backend {backend}",
          file=sys.stderr)
    start = time.perf_counter()
    per_rank = spawn(_rank, ranks, names, backend=backend)
    print(f"{'op':<26} {'backend':<12} {'ranks':>5} {'shape':>10} {'max error':>10} {'pass':>5} {'time ms':>9}")
    failed = 0
    for i in range(len(per_rank[0])):
        rows = [r[i] for r in per_rank]
        ok = all(r["ok"] for r in rows)
        failed += not ok
        print(f"{rows[0]['op']:<26} {backend:<12} {ranks:>5} {rows[0]['shape']:>10} "
              f"{max(r['error'] for r in rows):>10.2e} {'yes' if ok else 'NO':>5} "
              f"{max(r['time_ms'] for r in rows):>9.1f}")
        for rank, r in enumerate(rows):
            if not r["ok"]:
                print(f"    rank {rank}: {r['detail']}")
    print(f"{len(per_rank[0]) - failed} passed, {failed} failed in {time.perf_counter() - start:.1f} s")
    return 1 if failed else 0

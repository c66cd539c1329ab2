"""Ops captured once in a CUDA graph and replayed with new inputs (the protocols' epochs and counters live on the
device, so a replay needs no host work): collectives and fused GEMMs, 2 and 4 ranks. GPU only."""

import pytest
import torch
from conftest import worlds

import parallelkittens as pk
from parallelkittens.ops.gemm.all_gather_matmul import reference_all_gather_matmul
from parallelkittens.ops.gemm.matmul_all_reduce import reference_matmul_all_reduce
from parallelkittens.ops.gemm.matmul_reduce_scatter import reference_matmul_reduce_scatter
from parallelkittens.testing import poison, rank_data, relative_error, shared_seed

pytestmark = pytest.mark.gpu
BOUND = 1e-2  # bf16 inputs and outputs, fp32 sums


def _replay(steps: int) -> list[str]:
    ctx = pk.context()
    world, me = ctx.local_world_size, ctx.local_rank
    seed = shared_seed()
    bf16 = torch.bfloat16

    def data(step: int):  # every rank's inputs for one step, regenerated anywhere
        x = [rank_data((3, 1000), bf16, seed + step, r) for r in range(world)]
        a = [rank_data((256, 136), bf16, seed + step, 10 + r) for r in range(world)]
        b = [rank_data((136, 264), bf16, seed + step, 20 + r) for r in range(world)]
        return x, a, b

    x0, a0, b0 = data(0)
    x, a, b, b_common = x0[me].clone(), a0[me].clone(), b0[me].clone(), b0[0].clone()  # captured by address
    ops = {
        "all_reduce": lambda: pk.ops.all_reduce(x),
        "all_gather": lambda: pk.ops.all_gather(x, dim=1),
        "reduce_scatter": lambda: pk.ops.reduce_scatter(a, dim=0),
        "matmul_reduce_scatter": lambda: pk.ops.matmul_reduce_scatter(a, b),
        "matmul_all_reduce": lambda: pk.ops.matmul_all_reduce(a, b, num_comm_sms=2),
        "all_gather_matmul": lambda: pk.ops.all_gather_matmul(a, b_common, num_comm_sms=2),
    }
    for fn in ops.values():  # first calls make the buffers and compile: not capturable
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = {name: fn() for name, fn in ops.items()}
    failures = []
    for step in range(1, steps + 1):
        xs, as_, bs = data(step)
        x.copy_(xs[me])
        a.copy_(as_[me])
        b.copy_(bs[me])
        b_common.copy_(bs[0])
        for out in outs.values():
            poison(out)
        graph.replay()
        torch.cuda.synchronize()
        refs = {
            "all_reduce": sum(t.double() for t in xs),
            "all_gather": torch.cat([t.double() for t in xs], dim=1),
            "reduce_scatter": sum(t.double() for t in as_).chunk(world)[me],
            "matmul_reduce_scatter": reference_matmul_reduce_scatter(as_, bs, me),
            "matmul_all_reduce": reference_matmul_all_reduce(as_, bs),
            "all_gather_matmul": reference_all_gather_matmul(as_, bs[0]),
        }
        for name, out in outs.items():
            err = relative_error(out, refs[name])
            if not err <= BOUND:
                failures.append(f"replay {step}, {name}: relative error {err:.2e}")
    try:  # a call whose plan does not exist yet: refused on every rank, before anything is captured
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            pk.ops.matmul_reduce_scatter(a[: 32 * world], b)  # fewer rows than the captured call's 256
        failures.append("a plan was built while a CUDA graph was being captured")
    except pk.PKError as e:
        if "warm-up" not in str(e):
            failures.append(f"building a plan while capturing: unexpected error {e}")
    pk.sync()
    return failures


@pytest.mark.parametrize("world", worlds("2,4"))
def test_ops_replay_from_a_cuda_graph_with_new_inputs(world):
    for rank, failures in enumerate(pk.spawn(_replay, world, 3, timeout=600)):
        assert not failures, f"rank {rank}: " + "; ".join(failures)

"""The LCSC template through its worked example, `ScaledAllGather`: any world size, several communicator
counts, ragged tiles, back-to-back calls reusing every buffer."""

import pytest
import torch
from conftest import worlds

import parallelkittens as pk
from parallelkittens.template import grid
from parallelkittens.template.example import ScaledAllGather, reference_scaled_all_gather
from parallelkittens.testing import TOLERANCE, poison, rank_data, relative_error, shared_seed

M, N = 50, 70  # ragged against 32 x 64 tiles


def _run(dtype_name: str, num_comm: int, calls: int) -> list[float]:
    ctx = pk.context()
    dtype = getattr(torch, dtype_name)
    op = ScaledAllGather((M, N), dtype, num_comm_programs=num_comm)
    errors = []
    for call in range(calls):
        seed, alpha = shared_seed(), 0.5 + call
        poison(op.out.local)
        pk.barrier()
        out = op(rank_data((M, N), dtype, seed, ctx.local_rank), alpha)
        pk.sync()
        ref = reference_scaled_all_gather([rank_data((M, N), dtype, seed, r) for r in range(ctx.local_world_size)],
                                          alpha)
        errors.append(relative_error(out, ref))
    return errors


@pytest.mark.parametrize("world", worlds("1,2,3,4"))
@pytest.mark.parametrize("dtype, num_comm", [("float32", 1), ("bfloat16", 2), ("float16", 1)])
def test_scaled_all_gather(world, dtype, num_comm):
    for rank, errors in enumerate(pk.spawn(_run, world, dtype, num_comm, 3)):
        bound = TOLERANCE[getattr(torch, dtype)]
        assert all(e <= bound for e in errors), f"rank {rank}: relative errors {errors} (bound {bound})"


def _wrong_inputs() -> list[str]:
    op = ScaledAllGather((M, N), torch.float32)
    messages = []
    for x in (torch.ones(M + 1, N), torch.ones(M, N, dtype=torch.float16), torch.ones(M, N, device="meta")):
        try:
            op(x.to(pk.context().device) if x.device.type != "meta" else x, 1.0)
            messages.append("no error")
        except pk.PKError as e:
            messages.append(str(e))
    return messages


def test_wrong_shape_dtype_or_device_is_refused_before_launch():
    for messages in pk.spawn(_wrong_inputs, 2):
        assert all("expected a torch.float32 tensor of shape (50, 70)" in m for m in messages), messages
        assert "(51, 70)" in messages[0] and "torch.float16" in messages[1] and "on meta" in messages[2]


def test_grid_validation():
    assert grid(10, 2, max_programs=8) == (8,)
    assert grid(3, 2, max_programs=8) == (5,)
    with pytest.raises(ValueError, match=r"num_comm_programs must be in \[0, 7\]"):
        grid(10, 8, max_programs=8)

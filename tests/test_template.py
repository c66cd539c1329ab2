"""The LCSC template through its worked example, `ScaledAllGather`: any world size, several communicator
counts, ragged tiles, back-to-back calls reusing every buffer."""

from typing import NamedTuple

import pytest
import torch
import triton
import triton.language as tl
from conftest import worlds

import parallelkittens as pk
from parallelkittens.template import grid, lcsc, meeting
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


class Counts(NamedTuple):
    consumed: object
    stored: object
    communicated: object
    finished: object


@triton.jit
def _count_consumer(G, C, task, loader):
    tl.atomic_add(G.consumed + task, 1)  # consumers always run: they read only local memory
    return task


@triton.jit
def _count_storer(G, C, task, result):
    tl.atomic_add(G.stored + result, 1)


@triton.jit
def _count_communicator(G, C, task):
    tl.atomic_add(G.communicated + task, 1)


@triton.jit
def _count_finisher(G, C):
    tl.atomic_add(G.finished, 1)


@triton.jit(do_not_specialize=["num_comm"])
def _verdict_kernel(consumed_ptr, stored_ptr, communicated_ptr, finished_ptr, num_tasks, num_comm, meet):
    call = meeting.begin(meet)
    G = Counts(consumed_ptr, stored_ptr, communicated_ptr, finished_ptr)
    lcsc(G, (1,), num_tasks, num_tasks, num_comm, None, _count_consumer, _count_storer, _count_communicator, call,
         _count_finisher)


def _verdicts() -> list[list[int]]:
    ctx = pk.context()
    tasks, num_comm, rows = 7, 2, []
    for same in (True, False, True):  # agree, disagree, agree again: the counters recover
        counts = [torch.zeros(tasks, dtype=torch.int32, device=ctx.device) for _ in range(3)]
        finished = torch.zeros(1, dtype=torch.int32, device=ctx.device)
        sig = meeting.signature("verdict test", 1 if same else ctx.rank)
        _verdict_kernel[grid(tasks, num_comm, max_programs=5)](*counts, finished, tasks, num_comm,
                                                              meeting.meeting().group(sig))
        rows.append([c.tolist() for c in counts] + [finished.tolist()])
        try:
            pk.sync()
        except pk.MismatchError:
            rows[-1].append("MismatchError")
    return rows


@pytest.mark.parametrize("world", worlds("1,2,3"))
def test_the_verdict_gates_storers_and_communicators(world):
    """Ranks that disagree: every consumer still runs once per task, but no storer, no communicator and no finisher
    does, and `pk.sync()` raises MismatchError; ranks that agree run everything, the finisher once per rank."""
    tasks = 7
    for rows in pk.spawn(_verdicts, world):
        for call, row in enumerate(rows):
            runs = 0 if call == 1 and world > 1 else 1
            consumed, stored, communicated, finished = row[:4]
            assert consumed == [1] * tasks and finished == [runs], row
            assert stored == [runs] * tasks and communicated == [runs] * tasks, (call, row)
            assert (row[4:] == ["MismatchError"]) == (runs == 0), row

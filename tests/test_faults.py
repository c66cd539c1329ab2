"""Faults: every case runs as a fresh job and must end with the root cause named on time, leaving nothing behind
(no shared-memory file, no temporary folder of multiprocessing's, no child process). Each case prints how long
its failure took to surface (`pytest -s`); docs/testing.md has the table."""

import glob
import multiprocessing
import multiprocessing.resource_tracker
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from conftest import worlds

import parallelkittens as pk
from parallelkittens.runtime.spawn import Failure, originating

HERE = os.path.dirname(os.path.abspath(__file__))


def _children() -> list[int]:
    """Live processes whose parent is this process or its fork server (zombies not counted), less multiprocessing's
    resource tracker and fork server themselves: started once, by the first spawn that needs them, they serve the
    whole session."""
    from multiprocessing import forkserver

    server = getattr(forkserver._forkserver, "_forkserver_pid", None)
    helpers = {getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None), server}
    parents = {os.getpid(), server}
    found = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(stat.split("/")[2])
        if fields[0] != "Z" and int(fields[1]) in parents and pid not in helpers:
            found.append(pid)
    return found


def _leftovers() -> set[str]:
    """Shared-memory files and multiprocessing's temporary folders, less this process's own (its fork server's
    socket lives there until the session ends)."""
    own = multiprocessing.current_process()._config.get("tempdir")
    return (set(glob.glob("/dev/shm/pk*")) | set(glob.glob(os.path.join(tempfile.gettempdir(), "pymp-*")))) - {own}


@pytest.fixture
def clean():
    """Fails the case if it left a file or a process behind; yields a stopwatch for the time to the failure."""
    before, start = _leftovers(), time.monotonic()
    yield lambda: time.monotonic() - start
    deadline = time.monotonic() + 5
    while _children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _children(), f"child processes left: {_children()}"
    assert not _leftovers() - before, f"left behind: {sorted(_leftovers() - before)}"


def _report(case: str, seconds: float) -> None:
    print(f"\n[fault] {case}: surfaced in {seconds:.1f} s")


# --- which failure is the cause -------------------------------------------------------------------------------


def test_the_cause_is_reported_before_its_consequences():
    failures = [Failure(0.10, 0, "DistBackendError: Connection closed by peer [127.0.0.1]:41234", None, ""),
                Failure(0.20, 2, "WaitTimeoutError: rank 2: wait on meeting[0] of rank 1 timed out", None, ""),
                Failure(0.30, 1, "ValueError: the user's own bug", None, "")]
    assert originating(failures).rank == 1
    assert originating(failures[:2]).rank == 0  # only consequences: the earliest
    killed = Failure(0.05, 3, "was killed by signal SIGKILL", None, "", died=True)
    assert originating([*failures, killed]).rank == 3  # a death is a cause, and this one came first


def _raise_on_rank_one() -> None:
    ctx = pk.context()
    if ctx.rank == 1:
        raise ValueError("boom on rank 1")
    torch.distributed.barrier(group=ctx.cpu_group)  # the others fail (or are stopped) because rank 1 left


def test_a_rank_that_raises_is_named_with_its_exception(clean):
    with pytest.raises(pk.RankError) as info:
        pk.spawn(_raise_on_rank_one, 3, timeout=60)
    _report("rank raises", clean())
    assert info.value.rank == 1 and isinstance(info.value.original, ValueError)
    first = str(info.value).splitlines()[0]
    assert first.startswith("rank 1 failed: ValueError: boom on rank 1"), str(info.value)
    assert "raise ValueError" in info.value.remote_traceback


def _killed_mid(op: str) -> None:
    ctx = pk.context()
    a = torch.ones(64, 64, device=ctx.device)
    run = {"all_reduce": lambda: pk.ops.all_reduce(a), "matmul_all_reduce": lambda: pk.ops.matmul_all_reduce(a, a)}
    run[op]()  # the plan is built on both ranks
    pk.sync()
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    run[op]()  # rank 0 waits in the kernel for a rank that is gone
    pk.sync()


@pytest.mark.parametrize("world", worlds("2,4"))
@pytest.mark.parametrize("op", ["all_reduce", "matmul_all_reduce"])
def test_a_rank_killed_mid_op_is_named(clean, op, world):
    with pytest.raises(pk.PKError, match="rank 1 was killed by signal SIGKILL"):
        pk.spawn(_killed_mid, world, op, timeout=60)
    _report(f"rank killed during {op}", clean())
    assert clean() < 15


def _never_arrives(inside_kernel: bool) -> None:
    ctx = pk.context()
    x = torch.ones(100, device=ctx.device)
    if inside_kernel:
        pk.ops.all_reduce(x)  # built together: a second call has no host agreement, only the kernel's meeting
        pk.sync()
    if ctx.rank == 1:
        time.sleep(120)
    pk.ops.all_reduce(x)
    pk.sync()


@pytest.mark.parametrize("world", worlds("2,4"))
@pytest.mark.parametrize("inside_kernel", [False, True], ids=["at the agreement", "inside the kernel"])
def test_a_rank_that_never_arrives_is_named_in_default_mode(clean, monkeypatch, inside_kernel, world):
    monkeypatch.setenv("PK_DEBUG", "0")  # the default mode: the watchdog is PK_TIMEOUT
    monkeypatch.setenv("PK_TIMEOUT", "3")
    with pytest.raises(pk.RankError) as info:
        pk.spawn(_never_arrives, world, inside_kernel, timeout=60)
    _report(f"rank never arrives ({'kernel' if inside_kernel else 'agreement'})", clean())
    message = str(info.value)
    # every waiting rank names rank 1; whichever gave up first is reported
    assert info.value.rank != 1 and "rank(s) [1] did not arrive within" in message, message
    if inside_kernel:  # the kernel's own watchdog first, then the host's; the call and who never came to it named
        assert "WaitTimeoutError" in message and "arrivals at a call" in message and "after 3 s" in message, message
        assert "at all_reduce with (100,)" in message and "rank(s) [1] never arrived at that call" in message, message
    else:
        assert "building a plan (all_reduce)" in message, message
    assert clean() < 20


# --- bad input, every op ----------------------------------------------------------------------------------------


def _disagreements() -> dict[str, str]:
    ctx = pk.context()
    me, dev = ctx.rank, ctx.device
    n = 8 + 8 * me  # a size that differs between the ranks
    x = torch.ones(n, 16, device=dev)
    q = torch.ones(1, 4, n, 64, device=dev)
    ids = torch.arange(4, device=dev).view(2, 2) % ctx.world_size  # expert e on rank e: every rank gets rows
    experts = ctx.world_size
    inner = 16 * (1 + me)  # an expert width that differs between the ranks
    cases = {
        "all_reduce": lambda: pk.ops.all_reduce(x),
        "all_gather": lambda: pk.ops.all_gather(x, 0),
        "reduce_scatter": lambda: pk.ops.reduce_scatter(x, 0),
        "all_to_all": lambda: pk.ops.all_to_all(x, 0, 1),
        "all_gather_matmul": lambda: pk.ops.all_gather_matmul(x, torch.ones(16, 16, device=dev)),
        "matmul_reduce_scatter": lambda: pk.ops.matmul_reduce_scatter(x, torch.ones(16, 16, device=dev)),
        "matmul_all_reduce": lambda: pk.ops.matmul_all_reduce(x, torch.ones(16, 16, device=dev)),
        "ring_attention": lambda: pk.ops.ring_attention(q, q, q),
        "ulysses_attention": lambda: pk.ops.ulysses_attention(q.transpose(1, 2), q.transpose(1, 2),
                                                              q.transpose(1, 2)),
        "moe_layout": lambda: pk.ops.moe_layout(ids, experts * (1 + me)),
        "moe_dispatch_gemm": lambda: pk.ops.moe_dispatch_gemm(torch.ones(2, n, device=dev), ids,
                                                              torch.ones(1, n, 16, device=dev)),
        "moe_gemm_combine": lambda: _combine_of_width(inner, pk.ops.moe_layout(ids, experts)),
        "dtype": lambda: pk.ops.all_reduce(torch.ones(16, device=dev, dtype=torch.float32 if me else torch.bfloat16)),
        "wrong device": lambda: pk.ops.all_reduce(torch.ones(16, device="meta")),
        "not contiguous": lambda: pk.ops.all_gather(torch.ones(16, 4, device=dev).t(), 0),
        "zero size": lambda: pk.ops.all_gather(torch.ones(0, 4, device=dev), 0).shape,
    }
    messages = {"device": str(dev)}
    for name, call in cases.items():
        try:
            result = call()
            pk.sync()
            messages[name] = f"ok {tuple(result)}" if name == "zero size" else "no error"
        except pk.PKError as e:
            messages[name] = f"{type(e).__name__}: {e}"
    messages["after"] = "ok" if pk.ops.all_reduce(torch.ones(4, device=dev)).eq(ctx.world_size).all() else "wrong"
    pk.sync()
    return messages


def _combine_of_width(inner: int, layout) -> torch.Tensor:
    dev = pk.context().device
    return pk.ops.moe_gemm_combine(torch.ones(layout.rows, inner, device=dev), torch.ones(1, inner, 16, device=dev),
                                   layout, torch.ones(2, 2, device=dev))


@pytest.mark.parametrize("world", worlds("2,4"))
def test_every_op_refuses_disagreeing_ranks_on_every_rank(clean, world):
    everyone = pk.spawn(_disagreements, world, timeout=120)
    _report("disagreements, every op", clean())
    wrong = []  # every unexpected message at once: a GPU run is too dear to learn them one by one
    for rank, messages in enumerate(everyone):
        for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_gather_matmul",
                   "matmul_reduce_scatter", "matmul_all_reduce", "ring_attention", "ulysses_attention", "moe_layout",
                   "moe_dispatch_gemm", "moe_gemm_combine", "dtype"):
            if not (messages[op].startswith("MismatchError") and "ranks called it differently" in messages[op]):
                wrong.append((rank, op, messages[op]))
        expected = {"wrong device": f"this rank's device is {messages['device']}", "not contiguous": "contiguous",
                    "zero size": "ok (0, 4)", "after": "ok"}
        wrong += [(rank, case, messages[case]) for case, text in expected.items() if text not in messages[case]]
    assert not wrong, "\n".join(map(str, wrong))


# --- the machine and the parent ---------------------------------------------------------------------------------


def _rank_and_tensor() -> tuple[int, torch.Tensor]:
    ctx = pk.context()
    return ctx.rank, torch.full((1000,), float(ctx.rank))


def test_two_jobs_started_at_once_both_succeed(clean):
    script = ("import sys; sys.path.insert(0, '.'); import parallelkittens as pk; from test_faults import "
              "_rank_and_tensor as f; r = pk.spawn(f, 2); assert [x for x, _ in r] == [0, 1]; print('ok')")
    jobs = [subprocess.Popen([sys.executable, "-c", script], cwd=HERE, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [job.communicate(timeout=120)[0] for job in jobs]
    _report("two jobs at once", clean())
    for job, out in zip(jobs, outputs, strict=True):
        assert job.returncode == 0 and out.strip().endswith("ok"), out[-2000:]


def test_results_always_arrive_on_a_busy_machine(clean):
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for i in range(50):
            (rank, tensor), = pk.spawn(_rank_and_tensor, 1, timeout=60)
            assert rank == 0 and tensor.shape == (1000,) and tensor.eq(0).all(), i
    finally:
        for p in busy:
            p.kill()
            p.wait()
    _report("50 spawns returning tensors, CPUs busy", clean())


def _first_parallel_op() -> float:
    pk.init()
    x = torch.zeros(1 << 18)  # 1 MiB: large enough for torch to reach for its thread pool
    return float((x + 1).sum() + torch.ones(300, 300).matmul(torch.ones(300, 300)).sum())


def _in_a_parent_with_a_running_pool(fn: str, want: float) -> None:
    """Run `fn` at 2 ranks from a fresh parent whose OpenMP pool runs (a matmul started it), so that the test
    process's own pool, and so its later jobs, stay as they were."""
    script = ("import os, sys; sys.path.insert(0, '.'); import torch; import parallelkittens as pk; "
              f"from test_faults import {fn} as f; os.environ.pop('PK_SPAWN_METHOD', None); "  # conftest set it
              "torch.ones(1500, 1500) @ torch.ones(1500, 1500); "
              f"assert pk.spawn(f, 2, timeout=60) == [{want!r}] * 2; print('ok')")
    out = subprocess.run([sys.executable, "-c", script], cwd=HERE, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.stdout + out.stderr)[-2000:]


def test_a_parent_that_used_its_thread_pool_can_spawn(clean):
    _in_a_parent_with_a_running_pool("_first_parallel_op", float((1 << 18) + 300 * 300 * 300))
    _report("spawn after a parent's matmul", clean())
    assert clean() < 30


# --- many calls -------------------------------------------------------------------------------------------------


def _every_op_back_to_back(calls: int) -> list[str]:
    ctx = pk.context()
    dev, me = ctx.device, ctx.rank
    x = torch.arange(64 * 16, dtype=torch.float32, device=dev).reshape(64, 16) * (me + 1) / 1000
    b = torch.eye(16, device=dev) + 0.5
    q = (torch.arange(2 * 16 * 32, dtype=torch.float32, device=dev).reshape(1, 2, 16, 32) * (me + 1)).sin()
    ops = {
        "all_reduce": lambda: pk.ops.all_reduce(x),
        "all_gather": lambda: pk.ops.all_gather(x, 0),
        "reduce_scatter": lambda: pk.ops.reduce_scatter(x, 0),
        "all_to_all": lambda: pk.ops.all_to_all(x, 0, 1),
        "barrier": lambda: pk.ops.barrier() or torch.zeros(1),
        "all_gather_matmul": lambda: pk.ops.all_gather_matmul(x, b),
        "matmul_reduce_scatter": lambda: pk.ops.matmul_reduce_scatter(x, b),
        "matmul_all_reduce": lambda: pk.ops.matmul_all_reduce(x, b),
        "ring_attention": lambda: pk.ops.ring_attention(q, q, q, causal=True, layout="zigzag"),
        "ulysses_attention": lambda: pk.ops.ulysses_attention(q, q, q),
    }
    # MoE: two experts per rank, each token to its k = 2 next experts (some on this rank, some on others)
    experts, tokens = 2 * ctx.world_size, torch.arange(64, device=dev)[:, None]
    layout = pk.ops.moe_layout((tokens + me + torch.tensor([0, 1], device=dev)) % experts, experts)
    w1 = (torch.arange(2 * 16 * 32, dtype=torch.float32, device=dev).reshape(2, 16, 32) * (me + 1)).cos() / 4
    w2 = w1.transpose(1, 2).contiguous()
    h = pk.ops.moe_dispatch_gemm(x, layout, w1)[0]
    weights = (tokens + torch.tensor([1.0, 2.0], device=dev)).sin()
    ops["moe_dispatch_gemm"] = lambda: pk.ops.moe_dispatch_gemm(x, layout, w1)[0]
    ops["moe_gemm_combine"] = lambda: pk.ops.moe_gemm_combine(h, w2, layout, weights)
    first = {name: op().clone() for name, op in ops.items()}
    names, bad = list(ops), []
    for i in range(calls):
        name = names[i % len(names)]
        if not torch.equal(ops[name](), first[name]):
            bad.append(f"call {i} ({name}) differs from the first")
    pk.sync()
    return bad


@pytest.mark.parametrize("world", worlds("2,4"))
def test_every_op_called_back_to_back_gives_identical_results(clean, world):
    # at 4 ranks (3 peers' shares per fused sum, in whatever order they land) a fifth of the calls, for CI's time
    calls = int(os.environ.get("PK_TEST_CALLS", "1000")) // (1 if world <= 2 else 5)
    for rank, bad in enumerate(pk.spawn(_every_op_back_to_back, world, calls, timeout=900)):
        assert not bad, f"rank {rank}: {bad[:5]}"
    _report(f"{calls} back-to-back calls, every op", clean())


def test_torchrun_names_the_originating_failure(clean):
    """Under torchrun, rank 1 raises; ranks 0 and 2 then fail waiting for it. torchrun's report names rank 1's own
    error as the root cause (the ranks date a consequence's error file later than a cause's)."""
    start = time.monotonic()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3",
           os.path.join(os.path.dirname(__file__), "torchrun_failure.py")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PK_TIMEOUT="5", PK_DEBUG="0"))
    _report("torchrun: a rank raises", time.monotonic() - start)
    assert out.returncode != 0
    root = out.stderr[out.stderr.find("Root Cause"):]
    assert "Root Cause" in out.stderr and "rank 1's own mistake" in root.split("Other Failures")[0], out.stderr[-4000:]
    assert "rank      : 1" in root.split("Other Failures")[0], out.stderr[-4000:]


# --- no silent garbage ------------------------------------------------------------------------------------------


def _two_calls(op: str):
    """Two calls of `op` with different shapes, each with a plan built (by every rank, in the same order)."""
    ctx = pk.context()
    dev, me = ctx.device, ctx.rank

    def data(*shape):
        return (torch.arange(torch.Size(shape).numel(), dtype=torch.float32, device=dev).reshape(shape) * (me + 1)
                / 997).sin()

    if op == "all_reduce":
        return [lambda n=n: pk.ops.all_reduce(data(n)) for n in (64, 96)]
    if op == "all_gather_matmul":
        b = data(16, 16)
        return [lambda n=n: pk.ops.all_gather_matmul(data(n, 16), b) for n in (8, 24)]
    if op == "ring_attention":
        return [lambda n=n: pk.ops.ring_attention(*(data(1, 2, n, 32),) * 3) for n in (16, 24)]
    if op == "ulysses_attention":
        return [lambda n=n: pk.ops.ulysses_attention(*(data(1, n, 2, 32),) * 3) for n in (16, 24)]
    experts, w1 = 2 * ctx.world_size, data(2, 16, 32)
    layouts = [pk.ops.moe_layout((torch.arange(n, device=dev)[:, None] + torch.tensor([0, 1], device=dev)) % experts,
                                 experts) for n in (8, 24)]
    return [lambda lay=lay: pk.ops.moe_dispatch_gemm(data(lay.tokens, 16), lay, w1)[0] for lay in layouts]


def _garbage(op: str, sync: bool) -> list[float]:
    calls = _two_calls(op)
    for call in calls:  # every plan exists: the disagreement below is found on the device only
        call()
    pk.sync()
    result = calls[pk.context().rank % 2]()  # rank 0 the first shape, rank 1 the second
    if sync:
        pk.sync()
    return result.flatten().tolist()[:4]  # what a job that went on would use


@pytest.mark.parametrize("debug", ["1", "0"])
@pytest.mark.parametrize("sync", [False, True])
@pytest.mark.parametrize("op", ["all_reduce", "all_gather_matmul", "ring_attention", "ulysses_attention", "moe"])
def test_a_disagreement_on_built_plans_never_returns_a_number(clean, monkeypatch, op, sync, debug):
    """Ranks that call different built plans get a MismatchError naming both calls and the rank that differs,
    whether or not the job calls pk.sync() and in either mode (PK_DEBUG=0: waits last PK_TIMEOUT): the unwritten
    output is never returned as a result."""
    monkeypatch.setenv("PK_DEBUG", debug)
    with pytest.raises(pk.PKError, match="MismatchError: rank [01]: ranks disagree on a call") as info:
        pk.spawn(_garbage, 2, op, sync, timeout=120)
    _report(f"disagreement on built plans, {op}, sync={sync}, PK_DEBUG={debug}", clean())
    message = str(info.value)
    assert "this rank called" in message and (", rank 0 " in message or ", rank 1 " in message), message
    assert clean() < 30


def _then_idle() -> None:
    calls = _two_calls("all_reduce")
    for call in calls:
        call()
    pk.sync()
    calls[pk.context().rank % 2]()
    time.sleep(120)  # no further call: only the watchdog can tell


def test_the_watchdog_reports_an_error_no_call_raised(clean):
    start = time.monotonic()
    with pytest.raises(pk.PKError, match="found by the watchdog"):
        pk.spawn(_then_idle, 2, timeout=120)
    _report("an error no call raised (the watchdog)", clean())
    assert time.monotonic() - start < 60  # 10 s of grace under the interpreter, 1 s on a GPU


def _more_threads() -> float:
    pk.init()
    torch.set_num_threads(2)  # a rank forked from a parent with a running OpenMP pool hung here
    return float(torch.ones(300, 300).matmul(torch.ones(300, 300)).sum() + torch.zeros(1 << 18).add(1).sum())


def test_a_rank_may_raise_its_thread_count_after_the_parents_pool_started(clean):
    _in_a_parent_with_a_running_pool("_more_threads", float(300 ** 3 + (1 << 18)))
    _report("a rank raising its thread count", clean())


def _user_faults() -> dict:
    """Inputs the ops cannot compute: meta tensors to MoE, int64 ids past 2^32, empty attention."""
    ctx = pk.context()
    dev, world, found = ctx.device, ctx.world_size, {}
    experts, x = 2 * world, torch.ones(8, 16, device=dev)
    ids = (torch.arange(8, device=dev)[:, None] + torch.tensor([0, 1], device=dev)) % experts
    w1 = torch.ones(2, 16, 32, device=dev)
    cases = {"meta x": lambda: pk.ops.moe_dispatch_gemm(torch.ones(8, 16, device="meta"), ids, w1),
             "meta w1": lambda: pk.ops.moe_dispatch_gemm(x, ids, torch.ones(2, 16, 32, device="meta")),
             "int64 id past 2^32": lambda: pk.ops.moe_layout(ids.masked_fill(ids == 1, 2 ** 32 + 1), experts)}
    for name, make in cases.items():
        try:
            make()
            pk.sync()
            found[name] = "no error"
        except pk.PKError as e:
            found[name] = str(e)
    for name, shape in [("N = 0", (1, 2, 0, 64)), ("B = 0", (0, 2, 8, 64))]:
        for op in ("attention", "ring_attention", "ulysses_attention"):
            q = torch.ones(shape if op != "ulysses_attention" else (shape[0], shape[2], shape[1], shape[3]),
                           device=dev, requires_grad=True)
            out = getattr(pk.ops, op)(q, q, q, causal=True)
            out.sum().backward()
            found[f"{op} {name}"] = (tuple(out.shape) == tuple(q.shape) and tuple(q.grad.shape) == tuple(q.shape))
    pk.sync()
    return found


@pytest.mark.parametrize("world", worlds("1,2"))
def test_inputs_no_op_can_compute_are_refused_and_empty_attention_is_empty(clean, world):
    for rank, found in enumerate(pk.spawn(_user_faults, world, timeout=120)):
        device = "cuda:" if torch.cuda.is_available() else "cpu"
        assert "x is on meta" in found["meta x"] and device in found["meta x"], (rank, found["meta x"])
        assert "w1 is on meta" in found["meta w1"], (rank, found["meta w1"])
        assert "ids outside [0, " in found["int64 id past 2^32"], (rank, found["int64 id past 2^32"])
        assert all(v is True for k, v in found.items() if "= 0" in k), (rank, found)
    _report("meta tensors, int64 ids, empty attention", clean())


def _an_extra_call(at_the_agreement: bool) -> None:
    x = torch.ones(100, device=pk.context().device)
    pk.ops.all_reduce(x)
    pk.sync()
    if pk.context().rank == 0:  # a call rank 1 never makes: it has returned
        pk.ops.all_reduce(torch.ones(50 if at_the_agreement else 100, device=x.device))
        pk.sync()


@pytest.mark.parametrize("at_the_agreement", [False, True], ids=["inside the kernel", "at the agreement"])
def test_an_extra_call_fails_within_the_debug_wait_naming_who_returned(clean, monkeypatch, at_the_agreement):
    monkeypatch.setenv("PK_WAIT_TIMEOUT", "5")
    start = time.monotonic()
    with pytest.raises(pk.PKError) as info:
        pk.spawn(_an_extra_call, 2, at_the_agreement, timeout=120)
    _report(f"an extra call ({'agreement' if at_the_agreement else 'kernel'})", clean())
    message = str(info.value)
    assert time.monotonic() - start < 40, message  # PK_WAIT_TIMEOUT (5 s here), not PK_TIMEOUT
    if at_the_agreement:
        assert "(PK_WAIT_TIMEOUT)" in message and "rank 1: had returned from the job's function" in message, message
    else:
        assert "at all_reduce with (100,)" in message and "rank(s) [1] never arrived" in message, message

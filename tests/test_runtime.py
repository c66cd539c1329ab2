"""Bootstrap, spawn, parallel tensors and bad input: clear errors on every rank, nothing left behind."""

import gc
import glob
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import worlds

import parallelkittens as pk
from parallelkittens.testing import rank_data, shared_seed


def _shm_files() -> list[str]:
    return glob.glob("/dev/shm/pk-*")


@pytest.fixture(autouse=True)
def no_leftovers():
    before = set(_shm_files())
    yield
    assert multiprocessing.active_children() == []
    assert set(_shm_files()) <= before, f"leaked shared-memory files: {set(_shm_files()) - before}"


def _describe() -> tuple:
    ctx = pk.init()
    assert pk.init() is ctx  # idempotent
    return ctx.rank, ctx.world_size, ctx.local_rank, ctx.local_world_size, ctx.backend, str(ctx.device)


@pytest.mark.parametrize("world", worlds("1,3"))
def test_spawn_returns_results_in_rank_order(world):
    rows = pk.spawn(_describe, world)
    assert [r[:4] for r in rows] == [(r, world, r, world) for r in range(world)]
    assert len({r[4] for r in rows}) == 1


def _raise_on(rank: int) -> int:
    if pk.context().rank == rank:
        raise ValueError(f"bad value on purpose at rank {rank}")
    return pk.context().rank


def test_spawn_reraises_naming_rank_and_error():
    with pytest.raises(pk.RankError) as info:
        pk.spawn(_raise_on, 3, 2)
    err = info.value
    assert err.rank == 2 and isinstance(err.original, ValueError)
    assert "rank 2" in str(err) and "bad value on purpose" in str(err) and "_raise_on" in err.remote_traceback


def _die(how: str) -> None:
    if pk.context().rank == 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # the others would wait forever for rank 1


@pytest.mark.parametrize("how, said", [("exit", "exited with 3"), ("kill", "was killed by signal SIGKILL")])
def test_spawn_reports_a_dead_rank_and_stops_the_others(how, said):
    start = time.monotonic()
    with pytest.raises(pk.PKError, match=f"rank 1 {said}"):
        pk.spawn(_die, 3, how)
    assert time.monotonic() - start < 30


def _hang() -> None:
    time.sleep(600)


def test_spawn_timeout_stops_every_rank():
    start = time.monotonic()
    with pytest.raises(pk.PKError, match=r"rank\(s\) \[0, 1\] still running after 3 s"):
        pk.spawn(_hang, 2, timeout=3)
    assert time.monotonic() - start < 20


def test_spawn_rejects_what_ranks_cannot_import():
    with pytest.raises(pk.PKError, match="module-level"):
        pk.spawn(lambda: 1, 2)


def test_world_size_the_backend_cannot_serve():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(pk.PKError, match="needs a GPU|needs one GPU per local rank"):
        pk.spawn(_describe, 2, backend="cuda")
    with pytest.raises(pk.PKError, match="needs a GPU"):
        pk.spawn(_describe, 2, backend="cuda-shared")
    with pytest.raises(pk.PKError, match="unknown backend"):
        pk.spawn(_describe, 2, backend="tpu")
    with pytest.raises(pk.PKError, match="positive int"):
        pk.spawn(_describe, 0)


def test_a_rank_that_never_joins_is_named():
    port = str(_free_port())
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PK_JOIN_TIMEOUT="3")
    code = "import parallelkittens as pk\ntry:\n    pk.init()\nexcept pk.PKError as e:\n    print(e)\n"
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "rank 0: waited 3 s for all 2 ranks to join, but rank(s) [1] never called pk.init()" in out.stdout, (
        out.stdout + out.stderr[-2000:])
    assert time.monotonic() - start < 60


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parallel_tensor_views() -> list:
    ctx = pk.context()
    x = pk.empty((3, 5), torch.float32, name="x")
    seed = shared_seed()
    x.local.copy_(rank_data((3, 5), torch.float32, seed, ctx.local_rank))
    pk.sync()
    ok = all(torch.equal(x.peer(r).cpu(), rank_data((3, 5), torch.float32, seed, r).cpu())
             for r in range(ctx.local_world_size))
    ptrs_ok = x.ptrs.tolist() == [x.peer(r).data_ptr() for r in range(ctx.local_world_size)]
    pk.sync()
    x.free()
    return [ok, ptrs_ok, x.shape == (0,) or True]


@pytest.mark.parametrize("world", worlds("1,2,4"))
def test_peer_views_and_pointer_table(world):
    assert all(all(r) for r in pk.spawn(_parallel_tensor_views, world))


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum("/dev/shm/pk-" in line for line in f)


def _alloc_free_cycles(cycles: int) -> tuple:
    pk.init()
    start = _mappings()
    for i in range(cycles):
        x = pk.zeros(1000 + i, torch.bfloat16, name="cycle")
        x.free()
        del x
    gc.collect()
    return start, _mappings()


def test_allocate_free_cycles_leave_no_files_or_mappings():
    if torch.cuda.is_available():
        pytest.skip("shared-memory files are the CPU backend's")
    for start, end in pk.spawn(_alloc_free_cycles, 3, 30):
        assert end == start == 0


def _crash_holding_memory() -> None:
    pk.zeros(4096, torch.float32, name="held")
    pk.sync()
    if pk.context().rank == 1:
        os._exit(1)
    time.sleep(60)


def test_crash_leaves_no_files():
    with pytest.raises(pk.PKError, match="rank 1 exited with 1"):
        pk.spawn(_crash_holding_memory, 3)
    # the fixture checks /dev/shm and children


def _watchdog_s() -> float:
    return pk.context().settings.timeout_s


def test_forkserver_ranks_take_the_parents_environment_of_now(monkeypatch):
    """The fork server starts once, with the environment of that moment; its ranks must still see what the parent
    set since (a test's monkeypatched PK_TIMEOUT, a user's CUDA_VISIBLE_DEVICES)."""
    monkeypatch.setenv("PK_SPAWN_METHOD", "forkserver")
    monkeypatch.setenv("PK_TIMEOUT", "321")
    assert pk.spawn(_watchdog_s, 2) == [321.0, 321.0]
    monkeypatch.setenv("PK_TIMEOUT", "123")
    assert pk.spawn(_watchdog_s, 2) == [123.0, 123.0]
    monkeypatch.setenv("PK_SPAWN_METHOD", "vfork")
    with pytest.raises(pk.PKError, match="PK_SPAWN_METHOD='vfork' is not one of auto, fork, forkserver, spawn"):
        pk.spawn(_watchdog_s, 2)


def _sleep_forever() -> None:
    print(os.getpid(), flush=True)  # the test reads each rank's pid from the shared stdout
    time.sleep(600)


_ORPHAN_PARENT = """
import os, sys, parallelkittens as pk, test_runtime
print(os.getpid(), flush=True)
pk.spawn(test_runtime._sleep_forever, 2, backend="cpu")
"""


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in glob.glob(f"/proc/{p}/task/*/children"):
            try:
                kids = [int(k) for k in open(task).read().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_ranks_die_with_a_killed_parent(method):
    """A parent killed outright (a CI timeout, kill -9) takes its ranks with it, and its fork server: none is left
    running."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([here, os.path.dirname(here)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN_PARENT], stdout=subprocess.PIPE, text=True, cwd=here,
                              env=dict(os.environ, PYTHONPATH=path, TRITON_INTERPRET="1", PK_SPAWN_METHOD=method))
    try:
        pid = int(parent.stdout.readline())
        ranks = [int(parent.stdout.readline()) for _ in range(2)]  # both ranks are in fn
        everyone = _descendants(pid)
        assert set(ranks) <= set(everyone), (ranks, everyone)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{r}") and "Z" not in _state(r) for r in everyone) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [r for r in everyone if os.path.exists(f"/proc/{r}") and "Z" not in _state(r)]
    for r in alive:
        os.kill(r, signal.SIGKILL)
    assert not alive, f"processes {alive} of {everyone} (ranks {ranks}) outlived their parent"


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def _expect_error(fn, *args) -> str:
    try:
        fn(*args)
    except pk.PKError as e:
        return str(e)
    return "no error"


def _mismatched_shapes() -> str:
    rank = pk.context().rank
    return _expect_error(pk.empty, (4, 4 + (rank == 1)), torch.float32)


def _mismatched_dtypes() -> str:
    rank = pk.context().rank
    return _expect_error(pk.zeros, (8,), torch.float16 if rank == 2 else torch.float32)


@pytest.mark.parametrize("fn, needle", [(_mismatched_shapes, "(4, 5)"), (_mismatched_dtypes, "torch.float16")])
def test_mismatched_allocations_fail_on_every_rank(fn, needle):
    messages = pk.spawn(fn, 3)
    for m in messages:
        assert "ranks asked for different parallel tensors" in m and needle in m, m


def _bad_arguments() -> list[str]:
    x = pk.zeros(8, torch.float32, name="x")
    out = [
        _expect_error(x.peer, pk.context().local_world_size),
        _expect_error(x.peer, -1),
        _expect_error(pk.empty, (2, -1), torch.float32),
        _expect_error(pk.empty, (2, 2), "float32"),
    ]
    x.free()
    return out


def test_bad_arguments_raise_clear_errors():
    for messages in pk.spawn(_bad_arguments, 2):
        assert "out of range" in messages[0] and "out of range" in messages[1]
        assert "non-negative ints" in messages[2] and "torch.dtype" in messages[3]

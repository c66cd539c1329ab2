"""`spawn`: run a function on fresh ranks (processes) and bring back their results or their errors.

The parent never joins the world itself. It serves the job's rendezvous store on a port the system picks (so any
number of jobs can start at once) and watches every rank's result pipe and process. The first failure (an
exception, a death, or the deadline) stops all ranks after a short grace for the others to report theirs; the
error names the originating failure first, the earliest one that is not a consequence of another rank's (a
transport error, a wait that gave up), with its rank and traceback, and lists the others after it. Results travel
by value (pickled whole, never as shared file descriptors), so they arrive however loaded the machine is and the
rank leaves nothing behind. Shared-memory files a job left behind (a rank killed mid-allocation) are removed by
their job-id prefix.
"""

from __future__ import annotations

import datetime
import glob
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed

from . import context as _context
from . import sync as _sync
from .errors import PKError, RankError, is_consequence
from .memory import _SHM_DIR, shm_prefix
from .settings import Settings

_GRACE_S = 1.0  # after the first failure, how long other ranks may take to report their own errors


def _die_with_parent(parent_pid: int | None) -> None:
    """Have the kernel kill this rank when its parent process dies, so that no orphaned rank is left spinning in a
    kernel on a shared GPU. The parent is the process that called `spawn` (a timeout or Ctrl-C twice kills it), or
    its fork server, which exits as soon as that process is gone. Linux only."""
    # A fork server exits once the spawning process, the last holder of its "alive" pipe, is gone; but it hands
    # every child a copy of that pipe (for servers of their own). A rank holding one would keep the server, its
    # parent, alive after the spawning process died, and with it itself: close it and forget that server.
    server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = server._forkserver_pid = server._forkserver_address = None
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:  # the parent died before the request took hold
        os._exit(1)


def _rank_main(fn: Callable, args: tuple, rank: int, env: dict[str, str], conn, parent_pid: int | None,
               forked: bool) -> None:
    _die_with_parent(parent_pid)
    os.environ.clear()  # a fork server's environment is the one it started with: take the parent's of now
    os.environ.update(env)
    os.environ["MASTER_PORT"] = str(conn.recv())  # the parent's store starts after the fork (threads and fork mix ill)
    _context._CTX = None  # a forked rank must not inherit a context
    if forked:
        # A forked child cannot use the OpenMP thread pool its parent started (its first parallel op, a zero_()
        # of 1 MiB say, hangs); with one thread torch runs every op inline and never touches that pool.
        torch.set_num_threads(1)
    sending = threading.Lock()

    def report(error: BaseException) -> None:  # the watchdog's: an error no call of the rank raised
        with sending:
            conn.send_bytes(pickle.dumps(("error", f"{type(error).__name__}: {error} (found by the watchdog: the "
                                                   "rank raised no error of its own)", None, "")))
        os._exit(1)

    _sync.report_error = report
    try:
        if torch.cuda._is_in_bad_fork():
            raise PKError("this rank was forked from a process that had initialised CUDA; set "
                          "PK_SPAWN_METHOD=spawn")
        _context.init()
        result = fn(*args)
        ctx = _context.context()
        if ctx.store is not None:  # what a peer still waiting for this rank will say of it
            ctx.store.set(f"returned/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{ctx.rank}", "1")
        _sync.check_at_exit()  # an error a kernel recorded and nobody raised: the rank failed
        payload = ("ok", result)
        try:
            pickle.dumps(result)
        except Exception as e:
            payload = ("error", f"returned an unpicklable {type(result).__name__}: {e}", None, "")
    except BaseException as e:  # noqa: BLE001 - everything must reach the parent
        tb = traceback.format_exc()
        try:
            original = pickle.loads(pickle.dumps(e))
        except Exception:
            original = None
        payload = ("error", f"{type(e).__name__}: {e}", original, tb)
    try:
        data = pickle.dumps(payload)  # by value: a tensor's bytes, not a descriptor the parent must fetch from us
    except Exception as e:  # an exception (or result) that pickled alone but not inside the payload
        data = pickle.dumps(("error", f"{payload[1]} (and the result could not be sent: {e})", None, ""))
    try:
        with sending:
            conn.send_bytes(data)
    finally:
        conn.close()
    try:
        _context.finalize()
    finally:
        # Skip interpreter teardown: gloo and triton threads have nothing left to do, and exiting now avoids
        # waiting on peers that may already be gone.
        os._exit(0)


METHODS = ("auto", "fork", "forkserver", "spawn")


def _start_method(backend: str, settings: Settings) -> str:
    """How ranks start (PK_SPAWN_METHOD). Forking is about 20x cheaper than a cold interpreter, but a process that
    has touched CUDA or runs a process group's threads cannot be forked safely; a fork server can: it is started
    once per parent, before any of that, with torch and triton already imported, and forks each rank."""
    method = settings.spawn_method
    if method not in METHODS:
        raise PKError(f"PK_SPAWN_METHOD={method!r} is not one of {', '.join(METHODS)}")
    fork_safe = not torch.cuda.is_initialized() and not torch.distributed.is_initialized()
    if method == "fork" and not fork_safe:
        raise PKError("PK_SPAWN_METHOD=fork, but this process has initialised CUDA or a process group, which a "
                      "forked rank cannot use; use forkserver or spawn")
    if method == "auto":
        # a parent whose OpenMP pool has started (its first parallel op) hands a forked child a pool whose threads do
        # not exist there: a rank that raises its thread count hangs. Fork only while no thread has started since
        # this module was imported (torch's own are there by then).
        method = "fork" if backend == "cpu" and fork_safe and _threads() <= _THREADS_AT_IMPORT else "forkserver"
    return method


def _threads() -> set[str]:
    """The ids of the threads this process runs (none where that cannot be read)."""
    try:
        return set(os.listdir("/proc/self/task"))
    except OSError:
        return set()


_THREADS_AT_IMPORT = _threads()


def _context_for(method: str) -> tuple[Any, int | None]:
    """The multiprocessing context for `method`, and the pid the ranks' parent will have (None: not known)."""
    mpc = mp.get_context(method)
    if method != "forkserver":
        return mpc, os.getpid()
    from multiprocessing import forkserver

    mpc.set_forkserver_preload(["torch", "triton"])  # not __main__: the server must never initialise CUDA
    forkserver.ensure_running()
    return mpc, getattr(forkserver._forkserver, "_forkserver_pid", None)


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str | None = None,
          timeout: float | None = None) -> list[Any]:
    """Run module-level `fn(*args)` on `world_size` fresh ranks with pk initialised; return their results in
    rank order.

    If a rank raises, `RankError` names the rank and carries the original exception (`.original`) and its
    traceback; if a rank dies, or the ranks outlast `timeout` seconds (default 300, PK_SPAWN_TIMEOUT), all
    ranks are stopped and `PKError` says which. No process or shared-memory file outlives the call.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise PKError(f"world_size must be a positive int, got {world_size!r}")
    if getattr(fn, "__qualname__", "").find("<locals>") >= 0 or getattr(fn, "__name__", "") == "<lambda>":
        raise PKError(f"pk.spawn needs a module-level function so ranks can import it; got {fn!r}")
    try:
        pickle.dumps((fn, args))
    except Exception as e:
        raise PKError(f"pk.spawn cannot send fn and args to the ranks: {e}") from None
    settings = Settings.from_env()
    name = _context.choose_backend(world_size, backend, settings)
    timeout = timeout if timeout is not None else settings.spawn_timeout_s
    job_id = uuid.uuid4().hex[:12]
    mpc, ranks_parent = _context_for(_start_method(name, settings))
    procs, conns, store = [], [], None
    try:
        for rank in range(world_size):
            env = {
                **os.environ,
                "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                "TORCHELASTIC_USE_AGENT_STORE": "True",  # the ranks connect to the parent's store
                "PK_BACKEND": name, "PK_JOB_ID": job_id,
                "PK_JOIN_TIMEOUT": str(min(timeout, settings.join_timeout_s)),
            }
            parent_conn, child_conn = mpc.Pipe()  # the store's port goes down, the result comes up
            proc = mpc.Process(target=_rank_main, daemon=True, name=f"pk-rank-{rank}",
                               args=(fn, args, rank, env, child_conn, ranks_parent, mpc.get_start_method() == "fork"))
            proc.start()
            child_conn.close()
            procs.append(proc)
            conns.append(parent_conn)
        # the job's own store, on a port the system picks: no probing, so no race between jobs
        store = torch.distributed.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                                           timeout=datetime.timedelta(seconds=settings.join_timeout_s))
        for conn in conns:
            try:
                conn.send(store.port)
            except OSError:  # that rank died before it read the port: _collect reports its death
                pass
        return _collect(procs, conns, timeout)
    finally:
        _stop(procs)
        for c in conns:
            c.close()
        del store
        for path in glob.glob(os.path.join(_SHM_DIR, shm_prefix(job_id) + "*")):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


class Failure(NamedTuple):
    """One rank's failure as the parent saw it: when it arrived, the rank, and what the rank said."""

    at: float
    rank: int
    message: str
    original: BaseException | None
    traceback: str
    died: bool = False


def originating(failures: list[Failure]) -> Failure:
    """The failure that started it: the earliest that is not a consequence of another rank's (a death always
    counts as a cause), else the earliest."""
    ordered = sorted(failures)
    causes = [f for f in ordered if f.died or not is_consequence(f.message)]
    return (causes or ordered)[0]


def _receive(conn) -> tuple:
    try:
        return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):  # the pipe closed without a word: the rank died
        return ("died",)
    except Exception as e:  # noqa: BLE001 - it sent something the parent cannot read: that rank failed
        return ("error", f"sent a result the parent could not read ({type(e).__name__}: {e})", None, "")


def _collect(procs: list, conns: list, timeout: float) -> list[Any]:
    world_size = len(procs)
    results: dict[int, Any] = {}
    failures: dict[int, Failure] = {}
    deadline = time.monotonic() + timeout
    failed_at = None
    while len(results) + len(failures) < world_size:
        now = time.monotonic()
        if failed_at is not None and now > failed_at + _GRACE_S:
            break
        if now > deadline:
            if failures:  # a failure seen within the grace before the deadline: report it, not the deadline
                break
            waiting = sorted(set(range(world_size)) - set(results) - set(failures))
            returned = f"; rank(s) {sorted(results)} had returned" if results else ""
            raise PKError(f"pk.spawn: rank(s) {waiting} still running after {timeout:g} s{returned}; all ranks were "
                          "stopped")
        pending = {conns[r]: r for r in range(world_size) if r not in results and r not in failures}
        ready = mp.connection.wait(list(pending) + [procs[r].sentinel for r in pending.values()], timeout=0.1)
        for obj in ready:
            rank = pending.get(obj)
            if rank is None:  # a process ended: read what it sent, if anything, or record its death
                rank = next(r for r in pending.values() if procs[r].sentinel == obj)
                if rank in results or rank in failures or conns[rank].poll():
                    continue  # its message is waiting on the pipe: take it through the pipe below
                status = ("died",)
            else:
                status = _receive(obj)
            if status[0] == "ok":
                results[rank] = status[1]
            elif status[0] == "error":
                failures[rank] = Failure(time.monotonic(), rank, *status[1:])
            else:
                procs[rank].join()
                code = procs[rank].exitcode
                how = (f"was killed by signal {signal.Signals(-code).name}" if code and code < 0 else
                       f"exited with {code}")
                failures[rank] = Failure(time.monotonic(), rank, f"{how} before returning a result", None, "",
                                         died=True)
            if rank in failures:
                failed_at = failed_at or time.monotonic()
    if failures:
        cause = originating(list(failures.values()))
        others = [f for f in sorted(failures.values()) if f is not cause]
        then = "".join(f"\n  rank {f.rank}: {f.message.splitlines()[0] if f.message else ''}" for f in others)
        running = sorted(set(range(world_size)) - set(results) - set(failures))
        if running:
            then += f"\n  rank(s) {running} were still running (stopped)"
        if then:
            then = "\n--- then, in the order they arrived ---" + then
        if cause.died:
            raise PKError(f"pk.spawn: rank {cause.rank} {cause.message}; all ranks were stopped{then}")
        raise RankError(cause.rank, cause.message + then, cause.original, cause.traceback)
    if len(results) < world_size:
        missing = sorted(set(range(world_size)) - set(results))
        raise PKError(f"pk.spawn: rank(s) {missing} gave no result; all ranks were stopped")
    return [results[r] for r in range(world_size)]


def _stop(procs: list) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + 5.0
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()

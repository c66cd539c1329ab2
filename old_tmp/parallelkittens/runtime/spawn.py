"""`spawn`: run a function on fresh ranks (processes) and bring back their results or their errors.

The parent never joins the world itself. It watches every rank's result pipe and process; the first failure
(an exception, a death, or the deadline) stops all ranks, and the error names the rank and what happened.
Shared-memory files a job left behind (a rank killed mid-allocation) are removed by their job-id prefix.
"""

from __future__ import annotations

import glob
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed

from . import context as _context
from .errors import PKError, RankError
from .memory import _SHM_DIR, shm_prefix

DEFAULT_TIMEOUT_S = 300.0
_GRACE_S = 1.0  # after the first failure, how long other ranks may take to report their own errors


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this rank when the process that spawned it dies (killed by a timeout or Ctrl-C
    twice, say), so that no orphaned rank is left spinning in a kernel on a shared GPU. Linux only."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before the request took hold
        os._exit(1)


def _rank_main(fn: Callable, args: tuple, rank: int, env: dict[str, str], conn, parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    os.environ.update(env)
    _context._CTX = None  # a forked rank must not inherit a context
    try:
        from ..language import signals

        signals.set_debug(os.environ.get("PK_DEBUG", "0") == "1")
        _context.init()
        result = fn(*args)
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
        conn.send(payload)
    finally:
        conn.close()
    try:
        _context.finalize()
    finally:
        # Skip interpreter teardown: gloo and triton threads have nothing left to do, and exiting now avoids
        # waiting on peers that may already be gone.
        os._exit(0)


def _start_method(backend: str) -> str:
    # fork is ~20x cheaper than spawn on the CPU, but a process that has touched CUDA cannot be forked.
    if backend == "cpu" and not torch.cuda.is_initialized() and not torch.distributed.is_initialized():
        return "fork"
    return "spawn"


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
    name = _context.choose_backend(world_size, backend)
    timeout = timeout if timeout is not None else float(os.environ.get("PK_SPAWN_TIMEOUT", DEFAULT_TIMEOUT_S))
    job_id = uuid.uuid4().hex[:12]
    port = _context._free_port()
    mpc = mp.get_context(_start_method(name))
    procs, conns = [], []
    try:
        for rank in range(world_size):
            env = {
                "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "PK_BACKEND": name, "PK_JOB_ID": job_id,
                "PK_JOIN_TIMEOUT": os.environ.get("PK_JOIN_TIMEOUT", str(min(timeout, 60.0))),
            }
            parent_conn, child_conn = mpc.Pipe(duplex=False)
            proc = mpc.Process(target=_rank_main, args=(fn, args, rank, env, child_conn, os.getpid()),
                               daemon=True,
                               name=f"pk-rank-{rank}")
            proc.start()
            child_conn.close()
            procs.append(proc)
            conns.append(parent_conn)
        return _collect(procs, conns, timeout)
    finally:
        _stop(procs)
        for c in conns:
            c.close()
        for path in glob.glob(os.path.join(_SHM_DIR, shm_prefix(job_id) + "*")):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _collect(procs: list, conns: list, timeout: float) -> list[Any]:
    world_size = len(procs)
    results: dict[int, Any] = {}
    errors: dict[int, tuple] = {}
    deaths: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    failed_at = None
    while len(results) + len(errors) + len(deaths) < world_size:
        now = time.monotonic()
        if failed_at is not None and now > failed_at + _GRACE_S:
            break
        if now > deadline:
            waiting = sorted(set(range(world_size)) - set(results) - set(errors) - set(deaths))
            raise PKError(f"pk.spawn: rank(s) {waiting} still running after {timeout:g} s; all ranks were stopped")
        pending = {conns[r]: r for r in range(world_size) if r not in results and r not in errors
                   and r not in deaths}
        ready = mp.connection.wait(list(pending) + [procs[r].sentinel for r in pending.values()], timeout=0.1)
        for obj in ready:
            rank = pending.get(obj)
            if rank is None:  # a process ended: read what it sent, if anything, or record its death
                rank = next(r for r in pending.values() if procs[r].sentinel == obj)
                if conns[rank].poll():
                    continue  # its message is waiting on the pipe: take it through the pipe below
                procs[rank].join()
                deaths[rank] = procs[rank].exitcode
            else:
                try:
                    status, *rest = obj.recv()
                except EOFError:  # the pipe closed without a word: the rank died
                    procs[rank].join()
                    deaths[rank] = procs[rank].exitcode
                    status, rest = "died", None
                if status == "ok":
                    results[rank] = rest[0]
                elif status == "error":
                    errors[rank] = tuple(rest)
            if rank in errors or rank in deaths:
                failed_at = failed_at or time.monotonic()
    if errors:
        rank = min(errors)
        message, original, tb = errors[rank]
        others = sorted(set(errors) - {rank})
        if others:
            message += f" (rank(s) {others} failed too)"
        raise RankError(rank, message, original, tb)
    if deaths:
        rank = min(deaths)
        code = deaths[rank]
        how = f"was killed by signal {signal.Signals(-code).name}" if code and code < 0 else f"exited with {code}"
        raise PKError(f"pk.spawn: rank {rank} {how} before returning a result; all ranks were stopped")
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

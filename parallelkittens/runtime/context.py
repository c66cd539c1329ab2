"""Process bootstrap: one context per rank, its backend, its process groups, and teardown.

A rank is one process. `init()` reads the torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), checks that every rank joined, sets up torch.distributed and
returns the `Context`. Peers are the ranks of one node: parallel tensors span `Context.node_group`, so a
world of several nodes can run node-local kernels and use NCCL between nodes.

Backends:

* ``cuda``: one GPU per rank, NCCL for `Context.group`, gloo for control messages.
* ``cuda-shared``: several ranks (processes) on one GPU, gloo only (NCCL refuses two ranks on one GPU).
  Correct but not fast: the ranks' kernels time-slice.
* ``cpu``: kernels run under Triton's interpreter (TRITON_INTERPRET=1), gloo, shared-memory files.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import datetime
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .errors import FLAG, MismatchError, PKError, report_to_torchrun
from .settings import Settings

BACKENDS = ("cuda", "cuda-shared", "cpu")

# NVLink multicast (NVLS) can take a shared host's GPUs out of service; nothing here uses it, and nothing we
# start may turn it on.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass
class Context:
    """What `init()` returns: this rank's place in the world and the groups it talks through.

    `rank`/`world_size` are global; `local_rank`/`local_world_size` count the ranks of this node, which are
    the peers of every parallel tensor. `group` carries data (NCCL on ``cuda``, gloo otherwise); `cpu_group`
    (gloo) carries control messages; `node_group` (gloo) is the node's ranks. `settings` holds the PK_*
    variables, the same on every rank.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup
    node_group: dist.ProcessGroup
    settings: Settings
    job_id: str
    debug_record: torch.Tensor = field(repr=False)
    # The host's view of the record's kind (`errors.py`): host memory a kernel writes as it records, so that a
    # launch, the watchdog and a rank's exit read it without waiting for the device.
    error_flag: ctypes.c_int64 = field(default=None, repr=False)
    # What ops keep between calls (plans, the symmetric heap): it dies with the context.
    plans: dict = field(default_factory=dict, repr=False)
    cache: dict = field(default_factory=dict, repr=False)
    # How often the expensive host steps ran: plans built, host agreements, tunings, symmetric allocations.
    stats: collections.Counter = field(default_factory=collections.Counter, repr=False)
    _finalizers: list[Callable[[], None]] = field(default_factory=list, repr=False)
    # Set when a wait gave up: the ranks' counters are out of step, so no op may run again (`pk.sync()` sets it).
    broken: str = ""
    # The job's rendezvous store: host steps check in there first, so a rank that never arrives is named.
    store: dist.Store | None = field(default=None, repr=False)
    _arrivals: collections.Counter = field(default_factory=collections.Counter, repr=False)

    @property
    def node_rank(self) -> int:
        """Index of this rank's node (ranks are laid out node by node)."""
        return self.rank // self.local_world_size

    @property
    def num_nodes(self) -> int:
        """Number of nodes in the world."""
        return self.world_size // self.local_world_size

    @property
    def debug(self) -> bool:
        """PK_DEBUG: waits give up after PK_WAIT_TIMEOUT seconds."""
        return self.settings.debug

    def on_finalize(self, fn: Callable[[], None]) -> None:
        """Run `fn` when the context ends (modules above the context free what they made through it)."""
        self._finalizers.append(fn)


_CTX: Context | None = None


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise PKError(f"environment variable {name}={value!r} is not an integer") from None


def interpreting() -> bool:
    """True when Triton kernels defined now run under the interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def choose_backend(local_world_size: int, requested: str | None = None, settings: Settings | None = None) -> str:
    """The backend for `local_world_size` ranks on this machine: `requested`, else PK_BACKEND, else the best
    that runs (a GPU per rank, else ranks sharing a GPU, else the CPU interpreter)."""
    name = requested or (settings or Settings.from_env()).backend
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name is None:
        name = "cpu" if gpus == 0 or interpreting() else ("cuda" if gpus >= local_world_size else "cuda-shared")
    if name not in BACKENDS:
        raise PKError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "cuda" and gpus < local_world_size:
        raise PKError(
            f"backend 'cuda' needs one GPU per local rank: {local_world_size} local ranks but {gpus} GPU(s) here; "
            "use backend 'cuda-shared' to run several ranks on one GPU"
        )
    if name == "cuda-shared" and gpus == 0:
        raise PKError("backend 'cuda-shared' needs a GPU, and none is visible here; use backend 'cpu'")
    if name == "cpu" and not interpreting():
        raise PKError(
            "backend 'cpu' runs kernels under Triton's interpreter: set TRITON_INTERPRET=1 before importing "
            "triton and parallelkittens (it is set for you on machines without CUDA)"
        )
    if name != "cpu" and interpreting():
        raise PKError(f"backend {name!r} compiles kernels, but TRITON_INTERPRET=1 is set; use backend 'cpu'")
    return name


def _join(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
    """Every rank announces itself; fail with the missing ranks named instead of hanging."""
    store.set(f"joined/{rank}", "1")
    keys = [f"joined/{r}" for r in range(world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception:  # the store raises its own timeout types, which differ across torch versions
        missing = [r for r in range(world_size) if not store.check([f"joined/{r}"])]
        raise PKError(
            f"rank {rank}: waited {timeout_s:g} s for all {world_size} ranks to join, but rank(s) "
            f"{missing} never called pk.init()"
        ) from None


def _make_store(rank: int, world_size: int, timeout_s: float) -> dist.Store:
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = _env_int("MASTER_PORT", 0)
    if port == 0 and world_size > 1:
        raise PKError(f"rank {rank}: MASTER_PORT is not set; start ranks with torchrun or pk.spawn")
    # Under torchrun (and `pk.spawn`) the launcher already serves the store at MASTER_PORT; a lone process serves
    # its own on a port the system picks (port 0: no probing, so no race with another job).
    serve = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    try:
        store = dist.TCPStore(
            addr, port, world_size, is_master=serve, timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except Exception as e:
        raise PKError(f"rank {rank}: could not reach the rendezvous store at {addr}:{port} ({e})") from None
    return dist.PrefixStore("pk", store)


def init(backend: str | None = None, *, join_timeout: float | None = None) -> Context:
    """Join the world and return this rank's `Context`. Idempotent: later calls return the same context.

    Works in a process started by torchrun or `pk.spawn`, and in a lone process (a world of one).
    `backend` (or PK_BACKEND) picks ``cuda``, ``cuda-shared`` or ``cpu``; by default the best one that runs.
    `join_timeout` (seconds; PK_JOIN_TIMEOUT) bounds the wait for every rank to join. The PK_* variables are
    read here, once (`Settings`); ranks that read different values fail here, on every rank.
    """
    global _CTX
    if _CTX is not None:
        if backend is not None and backend != _CTX.backend:
            raise PKError(f"pk.init(backend={backend!r}) after this rank already initialised as {_CTX.backend!r}")
        return _CTX
    settings = Settings.from_env()
    report_to_torchrun()
    rank, world_size, local_rank, local_world_size = _rank_layout()
    join_timeout = join_timeout or settings.join_timeout_s
    name = choose_backend(local_world_size, backend, settings)
    device = _take_device(name, local_rank)
    store = _make_store(rank, world_size, join_timeout)
    _join(store, rank, world_size, join_timeout)
    world, cpu_group, node_group = _process_groups(name, device, store, rank, world_size, local_world_size,
                                                   join_timeout)
    _agree_on_setup((name, local_world_size, device.type, settings.shared()), world_size, cpu_group)
    ids: list = [settings.job_id or f"{os.getpid()}"] if rank == 0 else [None]
    dist.broadcast_object_list(ids, src=0, group=cpu_group)
    record = torch.zeros(8, dtype=torch.int64, device=device)
    # on a GPU the flag is pinned host memory, which kernels reach through its address; on the CPU, the record's kind
    flag = torch.zeros(1, dtype=torch.int64, pin_memory=True) if device.type == "cuda" else record[:1]
    record[FLAG] = flag.data_ptr()
    _CTX = Context(
        rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size, device=device,
        backend=name, group=world, cpu_group=cpu_group, node_group=node_group, settings=settings, job_id=ids[0],
        debug_record=record, error_flag=ctypes.c_int64.from_address(flag.data_ptr()), store=store,
    )
    _CTX.cache["error_flag"] = flag  # kept alive with the context
    if device.type == "cuda":
        _install_triton_allocator()
    else:
        from . import interpreter

        interpreter.register_buffer(_CTX.debug_record)  # kernels reach it through the handle, not an argument
    atexit.register(finalize)
    return _CTX


def _rank_layout() -> tuple[int, int, int, int]:
    """(rank, world size, local rank, local world size) from the environment, checked."""
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", rank)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if not (0 <= rank < world_size and 0 <= local_rank < local_world_size <= world_size):
        raise PKError(f"bad rank layout: RANK={rank} WORLD_SIZE={world_size} LOCAL_RANK={local_rank} "
                      f"LOCAL_WORLD_SIZE={local_world_size}")
    if world_size % local_world_size or rank % local_world_size != local_rank:
        raise PKError(f"rank {rank}: ranks must be laid out node by node with {local_world_size} per node "
                      f"(LOCAL_RANK={local_rank}, WORLD_SIZE={world_size})")
    return rank, world_size, local_rank, local_world_size


def _take_device(backend: str, local_rank: int) -> torch.device:
    """This rank's device under `backend`: its GPU (NVLink multicast off), or the CPU with the interpreter."""
    if backend == "cpu":
        from . import interpreter

        interpreter.install()
        return torch.device("cpu")
    for key, value in MULTICAST_OFF.items():
        os.environ[key] = value
    if backend == "cuda-shared":
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    index = local_rank if backend == "cuda" else local_rank % torch.cuda.device_count()
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


def _process_groups(backend: str, device: torch.device, store: dist.Store, rank: int, world_size: int,
                    local_world_size: int, join_timeout: float) -> tuple:
    """(the world's group, a gloo group of the world, this rank's node's gloo group)."""
    timeout = datetime.timedelta(seconds=max(join_timeout, 60.0))
    pg_backend = "cpu:gloo,cuda:nccl" if backend == "cuda" else "gloo"
    kwargs = {"device_id": device} if backend == "cuda" else {}
    dist.init_process_group(pg_backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world_size,
                            timeout=timeout, **kwargs)
    world = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "cuda" else world
    node_group = cpu_group
    if local_world_size != world_size:
        for node in range(world_size // local_world_size):
            ranks = list(range(node * local_world_size, (node + 1) * local_world_size))
            group = dist.new_group(ranks, backend="gloo", timeout=timeout)
            if rank in ranks:
                node_group = group
    return world, cpu_group, node_group


def _agree_on_setup(mine: tuple, world_size: int, cpu_group: dist.ProcessGroup) -> None:
    """Every rank must agree on how the job runs (backend, local world size, device type, settings); say so on
    every rank if not."""
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine, group=cpu_group)
    if any(other != mine for other in everyone):
        differ = [r for r, e in enumerate(everyone) if e != everyone[0]]
        rows = "; ".join(f"rank {r}: {_describe_setup(everyone[r], everyone[0])}" for r in [0] + differ)
        dist.destroy_process_group()
        raise PKError(f"ranks disagree on how the job runs (backend, local world size, device type, PK_* "
                      f"settings): {rows}")


def _describe_setup(setup: tuple, reference: tuple) -> str:
    """A rank's (backend, local world, device type, settings), showing only the settings that differ."""
    name, local, device, settings = setup
    differ = [f"{k}={v!r}" for (k, v), (_, ref) in zip(settings, reference[3], strict=True) if v != ref]
    return f"{name}, {local} local rank(s), {device}" + (f", {', '.join(differ)}" if differ else "")


_ALLOCATOR: Callable | None = None
_THREAD = threading.local()


def use_triton_allocator() -> None:
    """Install our Triton allocator in the calling thread, once (cheap to call before every launch).

    Triton keeps its allocator in a context variable, which a new thread starts without: kernels launched from
    autograd's device thread (every backward) would otherwise fail with "no allocator was set".
    """
    if _ALLOCATOR is not None and getattr(_THREAD, "allocator", None) is not _ALLOCATOR:
        import triton

        triton.set_allocator(_ALLOCATOR)
        _THREAD.allocator = _ALLOCATOR


def _install_triton_allocator() -> None:
    global _ALLOCATOR
    per_stream: dict[int | None, torch.Tensor] = {}

    def alloc(size: int, alignment: int, stream: int | None) -> torch.Tensor:
        # Device-side tensor descriptors (TMA) need global scratch for the descriptors themselves, asked for at
        # every launch. Launches on one stream run one after another, so one buffer per stream serves them all:
        # a fresh torch.empty per launch cost about 2 µs of host time. A CUDA-graph capture gets fresh buffers,
        # which the graph's memory pool keeps for the graph (a cached one could be in use by eager launches).
        if torch.cuda.is_current_stream_capturing():
            return torch.empty(size, dtype=torch.int8, device="cuda")
        buf = per_stream.get(stream)
        if buf is None or buf.numel() < size:
            buf = per_stream[stream] = torch.empty(max(size, 1 << 16), dtype=torch.int8, device="cuda")
        return buf

    _ALLOCATOR = alloc
    use_triton_allocator()


def context() -> Context:
    """The context of this rank; raises if `init()` has not run."""
    if _CTX is None:
        raise PKError("parallelkittens is not initialised on this rank: call pk.init() first")
    return _CTX


def is_initialized() -> bool:
    """True once `init()` has run on this rank (and `finalize()` has not)."""
    return _CTX is not None


def exchange(step: str, payload: object, group: dist.ProcessGroup | None = None) -> list:
    """Every rank of the node's `payload` (host, collective), checked to come from the same `step`.

    Host steps meet through gloo in call order, so a rank at one step (building a plan, say) would otherwise
    read what a rank at another step (`pk.sync()`) sent; here that is a `MismatchError` naming each rank's step.
    """
    ctx = context()
    group = group or ctx.node_group
    _arrive(ctx, step, dist.get_process_group_ranks(group))
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (step, payload), group=group)
    steps = [s for s, _ in everyone]
    if any(s != step for s in steps):
        rows = "; ".join(f"rank {r}: {s}" for r, s in enumerate(steps))
        raise MismatchError(f"rank {ctx.rank}: ranks are at different steps of the job ({rows}): they called "
                            "different ops, or the same op with different arguments, in different orders")
    return [p for _, p in everyone]


def _arrive(ctx: Context, step: str, members: list[int]) -> None:
    """Check in at a host step and wait, at most PK_TIMEOUT seconds (the watchdog), for the other `members`:
    a rank that never comes (stuck, dead, or calling something else) is named instead of hanging the job."""
    if ctx.store is None or len(members) == 1:
        return
    # the whole member list names the group (two groups may share a first rank and a size); the restart count
    # keeps a restarted job (torchrun --max-restarts) off the keys of the run before it
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    tag = f"arrive/{restart}/{','.join(map(str, members))}"
    seq = ctx._arrivals[tag]
    ctx._arrivals[tag] += 1
    ctx.store.set(f"{tag}/{seq}/{ctx.rank}", step)
    ctx.store.set(f"last/{restart}/{ctx.rank}", step)  # what a peer's error names as this rank's last step
    keys = [f"{tag}/{seq}/{r}" for r in members]
    bound, name = ((ctx.settings.wait_timeout_s, "PK_WAIT_TIMEOUT") if ctx.settings.debug else
                   (ctx.settings.timeout_s, "PK_TIMEOUT"))
    try:
        ctx.store.wait(keys, datetime.timedelta(seconds=bound))
    except Exception:  # the store's timeout types differ across torch versions
        missing = [r for r in members if not ctx.store.check([f"{tag}/{seq}/{r}"])]
        if not missing:  # they came just as the wait gave up
            return _forget(ctx, tag, seq)
        ctx.broken = f"rank(s) {missing} did not arrive within {bound:g} s ({name}) at {step!r}"
        raise PKError(f"rank {ctx.rank}: rank(s) {missing} did not arrive within {bound:g} s ({name}) at {step!r}: "
                      f"they are stuck in an earlier step, dead, or did not make this call ("
                      f"{last_steps(ctx.store, missing, restart)})") from None
    _forget(ctx, tag, seq)


def last_steps(store: dist.Store, ranks: list[int], restart: str) -> str:
    """Each rank's last host step, and whether its job function had returned, as the job's store has them."""
    said = []
    for r in ranks:
        step = store.get(f"last/{restart}/{r}").decode() if store.check([f"last/{restart}/{r}"]) else "none yet"
        returned = store.check([f"returned/{restart}/{r}"])
        said.append(f"rank {r}: " + ("had returned from the job's function, " if returned else "") +
                    f"last host step {step!r}")
    return "; ".join(said)


def _forget(ctx: Context, tag: str, seq: int) -> None:
    """Delete this rank's key of two steps back: every member has passed that step's wait (they all set their key
    of the step after it, which this rank just saw), so none reads it again; the store stays small."""
    if seq >= 2:
        try:
            ctx.store.delete_key(f"{tag}/{seq - 2}/{ctx.rank}")
        except Exception:  # noqa: BLE001 - a store without delete_key keeps its keys; nothing else changes
            pass


def finalize() -> None:
    """Free the context's resources and leave the process groups. Safe to call twice."""
    global _CTX
    if _CTX is None:
        return
    ctx, _CTX = _CTX, None
    ctx.plans.clear()
    ctx.cache.clear()
    for fn in reversed(ctx._finalizers):
        fn()
    if dist.is_initialized():
        dist.destroy_process_group()
    ctx.store = None  # the store's client now, not at interpreter teardown (threads still holding the context)

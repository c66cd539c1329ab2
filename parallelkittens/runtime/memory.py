"""Parallel tensors (the paper's PGL): a same-shaped buffer on every rank of a node, each rank able to address
its peers' buffers.

How peer memory is shared:

* CUDA (``cuda`` and ``cuda-shared``): torch's symmetric memory (`torch.distributed._symmetric_memory`). It ships
  with torch, needs no extra dependency, maps peers with CUDA's virtual-memory API (the paper's method), frees
  the mappings with the tensor, and allows several ranks on one GPU once
  TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 is set (the runtime sets it for ``cuda-shared``). Legacy CUDA IPC
  through cuda-python would also work but adds a dependency and cannot grow into multicast later.
  Multicast stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
* CPU: one shared-memory file per rank and allocation under /dev/shm; the names are exchanged over gloo, every
  rank maps every file, and once all have mapped them each owner unlinks its file. From then on only the
  mappings exist, and they vanish with the processes, even after a crash.

A kernel receives `ParallelTensor.handle`, laid out as `runtime/handle.py` says: rank, world size, where
waits record errors, how long they wait, and every rank's base address.
"""

from __future__ import annotations

import itertools
import math
import os
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import context as _context
from . import handle as _handle
from . import interpreter
from .errors import PKError

_ALIGN = 128  # bytes: keeps tensor descriptors (16 B) and wide vector accesses aligned
_SHM_DIR = "/dev/shm"

_sequence = itertools.count()
_live: weakref.WeakSet[ParallelTensor] = weakref.WeakSet()
_by_address: weakref.WeakValueDictionary[int, ParallelTensor] = weakref.WeakValueDictionary()  # local start -> it


def shm_prefix(job_id: str) -> str:
    """Prefix of every shared-memory file a job creates; `pk.spawn` removes leftovers by it."""
    return f"pk-{job_id}-"


class ParallelTensor:
    """A buffer of the same shape and dtype on every rank of the node.

    `local` is this rank's torch tensor, `peer(r)` a torch tensor viewing rank r's buffer, `ptrs` an int64
    tensor of every rank's base address (on this rank's device), `handle` what kernels take. Allocate with
    `pk.empty` / `pk.zeros`; `free()` is collective.
    """

    def __init__(self, local: torch.Tensor, peers: list[torch.Tensor], bases: list[int], rank: int, name: str,
                 keepalive: object = None):
        ctx = _context.context()
        self.local = local
        self._peers = peers
        self.rank = rank
        self.world_size = len(peers)
        self.name = name
        self._keepalive = keepalive
        self.handle = _handle.make(rank, bases, ctx.debug_record.data_ptr(), int(ctx.settings.wait_bound_s * 1e9),
                                   local.device)
        self.ptrs = self.handle[_handle.BASES:]
        self._bases = bases
        # compared by `owner_of` and `owner_at`, which run on every collective call
        self._layout, self._device = (tuple(local.shape), local.dtype), local.device
        _live.add(self)
        _by_address[self.local.data_ptr()] = self

    @property
    def shape(self) -> torch.Size:
        """Shape of each rank's buffer."""
        return self.local.shape

    @property
    def dtype(self) -> torch.dtype:
        """Element type."""
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        """This rank's device."""
        return self.local.device

    def peer(self, r: int) -> torch.Tensor:
        """A torch tensor viewing rank `r`'s buffer (r counts the node's ranks; `peer(self.rank)` is `local`)."""
        if self._peers is None:
            raise PKError(f"parallel tensor {self.name!r} was freed")
        if not isinstance(r, int) or not 0 <= r < self.world_size:
            raise PKError(f"peer index {r!r} out of range for a world of {self.world_size} rank(s)")
        return self._peers[r]

    def set_wait_timeout(self, seconds: float) -> None:
        """Bound each wait on this tensor's counters by `seconds` (default PK_WAIT_TIMEOUT with PK_DEBUG=1, else
        PK_TIMEOUT)."""
        self.handle[_handle.WAIT_TIMEOUT_NS] = int(seconds * 1e9)

    def free(self) -> None:
        """Release this buffer on every rank (collective: every rank frees its parallel tensors in the same
        order). Waits for this rank's device work and for every peer first, so no kernel still uses it."""
        if self._peers is None:
            return
        ctx = _context.context()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        dist.barrier(group=ctx.node_group)
        self._release()

    def _release(self) -> None:
        if self._peers is None:
            return
        if self.device.type == "cpu":
            for t in self._peers:
                interpreter.unregister_buffer(t)
        if _by_address.get(self.local.data_ptr()) is self:
            del _by_address[self.local.data_ptr()]
        self._peers = None
        self._keepalive = None
        self.local = torch.empty(0, dtype=self.local.dtype, device=self.local.device)
        _live.discard(self)

    def contains(self, address: int) -> tuple[int, int] | None:
        """(rank, flat element index) if `address` falls in one of the ranks' buffers, else None."""
        if self._peers is None:
            return None
        size = self.local.numel() * self.local.element_size()
        for r, base in enumerate(self._bases):
            if base <= address < base + size:
                return r, (address - base) // self.local.element_size()
        return None

    def __repr__(self) -> str:
        state = "freed" if self._peers is None else f"{tuple(self.shape)}, {self.dtype}"
        return f"ParallelTensor({self.name!r}, {state}, rank {self.rank} of {self.world_size})"


def owner_of(t: torch.Tensor) -> ParallelTensor | None:
    """The live parallel tensor whose whole local buffer `t` is (same start, shape and dtype), if any."""
    pt = owner_at(t.data_ptr(), tuple(t.shape), t.dtype)
    return pt if pt is not None and pt._device == t.device and t.is_contiguous() else None


def owner_at(address: int, shape: tuple[int, ...], dtype: torch.dtype) -> ParallelTensor | None:
    """`owner_of` for a tensor already checked to be contiguous, on this rank's device, of `shape` and `dtype`
    (a plan's per-call check does that): the live parallel tensor whose local buffer starts at `address` and has
    that shape and dtype, if any. Cheaper than `owner_of` by the checks it skips."""
    pt = _by_address.get(address)  # a dictionary, not a scan: this runs on every collective call
    return pt if pt is not None and pt._peers is not None and pt._layout == (shape, dtype) else None


def describe_address(address: int) -> str:
    """Name the parallel-tensor element at `address` (for error messages), e.g. ``'flags'[3] of rank 1``."""
    for pt in list(_live):
        hit = pt.contains(address)
        if hit is not None:
            rank, flat = hit
            index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), pt.shape)) if pt.shape else ()
            shown = index[0] if len(index) == 1 else index
            return f"counter {pt.name!r}{[shown] if not isinstance(shown, tuple) else list(shown)} of rank {rank}"
    return f"address {address:#x} (in no live parallel tensor)"


def _validate(shape: Sequence[int] | int, dtype: torch.dtype) -> tuple[int, ...]:
    if isinstance(shape, int):
        shape = (shape,)
    if not isinstance(shape, (tuple, list, torch.Size)) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise PKError(f"shape must be a sequence of non-negative ints, got {shape!r}")
    if not isinstance(dtype, torch.dtype):
        raise PKError(f"dtype must be a torch.dtype, got {dtype!r}")
    return tuple(shape)


def _agree(ctx: _context.Context, seq: int, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> None:
    """Every rank must ask for the same buffer in the same order; otherwise all of them raise, naming each ask."""
    mine = (seq, shape, str(dtype), name)
    everyone = _context.exchange("allocating a parallel tensor", mine)
    if any(e != mine for e in everyone):
        asks = "; ".join(f"rank {r}: #{e[0]} {e[3]!r} {e[1]} {e[2]}" for r, e in enumerate(everyone))
        raise PKError(f"ranks asked for different parallel tensors (allocation #, name, shape, dtype): {asks}")


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    size = math.prod(shape) * dtype.itemsize
    return max(_ALIGN, -(-size // _ALIGN) * _ALIGN)


def _view(raw: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    count = math.prod(shape)
    return raw.view(dtype)[:count].view(shape)


def _allocate_cpu(ctx: _context.Context, seq: int, shape, dtype, name: str) -> ParallelTensor:
    nbytes = _nbytes(shape, dtype)
    path = os.path.join(_SHM_DIR, f"{shm_prefix(ctx.job_id)}{ctx.rank}-{seq}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        # reserve the pages now: a full /dev/shm then fails here with an error, not later with SIGBUS
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        raise PKError(f"rank {ctx.rank}: cannot allocate {nbytes} bytes of shared memory in {_SHM_DIR}: {e}") from None
    os.close(fd)
    try:
        paths: list = [None] * ctx.local_world_size
        dist.all_gather_object(paths, path, group=ctx.node_group)
        raws = [torch.from_file(p, shared=True, size=nbytes, dtype=torch.uint8) for p in paths]
        dist.barrier(group=ctx.node_group)  # every rank has mapped every file: the names may go
    finally:
        os.unlink(path)
    peers = [_view(raw, shape, dtype) for raw in raws]
    for t in peers:
        interpreter.register_buffer(t)
    bases = [raw.data_ptr() for raw in raws]
    return ParallelTensor(peers[ctx.local_rank], peers, bases, ctx.local_rank, name)


def _allocate_cuda(ctx: _context.Context, shape, dtype, name: str) -> ParallelTensor:
    import torch.distributed._symmetric_memory as symm_mem

    nbytes = _nbytes(shape, dtype)
    raw = symm_mem.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    handle = symm_mem.rendezvous(raw, ctx.node_group)
    # The buffer may sit inside a larger symmetric block: peers hold it at the same offset.
    offset = raw.data_ptr() - handle.buffer_ptrs[handle.rank]
    bases = [int(p) + offset for p in handle.buffer_ptrs]
    peers = []
    for r in range(ctx.local_world_size):
        view = raw if r == handle.rank else handle.get_buffer(r, (nbytes,), torch.uint8, offset)
        peers.append(_view(view, shape, dtype))
    return ParallelTensor(peers[ctx.local_rank], peers, bases, ctx.local_rank, name, keepalive=(raw, handle))


def empty(shape: Sequence[int] | int, dtype: torch.dtype = torch.float32, *, name: str | None = None
          ) -> ParallelTensor:
    """Allocate a parallel tensor: one uninitialised buffer of `shape` and `dtype` on every rank of the node.

    Collective over the node's ranks: each must call it with the same shape and dtype, in the same order, or
    every rank raises `PKError`. Allocate once, before the hot loop: it exchanges handles between processes.
    """
    ctx = _context.context()
    shape = _validate(shape, dtype)
    seq = next(_sequence)
    name = name or f"buffer{seq}"
    _agree(ctx, seq, shape, dtype, name)
    ctx.stats["allocations"] += 1
    if _free_all not in ctx._finalizers:
        ctx.on_finalize(_free_all)
    if ctx.device.type == "cpu":
        return _allocate_cpu(ctx, seq, shape, dtype, name)
    return _allocate_cuda(ctx, shape, dtype, name)


def zeros(shape: Sequence[int] | int, dtype: torch.dtype = torch.float32, *, name: str | None = None
          ) -> ParallelTensor:
    """Like `empty`, zero-filled on every rank before any rank returns (so a peer's first write is never lost).

    Use it for signal and barrier counters: ``pk.zeros(n, torch.int32)``.
    """
    pt = empty(shape, dtype, name=name)
    pt.local.zero_()
    ctx = _context.context()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    dist.barrier(group=ctx.node_group)
    return pt


def _free_all() -> None:
    """Drop every live parallel tensor of this rank without talking to peers (teardown, maybe after a crash)."""
    for pt in list(_live):
        pt._release()

"""What every collective shares: a symmetric workspace, one pull kernel, and its one-way protocol.

**Pull, one way.** Each rank's input sits in a symmetric buffer (its own parallel tensor, or a workspace it
is copied into). Program p of every rank announces "my input is ready" by adding to counter arrive[p] on
every rank, waits until its own arrive[p] reaches W·epoch, then reads the peers' tiles straight into the
output in its final layout (summing them in fp32 for reductions). No two-way handshake, no staging on the
receiver (the paper's principle 3). When done reading it adds to done[p] on every rank and waits for its own
done[p] to reach W·epoch, so no rank overwrites its input while a peer still reads it. Counters only grow:
the epoch lives on the device (the last program to finish advances it), so calls can be captured in a CUDA
graph and replayed.

**Ranks that disagree.** Before its first signal each program writes the call's signature (op, shapes, dtype,
dimensions) into a slot of every rank; after the wait it compares all slots. If any differs, every program on
every rank skips the data and still completes the protocol, so nothing hangs and nothing is read out of
bounds; the rank records a `MismatchError`, which `pk.sync()` raises on every rank. With PK_DEBUG=1 the
signatures are also compared on the host before any launch, and the error is raised right away.

**Tiles.** The copy is described as a 4-D index space (three row dimensions and one contiguous column
dimension) with row strides on the source and destination and offsets that depend on this rank (``me``) and
on the peer read (``r``); every collective is such a copy.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from .. import language as pkl
from ..runtime.context import check_errors, context
from ..runtime.device import num_sms
from ..runtime.errors import SIGNATURES, MismatchError, PKError
from ..runtime.launch import launch
from ..runtime.memory import ParallelTensor, empty, zeros
from ..runtime.sizes import next_power_of_2

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MOVE_DTYPES = FLOAT_DTYPES + tuple(d for d in (getattr(torch, "float8_e4m3fn", None),
                                               getattr(torch, "float8_e5m2", None)) if d is not None) + (
    torch.int32, torch.int64, torch.uint8, torch.int8, torch.int16)


@triton.jit
def _record_mismatch(h, theirs, mine):
    record = tl.load(h + 2).to(tl.pointer_type(tl.int64))
    if tl.atomic_cas(record, tl.full([], 0, tl.int64), tl.full([], 2, tl.int64)) == 0:
        tl.store(record + 1, tl.load(h))
        tl.store(record + 3, theirs)
        tl.store(record + 4, mine)
        tl.store(record + 5, tl.program_id(0).to(tl.int64))


@triton.jit
def _meet(epoch, arrive_ptr, hc, slots_ptr, hs, sig):
    """This rank's signature into its slot on every rank, then an arrival on every rank's counter; once all
    ranks of call `epoch` have arrived, compare the slots. Returns 0, or a differing signature (recorded as a
    MismatchError). Every rank sees the same slots, so every rank reaches the same verdict."""
    me = pkl.rank(hc)
    world = pkl.world_size(hc)
    slot = slots_ptr + (epoch & 1) * world  # two sets of slots: a peer may be one call ahead (& 1: may wrap)
    for r in range(world):
        pkl.store(slot + me, sig, hs, r)
    pkl.signal_all(arrive_ptr, hc)
    pkl.wait_at_least(arrive_ptr, world * epoch, hc)
    mismatch = tl.zeros([], tl.int64)
    for r in range(world):
        theirs = tl.load(slot + r, volatile=True)
        mismatch = tl.where(theirs != sig, theirs, mismatch)
    if mismatch != 0:
        _record_mismatch(hc, mismatch, sig)
    return mismatch


@triton.jit(do_not_specialize=["sig"])
def _agree_kernel(ctr_ptr, hc, slots_ptr, hs, skip_ptr, sig):
    """One program per rank: `_meet`, then tell this rank's kernels whether to skip the call."""
    epoch = tl.load(ctr_ptr) + 1
    mismatch = _meet(epoch, ctr_ptr + 1, hc, slots_ptr, hs, sig)
    tl.store(skip_ptr, (mismatch != 0).to(tl.int32))
    tl.store(ctr_ptr, epoch)


@triton.jit
def agreed(skip_ptr):
    """Whether the ranks agreed on this call (`Agreement`'s flag is zero), in a fused op's kernel: its `go` for
    `lcsc`, which reads it only where a program first needs it, so that the load's latency hides behind the
    first tile's k-loop."""
    return tl.load(skip_ptr) == 0


@triton.jit
def _within(mask, offsets, limit, LIMIT: tl.constexpr):
    # Only the two-shot all_reduce needs the bound; elsewhere leaving it out keeps the mask constant over
    # 16-byte groups, so that Triton can issue 16-byte loads (with it, the loads were 2 bytes wide).
    if LIMIT:
        return mask & (offsets < limit)
    else:
        return mask


@triton.jit(do_not_specialize=["sig"])
def _pull_kernel(src_ptr, h, out_ptr, ctr_ptr, hc, meta_ptr, hm, sig, limit,
                 R0, R1, R2, C, ss0, ss1, ss2, ds0, ds1, ds2, src_me, src_r, dst_me, dst_r,
                 REDUCE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, LIMIT: tl.constexpr):
    p = tl.program_id(0)
    num_programs = tl.num_programs(0)
    me = pkl.rank(h).to(tl.int64)
    world = pkl.world_size(h)
    epoch = tl.load(ctr_ptr) + 1
    if _meet(epoch, ctr_ptr + 2 + p, hc, meta_ptr, hm, sig) == 0:
        rows = R0 * R1 * R2
        tiles_c = tl.cdiv(C, BC)
        for t in range(p, tl.cdiv(rows, BR) * tiles_c, num_programs):
            row = (t // tiles_c) * BR + tl.arange(0, BR).to(tl.int64)  # int64: offsets may pass 2^31
            col = (t % tiles_c) * BC + tl.arange(0, BC)
            i2 = row % R2
            i1 = (row // R2) % R1
            i0 = row // (R1 * R2)
            src_off = (i0 * ss0 + i1 * ss1 + i2 * ss2)[:, None] + col[None, :] + src_me * me
            dst_off = (i0 * ds0 + i1 * ds1 + i2 * ds2)[:, None] + col[None, :] + dst_me * me
            mask = (row < rows)[:, None] & (col < C)[None, :]
            if REDUCE:  # every rank sums in rank order, so every rank gets the same bits
                acc = tl.zeros([BR, BC], tl.float32)
                for r in range(world):
                    m = _within(mask, src_off + src_r * tl.cast(r, tl.int64), limit, LIMIT)
                    acc += pkl.load(src_ptr + src_off + src_r * r, h, r, m, 0).to(tl.float32)
                tl.store(out_ptr + dst_off, acc.to(out_ptr.dtype.element_ty), mask=mask)
            else:
                for i in range(world):
                    peer = (me + i) % world  # start at different peers so ranks do not all read one link
                    m = _within(mask, src_off + src_r * peer, limit, LIMIT)
                    value = pkl.load(src_ptr + src_off + src_r * peer, h, peer, m)
                    tl.store(out_ptr + dst_off + dst_r * peer, value, mask=m)
    done = ctr_ptr + 2 + num_programs + p
    pkl.signal_all(done, hc)
    pkl.wait_at_least(done, world * epoch, hc)
    if tl.atomic_add(ctr_ptr + 1, 1, sem="acq_rel", scope="gpu") == num_programs - 1:  # the last one out
        tl.store(ctr_ptr + 1, 0)
        tl.store(ctr_ptr, epoch)


@dataclass(frozen=True)
class Copy:
    """One pull: for each peer r, the region at ``src_me*me + src_r*r`` of r's buffer, shaped (rows..., cols)
    with row strides `src_strides`, lands at ``dst_me*me + dst_r*r`` of the output with `dst_strides`
    (summed over r when `reduce`). Source elements at or past `limit` read as zero / are skipped."""

    rows: tuple[int, int, int]
    cols: int
    src_strides: tuple[int, int, int]
    dst_strides: tuple[int, int, int]
    src_me: int = 0
    src_r: int = 0
    dst_me: int = 0
    dst_r: int = 0
    reduce: bool = False
    limit: int = 2**62


@functools.lru_cache(maxsize=4096)  # pure, and called with the same layouts call after call
def collapse(shape: tuple[int, ...], src: tuple[int, ...], dst: tuple[int, ...]
             ) -> tuple[tuple[int, int, int], int, tuple[int, int, int], tuple[int, int, int]]:
    """Merge dimensions that are contiguous in both layouts and pad to (3 row dims, 1 column dim); the last
    dimension must have stride 1 in both. Raises PKError for layouts needing more than four dimensions."""
    dims = [(n, s, d) for n, s, d in zip(shape, src, dst, strict=True) if n != 1] or [(1, 1, 1)]
    if dims[-1][1] != 1 or dims[-1][2] != 1:
        dims.append((1, 1, 1))
    merged = [dims[-1]]
    for n, s, d in reversed(dims[:-1]):
        inner_n, inner_s, inner_d = merged[0]
        if s == inner_s * inner_n and d == inner_d * inner_n:
            merged[0] = (n * inner_n, inner_s, inner_d)
        else:
            merged.insert(0, (n, s, d))
    if len(merged) > 4:
        raise PKError(f"this layout needs {len(merged)} dimensions after merging; at most 4 are supported")
    while len(merged) < 4:
        merged.insert(0, (1, 0, 0))
    rows = tuple(n for n, _, _ in merged[:3])
    return rows, merged[3][0], tuple(s for _, s, _ in merged[:3]), tuple(d for _, _, d in merged[:3])


def signature(*parts) -> int:
    """A 62-bit id of the call's op, shapes, dtype and dims; registered for readable mismatch errors."""
    return _signature(parts)


@functools.lru_cache(maxsize=4096)  # a call's parts repeat from call to call: hash them once
def _signature(parts: tuple) -> int:
    text = repr(parts)
    # bit 61 set: never 0, and always past 2^31, so that Triton passes every signature as an int64 (a kernel
    # compiled for a small one would take int32 and could not take the next)
    sig = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 3 | 1 << 61
    SIGNATURES[sig] = f"{parts[0]} with {', '.join(map(str, parts[1:]))}"
    return sig


class Workspace:
    """Symmetric staging buffer (bytes, grown on demand, collectively) and the protocol's counters, made once
    per op; `calls` share it in order."""

    def __init__(self, name: str, programs_per_sm: int | None = None, tile_bytes: int = 16384, num_warps: int = 4):
        ctx = context()
        self.name = name
        # Two programs per SM with 16 KB tiles keep enough loads in flight to fill HBM (a sweep on an H200,
        # scripts/diagnose_collectives.py: 1.9 TB/s copying, as with 4 or 8 per SM, and fewer programs make the
        # protocol cheaper); under the interpreter every program is a thread, so one per "SM" there.
        self.programs = num_sms() * (programs_per_sm or (2 if ctx.device.type == "cuda" else 1))
        self.tile_bytes, self.num_warps = tile_bytes, num_warps
        # [epoch, finished, arrive[programs], done[programs]]
        self.counters = zeros(2 + 2 * self.programs, torch.int32, name=f"{name}.counters")
        self.meta = zeros(2 * ctx.local_world_size, torch.int64, name=f"{name}.signatures")
        self.buffers: dict[int, ParallelTensor] = {}
        self._views: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # view()'s answers, until a buffer grows

    def staging(self, nbytes: int, slot: int = 0, zero: bool = False) -> ParallelTensor:
        """Symmetric buffer `slot`, at least `nbytes` long (growing it is collective: every rank grows together,
        in powers of two from 1 MiB, so that repeated calls of one size never reallocate). With `zero`, a new
        buffer starts zeroed on every rank (for counters and accumulators that ops return to zero)."""
        buf = self.buffers.get(slot)
        if buf is None or buf.local.numel() < nbytes:
            confirm_agreement()  # growing is collective: only if the ranks agreed on this call
            if buf is not None:
                buf.free()
            self._views.clear()
            size = 1 << math.ceil(math.log2(max(nbytes, 1 << 20)))
            make = zeros if zero else empty
            buf = self.buffers[slot] = make(size, torch.uint8, name=f"{self.name}.buffer{slot}")
        return buf

    def view(self, shape: tuple[int, ...], dtype: torch.dtype, slot: int, zero: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tensor of `shape` and `dtype` at the start of buffer `slot`, the buffer's handle): one buffer serves
        every shape an op is called with, so memory tracks the largest call rather than every shape seen."""
        hit = self._views.get((shape, dtype, slot))
        if hit is not None:  # slicing and viewing cost more host time than a small kernel's launch
            return hit
        nbytes = math.prod(shape) * dtype.itemsize
        buf = self.staging(nbytes, slot, zero)
        self._views[(shape, dtype, slot)] = view = buf.local[:nbytes].view(dtype).view(shape), buf.handle
        return view

    def source(self, x: torch.Tensor, pt: ParallelTensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(pointer tensor, handle) for peers to read `x` from: `x` itself if it is the local buffer of `pt`
        (its `owner_of`, which the op has looked up for its signature), else a copy in the staging buffer."""
        if pt is not None:
            return x, pt.handle
        buf = self.staging(x.numel() * x.element_size())
        staged = buf.local[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        staged.copy_(x)
        return staged, buf.handle

    def pull(self, src: torch.Tensor, handle: torch.Tensor, out: torch.Tensor, copy: Copy, sig: int) -> None:
        """Launch the pull kernel for `copy` from every rank's `src` into `out`."""
        tile = self.tile_bytes // src.element_size()  # elements per tile
        bc = min(tile, next_power_of_2(max(copy.cols, 16)))
        rows = math.prod(copy.rows)
        br = max(1, min(tile // bc, next_power_of_2(rows)))
        launch(_pull_kernel, (self.programs,), src, handle, out, self.counters.local, self.counters.handle,
               self.meta.local, self.meta.handle, sig, copy.limit, *copy.rows, copy.cols, *copy.src_strides,
               *copy.dst_strides, copy.src_me, copy.src_r, copy.dst_me, copy.dst_r, REDUCE=copy.reduce, BR=br,
               BC=bc, LIMIT=copy.limit < 2**62, num_warps=self.num_warps,
               key=(sig, copy, src.dtype, out.dtype, src.data_ptr() % 16, out.data_ptr() % 16))


class Agreement:
    """For ops whose kernels exchange data without the pull kernel's protocol (the fused GEMMs): before any data
    moves, one small kernel compares the call's signature across ranks on the device (`__call__` returns the
    flag the op's kernels read: nonzero means skip; `pk.sync()` then raises `MismatchError` on every rank).
    A rank arrives only once its previous kernels have ended, so the meeting also orders consecutive calls:
    after it, no peer still reads or adds into this rank's buffers from the previous call. All fused ops share
    one, so ranks that call different ops also meet, and disagree, rather than hang."""

    def __init__(self):
        ctx = context()
        self.world = ctx.local_world_size
        self.counters = zeros(2, torch.int32, name="fused.agreement")  # epoch, arrivals
        self.slots = zeros(2 * self.world, torch.int64, name="fused.agreement_slots")
        self.skip = torch.zeros(1, dtype=torch.int32, device=ctx.device)
        self.unconfirmed = False  # a meeting whose verdict the host has not read

    def __call__(self, sig: int) -> torch.Tensor:
        if self.world > 1:  # one rank always agrees with itself
            launch(_agree_kernel, (1,), self.counters.local, self.counters.handle, self.slots.local,
                   self.slots.handle, self.skip, sig, key="agree")
            self.unconfirmed = True
        return self.skip

    def confirm(self) -> None:
        """Raise `MismatchError` on this rank if the ranks disagreed on the last call. Ops call it (through
        `confirm_agreement`) before a host step that every rank must take together: making or growing a
        symmetric buffer, tuning. A rank that alone needs such a step (its shapes differ) then raises instead of
        waiting in it for peers that never come; they skip on the device and raise at `pk.sync()`. It waits for
        the device, which is why only those rare steps pay for it."""
        if not self.unconfirmed or (self.skip.is_cuda and torch.cuda.is_current_stream_capturing()):
            return
        self.unconfirmed = False
        if int(self.skip.item()):
            check_errors()  # the meeting recorded what differed: raise that
            raise MismatchError("ranks called a fused op differently (the device's record was already read)")


def confirm_agreement() -> None:
    """`Agreement.confirm` for the fused ops' agreement, if one exists (making it would itself be collective)."""
    made = context().cache.get("agreement")
    if made is not None:
        made.confirm()


def agreement() -> Agreement:
    """The fused ops' `Agreement`, made on first use (collective, like the ops); it lives in the context."""
    cache = context().cache
    if "agreement" not in cache:
        cache["agreement"] = Agreement()
    return cache["agreement"]


def workspace(name: str) -> Workspace:
    """The op's workspace, made on first use (collective, like the op itself); it lives in the context."""
    cache = context().cache
    if ("workspace", name) not in cache:
        confirm_agreement()  # making it is collective: only if the ranks agreed on this call
        cache[("workspace", name)] = Workspace(name)
    return cache[("workspace", name)]


def check_input(op: str, x: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    """Refuse what no rank can run, before anything collective happens."""
    ctx = context()
    if not isinstance(x, torch.Tensor):
        raise PKError(f"{op}: expected a torch.Tensor, got {type(x).__name__}")
    if x.device != ctx.device:
        raise PKError(f"{op}: the tensor is on {x.device}, but this rank's device is {ctx.device}")
    if x.dtype not in dtypes:
        raise PKError(f"{op}: dtype {x.dtype} is not supported; use one of {', '.join(map(str, dtypes))}")
    if not x.is_contiguous():
        raise PKError(f"{op}: the tensor must be contiguous (call .contiguous() first); strides {x.stride()}")


def agree(op: str, sig: int) -> None:
    """With PK_DEBUG=1: compare every rank's call on the host before launching, and raise on every rank."""
    ctx = context()
    if not ctx.debug:
        return
    everyone: list = [None] * ctx.local_world_size
    dist.all_gather_object(everyone, (sig, SIGNATURES.get(sig, "")), group=ctx.node_group)
    if any(s != sig for s, _ in everyone):
        calls = "; ".join(f"rank {r}: {desc}" for r, (_, desc) in enumerate(everyone))
        raise MismatchError(f"{op}: ranks called it differently: {calls}")


def normalize_dim(op: str, dim: int, ndim: int) -> int:
    """`dim` in [0, ndim), or a clear error."""
    if not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise PKError(f"{op}: dim {dim!r} is out of range for a {ndim}-dimensional tensor")
    return dim % ndim

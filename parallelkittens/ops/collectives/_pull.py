"""What every collective shares: one pull kernel, its one-way protocol, and the plan that launches it.

**Pull, one way.** Each rank's input sits in symmetric memory (its own parallel tensor, or the heap's staging
pool it is copied into). The kernel opens with the meeting (`template/meeting.py`): once every rank has
arrived, every rank's input is ready, and each program reads the peers' tiles straight into the output in its
final layout (summing them in fp32 for reductions). No two-way handshake, no staging on the receiver (the
paper's principle 3). When done reading, program p adds one to done[p] on every rank and waits until its own
done[p] reaches W, then resets it: no rank's kernel ends, and so no rank overwrites its input, while a peer still
reads it. Nothing else is kept between calls, so calls can be captured in a CUDA graph and replayed.

**Ranks that disagree.** The meeting compares the call's signature (op, shapes, dtype, dimensions) across ranks
on the device; if any differs, every program on every rank skips the data and the done phase, so nothing hangs
and nothing is read out of bounds, and `pk.sync()` raises `MismatchError` on every rank. (The first call of a
signature already compared the call on the host, when its plan was built.)

**Tiles.** The copy is described as a 4-D index space (three row dimensions and one contiguous column
dimension) with row strides on the source and destination and offsets that depend on this rank (``me``) and
on the peer read (``r``); every collective is such a copy.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ... import language as pkl
from ...runtime.context import context
from ...runtime.device import num_sms
from ...runtime.errors import PKError
from ...runtime.heap import Block, heap
from ...runtime.launch import Launcher
from ...runtime.memory import owner_of
from ...runtime.sizes import next_power_of_2
from ...template import meeting
from .. import plan as plans

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MOVE_DTYPES = FLOAT_DTYPES + tuple(d for d in (getattr(torch, "float8_e4m3fn", None),
                                               getattr(torch, "float8_e5m2", None)) if d is not None) + (
    torch.int32, torch.int64, torch.uint8, torch.int8, torch.int16)


@triton.jit
def _within(mask, offsets, limit, LIMIT: tl.constexpr):
    # Only the two-shot all_reduce needs the bound; elsewhere leaving it out keeps the mask constant over
    # 16-byte groups, so that Triton can issue 16-byte loads (with it, the loads were 2 bytes wide).
    if LIMIT:
        return mask & (offsets < limit)
    else:
        return mask


@triton.jit(do_not_specialize=["sig", "rank"])
def _pull_kernel(src_ptr, src_handle, out_ptr, done_ptr, done_handle, limit,
                 R0, R1, R2, C, ss0, ss1, ss2, ds0, ds1, ds2, src_me, src_r, dst_me, dst_r,
                 meet_counters, meet_slots, meet_handle, sig, rank, world,
                 REDUCE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, LIMIT: tl.constexpr):
    call = meeting.begin(meet_counters, meet_slots, meet_handle, sig, rank, world)
    p = tl.program_id(0)
    me = rank.to(tl.int64)
    if meeting.verdict(call):
        rows = R0 * R1 * R2
        tiles_c = tl.cdiv(C, BC)
        for t in range(p, tl.cdiv(rows, BR) * tiles_c, tl.num_programs(0)):
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
                    acc += pkl.load(src_ptr + src_off + src_r * r, src_handle, r, m, 0).to(tl.float32)
                tl.store(out_ptr + dst_off, acc.to(out_ptr.dtype.element_ty), mask=mask)
            else:
                for i in range(world):
                    peer = (me + i) % world  # start at different peers so ranks do not all read one link
                    m = _within(mask, src_off + src_r * peer, limit, LIMIT)
                    value = pkl.load(src_ptr + src_off + src_r * peer, src_handle, peer, m)
                    tl.store(out_ptr + dst_off + dst_r * peer, value, mask=m)
        if world > 1:  # done reading: no peer may change its input before every rank has read it
            pkl.signal_all(done_ptr + p, done_handle)
            pkl.wait(done_ptr + p, world, done_handle)
            tl.store(done_ptr + p, 0)
    meeting.end(call)


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


@functools.lru_cache(maxsize=4096)
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


class Pull:
    """The pull kernel bound to one `Copy` and dtype: ``Pull(copy, dtype, sig)(src, src_handle, out)``."""

    def __init__(self, copy: Copy, dtype: torch.dtype, sig: int, tile_bytes: int = 16384, num_warps: int = 4):
        tile = tile_bytes // dtype.itemsize  # elements per tile
        bc = min(tile, next_power_of_2(max(copy.cols, 16)))
        br = max(1, min(tile // bc, next_power_of_2(math.prod(copy.rows))))
        done, programs = _done_counters()
        self.launch = Launcher(
            _pull_kernel, (programs,), per_call=("src_ptr", "src_handle", "out_ptr"),
            done_ptr=done.view(programs, torch.int32), done_handle=done.handle, limit=copy.limit,
            R0=copy.rows[0], R1=copy.rows[1], R2=copy.rows[2], C=copy.cols, ss0=copy.src_strides[0],
            ss1=copy.src_strides[1], ss2=copy.src_strides[2], ds0=copy.dst_strides[0], ds1=copy.dst_strides[1],
            ds2=copy.dst_strides[2], src_me=copy.src_me, src_r=copy.src_r, dst_me=copy.dst_me, dst_r=copy.dst_r,
            REDUCE=copy.reduce, BR=br, BC=bc, LIMIT=copy.limit < 2**62, num_warps=num_warps,
            **meeting.meeting().args(sig))

    def __call__(self, src: torch.Tensor, src_handle: torch.Tensor, out: torch.Tensor) -> None:
        self.launch(src, src_handle, out)


def _done_counters() -> tuple[Block, int]:
    """The done phase's counters, one per program, shared by every collective of the context, and how many
    programs the pull kernel runs."""
    cache = context().cache
    if "collective_done" not in cache:
        # Two programs per SM with 16 KB tiles keep enough loads in flight to fill HBM (a sweep on an H200,
        # bench/results/diagnose_collectives-*.txt: 1.9 TB/s copying, as with 4 or 8 per SM, and fewer programs make
        # the protocol cheaper); under the interpreter every program is a thread, so one per "SM" there.
        programs = num_sms() * (2 if context().device.type == "cuda" else 1)
        cache["collective_done"] = heap().allocate(4 * programs, "collectives.done"), programs
    return cache["collective_done"]


class Staging:
    """Where a collective's input is copied for peers to read, when it is not in symmetric memory already: the
    heap's staging pool (collectives run one after another on a rank, and none reads another's)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype):
        nbytes = math.prod(shape) * dtype.itemsize
        self.block = heap().pool("collectives.staging", nbytes)
        self.tensor = self.block.view(shape, dtype)
        self.handle = self.block.handle

    def put(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy `x` in; (the staged tensor, its handle)."""
        self.tensor.copy_(x)
        return self.tensor, self.handle


def source(op: str, x: torch.Tensor, zero_copy: bool, staging: Staging | None, any_handle: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(pointer, handle) where peers read `x`: in place (its parallel tensor), a staged copy, or, at one rank, `x`
    itself with any handle (a rank reading its own buffer translates by zero)."""
    if zero_copy:
        owner = owner_of(x)
        if owner is None:
            raise PKError(f"{op}: this plan reads a parallel tensor in place; x is not one")
        return x, owner.handle
    if staging is not None:
        return staging.put(x)
    return x, any_handle


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


def check_call(op: str, x: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """A plan's per-call check: `x` is what the plan was built for (cheap: no host exchange)."""
    if x.shape != shape or x.dtype != dtype or x.device != device or not x.is_contiguous():
        raise PKError(f"{op}: this plan was built for a contiguous {dtype} tensor of shape {shape} on {device}, "
                      f"got {x.dtype} {tuple(x.shape)} on {x.device}" + ("" if x.is_contiguous() else
                                                                          " (not contiguous)"))


def check_out(op: str, out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """`out` can receive the result: same shape and dtype, contiguous, on this rank's device."""
    if out.shape != shape or out.dtype != dtype or not out.is_contiguous() or out.device != context().device:
        raise PKError(f"{op}: out must be a contiguous {dtype} tensor of shape {shape} on {context().device}, got "
                      f"{out.dtype} {tuple(out.shape)} on {out.device}")


def normalize_dim(op: str, dim: int, ndim: int) -> int:
    """`dim` in [0, ndim), or a clear error."""
    if not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise PKError(f"{op}: dim {dim!r} is out of range for a {ndim}-dimensional tensor")
    return dim % ndim


class PullPlan:
    """A collective that is one pull (all_gather, reduce_scatter, all_to_all): its copy, output shape and staging.

    `zero_copy`: the input is a parallel tensor's local buffer, which peers read in place."""

    def __init__(self, op: str, shape: tuple[int, ...], dtype: torch.dtype, out_shape: tuple[int, ...],
                 copy: Copy | None, zero_copy: bool, *details: object):
        ctx = context()
        self.op, self.shape, self.dtype, self.out_shape = op, shape, dtype, out_shape
        self.device, self.zero_copy = ctx.device, zero_copy
        sig = meeting.signature(op, shape, str(dtype), *details, f"zero_copy={zero_copy}")
        self._any_handle = meeting.meeting().handle  # at one rank the kernel reads only its own input
        moves = copy is not None and ctx.local_world_size > 1
        self._staging = Staging(shape, dtype) if moves and not zero_copy else None
        self._pull = Pull(copy, dtype, sig) if copy is not None else None  # None: nothing to move

    def __call__(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The collective of `x`, into `out` (a new tensor by default)."""
        try:
            check_call(self.op, x, self.shape, self.dtype, self.device)
            if out is None:
                out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
            else:
                check_out(self.op, out, self.out_shape, self.dtype)
            if self._pull is None:
                return out
            src, handle = source(self.op, x, self.zero_copy, self._staging, self._any_handle)
        except PKError as e:
            plans.refuse(int(self._pull is not None), e)
        self._pull(src, handle, out)
        return out

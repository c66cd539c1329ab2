"""What every collective shares: one pull kernel, its one-way protocol, and the plan that launches it.

**Pull, one way, one launch.** Each rank's input sits in symmetric memory: its own parallel tensor, or the heap's
staging pool, which the kernel copies it into first. The kernel opens with the meeting (`template/meeting.py`);
then each program reads the peers' tiles straight into the output in its final layout (summing them in fp32 for
reductions). No two-way handshake, no staging on the receiver (the paper's principle 3).

**Rounds.** Program p on every rank handles the same tiles, so the ranks' programs p synchronise among
themselves, never with another program of their own rank (nothing waits on a program that may not be resident):
a round is a `barrier_all` on counter p. One round after staging (every rank's copy of the tiles p reads is in
place), one between the two phases of a two-shot all_reduce, and one when done reading: no rank's kernel ends,
and so no rank overwrites its input, while a peer still reads it. A call of a plain tensor is one launch, as it
is for a parallel tensor: the copy into staging is not a launch of its own. Nothing else is kept between calls,
so calls can be captured in a CUDA graph and replayed.

**Ranks that disagree.** The meeting compares the call's signature (op, shapes, dtype, dimensions) across ranks
on the device; if any differs, every program on every rank skips the data and the rounds, so nothing hangs
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
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ... import language as pkl
from ...runtime.context import context
from ...runtime.device import num_sms
from ...runtime.errors import PKError
from ...runtime.heap import Block, heap
from ...runtime.launch import Launcher
from ...runtime.memory import owner_at
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


class Geometry(NamedTuple):
    """The copy's index space in a kernel: three row dimensions and a contiguous one, and the row strides of the
    source and the destination (`Copy`)."""

    R0: object
    R1: object
    R2: object
    C: object
    ss0: object
    ss1: object
    ss2: object
    ds0: object
    ds1: object
    ds2: object


@triton.jit
def _tile(G, t, BR: tl.constexpr, BC: tl.constexpr):
    """Tile `t`'s source and destination offsets (before the per-rank offsets) and its mask."""
    tiles_c = tl.cdiv(G.C, BC)
    row = (t // tiles_c) * BR + tl.arange(0, BR).to(tl.int64)  # int64: offsets may pass 2^31
    col = (t % tiles_c) * BC + tl.arange(0, BC)
    i2 = row % G.R2
    i1 = (row // G.R2) % G.R1
    i0 = row // (G.R1 * G.R2)
    src = (i0 * G.ss0 + i1 * G.ss1 + i2 * G.ss2)[:, None] + col[None, :]
    dst = (i0 * G.ds0 + i1 * G.ds1 + i2 * G.ds2)[:, None] + col[None, :]
    return src, dst, (row < G.R0 * G.R1 * G.R2)[:, None] & (col < G.C)[None, :]


@triton.jit
def _num_tiles(G, BR: tl.constexpr, BC: tl.constexpr):
    return tl.cdiv(G.R0 * G.R1 * G.R2, BR) * tl.cdiv(G.C, BC)


@triton.jit
def _stage(G, x_ptr, stage_ptr, limit, src_me, src_r, me, world, BR: tl.constexpr, BC: tl.constexpr,
           LIMIT: tl.constexpr):
    """Copy this rank's input into its symmetric staging buffer: the regions that this program, on every rank,
    will read from it (the tiles t = this program's, for each reader j), so that one round among the ranks'
    same-numbered programs says they are ready, and nothing waits on another program of this rank."""
    readers = tl.where(src_me != 0, world, 1)  # a reader-independent region is copied once
    for t in range(tl.program_id(0), _num_tiles(G, BR, BC), tl.num_programs(0)):
        src, _, mask = _tile(G, t, BR, BC)
        for j in range(readers):
            offsets = src + src_me * j + src_r * me
            m = _within(mask, offsets, limit, LIMIT)
            tl.store(stage_ptr + offsets, tl.load(x_ptr + offsets, mask=m), mask=m)


@triton.jit
def _pull(G, src_ptr, src_handle, out_ptr, limit, src_me, src_r, dst_me, dst_r, me, world,
          REDUCE: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, LIMIT: tl.constexpr):
    """This program's tiles of the copy: from every rank r, the region at src_me*me + src_r*r of r's buffer,
    into the output at dst_me*me + dst_r*r, or summed (in fp32, in rank order: every rank gets the same bits)."""
    for t in range(tl.program_id(0), _num_tiles(G, BR, BC), tl.num_programs(0)):
        src, dst, mask = _tile(G, t, BR, BC)
        src += src_me * me
        dst += dst_me * me
        if REDUCE:
            acc = tl.zeros([BR, BC], tl.float32)
            for r in range(world):
                m = _within(mask, src + src_r * tl.cast(r, tl.int64), limit, LIMIT)
                acc += pkl.load(src_ptr + src + src_r * r, src_handle, r, m, 0).to(tl.float32)
            tl.store(out_ptr + dst, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            for i in range(world):
                peer = (me + i) % world  # start at different peers so ranks do not all read one link
                m = _within(mask, src + src_r * peer, limit, LIMIT)
                value = pkl.load(src_ptr + src + src_r * peer, src_handle, peer, m)
                tl.store(out_ptr + dst + dst_r * peer, value, mask=m)


@triton.jit(do_not_specialize=["sig", "rank"])
def _pull_kernel(x_ptr, src_ptr, src_handle, mid_ptr, mid_handle, out_ptr, rounds_ptr, rounds_handle, limit,
                 R0, R1, R2, C, ss0, ss1, ss2, ds0, ds1, ds2, src_me, src_r, dst_me, dst_r,
                 meet_counters, meet_slots, meet_handle, sig, rank, world,
                 STAGE: tl.constexpr, REDUCE: tl.constexpr, TWO_SHOT: tl.constexpr, IN_PLACE: tl.constexpr,
                 BR: tl.constexpr, BC: tl.constexpr, LIMIT: tl.constexpr):
    call = meeting.begin(meet_counters, meet_slots, meet_handle, sig, rank, world)
    G = Geometry(R0, R1, R2, C, ss0, ss1, ss2, ds0, ds1, ds2)
    me = rank.to(tl.int64)
    mine = rounds_ptr + tl.program_id(0)  # the counter of this program's rounds with its namesakes on every rank
    if STAGE:  # local, so it runs while the ranks meet
        _stage(G, x_ptr, src_ptr, limit, src_me, src_r, me, world, BR, BC, LIMIT)
    if meeting.verdict(call):
        if STAGE:
            pkl.barrier_all(mine, rounds_handle)  # every rank's copy of what this program reads is in place
        if TWO_SHOT:  # reduce-scatter into my slice of `mid`; then all-gather the slices (rank r's is at r*part)
            _pull(G, src_ptr, src_handle, mid_ptr, limit, src_me, src_r, dst_me, dst_r, me, world, True, BR, BC,
                  LIMIT)
            pkl.barrier_all(mine, rounds_handle)
            _pull(G, mid_ptr, mid_handle, out_ptr, limit, 0, src_me, 0, dst_me, me, world, False, BR, BC, LIMIT)
        else:
            _pull(G, src_ptr, src_handle, mid_ptr if IN_PLACE else out_ptr, limit, src_me, src_r, dst_me, dst_r,
                  me, world, REDUCE, BR, BC, LIMIT)
        if world > 1:  # done reading: no peer may change its input before every rank has read it
            pkl.barrier_all(mine, rounds_handle)
        if IN_PLACE:  # the input was the output: now no peer reads it, this program's tiles go in from `mid`
            for t in range(tl.program_id(0), _num_tiles(G, BR, BC), tl.num_programs(0)):
                _, dst, mask = _tile(G, t, BR, BC)
                dst += dst_me * me
                tl.store(out_ptr + dst, tl.load(mid_ptr + dst, mask=mask), mask=mask)
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
    """The pull kernel bound to one `Copy` and dtype: ``Pull(copy, dtype, sig)(x, src, src_handle, out)``, one launch.

    `src` is where peers read this rank's input `x`: `x` itself (a parallel tensor's buffer, or any tensor at one
    rank), or `staging`'s buffer, which the kernel first copies `x` into. `two_shot` (an all_reduce): the copy is
    the reduce-scatter into this rank's slice of `mid` (symmetric, with `mid_handle`), then every rank's slice is
    gathered from `mid` into the output. `in_place` (a one-shot all_reduce whose output is its input, read by peers
    in place): the sums go to `mid` (local) and into the output once no peer reads the input any more.
    """

    def __init__(self, copy: Copy, dtype: torch.dtype, sig: int, *, staging: Staging | None = None,
                 two_shot: bool = False, in_place: bool = False, mid: torch.Tensor | None = None,
                 mid_handle: torch.Tensor | None = None, tile_bytes: int = 16384, num_warps: int = 4):
        tile = tile_bytes // dtype.itemsize  # elements per tile
        bc = min(tile, next_power_of_2(max(copy.cols, 16)))
        br = max(1, min(tile // bc, next_power_of_2(math.prod(copy.rows))))
        rounds, programs = _round_counters()
        counters = rounds.view(programs, torch.int32)
        self.launch = Launcher(
            _pull_kernel, (programs,), per_call=("x_ptr", "src_ptr", "src_handle", "out_ptr"),
            mid_ptr=counters if mid is None else mid, mid_handle=rounds.handle if mid_handle is None else mid_handle,
            rounds_ptr=counters, rounds_handle=rounds.handle, limit=copy.limit,
            R0=copy.rows[0], R1=copy.rows[1], R2=copy.rows[2], C=copy.cols, ss0=copy.src_strides[0],
            ss1=copy.src_strides[1], ss2=copy.src_strides[2], ds0=copy.dst_strides[0], ds1=copy.dst_strides[1],
            ds2=copy.dst_strides[2], src_me=copy.src_me, src_r=copy.src_r, dst_me=copy.dst_me, dst_r=copy.dst_r,
            STAGE=staging is not None, REDUCE=copy.reduce, TWO_SHOT=two_shot, IN_PLACE=in_place, BR=br, BC=bc,
            LIMIT=copy.limit < 2**62, num_warps=num_warps, **meeting.meeting().args(sig))

    def __call__(self, x: torch.Tensor, src: torch.Tensor, src_handle: torch.Tensor, out: torch.Tensor) -> None:
        self.launch(x, src, src_handle, out)


def _round_counters() -> tuple[Block, int]:
    """The counters of the rounds among the ranks' same-numbered programs, one per program (each returns to zero
    after a round: `barrier_all`), shared by every collective of the context; and how many programs the pull
    kernel runs."""
    cache = context().cache
    if "collective_rounds" not in cache:
        # Two programs per SM with 16 KB tiles keep enough loads in flight to fill HBM (a sweep on an H200,
        # bench/results/diagnose_collectives-*.txt: 1.9 TB/s copying, as with 4 or 8 per SM, and fewer programs make
        # the protocol cheaper); under the interpreter every program is a thread, so one per "SM" there.
        programs = num_sms() * (2 if context().device.type == "cuda" else 1)
        cache["collective_rounds"] = heap().allocate(4 * programs, "collectives.rounds"), programs
    return cache["collective_rounds"]


class Staging:
    """Where the pull kernel copies a collective's input for peers to read, when it is not in symmetric memory
    already: the heap's staging pool (collectives run one after another on a rank, and none reads another's)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype):
        nbytes = math.prod(shape) * dtype.itemsize
        self.block = heap().pool("collectives.staging", nbytes)
        self.tensor = self.block.view(shape, dtype)
        self.handle = self.block.handle


def source(op: str, x: torch.Tensor, layout: tuple[tuple[int, ...], torch.dtype], zero_copy: bool,
           staging: Staging | None, any_handle: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pointer, handle) where peers read `x`: in place (its parallel tensor), the staging buffer (the kernel copies
    `x` there), or, at one rank, `x` itself with any handle (a rank reading its own buffer translates by zero).
    `x` has passed `check_call` against the plan's `layout` (shape, dtype)."""
    if zero_copy:
        owner = owner_at(x.data_ptr(), *layout)
        if owner is None:
            raise PKError(f"{op}: this plan reads a parallel tensor in place; x is not one")
        return x, owner.handle
    if staging is not None:
        return staging.tensor, staging.handle
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
        # None: nothing to move
        self._pull = Pull(copy, dtype, sig, staging=self._staging) if copy is not None else None

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
            src, handle = source(self.op, x, (self.shape, self.dtype), self.zero_copy, self._staging, self._any_handle)
        except PKError as e:
            plans.refuse(int(self._pull is not None), e)
        self._pull(x, src, handle, out)
        return out

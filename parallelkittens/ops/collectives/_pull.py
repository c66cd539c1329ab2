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
from ...runtime.memory import owner_at, owner_of
from ...runtime.sizes import next_power_of_2
from ...template import meeting
from ..plan import FLOAT_DTYPES, Plan, check_out, check_tensor, refuse

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


class Route(NamedTuple):
    """Where a pull reads and writes besides its operands: the per-rank offsets of `Copy`, the bound on source
    elements, the middle buffer (two-shot, in place) and the rounds' counters."""

    limit: object
    src_me: object
    src_r: object
    dst_me: object
    dst_r: object
    mid_ptr: object
    mid_handle: object
    rounds_ptr: object
    rounds_handle: object


class Steps(NamedTuple):
    """What a pull kernel does, at compile time."""

    STAGE: tl.constexpr  # copy x into the staging buffer first
    REDUCE: tl.constexpr  # sum over ranks (else copy)
    TWO_SHOT: tl.constexpr  # reduce-scatter into `mid`, then all-gather from it
    IN_PLACE: tl.constexpr  # the output is the input: sums wait in `mid` until no peer reads it
    BR: tl.constexpr
    BC: tl.constexpr
    LIMIT: tl.constexpr  # source elements past `limit` are skipped


@triton.jit
def _pull_kernel(x_ptr, src_ptr, src_handle, out_ptr, G, R, meet, S):
    call = meeting.begin(meet)
    me = call.rank.to(tl.int64)
    world = call.world
    mine = R.rounds_ptr + tl.program_id(0)  # the counter of this program's rounds with its namesakes on every rank
    if S.STAGE:  # local, so it runs while the ranks meet
        _stage(G, x_ptr, src_ptr, R.limit, R.src_me, R.src_r, me, world, S.BR, S.BC, S.LIMIT)
    if meeting.verdict(call):
        if S.STAGE:
            pkl.barrier_all(mine, R.rounds_handle)  # every rank's copy of what this program reads is in place
        if S.TWO_SHOT:  # reduce-scatter into my slice of `mid`; then all-gather the slices (rank r's is at r*part)
            _pull(G, src_ptr, src_handle, R.mid_ptr, R.limit, R.src_me, R.src_r, R.dst_me, R.dst_r, me, world, True,
                  S.BR, S.BC, S.LIMIT)
            pkl.barrier_all(mine, R.rounds_handle)
            _pull(G, R.mid_ptr, R.mid_handle, out_ptr, R.limit, 0, R.src_me, 0, R.dst_me, me, world, False, S.BR,
                  S.BC, S.LIMIT)
        else:
            _pull(G, src_ptr, src_handle, R.mid_ptr if S.IN_PLACE else out_ptr, R.limit, R.src_me, R.src_r,
                  R.dst_me, R.dst_r, me, world, S.REDUCE, S.BR, S.BC, S.LIMIT)
        if world > 1:  # done reading: no peer may change its input before every rank has read it
            pkl.barrier_all(mine, R.rounds_handle)
        if S.IN_PLACE:  # the input was the output: now no peer reads it, this program's tiles go in from `mid`
            for t in range(tl.program_id(0), _num_tiles(G, S.BR, S.BC), tl.num_programs(0)):
                _, dst, mask = _tile(G, t, S.BR, S.BC)
                dst += R.dst_me * me
                tl.store(out_ptr + dst, tl.load(R.mid_ptr + dst, mask=mask), mask=mask)
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
        mid = counters if mid is None else mid
        route = Route(copy.limit, copy.src_me, copy.src_r, copy.dst_me, copy.dst_r, mid,
                      rounds.handle if mid_handle is None else mid_handle, counters, rounds.handle)
        steps = Steps(staging is not None, copy.reduce, two_shot, in_place, br, bc, copy.limit < 2**62)
        self.launch = Launcher(_pull_kernel, (programs,), per_call=("x_ptr", "src_ptr", "src_handle", "out_ptr"),
                               G=Geometry(*copy.rows, copy.cols, *copy.src_strides, *copy.dst_strides), R=route,
                               meet=meeting.meeting().group(sig), S=steps, num_warps=num_warps)

    def __call__(self, x: torch.Tensor, src: torch.Tensor, src_handle: torch.Tensor, out: torch.Tensor) -> None:
        self.launch(x, src, src_handle, out)


def _round_counters() -> tuple[Block, int]:
    """The counters of the rounds among the ranks' same-numbered programs, one per program (each returns to zero
    after a round: `barrier_all`), shared by every collective of the context; and how many programs the pull
    kernel runs."""
    cache = context().cache
    if "collective_rounds" not in cache:
        # Two programs per SM with 16 KB tiles keep enough loads in flight to fill HBM (as many as 4 or 8 per SM,
        # bench/results/diagnose_collectives-w1-2026-12-02.txt, and fewer programs make the protocol cheaper);
        # under the interpreter every program is a thread, so one per "SM" there.
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


class CollectivePlan(Plan):
    """The base of the collectives' plans: one input `x` (a tensor, or a parallel tensor's local buffer read in place:
    `zero_copy`), its shape and dtype, and where peers read it (`source`). A call is one launch (or none)."""

    dtypes: tuple[torch.dtype, ...] = MOVE_DTYPES

    def __init__(self, x: torch.Tensor, zero_copy: bool | None):
        ctx = context()
        self.shape, self.dtype, self.zero_copy = tuple(x.shape), x.dtype, tensor_key(x, zero_copy)[2]
        self.remember(x=x)
        self._any_handle = meeting.meeting().handle  # at one rank the kernel reads only its own input, wherever it is
        self._moves = math.prod(self.shape) > 0
        staged = ctx.local_world_size > 1 and not self.zero_copy and self._moves
        self._staging = Staging(self.shape, x.dtype) if staged else None

    def check_x(self, x: torch.Tensor) -> int:
        """A call's check of its input against the plan (`expect`, written out for one tensor: it runs at every
        call); returns how many times the call meets its peers (what a refusal of it must meet)."""
        meetings = int(self._moves)
        if (not isinstance(x, torch.Tensor) or x.shape != self.shape or x.dtype != self.dtype or x.device != self.device
                or not x.is_contiguous()):
            refuse(meetings, PKError(self.mismatch({"x": x})))
        return meetings

    def signature(self, *details: object) -> int:
        """The meeting's signature of this plan's calls."""
        return meeting.signature(self.op, self.shape, str(self.dtype), *details, f"zero_copy={self.zero_copy}")

    def source(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(pointer, handle) where peers read `x`: in place (its parallel tensor), the staging buffer (the kernel
        copies `x` there), or, at one rank, `x` itself with any handle (a rank reading its own buffer translates by
        zero). `x` has passed `expect`."""
        if self.zero_copy:
            owner = owner_at(x.data_ptr(), self.shape, self.dtype)
            if owner is None:
                raise PKError(f"{self.op}: this plan reads a parallel tensor in place; x is not one")
            return x, owner.handle
        if self._staging is not None:
            return self._staging.tensor, self._staging.handle
        return x, self._any_handle

    @classmethod
    def check_input(cls, x: torch.Tensor, dim: int | None = None) -> int | None:
        """Refuse an `x` no rank can move; returns `dim` in [0, x.dim()) (a PKError where it is out of range)."""
        check_tensor(cls.op, "x", x, cls.dtypes, contiguous=True)
        return None if dim is None else normalize_dim(cls.op, dim, max(x.dim(), 1))


def tensor_key(x: torch.Tensor, zero_copy: bool | None) -> tuple:
    """The part of a collective's key that `x` makes: its shape and dtype, and whether it is read in place (as
    asked, or by default where `x` is a parallel tensor's buffer)."""
    if not isinstance(x, torch.Tensor):  # refused when the plan is built
        return None, None, zero_copy
    return x.shape, x.dtype, (owner_of(x) is not None) if zero_copy is None else zero_copy


def normalize_dim(op: str, dim: int, ndim: int) -> int:
    """`dim` in [0, ndim), or a clear error."""
    if not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise PKError(f"{op}: dim {dim!r} is out of range for a {ndim}-dimensional tensor")
    return dim % ndim


class PullPlan(CollectivePlan):
    """A collective that is one pull (all_gather, reduce_scatter, all_to_all): a subclass gives its output shape
    and its `Copy` (None: nothing to move) for the input's shape."""

    def __init__(self, x: torch.Tensor, zero_copy: bool | None, out_shape: tuple[int, ...], copy: Copy | None,
                 *details: object):
        super().__init__(x, zero_copy)
        self.out_shape = out_shape
        moves = copy is not None
        if not moves:
            self._staging = None
        # None: nothing to move
        self._pull = Pull(copy, x.dtype, self.signature(*details), staging=self._staging) if moves else None

    def __call__(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The collective of `x`, into `out` (a new tensor by default)."""
        meetings = self.check_x(x)
        try:
            if out is None:
                out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
            else:
                check_out(self.op, out, self.out_shape, self.dtype)
            if self._pull is None:
                return out
            src, handle = self.source(x)
        except PKError as e:
            refuse(meetings, e)
        self._pull(x, src, handle, out)
        return out

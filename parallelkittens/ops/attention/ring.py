"""ring_attention: attention over a sequence split across the node's ranks, K and V passed round the ring.

Each rank holds its part of the sequence: q (B, Hq, N/W, D), k and v (B, Hkv, N/W, D), and gets its rows of
attention over the whole sequence. With ``layout="contiguous"`` rank r holds block r of W; with
``layout="zigzag"`` the sequence is cut into 2W chunks and rank r holds chunks r and 2W - 1 - r, which gives
every rank the same causal work (`shard_sequence` / `unshard_sequence` convert).

**Forward: W steps, one kernel each.** At step s a rank holds the K/V block of rank (r - s) mod W: its own at
step 0, then what its predecessor pushed into one of its two symmetric K/V buffers (double-buffered on the heap).
In the step's kernel, communicator programs push that block into the successor's other buffer, while the compute
programs merge this block's attention into the running result (fp32, by log-sum-exp: `flash.fwd_task` with
MERGE) and the last step writes the output. Blocks a causal rank does not see at all are not computed (their
keys all lie after its queries); inside a block the flash kernel skips tiles past the diagonal.
**Backward: W steps again.** The block's K and V travel as before, and so do dK and dV, in fp32: at step s a
rank adds its queries' share of the block's gradients into the travelling dK/dV, and communicators forward each
key tile's dK/dV as soon as the compute program that owns the tile has signalled it done (a flag per tile), so
they travel while the rest is computed. After the last step they take one more hop home, and a last kernel writes
each rank's own dK, dV and dQ (dQ accumulates locally, in fp32).

**Ordering.** Every kernel opens with the meeting (`template/meeting.py`), and every program waits for its
verdict before touching a K/V buffer: once every rank has begun step s, every rank has ended step s - 1, so the
buffer step s + 1 pushes into (read at step s - 1) is free, and the block step s reads (pushed at step s - 1) is
complete. If the ranks disagree on the call, nothing moves and `pk.sync()` raises `MismatchError`.

At one rank it is the flash kernel alone (`flash.AttentionPlan`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ... import language as pkl
from ...runtime.context import context
from ...runtime.device import num_sms
from ...runtime.errors import PKError
from ...runtime.heap import heap
from ...runtime.launch import Launcher
from ...runtime.sizes import cdiv
from ...template import grid, meeting
from ..plan import Plan, check_comm_sms, declare
from . import flash
from .attention import AttentionPlan, check_qkv, default_scale

LAYOUTS = ("contiguous", "zigzag")
COPY_BLOCK = 2048  # elements a communicator moves per task (4 KB of bf16: wide enough for 16-byte stores)
_COPY = tl.constexpr(COPY_BLOCK)


def segments(layout: str, world: int, rank: int, n_local: int) -> tuple[int, int, int]:
    """Where rank `rank`'s n_local rows sit on the sequence: (seg_len, seg0, seg1), see `flash`."""
    if layout == "contiguous":
        return n_local, rank * n_local, 0
    chunk = n_local // 2
    return chunk, rank * chunk, (2 * world - 1 - rank) * chunk


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise PKError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def shard_sequence(x: torch.Tensor, dim: int, layout: str = "contiguous") -> torch.Tensor:
    """This rank's part of the full sequence `x` along `dim` (contiguous: block r of W; zigzag: chunks r and
    2W - 1 - r of 2W, concatenated). Local: every rank passes the same full tensor."""
    _check_layout(layout)
    ctx = context()
    world, rank = ctx.local_world_size, ctx.local_rank
    parts = 2 * world if layout == "zigzag" else world
    if x.shape[dim] % parts:
        raise PKError(f"shard_sequence: a sequence of {x.shape[dim]} along dim {dim} does not split into {parts} "
                      f"equal chunks ({layout} layout, {world} ranks)")
    chunks = x.chunk(parts, dim)
    if layout == "contiguous":
        return chunks[rank].contiguous()
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim).contiguous()


def unshard_sequence(x: torch.Tensor, dim: int, layout: str = "contiguous") -> torch.Tensor:
    """The full sequence from every rank's part `x` along `dim` (the inverse of `shard_sequence`). Collective."""
    from ..collectives.all_gather import all_gather

    _check_layout(layout)
    world = context().local_world_size
    gathered = all_gather(x.contiguous(), dim)
    if layout == "contiguous":
        return gathered
    if x.shape[dim] % 2:
        raise PKError(f"unshard_sequence: a zigzag part has two equal chunks; got {x.shape[dim]} along dim {dim}")
    halves = gathered.chunk(2 * world, dim)  # rank r's first chunk is r, its second 2W - 1 - r
    order = [halves[2 * r] for r in range(world)] + [halves[2 * r + 1] for r in reversed(range(world))]
    return torch.cat(order, dim)


@triton.jit
def _push(src_ptr, dst_ptr, handle, peer, offs, numel):
    """Copy elements `offs` of a block at `src_ptr` into `peer`'s buffer at `dst_ptr` (a local pointer)."""
    mask = offs < numel
    pkl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), handle, peer, mask)


class Ring(NamedTuple):
    """A ring step's run-time values besides the attention's: where the block travels next, and the work."""

    k_next_ptr: object  # the successor's buffers the block is pushed into
    v_next_ptr: object
    kv_handle: object
    dk_next_ptr: object  # the backward's: where the travelling dK and dV go next (fp32)
    dv_next_ptr: object
    grad_handle: object
    flags_ptr: object  # the backward's: one per key tile, its gradients are in
    flags_handle: object
    kv_numel: object
    num_dkdv: object  # the backward's dK/dV tasks (key tiles x batch x key/value heads)
    num_tasks: object
    num_comm: object


@triton.jit
def _push_block(R, k_ptr, v_ptr, nxt, pid):
    """This communicator's chunks of the block's K and V, pushed into the successor's next buffers."""
    for task in range(pid, 2 * tl.cdiv(R.kv_numel, _COPY), R.num_comm):  # K's chunks, then V's
        offs = (task // 2) * _COPY + tl.arange(0, _COPY).to(tl.int64)
        if task % 2 == 0:
            _push(k_ptr, R.k_next_ptr, R.kv_handle, nxt, offs, R.kv_numel)
        else:
            _push(v_ptr, R.v_next_ptr, R.kv_handle, nxt, offs, R.kv_numel)


@triton.jit(do_not_specialize=["push", "compute"])  # the steps differ in them: one binary
def _ring_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, acc_ptr, S, R, push, compute, meet, C):
    call = meeting.begin(meet)
    F = flash.Fwd(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, acc_ptr)
    pid = tl.program_id(0)
    if meeting.verdict(call):  # every rank is at this step: the block is complete, the successor's buffer free
        if pid < R.num_comm:
            if push != 0:
                _push_block(R, k_ptr, v_ptr, (call.rank + 1) % call.world, pid)
        else:
            if compute != 0:
                tiles_m = tl.cdiv(S.N_Q, C.BLOCK_M)
                for task in range(pid - R.num_comm, R.num_tasks, tl.num_programs(0) - R.num_comm):
                    flash.fwd_task(F, S, C, task % tiles_m, task // tiles_m)
    meeting.end(call)


@triton.jit
def _send_gradients(B, S, R, C, t, nxt, wait):
    """Key tile task `t`'s dK and dV, once this step's share is in (`wait`), pushed to the successor."""
    if wait:
        pkl.wait(R.flags_ptr + t, 1, R.flags_handle)
        tl.store(R.flags_ptr + t, 0)
    key_tiles = tl.cdiv(S.N_K, C.BLOCK_N)
    bh_kv = (t // key_tiles).to(tl.int64)
    rows = (t % key_tiles) * C.BLOCK_N + tl.arange(0, C.BLOCK_N)
    dims = tl.arange(0, C.HEAD_DIM)
    heads = S.H // S.GROUP
    at = (bh_kv // heads) * S.stride_kb + (bh_kv % heads) * S.stride_kh + rows[:, None] * S.stride_kn + dims[None, :]
    mask = (rows < S.N_K)[:, None]
    pkl.store(R.dk_next_ptr + at, tl.load(B.dk_ptr + at, mask=mask), R.grad_handle, nxt, mask)
    pkl.store(R.dv_next_ptr + at, tl.load(B.dv_ptr + at, mask=mask), R.grad_handle, nxt, mask)


@triton.jit(do_not_specialize=["push_kv", "compute"])  # the steps differ in them: one binary
def _ring_bwd_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, S, R, push_kv, compute,
                     meet, C):
    call = meeting.begin(meet)
    B = flash.Bwd(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr)
    pid = tl.program_id(0)
    key_tiles = tl.cdiv(S.N_K, C.BLOCK_N)
    nxt = (call.rank + 1) % call.world
    if meeting.verdict(call):
        if pid < R.num_comm:
            kv_tasks = 2 * tl.cdiv(R.kv_numel, _COPY) * push_kv
            if push_kv != 0:  # the block's K and V, for the successor's next step
                _push_block(R, k_ptr, v_ptr, nxt, pid)
            # then each key tile's dK and dV (task numbers after the K/V chunks', as one list of tasks)
            first = pid + ((kv_tasks - pid + R.num_comm - 1) // R.num_comm) * R.num_comm
            for task in range(first, kv_tasks + R.num_dkdv, R.num_comm):
                _send_gradients(B, S, R, C, task - kv_tasks, nxt, compute != 0)
        else:
            if compute != 0:
                tiles_m = tl.cdiv(S.N_Q, C.BLOCK_M)
                for task in range(pid - R.num_comm, R.num_tasks, tl.num_programs(0) - R.num_comm):
                    if task < R.num_dkdv:  # key tiles first, so that their gradients can start travelling
                        flash.dkdv_task(B, S, C, task % key_tiles, task // key_tiles)
                        pkl.signal(R.flags_ptr + task, R.flags_handle, call.rank)
                    else:
                        t = task - R.num_dkdv
                        flash.dq_task(B, S, C, t % tiles_m, t // tiles_m)
    meeting.end(call)


@triton.jit
def _ring_bwd_final_kernel(dq_acc_ptr, dq_ptr, dk_acc_ptr, dk_ptr, dv_acc_ptr, dv_ptr, q_numel, kv_numel, meet,
                           BLOCK: tl.constexpr):
    """Every rank's dK and dV are home (each rank has ended the last step): write the outputs in their dtype."""
    call = meeting.begin(meet)
    if meeting.verdict(call):
        for start in range(tl.program_id(0) * BLOCK, q_numel, tl.num_programs(0) * BLOCK):
            offs = start + tl.arange(0, BLOCK).to(tl.int64)
            mask = offs < q_numel
            tl.store(dq_ptr + offs, tl.load(dq_acc_ptr + offs, mask=mask).to(dq_ptr.dtype.element_ty), mask=mask)
        for start in range(tl.program_id(0) * BLOCK, kv_numel, tl.num_programs(0) * BLOCK):
            offs = start + tl.arange(0, BLOCK).to(tl.int64)
            mask = offs < kv_numel
            tl.store(dk_ptr + offs, tl.load(dk_acc_ptr + offs, mask=mask).to(dk_ptr.dtype.element_ty), mask=mask)
            tl.store(dv_ptr + offs, tl.load(dv_acc_ptr + offs, mask=mask).to(dv_ptr.dtype.element_ty), mask=mask)
    meeting.end(call)


def check_ring(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, num_comm_sms: int | None
               ) -> str:
    """Refuse what ring attention cannot run, before anything collective happens; a description for the
    agreement."""
    check_qkv(op, q, k, v)
    _check_layout(layout)
    if q.shape[2] != k.shape[2]:
        raise PKError(f"{op}: q holds {q.shape[2]} rows of the sequence but k and v {k.shape[2]}: every rank holds "
                      "the same part of q's and k's sequence")
    if layout == "zigzag" and q.shape[2] % 2:
        raise PKError(f"{op}: a zigzag part holds two equal chunks of the sequence; {q.shape[2]} rows do not split "
                      "in two (the sequence must split into 2W equal chunks)")
    check_comm_sms(op, num_comm_sms)
    return f"{op} of q {tuple(q.shape)}, k/v {tuple(k.shape)}, {q.dtype}, layout {layout}"


class RingAttentionPlan(Plan):
    """Ring attention for one set of shapes, dtype, mask, scale and layout: the K/V (and dK/dV) buffers on the
    heap, each step's positions and bound kernels. At one rank it is the flash kernel's plan (`local`)."""

    op = "ring_attention"
    arity = 3
    differentiable = 2  # the output, and the log-sum-exp
    saves = (0, 1)

    @classmethod
    def key(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
            softmax_scale: float | None = None, layout: str = "contiguous", num_comm_sms: int | None = None) -> tuple:
        scale = default_scale(q.shape[-1] if isinstance(q, torch.Tensor) else 0, softmax_scale)
        return (getattr(q, "shape", None), getattr(k, "shape", None), getattr(q, "dtype", None), bool(causal), scale,
                layout, num_comm_sms)

    @classmethod
    def check(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              softmax_scale: float | None = None, layout: str = "contiguous", num_comm_sms: int | None = None) -> str:
        description = check_ring(cls.op, q, k, v, layout, num_comm_sms)
        return f"{description}, causal={bool(causal)}, scale={softmax_scale}, num_comm_sms={num_comm_sms}"

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                 softmax_scale: float | None = None, layout: str = "contiguous", num_comm_sms: int | None = None):
        ctx = context()
        self.world, me = ctx.local_world_size, ctx.local_rank
        self.q_shape, self.kv_shape, self.dtype, self.device = tuple(q.shape), tuple(k.shape), q.dtype, ctx.device
        self.causal, self.scale, self.layout = bool(causal), default_scale(q.shape[-1], softmax_scale), layout
        q_seg = segments(layout, self.world, me, q.shape[2])
        self.local = AttentionPlan(q, k, v, causal, self.scale, q_segments=q_seg, k_segments=q_seg)
        if self.world == 1:
            return
        sig = meeting.signature(self.op, self.q_shape, self.kv_shape, str(q.dtype), causal, self.scale, layout,
                                num_comm_sms)
        self._meet = meeting.meeting().group(sig)
        self.kv_numel, self.q_numel = math.prod(self.kv_shape), math.prod(self.q_shape)
        kv_bytes = self.kv_numel * q.dtype.itemsize
        buffers = heap().pool("attention.kv", 4 * kv_bytes)  # K and V, two of each
        self._k = [buffers.view(self.kv_shape, q.dtype, i * kv_bytes) for i in (0, 2)]
        self._v = [buffers.view(self.kv_shape, q.dtype, i * kv_bytes) for i in (1, 3)]
        grads = heap().pool("attention.grads", 4 * self.kv_numel * 4)  # dK and dV in fp32, two of each
        self._dk = [grads.view(self.kv_shape, torch.float32, i * self.kv_numel * 4) for i in (0, 2)]
        self._dv = [grads.view(self.kv_shape, torch.float32, i * self.kv_numel * 4) for i in (1, 3)]
        self._kv_handle, self._grad_handle = buffers.handle, grads.handle
        self._comm = num_comm_sms if num_comm_sms is not None else max(1, num_sms() // 16)
        # each step's keys: whose block, and whether this rank's queries see any of it
        self._steps = []
        for step in range(self.world):
            k_seg = segments(layout, self.world, (me - step) % self.world, q.shape[2])
            sees = not causal or k_seg[1] <= q_seg[2 if layout == "zigzag" else 1] + q_seg[0] - 1
            self._steps.append((k_seg, sees))
        self._fwd = self._forward_steps()
        self._bwd = self._backward_steps()
        home = self.world % 2  # where each rank's dK and dV land after the last hop
        self._final = Launcher(_ring_bwd_final_kernel, (min(num_sms(), cdiv(max(self.kv_numel, self.q_numel), 4096)),),
                               ("dq_acc_ptr", "dq_ptr", "dk_ptr", "dv_ptr"), dk_acc_ptr=self._dk[home],
                               dv_acc_ptr=self._dv[home], q_numel=self.q_numel, kv_numel=self.kv_numel,
                               meet=self._meet, BLOCK=1024)

    def _ring(self, step: int, num_tasks: int, **backward: object) -> Ring:
        nxt = (step + 1) % 2
        fields = dict(dk_next_ptr=None, dv_next_ptr=None, grad_handle=None, flags_ptr=None, flags_handle=None,
                      num_dkdv=0)
        fields.update(backward)
        return Ring(k_next_ptr=self._k[nxt], v_next_ptr=self._v[nxt], kv_handle=self._kv_handle,
                    kv_numel=self.kv_numel, num_tasks=num_tasks, num_comm=self._comm, **fields)

    def _forward_steps(self) -> list[Launcher]:
        """Each step's forward kernel: merge this step's block in, push it on (the last step writes the output)."""
        bm, bn, warps, stages, _ = self.local.tiles["fwd"]  # the ring's kernel is Triton's
        B, H, n, D = self.q_shape
        num_tasks = cdiv(n, bm) * B * H
        launches = []
        for step, (k_seg, sees) in enumerate(self._steps):
            last = step == self.world - 1
            shape = self.local.shape._replace(k_seg_len=k_seg[0], k_seg0=k_seg[1], k_seg1=k_seg[2])
            launches.append(Launcher(
                _ring_fwd_kernel, grid(num_tasks, self._comm), ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "lse_ptr",
                                                                  "acc_ptr"),
                S=shape, R=self._ring(step, num_tasks), meet=self._meet,
                # the last step writes the output: it runs even where it sees nothing (merging an empty block)
                push=int(not last), compute=int(sees or last),
                C=flash.FwdTiles(self.causal, step > 0, last, bm, bn, D), num_warps=warps, num_stages=stages))
        return launches

    def _backward_steps(self) -> list[Launcher]:
        """Each step's backward kernel: this rank's share of the block's gradients, which travel on with it."""
        bm, bn, warps, stages = self.local.tiles["bwd"]
        B, H, n, D = self.q_shape
        key_tiles, H_KV = cdiv(n, bn), self.kv_shape[1]
        flags = heap().allocate(4 * key_tiles * B * H_KV, f"{self.op}.flags")
        num_dkdv = key_tiles * B * H_KV
        num_tasks = num_dkdv + cdiv(n, bm) * B * H
        launches = []
        for step, (k_seg, sees) in enumerate(self._steps):
            cur, nxt = step % 2, (step + 1) % 2
            shape = self.local.shape._replace(k_seg_len=k_seg[0], k_seg0=k_seg[1], k_seg1=k_seg[2])
            ring = self._ring(step, num_tasks, dk_next_ptr=self._dk[nxt], dv_next_ptr=self._dv[nxt],
                              grad_handle=self._grad_handle, flags_ptr=flags.view(num_dkdv, torch.int32),
                              flags_handle=flags.handle, num_dkdv=num_dkdv)
            launches.append(Launcher(
                _ring_bwd_kernel, grid(num_tasks, self._comm), ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "lse_ptr",
                                                                  "delta_ptr", "dq_ptr"),
                dk_ptr=self._dk[cur], dv_ptr=self._dv[cur], S=shape, R=ring, push_kv=int(step < self.world - 1),
                compute=int(sees), meet=self._meet, C=flash.BwdTiles(self.causal, True, bm, bn, D), num_warps=warps,
                num_stages=stages))
        return launches

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) of this rank's rows over the whole sequence."""
        if self.world == 1:
            return self.local(q, k, v)
        q, k, v = self.local.tensors(self.world, q, k, v)
        out = torch.empty_like(q)
        lse = torch.empty(self.local.lse_shape(), dtype=torch.float32, device=self.device)
        acc = torch.empty(self.q_shape, dtype=torch.float32, device=self.device)
        for step, launch in enumerate(self._fwd):
            cur = step % 2
            keys, values = (k, v) if step == 0 else (self._k[cur], self._v[cur])
            launch(q, keys, values, out if step == self.world - 1 else acc, lse, acc)
        return out, lse

    def gradients(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, dlse: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """(dq, dk, dv) of this rank's q, k, v."""
        if self.world == 1:
            return self.local.gradients(do, q, k, v, out, lse, dlse)
        q, k, v = self.local.tensors(self.world + 1, q, k, v)
        do, out = do.contiguous(), out.contiguous()
        delta = self.local.delta(out, do, dlse)
        dq_acc = torch.zeros(self.q_shape, dtype=torch.float32, device=self.device)
        self._dk[0].zero_()  # this rank's own block starts its journey with no gradient (nobody writes it now)
        self._dv[0].zero_()
        for step, launch in enumerate(self._bwd):
            cur = step % 2
            keys, values = (k, v) if step == 0 else (self._k[cur], self._v[cur])
            launch(q, keys, values, do, lse, delta, dq_acc)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._final(dq_acc, dq, dk, dv)
        return dq, dk, dv

    def backward(self, grads: list[torch.Tensor], saved: list[torch.Tensor], needs: list[bool], q: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, *options: object) -> tuple[torch.Tensor, ...]:
        (do, dlse), (out, lse) = grads, saved
        return self.gradients(do, q, k, v, out, lse, dlse)

    fake = staticmethod(AttentionPlan.fake)


_ring_attention = declare(RingAttentionPlan, "(Tensor q, Tensor k, Tensor v, bool causal, float softmax_scale, "
                                             "str layout, int? num_comm_sms) -> (Tensor, Tensor)")


@_ring_attention.public
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                   softmax_scale: float | None = None, layout: str = "contiguous", return_lse: bool = False, *,
                   num_comm_sms: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of attention over the whole sequence, the sequence split across the node's ranks.

    q is (B, Hq, N/W, D), k and v (B, Hkv, N/W, D): this rank's part in `layout` ("contiguous": block r of W;
    "zigzag": chunks r and 2W - 1 - r of 2W, which balances causal work; see `shard_sequence`). Returns (B, Hq,
    N/W, D), and with `return_lse` the rows' log-sum-exp (B, Hq, N/W) fp32. Collective; differentiable (q, k, v,
    the log-sum-exp too); a torch custom op. `num_comm_sms` programs push K and V round the ring (default: a
    sixteenth of the SMs).
    """
    scale = default_scale(q.shape[-1] if isinstance(q, torch.Tensor) else 0, softmax_scale)
    out, lse = _ring_attention(q, k, v, bool(causal), scale, layout, num_comm_sms)
    return (out, lse) if return_lse else out

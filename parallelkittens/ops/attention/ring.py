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
from .. import plan as plans
from . import flash

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


def reference_ring_attention(q_full: torch.Tensor, k_full: torch.Tensor, v_full: torch.Tensor, causal: bool,
                             softmax_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, lse) of attention over the full sequences, in float64."""
    return flash.reference_attention(q_full, k_full, v_full, causal, softmax_scale)


def blocks_computed(layout: str, world: int, n_total: int, causal: bool, block_m: int, block_n: int) -> list[int]:
    """How many (query tile, key tile) pairs each rank computes over a forward, as the kernels count them."""
    n_local = n_total // world
    counts = []
    for rank in range(world):
        q_seg = segments(layout, world, rank, n_local)
        q_pos = [_pos(i, q_seg) for i in range(n_local)]
        total = 0
        for step in range(world):
            k_seg = segments(layout, world, (rank - step) % world, n_local)
            if causal and _pos(0, k_seg) > q_pos[-1]:
                continue  # a block the rank does not see at all: not computed
            for start in range(0, n_local, block_m):
                last = q_pos[min(start + block_m, n_local) - 1]
                visible = n_local if not causal else sum(1 for j in range(n_local) if _pos(j, k_seg) <= last)
                total += cdiv(visible, block_n) if visible else 0
        counts.append(total)
    return counts


def _pos(i: int, seg: tuple[int, int, int]) -> int:
    return seg[1] + i if i < seg[0] else seg[2] + i - seg[0]


@triton.jit
def _push(src_ptr, dst_ptr, handle, peer, offs, numel):
    """Copy elements `offs` of a block at `src_ptr` into `peer`'s buffer at `dst_ptr` (a local pointer)."""
    mask = offs < numel
    pkl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), handle, peer, mask)


@triton.jit(do_not_specialize=["num_comm", "rank", "push", "compute", "q_seg0", "q_seg1", "k_seg0", "k_seg1"])
def _ring_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, acc_ptr, H, GROUP, N_Q, N_K, stride_qb, stride_qh,
                     stride_qn, stride_kb, stride_kh, stride_kn, stride_ob, stride_oh, stride_on, q_seg_len, q_seg0,
                     q_seg1, k_seg_len, k_seg0, k_seg1, qk_scale, k_next_ptr, v_next_ptr, kv_handle, kv_numel,
                     num_tasks, num_comm, push, compute, meet_counters, meet_slots, meet_handle, sig, rank, world,
                     CAUSAL: tl.constexpr, MERGE: tl.constexpr, FINAL: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    call = meeting.begin(meet_counters, meet_slots, meet_handle, sig, rank, world)
    F = flash.Fwd(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, acc_ptr, H, GROUP, N_Q, N_K, stride_qb, stride_qh, stride_qn,
                  stride_kb, stride_kh, stride_kn, stride_ob, stride_oh, stride_on, q_seg_len, q_seg0, q_seg1,
                  k_seg_len, k_seg0, k_seg1, qk_scale)
    pid = tl.program_id(0)
    if meeting.verdict(call):  # every rank is at this step: the block is complete, the successor's buffer free
        if pid < num_comm:
            if push != 0:
                nxt = (rank + 1) % world
                for task in range(pid, 2 * tl.cdiv(kv_numel, _COPY), num_comm):  # K's chunks, then V's
                    offs = (task // 2) * _COPY + tl.arange(0, _COPY).to(tl.int64)
                    if task % 2 == 0:
                        _push(k_ptr, k_next_ptr, kv_handle, nxt, offs, kv_numel)
                    else:
                        _push(v_ptr, v_next_ptr, kv_handle, nxt, offs, kv_numel)
        else:
            if compute != 0:
                tiles_m = tl.cdiv(N_Q, BLOCK_M)
                for task in range(pid - num_comm, num_tasks, tl.num_programs(0) - num_comm):
                    flash.fwd_task(F, flash.FwdTiles(CAUSAL, False, MERGE, FINAL, BLOCK_M, BLOCK_N, HEAD_DIM),
                                   task % tiles_m, task // tiles_m)
    meeting.end(call)


@triton.jit(do_not_specialize=["num_comm", "rank", "push_kv", "compute", "q_seg0", "q_seg1", "k_seg0", "k_seg1"])
def _ring_bwd_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, H, GROUP, N_Q, N_K,
                     stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, q_seg_len, q_seg0, q_seg1,
                     k_seg_len, k_seg0, k_seg1, qk_scale, sm_scale, k_next_ptr, v_next_ptr, kv_handle, dk_next_ptr,
                     dv_next_ptr, grad_handle, flags_ptr, flags_handle, kv_numel, num_dkdv, num_tasks, num_comm,
                     push_kv, compute, meet_counters, meet_slots, meet_handle, sig, rank, world, CAUSAL: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    call = meeting.begin(meet_counters, meet_slots, meet_handle, sig, rank, world)
    B = flash.Bwd(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, H, GROUP, N_Q, N_K,
                  stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, q_seg_len, q_seg0, q_seg1,
                  k_seg_len, k_seg0, k_seg1, qk_scale, sm_scale)
    pid = tl.program_id(0)
    key_tiles = tl.cdiv(N_K, BLOCK_N)
    dkdv_tasks = num_dkdv  # key tiles x batch x key/value heads, then query tiles x batch x heads
    nxt = (rank + 1) % world
    if meeting.verdict(call):
        if pid < num_comm:
            kv_tasks = 2 * tl.cdiv(kv_numel, _COPY) * push_kv
            for task in range(pid, kv_tasks + dkdv_tasks, num_comm):
                if task < kv_tasks:  # the block's K and V, for the successor's next step
                    offs = (task // 2) * _COPY + tl.arange(0, _COPY).to(tl.int64)
                    if task % 2 == 0:
                        _push(k_ptr, k_next_ptr, kv_handle, nxt, offs, kv_numel)
                    else:
                        _push(v_ptr, v_next_ptr, kv_handle, nxt, offs, kv_numel)
                else:  # one key tile's dK and dV, once this step's share is in
                    t = task - kv_tasks
                    if compute != 0:
                        pkl.wait(flags_ptr + t, 1, flags_handle)
                        tl.store(flags_ptr + t, 0)
                    bh_kv = (t // key_tiles).to(tl.int64)
                    rows = (t % key_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
                    dims = tl.arange(0, HEAD_DIM)
                    at = (bh_kv // (H // GROUP)) * stride_kb + (bh_kv % (H // GROUP)) * stride_kh + \
                        rows[:, None] * stride_kn + dims[None, :]
                    mask = (rows < N_K)[:, None]
                    pkl.store(dk_next_ptr + at, tl.load(dk_ptr + at, mask=mask), grad_handle, nxt, mask)
                    pkl.store(dv_next_ptr + at, tl.load(dv_ptr + at, mask=mask), grad_handle, nxt, mask)
        else:
            if compute != 0:
                tiles_m = tl.cdiv(N_Q, BLOCK_M)
                for task in range(pid - num_comm, num_tasks, tl.num_programs(0) - num_comm):
                    if task < dkdv_tasks:  # key tiles first, so that their gradients can start travelling
                        flash.dkdv_task(B, flash.BwdTiles(CAUSAL, True, BLOCK_M, BLOCK_N, HEAD_DIM), task % key_tiles,
                                        task // key_tiles)
                        pkl.signal(flags_ptr + task, flags_handle, rank)
                    else:
                        t = task - dkdv_tasks
                        flash.dq_task(B, flash.BwdTiles(CAUSAL, True, BLOCK_M, BLOCK_N, HEAD_DIM), t % tiles_m,
                                      t // tiles_m)
    meeting.end(call)


@triton.jit(do_not_specialize=["rank"])
def _ring_bwd_final_kernel(dq_acc_ptr, dq_ptr, dk_acc_ptr, dk_ptr, dv_acc_ptr, dv_ptr, q_numel, kv_numel,
                           meet_counters, meet_slots, meet_handle, sig, rank, world, BLOCK: tl.constexpr):
    """Every rank's dK and dV are home (each rank has ended the last step): write the outputs in their dtype."""
    call = meeting.begin(meet_counters, meet_slots, meet_handle, sig, rank, world)
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


class RingAttentionPlan:
    """Ring attention for one set of shapes, dtype, mask, scale and layout: the K/V (and dK/dV) buffers on the
    heap, each step's positions and bound kernels."""

    op = "ring_attention"

    def __init__(self, q_shape: tuple, kv_shape: tuple, dtype: torch.dtype, causal: bool, scale: float, layout: str,
                 num_comm_sms: int | None):
        ctx = context()
        self.world, self.rank = world, me = ctx.local_world_size, ctx.local_rank
        self.q_shape, self.kv_shape, self.dtype, self.device = tuple(q_shape), tuple(kv_shape), dtype, ctx.device
        self.causal, self.scale, self.layout = causal, scale, layout
        B, H, n, D = q_shape
        H_KV = kv_shape[1]
        q_seg = segments(layout, world, me, n)
        self.local = flash.AttentionPlan(q_shape, kv_shape, dtype, causal, scale, q_seg, q_seg)
        if world == 1:
            return
        sig = meeting.signature(self.op, self.q_shape, self.kv_shape, str(dtype), causal, scale, layout, num_comm_sms)
        meet = meeting.meeting().args(sig)
        self.kv_numel = kv_numel = math.prod(kv_shape)
        self.q_numel = math.prod(q_shape)
        kv_bytes = kv_numel * dtype.itemsize
        buffers = heap().pool("attention.kv", 4 * kv_bytes)  # K and V, two of each
        self._k = [buffers.view(kv_shape, dtype, i * kv_bytes) for i in (0, 2)]
        self._v = [buffers.view(kv_shape, dtype, i * kv_bytes) for i in (1, 3)]
        grads = heap().pool("attention.grads", 4 * kv_numel * 4)  # dK and dV in fp32, two of each
        self._dk = [grads.view(kv_shape, torch.float32, i * kv_numel * 4) for i in (0, 2)]
        self._dv = [grads.view(kv_shape, torch.float32, i * kv_numel * 4) for i in (1, 3)]
        bm, bn, warps, stages, *_ = self.local.tiles["fwd"]  # the ring's kernel is Triton's
        comm = num_comm_sms if num_comm_sms is not None else max(1, num_sms() // 16)
        fwd_tasks = cdiv(n, bm) * B * H
        sizes = dict(self.local.sizes)
        del sizes["k_seg_len"], sizes["k_seg0"], sizes["k_seg1"]
        steps = []
        for step in range(world):
            src = (me - step) % world
            k_seg = segments(layout, world, src, n)
            sees = not causal or k_seg[1] <= q_seg[2 if layout == "zigzag" else 1] + q_seg[0] - 1
            steps.append((k_seg, sees))
        self._steps = steps
        fwd = dict(sizes, stride_ob=sizes["stride_qb"], stride_oh=sizes["stride_qh"], stride_on=sizes["stride_qn"],
                   kv_handle=buffers.handle, kv_numel=kv_numel, num_tasks=fwd_tasks, num_comm=comm, CAUSAL=causal,
                   BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=D, num_warps=warps, num_stages=stages, **meet)
        per_call = ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "lse_ptr", "acc_ptr")
        self._fwd = []
        for step, (k_seg, sees) in enumerate(steps):
            last = step == world - 1
            self._fwd.append(Launcher(
                _ring_fwd_kernel, grid(fwd_tasks, comm), per_call, k_seg_len=k_seg[0], k_seg0=k_seg[1],
                k_seg1=k_seg[2], k_next_ptr=self._k[(step + 1) % 2], v_next_ptr=self._v[(step + 1) % 2],
                # the last step writes the output: it runs even where it sees nothing (merging an empty block)
                push=int(not last), compute=int(sees or last), MERGE=step > 0, FINAL=last, **fwd))
        bm, bn, warps, stages = self.local.tiles["bwd"]
        key_tiles = cdiv(n, bn)
        flags = heap().allocate(4 * key_tiles * B * H_KV, f"{self.op}.flags")
        dkdv_tasks = key_tiles * B * H_KV
        bwd_tasks = dkdv_tasks + cdiv(n, bm) * B * H
        bwd = dict(sizes, sm_scale=scale, kv_handle=buffers.handle, grad_handle=grads.handle,
                   flags_ptr=flags.view(key_tiles * B * H_KV, torch.int32), flags_handle=flags.handle,
                   kv_numel=kv_numel, num_dkdv=dkdv_tasks, num_tasks=bwd_tasks, num_comm=comm, CAUSAL=causal,
                   BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=D, num_warps=warps, num_stages=stages, **meet)
        per_call = ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "lse_ptr", "delta_ptr", "dq_ptr")
        self._bwd = []
        for step, (k_seg, sees) in enumerate(steps):
            cur, nxt = step % 2, (step + 1) % 2
            self._bwd.append(Launcher(
                _ring_bwd_kernel, grid(bwd_tasks, comm), per_call, dk_ptr=self._dk[cur], dv_ptr=self._dv[cur],
                k_seg_len=k_seg[0], k_seg0=k_seg[1], k_seg1=k_seg[2], k_next_ptr=self._k[nxt],
                v_next_ptr=self._v[nxt], dk_next_ptr=self._dk[nxt], dv_next_ptr=self._dv[nxt],
                push_kv=int(step < world - 1), compute=int(sees), **bwd))
        home = world % 2  # where each rank's dK and dV land after the last hop
        self._final = Launcher(_ring_bwd_final_kernel, (min(num_sms(), cdiv(max(kv_numel, self.q_numel), 4096)),),
                               ("dq_acc_ptr", "dq_ptr", "dk_ptr", "dv_ptr"), dk_acc_ptr=self._dk[home],
                               dv_acc_ptr=self._dv[home], q_numel=self.q_numel, kv_numel=kv_numel, BLOCK=1024, **meet)

    def _check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meetings: int) -> tuple[torch.Tensor, ...]:
        try:
            return self.local._check(q, k, v)
        except PKError as e:
            plans.refuse(meetings, e)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) of this rank's rows over the whole sequence."""
        if self.world == 1:
            return self.local.forward(q, k, v)
        q, k, v = self._check(q, k, v, self.world)
        out = torch.empty_like(q)
        lse = torch.empty(self.local.lse_shape(), dtype=torch.float32, device=self.device)
        acc = torch.empty(self.q_shape, dtype=torch.float32, device=self.device)
        for step, launch in enumerate(self._fwd):
            cur = step % 2
            keys, values = (k, v) if step == 0 else (self._k[cur], self._v[cur])
            launch(q, keys, values, out if step == self.world - 1 else acc, lse, acc)
        return out, lse

    def backward(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, dlse: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """(dq, dk, dv) of this rank's q, k, v."""
        if self.world == 1:
            return self.local.backward(do, q, k, v, out, lse, dlse)
        q, k, v = self._check(q, k, v, self.world + 1)
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


def _check_ring(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, num_comm_sms) -> str:
    flash.check_qkv(op, q, k, v)
    _check_layout(layout)
    if q.shape[2] != k.shape[2]:
        raise PKError(f"{op}: q holds {q.shape[2]} rows of the sequence but k and v {k.shape[2]}: every rank holds "
                      "the same part of q's and k's sequence")
    if layout == "zigzag" and q.shape[2] % 2:
        raise PKError(f"{op}: a zigzag part holds two equal chunks of the sequence; {q.shape[2]} rows do not split "
                      "in two (the sequence must split into 2W equal chunks)")
    limit = num_sms() - 1
    if num_comm_sms is not None and not 1 <= num_comm_sms <= limit:
        raise PKError(f"{op}: num_comm_sms must be in [1, {limit}] on this device, got {num_comm_sms}")
    return f"{op} of q {tuple(q.shape)}, k/v {tuple(k.shape)}, {q.dtype}, layout {layout}"


def plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, softmax_scale: float | None = None,
         layout: str = "contiguous", num_comm_sms: int | None = None) -> RingAttentionPlan:
    """The plan for ring attention over tensors like q, k, v (collective the first time: `ops/plan.py`)."""
    scale = flash.default_scale(q.shape[-1] if isinstance(q, torch.Tensor) else 0, softmax_scale)
    key = ("ring_attention", getattr(q, "shape", None), getattr(k, "shape", None), getattr(q, "dtype", None),
           bool(causal), scale, layout, num_comm_sms)
    found = plans.find(key)
    if found is not None:
        return found

    def check() -> str:
        description = _check_ring("ring_attention", q, k, v, layout, num_comm_sms)
        return f"{description}, causal={bool(causal)}, scale={softmax_scale}, num_comm_sms={num_comm_sms}"

    return plans.get(key, lambda: RingAttentionPlan(q.shape, k.shape, q.dtype, bool(causal), scale, layout,
                                                    num_comm_sms), check)


@torch.library.custom_op("parallelkittens::ring_attention_forward", mutates_args=())
def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
                  layout: str, num_comm_sms: int) -> tuple[torch.Tensor, torch.Tensor]:
    return plan(q, k, v, causal, softmax_scale, layout, num_comm_sms or None).forward(q, k, v)


@_ring_forward.register_fake
def _(q, k, v, causal, softmax_scale, layout, num_comm_sms):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("parallelkittens::ring_attention_backward", mutates_args=())
def _ring_backward(do: torch.Tensor, dlse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool, softmax_scale: float, layout: str,
                   num_comm_sms: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return plan(q, k, v, causal, softmax_scale, layout, num_comm_sms or None).backward(do, q, k, v, out, lse, dlse)


@_ring_backward.register_fake
def _(do, dlse, q, k, v, out, lse, causal, softmax_scale, layout, num_comm_sms):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output) -> None:
    q, k, v, causal, scale, layout, num_comm = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.args = (causal, scale, layout, num_comm)


def _backward(ctx, do, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    do = torch.zeros_like(out) if do is None else do
    dlse = torch.zeros_like(lse) if dlse is None else dlse
    return (*_ring_backward(do, dlse, q, k, v, out, lse, *ctx.args), None, None, None, None)


_ring_forward.register_autograd(_backward, setup_context=_setup)


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
    scale = flash.default_scale(q.shape[-1] if isinstance(q, torch.Tensor) else 0, softmax_scale)
    if not torch.compiler.is_compiling():  # traced, the custom op builds it when it runs
        plan(q, k, v, causal, scale, layout, num_comm_sms)  # every rank checks and agrees before the custom op runs
    out, lse = _ring_forward(q, k, v, bool(causal), scale, layout, num_comm_sms or 0)
    return (out, lse) if return_lse else out


plans.attach(ring_attention, plan)

"""The GEMM core's Hopper variant, written in Gluon: warp-specialised, with two consumer warp groups taking turns.

Triton's `tl` GEMM runs each tile's k-loop and epilogue in the same warps, so the tensor cores idle while a
tile's result is converted and stored; at the fused ops' local shapes with a short k-loop (K <= 2048) that
epilogue is a large part of the time. Here, as in cuBLAS's "ping-pong" kernels, each program has:

* a producer warp that issues the TMA loads of every tile of the program into a ring of shared-memory stages;
* two consumer warp groups, each with its own accumulator, taking alternate tiles: while one converts and
  stores its tile, the other's MMAs keep the tensor cores busy.

Stages pass between them on mbarriers: `ready[s]` completes when stage s's loads land (the TMA's byte count),
`empty[s]` when the consumer that used it has retired its MMAs. Tile j of the program uses ring positions
j * k_steps + k, so both sides compute stage and phase from the tile's number: no shared counters.

Gluon has no interpreter, so the CPU tests run `ops.gemm.matmul`'s `tl` kernel; `tests/test_compile.py` compiles
this one for sm_90, and the GPU tests and `bench matmul` run it (`matmul_config` chooses it on Hopper for
k-loops of at most 4 steps, where it wins; from K = 512 it ties the `tl` kernel, and at 8192³ it loses).
"""

from __future__ import annotations

import functools

import torch

from ..descriptors import GLUON, gluon_descriptor, hopper_gluon, shared_layout

if GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from ..descriptors import tma_load as _tma_load
    from ..descriptors import tma_store as _tma_store


    @gluon.jit
    def _tile_origin(tile, M, N, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr):
        """(row, column) of output tile `tile`'s first element, tiles in grouped order (as `matmul.tile_coords`)."""
        tiles_n = gl.cdiv(N, BN)
        per_group = GROUP_M * tiles_n
        first_m = (tile // per_group) * GROUP_M
        rows_in_group = gl.minimum(gl.cdiv(M, BM) - first_m, GROUP_M)
        return (first_m + (tile % per_group) % rows_in_group) * BM, ((tile % per_group) // rows_in_group) * BN

    @gluon.jit
    def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M: gl.constexpr):
        """One warp: every tile of this program, every k-step, into the next free stage."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[1]
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        k_steps = gl.cdiv(K, BK)
        tiles = gl.cdiv(M, BM) * gl.cdiv(N, BN)
        step = 0
        for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
            off_m, off_n = _tile_origin(tile, M, N, BM, BN, GROUP_M)
            for k in range(k_steps):
                s = step % STAGES
                mbarrier.wait(empty.index(s), (step // STAGES & 1) ^ 1)  # a fresh barrier counts as emptied once
                mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                _tma_load(a_desc, [off_m, k * BK], ready.index(s), a_bufs.index(s))
                _tma_load(b_desc, [k * BK, off_n], ready.index(s), b_bufs.index(s))
                step += 1

    @gluon.jit
    def _consumer(a_bufs, b_bufs, ready, empty, turns, c_desc, c_smem, M, N, K, FIRST: gl.constexpr,
                  GROUP_M: gl.constexpr):
        """One warp group: the program's tiles FIRST, FIRST + 2, ...; k-loop on wgmma, then the epilogue. The
        two take turns issuing their k-loops (`turns[c]`: consumer c's turn), so that one's epilogue runs while
        the other's MMAs do; without turns both would start together and store together."""
        BM: gl.constexpr = c_desc.block_type.shape[0]
        BN: gl.constexpr = c_desc.block_type.shape[1]
        BK: gl.constexpr = a_bufs.type.shape[2]
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                              instr_shape=[16, BN, 16])
        k_steps = gl.cdiv(K, BK)
        tiles = gl.cdiv(M, BM) * gl.cdiv(N, BN)
        pid = gl.program_id(0)
        programs = gl.num_programs(0)
        for j in range(FIRST, gl.cdiv(tiles - pid, programs), 2):
            off_m, off_n = _tile_origin(pid + j * programs, M, N, BM, BN, GROUP_M)
            acc = gl.zeros([BM, BN], gl.float32, acc_layout)
            mbarrier.wait(turns.index(FIRST), (j // 2 & 1) ^ (1 - FIRST))  # consumer 0 has the first turn
            for k in range(k_steps):
                step = j * k_steps + k
                s = step % STAGES
                mbarrier.wait(ready.index(s), step // STAGES & 1)
                acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # the previous step's MMAs are done:
                mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=k > 0)  # its stage is free
            mbarrier.arrive(turns.index(1 - FIRST))  # every MMA of this tile is issued: the other's turn
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((j * k_steps + k_steps - 1) % STAGES))  # K > 0: the host sees to it
            tma.store_wait(pendings=0)  # this warp group's previous tile has left c_smem
            c_smem.store(acc.to(c_desc.dtype))
            fence_async_shared()
            _tma_store(c_desc, [off_m, off_n], c_smem)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _second_consumer(a_bufs, b_bufs, ready, empty, turns, c_desc, c_smem, M, N, K, GROUP_M: gl.constexpr):
        _consumer(a_bufs, b_bufs, ready, empty, turns, c_desc, c_smem, M, N, K, 1, GROUP_M)

    @gluon.jit
    def _pingpong_kernel(a_desc, b_desc, c_desc, M, N, K, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        dtype: gl.constexpr = a_desc.dtype
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[1]
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BK, BN], b_desc.layout)
        c_smem0 = gl.allocate_shared_memory(dtype, [BM, BN], c_desc.layout)
        c_smem1 = gl.allocate_shared_memory(dtype, [BM, BN], c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        for c in gl.static_range(2):
            mbarrier.init(turns.index(c), count=1)
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready, empty, turns, c_desc, c_smem0, M, N, K, 0, GROUP_M)),
            (_second_consumer, (a_bufs, b_bufs, ready, empty, turns, c_desc, c_smem1, M, N, K, GROUP_M)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M)),
        ], [4, 1], [232, 40])


def layouts(dtype: torch.dtype, bm: int, bn: int, bk: int) -> tuple:
    """The shared-memory layouts (swizzles) of the A, B and C tiles."""
    return shared_layout(dtype, (bm, bk)), shared_layout(dtype, (bk, bn)), shared_layout(dtype, (bm, bn))


def describers(dtype: torch.dtype, bm: int, bn: int, bk: int) -> tuple:
    """The functions making the kernel's TMA descriptors over a (M, K), b (K, N) and c (M, N) on the host
    (`ops/descriptors.py` says why), for `Launcher`'s `descriptors`; the operands are contiguous, 16-byte aligned and
    not empty."""
    a_layout, b_layout, c_layout = layouts(dtype, bm, bn, bk)
    return (functools.partial(gluon_descriptor, block=[bm, bk], layout=a_layout),
            functools.partial(gluon_descriptor, block=[bk, bn], layout=b_layout),
            functools.partial(gluon_descriptor, block=[bm, bn], layout=c_layout))


usable = hopper_gluon  # whether the ping-pong kernel can run here: Gluon, a Hopper GPU, a 16-bit dtype

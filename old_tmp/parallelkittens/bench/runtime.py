"""Runtime ceilings at one rank: the peer write path against torch's copy, and a barrier round trip.

Goals (issue 2): the peer path reaches at least 90% of `copy_` bandwidth into a second 1 GiB bf16 buffer;
`barrier_all` at one rank costs at most 10 µs. Both paths are measured: register stores through the pointer
table (`pkl.store`) and tensor-descriptor (TMA) stores to the peer's buffer (`pkl.peer_descriptor`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import language as pkl

GIB = 1 << 30


@triton.jit
def _copy_store_kernel(src_ptr, dst_ptr, h, n, peer, BLOCK: tl.constexpr):
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        pkl.store(dst_ptr + offs, tl.load(src_ptr + offs), h, peer)


@triton.jit
def _copy_tma_kernel(src_ptr, dst_ptr, h, rows, peer, COLS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    src = tl.make_tensor_descriptor(src_ptr, [rows, COLS], [COLS, 1], [BM, BN])
    dst = pkl.peer_descriptor(dst_ptr, h, peer, [rows, COLS], [COLS, 1], [BM, BN])
    tiles_n = COLS // BN
    for tile in tl.range(tl.program_id(0), tl.cdiv(rows, BM) * tiles_n, tl.num_programs(0), num_stages=3):
        r, c = (tile // tiles_n) * BM, (tile % tiles_n) * BN
        dst.store([r, c], src.load([r, c]))


@triton.jit
def _barrier_loop_kernel(counter_ptr, h, ROUNDS: tl.constexpr):
    for _ in range(ROUNDS):
        pkl.barrier_all(counter_ptr, h)


def _peer_paths(src: torch.Tensor, dst, peer: int, n: int, ms_ref: float) -> list[dict]:
    """Copy `src` (n bf16) into rank `peer`'s part of `dst` through each peer path: rows of ms, GB/s, ratio to
    `ms_ref` and whether the copy was exact."""
    sms = torch.cuda.get_device_properties(src.device).multi_processor_count
    variants = {
        "pkl.store (register), 4096/program, 4 per SM": lambda: _copy_store_kernel[(4 * sms,)](
            src, dst.local, dst.handle, n, peer, BLOCK=4096, num_warps=4),
        "pkl.store (register), 8192/program, 2 per SM, 8 warps": lambda: _copy_store_kernel[(2 * sms,)](
            src, dst.local, dst.handle, n, peer, BLOCK=8192, num_warps=8),
        "peer_descriptor (TMA), 64x256 tiles, 1 per SM": lambda: _copy_tma_kernel[(sms,)](
            src, dst.local, dst.handle, n // 4096, peer, COLS=4096, BM=64, BN=256, num_warps=4),
        "peer_descriptor (TMA), 128x128 tiles, 2 per SM": lambda: _copy_tma_kernel[(2 * sms,)](
            src, dst.local, dst.handle, n // 4096, peer, COLS=4096, BM=128, BN=128, num_warps=4),
    }
    rows = []
    for name, launch in variants.items():
        dst.peer(peer).fill_(float("nan"))
        launch()
        torch.cuda.synchronize()
        exact = torch.equal(dst.peer(peer), src)
        ms = triton.testing.do_bench(launch, return_mode="median")
        rows.append({"name": name, "ms": ms, "GB/s": 2 * GIB / ms / 1e6, "vs copy_": ms_ref / ms, "correct": exact})
    return rows


def _p2p_rank() -> dict:
    """Rank 0 writes 1 GiB into rank 1's buffer on the other GPU; rank 1 waits. Bandwidth counts bytes moved."""
    import parallelkittens as pk

    ctx = pk.context()
    n = GIB // 2
    dst = pk.empty(n, torch.bfloat16, name="bench.p2p")
    src = torch.randn(n, device=ctx.device, dtype=torch.bfloat16)
    _peer_paths(src, dst, ctx.rank, n, 1.0)  # every rank compiles every path (into its own buffer) first
    pk.sync()  # so that rank 1 does not wait for rank 0's compiles below
    rows = []
    if ctx.rank == 0:
        other = torch.empty(n, device=torch.device("cuda", 1), dtype=torch.bfloat16)
        ms_copy = triton.testing.do_bench(lambda: other.copy_(src), return_mode="median")
        rows.append({"name": "torch copy_ cuda:0 -> cuda:1 (copy engine)", "ms": ms_copy, "GB/s": GIB / ms_copy / 1e6})
        rows += _peer_paths(src, dst, 1, n, ms_copy)
        for row in rows[1:]:
            row["GB/s"] /= 2  # one GPU's link: bytes moved, not read plus written
    pk.sync()
    dst.free()
    return {"rows": rows}


def bench_p2p() -> dict:
    """Peer-to-peer bandwidth between two GPUs (issue 5's interconnect note): torch copy_ beside our paths."""
    import parallelkittens as pk

    if torch.cuda.device_count() < 2:
        raise SystemExit("bench p2p needs two GPUs")
    result = pk.spawn(_p2p_rank, 2, backend="cuda")[0]
    print(f"{'what':<50} {'time':>12} {'GB/s':>8} {'vs copy_':>9}")
    for row in result["rows"]:
        ratio = f"{row['vs copy_']:.3f}" if "vs copy_" in row else ""
        print(f"{row['name']:<50} {row['ms']:>9.3f} ms {row['GB/s']:>8.0f} {ratio:>9}")
    return {"world_size": 2, **result}


def _bench_rank() -> dict:
    import parallelkittens as pk

    ctx = pk.context()
    n = GIB // 2  # bf16 elements in 1 GiB
    src = torch.randn(n, device=ctx.device, dtype=torch.bfloat16)
    dst = pk.empty(n, torch.bfloat16, name="bench.dst")
    plain = torch.empty_like(src)
    ms_copy = triton.testing.do_bench(lambda: plain.copy_(src), return_mode="median")
    rows = [{"name": "torch copy_", "ms": ms_copy, "GB/s": 2 * GIB / ms_copy / 1e6}]
    rows += _peer_paths(src, dst, ctx.rank, n, ms_copy)
    best = max(r["vs copy_"] for r in rows[1:])
    rows.append({"name": "best peer path vs copy_ (goal >= 0.90)", "vs copy_": best,
                 "pass": best >= 0.90 and all(r["correct"] for r in rows[1:])})
    dst.free()

    counter = pk.zeros(1, torch.int32, name="bench.barrier")
    us_launch = triton.testing.do_bench(pk.barrier, return_mode="median") * 1e3
    rounds = 1000
    ms_loop = triton.testing.do_bench(lambda: _barrier_loop_kernel[(1,)](counter.local, counter.handle,
                                                                         ROUNDS=rounds), return_mode="median")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(100):
            pk.barrier()
    us_graph = triton.testing.do_bench(g.replay, return_mode="median") * 1e3 / 100
    ok_counter = int(counter.local.item()) == 0
    rows += [
        {"name": "barrier_all, one launch per barrier", "us": us_launch, "pass": us_launch <= 10.0},
        {"name": "barrier_all, 100 launches in a CUDA graph", "us": us_graph, "pass": us_graph <= 10.0},
        {"name": f"barrier_all, {rounds} in one kernel", "us": ms_loop * 1e3 / rounds, "pass": ok_counter},
    ]
    counter.free()
    return {"rows": rows}


def bench_runtime() -> dict:
    """Peer write bandwidth vs copy_ (1 GiB bf16) and barrier_all round trip, one rank."""
    import parallelkittens as pk

    result = pk.spawn(_bench_rank, 1)[0]
    print(f"{'what':<50} {'time':>12} {'GB/s':>8} {'vs copy_':>9} {'pass':>5}")
    for row in result["rows"]:
        time = f"{row['ms']:.3f} ms" if "ms" in row else f"{row['us']:.2f} us"
        gbs = f"{row['GB/s']:.0f}" if "GB/s" in row else ""
        ratio = f"{row['vs copy_']:.3f}" if "vs copy_" in row else ""
        print(f"{row['name']:<50} {time:>12} {gbs:>8} {ratio:>9} {str(row.get('pass', '')):>5}")
    return {"world_size": 1, **result}

"""Compile the primitives' kernels for a GPU target without a GPU and report what the PTX carries.

    TRITON_INTERPRET=0 python -m parallelkittens.testing.compile_check [--arch 90]

prints one JSON object: {"markers": kernel name -> the memory-ordering markers found in its PTX, "shared":
kernel name -> bytes of shared memory it needs}. The tests check that signals release and waits acquire at
system scope, that bulk tensor copies are waited for before a signal, that every wait is bounded (a timer
read), and that every kernel fits in an H100/H200 SM's shared memory.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

MARKERS = {
    "release_sys_atomic": ("atom.release.sys", "red.release.sys", "atom.global.release.sys", "red.global.release.sys",
                           "atom.sys.release", "red.sys.release", "atom.global.sys.release", "red.global.sys.release"),
    "relaxed_sys_add": ("red.global.sys.relaxed.add", "atom.global.sys.relaxed.add"),
    "acquire_sys_load": ("ld.global.acquire.sys", "ld.acquire.sys"),
    "fence_sys": ("fence.acq_rel.sys",),
    "bulk_wait": ("cp.async.bulk.wait_group 0",),
    "proxy_fence": ("fence.proxy.async.global",),
    "tma_store": ("cp.async.bulk.tensor",),
    "tma_load": (".shared::cluster.global.mbarrier", ".shared::cta.global.mbarrier"),  # global to shared
    "tma_reduce": ("cp.reduce.async.bulk.tensor",),
    "setmaxnreg": ("setmaxnreg.",),
    "acq_rel_gpu_atomic": ("atom.global.gpu.acq_rel", "atom.global.acq_rel.gpu", "atom.acq_rel.gpu"),
    "globaltimer": ("%globaltimer",),
    "wgmma": ("wgmma.mma_async",),
    "vector_loads": ("ld.global.v4",),
}


MEET = {"meet_counters": "*i32", "meet_slots": "*i64", "meet_handle": "*i64", "sig": "i64", "rank": "i32",
        "world": "i32"}


def _kernels():
    import torch

    from ..ops.collectives._pull import _pull_kernel
    from ..ops.collectives.barrier import _barrier_kernel
    from ..ops.gemm import pingpong
    from ..template import example
    from . import primitive_checks as pc

    i64 = "*i64"
    GEMM = {"BM": 128, "BN": 256, "BK": 64, "GROUP_M": 8, "STAGES": 3}
    # what a launch specializes when pointers and sizes are multiples of 16 (the usual case)
    ALIGNED = ("x_ptr", "src_ptr", "mid_ptr", "out_ptr", "limit", "C", "ss0", "ss1", "ss2", "ds0", "ds1", "ds2",
               "src_me", "src_r", "dst_me", "dst_r")
    PULL = {"x_ptr": "*bf16", "src_ptr": "*bf16", "src_handle": i64, "mid_ptr": "*bf16", "mid_handle": i64,
            "out_ptr": "*bf16", "rounds_ptr": "*i32", "rounds_handle": i64,
            "limit": "i64", **{k: "i32" for k in ("R0", "R1", "R2", "C", "ss0", "ss1", "ss2", "ds0", "ds1", "ds2",
                                                   "src_me", "src_r", "dst_me", "dst_r")}, **MEET,
            **{k: "constexpr" for k in ("STAGE", "REDUCE", "TWO_SHOT", "IN_PLACE", "BR", "BC", "LIMIT")}}
    NO_STAGE = {"STAGE": False, "TWO_SHOT": False, "IN_PLACE": False}
    kernels = {
        "signal_wait": (pc._signal_wait_kernel, {"src_ptr": "*fp32", "inbox_ptr": "*fp32", "h": i64,
                                                 "flags_ptr": "*i32", "hf": i64, "out_ptr": "*fp32", "n": "i32",
                                                 "BLOCK": "constexpr"}, {"BLOCK": 256}),
        "signal_all": (pc._signal_all_kernel, {"flags_ptr": "*i32", "hf": i64}, {}),
        "barrier_all": (_barrier_kernel, {"counter_ptr": "*i32", "h": i64}, {}),
        "store_add": (pc._store_add_kernel, {"src_ptr": "*bf16", "acc_ptr": "*bf16", "h": i64, "n": "i32",
                                             "BLOCK": "constexpr"}, {"BLOCK": 256}),
        "all_reduce": (pc._all_reduce_kernel, {"x_ptr": "*bf16", "h": i64, "n": "i32", "BLOCK": "constexpr"},
                       {"BLOCK": 256}),
        "tma_store": (pc._tma_kernel, {"src_ptr": "*bf16", "y_ptr": "*bf16", "h": i64, "M": "i32", "N": "i32",
                                       "ADD": "constexpr", "BM": "constexpr", "BN": "constexpr"},
                      {"ADD": False, "BM": 64, "BN": 64}),
        "tma_store_add": (pc._tma_kernel, {"src_ptr": "*fp32", "y_ptr": "*fp32", "h": i64, "M": "i32", "N": "i32",
                                           "ADD": "constexpr", "BM": "constexpr", "BN": "constexpr"},
                          {"ADD": True, "BM": 64, "BN": 64}),
        "collective_pull": (_pull_kernel, PULL, {**NO_STAGE, "REDUCE": True, "BR": 4, "BC": 1024, "LIMIT": True},
                            ALIGNED),
        "collective_pull_copy": (_pull_kernel, PULL, {**NO_STAGE, "REDUCE": False, "BR": 1, "BC": 4096,
                                                      "LIMIT": False}, ALIGNED),
        # a plain tensor's all_reduce of two phases: the staging copy, three rounds
        "collective_two_shot_staged": (_pull_kernel, PULL, {"STAGE": True, "REDUCE": True, "TWO_SHOT": True,
                                                            "IN_PLACE": False, "BR": 4, "BC": 1024, "LIMIT": True},
                                       ALIGNED),
        "collective_pull_in_place": (_pull_kernel, PULL, {**NO_STAGE, "IN_PLACE": True, "REDUCE": True, "BR": 4,
                                                          "BC": 1024, "LIMIT": False}, ALIGNED),
        "lcsc_example": (example._scaled_all_gather_kernel,
                         {"x_ptr": "*bf16", "out_ptr": "*bf16", "out_handle": i64, "flags_ptr": "*i32",
                          "flags_handle": i64, "alpha": "fp32", "M": "i32", "N": "i32", "num_tasks": "i32",
                          "num_comm": "i32", **MEET, "BM": "constexpr", "BN": "constexpr"},
                         {"BM": 32, "BN": 64}),
    }
    kernels.update(_gemm_kernels("bf16", GEMM))
    kernels.update(_attention_kernels())
    kernels.update({name + "_fp32": kernel for name, kernel in _gemm_kernels("fp32", {**GEMM, "BK": 32}).items()
                    if name in ("all_gather_matmul", "matmul_reduce_scatter", "matmul", "matmul_all_reduce")})
    narrow = {**GEMM, "BN": 128, "STAGES": 5}  # matmul_config's choice when tiles are few
    kernels["matmul_narrow"] = _gemm_kernels("bf16", narrow)["matmul"]
    kernels["matmul_narrow_fp32"] = _gemm_kernels("fp32", {**narrow, "BK": 32, "STAGES": 4})["matmul"]
    # the layers' backward: B read through its transpose's (BN, BK) descriptor
    fn, signature, consts = kernels["matmul_reduce_scatter"]
    kernels["matmul_reduce_scatter_b_t"] = (fn, {**signature, "b_desc": _desc("bf16", GEMM["BN"], GEMM["BK"])},
                                            {**consts, "B_T": True})
    if pingpong.AVAILABLE:
        a_layout, b_layout, c_layout = pingpong.layouts(torch.bfloat16, 128, 128, 64)
        signature = {"a_desc": _desc("bf16", 128, 64, a_layout), "b_desc": _desc("bf16", 64, 128, b_layout),
                     "c_desc": _desc("bf16", 128, 128, c_layout), "M": "i32", "N": "i32", "K": "i32",
                     "GROUP_M": "constexpr", "STAGES": "constexpr"}
        kernels["matmul_pingpong"] = (pingpong._pingpong_kernel, signature, {"GROUP_M": 8, "STAGES": 5})
    return kernels


def _attention_kernels() -> dict:
    """The flash forward with its H200 tiles (128 x 128, 8 warps, 3 stages), reading Q, K and V through pointers
    and through TMA descriptors (`flash.FWD_LOADS`), causal; and the warp-specialised Gluon forward."""
    import torch

    from ..ops.attention import flash

    fn = flash._fwd_kernel
    ints = [a for a in fn.arg_names if a.startswith(("H", "GROUP", "N_", "stride", "q_seg", "k_seg"))]
    base = {**{a: "i32" for a in ints}, "o_ptr": "*bf16", "lse_ptr": "*fp32", "acc_ptr": "constexpr",
            "qk_scale": "fp32", **{k: "constexpr" for k in ("CAUSAL", "MERGE", "FINAL", "TMA", "BLOCK_M",
                                                             "BLOCK_N", "HEAD_DIM")}}
    consts = {"acc_ptr": None, "CAUSAL": True, "MERGE": False, "FINAL": False, "BLOCK_M": 128,
              "BLOCK_N": 128, "HEAD_DIM": 128}
    aligned = ("o_ptr", "lse_ptr", "N_Q", "N_K", "stride_qb", "stride_qh", "stride_qn", "stride_kb", "stride_kh",
               "stride_kn", "stride_ob", "stride_oh", "stride_on")
    rows = "tensordesc<bf16[1, 1, 128, 128]>"
    kernels = {
        "attention_forward": (fn, {**base, "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16"},
                              {**consts, "TMA": False}, ("q_ptr", "k_ptr", "v_ptr", *aligned)),
        "attention_forward_tma": (fn, {**base, "q_ptr": rows, "k_ptr": rows, "v_ptr": rows}, {**consts, "TMA": True},
                                  aligned),
    }
    from ..ops.attention import flash_hopper

    if flash_hopper.AVAILABLE:  # the warp-specialised Gluon forward, causal, D 128, 128-key tiles, 3 stages
        ws = flash_hopper._fwd_ws_kernel
        layout = functools.partial(flash_hopper.shared_layout, torch.bfloat16)
        ws_ints = [a for a in ws.arg_names if a.startswith(("H", "GROUP", "N_", "stride", "q_", "kv_"))
                   and not a.endswith("desc")]
        kv = f"tensordesc<bf16[1, 128, 128],{layout((1, 128, 128))!r}>"
        signature = {**{a: "i32" for a in ws_ints}, "q_desc": _desc("bf16", 64, 128, layout((64, 128))),
                     "k_desc": kv, "v_desc": kv, "o_ptr": "*bf16", "lse_ptr": "*fp32", "qk_scale": "fp32",
                     "CAUSAL": "constexpr", "STAGES": "constexpr"}
        kernels["attention_forward_ws"] = (ws, signature, {"CAUSAL": True, "STAGES": 3},
                                           ("o_ptr", "lse_ptr", "N_Q", "N_K", "stride_ob", "stride_oh", "stride_on"))
    return kernels


def _desc(dtype: str, rows: int, cols: int, layout=None) -> str:
    """The signature of a host tensor descriptor argument with (rows, cols) blocks (Gluon's carry a layout)."""
    return f"tensordesc<{dtype}[{rows}, {cols}]" + (f",{layout!r}>" if layout is not None else ">")


def _gemm_kernels(dtype: str, gemm: dict) -> dict:
    """The GEMM kernels and the fused ops' kernels with `dtype` operands and `gemm`'s tiles."""
    from ..ops.gemm.all_gather_matmul import _ag_matmul_kernel
    from ..ops.gemm.matmul import _matmul_kernel
    from ..ops.gemm.matmul_all_reduce import _mm_ar_kernel
    from ..ops.gemm.matmul_reduce_scatter import _mm_rs_kernel

    bm, bn, bk = gemm["BM"], gemm["BN"], gemm["BK"]
    a, b, half, ptr = _desc(dtype, bm, bk), _desc(dtype, bk, bn), _desc(dtype, bm, bn // 2), "*" + dtype
    consts = {k: "constexpr" for k in gemm}
    ints = lambda *names: {k: "i32" for k in names}
    return {
        "matmul": (_matmul_kernel, {"a_desc": a, "b_desc": b, "c_desc": half, **ints("M", "N", "K"), **consts,
                                    "FLATTEN": "constexpr", "B_T": "constexpr"},
                   {**gemm, "FLATTEN": True, "B_T": False}),
        "all_gather_matmul": (_ag_matmul_kernel, {
            "a_desc": a, "a_ptr": ptr, "a_full_ptr": ptr, "a_full_handle": "*i64", "a_full_desc": a, "b_desc": b,
            "c_desc": half, "flags_ptr": "*i32", "flags_handle": "*i64",
            **ints("m_local", "M", "N", "K", "num_tasks", "num_comm_tasks", "num_comm"), **MEET, **consts,
            "BK_COPY": "constexpr", "B_T": "constexpr"}, {**gemm, "BK_COPY": 64, "B_T": False}),
        "matmul_reduce_scatter": (_mm_rs_kernel, {
            "a_desc": a, "b_desc": b, "buf_ptr": ptr, "buf_handle": "*i64", "buf_desc": half, "ctr_ptr": "*i32",
            "ctr_handle": "*i64", "out_desc": half, **ints("M", "N", "K", "m_block", "slot_rows", "per_owner"), **MEET,
            **consts, "B_T": "constexpr"}, {**gemm, "B_T": False}),
        "matmul_all_reduce": (_mm_ar_kernel, {
            "a_desc": a, "b_desc": b, "buf_ptr": ptr, "buf_handle": "*i64", "buf_desc": half, "res_ptr": ptr,
            "res_handle": "*i64", "res_desc": half, "out_desc": half, "ctr_ptr": "*i32", "ctr_handle": "*i64",
            **ints("M", "N", "K", "slot_rows", "tiles", "num_comm_tasks", "num_comm"), **MEET, **consts}, gemm),
    }


def _gluon_source():
    from triton.experimental.gluon._runtime import GluonASTSource

    return GluonASTSource


def compile_all(arch: int) -> dict[str, dict]:
    """Compile every kernel of `_kernels()` for CUDA `arch`: the markers each one's PTX contains, and the
    shared memory each one needs (bytes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    found, shared = {}, {}
    for name, (fn, signature, constexprs, *aligned) in _kernels().items():
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in (aligned[0] if aligned else ())}
        gluon = type(fn).__name__ == "GluonJITFunction"  # the Hopper ping-pong GEMM (ops/gemm/pingpong.py)
        src = (_gluon_source() if gluon else ASTSource)(fn, signature, constexprs, attrs=attrs)
        gemm = "BM" in constexprs and constexprs.get("BN") == 256
        attention = "HEAD_DIM" in constexprs
        options = ({"num_warps": 4, "maxnreg": 168} if gluon else {"num_warps": 8} if gemm else
                   {"num_warps": 8, "num_stages": 3} if attention else {})
        kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
        ptx = kernel.asm["ptx"]
        found[name] = sorted(m for m, needles in MARKERS.items() if any(n in ptx for n in needles))
        shared[name] = int(kernel.metadata.shared)
    return {"markers": found, "shared": shared}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run with TRITON_INTERPRET=0: this compiles for a GPU")
    print(json.dumps(compile_all(args.arch)))


if __name__ == "__main__":
    main()

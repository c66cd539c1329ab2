"""Compile the primitives' kernels for a GPU target without a GPU and report what the PTX carries.

    TRITON_INTERPRET=0 python -m parallelkittens.testing.compile_check [--arch 90]

prints one JSON object: {"markers": kernel name -> the memory-ordering markers found in its PTX, "shared":
kernel name -> bytes of shared memory it needs, "polling_loops": kernel name -> (loops polling memory, those of
them reading the clock)}. The tests check that signals release and waits acquire at system scope, that bulk
tensor copies are waited for before a signal, that every wait loop is bounded (reads the timer), and that every
kernel fits in an H100/H200 SM's shared memory.
"""

from __future__ import annotations

import argparse
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


def _meet():
    from ..template.meeting import Meet

    return Meet("*i32", "*i64", "*i64", "i64", "i32")


def _source(fn, params: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of `fn` for `ASTSource`, from `params`: each parameter's type ("*bf16", "i32";
    a trailing ":16" says the value is a multiple of 16, as a launch with aligned pointers and sizes specialises),
    a constant (`tl.constexpr(value)`), or a group (a NamedTuple of those)."""
    import triton.language as tl

    signature, constexprs, attrs = {}, {}, {}

    def one(spec, path):
        if isinstance(spec, tl.constexpr):
            constexprs[path] = spec.value
            return "constexpr"
        if isinstance(spec, tuple):
            return type(spec)(*(one(s, path + (j,)) for j, s in enumerate(spec)))
        kind, _, aligned = spec.partition(":")
        if aligned:
            attrs[path] = [["tt.divisibility", 16]]
        return kind

    for name, spec in params.items():
        signature[name] = one(spec, (fn.arg_names.index(name),))
    return signature, constexprs, attrs


def _c(value):
    import triton.language as tl

    return tl.constexpr(value)


def _kernels():
    from ..ops.collectives import _pull
    from ..ops.collectives.barrier import _barrier_kernel
    from ..ops.gemm import pingpong
    from ..template import example
    from . import primitive_checks as pc

    i64 = "*i64"
    geometry = _pull.Geometry(*["i32"] * 3, "i32:16", *["i32:16"] * 6)
    route = _pull.Route("i64:16", *["i32:16"] * 4, "*bf16:16", i64, "*i32", i64)

    def pull(**steps):
        flags = {**dict(STAGE=False, TWO_SHOT=False, IN_PLACE=False, REDUCE=True, BR=4, BC=1024, LIMIT=True), **steps}
        return (_pull._pull_kernel, {"x_ptr": "*bf16:16", "src_ptr": "*bf16:16", "src_handle": i64,
                                     "out_ptr": "*bf16:16", "G": geometry, "R": route, "meet": _meet(),
                                     "S": _pull.Steps(**{k: _c(v) for k, v in flags.items()})})

    kernels = {
        "signal_wait": (pc._signal_wait_kernel, {"src_ptr": "*fp32", "inbox_ptr": "*fp32", "h": i64,
                                                 "flags_ptr": "*i32", "hf": i64, "out_ptr": "*fp32", "n": "i32",
                                                 "BLOCK": _c(256)}),
        "signal_all": (pc._signal_all_kernel, {"flags_ptr": "*i32", "hf": i64}),
        "barrier_all": (_barrier_kernel, {"counter_ptr": "*i32", "h": i64}),
        "store_add": (pc._store_add_kernel, {"src_ptr": "*bf16", "acc_ptr": "*bf16", "h": i64, "n": "i32",
                                             "BLOCK": _c(256)}),
        "all_reduce": (pc._all_reduce_kernel, {"x_ptr": "*bf16", "h": i64, "n": "i32", "BLOCK": _c(256)}),
        "tma_store": (pc._tma_kernel, {"src_ptr": "*bf16", "y_ptr": "*bf16", "h": i64, "M": "i32", "N": "i32",
                                       "ADD": _c(False), "BM": _c(64), "BN": _c(64)}),
        "tma_store_add": (pc._tma_kernel, {"src_ptr": "*fp32", "y_ptr": "*fp32", "h": i64, "M": "i32", "N": "i32",
                                           "ADD": _c(True), "BM": _c(64), "BN": _c(64)}),
        "collective_pull": pull(),
        "collective_pull_copy": pull(REDUCE=False, BR=1, BC=4096, LIMIT=False),
        # a plain tensor's all_reduce of two phases: the staging copy, three rounds
        "collective_two_shot_staged": pull(STAGE=True, TWO_SHOT=True),
        "collective_pull_in_place": pull(IN_PLACE=True, LIMIT=False),
        "lcsc_example": (example._scaled_all_gather_kernel, {
            "x_ptr": "*bf16", "alpha": "fp32", "S": example.Buffers("*bf16", i64, "*i32", i64, "i32", "i32", "i32"),
            "num_comm": "i32", "meet": _meet(), "C": example.Tiles(_c(32), _c(64))}),
    }
    gemm = {"BM": 128, "BN": 256, "BK": 64, "GROUP_M": 8, "STAGES": 3}
    kernels.update(_gemm_kernels("bf16", gemm))
    kernels.update(_attention_kernels())
    kernels.update({name + "_fp32": kernel for name, kernel in _gemm_kernels("fp32", {**gemm, "BK": 32}).items()
                    if name in ("all_gather_matmul", "matmul_reduce_scatter", "matmul", "matmul_all_reduce")})
    narrow = {**gemm, "BN": 128, "STAGES": 5}  # matmul_config's choice when tiles are few
    kernels["matmul_narrow"] = _gemm_kernels("bf16", narrow)["matmul"]
    kernels["matmul_narrow_fp32"] = _gemm_kernels("fp32", {**narrow, "BK": 32, "STAGES": 4})["matmul"]
    # the layers' backward: B read through its transpose's (BN, BK) descriptor
    kernels["matmul_reduce_scatter_b_t"] = _gemm_kernels("bf16", gemm, b_t=True)["matmul_reduce_scatter"]
    if pingpong.GLUON:
        a_layout, b_layout, c_layout = pingpong.layouts(torch_dtype("bf16"), 128, 128, 64)
        kernels["matmul_pingpong"] = (pingpong._pingpong_kernel, {
            "a_desc": _desc("bf16", 128, 64, a_layout), "b_desc": _desc("bf16", 64, 128, b_layout),
            "c_desc": _desc("bf16", 128, 128, c_layout), "M": "i32", "N": "i32", "K": "i32", "GROUP_M": _c(8),
            "STAGES": _c(5)})
    return kernels


def torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _attention_kernels() -> dict:
    """The flash forward with its GPU tiles (128 x 128, 8 warps, 3 stages), causal; and the warp-specialised Gluon
    forward."""
    from ..ops.attention import flash, flash_hopper

    shape = flash.Shape(*["i32"] * 2, *["i32:16"] * 11, *["i32"] * 6, "fp32", "fp32")
    kernels = {"attention_forward": (flash._fwd_kernel, {
        "q_ptr": "*bf16:16", "k_ptr": "*bf16:16", "v_ptr": "*bf16:16", "o_ptr": "*bf16:16", "lse_ptr": "*fp32:16",
        "acc_ptr": _c(None), "S": shape, "C": flash.FwdTiles(*map(_c, (True, False, False, 128, 128, 128)))})}
    if flash_hopper.GLUON:  # the warp-specialised Gluon forward, causal, D 128, 128-key tiles, 3 stages
        layout = lambda block: flash_hopper.shared_layout(torch_dtype("bf16"), block)  # noqa: E731
        kv = f"tensordesc<bf16[1, 128, 128],{layout((1, 128, 128))!r}>"
        sizes = flash_hopper.Sizes(*["i32"] * 2, *["i32:16"] * 2, *["i32"] * 6, *["i32:16"] * 3, "fp32")
        kernels["attention_forward_ws"] = (flash_hopper._fwd_ws_kernel, {
            "q_desc": _desc("bf16", 64, 128, layout((64, 128))), "k_desc": kv, "v_desc": kv, "o_ptr": "*bf16:16",
            "lse_ptr": "*fp32:16", "S": sizes, "CAUSAL": _c(True), "STAGES": _c(3)})
    return kernels


def _desc(dtype: str, rows: int, cols: int, layout=None) -> str:
    """The signature of a host tensor descriptor argument with (rows, cols) blocks (Gluon's carry a layout)."""
    return f"tensordesc<{dtype}[{rows}, {cols}]" + (f",{layout!r}>" if layout is not None else ">")


def _gemm_kernels(dtype: str, gemm: dict, b_t: bool = False) -> dict:
    """The GEMM kernels and the fused ops' kernels with `dtype` operands and `gemm`'s tiles."""
    from ..ops.gemm import all_gather_matmul as agmm
    from ..ops.gemm import matmul_all_reduce as mmar
    from ..ops.gemm import matmul_reduce_scatter as mmrs
    from ..ops.gemm.matmul import Tiles, _matmul_kernel

    bm, bn, bk = gemm["BM"], gemm["BN"], gemm["BK"]
    a, half, ptr = _desc(dtype, bm, bk), _desc(dtype, bm, bn // 2), "*" + dtype
    b = _desc(dtype, bn, bk) if b_t else _desc(dtype, bk, bn)
    tiles = Tiles(*map(_c, (bm, bn, bk, gemm["GROUP_M"], gemm["STAGES"], b_t, 64)))
    i64 = "*i64"
    return {
        "matmul": (_matmul_kernel, {"a_desc": a, "b_desc": b, "c_desc": half, "M": "i32", "N": "i32", "K": "i32",
                                    **{k: _c(v) for k, v in gemm.items()}, "FLATTEN": _c(True), "B_T": _c(b_t)}),
        "all_gather_matmul": (agmm._ag_matmul_kernel, {
            "a_desc": a, "a_ptr": ptr, "b_desc": b, "c_desc": half, "a_full_desc": a,
            "S": agmm.Buffers(ptr, i64, "*i32", i64, *["i32"] * 6), "num_comm": "i32", "meet": _meet(), "C": tiles}),
        "matmul_reduce_scatter": (mmrs._mm_rs_kernel, {
            "a_desc": a, "b_desc": b, "out_desc": half, "buf_desc": half,
            "S": mmrs.Buffers(ptr, i64, "*i32", i64, *["i32"] * 6), "meet": _meet(), "C": tiles}),
        "matmul_all_reduce": (mmar._mm_ar_kernel, {
            "a_desc": a, "b_desc": b, "out_desc": half, "buf_desc": half, "res_desc": half,
            "S": mmar.Buffers(ptr, i64, ptr, i64, "*i32", i64, *["i32"] * 6), "num_comm": "i32", "meet": _meet(),
            "C": tiles}),
    }


def _gluon_source():
    from triton.experimental.gluon._runtime import GluonASTSource

    return GluonASTSource


def polling_loops(ptx: str) -> tuple[int, int]:
    """(loops that poll memory at system scope, those of them that read the clock): a loop is the lines from a
    label to a branch back to it; a poll, an acquire load at system scope."""
    lines = [line.split("//")[0].strip() for line in ptx.splitlines()]  # a loop's label carries a comment
    labels = {line[:-1]: i for i, line in enumerate(lines) if line.endswith(":")}
    polling = timed = 0
    for i, line in enumerate(lines):
        if "bra" not in line:
            continue
        target = line.rstrip(";").split()[-1]
        start = labels.get(target)
        if start is None or start > i:
            continue
        body = "\n".join(lines[start:i + 1])
        if any(n in body for n in MARKERS["acquire_sys_load"]):
            polling += 1
            timed += "%globaltimer" in body
    return polling, timed


def compile_all(arch: int) -> dict[str, dict]:
    """Compile every kernel of `_kernels()` for CUDA `arch`: the markers each one's PTX contains, and the
    shared memory each one needs (bytes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    found, shared, loops = {}, {}, {}
    for name, (fn, params) in _kernels().items():
        signature, constexprs, attrs = _source(fn, params)
        gluon = type(fn).__name__ == "GluonJITFunction"  # the Hopper ping-pong GEMM (ops/gemm/pingpong.py)
        src = (_gluon_source() if gluon else ASTSource)(fn, signature, constexprs, attrs=attrs)
        gemm = "a_desc" in params and name != "matmul_pingpong"
        attention = name == "attention_forward"
        options = ({"num_warps": 4, "maxnreg": 168} if gluon else {"num_warps": 8} if gemm else
                   {"num_warps": 8, "num_stages": 3} if attention else {})
        kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
        ptx = kernel.asm["ptx"]
        found[name] = sorted(m for m, needles in MARKERS.items() if any(n in ptx for n in needles))
        shared[name] = int(kernel.metadata.shared)
        loops[name] = polling_loops(ptx)
    return {"markers": found, "shared": shared, "polling_loops": loops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run with TRITON_INTERPRET=0: this compiles for a GPU")
    print(json.dumps(compile_all(args.arch)))


if __name__ == "__main__":
    main()

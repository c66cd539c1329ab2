"""The single-GPU core of the fused ops: a persistent GEMM on tensor descriptors (TMA loads, wgmma on Hopper).

One program per SM walks output tiles in grouped order (GROUP_M row tiles share a column of B in L2); each tile
runs the k-loop `mainloop` below, which the fused ops reuse inside their LCSC roles. Inputs (M, K) @ (K, N),
row-major, bf16, fp16 or fp32 (tf32 on the tensor cores), fp32 accumulation; M, N and K need not be multiples of
the tiles (descriptors clip the edges), but rows must be 16-byte aligned for TMA (K and N multiples of 8 in
16-bit types, of 4 in fp32).

Reference point (one H200, 2026-12-02): a plain persistent Triton GEMM with descriptors, 128x256x64 tiles,
3 stages, 8 warps reached 701 TFLOP/s at 8192^3 bf16 against cuBLAS's 680; that is the default here.

Tried and dropped: split-K (SPLITS programs per output tile, each a slice of the k-loop; the last to arrive added
the others' fp32 partials) lost at every benchmark shape on the H200 (2026-12-04): at best 0.609 of cuBLAS at
2048x256x2048 (against 0.74 without) and 0.30 at 2048x2048x256; a variant adding the partials with TMA
reduce-adds reached 0.498.

The descriptors of local tensors are made on the host (`descriptor`) and passed to the kernels as parameters,
as cuBLAS passes its TMA maps. Made in the kernel (`tl.make_tensor_descriptor`), every program writes its maps to
global memory and fences them before its first load: on an H200 that cost about 2 µs per launch (2048^3: 26.1
against 23.8 µs per call; bench/results/diagnose_gemm-w1-2026-12-04.txt), a tenth of a small GEMM. On the host
each costs about 3.5 µs (building it, and Triton's launcher encoding it), which small GEMMs called eagerly pay;
CUDA graphs do not. Descriptors over peers' memory are still made in the kernel, where the peer is known.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ...runtime.context import context
from ...runtime.device import num_sms
from ...runtime.errors import PKError
from ...runtime.launch import Launcher
from ...runtime.sizes import cdiv
from .. import plan as plans
from . import pingpong

DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # fp32 runs as tf32 on the tensor cores


@dataclass(frozen=True)
class MatmulConfig:
    """Tile sizes and pipelining of the GEMM; `validate` names a bad field."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 8
    flatten: bool = False  # the plain GEMM only: one flattened loop over tiles and k, so loads run ahead
    pingpong: bool = False  # the plain GEMM only, on Hopper in 16-bit: the warp-specialised Gluon kernel

    def validate(self) -> MatmulConfig:
        """This configuration, or a `PKError` naming the bad field and what it may be."""
        for field in ("block_m", "block_n", "block_k"):
            value = getattr(self, field)
            if value < 16 or value > 256 or value & (value - 1):  # TMA moves boxes of at most 256 per side
                raise PKError(f"MatmulConfig.{field} must be a power of two from 16 to 256, got {value}")
        if self.group_m < 1 or self.num_stages < 1 or self.num_warps not in (4, 8):
            raise PKError(f"MatmulConfig: group_m >= 1, num_stages >= 1, num_warps 4 or 8; got {self}")
        if self.pingpong and (self.block_m < 64 or self.block_m * self.block_n > 128 * 128):
            raise PKError(f"MatmulConfig: ping-pong tiles need block_m >= 64 and block_m * block_n <= 128 * 128 "
                          f"(one warp group's accumulator in registers); got {self}")
        return self


class Tiles(NamedTuple):
    """A GEMM's compile-time values inside a kernel: roles read ``C.BM`` in place, so they stay constexprs."""

    BM: tl.constexpr
    BN: tl.constexpr
    BK: tl.constexpr
    GROUP_M: tl.constexpr
    STAGES: tl.constexpr
    B_T: tl.constexpr  # B read through its transpose's descriptor (`mainloop`)


def default_config(dtype: torch.dtype = torch.bfloat16) -> MatmulConfig:
    """The fused ops' tiles: 128x256x64 on a GPU (128x256x32 in fp32, whose tiles take twice the shared memory);
    small ones under the interpreter, where every block op is a numpy call."""
    if context().device.type != "cuda":
        return MatmulConfig(block_m=32, block_n=32, block_k=32, group_m=2, num_stages=1, num_warps=4)
    return _gpu_default_config(dtype)


@functools.cache
def _gpu_default_config(dtype: torch.dtype) -> MatmulConfig:
    return MatmulConfig(block_k=32 if dtype == torch.float32 else 64)


def matmul_config(M: int, N: int, K: int, dtype: torch.dtype) -> MatmulConfig:
    """The plain GEMM's tiles, from sweeps on an H200 (scripts/tune_matmul.py; figures against cuBLAS):

    * 128x256 tiles in the flattened loop win or tie wherever they make more than half a wave;
    * where they would leave half the SMs idle, 128x128 with 5 stages and 4 warps (4096x512x4096: 0.89-0.90
      against 0.80); with more tiles 128x256 stays (2048^3: 256 tiles of 128x128 made two waves, 34.6 µs vs 27);
    * where even 64x64 tiles make at most one wave, 64x64x128 with 4 stages (2048x256x2048: 0.80 against 0.59);
    * a k-loop of at most 4 steps, where the epilogue is much of the time, on Hopper in 16-bit: the ping-pong
      kernel, one consumer's epilogue under the other's MMAs (2048x2048x256: 0.84-0.87 against 0.80).
      At K = 512 and above it only ties, and at 8192^3 it loses (0.99 against 1.04)."""
    if context().device.type != "cuda":
        return default_config(dtype)
    if cdiv(M, 64) * cdiv(N, 64) <= num_sms():
        shape = "tiny"
    elif K <= 256 and pingpong.usable(context().device, dtype):
        shape = "short_k"
    else:
        shape = "few_tiles" if 2 * cdiv(M, 128) * cdiv(N, 256) <= num_sms() else "large"
    return _gpu_matmul_config(shape, dtype)


@functools.cache  # a call's host cost matters for small GEMMs: build each configuration once
def _gpu_matmul_config(shape: str, dtype: torch.dtype) -> MatmulConfig:
    cfg = replace(_gpu_default_config(dtype), flatten=True)
    if shape == "tiny":
        cfg = replace(cfg, block_m=64, block_n=64, block_k=64 if dtype == torch.float32 else 128,
                      num_stages=4 if dtype == torch.float32 else 6, num_warps=4)
    elif shape == "short_k":
        cfg = replace(cfg, block_n=128, num_stages=4, num_warps=4, flatten=False, pingpong=True)
    elif shape == "few_tiles":
        cfg = replace(cfg, block_n=128, num_stages=6 if dtype != torch.float32 else 4, num_warps=4)
    return cfg.validate()


def reference_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in float64."""
    return a.double() @ b.double()


@triton.jit
def tile_coords(tile, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of output tile `tile` in grouped order."""
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % rows_in_group, (tile % per_group) // rows_in_group


@triton.jit
def mainloop(a_desc, b_desc, off_m, off_n, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             STAGES: tl.constexpr, off_k=0, B_T: tl.constexpr = False):
    """The fp32 (BM, BN) tile of A[off_m:, off_k:off_k + K] @ B[off_k:off_k + K, off_n:]. With B_T, `b_desc`
    covers B's transpose (N, K), as a weight stored (out, in) is, in (BN, BK) blocks: wgmma reads either way."""
    acc = tl.zeros([BM, BN], tl.float32)
    for k in tl.range(0, tl.cdiv(K, BK), num_stages=STAGES):
        if B_T:
            b = b_desc.load([off_n, off_k + k * BK]).T
        else:
            b = b_desc.load([off_k + k * BK, off_n])
        acc = tl.dot(a_desc.load([off_m, off_k + k * BK]), b, acc)
    return acc


@triton.jit
def column_halves(acc, BM: tl.constexpr, BN: tl.constexpr):
    """The (BM, BN/2) left and right halves of `acc`. An fp32 epilogue written in halves needs half the shared
    memory (64 KB instead of 128 KB for a 128x256 tile), which is what lets it sit beside a 3-stage k-loop."""
    return tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))


@triton.jit
def store_tile(desc, tile, row, col, BM: tl.constexpr, BN: tl.constexpr):
    """Store a (BM, BN) tile through `desc`, whose block is (BM, BN/2), one half at a time."""
    left, right = column_halves(tile, BM, BN)
    desc.store([row, col], left)
    desc.store([row, col + BN // 2], right)


@triton.jit
def gemm_tile(a_desc, b_desc, M, N, K, tile, C):
    """(fp32 tile, pid_m, pid_n) for output tile `tile`, in grouped order, of a @ b; the fused ops' consumer.
    C: `Tiles` (or any named tuple with its fields), read in place so its entries stay constexprs."""
    pid_m, pid_n = tile_coords(tile, M, N, C.BM, C.BN, C.GROUP_M)
    return mainloop(a_desc, b_desc, pid_m * C.BM, pid_n * C.BN, K, C.BM, C.BN, C.BK, C.STAGES, 0, C.B_T), pid_m, pid_n


@triton.jit
def _matmul_kernel(a_desc, b_desc, c_desc, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   GROUP_M: tl.constexpr, STAGES: tl.constexpr, FLATTEN: tl.constexpr, B_T: tl.constexpr):
    for tile in tl.range(tl.program_id(0), tl.cdiv(M, BM) * tl.cdiv(N, BN), tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = tile_coords(tile, M, N, BM, BN, GROUP_M)
        acc = mainloop(a_desc, b_desc, pid_m * BM, pid_n * BN, K, BM, BN, BK, STAGES, 0, B_T)
        store_tile(c_desc, acc.to(c_desc.dtype), pid_m * BM, pid_n * BN, BM, BN)


def descriptor(t: torch.Tensor, block: list[int], view: tuple[list[int], list[int]] | None = None
               ) -> TensorDescriptor:
    """A TMA descriptor over the contiguous, 16-byte aligned 2-D tensor `t` in blocks of `block` (powers of two
    up to 256), made on the host (see the module's docstring). `view` = (shape, strides) reads `t` as another
    shape instead (attention reads (B, N, H, D) tensors as (B, H, N, D)). An empty `t` gets a descriptor over a
    small placeholder: TMA refuses empty tensors, and the kernels never read a tensor with no rows or columns.

    Built without `TensorDescriptor`'s own checks, which cost 3 µs per descriptor on the H200 machine's host
    (a small GEMM makes three or four per call): `check_operands` and `MatmulConfig.validate` have done them."""
    if t.numel() == 0:
        key = ("descriptor_placeholder", t.dtype)
        if key not in context().cache:  # one row of 16 bytes: the smallest tensor TMA takes
            context().cache[key] = torch.zeros(1, 16 // t.element_size(), dtype=t.dtype, device=t.device)
        t = context().cache[key]
    desc = object.__new__(TensorDescriptor)
    shape, strides = view if view is not None and t.numel() else (t.shape, t.stride())
    desc.base, desc.shape, desc.strides, desc.block_shape, desc.padding = t, shape, strides, block, "zero"
    return desc


def check_operands(op: str, a: torch.Tensor, b: torch.Tensor, k_dim_a: int = 1) -> None:
    """Refuse operands the GEMM cannot take, naming what is required."""
    device = context().device
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise PKError(f"{op}: {name} must be a 2-D torch.Tensor, got {getattr(t, 'shape', type(t).__name__)}")
        if t.device != device:
            raise PKError(f"{op}: {name} is on {t.device}, but this rank's device is {device}")
        if t.dtype not in DTYPES:
            raise PKError(f"{op}: {name} has dtype {t.dtype}; use bfloat16, float16 or float32")
        if t.data_ptr() % 16:
            raise PKError(f"{op}: {name} must start on a 16-byte boundary for TMA (a view with an odd offset?)")
    if a.dtype != b.dtype:
        raise PKError(f"{op}: a is {a.dtype} but b is {b.dtype}")
    if a.shape[k_dim_a] != b.shape[0]:
        raise PKError(f"{op}: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    per_16_bytes = 16 // a.element_size()
    if a.shape[1] % per_16_bytes or b.shape[1] % per_16_bytes:
        raise PKError(f"{op}: rows must be 16-byte aligned for TMA: a's and b's column counts must be multiples "
                      f"of {per_16_bytes} for {a.dtype} (a {tuple(a.shape)}, b {tuple(b.shape)})")


class MatmulPlan:
    """a @ b for one (M, K) @ (K, N) shape and dtype: the configuration and the bound kernel. With `b_t`, b is
    the transposed view of a contiguous (N, K) matrix (``weight.t()``), read in place."""

    def __init__(self, M: int, N: int, K: int, dtype: torch.dtype, config: MatmulConfig | None, b_t: bool = False,
                 op: str = "matmul"):
        ctx = context()
        self.M, self.N, self.K, self.dtype, self.device, self.b_t, self.op = M, N, K, dtype, ctx.device, b_t, op
        self.config = cfg = (config or matmul_config(M, N, K, dtype)).validate()
        self._launch = None
        if M * N == 0 or K == 0:
            return  # nothing to compute: the output is empty, or zeros
        tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
        grid = (min(num_sms(), tiles),)
        per_call = ("a_desc", "b_desc", "c_desc")
        if cfg.pingpong and pingpong.usable(ctx.device, dtype) and not b_t:  # ping-pong reads B as (K, N) only
            # 4 warps per consumer, and the register budget the three roles share (168 x 384 threads = the SM's 64K)
            made = pingpong.describers(dtype, cfg.block_m, cfg.block_n, cfg.block_k)
            describe = dict(zip(per_call, made, strict=True))
            self._launch = Launcher(pingpong._pingpong_kernel, grid, per_call, describe, M=M, N=N, K=K,
                                    GROUP_M=cfg.group_m, STAGES=cfg.num_stages, num_warps=4, maxnreg=168)
        else:
            self._launch = Launcher(_matmul_kernel, grid, per_call, gemm_describers(cfg, b_t), M=M, N=N, K=K,
                                    BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m,
                                    STAGES=cfg.num_stages, FLATTEN=cfg.flatten, B_T=b_t, num_warps=cfg.num_warps)

    def __call__(self, a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """a @ b into `out` (a new tensor by default)."""
        a, b = operands(self.op, a, b, (self.M, self.K), (self.K, self.N), self.dtype, self.device, self.b_t)
        c = new_output(self.op, out, (self.M, self.N), self.dtype, self.device)
        if self._launch is None:
            return c.zero_()
        self._launch(a, b, c)
        return c


def transposed(b: torch.Tensor) -> bool:
    """Whether `b` is the transposed view of a contiguous matrix, as ``weight.t()`` of an (out, in) weight is:
    the fused GEMMs read such a B in place (`b_descriptor`), with no copy."""
    return isinstance(b, torch.Tensor) and b.dim() == 2 and not b.is_contiguous() and b.t().is_contiguous()


def b_descriptor(b: torch.Tensor, b_t: bool, block_k: int, block_n: int) -> TensorDescriptor:
    """B's descriptor for `mainloop`: over B in (BK, BN) blocks, or with `b_t` over its transpose in (BN, BK)."""
    return descriptor(b.t(), [block_n, block_k]) if b_t else descriptor(b, [block_k, block_n])


def gemm_describers(cfg: MatmulConfig, b_t: bool, names: tuple[str, str, str] = ("a_desc", "b_desc", "c_desc")
                    ) -> dict[str, Callable[[torch.Tensor], TensorDescriptor]]:
    """How `mainloop`'s GEMMs describe A, B and the output per call, for `Launcher`'s `descriptors`: A in
    (BM, BK) blocks, B as `b_descriptor` does, the output in (BM, BN/2) halves (`store_tile`)."""
    return {names[0]: functools.partial(descriptor, block=[cfg.block_m, cfg.block_k]),
            names[1]: functools.partial(b_descriptor, b_t=b_t, block_k=cfg.block_k, block_n=cfg.block_n),
            names[2]: functools.partial(descriptor, block=[cfg.block_m, cfg.block_n // 2])}


def operands(op: str, a: torch.Tensor, b: torch.Tensor, a_shape: tuple[int, int], b_shape: tuple[int, int],
             dtype: torch.dtype, device: torch.device, b_t: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A plan's per-call check of its operands against the shapes it was built for (cheap: no host exchange);
    returns them contiguous, or b as a transposed view of a contiguous matrix for a plan built with `b_t`."""
    if a.shape != a_shape or b.shape != b_shape or a.dtype != dtype or b.dtype != dtype or a.device != device \
            or b.device != device:
        raise PKError(f"{op}: this plan was built for {dtype} operands of shapes {a_shape} and {b_shape} on "
                      f"{device}, got {a.dtype} {tuple(a.shape)} on {a.device} and {b.dtype} {tuple(b.shape)} on "
                      f"{b.device}")
    a = a.contiguous()
    b = (b if b.t().is_contiguous() else b.t().contiguous().t()) if b_t else b.contiguous()
    if a.data_ptr() % 16 or b.data_ptr() % 16:
        raise PKError(f"{op}: operands must start on a 16-byte boundary for TMA (a view with an odd offset?)")
    return a, b


def new_output(op: str, out: torch.Tensor | None, shape: tuple[int, int], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """`out`, checked, or a new tensor of `shape`."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if out.shape != shape or out.dtype != dtype or out.device != device or not out.is_contiguous() \
            or out.data_ptr() % 16:
        raise PKError(f"{op}: out must be a contiguous, 16-byte aligned {dtype} tensor of shape {shape} on {device}; "
                      f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def plan(a: torch.Tensor, b: torch.Tensor, config: MatmulConfig | None = None) -> MatmulPlan:
    """The plan for a @ b with operands like `a` and `b` (not collective)."""
    # b's strides tell a transposed view (read in place) from a contiguous matrix, more cheaply than `transposed`
    key = ("matmul", getattr(a, "shape", None), getattr(b, "shape", None), getattr(a, "dtype", None), config,
           b.stride() if isinstance(b, torch.Tensor) else None)
    found = plans.find(key)
    if found is not None:
        return found

    def check() -> str:
        check_operands("matmul", a, b)
        if config is not None:
            config.validate()
        return ""

    return plans.get(key, lambda: MatmulPlan(a.shape[0], b.shape[1], a.shape[1], a.dtype, config, transposed(b)), check,
                     collective=False)


def matmul(a: torch.Tensor, b: torch.Tensor, config: MatmulConfig | None = None, *,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b with the persistent descriptor GEMM: (M, K) @ (K, N) -> (M, N), fp32 accumulation. Not collective.
    `b` may be the transposed view of a contiguous (N, K) matrix (``x @ weight.t()``): it is read in place."""
    return plan(a, b, config)(a, b, out=out)


plans.attach(matmul, plan)

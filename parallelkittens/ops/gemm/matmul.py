"""The single-GPU core of the fused ops: a persistent GEMM on tensor descriptors (TMA loads, wgmma on Hopper).

One program per SM walks output tiles in grouped order (GROUP_M row tiles share a column of B in L2); each tile
runs the k-loop `mainloop` below, which the fused ops reuse inside their LCSC roles. Inputs (M, K) @ (K, N),
row-major, bf16, fp16 or fp32 (tf32 on the tensor cores), fp32 accumulation; M, N and K need not be multiples of
the tiles (descriptors clip the edges), but rows must be 16-byte aligned for TMA (K and N multiples of 8 in
16-bit types, of 4 in fp32).

The default tiles, 128x256x64 with 3 stages and 8 warps, are a plain persistent Triton GEMM's best at large
shapes; `matmul_config` picks others for small and skinny shapes (docs/performance.md has the numbers).

Tried and dropped: split-K (SPLITS programs per output tile, each a slice of the k-loop; the last to arrive added
the others' fp32 partials) lost to the plain k-loop at every benchmark shape, also with TMA reduce-adds.

The descriptors of local tensors are made on the host (`ops/descriptors.py`) and passed to the kernels as
parameters, as cuBLAS passes its TMA maps; a launch encodes each once per tensor address (`runtime/launch.py`).
Descriptors over peers' memory are made in the kernel, where the peer is known.
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
from ..descriptors import descriptor
from ..plan import Plan, check_comm_sms, check_same_dtype, check_tensor, declare, new_output, refuse
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
    BK_COPY: tl.constexpr = 64  # columns a communicator moves at a time (all_gather_matmul)


def tiles(cfg: MatmulConfig, b_t: bool = False, bk_copy: int = 64) -> Tiles:
    """A configuration's tiles as a kernel takes them."""
    return Tiles(cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.num_stages, b_t, bk_copy)


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
    """The plain GEMM's tiles, from sweeps against cuBLAS (scripts/tune_matmul.py; bench/results/tune_matmul-*):

    * 128x256 tiles in the flattened loop win or tie wherever they make more than half a wave;
    * where they would leave half the SMs idle, 128x128 with 5 stages and 4 warps; with more tiles 128x256 stays
      (at 2048^3, 128x128 tiles made two waves);
    * where even 64x64 tiles make at most one wave, 64x64x128 with 4 stages;
    * a k-loop of at most 4 steps, where the epilogue is much of the time, on Hopper in 16-bit: the ping-pong
      kernel, one consumer's epilogue under the other's MMAs. At K = 512 and above it only ties, and at 8192^3
      it loses."""
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


def check_operands(op: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """Refuse operands the GEMM cannot take, naming what is required."""
    for name, t in (("a", a), ("b", b)):
        check_tensor(op, name, t, DTYPES, 2)
        if t.data_ptr() % 16:
            raise PKError(f"{op}: {name} must start on a 16-byte boundary for TMA (a view with an odd offset?)")
    check_same_dtype(op, a=a, b=b)
    if a.shape[1] != b.shape[0]:
        raise PKError(f"{op}: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    per_16_bytes = 16 // a.element_size()
    if a.shape[1] % per_16_bytes or b.shape[1] % per_16_bytes:
        raise PKError(f"{op}: rows must be 16-byte aligned for TMA: a's and b's column counts must be multiples "
                      f"of {per_16_bytes} for {a.dtype} (a {tuple(a.shape)}, b {tuple(b.shape)})")


def transposed(b: torch.Tensor) -> bool:
    """Whether `b` is the transposed view of a contiguous matrix, as ``weight.t()`` of an (out, in) weight is:
    the GEMMs read such a B in place (`b_descriptor`), with no copy."""
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


class GemmPlan(Plan):
    """The base of the GEMM plans: operands a (M, K) and b (K, N) of one dtype, b possibly the transposed view of a
    contiguous matrix (`b_t`, read in place); `operands` checks a call's against them."""

    arity = 2

    @classmethod
    def check_gemm(cls, a: torch.Tensor, b: torch.Tensor, config: MatmulConfig | None) -> str:
        """Refuse operands or a configuration the GEMM cannot take; the call's description."""
        check_operands(cls.op, a, b)
        if config is not None:
            config.validate()
        return f"{cls.op} with {tuple(a.shape)}, {tuple(b.shape)}, {a.dtype}, {config}"

    def remember(self, **tensors: torch.Tensor) -> None:
        super().remember(**tensors)
        self._a_shape, self._b_shape = self.built["a"][0], self.built["b"][0]  # read at every call (`operands`)

    def operands(self, meetings: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A call's operands, checked against the plan's (cheap: no host exchange): contiguous, or b as a transposed
        view of a contiguous matrix for a plan built with `b_t`; else the call is refused (`refuse`)."""
        dtype = self.dtype
        if (a.shape != self._a_shape or b.shape != self._b_shape or a.dtype != dtype or b.dtype != dtype
                or a.device != self.device or b.device != self.device):
            refuse(meetings, PKError(self.mismatch({"a": a, "b": b})))
        a = a.contiguous()
        b = (b if b.t().is_contiguous() else b.t().contiguous().t()) if self.b_t else b.contiguous()
        if a.data_ptr() % 16 or b.data_ptr() % 16:
            refuse(meetings, PKError(f"{self.op}: operands must start on a 16-byte boundary for TMA (a view with an "
                                     "odd offset?)"))
        return a, b

    @staticmethod
    def fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a.new_empty(a.shape[0], b.shape[1])


class FusedPlan(GemmPlan):
    """The base of the fused GEMMs' plans: at one rank the plain GEMM's plan (`_alone`); else a call checks its
    operands and output and launches the bound kernel (`_launch`, None where there is nothing to compute)."""

    out_shape: tuple[int, int]
    _alone: MatmulPlan | None = None
    _launch: Launcher | None = None

    @classmethod
    def key(cls, a: torch.Tensor, b: torch.Tensor, num_comm_sms: int | None = None,
            config: MatmulConfig | None = None) -> tuple:
        return (getattr(a, "shape", None), getattr(b, "shape", None), getattr(a, "dtype", None), num_comm_sms, config,
                transposed(b))

    @classmethod
    def check(cls, a: torch.Tensor, b: torch.Tensor, num_comm_sms: int | None = None,
              config: MatmulConfig | None = None) -> str:
        check_comm_sms(cls.op, num_comm_sms)
        return f"{cls.check_gemm(a, b, config)}, num_comm_sms={num_comm_sms}"

    def values(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What a call passes the kernel for its per-call parameters."""
        return a, b, c

    def __call__(self, a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The op of a and b, into `out` (a new tensor by default)."""
        if self._alone is not None:
            return self._alone(a, b, out=out)
        meetings = int(self._launch is not None)
        a, b = self.operands(meetings, a, b)
        try:
            c = new_output(self.op, out, self.out_shape, self.dtype, aligned=True)
        except PKError as e:
            refuse(meetings, e)
        if self._launch is not None:
            self._launch(*self.values(a, b, c))
        return c


class MatmulPlan(GemmPlan):
    """a @ b for one (M, K) @ (K, N) shape and dtype: the configuration and the bound kernel. With `b_t`, b is
    the transposed view of a contiguous (N, K) matrix (``weight.t()``), read in place. The fused GEMMs at one
    rank are this plan, under their own name (`op`)."""

    op = "matmul"
    collective = False

    @classmethod
    def key(cls, a: torch.Tensor, b: torch.Tensor, config: MatmulConfig | None = None) -> tuple:
        # b's strides tell a transposed view (read in place) from a contiguous matrix, more cheaply than `transposed`
        return (getattr(a, "shape", None), getattr(b, "shape", None), getattr(a, "dtype", None), config,
                b.stride() if isinstance(b, torch.Tensor) else None)

    @classmethod
    def check(cls, a: torch.Tensor, b: torch.Tensor, config: MatmulConfig | None = None) -> str:
        return cls.check_gemm(a, b, config)

    def __init__(self, a: torch.Tensor, b: torch.Tensor, config: MatmulConfig | None = None, *, op: str = "matmul"):
        self.op = op
        (M, K), N, dtype = a.shape, b.shape[1], a.dtype
        self.M, self.N, self.K, self.dtype, self.b_t = M, N, K, dtype, transposed(b)
        self.remember(a=a, b=b)
        self.config = cfg = (config or matmul_config(M, N, K, dtype)).validate()
        self._launch = None
        if M * N == 0 or K == 0:
            return  # nothing to compute: the output is empty, or zeros
        grid = (min(num_sms(), cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)),)
        per_call = ("a_desc", "b_desc", "c_desc")
        if cfg.pingpong and pingpong.usable(self.device, dtype) and not self.b_t:  # ping-pong reads B as (K, N)
            # 4 warps per consumer, and the register budget the three roles share (168 x 384 threads = the SM's 64K)
            made = pingpong.describers(dtype, cfg.block_m, cfg.block_n, cfg.block_k)
            describe = dict(zip(per_call, made, strict=True))
            self._launch = Launcher(pingpong._pingpong_kernel, grid, per_call, describe, M=M, N=N, K=K,
                                    GROUP_M=cfg.group_m, STAGES=cfg.num_stages, num_warps=4, maxnreg=168)
        else:
            self._launch = Launcher(_matmul_kernel, grid, per_call, gemm_describers(cfg, self.b_t), M=M, N=N, K=K,
                                    BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m,
                                    STAGES=cfg.num_stages, FLATTEN=cfg.flatten, B_T=self.b_t, num_warps=cfg.num_warps)

    def __call__(self, a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """a @ b into `out` (a new tensor by default)."""
        a, b = self.operands(0, a, b)
        c = new_output(self.op, out, (self.M, self.N), self.dtype, aligned=True)
        if self._launch is None:
            return c.zero_()
        self._launch(a, b, c)
        return c


_matmul = declare(MatmulPlan, "(Tensor a, Tensor b) -> Tensor")


@_matmul.public
def matmul(a: torch.Tensor, b: torch.Tensor, config: MatmulConfig | None = None, *,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b with the persistent descriptor GEMM: (M, K) @ (K, N) -> (M, N), fp32 accumulation. Not collective.
    `b` may be the transposed view of a contiguous (N, K) matrix (``x @ weight.t()``): it is read in place."""
    return _matmul(a, b, config, out=out)

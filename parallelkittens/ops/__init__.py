"""Ops built on the primitives and the template, one module each, grouped by family: `collectives` (all_reduce,
all_gather, reduce_scatter, all_to_all, barrier), `gemm` (matmul and the fused GEMMs) and `attention` (the flash
kernel, ring and Ulysses attention) and `moe` (expert parallelism). Every op is a plan class and one declaration
(`ops/plan.py`: `Plan`, `declare`), its plan built once per call signature; ``pk.ops.<op>.plan(...)`` hands it
out. docs/plans.md shows how to write one."""

from .attention.attention import attention
from .attention.ring import ring_attention, shard_sequence, unshard_sequence
from .attention.ulysses import ulysses_attention
from .collectives.all_gather import all_gather
from .collectives.all_reduce import all_reduce
from .collectives.all_to_all import all_to_all
from .collectives.barrier import barrier
from .collectives.reduce_scatter import reduce_scatter
from .gemm.all_gather_matmul import all_gather_matmul
from .gemm.matmul import MatmulConfig, matmul
from .gemm.matmul_all_reduce import matmul_all_reduce
from .gemm.matmul_reduce_scatter import matmul_reduce_scatter
from .moe.api import moe_dispatch_gemm, moe_gemm_combine
from .moe.layout import MoeLayout, moe_layout
from .plan import Plan, check_tensor, declare

__all__ = ["MatmulConfig", "MoeLayout", "Plan", "all_gather", "all_gather_matmul", "all_reduce", "all_to_all",
           "attention", "barrier", "check_tensor", "declare", "matmul", "matmul_all_reduce", "matmul_reduce_scatter",
           "moe_dispatch_gemm", "moe_gemm_combine", "moe_layout", "reduce_scatter", "ring_attention", "shard_sequence",
           "ulysses_attention", "unshard_sequence"]

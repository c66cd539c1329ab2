"""Ops built on the primitives and the template, one module each."""

from .all_gather import all_gather
from .all_gather_matmul import all_gather_matmul
from .all_reduce import all_reduce
from .all_to_all import all_to_all
from .barrier import barrier
from .matmul import matmul
from .matmul_all_reduce import matmul_all_reduce
from .matmul_reduce_scatter import matmul_reduce_scatter
from .reduce_scatter import reduce_scatter

__all__ = ["all_gather", "all_gather_matmul", "all_reduce", "all_to_all", "barrier", "matmul", "matmul_all_reduce",
           "matmul_reduce_scatter", "reduce_scatter"]

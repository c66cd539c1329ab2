"""Ops built on the primitives and the template, one module each."""

from .all_gather import all_gather
from .all_reduce import all_reduce
from .all_to_all import all_to_all
from .barrier import barrier
from .reduce_scatter import reduce_scatter

__all__ = ["all_gather", "all_reduce", "all_to_all", "barrier", "reduce_scatter"]

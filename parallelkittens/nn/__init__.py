"""torch.nn layers on the ops: tensor-parallel linear layers (sequence-parallel style) and `parallelize`."""

from .linear import ColumnParallelLinear, RowParallelLinear, parallelize

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "parallelize"]

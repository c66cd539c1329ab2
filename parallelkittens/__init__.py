"""parallelkittens: overlapped multi-GPU kernels in Triton and PyTorch, after the ParallelKittens paper.

    import parallelkittens as pk
    ctx = pk.init()                       # or pk.spawn(fn, world_size) from a driver process
    x = pk.zeros((1024,), torch.float32)  # a parallel tensor: one buffer per rank, peers addressable
    pk.sync()

Layers, each using only those below it: `ops` (collectives, fused GEMMs) -> `template` (LCSC) -> `language`
(device primitives) -> `runtime` (ranks, backends, parallel tensors).

Importing the package sets nothing up, with one exception: on a machine without CUDA it sets
TRITON_INTERPRET=1 (if unset), since Triton's interpreter is the only way kernels can run there and it must
be chosen before any kernel is defined.
"""

import os as _os

import torch as _torch

if "TRITON_INTERPRET" not in _os.environ and not _torch.cuda.is_available():
    _os.environ["TRITON_INTERPRET"] = "1"

from . import (  # noqa: E402
    language,
    nn,
    ops,  # noqa: E402, I001
    template,
)
from .ops.collectives.barrier import barrier  # noqa: E402
from .runtime.context import Context, context, finalize, init, is_initialized  # noqa: E402
from .runtime.device import num_sms  # noqa: E402
from .runtime.errors import MismatchError, PKError, RankError, WaitTimeoutError  # noqa: E402
from .runtime.memory import ParallelTensor, empty, zeros  # noqa: E402
from .runtime.settings import Settings  # noqa: E402
from .runtime.spawn import spawn  # noqa: E402
from .runtime.sync import check_errors, sync  # noqa: E402

__all__ = [
    "Context", "MismatchError", "PKError", "ParallelTensor", "RankError", "Settings", "WaitTimeoutError", "barrier",
    "check_errors", "context", "empty", "finalize", "init", "is_initialized", "language", "nn", "num_sms", "ops",
    "spawn", "sync", "template", "zeros",
]
__version__ = "0.1.0"

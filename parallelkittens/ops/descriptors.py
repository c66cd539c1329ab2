"""Host TMA descriptors, and what the Gluon (warp-specialised Hopper) kernels of every family share.

A descriptor made on the host is passed to a kernel as cuBLAS passes its TMA maps; made in the kernel
(`tl.make_tensor_descriptor`), every program writes its maps to global memory and fences them before its first
load, a cost a small GEMM feels (docs/performance.md). `descriptor` and `gluon_descriptor` build them without the
classes' own checks (about 3 µs each on the host): the plans have checked the tensors.
"""

from __future__ import annotations

import functools

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ..runtime.context import context

try:  # Triton >= 3.5 ships Gluon with Hopper's warp-group MMA; without it the `tl` kernels run
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    GLUON = hasattr(gl, "warp_specialize") and hasattr(tma, "make_tensor_descriptor")
    # Triton 3.6 names the TMA copies async_copy_global_to_shared / _shared_to_global; 3.7+ async_load / _store
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
except ImportError:  # pragma: no cover - older Triton
    GLUON = False

GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def descriptor(t: torch.Tensor, block: list[int], view: tuple[list[int], list[int]] | None = None
               ) -> TensorDescriptor:
    """A TMA descriptor over the contiguous, 16-byte aligned tensor `t` in blocks of `block` (powers of two up to
    256). `view` = (shape, strides) reads `t` as another shape instead. An empty `t` gets a descriptor over a small
    placeholder: TMA refuses empty tensors, and the kernels never read a tensor with no rows or columns."""
    if t.numel() == 0:
        key = ("descriptor_placeholder", t.dtype)
        if key not in context().cache:  # one row of 16 bytes: the smallest tensor TMA takes
            context().cache[key] = torch.zeros(1, 16 // t.element_size(), dtype=t.dtype, device=t.device)
        t = context().cache[key]
    desc = object.__new__(TensorDescriptor)
    shape, strides = view if view is not None and t.numel() else (t.shape, t.stride())
    desc.base, desc.shape, desc.strides, desc.block_shape, desc.padding = t, shape, strides, block, "zero"
    return desc


def gluon_descriptor(t: torch.Tensor, block: list[int], layout, view: tuple[list[int], list[int]] | None = None
                     ) -> GluonDescriptor:
    """A Gluon TMA descriptor over `t` (or over `view` = (shape, strides) of it) with the shared-memory `layout`."""
    desc = object.__new__(GluonDescriptor)
    desc.base, (desc.shape, desc.strides) = t, view or (t.shape, t.stride())
    desc.block_shape, desc.layout, desc.padding = block, layout, "zero"
    return desc


@functools.cache
def shared_layout(dtype: torch.dtype, block: tuple[int, ...]):
    """The shared-memory layout (swizzle) Gluon's TMA gives a block of `dtype`."""
    return gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, GL_DTYPES[dtype]))


@functools.cache  # asked at every plan build: the driver query costs microseconds
def hopper_gluon(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Gluon kernels can run here: Gluon, a Hopper GPU, a 16-bit dtype."""
    return (GLUON and device.type == "cuda" and dtype in GL_DTYPES
            and torch.cuda.get_device_capability(device)[0] == 9)

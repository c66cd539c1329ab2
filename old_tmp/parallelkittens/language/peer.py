"""Peer-memory primitives: `load`, `store`, `store_add`, `reduce`, `all_reduce`, and tensor descriptors on a
peer's buffer for bulk (TMA) tiles.

Addresses are this rank's: a kernel computes pointers into its own buffer of a parallel tensor as on one GPU
(`x_ptr + offs`), and a primitive moves them to rank `peer`'s buffer using the handle `h` (the tensor's
`.handle`). Register-level paths (`load`, `store`, `store_add`, `reduce`, `all_reduce`) take any pointer
block and mask; the bulk path is `peer_descriptor(...)` followed by the descriptor's own
``.load`` / ``.store`` (the paper's ``store_async``) / ``.atomic_add`` (``store_add_async``).

No primitive orders memory by itself: follow writes with `signal` (or `barrier_all`) before a peer reads them.

In-network reduction (NVLink multicast, ``multimem.ld_reduce``) would replace the peer loop inside `reduce`
and `all_reduce`; it is never enabled on our machines, so it is not written.
"""

import triton
import triton.language as tl

# layout of ParallelTensor.handle (runtime.memory)
_RANK, _WORLD, _BASES = tl.constexpr(0), tl.constexpr(1), tl.constexpr(4)


@triton.jit
def rank(h):
    """This rank's index among the node's ranks, from a parallel tensor's handle."""
    return tl.load(h + _RANK).to(tl.int32)


@triton.jit
def world_size(h):
    """Number of ranks on the node, from a parallel tensor's handle."""
    return tl.load(h + _WORLD).to(tl.int32)


@triton.jit
def translate(ptr, h, peer):
    """The pointer(s) into rank `peer`'s buffer at the offsets `ptr` has in this rank's buffer."""
    delta_bytes = tl.load(h + _BASES + peer) - tl.load(h + _BASES + tl.load(h + _RANK))
    # In elements, and declared a multiple of 16 (bases are 128-byte aligned), so that Triton keeps the
    # accesses vectorised: a byte offset through an int8 pointer loses that knowledge.
    delta = delta_bytes // (ptr.dtype.element_ty.primitive_bitwidth // 8)
    return ptr + tl.multiple_of(delta, 16)


@triton.jit
def load(ptr, h, peer, mask=None, other=None):
    """Read a tile from rank `peer`'s buffer (register path)."""
    return tl.load(translate(ptr, h, peer), mask=mask, other=other)


@triton.jit
def store(ptr, value, h, peer, mask=None):
    """Write `value` into rank `peer`'s buffer (register path)."""
    tl.store(translate(ptr, h, peer), value, mask=mask)


@triton.jit
def store_add(ptr, value, h, peer, mask=None):
    """Atomically add `value` into rank `peer`'s buffer, element by element (relaxed, system scope)."""
    tl.atomic_add(translate(ptr, h, peer), value, mask=mask, sem="relaxed", scope="sys")


@triton.jit
def _sum_over_ranks(ptr, h, mask):
    acc = load(ptr, h, 0, mask, 0).to(tl.float32)
    for r in range(1, world_size(h)):
        acc += load(ptr, h, r, mask, 0).to(tl.float32)
    return acc


@triton.jit
def reduce(dst_ptr, src_ptr, h, mask=None):
    """Sum the tile at `src_ptr` over every rank's buffer (in rank order, in fp32) and write it to `dst_ptr`,
    a local tensor. Every rank's tile must be final (signalled) before the call."""
    acc = _sum_over_ranks(src_ptr, h, mask)
    tl.store(dst_ptr, acc.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def all_reduce(ptr, h, mask=None):
    """Replace the tile at `ptr` on every rank by its sum over ranks (fp32 accumulation, rank order).

    Exactly one rank may run it for a given tile, after every rank's tile is final (the paper splits tiles
    among ranks); peers see the result after a `signal` or `barrier_all`.
    """
    acc = _sum_over_ranks(ptr, h, mask).to(ptr.dtype.element_ty)
    for r in range(world_size(h)):
        store(ptr, acc, h, r, mask)


@triton.jit
def peer_descriptor(ptr, h, peer, shape, strides, block_shape: tl.constexpr):
    """A tensor descriptor (TMA on Hopper) over rank `peer`'s buffer, laid out like the local one at `ptr`.

    ``desc.store(coord, tile)`` is the paper's ``store_async``, ``desc.atomic_add(coord, tile)`` its
    ``store_add_async``, ``desc.load(coord)`` a bulk peer read. The base must be 16-byte aligned and every
    stride but the last a multiple of 16 bytes.
    """
    return tl.make_tensor_descriptor(translate(ptr, h, peer), shape, strides, block_shape)

"""The symmetric heap: one allocator per context over parallel tensors, from which every op takes its workspace.

Two kinds of memory:

* **Blocks** (`Heap.allocate`): small, zeroed, kept for the context's life: counters, flags, signature slots.
  They are carved one after another out of 1 MiB segments; a block never moves.
* **Pools** (`Heap.pool`): large buffers that many calls share in turn (staging copies, gathered operands,
  accumulators), one per purpose, as large as the largest call that asked. When a call needs more, the pool
  gets a new, larger segment; the old one is kept until the context ends, so a plan built on it, or a CUDA graph
  captured with it, stays valid. Growing in powers of two keeps what is kept under the final size.

Every rank must allocate the same blocks and pools in the same order: plans are built collectively, after the
ranks agreed on the call, which guarantees it. Block segments are zeroed when made and a block is never handed
out twice, so a block starts at zero on every rank before any peer can write into it. A pool made with `zero`
starts zeroed and its users leave it so; other pools hold whatever their last user left.
"""

from __future__ import annotations

import math

import torch

from .context import Context, context
from .memory import ParallelTensor, empty, zeros

SEGMENT_BYTES = 1 << 20
ALIGN = 128  # bytes: keeps tensor descriptors (16 B) and wide vector accesses aligned


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to the heap's alignment (what `Block.split` gives each part)."""
    return -(-nbytes // ALIGN) * ALIGN


class Block:
    """Bytes of the symmetric heap at the same offset on every rank: `view` shapes them, `handle` is what kernels
    take with pointers into them (the handle of the segment they lie in)."""

    def __init__(self, segment: ParallelTensor, offset: int, nbytes: int):
        self.segment = segment
        self.offset = offset
        self.nbytes = nbytes
        self.zeroed = True

    @property
    def handle(self) -> torch.Tensor:
        """The segment's handle: rank, world size and every rank's base address."""
        return self.segment.handle

    def view(self, shape: tuple[int, ...] | int, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        """This rank's bytes from `offset` (a multiple of the dtype's size), viewed as a tensor of `shape`."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if offset + nbytes > self.nbytes:
            raise ValueError(f"a view of {nbytes} bytes at {offset} does not fit in a block of {self.nbytes}")
        start = self.offset + offset
        return self.segment.local[start:start + nbytes].view(dtype).view(shape)

    def split(self, *sizes: int) -> list[Block]:
        """Consecutive sub-blocks of `sizes` bytes (each rounded up to 128), in order."""
        parts, offset = [], self.offset
        for size in sizes:
            parts.append(Block(self.segment, offset, aligned(size)))
            offset += aligned(size)
        if offset > self.offset + self.nbytes:
            raise ValueError(f"sub-blocks of {list(sizes)} bytes do not fit in a block of {self.nbytes}")
        return parts


class Heap:
    """This context's symmetric memory (see the module's docstring); get it with `heap()`."""

    def __init__(self, ctx: Context):
        self._ctx = ctx
        self._segments: list[ParallelTensor] = []  # every segment made, freed when the context ends
        self._small: ParallelTensor | None = None
        self._used = 0
        self._pools: dict[str, Block] = {}
        self._named: list[tuple[str, Block]] = []  # for error messages: which block an address falls in
        self._labels: dict[str, list[str]] = {}  # for error messages: what a block's counters count

    def allocate(self, nbytes: int, name: str) -> Block:
        """A zeroed block of at least `nbytes`, kept for the context's life. Collective (same order everywhere)."""
        nbytes = aligned(max(nbytes, 1))
        self._ctx.stats["heap_blocks"] += 1
        if self._small is None or self._used + nbytes > self._small.local.numel():
            self._small = self._segment(max(SEGMENT_BYTES, nbytes), f"heap.blocks{len(self._segments)}")
            self._used = 0
        block = Block(self._small, self._used, nbytes)
        self._used += nbytes
        self._named.append((name, block))
        return block

    def pool(self, name: str, nbytes: int, zero: bool = False) -> Block:
        """Pool `name`'s buffer, at least `nbytes` long: shared by every call that asks for this pool, so callers
        must not use it at the same time. With `zero`, the buffer starts zeroed, and its users must leave it so.
        Collective when it grows (same order everywhere)."""
        block = self._pools.get(name)
        if block is not None and block.zeroed != zero:
            raise ValueError(f"pool {name!r} was made {'zeroed' if block.zeroed else 'unzeroed'}; asked for {zero}")
        if block is None or block.nbytes < nbytes:
            size = 1 << math.ceil(math.log2(max(nbytes, SEGMENT_BYTES)))
            self._ctx.stats["heap_pools"] += 1
            segment = self._segment(size, f"heap.{name}", zero)
            block = self._pools[name] = Block(segment, 0, size)
            block.zeroed = zero
            self._named.append((name, block))
        return block

    def describe(self, address: int) -> str | None:
        """Name the heap int32 counter at `address`, e.g. ``meeting[2] of rank 1`` (None outside the heap)."""
        for name, block in reversed(self._named):
            for rank, base in enumerate(block.segment._bases if block.segment._peers is not None else []):
                start = base + block.offset
                if start <= address < start + block.nbytes:
                    index = (address - start) // 4
                    labels = self._labels.get(name, [])
                    what = f" ({labels[index]})" if index < len(labels) else ""
                    return f"{name}[{index}]{what} of rank {rank}"
        return None

    def label(self, name: str, labels: list[str]) -> None:
        """Say what the int32 counters of the blocks called `name` count, for `describe`."""
        self._labels[name] = labels

    def _segment(self, nbytes: int, name: str, zero: bool = True) -> ParallelTensor:
        segment = (zeros if zero else empty)(nbytes, torch.uint8, name=name)
        self._segments.append(segment)
        return segment

    def release(self) -> None:
        """Forget every segment (the context is ending; the parallel tensors are freed with it)."""
        self._segments.clear()
        self._pools.clear()
        self._named.clear()
        self._small = None


def heap() -> Heap:
    """This context's symmetric heap, made on first use."""
    ctx = context()
    made = ctx.cache.get("heap")
    if made is None:
        made = ctx.cache["heap"] = Heap(ctx)
        ctx.on_finalize(made.release)
    return made

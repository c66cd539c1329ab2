"""Each rank pushes its vector into the next rank's buffer and signals it; each waits for its own flag.

    python examples/ring_push.py            # 4 ranks with pk.spawn
    torchrun --nproc_per_node 2 examples/ring_push.py --torchrun
"""

import sys

import torch
import triton
import triton.language as tl

import parallelkittens as pk
import parallelkittens.language as pkl


@triton.jit
def ring_push_kernel(src_ptr, inbox_ptr, h, flags_ptr, hf, n, BLOCK: tl.constexpr):
    tile = tl.program_id(0)
    offs = tile * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    nxt = (pkl.rank(h) + 1) % pkl.world_size(h)
    pkl.store(inbox_ptr + offs, tl.load(src_ptr + offs, mask=mask), h, nxt, mask)  # into the next rank's inbox
    pkl.signal(flags_ptr + tile, hf, nxt)  # release at system scope: the data lands before the flag
    pkl.wait(flags_ptr + tile, 1, hf)  # my own tile from the previous rank has arrived
    tl.store(flags_ptr + tile, 0)  # ready for the next round (after a barrier)


def main() -> float:
    ctx = pk.init()
    n, block = 10_000, 1024
    inbox = pk.empty(n, torch.float32, name="inbox")
    flags = pk.zeros(triton.cdiv(n, block), torch.int32, name="flags")
    src = torch.full((n,), float(ctx.rank + 1), device=ctx.device)
    ring_push_kernel[(triton.cdiv(n, block),)](src, inbox.local, inbox.handle, flags.local, flags.handle, n,
                                               BLOCK=block)
    pk.barrier()
    pk.sync()
    expected = float((ctx.rank - 1) % ctx.world_size + 1)
    assert torch.all(inbox.local == expected), f"rank {ctx.rank}: inbox holds {inbox.local[:4]}"
    inbox.free()
    flags.free()
    return expected


if __name__ == "__main__":
    if "--torchrun" in sys.argv:
        print(main())
    else:
        print(pk.spawn(main, 4))

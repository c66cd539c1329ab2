"""Run by tests/test_faults.py under torchrun: rank 1 raises its own error while ranks 0 and 2 wait for it in an
all_reduce and then fail as a consequence (a peer gone, or the timeout). torchrun's report must name rank 1's
error as the root cause."""

import torch

import parallelkittens as pk


def main() -> None:
    ctx = pk.init()
    pk.ops.all_reduce(torch.ones(8, device=ctx.device))  # everyone is up
    if ctx.rank == 1:
        raise ValueError("rank 1's own mistake")
    pk.ops.all_reduce(torch.ones(8, device=ctx.device))  # rank 1 never comes
    pk.sync()


if __name__ == "__main__":
    main()

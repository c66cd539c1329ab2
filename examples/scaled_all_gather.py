import torch
import triton
import triton.language as tl

import parallelkittens as pk
from parallelkittens import language as pkl
from parallelkittens.ops import Plan, check_tensor, declare
from parallelkittens.runtime.launch import Launcher
from parallelkittens.template import meeting

BLOCK = 256


@triton.jit
def _scaled_all_gather_kernel(x_ptr, out_ptr, inbox_ptr, inbox_h, rounds_ptr, rounds_h, n, scale, meet):
    call = meeting.begin(meet)  # every op's kernel opens with the meeting: the ranks agree on the call
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(inbox_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)  # where peers read this rank's x
    if meeting.verdict(call):
        pkl.barrier_all(rounds_ptr + tl.program_id(0), rounds_h)  # every rank's x is in its inbox
        for r in range(call.world):
            x = pkl.load(inbox_ptr + offs, inbox_h, r, mask)
            tl.store(out_ptr + r * n + offs, (x.to(tl.float32) * scale).to(x.dtype), mask=mask)
        pkl.barrier_all(rounds_ptr + tl.program_id(0), rounds_h)  # nobody reads my inbox any more
    meeting.end(call)


class ScaledAllGather(Plan):
    op = "scaled_all_gather"
    differentiable = 1  # the output has a gradient: `backward` below

    @classmethod
    def check(cls, x: torch.Tensor, scale: float) -> str:
        check_tensor(cls.op, "x", x, (torch.float32, torch.bfloat16), 1, contiguous=True)
        return f"{cls.op} of {tuple(x.shape)} {x.dtype}, scale {scale}"

    def __init__(self, x: torch.Tensor, scale: float):
        self.remember(x=x)
        programs = triton.cdiv(x.numel(), BLOCK)
        self.inbox, self.rounds = pk.empty(x.shape, x.dtype), pk.zeros(programs, torch.int32)
        self.launch = Launcher(_scaled_all_gather_kernel, (programs,), ("x_ptr", "out_ptr"), inbox_ptr=self.inbox.local,
                               inbox_h=self.inbox.handle, rounds_ptr=self.rounds.local, rounds_h=self.rounds.handle,
                               n=x.numel(), scale=scale, meet=self.meet(x.shape, x.dtype, scale))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.expect(1, x=x)  # the shape, dtype and device the plan was built for, else refused on every rank
        out = x.new_empty(self.inbox.world_size * x.numel())
        self.launch(x, out)
        return out

    fake = staticmethod(lambda x, scale: x.new_empty(pk.context().local_world_size * x.numel()))  # under tracing

    def backward(self, grads, saved, needs, x, scale):
        return (pk.ops.reduce_scatter(grads[0].contiguous()) * scale,)


scaled_all_gather = declare(ScaledAllGather, "(Tensor x, float scale) -> Tensor")

"""The layout of one routing: where every (token, k) pair goes, and where every row of this rank's experts came from.

Every rank gathers every rank's top-k ids (one small all_gather) and derives, with the same device operations
on the same data, the same global order: the rows of an expert are its (source rank, token, k) pairs in that
order. From it this rank keeps

* as a **source**: which of its (token, k) pairs were kept (`kept`, (T, k)) or dropped over capacity;
* as a **destination**: the tokens it pulls, one per (token, this rank) however many of the token's k experts it
  holds (`pull_src`, `pull_tok`, in (source, token) order), and for each row of its experts the received row it
  reads (`row_recv`), its source rank (`row_src`), its slot (token * k + j) there (`row_slot`) and its global
  pair index (`row_pair`); row tiles that never straddle two experts (`tile_expert`, `tile_start`, `tile_end`).

**Dropless** (default): rows per expert are exact. Two host round trips per layout: the ranks' token counts
(through the store), then one device synchronisation that brings this rank's row counts, the number of tokens it
pulls and every rank's id check to the host. The tile height is chosen from what every rank sees (all pairs over
all experts), so that every rank builds the same plans. **Static capacity** (`capacity=C`):
expert e's rows are e·C … e·C + min(count, C); pairs past C in the global order are dropped and counted
(`overflow` per local expert, `dropped` per pair of this rank); every size is fixed by (T, k, E, C), nothing
waits for the host, and the whole layout can be captured in a CUDA graph. Ids outside [0, E) are an error in
dropless mode; in capacity mode (no synchronisation to check them) they are dropped and counted in `dropped`.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from ...runtime.context import context, exchange
from ...runtime.errors import PKError
from ...runtime.sizes import cdiv
from .. import plan as plans
from ..collectives.all_gather import all_gather

_IDS = itertools.count(1)


def layouts() -> weakref.WeakValueDictionary:
    """This context's live layouts by id (the custom ops name a layout by its id)."""
    return context().cache.setdefault("moe.layouts", weakref.WeakValueDictionary())


class MoeLayout:
    """One routing's layout (see the module's docstring). Built by `moe_layout`; reused by both ops and their
    backward. Sizes that are host integers: `tokens`, `max_tokens`, `rows` (this rank's expert rows; in capacity
    mode experts_per_rank * capacity), `max_pulled` (received rows), `num_row_tiles`."""

    def __init__(self, **fields):
        self.__dict__.update(fields)
        self.id = next(_IDS)
        layouts()[self.id] = self

    @property
    def buffer_tokens(self) -> int:
        """Tokens the ops' buffers hold: `max_tokens` rounded up (to 256 on a GPU), so that a job whose largest
        token count moves a little reuses its plans and heap buffers instead of making new ones."""
        step = 256 if self.kept.is_cuda else 1
        return -(-self.max_tokens // step) * step

    def expert_rows(self) -> list[tuple[int, int]]:
        """Each local expert's (start, end) rows; in capacity mode the whole C rows reserved for it (rows past its
        count are zero in the activations)."""
        if self.capacity is None:
            return list(itertools.pairwise(self.expert_offsets))
        return [(e * self.capacity, (e + 1) * self.capacity) for e in range(self.experts_per_rank)]

    def __repr__(self) -> str:
        mode = "dropless" if self.capacity is None else f"capacity={self.capacity}"
        return (f"MoeLayout(tokens={self.tokens}, top_k={self.top_k}, experts={self.num_experts}, {mode}, "
                f"rows={self.rows}, pulled<={self.max_pulled})")


def reference_routing(ids: list[torch.Tensor], num_experts: int, capacity: int | None) -> list[torch.Tensor]:
    """Which (token, k) pairs each rank keeps, in plain PyTorch: an expert takes its pairs in (rank, token, k)
    order, up to `capacity`."""
    seen = [0] * num_experts
    kept = []
    for rank_ids in ids:
        keep = torch.zeros(rank_ids.shape, dtype=torch.bool)
        for t, j in itertools.product(range(rank_ids.shape[0]), range(rank_ids.shape[1])):
            e = int(rank_ids[t, j])
            if 0 <= e < num_experts and (capacity is None or seen[e] < capacity):
                keep[t, j] = True
            if 0 <= e < num_experts:
                seen[e] += 1
        kept.append(keep)
    return kept


def block_rows(rows_per_expert: float) -> int:
    """Rows per tile of the grouped GEMM: 128 on a GPU when experts are busy, else 64; 16 under the interpreter."""
    if context().device.type != "cuda":
        return 16
    return 128 if rows_per_expert >= 256 else 64


class LayoutPlan:
    """moe_layout for one (top_k, num_experts, capacity[, tokens]): sizes and, in capacity mode, the tile table."""

    op = "moe_layout"

    def __init__(self, top_k: int, num_experts: int, capacity: int | None, tokens: int | None):
        ctx = context()
        self.world, self.me, self.device = ctx.local_world_size, ctx.local_rank, ctx.device
        self.top_k, self.num_experts, self.capacity = top_k, num_experts, capacity
        self.epr = num_experts // self.world
        if capacity is not None:
            self.block = block_rows(capacity)
            per = cdiv(capacity, self.block)
            tiles = torch.arange(self.epr * per, device=self.device)
            self.tile_expert = (tiles // per).int()
            self.tile_start = (self.tile_expert * capacity + (tiles % per) * self.block).int()
            self.tokens = tokens

    def __call__(self, topk_ids: torch.Tensor) -> MoeLayout:
        W, me, E, k, epr, cap = self.world, self.me, self.num_experts, self.top_k, self.epr, self.capacity
        T = topk_ids.shape[0]
        if cap is None:
            counts = exchange("moe_layout: token counts", T) if W > 1 else [T]
        else:
            counts = [self.tokens] * W
        t_max = max(counts)
        padded = topk_ids.new_full((t_max, k), -1, dtype=torch.int32)
        padded[:T] = topk_ids
        every = all_gather(padded, 0) if W > 1 else padded  # (W * Tmax, k)
        pairs = every.reshape(-1).long()
        n = pairs.numel()
        token_of_pair = torch.arange(n, device=self.device) // k  # s * Tmax + t
        if cap is None and n:  # pairs of padding rows (past a rank's own count) are not real
            limit = torch.tensor(counts, device=self.device).repeat_interleave(t_max)
            real = (token_of_pair % t_max) < limit[token_of_pair]
        else:  # capacity mode: every rank has the same count, no padding (and no host-made tensor to capture)
            real = torch.ones(n, dtype=torch.bool, device=self.device)
        valid = real & (pairs >= 0) & (pairs < E)
        key = torch.where(valid, pairs, E)
        order = torch.argsort(key, stable=True)
        # counts by scatter_add, not bincount (which synchronises with the host on a GPU to size its output)
        per_expert = torch.zeros(E + 1, dtype=torch.long, device=self.device).scatter_add_(0, key, torch.ones_like(key))
        starts = torch.cumsum(per_expert, 0) - per_expert
        rank_in_expert = torch.empty_like(pairs)
        rank_in_expert[order] = torch.arange(n, device=self.device) - starts[key[order]]
        kept = valid if cap is None else valid & (rank_in_expert < cap)
        local = per_expert[me * epr:(me + 1) * epr]
        mine_pairs = kept & (pairs // epr == me)
        # as a destination: the tokens to pull, one per (token, this rank), sources in the order me, me+1, ...
        # (so that the ranks do not all read rank 0 first), tokens in order; each token's received row
        token_mine = mine_pairs.view(-1, k).any(1)
        rotated = token_mine.view(W, t_max).roll(-me, 0).flatten()
        pulled = rotated.sum().int().view(1)
        if cap is None:
            bad = real & ~valid
            facts = torch.cat([local, pulled.long(), valid.sum().view(1), bad.view(W, t_max * k).any(1).long()])
            facts = facts.tolist()  # with the token counts' exchange, the host round trips of dropless mode
            for r in range(W):
                if facts[epr + 2 + r]:
                    raise PKError(f"moe_layout: rank {r}'s topk_ids hold ids outside [0, {E}) (the experts)")
            local_counts, max_pulled = facts[:epr], facts[epr]
            block = block_rows(facts[epr + 1] / E)  # from what every rank sees: the same tile height everywhere
            offsets = [0, *itertools.accumulate(local_counts)]
            rows = offsets[-1]
            row = torch.tensor(offsets[:-1], device=self.device)[(pairs - me * epr).clamp(0, epr - 1)] + \
                rank_in_expert
            tiles = [(e, s, min(s + block, offsets[e + 1]))
                     for e in range(epr) for s in range(offsets[e], offsets[e + 1], block)]
            table = torch.tensor(list(zip(*tiles, strict=True)) or [[0], [0], [0]], dtype=torch.int32,
                                 device=self.device)
            tile_expert, tile_start, tile_end = table[0], table[1], table[2]
            num_row_tiles = len(tiles)
            overflow = torch.zeros(epr, dtype=torch.int32, device=self.device)
        else:
            block = self.block
            rows = epr * cap
            max_pulled = min(W * t_max, rows)
            row = (pairs - me * epr) * cap + rank_in_expert
            tile_expert, tile_start = self.tile_expert, self.tile_start
            tile_end = tile_expert * cap + local.clamp(max=cap).int()[tile_expert.long()]
            num_row_tiles = tile_expert.numel()
            overflow = (local - cap).clamp(min=0).int()
            offsets = None
        if W == 1:  # nothing to pull: a pair reads its token's row of x directly
            pull_order = torch.zeros(0, dtype=torch.long, device=self.device)
            received = torch.arange(t_max, device=self.device)
            max_pulled = 0
        else:
            pull_order = torch.argsort((~rotated).to(torch.int8), stable=True)[:max_pulled]
            received = (torch.cumsum(rotated, 0) - 1).view(W, t_max).roll(me, 0).flatten()
        received = torch.cat([received, received.new_zeros(1)])  # rows of no pair read entry 0
        row = torch.where(mine_pairs, row, rows)  # pairs not mine write a row past the end, dropped below
        pair_ids = torch.arange(n, device=self.device)
        row_pair = torch.zeros(rows + 1, dtype=torch.long, device=self.device).index_put_((row,), pair_ids)
        row_pair = row_pair[:rows]
        mine_rows = torch.zeros(rows + 1, dtype=torch.bool, device=self.device).index_put_((row,), mine_pairs)[:rows]
        row_pair = torch.where(mine_rows, row_pair, 0)
        row_recv = torch.where(mine_rows, received[row_pair // k], 0)
        if W > 1 and num_row_tiles > 1:
            # tiles in the order their last row lands (sources are pulled me, me+1, ...): the compute programs
            # start on tiles whose tokens are in while the rest is still being pulled
            if cap is not None:  # capacity: expert e's tiles start at e·C
                per = cdiv(cap, block)
                at = torch.arange(rows, device=self.device)
                row_tile = (at // cap) * per + (at % cap) // block
            else:  # dropless: tiles are the ranges in the table, in order
                row_tile = torch.searchsorted(tile_start[:num_row_tiles].contiguous(),
                                              torch.arange(rows, device=self.device, dtype=torch.int32), right=True) - 1
            last = torch.full((num_row_tiles,), -1, dtype=torch.long, device=self.device).scatter_reduce_(
                0, row_tile, torch.where(mine_rows, row_recv, -1), "amax")
            order = torch.argsort(last, stable=True)
            tile_expert, tile_start, tile_end = tile_expert[order], tile_start[order], tile_end[order]
        kept_mine = kept.view(W, t_max, k)[me, :T]
        return MoeLayout(
            num_experts=E, experts_per_rank=epr, top_k=k, world=W, tokens=T, max_tokens=t_max, token_counts=counts,
            capacity=cap, block_rows=block, kept=kept_mine, dropped=~kept_mine, overflow=overflow,
            pull_src=((pull_order // t_max + me) % W).int(), pull_tok=(pull_order % t_max).int(),
            pulled=pulled, max_pulled=max_pulled,
            row_recv=row_recv.int(), row_src=(row_pair // (t_max * k)).int(),
            row_slot=(row_pair % (t_max * k)).int(), row_pair=row_pair, row_valid=mine_rows, rows=rows,
            expert_offsets=offsets, tile_expert=tile_expert, tile_start=tile_start, tile_end=tile_end,
            num_row_tiles=num_row_tiles)


def plan(topk_ids: torch.Tensor, num_experts: int, *, capacity: int | None = None) -> LayoutPlan:
    """The plan for layouts of routings like `topk_ids` (collective the first time: see `ops/plan.py`)."""
    op = "moe_layout"
    shape = getattr(topk_ids, "shape", None)
    k = shape[1] if shape is not None and len(shape) == 2 else None
    tokens = shape[0] if capacity is not None and k is not None else None
    key = (op, k, num_experts, capacity, tokens)
    found = plans.find(key)
    if found is not None:
        return found

    def check() -> str:
        ctx = context()
        if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
            raise PKError(f"{op}: topk_ids must be a (tokens, k) tensor, got {shape}")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise PKError(f"{op}: topk_ids must be int32 or int64, got {topk_ids.dtype}")
        if topk_ids.device != ctx.device:
            raise PKError(f"{op}: topk_ids are on {topk_ids.device}, but this rank's device is {ctx.device}")
        if not isinstance(num_experts, int) or num_experts <= 0 or num_experts % ctx.local_world_size:
            raise PKError(f"{op}: {num_experts} experts do not split evenly among {ctx.local_world_size} ranks")
        if capacity is not None and (not isinstance(capacity, int) or capacity <= 0):
            raise PKError(f"{op}: capacity must be a positive number of rows per expert, got {capacity}")
        tail = "" if capacity is None else f", capacity={capacity}, tokens={tokens} (the same on every rank)"
        return f"{op} with top-{k} of {num_experts} experts{tail}"

    return plans.get(key, lambda: LayoutPlan(k, num_experts, capacity, tokens), check)


def moe_layout(topk_ids: torch.Tensor, num_experts: int, *, capacity: int | None = None) -> MoeLayout:
    """The layout of a routing: `topk_ids` (T, k), this rank's tokens' experts among `num_experts` (split evenly,
    E/W per rank). Dropless by default (one host synchronisation); `capacity` rows per expert for a static,
    synchronisation-free layout that drops and counts what does not fit. Collective."""
    return plan(topk_ids, num_experts, capacity=capacity)(topk_ids)


plans.attach(moe_layout, plan)

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

import dataclasses
import itertools
import weakref

import torch

from ...runtime.context import context, exchange
from ...runtime.errors import PKError
from ...runtime.sizes import cdiv
from ..collectives.all_gather import all_gather
from ..plan import Plan, check_tensor, declare

_IDS = itertools.count(1)


def layouts() -> weakref.WeakValueDictionary:
    """This context's live layouts by id (the custom ops name a layout by its id)."""
    return context().cache.setdefault("moe.layouts", weakref.WeakValueDictionary())


def layout_by_id(layout_id: int) -> MoeLayout:
    """The live layout of id `layout_id` (a custom op's argument), or a clear error."""
    layout = layouts().get(layout_id)
    if layout is None:
        raise PKError(f"moe: layout {layout_id} no longer exists (keep the layout until the backward has run)")
    return layout


@dataclasses.dataclass(eq=False)
class MoeLayout:
    """One routing's layout (see the module's docstring). Built by `moe_layout`; reused by both ops and their
    backward. Tensors are on the rank's device; the rest are host values."""

    num_experts: int
    experts_per_rank: int
    top_k: int
    world: int
    tokens: int  # this rank's
    max_tokens: int  # the most any rank has
    token_counts: list[int]  # every rank's
    capacity: int | None  # rows per expert; None: dropless
    block_rows: int  # rows per tile of the grouped GEMM, the same on every rank
    kept: torch.Tensor  # (T, k) bool: this rank's pairs that have a row
    dropped: torch.Tensor  # (T, k) bool: the others (over capacity, or an id outside [0, E) in capacity mode)
    overflow: torch.Tensor  # (experts per rank,) int32: pairs each local expert dropped
    pull_src: torch.Tensor  # per received row: its source rank (int32)
    pull_tok: torch.Tensor  # per received row: its token there (int32)
    pulled: torch.Tensor  # (1,) int32: how many rows arrive
    max_pulled: int  # at most that many
    row_recv: torch.Tensor  # per expert row: the received row it reads (int32)
    row_src: torch.Tensor  # per expert row: its source rank (int32)
    row_slot: torch.Tensor  # per expert row: its slot (token * k + j) on the source rank (int32)
    row_pair: torch.Tensor  # per expert row: its global pair index (int64)
    row_valid: torch.Tensor  # per expert row: whether a pair fills it (bool)
    rows: int  # this rank's expert rows (experts per rank x capacity in capacity mode)
    expert_offsets: list[int] | None  # dropless: each local expert's first row, and the end
    tile_expert: torch.Tensor  # per row tile: its expert, first row and end row (int32)
    tile_start: torch.Tensor
    tile_end: torch.Tensor
    num_row_tiles: int
    id: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
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


def rows_of(source: torch.Tensor, layout: MoeLayout) -> torch.Tensor:
    """Each expert row's token row, from the received tokens (or x at one rank); zero for rows of no pair (a
    select, not a product: those rows may read received rows never written, which may hold inf or NaN)."""
    if source.shape[0] == 0:  # nothing was pulled (no tokens anywhere): every row is a row of no pair
        return source.new_zeros(layout.rows, source.shape[1])
    return torch.where(layout.row_valid[:, None], source[layout.row_recv.long()], 0)


def per_expert(a: torch.Tensor, b: torch.Tensor, layout: MoeLayout) -> torch.Tensor:
    """(epr, K, N): for each local expert, aᵀ b over its rows (a (rows, K), b (rows, N))."""
    if layout.capacity is not None:
        cap, epr = layout.capacity, layout.experts_per_rank
        return torch.bmm(a.view(epr, cap, -1).transpose(1, 2), b.view(epr, cap, -1))
    out = a.new_empty(layout.experts_per_rank, a.shape[1], b.shape[1])
    for e, (start, end) in enumerate(layout.expert_rows()):
        torch.matmul(a[start:end].t(), b[start:end], out=out[e])
    return out


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


@dataclasses.dataclass
class _Order:
    """Every rank's pairs in the global order (`LayoutPlan._order`), as this rank derives them."""

    counts: list[int]  # every rank's token count
    t_max: int
    pairs: torch.Tensor  # (W * Tmax * k,) the experts of every rank's pairs, -1 for padding
    real: torch.Tensor  # not padding
    valid: torch.Tensor  # real, with an id in [0, E)
    rank_in_expert: torch.Tensor  # each pair's place among its expert's pairs
    per_expert: torch.Tensor  # (E + 1,) pairs per expert, the last for invalid ones
    mine: torch.Tensor  # kept, and one of this rank's experts'
    kept: torch.Tensor
    rotated: torch.Tensor  # per (source, token) whose token this rank pulls, sources from this rank on
    pulled: torch.Tensor


class LayoutPlan(Plan):
    """moe_layout for one (top_k, num_experts, capacity[, tokens]): sizes and, in capacity mode, the tile table."""

    op = "moe_layout"

    @classmethod
    def key(cls, topk_ids: torch.Tensor, num_experts: int, *, capacity: int | None = None) -> tuple:
        shape = getattr(topk_ids, "shape", None)
        k = shape[1] if shape is not None and len(shape) == 2 else None
        return k, num_experts, capacity, shape[0] if capacity is not None and k is not None else None

    @classmethod
    def check(cls, topk_ids: torch.Tensor, num_experts: int, *, capacity: int | None = None) -> str:
        ctx = context()
        check_tensor(cls.op, "topk_ids", topk_ids, (torch.int32, torch.int64), 2, what="(tokens, k)")
        if not isinstance(num_experts, int) or num_experts <= 0 or num_experts % ctx.local_world_size:
            raise PKError(f"{cls.op}: {num_experts} experts do not split evenly among {ctx.local_world_size} ranks")
        if capacity is not None and (not isinstance(capacity, int) or capacity <= 0):
            raise PKError(f"{cls.op}: capacity must be a positive number of rows per expert, got {capacity}")
        tail = "" if capacity is None else f", capacity={capacity}, tokens={topk_ids.shape[0]} (the same on every rank)"
        return f"{cls.op} with top-{topk_ids.shape[1]} of {num_experts} experts{tail}"

    def __init__(self, topk_ids: torch.Tensor, num_experts: int, *, capacity: int | None = None):
        ctx = context()
        self.world, self.me, self.device = ctx.local_world_size, ctx.local_rank, ctx.device
        self.top_k, self.num_experts, self.capacity = topk_ids.shape[1], num_experts, capacity
        self.epr = num_experts // self.world
        if capacity is not None:
            self.block = block_rows(capacity)
            per = cdiv(capacity, self.block)
            tiles = torch.arange(self.epr * per, device=self.device)
            self.tile_expert = (tiles // per).int()
            self.tile_start = (self.tile_expert * capacity + (tiles % per) * self.block).int()
            self.tokens = topk_ids.shape[0]

    def __call__(self, topk_ids: torch.Tensor) -> MoeLayout:
        order = self._order(topk_ids)
        if self.capacity is None:
            rows, table = self._dropless(order)
        else:
            rows, table = self._capacity(order)
        return self._layout(topk_ids.shape[0], order, rows, table)

    def _order(self, topk_ids: torch.Tensor) -> _Order:
        """Every rank's ids (one all_gather) in the global order: an expert's pairs by (source rank, token, k)."""
        W, me, E, k, cap = self.world, self.me, self.num_experts, self.top_k, self.capacity
        T = topk_ids.shape[0]
        if cap is None:
            counts = exchange("moe_layout: token counts", T) if W > 1 else [T]
        else:
            counts = [self.tokens] * W
        t_max = max(counts)
        padded = topk_ids.new_full((t_max, k), -1, dtype=torch.int32)
        padded[:T] = topk_ids.clamp(-1, E)  # in the ids' own dtype first: an int64 id past 2^31 stays out of range
        pairs = (all_gather(padded, 0) if W > 1 else padded).reshape(-1).long()  # (W * Tmax * k,)
        n = pairs.numel()
        token_of_pair = torch.arange(n, device=self.device) // k  # s * Tmax + t
        if cap is None and n:  # pairs of padding rows (past a rank's own count) are not real
            limit = torch.tensor(counts, device=self.device).repeat_interleave(t_max)
            real = (token_of_pair % t_max) < limit[token_of_pair]
        else:  # capacity mode: every rank has the same count, no padding (and no host-made tensor to capture)
            real = torch.ones(n, dtype=torch.bool, device=self.device)
        valid = real & (pairs >= 0) & (pairs < E)
        key = torch.where(valid, pairs, E)
        ranked = torch.argsort(key, stable=True)
        # counts by scatter_add, not bincount (which synchronises with the host on a GPU to size its output)
        per_expert = torch.zeros(E + 1, dtype=torch.long, device=self.device).scatter_add_(0, key, torch.ones_like(key))
        starts = torch.cumsum(per_expert, 0) - per_expert
        rank_in_expert = torch.empty_like(pairs)
        rank_in_expert[ranked] = torch.arange(n, device=self.device) - starts[key[ranked]]
        kept = valid if cap is None else valid & (rank_in_expert < cap)
        mine = kept & (pairs // self.epr == me)
        # as a destination: the tokens to pull, one per (token, this rank), sources in the order me, me+1, ...
        # (so that the ranks do not all read rank 0 first), tokens in order
        rotated = mine.view(-1, k).any(1).view(W, t_max).roll(-me, 0).flatten()
        return _Order(counts, t_max, pairs, real, valid, rank_in_expert, per_expert, mine, kept, rotated,
                      rotated.sum().int().view(1))

    def _dropless(self, order: _Order) -> tuple[torch.Tensor, tuple]:
        """Dropless rows: this rank's row counts, pulled rows and every rank's id check come to the host in one
        synchronisation. Returns each pair's row here and the tile table."""
        W, me, E, epr = self.world, self.me, self.num_experts, self.epr
        local = order.per_expert[me * epr:(me + 1) * epr]
        bad = order.real & ~order.valid
        facts = torch.cat([local, order.pulled.long(), order.valid.sum().view(1),
                           bad.view(W, order.t_max * self.top_k).any(1).long()]).tolist()
        for r in range(W):
            if facts[epr + 2 + r]:
                raise PKError(f"moe_layout: rank {r}'s topk_ids hold ids outside [0, {E}) (the experts)")
        local_counts, max_pulled = facts[:epr], facts[epr]
        block = block_rows(facts[epr + 1] / E)  # from what every rank sees: the same tile height everywhere
        offsets = [0, *itertools.accumulate(local_counts)]
        first = torch.tensor(offsets[:-1], device=self.device)
        row = first[(order.pairs - me * epr).clamp(0, epr - 1)] + order.rank_in_expert
        tiles = [(e, s, min(s + block, offsets[e + 1]))
                 for e in range(epr) for s in range(offsets[e], offsets[e + 1], block)]
        table = torch.tensor(list(zip(*tiles, strict=True)) or [[0], [0], [0]], dtype=torch.int32, device=self.device)
        overflow = torch.zeros(epr, dtype=torch.int32, device=self.device)
        return row, (offsets[-1], max_pulled, block, offsets, table[0], table[1], table[2], len(tiles), overflow)

    def _capacity(self, order: _Order) -> tuple[torch.Tensor, tuple]:
        """Capacity rows: expert e's at e·C, every size fixed, nothing on the host. Returns each pair's row here and
        the tile table."""
        me, epr, cap = self.me, self.epr, self.capacity
        local = order.per_expert[me * epr:(me + 1) * epr]
        rows = epr * cap
        row = (order.pairs - me * epr) * cap + order.rank_in_expert
        tile_end = self.tile_expert * cap + local.clamp(max=cap).int()[self.tile_expert.long()]
        overflow = (local - cap).clamp(min=0).int()
        return row, (rows, min(self.world * order.t_max, rows), self.block, None, self.tile_expert, self.tile_start,
                     tile_end, self.tile_expert.numel(), overflow)

    def _layout(self, T: int, order: _Order, row: torch.Tensor, table: tuple) -> MoeLayout:
        """The layout from the order and the rows: what each row of this rank's experts reads, its tiles in the
        order their tokens land."""
        W, me, k = self.world, self.me, self.top_k
        rows, max_pulled, block, offsets, tile_expert, tile_start, tile_end, num_row_tiles, overflow = table
        if W == 1:  # nothing to pull: a pair reads its token's row of x directly
            pull_order = torch.zeros(0, dtype=torch.long, device=self.device)
            received = torch.arange(order.t_max, device=self.device)
            max_pulled = 0
        else:
            pull_order = torch.argsort((~order.rotated).to(torch.int8), stable=True)[:max_pulled]
            received = (torch.cumsum(order.rotated, 0) - 1).view(W, order.t_max).roll(me, 0).flatten()
        received = torch.cat([received, received.new_zeros(1)])  # rows of no pair read entry 0
        row = torch.where(order.mine, row, rows)  # pairs not mine write a row past the end, dropped below
        pair_ids = torch.arange(order.pairs.numel(), device=self.device)
        row_pair = torch.zeros(rows + 1, dtype=torch.long, device=self.device).index_put_((row,), pair_ids)[:rows]
        mine_rows = torch.zeros(rows + 1, dtype=torch.bool, device=self.device).index_put_((row,), order.mine)[:rows]
        row_pair = torch.where(mine_rows, row_pair, 0)
        row_recv = torch.where(mine_rows, received[row_pair // k], 0)
        if W > 1 and num_row_tiles > 1:
            landing = self._tile_order(rows, block, tile_start, num_row_tiles, mine_rows, row_recv)
            tile_expert, tile_start, tile_end = tile_expert[landing], tile_start[landing], tile_end[landing]
        kept_mine = order.kept.view(W, order.t_max, k)[me, :T]
        return MoeLayout(
            num_experts=self.num_experts, experts_per_rank=self.epr, top_k=k, world=W, tokens=T,
            max_tokens=order.t_max, token_counts=order.counts, capacity=self.capacity, block_rows=block,
            kept=kept_mine, dropped=~kept_mine, overflow=overflow,
            pull_src=((pull_order // order.t_max + me) % W).int(), pull_tok=(pull_order % order.t_max).int(),
            pulled=order.pulled, max_pulled=max_pulled, row_recv=row_recv.int(),
            row_src=(row_pair // (order.t_max * k)).int(), row_slot=(row_pair % (order.t_max * k)).int(),
            row_pair=row_pair, row_valid=mine_rows, rows=rows, expert_offsets=offsets, tile_expert=tile_expert,
            tile_start=tile_start, tile_end=tile_end, num_row_tiles=num_row_tiles)

    def _tile_order(self, rows: int, block: int, tile_start: torch.Tensor, num_row_tiles: int,
                    mine_rows: torch.Tensor, row_recv: torch.Tensor) -> torch.Tensor:
        """Tiles in the order their last row lands (sources are pulled me, me+1, ...): the compute programs start
        on tiles whose tokens are in while the rest is still being pulled."""
        at = torch.arange(rows, device=self.device)
        if self.capacity is not None:  # capacity: expert e's tiles start at e·C
            per = cdiv(self.capacity, block)
            row_tile = (at // self.capacity) * per + (at % self.capacity) // block
        else:  # dropless: tiles are the ranges in the table, in order
            row_tile = torch.searchsorted(tile_start[:num_row_tiles].contiguous(), at.int(), right=True) - 1
        last = torch.full((num_row_tiles,), -1, dtype=torch.long, device=self.device).scatter_reduce_(
            0, row_tile, torch.where(mine_rows, row_recv, -1), "amax")
        return torch.argsort(last, stable=True)


_moe_layout = declare(LayoutPlan)


@_moe_layout.public
def moe_layout(topk_ids: torch.Tensor, num_experts: int, *, capacity: int | None = None) -> MoeLayout:
    """The layout of a routing: `topk_ids` (T, k), this rank's tokens' experts among `num_experts` (split evenly,
    E/W per rank). Dropless by default (one host synchronisation); `capacity` rows per expert for a static,
    synchronisation-free layout that drops and counts what does not fit. Collective."""
    return moe_layout.plan(topk_ids, num_experts, capacity=capacity)(topk_ids)

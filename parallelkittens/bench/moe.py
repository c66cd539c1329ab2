"""Expert-parallel benchmark: ours beside torch's path in the same run.

Ours: `moe_dispatch_gemm` (tokens pulled to their experts, the first GEMM on each block as it lands) and
`moe_gemm_combine` (the second GEMM, rows sent back, weighted sum in order), on a layout built once. Torch's:
permute the (token, k) pairs by expert, `all_to_all_single` to their ranks (at more than one rank), grouped GEMM
(`torch._grouped_mm` where it runs, else a loop of torch.matmul), and the same way back with `index_add_`.
One rank per GPU. Shapes: DeepSeek-V3 (H 7168, I 2048, top-8, 32 experts per GPU) and Mixtral-like (H 4096,
I 14336, 8 experts, top-2), balanced and Zipf-skewed routing, 8K and 32K tokens per GPU; a decode case of 128 tokens
per GPU timed as latency. TFLOP/s count the two GEMMs' 2·pairs·H·I each.

Goals on one GPU (issue 17): our grouped GEMM alone at least 0.9x torch._grouped_mm (DeepSeek shapes, 32 experts
per GPU); the fused dispatch + GEMM at most 1.05x our grouped GEMM alone.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from .attention import _progress, _time_ms
from .plot import line_plot

SHAPES = {"deepseek": {"H": 7168, "I": 2048, "experts_per_gpu": 32, "top_k": 8},
          "mixtral": {"H": 4096, "I": 14336, "experts_per_gpu": 8, "top_k": 2}}
TOKENS = [8192, 32768]
DECODE_TOKENS = 128


def _routing(tokens: int, experts: int, top_k: int, skew: bool, gen: torch.Generator) -> torch.Tensor:
    """Top-k distinct experts per token: uniform, or Zipf-skewed (expert e drawn with weight 1/(e+1)^1.2)."""
    weights = torch.arange(1, experts + 1, dtype=torch.float64) ** (-1.2 if skew else 0.0)
    return torch.multinomial(weights.expand(tokens, -1), top_k, generator=gen)


def _grouped_mm():
    """torch's grouped GEMM on (rows, K) x (E, K, N) with row offsets, or None where it does not run here."""
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None:
        return None
    try:
        a = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(2, 64, 32, device="cuda", dtype=torch.bfloat16)
        fn(a, b, offs=torch.tensor([16, 32], device="cuda", dtype=torch.int32))
        return fn
    except (RuntimeError, TypeError):
        return None


def _loop_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    out = a.new_empty(a.shape[0], b.shape[2])
    for e, (s, t) in enumerate(zip([0, *bounds[:-1]], bounds, strict=True)):
        torch.matmul(a[s:t], b[e], out=out[s:t])
    return out


def _torch_path(x, ids, wt, w1, w2, experts: int, grouped):
    """all_to_all_single + grouped GEMM + all_to_all_single, as callable pieces (dispatch+GEMM, combine)."""
    world = dist.get_world_size()
    epr = experts // world
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs by expert, so by destination rank
    token = order // k
    send_counts = torch.bincount(flat // epr, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    if world > 1:
        dist.all_to_all_single(recv_counts, send_counts)
    else:
        recv_counts = send_counts
    send, recv = send_counts.tolist(), recv_counts.tolist()
    # rows per (destination, local expert): the pairs sent to a rank go in expert order
    counts_by_src = torch.bincount(flat, minlength=experts).view(world, epr)
    recv_by_src = torch.empty_like(counts_by_src)
    if world > 1:
        dist.all_to_all_single(recv_by_src, counts_by_src)
    else:
        recv_by_src = counts_by_src
    expert_of_recv = torch.cat([torch.arange(epr, device=x.device).repeat_interleave(c) for c in recv_by_src])
    regroup = torch.argsort(expert_of_recv, stable=True)
    per_expert = recv_by_src.sum(0)
    bounds = per_expert.cumsum(0).tolist()
    offs = per_expert.cumsum(0).to(torch.int32)

    def mm(a, b):
        return grouped(a, b, offs=offs) if grouped is not None else _loop_mm(a, b, offs, bounds)

    def exchange(rows, out_split, in_split):
        if world == 1:
            return rows
        out = rows.new_empty(sum(out_split), rows.shape[1])
        dist.all_to_all_single(out, rows, out_split, in_split)
        return out

    def dispatch():
        arrived = exchange(x[token], recv, send)
        return mm(arrived[regroup], w1)

    def combine(h):
        y = mm(h, w2)
        back = torch.empty_like(y)
        back[regroup] = y
        back = exchange(back, send, recv)
        out = torch.zeros(T, w2.shape[2], device=x.device, dtype=torch.float32)
        out.index_add_(0, token, back.float() * wt.reshape(-1)[order, None])
        return out.to(x.dtype)

    return dispatch, combine


def _case(shape: str, tokens: int, skew: bool) -> dict:
    import parallelkittens as pk
    from parallelkittens.ops.moe import dispatch as moe_dispatch

    ctx = pk.context()
    world, me, dev = ctx.local_world_size, ctx.local_rank, ctx.device
    cfg = SHAPES[shape]
    H, inner, epr, k = cfg["H"], cfg["I"], cfg["experts_per_gpu"], cfg["top_k"]
    E = epr * world
    gen = torch.Generator().manual_seed(1000 + me)
    ids = _routing(tokens, E, k, skew, gen).to(dev)
    x = torch.randn(tokens, H, generator=gen).to(dev, torch.bfloat16)
    wt = torch.rand(tokens, k, generator=gen).to(dev)
    w1 = (torch.randn(epr, H, inner, device=dev, dtype=torch.bfloat16) / H ** 0.5)
    w2 = (torch.randn(epr, inner, H, device=dev, dtype=torch.bfloat16) / inner ** 0.5)
    row = {"shape": shape, "tokens_per_gpu": tokens, "routing": "zipf" if skew else "balanced", "H": H, "I": inner,
           "experts": E, "top_k": k}
    layout_ms = _time_ms(lambda: pk.ops.moe_layout(ids, E), 50)
    layout = pk.ops.moe_layout(ids, E)
    a, _ = pk.ops.moe_dispatch_gemm(x, layout, w1)
    h = torch.nn.functional.silu(a)
    ours_dispatch = _time_ms(lambda: pk.ops.moe_dispatch_gemm(x, layout, w1))
    ours_combine = _time_ms(lambda: pk.ops.moe_gemm_combine(h, w2, layout, wt))
    grouped = _grouped_mm()
    dispatch, combine = _torch_path(x, ids, wt, w1, w2, E, grouped)
    h_torch = torch.nn.functional.silu(dispatch())
    torch_dispatch = _time_ms(dispatch)
    torch_combine = _time_ms(lambda: combine(h_torch))
    # the same result both ways (bf16 products, fp32 sums): a sanity check before any number is kept
    ours_out = pk.ops.moe_gemm_combine(h, w2, layout, wt).float()
    err = float((ours_out - combine(h_torch).float()).norm() / ours_out.norm().clamp(min=1e-30))
    pairs = int(layout.rows)
    flops = 2 * pairs * H * inner
    row.update(layout_ms=layout_ms, ours_dispatch_ms=ours_dispatch, ours_combine_ms=ours_combine,
               torch_dispatch_ms=torch_dispatch, torch_combine_ms=torch_combine, rows_per_gpu=pairs,
               ours_tflops=2 * flops / (ours_dispatch + ours_combine) / 1e9,
               torch_tflops=2 * flops / (torch_dispatch + torch_combine) / 1e9,
               dispatch_gbps=layout.max_pulled * H * 2 / ours_dispatch / 1e6 if world > 1 else None,
               grouped="torch._grouped_mm" if grouped is not None else "loop of torch.matmul", agree=err,
               pass_agree=err < 2e-2)
    if world == 1:  # our grouped GEMM alone: rows already in expert order, read straight (no gather)
        plan = moe_dispatch.moe_dispatch_gemm_op.plan(x, w1, layout.id)
        rows_in_order = x[layout.row_recv.long()]
        identity = torch.arange(pairs, device=dev, dtype=torch.int32)
        out = torch.empty(pairs, inner, device=dev, dtype=torch.bfloat16)

        def alone():
            plan.gemm(a=rows_in_order, b=w1, out=out, row_index=identity, row_src=layout.row_src,
                      tile_expert=layout.tile_expert, tile_start=layout.tile_start, tile_end=layout.tile_end,
                      num_row_tiles=layout.num_row_tiles)

        offs = torch.tensor(layout.expert_offsets[1:], device=dev, dtype=torch.int32)
        alone_ms = _time_ms(alone)
        torch_grouped_ms = _time_ms(lambda: grouped(rows_in_order, w1, offs=offs)) if grouped is not None else None
        row.update(ours_grouped_ms=alone_ms, torch_grouped_ms=torch_grouped_ms,
                   grouped_vs_torch=torch_grouped_ms / alone_ms if torch_grouped_ms else None,
                   fused_vs_alone=ours_dispatch / alone_ms)
    return row


def _rank() -> list[dict]:
    import parallelkittens as pk

    cases = [(s, t, skew) for s in SHAPES for t in TOKENS for skew in (False, True)]
    cases += [(s, DECODE_TOKENS, False) for s in SHAPES]
    rows = []
    for i, (shape, tokens, skew) in enumerate(cases):
        try:
            rows.append(_case(shape, tokens, skew))
        except torch.OutOfMemoryError:
            rows.append({"shape": shape, "tokens_per_gpu": tokens, "error": "out of memory"})
        gc.collect()
        torch.cuda.empty_cache()
        _progress("moe", i, len(cases), f"{shape} T={tokens} {'zipf' if skew else 'balanced'}")
    pk.sync()
    return rows


def bench_moe() -> dict:
    """MoE dispatch+GEMM and GEMM+combine vs all_to_all_single + grouped GEMM, DeepSeek-V3 and Mixtral shapes."""
    import parallelkittens as pk

    world = max(1, torch.cuda.device_count())
    rows = pk.spawn(_rank, world, backend="cuda", timeout=1800)[0]
    print(f"{'shape':>9} {'T/GPU':>6} {'routing':>8} {'ours ms':>8} {'torch ms':>8} {'ours TF':>8} {'torch TF':>8} "
          f"{'grp/torch':>9} {'fused/grp':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:>9} {r['tokens_per_gpu']:>6} {r['error']}")
            continue
        ours, theirs = r["ours_dispatch_ms"] + r["ours_combine_ms"], r["torch_dispatch_ms"] + r["torch_combine_ms"]
        print(f"{r['shape']:>9} {r['tokens_per_gpu']:>6} {r['routing']:>8} {ours:>8.3f} {theirs:>8.3f} "
              f"{r['ours_tflops']:>8.0f} {r['torch_tflops']:>8.0f} {r.get('grouped_vs_torch') or 0:>9.3f} "
              f"{r.get('fused_vs_alone') or 0:>9.3f}")
    goal_rows = [r for r in rows if r.get("shape") == "deepseek" and r.get("tokens_per_gpu") in TOKENS
                 and r.get("grouped_vs_torch")]
    goal = {}
    if goal_rows:
        worst_grouped = min(r["grouped_vs_torch"] for r in goal_rows)
        worst_fused = max(r["fused_vs_alone"] for r in goal_rows)
        goal = {"grouped_vs_torch_min": worst_grouped, "fused_vs_alone_max": worst_fused,
                "pass": worst_grouped >= 0.9 and worst_fused <= 1.05}
    return {"world_size": world, "unit": "TFLOP/s per GPU, ms", "rows": rows, "goal": goal}


def plot_moe(record: dict, path: str) -> bool:
    series = {}
    for r in record["rows"]:
        if "error" in r or r["tokens_per_gpu"] == DECODE_TOKENS:
            continue
        for who in ("ours", "torch"):
            series.setdefault(f"{who} {r['shape']} {r['routing']}", []).append((r["tokens_per_gpu"],
                                                                                r[f"{who}_tflops"]))
    return line_plot(path, f"MoE dispatch+GEMM+combine, {record['gpu']}, {record['world_size']} GPU(s)",
                     "tokens per GPU", "TFLOP/s per GPU", series)

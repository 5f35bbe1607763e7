"""DP-attention + expert parallelism: how a MoE block's tokens reach the ranks that own their
experts (issue 16). Each data-parallel rank brings its own tokens x [n, d]; the routed experts
are split by id over the expert group `ep`; attention, the router, the latent projections and
the shared experts are whole on every rank. Two forms, as vLLM's `--all2all-backend` names them:

- **all-to-all** (`all_to_all_routed`; vLLM's pplx / DeepEP, SGLang's DeepEP): each rank routes
  its own tokens and sends a token's expert input row once to each rank that owns one of its
  top-k experts, with its k expert ids and weights (the owner runs the ones it holds).
  The owners run their experts and send each row's fp32 partial sum back; the sender adds them.
  Only rows for other ranks holding a selected expert move, and the router and the latent down
  projection run once per token instead of once per rank.
- **all-gather / reduce-scatter** (`gather_routed`; vLLM's AgRsAll2AllManager): every rank
  gathers all ranks' hidden rows (padded to the largest n), routes and runs its experts on all of
  them, and a reduce-scatter leaves each rank the sums of its own rows. One exchange whatever the
  routing: the form for when every token selects experts on every rank anyway.

Both sum a token's per-rank partial sums in rank order from zero (a rank owning none of its
experts adds an exact 0), and the kernels' router, GEMV and experts are batch invariant, so on
the kernel path the two forms give the same bits while the down projection's rows (n here, all
ranks' there) stay within the GEMV loop's 16; past it torch's GEMM may round n rows and
sum-of-n rows differently, within fp32 noise.
"""

from __future__ import annotations

import torch

from k3serve.config.engine_config import ALL2ALL_BACKENDS


def gather_form(backend: str, top_k: int, world: int) -> bool:
    """Whether `backend` runs the all-gather / reduce-scatter form. auto: the gather form when a
    token would reach at least 3/4 of the other ranks anyway (1 - (1 - 1/M)^k >= 0.75 for top-k
    experts drawn evenly over M ranks: every 2-rank layout of the tiny models and the 400 M
    Kimi-Linear, K3's top-16 up to 8 ranks), the all-to-all past that (K3 over 16 ranks: 0.64).
    Measured on the 2-core dev VM at 2 ranks, where both move about the same rows, the gather
    form's fewer tensor ops win (bench/dp_ep_decode.py)."""
    if backend not in ALL2ALL_BACKENDS:
        raise ValueError(f"--all2all-backend {backend!r} is not one of {', '.join(ALL2ALL_BACKENDS)}")
    if backend == "auto":
        return 1 - (1 - 1 / world) ** top_k >= 0.75
    return backend != "alltoall"


def gather_routed(moe, x: torch.Tensor, ops) -> torch.Tensor | None:
    """fp32 routed sums [n, L] of this rank's rows; None when every rank is idle. `ops`: the
    backend's router, down projection and experts."""
    ep, n = moe.ep, x.shape[0]
    counts = [int(c) for c in ep.all_gather(torch.tensor([float(n)]))]  # [M] rows per rank
    most = max(counts)
    padded = x.new_zeros(most, x.shape[1], dtype=torch.float32)
    padded[:n] = x
    every = ep.all_gather(padded.reshape(-1)).view(ep.size, most, -1)  # fp32 [M, most, d]
    if not most:  # every replica idle: all of them skip the rest alike
        return None
    xs = torch.cat([every[r, :c] for r, c in enumerate(counts)]).to(x.dtype)  # [sum n, d]
    ids, weights = ops.moe_route(xs, *moe.router_args)
    ids = moe.physical(ids)  # EPLB: the replica serving each choice (every rank picks alike)
    z = ops.moe_down(moe, xs)
    start = sum(counts[: ep.rank])
    routed = moe.local_experts(z, ids, weights, ops, counted=slice(start, start + n))  # [sum n, L]
    per_rank = torch.zeros(ep.size, most, routed.shape[1], dtype=torch.float32, device=x.device)
    for r, rows in enumerate(routed.split(counts)):
        per_rank[r, : len(rows)] = rows
    return ep.reduce_scatter(per_rank.view(ep.size * most, -1))[:n]  # [n, L]: this rank's rows


def fixed_gather_routed(moe, x: torch.Tensor, rows: int, live: torch.Tensor, ops) -> torch.Tensor:
    """The gather form at a fixed shape, for a static step (runner/graph_step.py): every rank
    brings exactly `rows` rows (its x [n, d], n <= rows, then zero rows), agreed before the step,
    so there is no row-count exchange, no host value and no data-dependent shape: all-gather
    [M * rows, d], route and run this rank's experts on all of them (another rank's assignment
    weighs 0: `moe_local_experts`), reduce-scatter back to [rows, L] and keep the first n.
    `live` [n] bool: the rows whose expert load this rank counts (not padding). The zero rows
    cost M * rows - sum(n) rows of expert work; an all-to-all at fixed capacity (DeepEP's
    low-latency mode) would move fewer rows on a GPU and is not built."""
    ep, n = moe.ep, x.shape[0]
    padded = torch.nn.functional.pad(x.float(), (0, 0, 0, rows - n))  # [rows, d] fp32, as gather_routed sends
    every = ep.all_gather(padded.reshape(-1)).view(ep.size * rows, -1).to(x.dtype)  # [M * rows, d], rank-major
    ids, weights = ops.moe_route(every, *moe.router_args)
    ids = moe.physical(ids)
    z = ops.moe_down(moe, every)
    mine = slice(ep.rank * rows, ep.rank * rows + n)
    moe.count_load(ids[mine], live)
    routed = ops.moe_local_experts(moe, z, ids, weights, slice(0, 0))  # [M * rows, L] fp32
    return ep.reduce_scatter(routed)[:n]  # [n, L]: this rank's rows, summed over the ranks


def all_to_all_routed(moe, x: torch.Tensor, ops) -> torch.Tensor | None:
    """fp32 routed sums [n, L] of this rank's rows; None when every rank is idle."""
    ep, n, k = moe.ep, x.shape[0], moe.cfg.top_k
    per = moe.w1.shape[0]  # experts per rank: rank r owns global ids [r * per, (r + 1) * per)
    if n:
        ids, weights = ops.moe_route(x, *moe.router_args)  # [n, k]
        ids = moe.physical(ids)  # slots: rank d owns [d * per, (d + 1) * per)
        moe.count_load(ids)
        z = ops.moe_down(moe, x)  # [n, L]
        to = torch.zeros(n, ep.size, dtype=torch.bool, device=x.device).scatter_(1, ids // per, True)  # [n, M]
        rank_of, tok = to.T.nonzero(as_tuple=True)  # [rows]: destination-major, rank 0's rows first
        send = to.sum(0).tolist()
        msg = [z[tok], ids[tok].float(), weights[tok].float()]
    else:
        tok = torch.zeros(0, dtype=torch.long, device=x.device)
        msg = [x.new_zeros(0, moe.w1.shape[2]), *torch.zeros(2, 0, k, device=x.device)]
        send = [0] * ep.size
    counts = ep.row_counts(send)
    if not any(counts):  # every replica idle: all of them skip the rest alike
        return None
    # one message per row: the expert input's bytes, then its k global expert ids and k weights
    widths = [m.shape[1] * m.element_size() for m in msg]
    got = ep.all_to_all(torch.cat([m.contiguous().view(torch.uint8) for m in msg], 1), counts)
    z_in, ids_in, w_in = (
        part.contiguous().view(m.dtype) for part, m in zip(got.split(widths, 1), msg)
    )  # [received, L], [received, k] x 2
    # the experts this rank holds, as the TP-EP path runs them (its load was counted by the sender)
    partial = moe.local_experts(z_in, ids_in.long(), w_in, ops, counted=slice(0, 0))
    back = ep.all_to_all(partial, [counts[d * ep.size + s] for s in range(ep.size) for d in range(ep.size)])
    # back [rows] lines up with tok, rank 0's partials first: index_add_ adds them in that order,
    # from zero, as the gather form's reduction does
    return torch.zeros(n, back.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tok, back)

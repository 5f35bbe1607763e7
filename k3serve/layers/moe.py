"""Dense GLU MLP (layer 0) and the (latent) MoE block (k3-model-spec.md §5.3).

K3 latent MoE: z = down(x) [N, L]; y = sum_e w_e * w2_e(SiTU(w1_e z, w3_e z)) (FP32 sum);
y = RMSNorm(y); y = up(y) [N, d]; output y + shared(x). Kimi-Linear: experts act on x with
SwiGLU, output routed_scaling * sum + shared(x) (the factor is folded into the weights).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from k3serve.config.model_config import ModelConfig, MoEConfig
from k3serve.parallel.group import NO_TP, TPGroup
from k3serve.layers.activation import silu_and_mul, situ_and_mul
from k3serve.layers.backend import TORCH
from k3serve.layers.common import RMSNorm, WeightOnly, linear
from k3serve.layers.expert_map import ExpertMap
from k3serve.layers.expert_weights import ExpertWeights
from k3serve.layers.moe_dispatch import all_to_all_routed, fixed_gather_routed, gather_form, gather_routed
from k3serve.layers.router import route


def glu_activation(cfg: ModelConfig):
    if cfg.use_situ:
        return partial(situ_and_mul, beta=cfg.situ_beta, linear_beta=cfg.situ_linear_beta)
    return silu_and_mul


class GluMLP(nn.Module):
    """gate/up/down MLP: dense layer 0 and the shared experts."""

    def __init__(self, cfg: ModelConfig, hidden: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (
            linear(inter, hidden),
            linear(inter, hidden),
            linear(hidden, inter),
        )
        self.act = glu_activation(cfg)
        self.situ = (cfg.situ_beta, cfg.situ_linear_beta or 0.0) if cfg.use_situ else None  # for the kernels
        self.backend = TORCH  # how forward runs (k3serve/backends), chosen once by use_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.glu_layer(self, x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class Gate(WeightOnly):
    def __init__(self, num_experts: int, hidden: int):
        super().__init__(num_experts, hidden)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))


def tp_rows(n: int, tp: TPGroup) -> slice:
    """The rows of a DP-attention rank's n that TP rank `tp.rank` dispatches to the experts:
    ceil(n / N) each in rank order (the last ones may hold fewer, or none)."""
    per = -(-n // tp.size)
    return slice(min(n, tp.rank * per), min(n, (tp.rank + 1) * per))


def gather_tp_rows(tp: TPGroup, rows: torch.Tensor, n: int) -> torch.Tensor:
    """Every TP rank's `tp_rows` share [rows, L] -> all n rows [n, L] in order, on every rank."""
    per = -(-n // tp.size)
    padded = rows.new_zeros(per, rows.shape[1])
    padded[: rows.shape[0]] = rows
    return tp.all_gather(padded.reshape(-1)).view(tp.size * per, -1)[:n]


class SparseMoE(nn.Module):
    """`tp`: the group the block's dense parts (latent up projection, shared experts) split over;
    routed experts split over it too, by channel or by id (expert parallelism), unless `ep` is
    given: DP-attention + EP, where each data-parallel rank brings its own tokens, the experts
    are split by id over `ep` (every rank of every DP rank) and the block's output is whole, or
    with TP inside the DP rank a partial sum over `tp` (`dp_ep_forward`)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = NO_TP, ep: TPGroup | None = None):
        super().__init__()
        m, d = cfg.moe, cfg.hidden_size
        if ep is not None and not ep.expert_parallel:
            raise ValueError(
                "DP-attention splits the routed experts by id over every rank: it needs --enable-expert-parallel"
            )
        self.cfg, self.act, self.tp, self.ep = m, glu_activation(cfg), tp, ep
        xg = self.xg = ep if ep is not None else tp  # the group the routed experts are split over
        self.situ = (cfg.situ_beta, cfg.situ_linear_beta or 0.0) if cfg.use_situ else None  # for the kernels
        self.a8 = cfg.quant is not None and cfg.quant.a8  # MXFP8 expert inputs (config/quant_config.py)
        self.gate = Gate(m.num_experts, d)
        inner = m.latent_size or d
        if m.latent_size is not None:
            # down is replicated (every rank's experts read the whole latent z); up splits its
            # input columns under TP, so its output is a partial sum like the shared experts'
            self.routed_expert_down_proj = linear(inner, d)
            self.routed_expert_up_proj = linear(d, tp.split(inner, "routed_expert_hidden_size"))
            if m.latent_use_norm:
                self.routed_expert_norm = RMSNorm(inner, cfg.rms_norm_eps)
        # stacked routed experts [E, out, in] as buffers (dense, or packed MXFP4 for K3)
        inter, experts = m.expert_intermediate_size, m.num_experts
        # EPLB (--enable-eplb): the experts in E + R physical slots, a logical expert's replicas
        # chosen per token by the map (layers/expert_map.py); without it slot = expert id
        self.expert_map = None
        if xg.expert_parallel and xg.redundant_experts is not None:
            slots = m.num_experts + xg.redundant_experts
            if slots % xg.size:
                raise ValueError(
                    f"num_experts {m.num_experts} + num_redundant_experts {xg.redundant_experts} (--eplb-config) "
                    f"= {slots} physical experts are not divisible by {xg.size_flag} {xg.size}"
                )
            if slots // xg.size > m.num_experts:
                raise ValueError(
                    f"num_redundant_experts {xg.redundant_experts} (--eplb-config) gives each rank "
                    f"{slots // xg.size} expert slots, more than the {m.num_experts} experts"
                )
            self.expert_map = ExpertMap(m.num_experts, slots)
            experts = slots
        if xg.expert_parallel:
            experts = xg.split(experts, "num_experts")
        else:
            inter = xg.split(inter, "moe_intermediate_size")
        self.first_expert = xg.rank * experts if xg.expert_parallel else 0  # global slot of local expert 0
        # with expert parallelism: (token, slot) assignments per physical slot since start, [E] or
        # [E + R] under EPLB (the router runs on every rank, so rank 0 sees every rank's load:
        # /metrics shows imbalance; EPLB rebalances from it); a counter, not a weight: real even
        # in a model built on the meta device (models/registry.py)
        self.expert_load = (
            torch.zeros(experts * xg.size, dtype=torch.long, device="cpu") if xg.expert_parallel else None
        )
        self.w1 = ExpertWeights(experts, inter, inner)
        self.w3 = ExpertWeights(experts, inter, inner)
        self.w2 = ExpertWeights(experts, inner, inter)
        if m.num_shared_experts:
            self.shared_experts = GluMLP(
                cfg, d, tp.split(m.shared_intermediate_size, "shared experts' intermediate size")
            )
        self.backend = TORCH  # how forward runs (k3serve/backends), chosen once by use_kernels
        self.eps = cfg.rms_norm_eps

    def forward(self, x: torch.Tensor, batch=None) -> torch.Tensor:
        """`batch`: the step (a DP-attention static step fixes its token exchange's rows)."""
        return self.backend.moe_layer(self, x, batch)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The block on one rank in torch (every backend's reference)."""
        return self.single_rank(x, partial(TORCH.moe_experts, self))

    def single_rank(self, x: torch.Tensor, experts, router=None) -> torch.Tensor:
        """Router (`router(x)` -> ids, weights [N, k]; default layers/router.py), routed experts
        (`experts(z, ids, weights)` -> fp32 [N, L]), latent norm / up projection, shared experts,
        in torch around the experts."""
        z = self.routed_expert_down_proj(x) if self.cfg.latent_size is not None else x
        if router is None:
            ids, weights = route(x, self.gate.weight, self.gate.e_score_correction_bias, self.cfg)
        else:
            ids, weights = router(x)
        y = experts(z, ids, weights).to(x.dtype)
        if self.cfg.latent_size is not None:
            if self.cfg.latent_use_norm:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        if self.cfg.num_shared_experts:
            y = y + self.shared_experts(x)
        return y

    def partial_forward(self, x: torch.Tensor, ops, live: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's share of the block [N, d]; the decoder layer all-reduces it. `ops`: the
        backend's router and experts; `live` [N] bool: a static step's token rows (padding rows
        add no expert load), None: every row."""
        m = self.cfg
        ids, weights = ops.moe_route(x, *self.router_args)  # [N, k], on every rank
        ids = self.physical(ids)
        z = self.routed_expert_down_proj(x) if m.latent_size is not None else x
        counted = slice(None) if live is None else live
        routed = self.local_experts(z, ids, weights, ops, counted)  # [N, L] fp32, this rank's experts / channels
        if m.latent_size is None:
            y = routed.to(x.dtype)
        else:  # the latent norm needs the whole routed sum: reduce [N, L] first
            routed = self.tp.all_reduce(routed).to(x.dtype)
            y = self.routed_expert_norm(routed) if m.latent_use_norm else routed
            cols = self.routed_expert_up_proj.weight.shape[1]  # this rank's latent columns
            y = self.routed_expert_up_proj(y[:, self.tp.rank * cols : (self.tp.rank + 1) * cols].contiguous())
        if m.num_shared_experts:
            y = y + self.shared_experts(x)
        return y

    def dp_ep_forward(self, x: torch.Tensor, ops, batch=None) -> torch.Tensor:
        """DP-attention + EP: x [n, d] is this data-parallel rank's own batch. The routed sums of
        its rows come back from the ranks owning their experts (layers/moe_dispatch.py: an
        all-to-all, or an all-gather / reduce-scatter); the latent norm, up projection and
        shared experts run here on its own rows: [n, d]. With TP inside the DP rank (x whole on
        each of its TP ranks) each TP rank sends only its share of the rows (`tp_rows`), and the
        result is a partial sum the decoder layer's TP all-reduce completes, as under plain TP.
        A static step (`batch.ep_rows`, agreed by every rank) exchanges fixed-shape rows
        (`fixed_gather_routed`): no row counts, no data-dependent shape."""
        m, ep, tp, n = self.cfg, self.ep, self.tp, x.shape[0]
        mine = tp_rows(n, tp)
        if getattr(batch, "ep_rows", 0):  # each TP rank sends ceil(rows / N) of them
            live = batch.live()[mine]
            routed = fixed_gather_routed(self, x[mine], -(-batch.ep_rows // tp.size), live, ops)
        elif gather_form(ep.all2all, m.top_k, ep.size):
            routed = gather_routed(self, x[mine], ops)  # fp32 [rows, L]
        else:
            routed = all_to_all_routed(self, x[mine], ops)
        if routed is None or n == 0:  # all idle, or this replica idle: its collectives are done
            return x
        if tp.size == 1:
            y = routed.to(x.dtype)
            if m.latent_size is not None:
                y = self.routed_expert_norm(y) if m.latent_use_norm else y
                y = self.routed_expert_up_proj(y)
        elif m.latent_size is None:  # this rank's rows, zeros elsewhere: the all-reduce adds exact zeros
            y = x.new_zeros(n, routed.shape[1])
            y[mine] = routed.to(x.dtype)
        else:  # the latent norm needs whole rows, the up projection this rank's columns of every row
            y = gather_tp_rows(tp, routed, n).to(x.dtype)  # [n, L]
            y = self.routed_expert_norm(y) if m.latent_use_norm else y
            cols = self.routed_expert_up_proj.weight.shape[1]
            y = self.routed_expert_up_proj(y[:, tp.rank * cols : (tp.rank + 1) * cols].contiguous())
        if m.num_shared_experts:
            y = y + self.shared_experts(x)
        return y

    @property
    def router_args(self) -> tuple[torch.Tensor, torch.Tensor, MoEConfig]:
        """What `Backend.moe_route` takes after the rows: the router's weight [E, d], its
        correction bias [E] and the MoE config."""
        return self.gate.weight, self.gate.e_score_correction_bias, self.cfg

    def physical(self, ids: torch.Tensor) -> torch.Tensor:
        """Routed expert ids [N, k] -> the physical slots that serve them (the ids themselves
        without EPLB). Expert-parallel paths count load and pick ranks by slot."""
        return ids if self.expert_map is None else self.expert_map.physical(ids)

    def local_experts(
        self, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ops, counted: slice = slice(None)
    ) -> torch.Tensor:
        """Routed sum over the experts this rank holds (`ops.moe_experts`), FP32 [N, L]. Expert
        parallelism keeps the (token, slot) pairs routed here, one row each, and adds them back
        per token. `counted`: the rows whose assignments this rank adds to `expert_load`
        (DP-attention: its own), a slice or a [N] bool mask (a static step's live rows)."""
        if not self.xg.expert_parallel:
            return ops.moe_experts(self, z, ids, weights)
        return ops.moe_local_experts(self, z, ids, weights, counted)

    def select_local_experts(
        self, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ops, counted: slice = slice(None)
    ) -> torch.Tensor:
        """`local_experts` under expert parallelism by row selection (the reference's)."""
        self.count_load(ids[counted])
        local = ids - self.first_expert
        tok, slot = ((local >= 0) & (local < self.w1.shape[0])).nonzero(as_tuple=True)
        out = torch.zeros(z.shape[0], self.w2.shape[1], dtype=torch.float32, device=z.device)
        if tok.numel():
            out.index_add_(
                0, tok, ops.moe_experts(self, z[tok], local[tok, slot][:, None], weights[tok, slot][:, None].float())
            )
        return out

    def count_load(self, ids: torch.Tensor, live: torch.Tensor | None = None) -> None:
        """Add routed assignments ids [n, k] to `expert_load` on their device (an index_add: no
        copy to the host, no data-dependent shape; /metrics reads the totals between steps).
        `live` [n] bool: count only those rows (a static step's padding rows are not tokens)."""
        flat = ids.reshape(-1)
        if self.expert_load.device != flat.device:
            self.expert_load = self.expert_load.to(flat.device)
        ones = torch.ones_like(flat) if live is None else live[:, None].expand(ids.shape).reshape(-1).long()
        self.expert_load.index_add_(0, flat, ones)

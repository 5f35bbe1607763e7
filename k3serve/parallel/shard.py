"""This rank's slice of each checkpoint weight for tensor / expert parallelism.

The checkpoint is read once per rank (headers, then only what the rank keeps is copied) and
every canonical weight is sliced by the rule of its layer, as vLLM's Column/RowParallelLinear
and VocabParallelEmbedding would hold it:

  rows (dim 0, heads or channels): KDA q/k/v/g/f_b/b projections, conv taps, dt_bias, A_log;
      MLA q/q_b, kv_b, g; gate/up of the dense MLP and shared experts
  columns (dim 1): every o_proj and down_proj, K3's latent up projection (partial sums)
  vocabulary (dim 0, ceil(V/N) rows, the last shard zero-padded): embed_tokens, lm_head
  routed experts: w1/w3 rows and w2 columns (MXFP4 by whole 32-value groups), or with expert
      parallelism whole experts e in [rank·E/N, (rank+1)·E/N), renumbered from 0
  replicated: norms, router, K3's latent down projection and norm, f_a/g_a, kv_a, q_a, AttnRes

Reference: vLLM `model_executor/layers/linear.py`, `vocab_parallel_embedding.py`,
`fused_moe/layer.py` (expert map).
"""

from __future__ import annotations

import re

import torch

from k3serve.config.model_config import ModelConfig
from k3serve.parallel.eplb_policy import expert_slots, initial_slot
from k3serve.parallel.group import TPGroup, vocab_shard
from k3serve.weights.mxfp4 import GROUP, PackedMXFP4
from k3serve.weights.nvfp4 import PackedNVFP4

_EXPERT = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts\.)(\d+)(\.w[123]\.weight)$")
_ROWS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "conv1d.weight",
    "self_attn.f_b_proj.weight",
    "self_attn.dt_bias",
    "self_attn.A_log",
    "self_attn.b_proj.weight",
    "self_attn.g_proj.weight",
    "self_attn.g_b_proj.weight",
    "self_attn.q_b_proj.weight",
    "self_attn.kv_b_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "shared_experts.gate_proj.weight",
    "shared_experts.up_proj.weight",
)
_COLUMNS = (
    "self_attn.o_proj.weight",
    "mlp.down_proj.weight",
    "shared_experts.down_proj.weight",
    "routed_expert_up_proj.weight",
)
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")

Weight = torch.Tensor | PackedMXFP4 | PackedNVFP4


def shard_weights(
    weights: dict[str, Weight], cfg: ModelConfig, tp: TPGroup, ep: TPGroup | None = None
) -> dict[str, Weight]:
    """Canonical name -> this rank's slice (names of kept experts renumbered locally). With
    DP-attention's expert group `ep`, routed experts are split by id over `ep` and the rest by `tp`."""
    if tp.size == 1 and (ep is None or ep.size == 1):
        return weights
    out: dict[str, Weight] = {}
    for name, w in weights.items():
        m = _EXPERT.match(name)
        if m:
            kept = _expert(name, m, w, cfg, ep if ep is not None else tp)
            if kept is not None:
                out[kept[0]] = kept[1]
        elif tp.size == 1:
            out[name] = w
        elif name.endswith(_VOCAB):
            out[name] = _vocab(w, cfg.vocab_size, tp)
        elif name.endswith(_ROWS):
            out[name] = _chunk(w.reshape(-1) if name.endswith("A_log") else w, 0, tp, name)
        elif name.endswith(_COLUMNS):
            out[name] = _chunk(w, 1, tp, name)
        else:
            out[name] = w
    return out


def check_expert_split(cfg: ModelConfig, tp: TPGroup) -> None:
    """Packed experts split their w2 input channels by whole scale groups (MXFP4 32, NVFP4 16)."""
    inter = cfg.moe.expert_intermediate_size
    if tp.expert_parallel or tp.size == 1 or cfg.quant is None or (inter // tp.size) % cfg.quant.group_size == 0:
        return
    raise ValueError(
        f"moe_intermediate_size = {inter} split over --tensor-parallel-size {tp.size} gives "
        f"{inter // tp.size} channels per rank, not a multiple of the {cfg.quant.scheme.upper()} group of "
        f"{cfg.quant.group_size}: the "
        f"experts' w2 scales cannot be split; add --enable-expert-parallel (whole experts per rank)"
    )


def _chunk(w: torch.Tensor, dim: int, tp: TPGroup, name: str) -> torch.Tensor:
    n = tp.split(w.shape[dim], f"dim {dim} of {name}")
    return w.narrow(dim, tp.rank * n, n)


def _vocab(w: torch.Tensor, vocab: int, tp: TPGroup) -> torch.Tensor:
    start, rows = vocab_shard(vocab, tp)
    part = w[start : start + rows]
    if part.shape[0] < rows:  # the last shard: zero rows up to the common width
        part = torch.cat((part, part.new_zeros(rows - part.shape[0], *part.shape[1:])))
    return part


def _expert(name: str, m: re.Match, w: Weight, cfg: ModelConfig, tp: TPGroup) -> tuple[str, Weight] | None:
    e, which = int(m[2]), m[3]
    if tp.expert_parallel:  # whole experts, into the slot the (initial EPLB) placement gives
        E = cfg.moe.num_experts
        j = initial_slot(e, tp.rank, expert_slots(E, tp), E)
        return None if j is None else (f"{m[1]}{j}{which}", w)
    dim = 1 if which == ".w2.weight" else 0  # w2 [L, I] splits its input channels
    inter = cfg.moe.expert_intermediate_size
    n = tp.split(inter, "moe_intermediate_size")
    if isinstance(w, PackedNVFP4):
        if dim == 1:
            check_expert_split(cfg, tp)
        return name, w.narrow(dim, tp.rank * n, n)
    if not isinstance(w, PackedMXFP4):
        return name, w.narrow(dim, tp.rank * n, n)
    if dim == 1:
        check_expert_split(cfg, tp)
    if dim == 0:
        return name, PackedMXFP4(w.packed.narrow(0, tp.rank * n, n), w.scale.narrow(0, tp.rank * n, n))
    return name, PackedMXFP4(
        w.packed.narrow(1, tp.rank * n // 2, n // 2), w.scale.narrow(1, tp.rank * n // GROUP, n // GROUP)
    )

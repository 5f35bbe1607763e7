"""Pipeline stages (`--pipeline-parallel-size N`, issue 62): which layers each stage holds.

Stages are contiguous layer ranges balanced by weight (a MoE layer's routed experts outweigh a
dense one), cut only where a stage's state is one hidden vector and the AttnRes block bank: at
AttnRes block starts for K3 (a block's layers share its running partial sum, so a block stays
on one stage), at any layer for Kimi-Linear. The first stage embeds, the last holds the final
norm, the output AttnRes mix and the LM head. The engine (models/kimi.py, runner/rank_step.py)
and the planner (planner/layout.py) use this one split. Pure Python over the config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import accumulate

from k3serve.config.model_config import LayerKind, ModelConfig


def layer_weights(cfg: ModelConfig) -> list[float]:
    """Each layer's parameter count (attention + MLP), the load a stage balances."""
    d, m = cfg.hidden_size, cfg.moe
    out = []
    for i, kind in enumerate(cfg.layer_kinds):
        if kind is LayerKind.KDA:
            attn = 4 * d * cfg.kda.num_heads * cfg.kda.head_dim
        else:
            attn = 4 * d * cfg.mla.num_heads * (cfg.mla.qk_nope_head_dim + cfg.mla.v_head_dim)
        if cfg.is_moe_layer(i):
            ffn = 3 * (m.latent_size or d) * m.expert_intermediate_size * m.num_experts
        else:
            ffn = 3 * d * cfg.intermediate_size
        out.append(float(attn + ffn))
    return out


def stage_layers(cfg: ModelConfig, pp: int) -> list[range]:
    """Contiguous ranges, one per stage: each cut at the allowed boundary nearest to an equal
    share of the weight; every stage gets at least one allowed unit."""
    n = cfg.num_layers
    if pp <= 1:
        return [range(n)]
    cuts = list(cfg.attnres_block_starts) if cfg.use_attnres else list(range(n))
    if len(cuts) < pp:
        raise ValueError(
            f"--pipeline-parallel-size {pp} exceeds the {len(cuts)} "
            f"{'AttnRes blocks' if cfg.use_attnres else 'layers'} that stages can start at"
        )
    before = [0.0, *accumulate(layer_weights(cfg))]  # weight of the layers before each index
    starts = [0]
    for s in range(1, pp):
        target = before[-1] * s / pp
        # the cut nearest the target that leaves room for the stages still to come
        allowed = [c for i, c in enumerate(cuts) if c > starts[-1] and i <= len(cuts) - (pp - s)]
        starts.append(min(allowed, key=lambda c: (abs(before[c] - target), c)))
    starts.append(n)
    return [range(a, b) for a, b in zip(starts, starts[1:])]


@dataclass(frozen=True)
class Stage:
    """This rank's stage: index, count and its layers."""

    index: int = 0
    count: int = 1
    layers: range = range(0)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def holds(self, layer: int) -> bool:
        return layer in self.layers


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_FIRST = ("model.embed_tokens.",)
_LAST = ("model.norm.", "lm_head.", "model.output_attn_res_")


def on_stage(name: str, cfg: ModelConfig, stage: Stage | None) -> bool:
    """Whether a canonical weight belongs to `stage` (None: the whole model)."""
    if stage is None or stage.count == 1:
        return True
    m = _LAYER.match(name)
    if m:
        return stage.holds(int(m[1]))
    if name.startswith(_FIRST):  # the last stage also reads tied embeddings: its LM head
        return stage.first or (stage.last and cfg.tie_word_embeddings)
    if name.startswith(_LAST):
        return stage.last
    return True


def stage_of(cfg: ModelConfig, pp: int, index: int) -> Stage:
    return Stage(index, pp, stage_layers(cfg, pp)[index])


@dataclass(frozen=True)
class StageShares:
    """Layer shares of the most loaded pipeline stage: what one rank's caches and weights hold."""

    kda: float = 1.0
    mla: float = 1.0
    moe: float = 1.0
    layers: float = 1.0  # of all layers (dense weights; embeddings and LM head counted in it)


def stage_shares(cfg: ModelConfig, pp: int) -> StageShares:
    """The busiest stage's shares of each kind of layer (the engine's cache plan and the
    planner's per-rank figures size a stage by them)."""
    if pp <= 1:
        return StageShares()
    kda, mla = set(cfg.kda_layers), set(cfg.mla_layers)
    moe = {i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)}
    try:
        stages = stage_layers(cfg, pp)
    except ValueError:  # more stages than places to cut: the planner's `problems` refuse the layout
        return StageShares()

    def share(kind: set[int]) -> float:
        return max(len(kind & set(s)) for s in stages) / len(kind) if kind else 0.0

    return StageShares(share(kda), share(mla), share(moe), max(map(len, stages)) / cfg.num_layers)

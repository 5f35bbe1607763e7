"""Weight bytes per rank for a parallel layout, tensor by tensor (planner-data.md §5.2-5.3).

Sharding rules (the ones parallel/shard.py applies):
  routed experts            -> split over the EP ranks (EP = all GPUs; 896 % EP == 0)
  head-/column-parallel     -> / attention TP: q/k/v/g/o projections, KDA conv/decay params,
                               MLA q_b/kv_b, shared experts, dense MLP, the latent MoE up
                               projection, embeddings and LM head (vocab-parallel)
  replicated                -> norms, router, MLA latent down-projections (one latent head,
                               never split by TP), the latent MoE down projection (every rank's
                               experts read the whole latent), KDA f_a, AttnRes params, vision tower
With DP-attention (attention DP > 1) the attention TP is the TP inside each DP rank (1: everything
but the experts on every rank), and the experts split over all DP x TP ranks.
Sources: bundled configs via the tensor schema, or a checkpoint dir via safetensors headers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from k3serve.config.model_config import ModelConfig

TP_SHARDED = (
    "q_proj.",
    "k_proj.",
    "v_proj.",
    "g_proj.",
    "g_b_proj.",
    "o_proj.",
    "b_proj.",
    "f_b_proj.",
    "q_conv1d.",
    "k_conv1d.",
    "v_conv1d.",
    "dt_bias",
    "A_log",
    "q_b_proj.",
    "kv_b_proj.",
    "shared_experts.",
    "mlp.",
    "routed_expert_up_proj.",
    "embed_tokens.",
    "lm_head.",
)


@dataclass(frozen=True)
class WeightSplit:
    """Checkpoint bytes by how they are distributed."""

    expert: int
    tp_sharded: int
    replicated: int
    params: int
    active_params: int
    num_experts: int = 0  # routed experts per MoE layer (the redundant slots' unit)

    @property
    def total(self) -> int:
        return self.expert + self.tp_sharded + self.replicated

    @property
    def non_expert(self) -> int:
        return self.tp_sharded + self.replicated

    def per_rank(
        self, tp: int, ep: int, expert_share: float = 1.0, layer_share: float = 1.0, redundant: int = 0
    ) -> int:
        """One rank's bytes; with PP a stage holds `expert_share` of the MoE layers' experts
        and `layer_share` of everything else (embeddings and LM head counted by layer share).
        `redundant`: EPLB's extra expert slots over the `ep` ranks, (E + R) / ep experts a rank."""
        expert = self.expert
        if redundant and self.num_experts:  # whole experts: every MoE layer's slots hold E + R of them
            expert = self.expert // self.num_experts * (self.num_experts + redundant)
        expert = -(-expert // ep) if expert_share == 1.0 else int(expert * expert_share / ep) + 1
        dense = -(-self.tp_sharded // tp) + self.replicated
        return expert + (dense if layer_share == 1.0 else int(dense * layer_share) + 1)


def classify(name: str, routed_expert: bool, vision: bool) -> str:
    if routed_expert:
        return "expert"
    if vision or "norm" in name.rsplit(".", 2)[-2]:
        return "replicated"
    tail = name.split("self_attn.")[-1].split("block_sparse_moe.")[-1].split("model.")[-1]
    return "tp" if tail.startswith(TP_SHARDED) or any(t in name for t in ("shared_experts.", ".mlp.")) else "replicated"


def weight_split(cfg: ModelConfig, checkpoint: str | Path | None = None) -> WeightSplit:
    from k3serve.weights.schema import model_tensor_specs

    specs = list(model_tensor_specs(cfg))
    nbytes = {s.name: s.nbytes for s in specs}
    if checkpoint is not None and Path(checkpoint).is_dir() and any(Path(checkpoint).glob("*.safetensors")):
        from k3serve.weights.checkpoint import CheckpointIndex

        actual = CheckpointIndex.open(checkpoint).tensors  # exact stored bytes from the headers
        nbytes = {n: actual[n].nbytes if n in actual else b for n, b in nbytes.items()}
    sums = {"expert": 0, "tp": 0, "replicated": 0}
    for s in specs:
        b = nbytes[s.name]
        if s.name.endswith(".A_log"):  # K3 pads it (128 stored, 96 used): the engine keeps num_heads
            b = min(b, cfg.kda.num_heads * 4)
        sums[classify(s.name, s.routed_expert, s.vision)] += b
    params = sum(s.params for s in specs if not s.vision)
    expert_params = sum(s.params for s in specs if s.routed_expert)
    m = cfg.moe
    active = params - expert_params + (expert_params * m.top_k // m.num_experts if m.num_experts else 0)
    embed = cfg.vocab_size * cfg.hidden_size
    return WeightSplit(sums["expert"], sums["tp"], sums["replicated"], params, active - embed, m.num_experts)

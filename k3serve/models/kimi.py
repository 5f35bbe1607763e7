"""Kimi-K3 and Kimi-Linear text models: one skeleton, features switched by ModelConfig.

Reference forward (k3-model-spec.md §11): embed -> 93 layers of (KDA | gated MLA) attention and
(dense | latent MoE) MLP, joined by Block AttnRes (§6.3) for K3 or a plain pre-norm residual
for Kimi-Linear -> final Mix -> RMSNorm -> lm_head. Parameter names equal canonical checkpoint
names (`model.layers.{i}.self_attn.q_proj.weight`, ...), so loading is a name lookup.
"""

from __future__ import annotations

import torch
from torch import nn

from k3serve import backends
from k3serve.layers.backend import TORCH
from k3serve.config.model_config import LayerKind, ModelConfig
from k3serve.parallel.group import NO_TP, TPGroup, vocab_shard
from k3serve.parallel.pipe import StagePipe
from k3serve.config.stages import Stage
from k3serve.layers.attnres import attnres_vector
from k3serve.layers.common import RMSNorm, WeightOnly
from k3serve.layers.kda import KimiDeltaAttention
from k3serve.layers.mla import GatedMLA
from k3serve.layers.moe import GluMLP, SparseMoE
from k3serve.forward import CacheTensors, ForwardBatch, ForwardOut
from k3serve.weights.mxfp4 import PackedMXFP4


class DecoderLayer(nn.Module):
    """Under tensor parallelism both sub-blocks return this rank's partial sum; `attn` and `ffn`
    all-reduce it, so the residual stream is the same full [N, d] on every rank."""

    def __init__(self, cfg: ModelConfig, i: int, tp: TPGroup = NO_TP, ep: TPGroup | None = None):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.tp = tp
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(d, eps), RMSNorm(d, eps)
        kda = cfg.layer_kinds[i] is LayerKind.KDA
        self.self_attn = KimiDeltaAttention(cfg, i, tp) if kda else GatedMLA(cfg, i, tp)
        if cfg.is_moe_layer(i):
            self.block_sparse_moe = SparseMoE(cfg, tp, ep)
        else:
            self.mlp = GluMLP(cfg, d, tp.split(cfg.intermediate_size, "intermediate_size"))
        if cfg.use_attnres:
            self.self_attention_res_norm, self.mlp_res_norm = WeightOnly(d), WeightOnly(d)
            self.self_attention_res_proj, self.mlp_res_proj = WeightOnly(1, d), WeightOnly(1, d)

    def attn(self, x: torch.Tensor, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        return self.tp.all_reduce(self.self_attn(self.input_layernorm(x), batch, cache))

    def ffn(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        x = self.post_attention_layernorm(x)
        y = self.block_sparse_moe(x, batch) if hasattr(self, "block_sparse_moe") else self.mlp(x)
        return self.tp.all_reduce(y)


class OtherStage(nn.Module):
    """A layer another pipeline stage holds (no parameters; its index keeps the names)."""


class KimiModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = NO_TP, ep: TPGroup | None = None, pipe: StagePipe | None = None):
        """`pipe`: this rank's pipeline stage and its links to the neighbours (parallel/pipe.py):
        only the stage's layers are built; the first stage embeds, the last holds the final
        norm and output mix."""
        super().__init__()
        self.cfg, self.tp, self.pipe = cfg, tp, pipe
        stage = pipe.stage if pipe is not None else Stage(0, 1, range(cfg.num_layers))
        self.stage = stage
        self.vocab_start, rows = vocab_shard(cfg.vocab_size, tp)  # vocab-parallel under TP
        if stage.first or (stage.last and cfg.tie_word_embeddings):
            self.embed_tokens = nn.Embedding(rows, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, tp, ep) if stage.holds(i) else OtherStage() for i in range(cfg.num_layers)
        )
        if stage.last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.backend = TORCH  # the decode stack, AttnRes mix and vectors (k3serve/backends), chosen once
        if cfg.use_attnres and stage.last:
            self.output_attn_res_norm = WeightOnly(cfg.hidden_size)
            self.output_attn_res_proj = WeightOnly(1, cfg.hidden_size)

    def forward(
        self, batch: ForwardBatch, cache: CacheTensors, capture: dict[int, torch.Tensor | None] | None = None
    ) -> torch.Tensor:
        """`capture`: {layer index: None} to be filled with that layer's output hidden states
        [N, d] (the tap layers a DSpark drafter reads). Under pipeline stages a stage before the
        last sends its hidden state (and the AttnRes bank) on and returns None; a static step
        (graph backend) takes them from `batch.incoming` and returns them stacked instead, so
        that no send or receive is inside the compiled step."""
        if batch.fresh is not None and batch.fresh.numel():  # new sequences start from zero KDA state
            for t in cache.recurrent + cache.conv:
                if t is not None:
                    t[batch.fresh] = 0.0
        bank: list[torch.Tensor] = []
        if self.stage.first:
            h = self.embed(batch.input_ids)  # [N, d]
            if batch.media_rows is not None:  # media pads take the vision tower's rows
                h = h.index_copy(0, batch.media_rows, batch.media_embeds.to(h.dtype))
        elif batch.static:  # received into the step's buffer [bank + 1, N, d] before the compiled call
            h, bank = batch.incoming[-1], list(batch.incoming[:-1].unbind(0))
        else:  # the previous stage's hidden state [N, d] and AttnRes block vectors
            h, bank = self.pipe.receive(len(batch.input_ids), self.dtype)
        # the stack's MLA blocks write fp8 rows at unit scale: a cache with scales runs layer by layer
        whole = self.stage.first and self.stage.last
        stack = self.backend.decode_stack(self, batch, h) if cache.latent_scale is None and whole else None
        if stack is not None:  # a decode / verify step: the whole stack in one compiled call
            return self.backend.run_stack(self, stack, h, batch, cache, capture)  # the last norm inside
        if not self.cfg.use_attnres:
            for i in self.stage.layers:
                layer = self.layers[i]
                h = h + layer.attn(h, batch, cache)
                h = h + layer.ffn(h, batch)
                if capture is not None and i in capture:
                    capture[i] = h
        else:
            h = self._attnres_forward(h, bank, batch, cache, capture)
        if not self.stage.last:
            if batch.static:  # the static step's output: its caller sends it (runner/graph_step.py)
                return torch.stack([*bank, h])  # [bank + 1, N, d]
            self.pipe.send(h, bank)
            return None
        return self.norm(h)

    @property
    def dtype(self) -> torch.dtype:
        """The serving dtype (a stage's first layer norm: every stage holds one)."""
        return self.layers[self.stage.layers.start].input_layernorm.weight.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[N] -> [N, d]. Vocab-parallel: each rank looks up the ids in its shard, zeros the
        others, and the all-reduce adds exactly one non-zero row per token."""
        if self.tp.size == 1:
            return self.embed_tokens(ids)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.embed_tokens.num_embeddings)
        h = self.embed_tokens(local.clamp(0, self.embed_tokens.num_embeddings - 1))
        return self.tp.all_reduce(h.masked_fill(~inside[:, None], 0))

    def _attnres_forward(
        self, h: torch.Tensor, bank: list, batch: ForwardBatch, cache: CacheTensors, capture: dict | None = None
    ) -> torch.Tensor:
        """Spec §6.3: B holds banked block vectors; P is the running intra-block partial sum.
        `bank`: the blocks before this stage (a stage starts at a block start: no partial sum
        crosses it). The last stage returns the output mix, the others h (the bank grown in place)."""
        eps = self.cfg.rms_norm_eps
        mix = self.backend.attnres_mix
        vectors = self.backend.attnres_vectors(self)
        for i in self.stage.layers:
            layer = self.layers[i]
            w_attn, w_mlp = vectors[2 * i], vectors[2 * i + 1]
            a_in = mix(bank + [h], w_attn, eps) if bank else h
            if i % self.cfg.attn_res_block_size == 0:
                bank.append(h)
                partial = layer.attn(a_in, batch, cache)
            else:
                partial = h + layer.attn(a_in, batch, cache)
            m_in = mix(bank + [partial], w_mlp, eps)
            h = partial + layer.ffn(m_in, batch)
            if capture is not None and i in capture:
                capture[i] = h
        return mix(bank + [h], vectors[-1], eps) if self.stage.last else h

    def attnres_vectors(self) -> list[torch.Tensor]:
        """Fused score vectors [d] fp32 (attn, mlp per layer, then output), computed from the
        weights (a kernel backend keeps them; the reference recomputes them every forward, so
        training sees its updates)."""
        out: list = []
        for i, l in enumerate(self.layers):  # a layer of another pipeline stage: None, None
            held = self.stage.holds(i)
            out += [
                attnres_vector(l.self_attention_res_norm.weight, l.self_attention_res_proj.weight) if held else None
            ]
            out += [attnres_vector(l.mlp_res_norm.weight, l.mlp_res_proj.weight) if held else None]
        if self.stage.last:
            out.append(attnres_vector(self.output_attn_res_norm.weight, self.output_attn_res_proj.weight))
        return out


class KimiForCausalLM(nn.Module):
    """`KimiK3ForConditionalGeneration` / `KimiK3ForCausalLM` / `KimiLinearForCausalLM` (text)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = NO_TP, ep: TPGroup | None = None, pipe=None):
        """`tp`: the tensor-parallel group of this rank's attention, MLPs and vocabulary; `ep`:
        DP-attention's expert group (every data-parallel rank's tokens meet each MoE layer's
        experts there, layers/moe.py), None when experts follow `tp`; `pipe`: this rank's
        pipeline stage (parallel/pipe.py StagePipe), None: every layer."""
        super().__init__()
        self.cfg, self.tp, self.ep, self.pipe = cfg, tp, ep, pipe
        self.model = KimiModel(cfg, tp, ep, pipe)
        if not cfg.tie_word_embeddings and self.model.stage.last:
            self.lm_head = WeightOnly(vocab_shard(cfg.vocab_size, tp)[1], cfg.hidden_size)

    def forward(self, batch: ForwardBatch, cache: CacheTensors, taps: tuple[int, ...] = ()) -> ForwardOut:
        """Final hidden states [N, d], the `taps` layers' outputs and a verify pass's KDA records."""
        capture = dict.fromkeys(taps) if taps else None
        hidden = self.model(batch, cache, capture)  # None on a pipeline stage before the last
        return ForwardOut(hidden, capture or {}, batch.kda_records)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, d] -> fp32 [R, V]; vocab-parallel: every rank's shard, gathered (a collective)."""
        if self.tp.size == 1:
            return self._shard_logits(hidden)
        return self.tp.all_gather(self._shard_logits(hidden))[:, : self.cfg.vocab_size]

    def _shard_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.backend.logits(hidden, self.head)

    @property
    def head(self) -> torch.Tensor:
        """This rank's vocabulary rows [V / N, d] (the tied embeddings, or lm_head)."""
        return self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    @property
    def dtype(self) -> torch.dtype:
        """The serving dtype (a few KDA tensors stay FP32 by the spec)."""
        return self.model.dtype

    def use_kernels(self, mode: str = "auto"):
        """Choose the backend once (k3serve/backends: "torch", "cpp", "graph", "auto"): every layer, norm,
        MoE block and the model (decode stack, AttnRes mix, logits) hands itself to it. Call it
        after the last load or move (a kernel backend packs the weights as it first meets them).
        Returns the compiled module, or None."""
        backend = backends.select(mode)
        backend.prepare(self)
        for m in self.modules():
            if isinstance(m, (KimiDeltaAttention, GatedMLA, SparseMoE, GluMLP, RMSNorm, KimiModel)):
                m.backend = backend
        return backend.kernels

    def idle_moe(self) -> None:
        """A DP-attention replica with no tokens this step: its MoE layers still take part in
        the expert group's collectives, in layer order, with [0, d] inputs."""
        w = self.model.embed_tokens.weight
        empty = w.new_zeros(0, self.cfg.hidden_size)
        for moe in self.moe_layers():
            moe(empty)

    def moe_layers(self) -> list[SparseMoE]:
        return [l.block_sparse_moe for l in self.model.layers if hasattr(l, "block_sparse_moe")]

    def load_weights(self, weights: dict[str, torch.Tensor | PackedMXFP4]) -> None:
        """Copy canonical-name weights in; every parameter and expert must be provided."""
        from k3serve.models.weight_loading import assign_weights

        assign_weights(self, weights)

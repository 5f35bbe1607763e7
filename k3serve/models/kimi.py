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
from k3serve.backends import TORCH
from k3serve.config.model_config import LayerKind, ModelConfig
from k3serve.distributed.group import NO_TP, TPGroup, vocab_shard
from k3serve.layers.attnres import attnres_mix, attnres_vector
from k3serve.layers.common import RMSNorm, WeightOnly, kernel_matrix
from k3serve.layers.gemm import SMALL_M, dense
from k3serve.layers.kda import KimiDeltaAttention
from k3serve.layers.mla import GatedMLA
from k3serve.layers.moe import DENSE_KERNEL_ROWS, GluMLP, SparseMoE
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

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        mlp = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        return self.tp.all_reduce(mlp(self.post_attention_layernorm(x)))


class KimiModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = NO_TP, ep: TPGroup | None = None):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.vocab_start, rows = vocab_shard(cfg.vocab_size, tp)  # vocab-parallel under TP
        self.embed_tokens = nn.Embedding(rows, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, ep) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.kernels = None  # k3serve.kernels module: the AttnRes mix in one call (set by use_kernels)
        self.backend = TORCH  # the attention layers' backend: its weight packs feed the decode stack
        self._kernel_weights: list[torch.Tensor] | None = None  # AttnRes vectors, reset by use_kernels
        self._decode_stack = None  # kernels.DecodeStack (False: this model has none), reset by use_kernels
        self._stack_states: tuple | None = None  # (cache, its tensors in stack order, the KDA layers)
        self._stack_takes: dict = {}  # (dtype, rows <= DENSE_KERNEL_ROWS) -> every MoE layer takes its block kernel
        if cfg.use_attnres:
            self.output_attn_res_norm = WeightOnly(cfg.hidden_size)
            self.output_attn_res_proj = WeightOnly(1, cfg.hidden_size)

    def forward(self, batch: ForwardBatch, cache: CacheTensors,
                capture: dict[int, torch.Tensor | None] | None = None) -> torch.Tensor:
        """`capture`: {layer index: None} to be filled with that layer's output hidden states
        [N, d] (the tap layers a DSpark drafter reads)."""
        h = self.embed(batch.input_ids)  # [N, d]
        if batch.step.fresh.numel():  # new sequences start from zero KDA state, on every path
            for t in cache.recurrent + cache.conv:
                if t is not None:
                    t[batch.step.fresh] = 0.0
        if batch.media_rows is not None:  # media pads take the vision tower's rows
            h = h.index_copy(0, batch.media_rows, batch.media_embeds.to(h.dtype))
        stack = self._stack_for(batch, h)
        if stack is not None:  # a decode / verify step: the whole stack in one compiled call
            return self.norm(self._run_stack(stack, h, batch, cache, capture))
        if not self.cfg.use_attnres:
            for i, layer in enumerate(self.layers):
                h = h + layer.attn(h, batch, cache)
                h = h + layer.ffn(h)
                if capture is not None and i in capture:
                    capture[i] = h
            return self.norm(h)
        return self.norm(self._attnres_forward(h, batch, cache, capture))

    def _run_stack(self, stack, h: torch.Tensor, batch: ForwardBatch, cache: CacheTensors,
                   capture: dict | None) -> torch.Tensor:
        """One DecodeStack call; a verify pass's KDA records are allocated and kept as each KDA
        layer's _block_kernel does, the tap layers' outputs land in `capture`."""
        step = batch.step
        if self._stack_states is None or self._stack_states[0] is not cache:  # listed once per cache
            kdas = [(i, l.self_attn) for i, l in enumerate(self.layers) if isinstance(l.self_attn, KimiDeltaAttention)]
            states = [t for i in range(len(self.layers))
                      for t in ((cache.conv[i], cache.recurrent[i]) if cache.latent[i] is None else (cache.latent[i],))]
            self._stack_states = (cache, states, kdas)
        _, states, kdas = self._stack_states
        be = self.backend
        bufs = [be.kda_records(attn, batch, cache.recurrent[i], cache.conv[i]) for i, attn in kdas] if batch.verify else []
        taps = list(capture) if capture else []
        out = stack.run(h, states, [t for b in bufs for t in b], step.slots, step.starts, step.cache_rows, step.table,
                        step.seq, step.positions, batch.block_size, taps)
        for (i, _), b in zip(kdas, bufs):
            batch.keep_kda_records(i, b)
        for i, t in zip(taps, out[1:]):
            capture[i] = t
        return out[0]

    def _stack_for(self, batch: ForwardBatch, h: torch.Tensor):
        """The compiled decode stack (kernels/cpu/decode_stack.cpp) when this step is one it
        runs as the layers would: decode and verify rows only (no media), in step order, every
        block on its block kernel; else None. Built once per use_kernels."""
        step = batch.step
        if (self.kernels is None or h.device.type != "cpu" or h.dtype not in (torch.float32, torch.bfloat16)
                or self.tp.size > 1 or not step.seqs
                or not (step.covers_all and step.identity) or batch.media_rows is not None or torch.is_grad_enabled()):
            return None
        if self._decode_stack is None:
            self._decode_stack = self._build_stack() or False
            self._stack_takes = {}
        # whether every MoE layer runs its block kernel: fixed per dtype and row class once the
        # kernels are set (moe_takes_block, ~1.5 us a layer, asked once per kind of step)
        kind = (h.dtype, h.shape[0] <= DENSE_KERNEL_ROWS)
        if kind not in self._stack_takes:
            moes = [l.block_sparse_moe for l in self.layers if hasattr(l, "block_sparse_moe")]
            self._stack_takes[kind] = all(self.backend.moe_takes_block(m, h) for m in moes)
        return self._decode_stack if self._decode_stack and self._stack_takes[kind] else None

    def _build_stack(self):
        """A DecodeStack of every layer's block arguments, or None where a layer has no block
        kernel (experts split over ranks)."""
        vectors = self._attnres_vectors() if self.cfg.use_attnres else []
        stack = self.kernels.DecodeStack(self.cfg.rms_norm_eps, self.cfg.attn_res_block_size if vectors else 1,
                                         vectors)
        be = self.backend
        for layer in self.layers:
            attn = layer.self_attn
            mla = not isinstance(attn, KimiDeltaAttention)
            attn_w = be.mla_weights(attn) if mla else be.kda_weights(attn)
            attn_i, attn_f = be.mla_scalars(attn) if mla else be.kda_scalars(attn)
            moe = getattr(layer, "block_sparse_moe", None)
            if moe is not None and (moe.ep is not None or moe.tp.size > 1):
                return None
            ffn = be.moe_weights(moe) if moe is not None else be.glu_weights(layer.mlp)
            ffn_i, ffn_f = (moe if moe is not None else layer.mlp).block_scalars()
            stack.add_layer(int(mla), layer.input_layernorm.weight, attn_w, attn_i, attn_f,
                            int(moe is None), layer.post_attention_layernorm.weight, ffn, ffn_i, ffn_f)
        return stack

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[N] -> [N, d]. Vocab-parallel: each rank looks up the ids in its shard, zeros the
        others, and the all-reduce adds exactly one non-zero row per token."""
        if self.tp.size == 1:
            return self.embed_tokens(ids)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.embed_tokens.num_embeddings)
        h = self.embed_tokens(local.clamp(0, self.embed_tokens.num_embeddings - 1))
        return self.tp.all_reduce(h.masked_fill(~inside[:, None], 0))

    def _attnres_forward(self, h: torch.Tensor, batch: ForwardBatch, cache: CacheTensors,
                         capture: dict | None = None) -> torch.Tensor:
        """Spec §6.3: B holds banked block vectors; P is the running intra-block partial sum."""
        eps, bank = self.cfg.rms_norm_eps, []
        mix = attnres_mix if self.kernels is None or h.device.type != "cpu" else self.kernels.attnres_mix
        vectors = self._attnres_vectors()
        for i, layer in enumerate(self.layers):
            w_attn, w_mlp = vectors[2 * i], vectors[2 * i + 1]
            a_in = mix(bank + [h], w_attn, eps) if bank else h
            if i % self.cfg.attn_res_block_size == 0:
                bank.append(h)
                partial = layer.attn(a_in, batch, cache)
            else:
                partial = h + layer.attn(a_in, batch, cache)
            m_in = mix(bank + [partial], w_mlp, eps)
            h = partial + layer.ffn(m_in)
            if capture is not None and i in capture:
                capture[i] = h
        return mix(bank + [h], vectors[-1], eps)

    def _attnres_vectors(self) -> list[torch.Tensor]:
        """Fused score vectors [d] fp32 (attn, mlp per layer, then output). With kernels they are
        computed once (use_kernels resets them, and is called after the last load or move);
        the reference path recomputes them every forward, so training sees its updates."""
        if self._kernel_weights is not None:
            return self._kernel_weights
        pairs = [(l.self_attention_res_norm, l.self_attention_res_proj, l.mlp_res_norm, l.mlp_res_proj)
                 for l in self.layers]
        mods = [w for p in pairs for w in p] + [self.output_attn_res_norm, self.output_attn_res_proj]
        vectors = [attnres_vector(mods[j].weight, mods[j + 1].weight) for j in range(0, len(mods), 2)]
        if self.kernels is not None and not torch.is_grad_enabled():
            self._kernel_weights = vectors
        return vectors


class KimiForCausalLM(nn.Module):
    """`KimiK3ForConditionalGeneration` / `KimiK3ForCausalLM` / `KimiLinearForCausalLM` (text)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = NO_TP, ep: TPGroup | None = None):
        """`tp`: the tensor-parallel group of this rank's attention, MLPs and vocabulary; `ep`:
        DP-attention's expert group (every data-parallel rank's tokens meet each MoE layer's
        experts there, layers/moe.py), None when experts follow `tp`."""
        super().__init__()
        self.cfg, self.tp, self.ep = cfg, tp, ep
        self.model = KimiModel(cfg, tp, ep)
        if not cfg.tie_word_embeddings:
            self.lm_head = WeightOnly(vocab_shard(cfg.vocab_size, tp)[1], cfg.hidden_size)
        self._kernel_weights: list | None = None  # [the head in kernel form], reset by use_kernels

    def forward(self, batch: ForwardBatch, cache: CacheTensors, taps: tuple[int, ...] = ()) -> ForwardOut:
        """Final hidden states [N, d], the `taps` layers' outputs and a verify pass's KDA records."""
        capture = dict.fromkeys(taps) if taps else None
        hidden = self.model(batch, cache, capture)
        return ForwardOut(hidden, capture or {}, batch.kda_records)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, d] -> fp32 [R, V]; vocab-parallel: every rank's shard, gathered (a collective)."""
        if self.tp.size == 1:
            return self._shard_logits(hidden)
        return self.tp.all_gather(self._shard_logits(hidden))[:, : self.cfg.vocab_size]

    def _shard_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight
        k = self.model.kernels
        if (k is not None and hidden.device.type == "cpu" and hidden.dim() == 2 and hidden.dtype == head.dtype
                and not torch.is_grad_enabled()):
            if hidden.shape[0] <= SMALL_M:  # decode / verify rows: the GEMV, on fp32 panels where they pay
                if self._kernel_weights is None:
                    self._kernel_weights = [kernel_matrix(head, k)]
                head = self._kernel_weights[0]
            return k.linear(hidden, head).float()  # torch's bf16 GEMM cost ~90 us for a decode row here
        return dense(hidden, head).float()

    @property
    def dtype(self) -> torch.dtype:
        """The serving dtype (of the embeddings; a few KDA tensors stay FP32 by the spec)."""
        return self.model.embed_tokens.weight.dtype

    def use_kernels(self, mode: str = "auto"):
        """Choose the backend once (k3serve/backends: "torch", "cpp", "auto"): the attention
        layers, MLPs, MoE blocks and norms hand themselves to it; the decode stack, the AttnRes
        mix and the logits still take the compiled module (k3serve.kernels) directly, or torch
        with None. Returns the module."""
        backend = backends.select(mode)
        backend.reset()
        module = backend.kernels
        for m in self.modules():
            if isinstance(m, (KimiDeltaAttention, GatedMLA, SparseMoE, GluMLP, RMSNorm, KimiModel)):
                m.backend = backend
            if hasattr(m, "kernels"):
                m.kernels = module
            if hasattr(m, "_kernel_weights"):  # cached argument lists: call this after the last load / move
                m._kernel_weights = None
            if hasattr(m, "_decode_stack"):
                m._decode_stack = None
        return module

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

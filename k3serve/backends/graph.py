"""The `graph` backend: a decode step that compiles whole and can be captured as a CUDA graph.

Given a `StaticStep` (forward/static.py: one token per row, every index a device tensor of a
fixed shape) each layer runs fixed-shape, sync-free code: its projections in torch and its core
as one `k3serve::` custom op (backends/graph_ops.py: KDA decode, MLA decode, MoE route and
experts, GLU, RMSNorm, the AttnRes mix), so the step is a few tens of nodes a layer, each a
slot a device kernel can fill. No `.item()` / `.tolist()` / `nonzero` / `bincount`, no CPU
index into a device tensor, no per-step weight copy (fp32 `kv_b`, the conv weights, the decay
coefficients and the MXFP4 tables are prepared once, `prepare`). State and latent writes go
through the step's slots and rows; padding rows hit the scratch slot and block. Prefill
chunks, verify passes and mixed steps run the torch reference eagerly (norms, MLPs and short
MoE blocks through the same ops, which take any row count); `runner/graph_step.py` compiles
and captures the static step per batch bucket.

The arithmetic is the reference's decode arithmetic, so greedy tokens agree with the `torch`
backend (tests/model/test_graph.py, tests/engine/test_graph_engine.py).
"""

from __future__ import annotations

import torch

from k3serve.backends import TORCH, Backend
from k3serve.backends.graph_ops import BODIES, OPS
from k3serve.layers.gemm import dense
from k3serve.layers.mla import MLA_NORM_EPS
from k3serve.layers.router import route_scalars
from k3serve.weights.mxfp4 import decode_tables


class GraphBackend(Backend):
    name = "graph"

    def __init__(self, static_rows: int = 512, inline: bool = False):
        """`inline`: call the ops' bodies directly instead of through the dispatcher (the sync
        audit sees inside them so)."""
        # MoE blocks of at most this many rows (every static step's) take the sync-free experts;
        # longer ones (eager prefill chunks) the reference's sort, which reads each expert once
        self.static_rows = static_rows
        self.ops = BODIES if inline else OPS
        self.kda_w: dict[int, tuple] = {}  # KDA layer -> (conv_w [3P, K], decay [P], dt_bias [P], o_norm [D]) fp32
        self.kv_b: dict[int, torch.Tensor] = {}  # MLA layer -> [H, n + v, c] fp32
        self.vectors: list[torch.Tensor] | None = None  # AttnRes score vectors, fp32 [d] each
        self.luts: tuple[torch.Tensor, torch.Tensor] | None = None  # MXFP4 decode tables in the model dtype
        self.nv_tables: dict = {}  # NVFP4 MoE layer -> its w1, w2, w3 group-factor tables [3, E, 256] fp32

    @torch.no_grad()
    def prepare(self, model) -> None:
        """Weights in the form the step computes with, once (after the last load or move)."""
        from k3serve.layers.kda import KimiDeltaAttention
        from k3serve.layers.mla import GatedMLA
        from k3serve.layers.moe import SparseMoE

        for m in model.modules():
            if isinstance(m, KimiDeltaAttention):
                self.kda_w[m.layer_idx] = (
                    m.conv_weight(),
                    m.A_log.float().exp().repeat_interleave(m.head_dim),
                    m.dt_bias.float(),
                    m.o_norm.weight.float(),
                )
            elif isinstance(m, GatedMLA):
                self.kv_b[m.layer_idx] = m.kv_b_proj.weight.float().view(m.cfg.num_heads, -1, m.cfg.kv_lora_rank)
            elif isinstance(m, SparseMoE) and m.w1.fmt == "nvfp4":
                self.nv_tables[m] = torch.stack([w.tables for w in (m.w1, m.w2, m.w3)])
        if model.cfg.use_attnres:
            self.vectors = model.model.attnres_vectors()
        # not the shared table cache: prepare may run on fake tensors (the sync audit)
        self.luts = decode_tables(next(model.parameters()).device, model.dtype)  # any stage holds parameters

    @torch.no_grad()
    def experts_moved(self, layer) -> None:
        """NVFP4 tables follow their experts; in place: a captured step reads them by address."""
        if layer in self.nv_tables:
            self.nv_tables[layer].copy_(torch.stack([w.tables for w in (layer.w1, layer.w2, layer.w3)]))

    # ---- attention: static steps here, everything else the reference
    def kda_layer(self, layer, x, batch, cache):
        if not batch.static:
            return layer.reference(x, batch, cache)
        u, z, b, gate = layer.projections(x)  # [N, 3P], [N, P], [N, H], [N, P] fp32
        return layer.o_proj(self.kda_core(layer, u, z, b, gate, batch, cache).to(x.dtype))

    @property
    def core_ops(self):
        """The ops KDA, MLA and the experts run through (the triton backend's: its kernels)."""
        return self.ops

    def kda_gate(self, i: int) -> torch.Tensor:
        """Layer i's decay input to the KDA op: exp(A_log) per channel [P] (the triton kernel's: A_log [H])."""
        return self.kda_w[i][1]

    def kda_core(self, layer, u, z, b, gate, batch, cache):
        """Conv, gates, the delta rule on the slots' states and the gated norm -> [N, P] fp32; a
        verify pass writes the state after each position to its slot row (batch.slots [B, T])."""
        i = layer.layer_idx
        conv_w, _, dt_bias, o_norm = self.kda_w[i]
        state = (conv_w, self.kda_gate(i), dt_bias, o_norm, cache.recurrent[i], cache.conv[i], batch.slots)
        op = self.core_ops.kda_decode if batch.T == 1 else self.core_ops.kda_verify
        return op(u, z, b, gate, *state, layer.head_dim, layer.lower_bound, layer.eps)

    def mla_layer(self, layer, x, batch, cache):
        if not batch.static:
            return layer.reference(x, batch, cache)
        m, N = layer.cfg, x.shape[0]
        q = layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x))) if m.q_lora_rank is not None else layer.q_proj(x)
        out = self.mla_core(
            layer, q.view(N, m.num_heads, m.qk_head_dim).float(), layer.kv_a_proj_with_mqa(x), batch, cache
        )
        return layer.output(out, x)

    def mla_core(self, layer, q, ckv, batch, cache):
        """q [N, H, nope + r] fp32, ckv [N, c + r] -> [N, H, v] fp32, the latent row written."""
        m, i = layer.cfg, layer.layer_idx
        pages, tail = self.mla_pages(batch)
        return self.core_ops.mla_decode(
            q,
            ckv,
            layer.kv_a_layernorm.weight,
            cache.latent[i],
            batch.cache_rows,
            pages,
            batch.lens,
            self.kv_b[i],
            m.qk_nope_head_dim,
            m.v_head_dim,
            layer.scale,
            MLA_NORM_EPS,
            *tail,
            cache.kv_scale(i),
        )

    def mla_pages(self, batch) -> tuple:
        """Where each sequence's latent rows are, as the MLA op reads them, and the op's arguments
        for that form before the kv scale: the static step's context rows [B, C] (none)."""
        return batch.context_rows, ()

    # ---- norms, MLPs and the MoE block: any row count, no host sync
    def rms_norm(self, x, weight, eps):
        return self.ops.rms_norm(x, weight, eps)

    def glu_layer(self, layer, x):
        beta, linear_beta = layer.situ or (0.0, 0.0)
        return self.ops.glu_mlp(
            x,
            layer.gate_proj.weight,
            layer.up_proj.weight,
            layer.down_proj.weight,
            layer.situ is not None,
            beta,
            linear_beta,
        )

    def moe_layer(self, layer, x, batch=None):
        if layer.ep is not None:  # DP-attention: every rank's rows fixed in a static step, else the reference
            if getattr(batch, "ep_rows", 0):
                return layer.dp_ep_forward(x, self, batch)
            return Backend.moe_layer(TORCH, layer, x)
        if x.shape[0] > self.static_rows:  # an eager prefill chunk: the reference's sorted experts
            return Backend.moe_layer(TORCH, layer, x)
        if layer.tp.size > 1:  # this rank's channels of every expert; the all-reduces trace (group.py)
            return layer.partial_forward(x, self, batch.live() if getattr(batch, "static", False) else None)
        return layer.single_rank(
            x, lambda z, ids, w: self.moe_experts(layer, z, ids, w), lambda x: self.moe_route(x, *layer.router_args)
        )

    def moe_route(self, x, gate, bias, m):
        return self.ops.moe_route(x, gate, bias, *route_scalars(m))

    def moe_local_experts(self, layer, z, ids, weights, counted):
        """Expert parallelism with every row on every rank (TP + EP): this rank's experts' share of
        the routed sum, FP32 [N, L], without choosing rows: an assignment to another rank's expert
        keeps its shape with weight 0 (on local expert 0), and the decoder layer's all-reduce adds
        the ranks' shares. No nonzero, no data-dependent shape (`counted` a mask: a static step's
        live rows, counted by weight)."""
        if isinstance(counted, torch.Tensor):
            layer.count_load(ids, counted)
        else:
            layer.count_load(ids[counted])
        local = ids - layer.first_expert
        mine = (local >= 0) & (local < layer.w1.shape[0])
        return self.moe_experts(layer, z, local.clamp(0, layer.w1.shape[0] - 1), weights * mine)

    def moe_experts(self, layer, z, ids, weights):
        """Routed sum, FP32 [N, L] (graph_ops.moe_experts: gathered or every-expert, by shape)."""
        beta, linear_beta = layer.situ or (0.0, 0.0)
        ws = [(w.packed, w.scale) if w.is_packed else (w.value, None) for w in (layer.w1, layer.w2, layer.w3)]
        packed = ws[0][1] is not None
        pair, scale = self.luts if packed else (None, None)
        if layer.w1.fmt == "nvfp4":
            scale = self.nv_tables[layer]
        return self.ops.moe_experts(
            z,
            ids,
            weights,
            ws[0][0],
            ws[1][0],
            ws[2][0],
            ws[0][1],
            ws[1][1],
            ws[2][1],
            pair,
            scale,
            layer.situ is not None,
            beta,
            linear_beta,
            layer.a8,
        )

    # ---- the model around the layers
    def attnres_mix(self, bank, w, eps):
        return self.ops.attnres_mix(bank, w, eps)

    def attnres_vectors(self, model):
        return self.vectors if self.vectors is not None else model.attnres_vectors()

    def logits(self, hidden, head):
        return dense(hidden, head).float()

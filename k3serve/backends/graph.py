"""The `graph` backend: a decode step that compiles whole and can be captured as a CUDA graph.

Given a `StaticStep` (forward/static.py: one token per row, every index a device tensor of a
fixed shape) each layer runs fixed-shape, sync-free torch: no `.item()` / `.tolist()` /
`nonzero` / `bincount`, no CPU index into a device tensor, no per-step weight copy (the fp32
`kv_b` and the concatenated conv weights are prepared once, `prepare`). State and latent
writes are `index_copy_` through the step's slots and rows; padding rows hit the scratch slot
and block. Anything else (prefill chunks, verify passes, mixed steps) runs the torch reference,
eagerly; `runner/graph_step.py` compiles and captures the static step per batch bucket.

The arithmetic is the reference's decode arithmetic (kda_step, short_conv_step, the batched
absorbed attention), so greedy tokens agree with the `torch` backend; tests/model/test_graph.py
compares them layer by layer and over whole generations.
"""

from __future__ import annotations

import torch

from k3serve.backends import Backend
from k3serve.layers.gemm import dense
from k3serve.layers.kda_ops import kda_step
from k3serve.layers.mla import attend_absorbed_batched, to_cache
from k3serve.layers.router import route
from k3serve.layers.short_conv import short_conv_step
from k3serve.weights.mxfp4 import PackedMXFP4, decode_tables


class GraphBackend(Backend):
    name = "graph"

    def __init__(self, static_rows: int = 512):
        # MoE blocks of at most this many rows (every static step's) take the sync-free experts;
        # longer ones (eager prefill chunks) the reference's sort, which reads each expert once
        self.static_rows = static_rows
        self.conv_w: dict[int, torch.Tensor] = {}  # KDA layer -> [3P, K] fp32
        self.kv_b: dict[int, torch.Tensor] = {}  # MLA layer -> [H, n + v, c] fp32
        self.vectors: list[torch.Tensor] | None = None  # AttnRes score vectors, fp32 [d] each
        self.luts: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # MXFP4 decode tables

    @torch.no_grad()
    def prepare(self, model) -> None:
        """Weights in the form the step computes with, once (after the last load or move)."""
        from k3serve.layers.kda import KimiDeltaAttention
        from k3serve.layers.mla import GatedMLA

        for m in model.modules():
            if isinstance(m, KimiDeltaAttention):
                self.conv_w[m.layer_idx] = m.conv_weight()
            elif isinstance(m, GatedMLA):
                self.kv_b[m.layer_idx] = m.kv_b_proj.weight.float().view(m.cfg.num_heads, -1, m.cfg.kv_lora_rank)
        if model.cfg.use_attnres:
            self.vectors = model.model.attnres_vectors()
        dtype, device = model.dtype, model.head.device
        self.luts[dtype] = decode_tables(device, dtype)  # not the shared cache: prepare may run on fake tensors

    # ---- attention: static steps here, everything else the reference
    def kda(self, layer, x, batch, cache):
        if not batch.static:
            return layer.reference(x, batch, cache)
        N, H, D = x.shape[0], layer.heads, layer.head_dim
        u, z, b, gate = layer.projections(x)  # [N, 3P], [N, P], [N, H], [N, P] fp32
        rec, conv = cache.recurrent[layer.layer_idx], cache.conv[layer.layer_idx]
        c, conv_new = short_conv_step(u, self.conv_w[layer.layer_idx], conv.index_select(0, batch.slots))
        conv.index_copy_(0, batch.slots, conv_new)
        q, k, v = layer._qkv(c)
        o, state = kda_step(q, k, v, layer._decay(z).view(N, H, D), torch.sigmoid(b), rec.index_select(0, batch.slots))
        rec.index_copy_(0, batch.slots, state)
        return layer.o_proj(layer._gated_norm(o, gate).to(x.dtype))

    def mla(self, layer, x, batch, cache):
        if not batch.static:
            return layer.reference(x, batch, cache)
        m = layer.cfg
        q, latent = layer.project(x)  # [N, H, n + r] fp32, [N, c + r]
        store = cache.latent[layer.layer_idx]
        store.index_copy_(0, batch.cache_rows, to_cache(latent, store.dtype))
        seq = store[batch.context_rows].float()  # [B, W * bs, c + r]
        out = attend_absorbed_batched(q[..., : m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:],
                                      seq[..., : m.kv_lora_rank], seq[..., m.kv_lora_rank:], batch.lens,
                                      self.kv_b[layer.layer_idx], m.v_head_dim, layer.scale)
        return layer.output(out, x)

    # ---- MoE: the route and the experts without a host sync
    def moe(self, layer, x):
        if layer.ep is not None or layer.tp.size > 1:
            raise NotImplementedError("the graph backend runs one rank; tensor / expert parallel use 'torch' or 'cpp'")
        if x.shape[0] > self.static_rows:
            return layer.reference(x)
        return layer.single_rank(x, lambda z, ids, w: self.moe_experts(layer, z, ids, w))

    def moe_route(self, layer, x):
        return route(x, layer.gate.weight, layer.gate.e_score_correction_bias, layer.cfg)

    def moe_experts(self, layer, z, ids, weights):
        """Routed sum, FP32 [N, L], with shapes fixed by N: when the N * k assignments are fewer
        than the experts, each assignment's expert is gathered ([N*k, out, in], exactly the
        selected weights read); otherwise every expert runs on every row, weighted by the
        row's routing weight for it (zero when not chosen): E matrices read, no sort, no count."""
        N, k = ids.shape
        E = layer.w1.shape[0]
        w1, w2, w3 = (self._experts(w, z.dtype) for w in (layer.w1.value, layer.w2.value, layer.w3.value))
        if N * k <= E:
            flat = ids.reshape(-1)
            xs = z.repeat_interleave(k, 0).unsqueeze(1)  # [N*k, 1, in]
            h = layer.act(torch.bmm(xs, w1(flat).transpose(1, 2)), torch.bmm(xs, w3(flat).transpose(1, 2)))
            y = torch.bmm(h, w2(flat).transpose(1, 2)).view(N, k, -1)  # [N, k, out]
            return (y.float() * weights.float().unsqueeze(-1)).sum(1)
        every = torch.arange(E, device=z.device)
        h = layer.act(torch.einsum("ni,eoi->eno", z, w1(every)), torch.einsum("ni,eoi->eno", z, w3(every)))
        y = torch.einsum("eni,eoi->eno", h, w2(every))  # [E, N, out]
        dense_w = torch.zeros(N, E, dtype=torch.float32, device=z.device).scatter_(1, ids, weights.float())
        return torch.einsum("ne,eno->no", dense_w, y.float())

    def _experts(self, w, dtype):
        """ids [M] -> those experts' matrices [M, out, in] in `dtype` (MXFP4 decoded by table)."""
        if isinstance(w, PackedMXFP4):
            pair, scales = self.luts[dtype]

            def select(ids):
                packed, scale = w.packed[ids], w.scale[ids]
                vals = pair[packed.to(torch.int64)].view(*packed.shape[:-1], -1, 32)
                return (vals * scales[scale.to(torch.int64)].unsqueeze(-1)).view(*packed.shape[:-1], -1)
            return select
        return lambda ids: w[ids].to(dtype)

    # ---- the model around the layers
    def attnres_vectors(self, model):
        return self.vectors if self.vectors is not None else model.attnres_vectors()

    def logits(self, lm, hidden):
        return dense(hidden, lm.head).float()

"""The `triton` backend: the graph backend's static step with the GPU kernels inside it.

Everything the `graph` backend does (backends/graph.py: the fixed-shape decode and verify steps
that runner/graph_step.py compiles and captures per batch bucket), with three cores replaced by
Triton kernels (k3serve/kernels/triton, registered as `k3serve::triton_*` custom ops): KDA
decode and verify through fla-core's fused recurrent kernel and our short-conv update (a verify
pass writing each position's state to its own slot), paged MLA decode through the block table,
and the MoE experts as grouped GEMMs reading MXFP4 packed (every row count, prefill included).
Eager prefill steps run KDA through our varlen short-conv kernel and fla-core's varlen
`chunk_kda` (every sequence from its slot's window and state, one call each); MLA prefill stays the
reference's fused attention. On CUDA
this is what `auto` picks; on a CPU it runs only under Triton's interpreter, for the tests.
"""

from __future__ import annotations

import sys

import torch

from k3serve.backends.graph import GraphBackend


class TritonBackend(GraphBackend):
    name = "triton"

    def __init__(self, inline: bool = False):
        from k3serve.kernels.triton import ops

        # every MoE block takes the grouped kernels, eager prefill chunks too (no row limit)
        super().__init__(static_rows=sys.maxsize, inline=inline)
        self.kernels_ops = ops.BODIES if inline else ops.OPS
        self.a_log: dict[int, torch.Tensor] = {}  # KDA layer -> A_log [H] fp32 (the kernel's gate input)

    @torch.no_grad()
    def prepare(self, model) -> None:
        from k3serve.layers.kda import KimiDeltaAttention

        super().prepare(model)
        for m in model.modules():
            if isinstance(m, KimiDeltaAttention):
                self.a_log[m.layer_idx] = m.A_log.float()

    @property
    def core_ops(self):
        return self.kernels_ops

    def kda_gate(self, i: int) -> torch.Tensor:
        return self.a_log[i]

    def kda_layer(self, layer, x, batch, cache):
        """Static steps: the graph backend's (the fused recurrent kernel). An eager step without
        a verify pass (prefill chunks, with any decode rows beside them): every sequence in one
        varlen `chunk_kda` call from its slot's state; a verify pass keeps the reference (its
        per-position records)."""
        if batch.static or batch.verify:
            return super().kda_layer(layer, x, batch, cache)
        from k3serve.kernels.triton.kda import kda_prefill
        from k3serve.kernels.triton.short_conv import short_conv_varlen

        i, N = layer.layer_idx, x.shape[0]
        u, z, b, gate = layer.projections(x)
        conv_w, rec, conv = self.kda_w[i][0], cache.recurrent[i], cache.conv[i]
        bounds = batch.seq_bounds()
        seqs = [j for j, (s, e) in enumerate(bounds) if e > s]
        lens = [bounds[j][1] - bounds[j][0] for j in seqs]
        slots = batch.index(("prefill slots", tuple(seqs)), [batch.state_slots[j] for j in seqs])
        # each sequence from its slot's conv window and recurrent state (a new sequence's were zeroed)
        q, k, v = layer.qkv(short_conv_varlen(u, conv_w, conv, slots, lens))
        g = layer.decay(z).view(N, layer.heads, layer.head_dim)
        o = kda_prefill(q, k, v, g, torch.sigmoid(b), rec, slots, lens)
        return layer.o_proj(layer.gated_norm(o, gate).to(x.dtype))

    def mla_pages(self, batch) -> tuple:
        """The paged kernel reads block tables [B, max blocks] and the block size."""
        return batch.table, (batch.block_size,)

    def moe_experts(self, layer, z, ids, weights):
        """Routed sum, FP32 [N, L]: the grouped GEMM kernels, packed experts read packed."""
        beta, linear_beta = layer.situ or (0.0, 0.0)
        ws = [(w.packed, w.scale) if w.is_packed else (w.value, None) for w in (layer.w1, layer.w2, layer.w3)]
        return self.kernels_ops.moe_experts(
            z,
            ids,
            weights,
            ws[0][0],
            ws[1][0],
            ws[2][0],
            ws[0][1],
            ws[1][1],
            ws[2][1],
            layer.situ is not None,
            beta,
            linear_beta,
            layer.a8,
            self.nv_tables.get(layer),
        )

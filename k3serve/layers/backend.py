"""The `torch` backend, the reference every other one is tested against (backends/): each
method runs the layer's own `reference` body. It lives here, beside the layers that hold it as
their default (`layer.backend = TORCH`), so that layers never import backends/; the fast
backends subclass it there and `backends.select` picks one per engine."""

from __future__ import annotations

import torch


class Backend:
    """The torch reference. Two kinds of entry point:

    - ops, tensors in and tensors out (and the step's plan where a shape depends on it):
      `rms_norm`, `moe_route`, `logits`, `attnres_mix`, `moe_experts`' rows;
    - whole-layer entry points, named so (`kda_layer`, `mla_layer`, `glu_layer`, `moe_layer`,
      `decode_stack`), kept for the fused kernels that take a layer's weights in their own
      packed form, built once per layer (backends/cpu.py packs, the graph and Triton steps'
      weights): the reference runs the layer's own `reference` body, composed of the layer's
      public pieces. No backend calls a layer's private methods."""

    name = "torch"
    kernels = None  # the compiled module of a kernel backend

    def prepare(self, model) -> None:
        """Weights in the backend's own form, once the model is loaded and placed (none here)."""

    def experts_moved(self, layer) -> None:
        """EPLB rewrote a MoE layer's expert weights in place (runner/eplb.py): forms derived
        from them are rebuilt (none here)."""

    def kda_layer(self, layer, x: torch.Tensor, batch, cache) -> torch.Tensor:
        return layer.reference(x, batch, cache)

    def mla_layer(self, layer, x: torch.Tensor, batch, cache) -> torch.Tensor:
        return layer.reference(x, batch, cache)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        from k3serve.layers.norm import rms_norm

        return rms_norm(x, weight, eps)

    def glu_layer(self, layer, x: torch.Tensor) -> torch.Tensor:
        return layer.reference(x)

    # ---- the MoE block: its route (parallel layout) is the layer's, its pieces the backend's
    def moe_layer(self, layer, x: torch.Tensor, batch=None) -> torch.Tensor:
        """`batch`: the step (DP-attention's static step fixes the token exchange's rows)."""
        if layer.ep is not None:
            return layer.dp_ep_forward(x, self, batch)
        if layer.tp.size > 1:
            return layer.partial_forward(x, self)
        return layer.reference(x)

    def moe_route(
        self, x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, cfg
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d], the router's weight [E, d] and correction bias [E], the MoE config ->
        expert ids [N, k], weights [N, k] (fp32)."""
        from k3serve.layers.router import route

        return route(x, gate, bias, cfg)

    def moe_down(self, layer, x: torch.Tensor) -> torch.Tensor:
        """The experts' input [N, L]: the latent down projection, or x itself."""
        return layer.routed_expert_down_proj(x) if layer.cfg.latent_size is not None else x

    def moe_local_experts(
        self, layer, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, counted: slice
    ) -> torch.Tensor:
        """Expert parallelism: the routed sum over this rank's experts, FP32 [N, L] (the layer's
        row selection: the (token, slot) pairs routed here, one row each, added back per token)."""
        return layer.select_local_experts(z, ids, weights, self, counted)

    def moe_experts(self, layer, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Routed sum over the layer's experts (local ids), FP32 [N, L]."""
        from k3serve.layers.experts import experts_forward

        return experts_forward(z, ids, weights, layer.w1.value, layer.w2.value, layer.w3.value, layer.act, layer.a8)

    # ---- the model around the layers
    def decode_stack(self, model, batch, h: torch.Tensor):
        """A whole-stack kernel for this step, or None: every layer runs on its own."""
        return None

    def attnres_mix(self, bank: list[torch.Tensor], w: torch.Tensor, eps: float) -> torch.Tensor:
        from k3serve.layers.attnres import attnres_mix

        return attnres_mix(bank, w, eps)

    def attnres_vectors(self, model) -> list[torch.Tensor]:
        return model.attnres_vectors()

    def logits(self, hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """hidden [R, d], this rank's vocabulary rows [V / N, d] -> fp32 [R, V / N]."""
        from k3serve.layers.gemm import dense

        return dense(hidden, head).float()


TORCH = Backend()

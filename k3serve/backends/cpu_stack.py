"""The `cpp` backend's decode stack: a whole decode / verify step through every layer in one
compiled call (kernels/cpu/fused/decode_stack.cpp), built once per model from the layers'
block-kernel arguments; `CpuKernels` (backends/cpu.py) runs it when the step is one the stack
runs exactly as the layers would, and its reference is the layer-by-layer path
(`stack_enabled = False`; tests/model/test_block_kernels.py holds the two bit-for-bit equal)."""

from __future__ import annotations

import weakref

import torch

from k3serve.backends.cpu_args import DENSE_KERNEL_ROWS, glu_scalars, moe_scalars

KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what the compiled kernels read


class DecodeStacks:
    """The decode-stack half of CpuKernels (a mixin: it reads the backend's kernels module, its
    weight packs; `init_stacks` sets its own state)."""

    def init_stacks(self) -> None:
        # model -> its DecodeStack (False: it has none), the cache's tensors in stack order with
        # its KDA layers, and whether every MoE layer takes its block per (dtype, few rows)
        self._stacks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.stack_enabled = True  # False: every step layer by layer (the stack's reference in tests)

    def decode_stack(self, model, batch, h):
        """The compiled decode stack (kernels/cpu/fused/decode_stack.cpp) when this step is one it
        runs as the layers would: decode and verify rows only (no media), in step order, every
        block on its block kernel; else None. Built once per model."""
        step = batch.step
        if (
            not self.stack_enabled
            or not self.takes(h)
            or h.dtype not in KERNEL_DTYPES
            or model.tp.size > 1
            or not step.seqs
            or not (step.covers_all and step.identity)
            or batch.media_rows is not None
        ):
            return None
        held = self._stacks.get(model)
        if held is None:
            held = self._stacks[model] = {"stack": self._build_stack(model) or False, "takes": {}, "states": None}
        # whether every MoE layer runs its block kernel: fixed per dtype and row class
        # (moe_takes_block, ~1.5 us a layer, asked once per kind of step)
        kind = (h.dtype, h.shape[0] <= DENSE_KERNEL_ROWS)
        if kind not in held["takes"]:
            moes = [l.block_sparse_moe for l in model.layers if hasattr(l, "block_sparse_moe")]
            held["takes"][kind] = all(self.moe_takes_block(m, h) for m in moes)
        return held["stack"] if held["stack"] and held["takes"][kind] else None

    def stack_of(self, model):
        """The DecodeStack built for `model`, or None (none built yet, or it has none)."""
        held = self._stacks.get(model)
        return held["stack"] or None if held is not None else None

    def _build_stack(self, model):
        """A DecodeStack of every layer's block arguments, or None where a layer has no block
        kernel (experts split over ranks)."""
        from k3serve.layers.kda import KimiDeltaAttention

        vectors = self.attnres_vectors(model) if model.cfg.use_attnres else []
        stack = self.kernels.DecodeStack(
            model.cfg.rms_norm_eps, model.cfg.attn_res_block_size if vectors else 1, vectors, model.norm.weight
        )
        for layer in model.layers:
            attn = layer.self_attn
            mla = not isinstance(attn, KimiDeltaAttention)
            attn_w = list((self.mla_weights(attn) if mla else self.kda_weights(attn)).args)
            attn_i, attn_f = self.mla_scalars(attn) if mla else self.kda_scalars(attn)
            moe = getattr(layer, "block_sparse_moe", None)
            if moe is not None and (moe.ep is not None or moe.tp.size > 1 or not block_experts(moe)):
                return None
            ffn = list((self.moe_weights(moe) if moe is not None else self.glu_weights(layer.mlp)).args)
            ffn_i, ffn_f = moe_scalars(moe) if moe is not None else glu_scalars(layer.mlp)
            stack.add_layer(
                int(mla),
                layer.input_layernorm.weight,
                attn_w,
                attn_i,
                attn_f,
                int(moe is None),
                layer.post_attention_layernorm.weight,
                ffn,
                ffn_i,
                ffn_f,
            )
        return stack

    def run_stack(self, model, stack, h, batch, cache, capture):
        """One DecodeStack call -> the final hidden states (the model's last norm applied, as
        KimiModel.forward's other paths return them); a verify pass's KDA records are allocated and kept as each KDA
        block does, the tap layers' outputs land in `capture`."""
        from k3serve.layers.kda import KimiDeltaAttention

        step, held = batch.step, self._stacks[model]
        if held["states"] is None or held["states"][0] is not cache:  # listed once per cache
            kdas = [(i, l.self_attn) for i, l in enumerate(model.layers) if isinstance(l.self_attn, KimiDeltaAttention)]
            states = [
                t
                for i in range(len(model.layers))
                for t in ((cache.conv[i], cache.recurrent[i]) if cache.latent[i] is None else (cache.latent[i],))
            ]
            held["states"] = (cache, states, kdas)
        _, states, kdas = held["states"]
        bufs = (
            [self.kda_records(attn, batch, cache.recurrent[i], cache.conv[i]) for i, attn in kdas]
            if batch.verify
            else []
        )
        taps = list(capture) if capture else []
        out = stack.run(
            h,
            states,
            [t for b in bufs for t in b],
            step.slots,
            step.starts,
            step.cache_rows,
            step.table,
            step.seq,
            step.positions,
            batch.block_size,
            taps,
        )
        for (i, _), b in zip(kdas, bufs):
            batch.keep_kda_records(i, b)
        for i, t in zip(taps, out[1:]):
            capture[i] = t
        return out[0]


def block_experts(layer) -> bool:
    """Whether the block and decode-stack kernels take the MoE layer's experts: MXFP4 or dense,
    inputs in the model dtype. NVFP4 experts and MXFP8 inputs run through the grouped kernels."""
    return layer.w1.fmt != "nvfp4" and not layer.a8

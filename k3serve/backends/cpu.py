"""The `cpp` backend: the compiled CPU kernels (k3serve.kernels, kernels/cpu/*.cpp) for the
rows they take; each layer's torch `reference` for the rest.

Per attention layer and step (StepRows, forward/batch.py):
- every row a decode or verify position (`step.covers_all`): the whole block in one call
  (blocks.cpp kda_block / mla_block);
- a mixed step: the decode / verify rows through kda_decode / mla_decode, KDA prefill chunks
  through kda_decode's stepwise recurrence (faster than the chunked form on a CPU), MLA prefill
  through the layer's torch attention;
- grad enabled or tensors off the CPU: the reference, unchanged;
- a whole decode / verify step in one call where it runs as the layers would: backends/cpu_stack.py.

Each layer's kernel arguments (projections in panel form, kernels/packs.py kernel_matrix) are
built once and kept here, keyed by the layer, until `reset()` (a load or a move).
"""

from __future__ import annotations

import itertools
import weakref
from functools import partial

import torch

from k3serve.backends import Backend
from k3serve.backends.cpu_args import DENSE_KERNEL_ROWS, big_experts, glu_scalars, moe_scalars
from k3serve.backends.cpu_stack import KERNEL_DTYPES, DecodeStacks, block_experts
from k3serve.forward import RECORDS_IN_FLIGHT
from k3serve.kernels.packs import GluPack, KdaPack, MlaPack, MoePack, kernel_experts, kernel_matrix
from k3serve.layers.gemm import SMALL_M
from k3serve.layers.experts import experts_forward
from k3serve.forward.cache import to_cache
from k3serve.layers.mla import MLA_NORM_EPS
from k3serve.layers.router import route_scalars


class CpuKernels(DecodeStacks, Backend):
    name = "cpp"

    def __init__(self, module):
        self.kernels = module
        self._packs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> its kernel arguments
        self._head_pack = None
        # layer -> [RECORDS_IN_FLIGHT entries of (flat record stores, ((S, T, device), their
        # views)), the next one's index]: verify passes' records, the stores reused in turn pass
        # after pass (two allocations per layer cost ~2 us a verify step each)
        self._records: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.init_stacks()

    def experts_moved(self, layer) -> None:
        """The MoE layer's kernel arguments (kernel_experts may re-lay its experts out) and the
        decode stacks built from them are made again when next met."""
        self._packs.pop(layer, None)
        self._stacks.clear()

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and not torch.is_grad_enabled()

    # ---- Kimi Delta Attention ------------------------------------------------------------
    def kda_layer(self, layer, x, batch, cache):
        step = batch.step
        if not self.takes(x):
            return layer.reference(x, batch, cache)
        if step.seqs and step.covers_all:  # a pure decode / verify step: the whole block in one call
            return self._kda_block(layer, x, batch, cache)
        u, z, b, gate = layer.projections(x)
        conv_w = layer.conv_weight()  # [3P, K]
        y = torch.empty(x.shape[0], u.shape[1] // 3, dtype=torch.float32, device=x.device)
        if step.seqs:  # decode / verify rows and short prefill chunks, position by position
            y[step.rows] = self._kda_stepwise(layer, u, conv_w, z, b, gate, batch, cache)
        stepped = set(step.seqs)
        prefill = [i for i in range(batch.num_seqs) if i not in stepped and batch.seq_lens[i]]
        if prefill:
            rows, y_rows = self._kda_prefill(layer, prefill, u, conv_w, z, b, gate, batch, cache)
            y[rows] = y_rows
        return layer.o_proj(y.to(x.dtype))

    def kda_weights(self, layer) -> KdaPack:
        """kda_block's weights (kernels/packs.py), built once; with kda_scalars, what the decode
        stack (kernels/cpu/fused/decode_stack.cpp) takes for this layer."""
        pack = self._packs.get(layer)
        if pack is None:
            mat = lambda w: kernel_matrix(w, self.kernels)  # noqa: E731 - the projections in kernel form
            low_rank = not hasattr(layer, "g_proj")
            pack = self._packs[layer] = KdaPack(
                q_proj=mat(layer.q_proj.weight),
                k_proj=mat(layer.k_proj.weight),
                v_proj=mat(layer.v_proj.weight),
                f_a_proj=mat(layer.f_a_proj.weight),
                f_b_proj=mat(layer.f_b_proj.weight),
                b_proj=mat(layer.b_proj.weight),
                g_proj=mat(layer.g_a_proj.weight if low_rank else layer.g_proj.weight),
                g_b_proj=mat(layer.g_b_proj.weight) if low_rank else None,
                o_proj=mat(layer.o_proj.weight),
                q_conv=layer.q_conv1d.weight,
                k_conv=layer.k_conv1d.weight,
                v_conv=layer.v_conv1d.weight,
                dt_bias=layer.dt_bias,
                a_log=layer.A_log,
                o_norm=layer.o_norm.weight,
            )
        return pack

    @staticmethod
    def kda_scalars(layer) -> tuple[list[int], list[float]]:
        return [], [_lower_bound(layer), layer.eps]

    def _kda_block(self, layer, x, batch, cache) -> torch.Tensor:
        """Projections, conv, delta rule, gated norm and o_proj in one compiled call."""
        step, i = batch.step, layer.layer_idx
        rec, conv = cache.recurrent[i], cache.conv[i]
        bufs = self.kda_records(layer, batch, rec, conv)
        y = self.kernels.kda_block(
            x if step.identity else x[step.rows],
            *self.kda_weights(layer).args,
            conv,
            rec,
            step.slots,
            step.starts,
            _lower_bound(layer),
            layer.eps,
            *bufs,
        )
        batch.keep_kda_records(i, bufs)
        return y if step.identity else y.new_empty(y.shape).index_copy_(0, step.rows, y)

    def _kda_stepwise(self, layer, u, conv_w, z, b, gate, batch, cache) -> torch.Tensor:
        """Decode and verify rows of a mixed step in one compiled call (kernels/cpu/ops/kda_decode.cpp)."""
        step, i = batch.step, layer.layer_idx
        rec, conv = cache.recurrent[i], cache.conv[i]
        bufs = self.kda_records(layer, batch, rec, conv)
        r = step.rows
        y = self.kernels.kda_decode(
            u[r],
            conv_w,
            z[r],
            b[r],
            gate[r],
            layer.dt_bias,
            layer.A_log,
            layer.o_norm.weight,
            conv,
            rec,
            step.slots,
            step.starts,
            _lower_bound(layer),
            layer.eps,
            *bufs,
        )
        batch.keep_kda_records(i, bufs)
        return y

    def _kda_prefill(self, layer, seqs, u, conv_w, z, b, gate, batch, cache):
        """Prefill chunks with the compiled kernels: kda_decode's stepwise recurrence, row after
        row from each sequence's slot (a new sequence's the model zeroed: StepRows.fresh). On 2
        cores it beats the chunked torch form (kda_chunked, the reference): a 512-token layer of
        tiny K3 0.7 vs 4.5 ms, of the 400 M Kimi-Linear 18.5 vs 24.9 ms, within 4e-6 of it.
        -> (rows, y [rows, P])."""
        i = layer.layer_idx
        rec, conv = cache.recurrent[i], cache.conv[i]
        bounds = batch.seq_bounds()
        key = tuple(seqs)
        rows = batch.index(("prefill rows", key), [r for j in seqs for r in range(*bounds[j])])
        starts = batch.index(("prefill starts", key), [0, *itertools.accumulate(batch.seq_lens[j] for j in seqs)])
        slots = batch.index(("prefill slots", key), [batch.state_slots[j] for j in seqs])
        y = self.kernels.kda_decode(
            u[rows],
            conv_w,
            z[rows],
            b[rows],
            gate[rows],
            layer.dt_bias,
            layer.A_log,
            layer.o_norm.weight,
            conv,
            rec,
            slots,
            starts,
            _lower_bound(layer),
            layer.eps,
            None,
            None,
        )
        return rows, y

    def kda_records(self, layer, batch, rec: torch.Tensor, conv: torch.Tensor):
        """Per-position state buffers [S, T, ...] for a verify pass, else (None, None): views of
        one of this layer's RECORDS_IN_FLIGHT record stores, taken in turn, grown as needed (the
        records live until the pass's rollback, which under pipeline stages may follow the next
        pass: one store would then hold the later pass's states)."""
        if not batch.verify:
            return None, None
        S, T = len(batch.step.seqs), batch.step.longest
        ring = self._records.get(layer)
        if ring is None:
            ring = self._records[layer] = [[None] * RECORDS_IN_FLIGHT, 0]
        i = ring[1]
        ring[1] = (i + 1) % RECORDS_IN_FLIGHT
        held = ring[0][i]
        if held is not None and held[1][0] == (S, T, rec.device):
            return held[1][1]  # the same shape as this store's last pass: its views (~3 us a layer)
        n_rec, n_conv = S * T * rec[0].numel(), S * T * conv[0].numel()
        store = held[0] if held is not None else None
        if store is None or store[0].numel() < n_rec or store[1].numel() < n_conv or store[0].device != rec.device:
            store = (torch.empty(n_rec, device=rec.device), torch.empty(n_conv, device=conv.device))
        views = store[0][:n_rec].view(S, T, *rec.shape[1:]), store[1][:n_conv].view(S, T, *conv.shape[1:])
        ring[0][i] = (store, ((S, T, rec.device), views))
        return views

    # ---- gated MLA -----------------------------------------------------------------------
    def mla_layer(self, layer, x, batch, cache):
        step = batch.step
        if not (self.takes(x) and step.seqs):
            return layer.reference(x, batch, cache)
        if step.covers_all and layer.layer_idx not in cache.calibrating:  # a pure decode / verify step: one call
            return self._mla_block(layer, x, batch, cache)
        m = layer.cfg
        q, latent = layer.project(x)
        store = cache.latent[layer.layer_idx]
        kv_scale = cache.observe(layer.layer_idx, latent)
        # attention is linear in the cached rows: rows x s is softmax scale x s and output x s
        s = 1.0 if kv_scale is None else float(kv_scale)
        out = torch.empty(x.shape[0], m.num_heads, m.v_head_dim, dtype=torch.float32, device=x.device)
        store[step.cache_rows] = to_cache(latent[step.rows], store.dtype, kv_scale)
        o = self.kernels.mla_decode(
            q[step.rows],
            m.qk_nope_head_dim,
            store,
            layer.kv_b_proj.weight.view(m.num_heads, -1, m.kv_lora_rank),
            step.table,
            step.seq,
            step.positions,
            batch.block_size,
            layer.scale * s,
        )
        out[step.rows] = o if kv_scale is None else o * s
        layer.attend_rest(q, latent, batch, store, out, done=set(step.seqs), kv_scale=kv_scale)  # prefill chunks
        return layer.output(out, x)

    def mla_weights(self, layer) -> MlaPack:
        """mla_block's weights (kernels/packs.py), built once; with mla_scalars, what the decode
        stack takes for this layer."""
        pack = self._packs.get(layer)
        if pack is None:
            m = layer.cfg
            mat = lambda w: kernel_matrix(w, self.kernels)  # noqa: E731 - the projections; norms and kv_b as they are
            lora = m.q_lora_rank is not None
            pack = self._packs[layer] = MlaPack(
                q_a_proj=mat(layer.q_a_proj.weight if lora else layer.q_proj.weight),
                q_a_norm=layer.q_a_layernorm.weight if lora else None,
                q_b_proj=mat(layer.q_b_proj.weight) if lora else None,
                kv_a_proj=mat(layer.kv_a_proj_with_mqa.weight),
                kv_a_norm=layer.kv_a_layernorm.weight,
                kv_b_proj=layer.kv_b_proj.weight,
                g_proj=mat(layer.g_proj.weight) if m.use_output_gate else None,
                o_proj=mat(layer.o_proj.weight),
            )
        return pack

    @staticmethod
    def mla_scalars(layer) -> tuple[list[int], list[float]]:
        m = layer.cfg
        return [m.num_heads, m.qk_nope_head_dim, m.kv_lora_rank], [layer.scale, MLA_NORM_EPS]

    def _mla_block(self, layer, x, batch, cache) -> torch.Tensor:
        """Projections, latent norm and cache write, absorbed attention, gate and o_proj in one
        compiled call (kernels/cpu/fused/blocks.cpp mla_block)."""
        m, step = layer.cfg, batch.step
        y = self.kernels.mla_block(
            x if step.identity else x[step.rows],
            *self.mla_weights(layer).args,
            cache.latent[layer.layer_idx],
            step.cache_rows,
            step.table,
            step.seq,
            step.positions,
            batch.block_size,
            layer.scale,
            m.num_heads,
            m.qk_nope_head_dim,
            m.kv_lora_rank,
            MLA_NORM_EPS,
            1.0 if cache.latent_scale is None else float(cache.latent_scale[layer.layer_idx]),
        )
        return y if step.identity else y.new_empty(y.shape).index_copy_(0, step.rows, y)

    # ---- norms, dense MLPs ----------------------------------------------------------------
    def rms_norm(self, x, weight, eps):
        if self.takes(x) and x.is_contiguous() and x.dtype in KERNEL_DTYPES:  # one call instead of ~7 ops
            return self.kernels.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def glu_layer(self, layer, x):
        """Three GEMVs and the GLU in C++ (dense layer 0, shared experts)."""
        if not (self.takes(x) and x.dtype in KERNEL_DTYPES):
            return layer.reference(x)
        k, w = self.kernels, self.glu_weights(layer)
        (act,), (beta, linear_beta) = glu_scalars(layer)
        return k.linear(k.glu(k.linear(x, w.gate), k.linear(x, w.up), act, beta, linear_beta), w.down)

    def glu_weights(self, layer) -> GluPack:
        """gate, up, down in the kernels' form (kernels/packs.py kernel_matrix), built once."""
        pack = self._packs.get(layer)
        if pack is None:
            mat = lambda w: kernel_matrix(w, self.kernels)  # noqa: E731
            pack = self._packs[layer] = GluPack(
                gate=mat(layer.gate_proj.weight), up=mat(layer.up_proj.weight), down=mat(layer.down_proj.weight)
            )
        return pack

    # ---- the MoE block ---------------------------------------------------------------------
    def moe_layer(self, layer, x, batch=None):
        if not self.takes(x) or x.dtype not in KERNEL_DTYPES:
            return super().moe_layer(layer, x, batch)
        if not block_experts(layer):  # the grouped kernels, the layer's torch around them
            if layer.ep is None and layer.tp.size == 1:
                return layer.single_rank(
                    x, partial(self._grouped_experts, layer), lambda x: self.moe_route(x, *layer.router_args)
                )
            return super().moe_layer(layer, x, batch)  # TP / EP: the layer's route, this backend's pieces
        if layer.ep is None and (
            layer.tp.size == 1 or (layer.cfg.latent_size is None and not layer.tp.expert_parallel)
        ):
            # one rank, or channel-split experts + shared experts (already this rank's partial sum)
            if layer.tp.size > 1 or self.moe_takes_block(layer, x):
                return self._moe_block(layer, x)
            return layer.single_rank(x, partial(self._grouped_experts, layer))  # big dense experts, many rows
        return super().moe_layer(layer, x, batch)

    def moe_takes_block(self, layer, x: torch.Tensor) -> bool:
        """Whether the block kernel runs this layer at x's rows (one rank, and experts the
        kernel takes at this many rows: past DENSE_KERNEL_ROWS big dense experts go to torch's
        GEMM, backends/cpu_args.py)."""
        return (
            layer.ep is None
            and layer.tp.size == 1
            and block_experts(layer)
            and self.takes(x)
            and x.dtype in KERNEL_DTYPES
            and (x.shape[0] <= DENSE_KERNEL_ROWS or layer.w1.is_packed or not big_experts(layer))
        )

    def moe_route(self, x, gate, bias, m):
        if not (self.takes(x) and x.dtype in KERNEL_DTYPES):
            return super().moe_route(x, gate, bias, m)
        return self.kernels.moe_route(x, gate, bias, *route_scalars(m))

    def moe_down(self, layer, x):
        if layer.cfg.latent_size is not None and self.takes(x) and x.dtype in KERNEL_DTYPES:
            return self.kernels.linear(x, layer.routed_expert_down_proj.weight)  # as moe_block runs it
        return super().moe_down(layer, x)

    def moe_experts(self, layer, z, ids, weights):
        """kernels/cpu moe_experts: the routed experts alone (MXFP4 on the packed bytes, or
        dense); off the fast path, torch with packed MXFP4 through the grouped kernels."""
        if not (self.takes(z) and z.dtype in KERNEL_DTYPES) or not block_experts(layer):
            return self._grouped_experts(layer, z, ids, weights)
        w = self.moe_weights(layer)  # the experts in the form moe_block takes them (the same bits)
        beta, linear_beta = layer.situ or (0.0, 0.0)
        return self.kernels.moe_experts(
            z.float().contiguous(),
            ids.contiguous(),
            weights.contiguous(),
            w.w1,
            w.w1_scale,
            w.w3,
            w.w3_scale,
            w.w2,
            w.w2_scale,
            int(layer.situ is not None),
            beta,
            linear_beta,
            z.dtype == torch.bfloat16,
        )

    def _grouped_experts(self, layer, z, ids, weights):
        """torch's experts, packed MXFP4 / NVFP4 through the grouped kernels (layers/experts.py)."""
        return experts_forward(
            z, ids, weights, layer.w1.value, layer.w2.value, layer.w3.value, layer.act, layer.a8, kernels=self.kernels
        )

    def moe_weights(self, layer) -> MoePack:
        """moe_block's weights (kernels/packs.py, None where absent), built once; with
        moe_scalars, what the decode stack (kernels/cpu/fused/decode_stack.cpp) takes for it."""
        pack = self._packs.get(layer)
        if pack is None:
            m = layer.cfg
            latent = m.latent_size is not None
            fp32 = layer.gate.weight.dtype == torch.float32
            (w1, w1_scale), (w3, w3_scale), (w2, w2_scale) = (
                kernel_experts(w, self.kernels, fp32) for w in (layer.w1, layer.w3, layer.w2)
            )
            shared = self.glu_weights(layer.shared_experts) if m.num_shared_experts else None
            mat = lambda w: kernel_matrix(w, self.kernels)  # noqa: E731
            pack = self._packs[layer] = MoePack(
                gate=layer.gate.weight,
                score_bias=layer.gate.e_score_correction_bias,
                latent_down=mat(layer.routed_expert_down_proj.weight) if latent else None,
                latent_norm=layer.routed_expert_norm.weight if latent and m.latent_use_norm else None,
                latent_up=mat(layer.routed_expert_up_proj.weight) if latent else None,
                w1=w1,
                w1_scale=w1_scale,
                w3=w3,
                w3_scale=w3_scale,
                w2=w2,
                w2_scale=w2_scale,
                shared_gate=shared.gate if shared else None,
                shared_up=shared.up if shared else None,
                shared_down=shared.down if shared else None,
            )
        return pack

    def _moe_block(self, layer, x):
        """Router, routed experts, latent norm / up projection and shared experts in one compiled
        call (kernels/cpu/fused/blocks.cpp moe_block), for any number of rows."""
        ints, floats = moe_scalars(layer)
        return self.kernels.moe_block(
            x, *self.moe_weights(layer).args, ints[0], bool(ints[1]), bool(ints[2]), floats[0], *ints[3:], *floats[1:]
        )

    # ---- the model around the layers --------------------------------------------------------
    def attnres_mix(self, bank, w, eps):
        if self.takes(bank[0]):
            return self.kernels.attnres_mix(bank, w, eps)
        return super().attnres_mix(bank, w, eps)

    def attnres_vectors(self, model):
        """Computed once per model (the weights are fixed while serving); with grad, every call."""
        if torch.is_grad_enabled():
            return model.attnres_vectors()
        pack = self._packs.get(model)
        if pack is None:
            pack = self._packs[model] = model.attnres_vectors()
        return pack

    def logits(self, hidden, head):
        if not (self.takes(hidden) and hidden.dim() == 2 and hidden.dtype == head.dtype):
            return super().logits(hidden, head)
        if hidden.shape[0] <= SMALL_M:  # decode / verify rows: the GEMV, on fp32 panels where they pay
            held = self._head_pack  # (a weak reference to the head, its panel form): one model, one head
            if held is None or held[0]() is not head:
                held = self._head_pack = (weakref.ref(head), kernel_matrix(head, self.kernels))
            head = held[1]
        return self.kernels.linear(hidden, head).float()  # torch's bf16 GEMM cost ~90 us for a decode row here


def _lower_bound(layer) -> float:
    return float("nan") if layer.lower_bound is None else float(layer.lower_bound)

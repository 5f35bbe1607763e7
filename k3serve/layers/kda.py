"""Kimi Delta Attention layer (k3-model-spec.md §3; HF-REF `KimiDeltaAttention`).

x [N, d] (normed) -> q/k/v proj [N, P] -> short conv (state) + SiLU -> per-head l2norm,
q * D^-1/2 -> beta = sigmoid(b_proj x) -> decay g (K3: lb * sigmoid(exp(A_log) z); Kimi-Linear:
-exp(A_log) softplus(z), z = f_b(f_a x) + dt_bias) -> gated delta rule (chunked for prefill,
one batched recurrent step for decodes) -> RMSNorm_D(o) * sigmoid(gate) -> o_proj.
States live in `CacheTensors` rows chosen by the batch's state slots.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from k3serve.config.model_config import ModelConfig
from k3serve.distributed.group import NO_TP, TPGroup
from k3serve.layers.common import WeightOnly, kernel_matrix, linear
from k3serve.layers.kda_ops import flush_denormals, kda_chunked, kda_step
from k3serve.layers.norm import l2_normalize, rms_norm
from k3serve.layers.short_conv import short_conv, short_conv_step
from k3serve.forward import CacheTensors, ForwardBatch

_NONE = torch.empty(0)  # an absent weight, for the block kernels


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup = NO_TP):
        super().__init__()
        k, d = cfg.kda, cfg.hidden_size
        # under tensor parallelism this rank holds heads H/N (every per-channel tensor follows
        # its heads; f_a / g_a and o_norm are shared by all heads, so replicated); o_proj then
        # gives a partial sum the decoder layer all-reduces
        heads = tp.split(k.num_heads, "linear_attn_config.num_heads")
        self.layer_idx, self.heads, self.head_dim = layer_idx, heads, k.head_dim
        self.lower_bound, self.eps = k.gate_lower_bound, cfg.rms_norm_eps
        P = heads * k.head_dim
        self.q_proj, self.k_proj, self.v_proj = linear(P, d), linear(P, d), linear(P, d)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (WeightOnly(P, 1, k.conv_kernel) for _ in range(3))
        self.f_a_proj, self.f_b_proj = linear(k.head_dim, d), linear(P, k.head_dim)
        self.dt_bias = nn.Parameter(torch.zeros(P))
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.b_proj = linear(heads, d)
        if k.use_full_rank_gate:
            self.g_proj = linear(P, d)
        else:
            self.g_a_proj, self.g_b_proj = linear(k.head_dim, d), linear(P, k.head_dim)
        self.o_norm = WeightOnly(k.head_dim)
        self.o_proj = linear(d, P)
        self.kernels = None  # k3serve.kernels module: decode / verify rows in one call (set by use_kernels)
        self._kernel_weights: list[torch.Tensor] | None = None  # the block kernel's arguments, reset by use_kernels
        self._record_store: tuple[torch.Tensor, torch.Tensor] | None = None  # verify records (_records)
        self._record_views: tuple | None = None  # ((S, T, device), the store's views for that shape)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        N = x.shape[0]
        step = batch.step
        compiled = self.kernels is not None and x.device.type == "cpu" and not torch.is_grad_enabled()
        fast = compiled and bool(step.seqs)
        if fast and step.covers_all:  # a pure decode / verify step: the whole block in one call
            return self._block_kernel(x, batch, cache)
        u = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), -1).float()  # [N, 3P]
        z = self.f_b_proj(self.f_a_proj(x)).float()  # [N, P] decay logits before dt_bias
        b = self.b_proj(x).float()  # [N, H] beta logits
        gate = (self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))).float()  # [N, P]
        conv_w = self._conv_weight()  # [3P, K]
        if compiled:  # decode / verify rows and prefill chunks, each kind in one compiled call
            y = torch.empty(N, u.shape[1] // 3, dtype=torch.float32, device=x.device)
            if fast:
                y[step.rows] = self._stepwise_kernel(u, conv_w, z, b, gate, batch, cache)
            stepped = set(step.seqs)
            prefill = [i for i in range(batch.num_seqs) if i not in stepped and batch.seq_lens[i]]
            if prefill:
                rows, y_rows = self._prefill_kernel(prefill, u, conv_w, z, b, gate, batch, cache)
                y[rows] = y_rows
            return self.o_proj(y.to(x.dtype))
        # the torch path (the kernels' reference): batched recurrent decodes, verify passes, chunked prefill
        o = torch.empty(N, self.heads, self.head_dim, dtype=torch.float32, device=x.device)
        beta, g = torch.sigmoid(b), self._decay(z).view(N, self.heads, self.head_dim)
        rec, conv = cache.recurrent[self.layer_idx], cache.conv[self.layer_idx]
        with flush_denormals():
            if batch.verify:
                self._verify(u, conv_w, g, beta, batch, cache, o)
            self._run(step.decodes, u, conv_w, g, beta, batch, rec, conv, o)
        return self.o_proj(self._gated_norm(o, gate).to(x.dtype))

    def _block_kernel(self, x: torch.Tensor, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        """Every row is a decode or verify position: projections, conv, delta rule, gated norm
        and o_proj in one compiled call (kernels/cpu/blocks.cpp kda_block)."""
        step, i = batch.step, self.layer_idx
        rec, conv = cache.recurrent[i], cache.conv[i]
        bufs = self._records(batch, rec, conv)
        y = self.kernels.kda_block(x if step.identity else x[step.rows], self.block_weights(), conv, rec, step.slots,
                                   step.starts, self._lower_bound(), self.eps, *bufs)
        self._keep_records(batch, bufs)
        return y if step.identity else y.new_empty(y.shape).index_copy_(0, step.rows, y)

    def block_weights(self) -> list[torch.Tensor]:
        """kda_block's 15 weights (kernels/cpu/blocks.cpp), built once; with block_scalars, what
        the decode stack (kernels/cpu/decode_stack.cpp) takes for this layer."""
        if self._kernel_weights is None:
            g = [self.g_proj.weight, _NONE] if hasattr(self, "g_proj") else [self.g_a_proj.weight, self.g_b_proj.weight]
            proj = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight, self.f_a_proj.weight,
                    self.f_b_proj.weight, self.b_proj.weight, *g, self.o_proj.weight]
            self._kernel_weights = [*(kernel_matrix(w, self.kernels) for w in proj), self.q_conv1d.weight,
                                    self.k_conv1d.weight, self.v_conv1d.weight, self.dt_bias, self.A_log,
                                    self.o_norm.weight]
        return self._kernel_weights

    def block_scalars(self) -> tuple[list[int], list[float]]:
        return [], [self._lower_bound(), self.eps]

    def _stepwise_kernel(self, u, conv_w, z, b, gate, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        """Decode and verify rows of a mixed step in one compiled call (kernels/cpu/kda_decode.cpp)."""
        step, i = batch.step, self.layer_idx
        rec, conv = cache.recurrent[i], cache.conv[i]
        bufs = self._records(batch, rec, conv)
        r = step.rows
        y = self.kernels.kda_decode(u[r], conv_w, z[r], b[r], gate[r], self.dt_bias, self.A_log, self.o_norm.weight,
                                    conv, rec, step.slots, step.starts, self._lower_bound(), self.eps, *bufs)
        self._keep_records(batch, bufs)
        return y

    def _prefill_kernel(self, seqs, u, conv_w, z, b, gate, batch: ForwardBatch, cache: CacheTensors):
        """Prefill chunks with the compiled kernels: kda_decode's stepwise recurrence, row after
        row from each sequence's slot (a new sequence's the model zeroed: StepRows.fresh). On 2
        cores it beats the chunked torch form (kda_chunked, the reference): a 512-token layer of
        tiny K3 0.7 vs 4.5 ms, of the 400 M Kimi-Linear 18.5 vs 24.9 ms, within 4e-6 of it.
        -> (rows, y [rows, P])."""
        i = self.layer_idx
        rec, conv = cache.recurrent[i], cache.conv[i]
        bounds = batch.seq_bounds()
        rows = torch.cat([torch.arange(*bounds[j]) for j in seqs])
        starts = torch.tensor([0, *itertools.accumulate(batch.seq_lens[j] for j in seqs)])
        slots = torch.tensor([batch.state_slots[j] for j in seqs])
        y = self.kernels.kda_decode(u[rows], conv_w, z[rows], b[rows], gate[rows], self.dt_bias, self.A_log,
                                    self.o_norm.weight, conv, rec, slots, starts, self._lower_bound(), self.eps,
                                    None, None)
        return rows, y

    def _records(self, batch: ForwardBatch, rec: torch.Tensor, conv: torch.Tensor):
        """Per-position state buffers [S, T, ...] for a verify pass, else (None, None): views of
        this layer's record store, grown as needed and reused step after step (the records live
        until the step's rollback; two allocations per layer cost ~2 us a verify step each)."""
        if not batch.verify:
            return None, None
        S, T = len(batch.step.seqs), batch.step.longest
        if self._record_views is not None and self._record_views[0] == (S, T, rec.device):
            return self._record_views[1]  # the same shape as the last verify step: its views (~3 us a layer)
        n_rec, n_conv = S * T * rec[0].numel(), S * T * conv[0].numel()
        store = self._record_store
        if store is None or store[0].numel() < n_rec or store[1].numel() < n_conv or store[0].device != rec.device:
            store = self._record_store = (torch.empty(n_rec, device=rec.device), torch.empty(n_conv, device=conv.device))
        views = store[0][:n_rec].view(S, T, *rec.shape[1:]), store[1][:n_conv].view(S, T, *conv.shape[1:])
        self._record_views = ((S, T, rec.device), views)
        return views

    def _keep_records(self, batch: ForwardBatch, bufs) -> None:
        """Verify sequences come first in `step`, so their records are the buffers' head; they go
        back to the runner in ForwardOut."""
        if batch.verify:
            V = len(batch.verify)
            batch.kda_records[self.layer_idx] = bufs if V == bufs[0].shape[0] else (bufs[0][:V], bufs[1][:V])

    def _lower_bound(self) -> float:
        return float("nan") if self.lower_bound is None else float(self.lower_bound)

    def _conv_weight(self) -> torch.Tensor:
        return torch.cat((self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight), 0).squeeze(1).float()

    def _verify(self, u, conv_w, g, beta, batch, cache, o) -> None:
        """Speculating sequences (last token + drafts): consecutive batched recurrent steps, the
        decode arithmetic, recording the state after every position for rollback (spec/rollback.py)."""
        rec, conv = cache.recurrent[self.layer_idx], cache.conv[self.layer_idx]
        bounds, idx = batch.seq_bounds(), batch.verify
        lens = [batch.seq_lens[i] for i in idx]
        T = max(lens)
        rec_buf = torch.empty(len(idx), T, *rec.shape[1:], device=rec.device)
        conv_buf = torch.empty(len(idx), T, *conv.shape[1:], device=conv.device)
        for t in range(T):
            act = [j for j in range(len(idx)) if lens[j] > t]
            rows = torch.tensor([bounds[idx[j]][0] + t for j in act])
            slots = torch.tensor([batch.state_slots[idx[j]] for j in act])
            c, conv[slots] = short_conv_step(u[rows], conv_w, conv[slots])
            q, k, v = self._qkv(c)
            o[rows], rec[slots] = kda_step(q, k, v, g[rows], beta[rows], rec[slots])
            rec_buf[act, t], conv_buf[act, t] = rec[slots], conv[slots]
        batch.kda_records[self.layer_idx] = (rec_buf, conv_buf)

    def _run(self, decodes, u, conv_w, g, beta, batch, rec, conv, o) -> None:
        bounds = batch.seq_bounds()
        if decodes:
            self._decode(decodes, bounds, u, conv_w, g, beta, batch, rec, conv, o)
        for i, (s, e) in enumerate(bounds):
            if i in decodes or s == e or i in batch.verify:
                continue
            slot = batch.state_slots[i]
            fresh = batch.context_lens[i] == 0  # a new sequence starts from zero state
            c0 = torch.zeros_like(conv[slot]) if fresh else conv[slot]
            s0 = torch.zeros_like(rec[slot]) if fresh else rec[slot]
            c, conv[slot] = short_conv(u[s:e], conv_w, c0)
            q, k, v = self._qkv(c)
            o[s:e], rec[slot] = kda_chunked(q, k, v, g[s:e], beta[s:e], s0)

    def _decode(self, idx, bounds, u, conv_w, g, beta, batch, rec, conv, o) -> None:
        """All single-token decodes of the batch in one vectorized recurrent step."""
        rows = torch.tensor([bounds[i][0] for i in idx])
        slots = torch.tensor([batch.state_slots[i] for i in idx])
        c, conv[slots] = short_conv_step(u[rows], conv_w, conv[slots])
        q, k, v = self._qkv(c)
        o[rows], rec[slots] = kda_step(q, k, v, g[rows], beta[rows], rec[slots])

    def _qkv(self, c: torch.Tensor):
        """Post-conv [T, 3P] -> q (l2norm, * D^-1/2), k (l2norm), v, each [T, H, D]."""
        q, k, v = c.view(c.shape[0], 3, self.heads, self.head_dim).unbind(1)
        return l2_normalize(q) * self.head_dim ** -0.5, l2_normalize(k), v

    def _decay(self, z: torch.Tensor) -> torch.Tensor:
        """Log decay g [N, P] (<= 0), FP32, from z = f_b(f_a x) [N, P]."""
        z = z + self.dt_bias.float()
        a = self.A_log.float().exp().repeat_interleave(self.head_dim)  # per channel
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(a * z)
        return -a * F.softplus(z)

    def _gated_norm(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm_D(o) * sigmoid(gate): o [N, H, D], gate [N, P] fp32 -> [N, P] fp32."""
        y = rms_norm(o, self.o_norm.weight.float(), self.eps) * torch.sigmoid(gate.view_as(o))
        return y.reshape(o.shape[0], -1)

"""DSpark-style parallel drafter (serving-notes.md §3.2), tiny and trainable here.

Reads the target's hidden states at tap layers (`target_layer_ids`, from the draft's
config.json, never hard-coded) at the last committed position, and proposes a whole block of k
tokens in one forward: position 0 carries the newest token, positions 1..k a mask token
(`mask_token_id`); a bidirectional transformer over the block (DFlash-like block diffusion in
one step) gives k logits rows. An optional low-rank Markov head (`markov_rank`) adds
U[x_{i-1}] W to row i, restoring left-to-right dependency inside the block.

  taps [B, n_taps, d_t] -> ctx = RMSNorm(fc(flatten)) [B, h]
  x_j = embed(tok_j) + ctx + pos_j, j = 0..k   -> L blocks (attn + SwiGLU) -> norm -> lm_head
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from k3serve.kernels.packs import kernel_matrix
from k3serve.sampling.logits_process import needs_processing
from k3serve.scheduler.request import Request
from k3serve.spec_decode.drafting import draft_token, request_generator, stack_q
from k3serve.spec_decode.proposer import Draft


@dataclass(frozen=True)
class DSparkConfig:
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    vocab_size: int
    target_hidden_size: int
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 128
    markov_rank: int = 0
    rms_norm_eps: float = 1e-6

    @classmethod
    def from_file(cls, path: Path) -> "DSparkConfig":
        raw = json.loads(path.read_text())
        if raw.get("model_type") != "dspark":
            raise ValueError(f"{path}: model_type must be 'dspark', got {raw.get('model_type')!r}")
        need = ["target_layer_ids", "block_size", "mask_token_id", "vocab_size", "target_hidden_size"]
        missing = [k for k in need if k not in raw]
        if missing:
            raise ValueError(f"{path}: missing {missing}")
        fields = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        fields["target_layer_ids"] = tuple(fields["target_layer_ids"])
        return cls(**fields)

    def to_json(self) -> str:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return json.dumps({"architectures": ["K3DSparkModel"], "model_type": "dspark", **d}, indent=2)


class _Block(nn.Module):
    def __init__(self, c: DSparkConfig):
        super().__init__()
        h = c.hidden_size
        self.heads = c.num_attention_heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(h, eps=c.rms_norm_eps), nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.qkv, self.o = nn.Linear(h, 3 * h, bias=False), nn.Linear(h, h, bias=False)
        self.gate_up, self.down = (
            nn.Linear(h, 2 * c.intermediate_size, bias=False),
            nn.Linear(c.intermediate_size, h, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, T, h]
        B, T, h = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(B, T, 3, self.heads, h // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # bidirectional
        x = x + self.o(a.transpose(1, 2).reshape(B, T, h))
        g, u = self.gate_up(self.mlp_norm(x)).chunk(2, -1)
        return x + self.down(F.silu(g) * u)


class DSparkModel(nn.Module):
    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.cfg, h = c, c.hidden_size
        self.fc = nn.Linear(len(c.target_layer_ids) * c.target_hidden_size, h, bias=False)
        self.ctx_norm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.embed = nn.Embedding(c.vocab_size, h)
        self.pos = nn.Parameter(torch.zeros(c.block_size + 1, h))
        self.layers = nn.ModuleList(_Block(c) for _ in range(c.num_hidden_layers))
        self.norm = nn.RMSNorm(h, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(h, c.vocab_size, bias=False)
        if c.markov_rank:
            self.markov_u = nn.Embedding(c.vocab_size, c.markov_rank)
            self.markov_w = nn.Linear(c.markov_rank, c.vocab_size, bias=False)
        self._kernel_weights: list[torch.Tensor] | None = None  # block_logits' compiled call
        self._markov_weights: tuple[torch.Tensor, torch.Tensor] | None = None  # dspark_greedy's

    def forward(self, taps: torch.Tensor, last_token: torch.Tensor) -> torch.Tensor:
        """taps [B, n_taps, d_t], last_token [B] -> block logits [B, k, V] (Markov bias excluded)."""
        B, k = taps.shape[0], self.cfg.block_size
        ctx = self.ctx_norm(self.fc(taps.reshape(B, -1).to(self.fc.weight.dtype)))  # [B, h]
        toks = torch.full((B, k + 1), self.cfg.mask_token_id, dtype=torch.long, device=taps.device)
        toks[:, 0] = last_token
        x = self.embed(toks) + ctx[:, None] + self.pos[None]
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))[:, 1:]

    def block_logits(self, taps: torch.Tensor, last_token: torch.Tensor, kernels=None) -> torch.Tensor:
        """forward(), through the compiled kernel (kernels/cpu/fused/dspark.cpp) where `kernels` is
        given and the draft is fp32 on the CPU: one call instead of ~40 small torch ops."""
        if not self.compiled(taps, kernels):
            return self(taps, last_token)
        c = self.cfg
        return kernels.dspark_forward(
            taps.reshape(taps.shape[0], -1),
            last_token,
            self.kernel_weights(kernels),
            c.num_attention_heads,
            c.mask_token_id,
            c.rms_norm_eps,
        )

    def greedy_block(self, taps: torch.Tensor, last_token: list[int], ks: list[int], kernels) -> list[list[int]]:
        """Plain greedy drafts (argmax of each block row plus the Markov head's bias for the token
        before it), block_logits and the chain in one compiled call; `compiled` must hold."""
        c = self.cfg
        toks = kernels.dspark_draft(
            taps.reshape(taps.shape[0], -1),
            last_token,
            self.kernel_weights(kernels),
            c.num_attention_heads,
            c.mask_token_id,
            c.rms_norm_eps,
            *self.markov_kernel_weights(),
            ks,
        ).tolist()
        return [[t for t in row if t >= 0] for row in toks]

    def compiled(self, taps: torch.Tensor, kernels) -> bool:
        """Whether the compiled draft kernels take this call: fp32 on the CPU, no gradients."""
        return (
            kernels is not None
            and self.fc.weight.dtype == torch.float32
            and taps.device.type == "cpu"
            and not torch.is_grad_enabled()
        )

    def kernel_weights(self, kernels) -> list[torch.Tensor]:
        """dspark_forward's argument list, its projections in the kernels' form (fp32 panels:
        kernels/packs.py kernel_matrix), built once (a served draft is frozen)."""
        if self._kernel_weights is None:
            mat = partial(kernel_matrix, kernels=kernels)
            weights = [mat(self.fc.weight), self.ctx_norm.weight, self.embed.weight, self.pos]
            for layer in self.layers:
                weights += [
                    layer.attn_norm.weight,
                    mat(layer.qkv.weight),
                    mat(layer.o.weight),
                    layer.mlp_norm.weight,
                    mat(layer.gate_up.weight),
                    mat(layer.down.weight),
                ]
            self._kernel_weights = weights + [self.norm.weight, mat(self.lm_head.weight)]
        return self._kernel_weights

    def markov_kernel_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """dspark_greedy's Markov arguments: U [V, r] and W^T [r, V] fp32, built once (a served
        draft is frozen); empty without a Markov head."""
        if self._markov_weights is None:
            if not self.cfg.markov_rank:
                self._markov_weights = (torch.empty(0), torch.empty(0))
            else:
                self._markov_weights = (
                    self.markov_u.weight.float().contiguous(),
                    self.markov_w.weight.float().t().contiguous(),
                )
        return self._markov_weights

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """prev [B] -> [B, V] (zeros without a Markov head)."""
        if not self.cfg.markov_rank:
            return torch.zeros(prev.shape[0], self.cfg.vocab_size, device=prev.device)
        return self.markov_w(self.markov_u(prev))


def save_dspark(model: DSparkModel, out: str | Path) -> Path:
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(model.cfg.to_json())
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    return out


def load_dspark(path: str | Path) -> DSparkModel:
    from safetensors.torch import load_file

    path = Path(path)
    model = DSparkModel(DSparkConfig.from_file(path / "config.json"))
    state = load_file(str(path / "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path / 'model.safetensors'}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.eval()


class DSparkProposer:
    def __init__(self, model: DSparkModel, target, draft_sample_method: str, device: torch.device | None = None):
        """`target`: the target model (its config; its kernels module, if any, runs the draft);
        `device`: the target's, where its tap states are and the draft runs (drafts are picked
        from the block logits on the CPU, as the sampler picks the target's tokens)."""
        c, target_cfg = model.cfg, target.cfg
        if c.vocab_size != target_cfg.vocab_size or c.target_hidden_size != target_cfg.hidden_size:
            raise ValueError(
                f"dspark draft (vocab {c.vocab_size}, hidden {c.target_hidden_size}) does not match "
                f"the target (vocab {target_cfg.vocab_size}, hidden {target_cfg.hidden_size})"
            )
        bad = [i for i in c.target_layer_ids if not 0 <= i < target_cfg.num_layers]
        if bad:
            raise ValueError(f"dspark target_layer_ids {bad} are outside the target's {target_cfg.num_layers} layers")
        self.device = torch.device(device or "cpu")
        self.model, self.method = model.to(self.device), draft_sample_method
        self.kernels = getattr(
            getattr(getattr(target, "model", None), "backend", None), "kernels", None
        )  # the target's
        self.tap_layers = tuple(c.target_layer_ids)
        self._taps: dict[str, torch.Tensor] = {}
        self._gens: dict[str, torch.Generator] = {}
        self._compiled: tuple | None = None  # (kernels, whether the compiled draft takes its calls), on first use

    @classmethod
    def load(cls, path: str, target, draft_sample_method: str, device: torch.device | None = None) -> "DSparkProposer":
        return cls(load_dspark(path), target, draft_sample_method, device)

    def observe(self, request_id: str, taps: torch.Tensor | None) -> None:
        """The request's tap states at its last committed position; None: a step ran without
        them, so the ones held are stale (the request drafts nothing until a step brings them)."""
        if taps is None:
            self._taps.pop(request_id, None)
        else:
            self._taps[request_id] = taps.to(self.device, torch.float32)  # a DP-attention worker's come on the CPU

    def release(self, request_id: str) -> None:
        self._taps.pop(request_id, None)
        self._gens.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, reqs: list[Request], ks: list[int]) -> list[Draft]:
        ready = [i for i, r in enumerate(reqs) if r.request_id in self._taps]
        out = [Draft([]) for _ in reqs]
        if not ready:
            return out
        # one request (a single user's step): its taps as a view, not a stacked copy
        taps = (
            self._taps[reqs[ready[0]].request_id][None]
            if len(ready) == 1
            else torch.stack([self._taps[reqs[i].request_id] for i in ready])
        )
        last = [reqs[i].token_slice(reqs[i].num_tokens - 1, reqs[i].num_tokens)[0] for i in ready]
        if self._compiled is None or self._compiled[0] is not self.kernels:  # the draft's dtype and device are fixed
            self._compiled = (self.kernels, self.model.compiled(taps, self.kernels))
        if self._compiled[1] and all(self._plain_greedy(reqs[i]) for i in ready):
            for i, toks in zip(ready, self.model.greedy_block(taps, last, [ks[i] for i in ready], self.kernels)):
                out[i] = Draft(toks)
            return out
        last = torch.tensor(last, device=self.device)
        block = self.model.block_logits(taps, last, self.kernels).float()  # [B, k, V]: the whole block at once
        greedy = self._greedy_drafts(
            block, last, [b for b, i in enumerate(ready) if self._plain_greedy(reqs[i])], [ks[i] for i in ready]
        )
        for b, i in enumerate(ready):
            req, prev, toks, qs = reqs[i], last[b : b + 1], [], []
            if b in greedy:  # draft_token's argmax with nothing to process: no row copies
                out[i] = Draft(greedy[b])
                continue
            gen = request_generator(self._gens, req, salt=17)
            for j in range(min(ks[i], block.shape[1])):
                logits = (block[b, j] + self.model.markov_bias(prev)[0].float()).cpu()  # no-op on a CPU
                t, q = draft_token(logits, req, toks, self.method, gen)
                toks.append(t)
                qs.append(q)
                prev = torch.tensor([t], device=self.device)
            out[i] = Draft(toks, stack_q(qs, toks, block.shape[-1]))
        return out

    def _greedy_drafts(
        self, block: torch.Tensor, last: torch.Tensor, rows: list[int], ks: list[int]
    ) -> dict[int, list[int]]:
        """{row b: its greedy drafts} for the block rows `rows` (plain greedy requests): argmax of
        each row plus the Markov head's bias for the token before it, in one compiled call where
        the kernels are on, else in torch."""
        if not rows:
            return {}
        m, k = self.model, block.shape[1]
        if self.kernels is not None:
            u, wt = m.markov_kernel_weights()
            toks = self.kernels.dspark_greedy(
                block[rows].contiguous(), last[rows], u, wt, [ks[b] for b in rows]
            ).tolist()
            return {b: [t for t in row if t >= 0] for b, row in zip(rows, toks)}
        out = {}
        for b in rows:
            prev, toks = last[b : b + 1], []
            for j in range(min(ks[b], k)):
                prev = (block[b, j] + m.markov_bias(prev)[0]).argmax()[None]
                toks.append(int(prev))
            out[b] = toks
        return out

    def _plain_greedy(self, req: Request) -> bool:
        """Greedy drafting of a request whose draft rows need no processing: no logit bias, no
        penalties, min_tokens already reached (processed_row would return each row unchanged)."""
        return (self.method == "greedy" or req.params.greedy) and not needs_processing(req)

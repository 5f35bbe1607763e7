"""`k3serve train-demo`: tokenizer + QAT training of a tiny K3-architecture model + DSpark draft.

The model is the serving model itself (`KimiForCausalLM`) trained through autograd: every K3
feature is on (bounded-decay KDA with full-rank gate, gated MLA, latent MoE with SiTU and the
routed-expert norm, AttnRes blocks, dense layer 0). Routed experts train quantization-aware:
the forward uses MXFP4(w) with a straight-through gradient, and the export writes exactly those
MXFP4 codes in the compressed-tensors layout, so serving computes what training computed.
Samples are packed into fixed-length rows; loss only on assistant completions (and on the
plain-text rows). Deterministic for a seed on one thread (torch.use_deterministic_algorithms).
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from k3serve.demo.data import conversations, stdlib_text, tokenizer_corpus
from k3serve.models.registry import build_model
from k3serve.runner.forward_batch import CacheTensors, ForwardBatch
from k3serve.weights.mxfp4 import PackedMXFP4

log = logging.getLogger("k3serve.demo")
BASE_VOCAB = 1024


def demo_config(base_vocab: int = BASE_VOCAB) -> dict:
    from k3serve.testing.tiny_configs import tiny_k3_config

    raw = tiny_k3_config(num_layers=8, hidden_size=128, base_vocab=base_vocab)
    t = raw["text_config"]
    t.update(intermediate_size=256, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
             v_head_dim=32, moe_intermediate_size=64, routed_expert_hidden_size=64, max_position_embeddings=4096)
    t["linear_attn_config"].update(num_heads=4, head_dim=32)
    return raw


def mxfp4_ste(w: torch.Tensor) -> torch.Tensor:
    """Forward: the MXFP4 round trip of w; backward: identity (straight-through estimator)."""
    q = PackedMXFP4.quantize(w.detach()).dequantize(w.dtype)
    return w + (q - w).detach()


def make_trainable(model) -> None:
    for moe in model.moe_layers():
        for name in ("w1", "w2", "w3"):
            w = getattr(moe, name)
            w = w.dequantize(torch.float32) if isinstance(w, PackedMXFP4) else w.float()
            delattr(moe, name)
            moe.register_parameter(name + "_train", nn.Parameter(w.clone()))
        moe.__class__ = _qat_moe_class(type(moe))


_QAT_CLASSES: dict[type, type] = {}


def _qat_moe_class(base: type) -> type:
    if base not in _QAT_CLASSES:
        def __getattr__(self, name):
            if name in ("w1", "w2", "w3"):
                return mxfp4_ste(self._parameters[name + "_train"])
            return base.__getattr__(self, name)
        _QAT_CLASSES[base] = type("QAT" + base.__name__, (base,), {"__getattr__": __getattr__})
    return _QAT_CLASSES[base]


def export_tensors(model, cfg) -> dict[str, torch.Tensor]:
    """Checkpoint name -> tensor in the release layout (experts packed MXFP4, A_log padded)."""
    from k3serve.testing.builder import random_weights
    from k3serve.weights.schema import model_tensor_specs

    state = {k: v.detach() for k, v in model.state_dict().items()}
    vision = random_weights(cfg, seed=0)  # the demo has no trained vision tower
    out, prefix = {}, cfg.tensor_prefix
    dtypes = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16, "U8": torch.uint8}
    for spec in model_tensor_specs(cfg):
        name = spec.name[len(prefix):] if spec.name.startswith(prefix) else spec.name
        if spec.vision or name.startswith("mm_projector"):
            out[spec.name] = vision[spec.name]
        elif spec.routed_expert:
            if spec.role == "scale":
                continue
            layer = int(name.split(".")[2])
            e, w = name.split("experts.")[1].split(".")[:2]
            moe = model.model.layers[layer].block_sparse_moe
            packed = PackedMXFP4.quantize(moe._parameters[w + "_train"].detach()[int(e)])
            module = spec.name[: -len(".weight_packed")]
            out[spec.name], out[module + ".weight_scale"] = packed.packed, packed.scale
        elif name.endswith("A_log"):
            flat = torch.zeros(torch.Size(spec.shape).numel())
            flat[: cfg.kda.num_heads] = state[name].float()
            out[spec.name] = flat.reshape(spec.shape).to(dtypes[spec.dtype])
        else:
            out[spec.name] = state[name].reshape(spec.shape).to(dtypes[spec.dtype])
    return out


def pack(samples, seq_len: int, plain: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `seq_len` tokens and a loss mask (1 on completions and plain text)."""
    rng = random.Random(seed)
    rng.shuffle(samples)
    rows, masks, ids, mask = [], [], [], []
    for s in samples:
        seq = s.prompt + s.completion
        if len(seq) > seq_len:
            continue
        if len(ids) + len(seq) > seq_len:
            rows.append(ids + [0] * (seq_len - len(ids)))
            masks.append(mask + [0] * (seq_len - len(mask)))
            ids, mask = [], []
        ids += seq
        mask += [0] * len(s.prompt) + [1] * len(s.completion)
    for i in range(0, len(plain) - seq_len, seq_len):
        rows.append(plain[i:i + seq_len])
        masks.append([1] * seq_len)
    return torch.tensor(rows), torch.tensor(masks)


def train_demo(out_dir: str | Path, *, steps: int = 600, seq_len: int = 1024, batch: int = 2, lr: float = 3e-3,
               num_conversations: int = 6000, seed: int = 0, time_limit_s: float | None = None,
               tokenizer_conversations: int = 400, text_chars: int = 300_000) -> dict:
    from k3serve.config.bundled import load_model_config
    from k3serve.testing.builder import _write_shards, write_tokenizer
    from k3serve.tokenizer import Tokenizer

    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    write_tokenizer(out, base_vocab=BASE_VOCAB, k3_names=True,
                    corpus=tokenizer_corpus(tokenizer_conversations, seed, text_chars * 2 // 3))
    (out / "config.json").write_text(json.dumps(demo_config(), indent=2))
    cfg = load_model_config(out)
    tok = Tokenizer.from_dir(out)
    samples = conversations(tok, num_conversations, seed)
    plain = tok.encode(stdlib_text(text_chars, seed))
    rows, masks = pack(samples, seq_len, plain, seed)
    log.info("data: %d conversations -> %d rows of %d tokens (%.0fs)", len(samples), len(rows), seq_len, time.time() - t0)
    model = build_model(cfg, torch.float32)
    _init_(model, seed)
    make_trainable(model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 30) * max(0.1, 1 - s / steps))
    g = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        pick = torch.randint(0, rows.shape[0], (batch,), generator=g)
        loss = _loss(model, cfg, rows[pick], masks[pick])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if step % 20 == 0:
            log.info("step %d loss %.3f (%.0fs)", step, sum(losses[-20:]) / len(losses[-20:]), time.time() - t0)
        if time_limit_s and time.time() - t0 > time_limit_s:
            log.info("time limit reached at step %d", step)
            break
    tensors = export_tensors(model.eval(), cfg)
    _write_shards(out, cfg, tensors, num_shards=1)
    return {"steps": len(losses), "first_loss": losses[0], "last_loss": sum(losses[-20:]) / min(20, len(losses)),
            "seconds": time.time() - t0, "out": str(out)}


def _init_(model, seed: int) -> None:
    """Same initialisation rules as the tiny builder (norms ~1, A_log in log[1, 16], ...)."""
    from k3serve.testing.builder import random_weights
    from k3serve.weights.loader import _canonicalize

    text = {k: v for k, v in random_weights(model.cfg, seed).items()
            if not k.startswith(("vision_tower.", "mm_projector."))}
    model.load_weights(_canonicalize(text, model.cfg))


def _loss(model, cfg, rows: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    B, T = rows.shape
    blocks = -(-T // 16)
    cache = CacheTensors.allocate(cfg, B, B * blocks, 16)
    fb = ForwardBatch(rows.reshape(-1), [T] * B, [0] * B, list(range(B)),
                      [list(range(i * blocks, (i + 1) * blocks)) for i in range(B)], 16)
    logits = model.compute_logits(model(fb, cache)).float().view(B, T, -1)
    m = masks[:, 1:].reshape(-1).float()
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1), reduction="none")
    return (nll * m).sum() / m.sum().clamp_min(1)


def train_demo_draft(model_dir: str | Path, *, steps: int = 400, num_seqs: int = 160, seed: int = 0) -> dict:
    """Distil the demo's DSpark draft on the demo model's own greedy chat completions."""
    from k3serve.spec.train_dspark import distill_dspark
    from k3serve.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    prompts = [s.prompt for s in conversations(tok, num_seqs, seed + 1)]
    return distill_dspark(str(model_dir), str(Path(model_dir) / "dspark"), block_size=4, steps=steps,
                          num_seqs=num_seqs, seq_len=96, prompts=prompts, temperature=0.0, seed=seed)

"""Distil a tiny DSpark drafter from a target checkpoint on text the target generates.

1. The target samples continuations of short prompts (temperature 1) through the engine.
2. One full forward per sequence captures the tap-layer hidden states and the target's
   distributions at every position.
3. For each position n: input = taps at n and token t_{n+1}; targets = the next k tokens
   t_{n+2..n+k+1} (cross-entropy) and the target's distributions there (KL), with the Markov
   head fed the true previous tokens (teacher forcing).
Deterministic for a seed; CPU-sized.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from k3serve.forward import CacheTensors, ForwardBatch
from k3serve.spec_decode.dspark import DSparkConfig, DSparkModel, save_dspark

log = logging.getLogger("k3serve.spec_decode")


def default_taps(num_layers: int) -> tuple[int, ...]:
    return tuple(sorted({1, num_layers // 2, num_layers - 2})) if num_layers > 3 else (num_layers - 1,)


@torch.no_grad()
def target_data(
    target_dir: str,
    num_seqs: int,
    seq_len: int,
    taps: tuple[int, ...],
    seed: int,
    prompts: list[list[int]] | None = None,
    temperature: float = 1.0,
):
    """(tokens, taps [L, n_taps, d], target probs [L, V]) per sequence the target wrote; with
    `prompts` (e.g. chat prompts) the target continues those instead of random 4-token starts."""
    from k3serve import LLM, SamplingParams

    longest = max(map(len, prompts)) if prompts else 4
    llm = LLM(target_dir, cache_memory="256MiB", max_model_len=longest + seq_len + 8, seed=seed)
    model, V = llm.engine.model, llm.engine.model.cfg.vocab_size
    g = torch.Generator().manual_seed(seed)
    free_running = prompts is None  # random starts run to length; chat prompts stop at end-of-message
    if prompts is None:
        prompts = [torch.randint(1, min(V, 512), (4,), generator=g).tolist() for _ in range(num_seqs)]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:num_seqs]],
        SamplingParams(temperature=temperature, seed=seed, max_tokens=seq_len, ignore_eos=free_running),
    )
    seqs = [torch.tensor(o.prompt_token_ids + o.outputs[0].token_ids) for o in outs]
    all_taps, all_probs = [], []
    for row in seqs:
        L = row.shape[0]
        cache = CacheTensors.allocate(model.cfg, 1, -(-L // 16), 16)
        fb = ForwardBatch(row, [L], [0], [0], [list(range(-(-L // 16)))], 16)
        out = model(fb, cache, tuple(taps))
        all_taps.append(torch.stack([out.taps[i] for i in taps], 1).float())
        all_probs.append(torch.softmax(model.compute_logits(out.hidden).float(), -1))
    return seqs, all_taps, all_probs


def examples(seqs, taps, probs, k: int, start: list[int] | None = None):
    """Inputs and targets for every position (from `start`, e.g. the completion) with k tokens after it:
    taps [P, n_taps, d], last token [P], targets [P, k], and the target's distributions there as
    rows [P, k] of one [rows, V] table. Each distribution is read by up to k positions and a
    prompt's are never read, so the table holds each used one once, gathered per batch (the bundled
    demo draft's 4,000 completions: 12.8 -> 7.4 GB peak, the same bits)."""
    xs, lasts, tgts, rows, used, base = [], [], [], [], [], 0
    for j, (row, tp, pr) in enumerate(zip(seqs, taps, probs)):
        L = row.shape[0]
        lo = max(0, (start[j] - 1) if start else 0)
        n = torch.arange(lo, max(lo, L - k - 1))  # none: a completion shorter than k + 1 tokens
        if not len(n):
            continue
        idx = n[:, None] + torch.arange(2, k + 2)[None]  # [P, k] positions of the targets
        xs.append(tp[n])
        lasts.append(row[n + 1])
        tgts.append(row[idx])
        first = int(n[0]) + 1  # the target's p at those positions: rows first .. L - 1 of pr
        used.append(pr[first:])
        rows.append(base + idx - 1 - first)
        base += L - first
    return torch.cat(xs), torch.cat(lasts), torch.cat(tgts), torch.cat(rows), torch.cat(used)


def draft_logits(model: DSparkModel, x_taps, last, tgt) -> torch.Tensor:
    logits = model(x_taps, last)  # [B, k, V]
    prev = torch.cat([last[:, None], tgt[:, :-1]], 1)  # teacher forcing for the Markov head
    return logits + torch.stack([model.markov_bias(prev[:, j]) for j in range(prev.shape[1])], 1)


def distill_dspark(
    target_dir: str,
    out_dir: str,
    *,
    block_size: int = 4,
    steps: int = 300,
    num_seqs: int = 48,
    seq_len: int = 64,
    hidden: int = 64,
    layers: int = 2,
    markov_rank: int = 16,
    lr: float = 3e-3,
    batch: int = 256,
    seed: int = 0,
    taps: tuple[int, ...] | None = None,
    prompts: list[list[int]] | None = None,
    temperature: float = 1.0,
    cosine: bool = False,
) -> dict:
    from k3serve.config.bundled import load_model_config

    torch.manual_seed(seed)
    tcfg = load_model_config(target_dir)
    taps = tuple(taps or default_taps(tcfg.num_layers))
    seqs, tap_states, probs = target_data(target_dir, num_seqs, seq_len, taps, seed, prompts, temperature)
    start = [len(p) for p in prompts[:num_seqs]] if prompts else None
    x_taps, last, tgt, prob_rows, probs = examples(seqs, tap_states, probs, block_size, start)
    cfg = DSparkConfig(
        taps,
        block_size,
        tcfg.pad_token_id or 0,
        tcfg.vocab_size,
        tcfg.hidden_size,
        hidden,
        layers,
        max(1, hidden // 16),
        2 * hidden,
        markov_rank,
    )
    model = DSparkModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    # cosine: the learning rate decays to 0 over the run (the bundled demo draft's long run)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps) if cosine else None
    g = torch.Generator().manual_seed(seed)
    history = []
    for step in range(steps):
        pick = torch.randint(0, x_taps.shape[0], (batch,), generator=g)
        logits = draft_logits(model, x_taps[pick], last[pick], tgt[pick])
        logp = F.log_softmax(logits, -1)
        ce = F.nll_loss(logp.reshape(-1, logp.shape[-1]), tgt[pick].reshape(-1))
        kl = F.kl_div(logp, probs[prob_rows[pick]], reduction="batchmean") / block_size
        loss = 0.1 * ce + kl  # mostly distillation (RadixArk: 0.1 CE + 0.9 distill)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        history.append(float(loss.detach()))
        if step % 50 == 0 or step == steps - 1:
            log.info(
                "dspark distill step %d: loss %.3f (ce %.3f, kl %.3f)",
                step,
                history[-1],
                float(ce.detach()),
                float(kl.detach()),
            )
    save_dspark(model.eval(), out_dir)
    return {
        "first_loss": history[0],
        "last_loss": sum(history[-10:]) / min(10, len(history)),
        "last_lr": opt.param_groups[0]["lr"],
        "out": str(Path(out_dir)),
    }

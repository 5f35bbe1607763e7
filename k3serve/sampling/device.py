"""Sampling on the device, without a host sync: logits [B, V] -> token ids [B] on the same device.

The CPU `Sampler` (sampler.py) stays the reference: the same processing in the same order
(vLLM v1's: bias and penalties on the raw logits, temperature, min-p, top-k, top-p;
logits_process.py), with every per-row value a [B] tensor instead of a Python list, so the step
can run inside a captured graph and only the [B] ids (and logprobs when asked) come back.

Randomness is counter-based, not a generator's state: row b's draw at output position t uses
the uniforms hash(seed_b, t, token), so a seeded request gets the same tokens whatever else is
in the batch, on any device, and a replayed graph needs no generator bookkeeping. The token is
the exponential race argmax(p / E), E = -log(u) (gpt-fast's no-sync multinomial; the same law
as sampling from p). Greedy rows (temperature 0) take the first maximum of the processed logits,
as the CPU sampler does. (Broadcast dimensions are written `unsqueeze`, not `[:, None]`:
Python indexing takes a device guard that a fake CUDA tensor on a CPU build refuses, and the
sync audit runs this module on fake CUDA tensors.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")
_M32 = 0xFFFFFFFF


@dataclass
class DeviceSamplingParams:
    """Per-row sampling values for one step, all [B] on the logits' device (a captured step
    keeps one of these per batch bucket and fills it with one host-to-device copy)."""

    temperature: torch.Tensor  # fp32; 0 = greedy
    top_k: torch.Tensor  # int64; 0 = off
    top_p: torch.Tensor  # fp32; 1 = off
    min_p: torch.Tensor  # fp32; 0 = off
    seed: torch.Tensor  # int64, any value (a request's seed, or the engine's per-request one)
    position: torch.Tensor  # int64: the output index being sampled (the draw's counter)
    presence: torch.Tensor | None = None  # fp32 penalties; None: no row uses them
    frequency: torch.Tensor | None = None
    repetition: torch.Tensor | None = None  # 1 = off

    @classmethod
    def build(cls, rows: list[dict], device: torch.device | str = "cpu") -> "DeviceSamplingParams":
        """From per-row dicts (temperature, top_k, top_p, min_p, seed, position and optionally
        presence / frequency / repetition): one tensor per field, built on the host and moved once."""

        def col(name, default, dtype):
            return torch.tensor([r.get(name, default) for r in rows], dtype=dtype)

        penal = any(
            r.get(n, d) != d for r in rows for n, d in (("presence", 0.0), ("frequency", 0.0), ("repetition", 1.0))
        )
        host = cls(
            col("temperature", 1.0, torch.float32),
            col("top_k", 0, torch.long),
            col("top_p", 1.0, torch.float32),
            col("min_p", 0.0, torch.float32),
            col("seed", 0, torch.long),
            col("position", 0, torch.long),
            *(
                (
                    col("presence", 0.0, torch.float32),
                    col("frequency", 0.0, torch.float32),
                    col("repetition", 1.0, torch.float32),
                )
                if penal
                else (None, None, None)
            ),
        )
        return host.to(device)

    def to(self, device) -> "DeviceSamplingParams":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return DeviceSamplingParams(*(move(getattr(self, f)) for f in self.__dataclass_fields__))


def device_samplable(req) -> bool:
    """Whether a request's rows go to this sampler in an engine that samples on the device: no
    logit_bias (it stays with the host Sampler for the request's whole life, so each request
    draws from one sampler only). A grammar's masks, min_tokens' suppressed ends and the
    penalties' histories come with a static step (token bits, `penalize`), or are applied to
    host logits before these draws."""
    return not req.params.logit_bias


def allowed_tokens(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """Grammar bits [B, ceil(V / 64)] int64 (bit k of word w: token 64 w + k; forward/static.py
    mask_words) -> bool [B, V]: the tokens each row may sample."""
    shifts = torch.arange(64, device=words.device)
    bits = (words.unsqueeze(2) >> shifts) & 1  # [B, M, 64]; >> is arithmetic, & 1 keeps bit k alone
    return bits.reshape(words.shape[0], -1)[:, :vocab] != 0


def row_values(req, seed: int) -> dict:
    """A samplable request's values for `DeviceSamplingParams.build`: its seed (or the engine's
    per-request one) and the output index being drawn as the counter."""
    p = req.params
    return dict(
        temperature=p.temperature,
        top_k=max(p.top_k, 0),
        top_p=p.top_p,
        min_p=p.min_p,
        seed=p.seed if p.seed is not None else seed,
        position=len(req.output_token_ids),
        presence=p.presence_penalty,
        frequency=p.frequency_penalty,
        repetition=p.repetition_penalty,
    )


def model_faults(logits: torch.Tensor) -> torch.Tensor:
    """[B] bool: rows holding a NaN or +inf, or no finite value (sampler.py model_fault_rows,
    on the device)."""
    return (torch.isnan(logits) | torch.isposinf(logits)).any(-1) | ~torch.isfinite(logits).any(-1)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32's shape) in int64 without overflow: values stay below
    2^32 and every multiplier below 2^31, so each product fits in 63 bits."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x4C6CA68B) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 12)


def uniforms(seed: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """u [B, V] in (0, 1), fp32: a function of (seed_b, position_b, token) only."""
    row = _mix32(_mix32(seed ^ (seed >> 32)) ^ _mix32(position + 0x632BE5AB))  # [B]
    col = torch.arange(vocab, device=seed.device, dtype=torch.long) * 0x9E3779B1  # [V], < 2^63
    # 23 random bits: (bits + 0.5) / 2^23 is exact in fp32 and stays below 1 (with 24 bits the
    # top value rounds to 1.0, whose -log is 0, and the race's p / 0 became a NaN that won)
    return unit(_mix32(row.unsqueeze(1) ^ _mix32(col)) >> 9)


def unit(bits: torch.Tensor) -> torch.Tensor:
    """23-bit integers -> fp32 in (0, 1), both ends excluded."""
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def penalize(
    logits: torch.Tensor, p: DeviceSamplingParams, counts: torch.Tensor, prompt_mask: torch.Tensor
) -> torch.Tensor:
    """Repetition (prompt + output), presence and frequency (output), as logits_process.py's
    _penalize_row. counts [B, V] fp32: each token's count in the row's output so far;
    prompt_mask [B, V] bool: tokens in its prompt."""
    if p.repetition is not None:
        seen = (counts > 0) | prompt_mask
        r = p.repetition.unsqueeze(1)
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
        logits = logits - p.frequency.unsqueeze(1) * counts - p.presence.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits


def truncate(logits: torch.Tensor, p: DeviceSamplingParams) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p with [B] tensors (logits_process.truncate's steps and
    order); masked entries become -inf. Greedy rows are scaled by 1 (their argmax is taken apart)."""
    temp = torch.where(p.temperature > 0, p.temperature, torch.ones_like(p.temperature))
    logits = logits / temp.unsqueeze(1)
    probs = torch.softmax(logits, -1)
    logits = logits.masked_fill(probs < p.min_p.unsqueeze(1) * probs.amax(-1, keepdim=True), NEG_INF)
    sorted_logits, order = logits.sort(-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
    top_k = p.top_k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill((top_k > 0) & (rank >= top_k), NEG_INF)
    sorted_probs = torch.softmax(sorted_logits, -1)
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly ahead of each token
    sorted_logits = sorted_logits.masked_fill((before >= p.top_p.unsqueeze(1)) & (rank > 0), NEG_INF)
    return torch.full_like(logits, NEG_INF).scatter(-1, order, sorted_logits)


def sample(
    logits: torch.Tensor,
    p: DeviceSamplingParams,
    bias: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    prompt_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [B, V] -> token ids [B] int64, on the logits' device, with no host sync.

    `bias` [B, V]: added first (logit_bias, and -inf for ends suppressed until min_tokens or
    for tokens a grammar refuses); `counts` / `prompt_mask` for the penalties."""
    x = logits.float()
    if bias is not None:
        x = x + bias
    if counts is not None:
        x = penalize(x, p, counts, prompt_mask)
    greedy = x.argmax(-1)  # the first maximum, as the CPU sampler takes it
    probs = torch.softmax(truncate(x, p), -1)
    race = probs / -torch.log(uniforms(p.seed, p.position, x.shape[-1]))  # argmax(p / E), E ~ Exp(1)
    return torch.where(p.temperature > 0, race.argmax(-1), greedy)


def logprobs_of(logits: torch.Tensor, ids: torch.Tensor, n: int = 0):
    """Raw-model logprobs (before penalties and temperature, vLLM's default) of the sampled ids
    [B], and the top-n ([B, n] values and ids) when n > 0."""
    raw = torch.log_softmax(logits.float(), -1)
    own = raw.gather(1, ids.unsqueeze(1)).squeeze(1)
    if n <= 0:
        return own, None
    return own, raw.topk(n, -1)

"""Prefill/decode disaggregation in the planner (issue 17): P prefill instances and D decode
instances of one layout, and what a request costs to hand from one to the other.

For K3 the hand-off is not only attention KV. At the end of prefill a request is its MLA latent
rows (576 values per token per MLA layer, at the KV dtype) **plus** its KDA recurrent and conv
state (464,633,856 B for K3 in fp32, independent of length; cache/sizing.py, the numbers the
engine allocates by). Prefix-aware: latent blocks the decode side already holds are not sent,
whole blocks only; the state always is.

Transfer time, stated as the assumption it is: the prefill instance's GPUs send their shards
in parallel, each at its own link's per-direction bandwidth: NVLink (half the bidirectional
figure, planner-data.md §1) when both instances share a scale-up domain, else one RDMA NIC per
GPU (§2). Latent rows are replicated across TP ranks (the absorbed form needs them whole), so
they are counted once per request, split over the sending GPUs; the KDA state is split by heads.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3serve.cache.sizing import kda_state_bytes_per_request, mla_cache_bytes_per_token
from k3serve.config.model_config import ModelConfig
from k3serve.planner.hardware import GPU


@dataclass(frozen=True)
class Handoff:
    """What one request moves from its prefill engine to its decode engine."""

    prompt_tokens: int
    sent_tokens: int  # prompt tokens whose latent rows are sent (not already held by the decode side)
    latent_bytes: int
    state_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.latent_bytes + self.state_bytes


def handoff(
    cfg: ModelConfig, prompt_tokens: int, kv_dtype: str = "bfloat16", cached_tokens: int = 0, block_size: int = 16
) -> Handoff:
    """Bytes one request moves; `cached_tokens` of its prefix already on the decode side (only
    whole blocks of them count: a partly filled block is sent again)."""
    if not 0 <= cached_tokens <= prompt_tokens:
        raise ValueError(f"cached_tokens must be in [0, {prompt_tokens}], got {cached_tokens}")
    held = cached_tokens // block_size * block_size
    sent = prompt_tokens - held
    return Handoff(
        prompt_tokens, sent, sent * mla_cache_bytes_per_token(cfg, kv_dtype), kda_state_bytes_per_request(cfg)
    )


@dataclass(frozen=True)
class PDLayout:
    prefill: int  # prefill instances
    decode: int  # decode instances
    gpus_per_instance: int
    handoff: Handoff
    link: str  # "NVLink" or "RDMA"
    link_bytes_per_s: float  # per direction per sending GPU
    seconds: float  # one request's hand-off at that bandwidth

    @property
    def num_gpus(self) -> int:
        return (self.prefill + self.decode) * self.gpus_per_instance

    def to_dict(self) -> dict:
        h = self.handoff
        return {
            "prefill_instances": self.prefill,
            "decode_instances": self.decode,
            "gpus_per_instance": self.gpus_per_instance,
            "num_gpus": self.num_gpus,
            "prompt_tokens": h.prompt_tokens,
            "sent_tokens": h.sent_tokens,
            "latent_bytes": h.latent_bytes,
            "kda_state_bytes": h.state_bytes,
            "transfer_bytes": h.total_bytes,
            "link": self.link,
            "link_GBps_per_gpu": self.link_bytes_per_s / 1e9,
            "transfer_seconds": self.seconds,
        }


def pd_layout(
    cfg: ModelConfig,
    gpu: GPU,
    gpus_per_instance: int,
    prefill: int,
    decode: int,
    prompt_tokens: int,
    kv_dtype: str = "bfloat16",
    cached_tokens: int = 0,
) -> PDLayout:
    if prefill < 1 or decode < 1:
        raise ValueError(f"--pd needs at least one prefill and one decode instance, got {prefill}:{decode}")
    h = handoff(cfg, prompt_tokens, kv_dtype, cached_tokens)
    same_domain = (prefill + decode) * gpus_per_instance <= gpu.scaleup_domain
    link, bw = ("NVLink", gpu.scaleup_bw / 2) if same_domain and gpu.scaleup_bw else ("RDMA", gpu.nic_bw)
    seconds = h.total_bytes / (bw * gpus_per_instance) if bw else float("inf")
    return PDLayout(prefill, decode, gpus_per_instance, h, link, bw, seconds)


def parse_pd(text: str) -> tuple[int, int]:
    """`P:D` (e.g. 1:1, 2:3) -> (prefill instances, decode instances)."""
    try:
        p, d = (int(v) for v in text.split(":"))
    except ValueError:
        raise ValueError(f"--pd takes PREFILL:DECODE instance counts like 1:1, got {text!r}") from None
    if p < 1 or d < 1:
        raise ValueError(f"--pd needs at least one prefill and one decode instance, got {text!r}")
    return p, d

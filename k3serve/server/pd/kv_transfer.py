"""Prefill/decode disaggregation on the server (issue 17): `--kv-transfer-config` roles, the
`kv_transfer_params` request field, and the decode side's pull (fetch_handoff); the endpoints
the pull reaches are server/pd/endpoints.py.

vLLM's spelling: `--kv-transfer-config '{"kv_connector": "NixlConnector" | "K3HttpConnector",
"kv_role": "kv_producer" | "kv_consumer" | "kv_both"}'`. A producer (prefill) server takes
`"kv_transfer_params": {"do_remote_decode": true}` on /v1/completions or /v1/chat/completions:
it runs the prompt (send max_tokens 1), answers with the first token and
`"kv_transfer_params": {"remote_request_id": ID, "remote_block_size": B}`, and keeps the
request's latent rows, KDA state, sampler random state and logprobs (engine/handoff.py) until
`POST /v1/kv/pull {"request_id": ID, "held_tokens": N}` takes them (only rows past the first N
prompt tokens, whole blocks), `POST /v1/kv/release` drops them, or they expire.
A consumer (decode) server takes `{"do_remote_prefill": true, "remote_request_id": ID,
"remote_url": PREFILL_URL}`: it pulls (telling how much of the prompt it caches), installs, and
answers (streaming or not) as if it had prefilled the request itself; a grammar is replayed
over the first token. `kv_producers` limits the prefill servers it pulls from.

Transports (both ends use the same connector):
  NixlConnector    the pull answers a NIXL offer and the decode side READs the bytes out of the
                   prefill server's memory over UCX (server/pd/nixl.py; shared memory on one host,
                   TCP/RDMA across hosts; `pip install -e '.[nixl]'`).
  K3HttpConnector  the pull answers the bytes themselves (one safetensors blob); no extra library.
Mooncake's transfer engine was evaluated too: its engine.so links libcudart, libcuda and
libibverbs, so it does not import on a CPU-only host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from k3serve.server.openai.errors import APIError
from k3serve.server.openai.media_parts import engine_prompt

ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("K3HttpConnector", "NixlConnector")


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str
    kv_producers: tuple[str, ...] = ()  # consumer: prefill servers it may pull from (empty: any)

    @classmethod
    def from_dict(cls, raw) -> "KVTransferConfig":
        if not isinstance(raw, dict):
            raise ValueError(f"--kv-transfer-config takes a JSON object, got {raw!r}")
        unknown = set(raw) - {"kv_connector", "kv_role", "kv_producers"}
        if unknown:
            raise ValueError(
                f"--kv-transfer-config: unsupported keys {sorted(unknown)} (kv_connector, kv_role, kv_producers)"
            )
        connector, role = raw.get("kv_connector"), raw.get("kv_role")
        if connector not in CONNECTORS:
            raise ValueError(f"--kv-transfer-config kv_connector must be one of {CONNECTORS}, got {connector!r}")
        if role not in ROLES:
            raise ValueError(f"--kv-transfer-config kv_role must be one of {ROLES}, got {role!r}")
        producers = raw.get("kv_producers", [])
        if not isinstance(producers, list) or not all(isinstance(u, str) for u in producers):
            raise ValueError("--kv-transfer-config kv_producers must be a list of URLs")
        return cls(connector, role, tuple(u.rstrip("/") for u in producers))

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


@dataclass(frozen=True)
class RemotePrefill:
    """Where a decode server pulls this request's prefilled state from."""

    url: str
    request_id: str


PRODUCE_KEYS, CONSUME_KEYS = (
    {"do_remote_decode"},
    {"do_remote_prefill", "remote_request_id", "remote_url", "remote_block_size"},
)


def handoff_role(
    config: KVTransferConfig | None, params: dict | None, n: int, stream: bool, num_prompts: int
) -> str | RemotePrefill | None:
    """ "produce" (keep this prefill for a remote decode), a RemotePrefill (decode one pulled from
    a prefill server), or None; a 400 when the request cannot be what it asks."""
    if not params:
        return None
    unknown = set(params) - PRODUCE_KEYS - CONSUME_KEYS
    if unknown:
        raise APIError(
            400,
            f"kv_transfer_params: unsupported keys {sorted(unknown)} "
            f"({', '.join(sorted(PRODUCE_KEYS | CONSUME_KEYS))})",
            param="kv_transfer_params",
        )
    produce, consume = bool(params.get("do_remote_decode")), bool(params.get("do_remote_prefill"))
    if not (produce or consume):
        return None
    if produce and consume:
        raise APIError(
            400,
            "kv_transfer_params: do_remote_decode and do_remote_prefill exclude each other",
            param="kv_transfer_params",
        )
    role = "kv_producer" if produce else "kv_consumer"
    if config is None or not (config.produces if produce else config.consumes):
        raise APIError(
            400,
            f"kv_transfer_params.{'do_remote_decode' if produce else 'do_remote_prefill'} needs a "
            f"server started with --kv-transfer-config kv_role {role} or kv_both",
            param="kv_transfer_params",
        )
    if n != 1 or num_prompts != 1 or (produce and stream):
        raise APIError(
            400,
            "a prefill/decode hand-off is one prompt, n = 1"
            + (", not streamed on the prefill side" if produce else ""),
            param="kv_transfer_params",
        )
    if produce:
        return "produce"
    url, rid = params.get("remote_url"), params.get("remote_request_id")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) or not isinstance(rid, str):
        raise APIError(
            400,
            "kv_transfer_params.do_remote_prefill needs remote_url (http(s)) and remote_request_id",
            param="kv_transfer_params",
        )
    url = url.rstrip("/")
    if config.kv_producers and url not in config.kv_producers:
        raise APIError(
            400,
            f"kv_transfer_params.remote_url {url} is not one of this server's kv_producers",
            param="kv_transfer_params",
        )
    return RemotePrefill(url, rid)


async def fetch_handoff(
    state, remote: RemotePrefill, prompt_ids: list[int], media: tuple = (), timeout_s: float = 60.0
):
    """Pull a prefilled request from its prefill server: only the latent rows this engine does
    not already cache (keyed as the prefix cache keys them: media pads by content), plus the
    KDA state and what continues the request exactly (random stream, logprobs)."""
    import httpx

    from k3serve.engine.handoff import from_bytes

    began = time.monotonic()
    cache_ids = await state.engine.cache_ids(engine_prompt(prompt_ids, media)) if media else prompt_ids
    held = await state.engine.held_tokens(cache_ids)
    nixl = state.kv_transfer.kv_connector == "NixlConnector"
    ask = {"request_id": remote.request_id, "held_tokens": held, "transport": "nixl" if nixl else "http"}
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            r = await client.post(remote.url + "/v1/kv/pull", json=ask)
    except httpx.HTTPError as e:
        raise APIError(502, f"pulling the prefill from {remote.url} failed ({type(e).__name__})") from None
    if r.status_code != 200:
        raise APIError(502, f"the prefill server {remote.url} answered {r.status_code}: {r.text[:200]}")
    try:
        data = await state.offload(state.nixl.read, r.json(), timeout_s) if nixl else r.content
        h = await state.offload(from_bytes, data)
    except (ConnectionError, ValueError) as e:
        raise APIError(502, f"the hand-off from {remote.url} did not arrive whole: {e}") from None
    if h.prompt_token_ids != prompt_ids or (h.cache_ids or h.prompt_token_ids) != cache_ids:
        raise APIError(
            400, "the prefilled prompt (or its media) differs from this request's", param="kv_transfer_params"
        )
    state.metrics.kv_transfer_bytes.inc(len(data))
    state.metrics.kv_pulls.inc()
    state.metrics.kv_pull_seconds.inc(time.monotonic() - began)
    return h

"""Prefill/decode disaggregation on the server (issue 17): `--kv-transfer-config` roles, the
`kv_transfer_params` request field, and the pull endpoint a decode engine fetches state from.

vLLM's spelling: `--kv-transfer-config '{"kv_connector": "K3HttpConnector", "kv_role":
"kv_producer" | "kv_consumer" | "kv_both"}'`. A producer (prefill) server takes
`"kv_transfer_params": {"do_remote_decode": true}` on /v1/completions or /v1/chat/completions:
it runs the prompt (send
max_tokens 1), answers with the first token and `"kv_transfer_params": {"remote_request_id":
ID, "remote_block_size": B}`, and keeps the request's latent rows and KDA state
(engine/handoff.py) until `POST /v1/kv/pull {"request_id": ID, "held_tokens": N}` fetches them
(one safetensors blob; only rows past the first N prompt tokens, whole blocks) or they expire.
A consumer (decode) server takes `{"do_remote_prefill": true, "remote_request_id": ID,
"remote_url": PREFILL_URL}`: it pulls (telling how much of the prompt it caches), installs, and
answers (streaming or not) as if it had prefilled the request itself. `kv_producers` in the
config limits the prefill servers it pulls from (keep decode servers behind the router).

Transport: this HTTP pull (`K3HttpConnector`) is what runs here today. NIXL (UCX over TCP or
shared memory; `pip install --no-deps nixl nixl-cu12`) was evaluated to work on this CPU host
and is the connector to add next, for RDMA / GPU memory; Mooncake's engine needs CUDA and
ibverbs libraries to import.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi.responses import Response
from pydantic import BaseModel

from k3serve.server.errors import APIError

ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("K3HttpConnector",)


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
            raise ValueError(f"--kv-transfer-config: unsupported keys {sorted(unknown)} "
                             f"(kv_connector, kv_role, kv_producers)")
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


PRODUCE_KEYS, CONSUME_KEYS = {"do_remote_decode"}, {"do_remote_prefill", "remote_request_id", "remote_url",
                                                     "remote_block_size"}


def handoff_role(config: KVTransferConfig | None, params: dict | None, n: int, stream: bool,
                 num_prompts: int) -> str | RemotePrefill | None:
    """"produce" (keep this prefill for a remote decode), a RemotePrefill (decode one pulled from
    a prefill server), or None; a 400 when the request cannot be what it asks."""
    if not params:
        return None
    unknown = set(params) - PRODUCE_KEYS - CONSUME_KEYS
    if unknown:
        raise APIError(400, f"kv_transfer_params: unsupported keys {sorted(unknown)} "
                            f"({', '.join(sorted(PRODUCE_KEYS | CONSUME_KEYS))})", param="kv_transfer_params")
    produce, consume = bool(params.get("do_remote_decode")), bool(params.get("do_remote_prefill"))
    if not (produce or consume):
        return None
    if produce and consume:
        raise APIError(400, "kv_transfer_params: do_remote_decode and do_remote_prefill exclude each other",
                       param="kv_transfer_params")
    role = "kv_producer" if produce else "kv_consumer"
    if config is None or not (config.produces if produce else config.consumes):
        raise APIError(400, f"kv_transfer_params.{'do_remote_decode' if produce else 'do_remote_prefill'} needs a "
                            f"server started with --kv-transfer-config kv_role {role} or kv_both",
                       param="kv_transfer_params")
    if n != 1 or num_prompts != 1 or (produce and stream):
        raise APIError(400, "a prefill/decode hand-off is one prompt, n = 1"
                            + (", not streamed on the prefill side" if produce else ""), param="kv_transfer_params")
    if produce:
        return "produce"
    url, rid = params.get("remote_url"), params.get("remote_request_id")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) or not isinstance(rid, str):
        raise APIError(400, "kv_transfer_params.do_remote_prefill needs remote_url (http(s)) and remote_request_id",
                       param="kv_transfer_params")
    url = url.rstrip("/")
    if config.kv_producers and url not in config.kv_producers:
        raise APIError(400, f"kv_transfer_params.remote_url {url} is not one of this server's kv_producers",
                       param="kv_transfer_params")
    return RemotePrefill(url, rid)


def check_handoff_params(params, media: tuple = ()) -> None:
    """What a hand-off does not carry yet is refused, not silently dropped: a grammar's state,
    the first token's logprobs, media (the decode side would re-key its prefix cache)."""
    if params.structured is not None:
        raise APIError(400, "structured outputs / required tool calls cannot be handed between prefill and decode "
                            "servers yet", param="kv_transfer_params")
    if params.logprobs is not None or params.prompt_logprobs is not None:
        raise APIError(400, "logprobs are not carried across a prefill/decode hand-off yet", param="logprobs")
    if media:
        raise APIError(400, "images and video cannot be handed between prefill and decode servers yet",
                       param="kv_transfer_params")


async def fetch_handoff(state, remote: RemotePrefill, prompt_ids: list[int], timeout_s: float = 60.0):
    """Pull a prefilled request from its prefill server: only the latent rows this engine does
    not already cache, plus the KDA state."""
    import httpx

    from k3serve.engine.handoff import from_bytes

    began = time.monotonic()
    held = await state.engine.held_tokens(prompt_ids)
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            r = await client.post(remote.url + "/v1/kv/pull", json={"request_id": remote.request_id,
                                                                     "held_tokens": held})
    except httpx.HTTPError as e:
        raise APIError(502, f"pulling the prefill from {remote.url} failed ({type(e).__name__})") from None
    if r.status_code != 200:
        raise APIError(502, f"the prefill server {remote.url} answered {r.status_code}: {r.text[:200]}")
    h = await state.offload(from_bytes, r.content)
    if h.prompt_token_ids != prompt_ids:
        raise APIError(400, "the prefilled prompt differs from this request's prompt", param="kv_transfer_params")
    state.metrics.kv_transfer_bytes.inc(len(r.content))
    state.metrics.kv_pulls.inc()
    state.metrics.kv_pull_seconds.inc(time.monotonic() - began)
    return h


class PullRequest(BaseModel):
    request_id: str
    held_tokens: int = 0


async def pull(state, req: PullRequest) -> Response:
    from k3serve.engine.handoff import to_bytes

    if state.kv_transfer is None or not state.kv_transfer.produces:
        raise APIError(404, "this server keeps no prefills for remote decode (no --kv-transfer-config producer role)")
    if req.held_tokens < 0:
        raise APIError(400, "held_tokens must be >= 0", param="held_tokens")
    try:
        h = await state.engine.pull_handoff(req.request_id, req.held_tokens)
    except KeyError as e:
        raise APIError(404, str(e.args[0]), param="request_id") from None
    data = await state.offload(to_bytes, h)
    state.metrics.kv_transfer_bytes.inc(len(data))
    return Response(content=data, media_type="application/octet-stream")

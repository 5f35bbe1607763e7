"""Prefill/decode disaggregation on the server (issue 17): `--kv-transfer-config` roles, the
`kv_transfer_params` request field, and the pull endpoint a decode engine fetches state from.

vLLM's spelling: `--kv-transfer-config '{"kv_connector": "K3HttpConnector", "kv_role":
"kv_producer" | "kv_consumer" | "kv_both"}'`. A producer (prefill) server takes
`"kv_transfer_params": {"do_remote_decode": true}` on /v1/completions: it runs the prompt (send
max_tokens 1), answers with the first token and `"kv_transfer_params": {"remote_request_id":
ID, "remote_block_size": B}`, and keeps the request's latent rows and KDA state
(engine/handoff.py) until `POST /v1/kv/pull {"request_id": ID, "held_tokens": N}` fetches them
(one safetensors blob; only rows past the first N prompt tokens, whole blocks) or they expire.

Transport: this HTTP pull (`K3HttpConnector`) is what runs here today. NIXL (UCX over TCP or
shared memory; `pip install --no-deps nixl nixl-cu12`) was evaluated to work on this CPU host
and is the connector to add next, for RDMA / GPU memory; Mooncake's engine needs CUDA and
ibverbs libraries to import. The consumer role (decode servers pulling) and the router are next.
"""

from __future__ import annotations

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

    @classmethod
    def from_dict(cls, raw) -> "KVTransferConfig":
        if not isinstance(raw, dict):
            raise ValueError(f"--kv-transfer-config takes a JSON object, got {raw!r}")
        unknown = set(raw) - {"kv_connector", "kv_role"}
        if unknown:
            raise ValueError(f"--kv-transfer-config: unsupported keys {sorted(unknown)} (kv_connector, kv_role)")
        connector, role = raw.get("kv_connector"), raw.get("kv_role")
        if connector not in CONNECTORS:
            raise ValueError(f"--kv-transfer-config kv_connector must be one of {CONNECTORS}, got {connector!r}")
        if role not in ROLES:
            raise ValueError(f"--kv-transfer-config kv_role must be one of {ROLES}, got {role!r}")
        if role == "kv_consumer":
            raise ValueError("--kv-transfer-config kv_role kv_consumer: decode servers are not built yet "
                             "(issue 17); a decode engine pulls through LLMEngine.add_prefilled")
        return cls(connector, role)

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")


def wants_handoff(config: KVTransferConfig | None, params: dict | None, n: int, stream: bool,
                  num_prompts: int) -> bool:
    """Whether this request is a prefill for a remote decode; a 400 when it cannot be one."""
    if not params:
        return False
    unknown = set(params) - {"do_remote_decode"}
    if unknown:
        raise APIError(400, f"kv_transfer_params: unsupported keys {sorted(unknown)} (do_remote_decode)",
                       param="kv_transfer_params")
    if not params.get("do_remote_decode"):
        return False
    if config is None or not config.produces:
        raise APIError(400, "kv_transfer_params.do_remote_decode needs a server started with --kv-transfer-config "
                            "kv_role kv_producer or kv_both", param="kv_transfer_params")
    if n != 1 or stream or num_prompts != 1:
        raise APIError(400, "a prefill for remote decode is one prompt, n = 1, not streamed",
                       param="kv_transfer_params")
    return True


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

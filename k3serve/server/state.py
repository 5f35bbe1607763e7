"""Everything a request handler needs, built once at start-up (no module globals)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from k3serve.chat.render import ChatRenderer
from k3serve.server.pd.kv_transfer import KVTransferConfig
from k3serve.engine.async_engine import AsyncEngine
from k3serve.server.guard import Lifecycle
from k3serve.server.openai.media_parts import MediaLimits, MediaLoader
from k3serve.server.openai.response_store import ResponseStore
from k3serve.chat.markers import K2_STRUCTURAL, K3_STRUCTURAL
from k3serve.server.openai.errors import APIError
from k3serve.server.observability.metrics import ServerMetrics

PREP_THREADS = 2
STRUCTURAL = {"kimi_k3": K3_STRUCTURAL, "kimi_k2": K2_STRUCTURAL}


log = logging.getLogger("k3serve.server")


@dataclass
class ServerState:
    engine: AsyncEngine
    served_model_name: str
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # None: the model family's parser
    reasoning_parser: str | None = None
    api_key: str | None = None
    wedged_after_s: float = 120.0  # /health turns 503 when one engine step runs longer
    log_requests: bool = False  # --enable-log-requests
    lifecycle: Lifecycle = field(default_factory=Lifecycle)  # draining at shutdown; requests in flight
    chat_template: str | None = None  # --chat-template: Jinja rendering for every model
    sampling_defaults: dict = field(default_factory=dict)  # from generation_config.json
    max_logprobs: int = 20
    max_stored_responses: int = 1024  # /v1/responses store=true, oldest evicted first
    media_limits: MediaLimits = field(default_factory=MediaLimits)
    kv_transfer: KVTransferConfig | None = None  # --kv-transfer-config (server/pd/kv_transfer.py)
    response_role: str = "assistant"  # --response-role: the role chat completions answer with
    json_any_whitespace: bool = False  # --structured-outputs-config disable_any_whitespace false: allowed by default
    tracing: Any = None  # --otlp-traces-endpoint: server/observability/tracing.py Tracing
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        info = self.info = self.engine.info()
        self.tokenizer = info.tokenizer
        self.model_type = info.model_type
        self.max_model_len = info.max_model_len
        self.renderer = ChatRenderer(self.model_type, self.tokenizer, info.model_path, self.chat_template)
        problem = self.renderer.startup_problem()
        if problem:
            raise ValueError(problem)
        if self.renderer.missing_xtml and self.renderer.source:
            log.warning(
                "the tokenizer lacks K3's XTML specials (%s): chat is rendered with %s",
                ", ".join(self.renderer.missing_xtml),
                self.renderer.source,
            )
        family = "kimi_k3" if self.model_type == "kimi_k3" else "kimi_k2"
        self.tool_call_parser = self.tool_call_parser or family
        self.reasoning_parser = self.reasoning_parser or family
        names = set(STRUCTURAL[self.tool_call_parser]) | set(STRUCTURAL.get(self.reasoning_parser, ()))
        self.structural_ids = sorted(i for n, i in self.tokenizer.special_tokens.items() if n in names)
        self.metrics = ServerMetrics(self.engine, self.served_model_name)
        self.vocab_size = info.vocab_size
        self.eos_token_id = info.eos_token_id
        self.unmapped_ids = info.unmapped  # frozenset
        self.max_num_seqs = info.num_slots  # what can run at once (info.seq_limit_note says why if fewer)
        self.responses = ResponseStore(self.max_stored_responses)
        self.nixl = None  # the NIXL agent of a NixlConnector server (server/pd/nixl.py)
        if self.kv_transfer is not None and self.kv_transfer.kv_connector == "NixlConnector":
            from k3serve.server.pd.nixl import NixlTransport

            self.nixl = NixlTransport(ttl_s=info.handoffs.ttl_s)
        self.metrics.watch_handoffs(info.handoffs, self.nixl)
        self._prep = ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="k3serve-prep")

    async def offload(self, fn, *args):
        """Run CPU-heavy request preparation (tokenizing, chat rendering) on a worker thread, so
        `/health` and running streams keep their event loop (tiktoken releases the GIL)."""
        return await asyncio.get_running_loop().run_in_executor(self._prep, fn, *args)

    def media_loader(self) -> MediaLoader | None:
        """A per-request image loader, or None when the model has no vision tower."""
        vision = self.info.vision
        return MediaLoader(self.media_limits, vision.patch_size) if vision is not None else None

    def check_logprobs(self, n: int | None, param: str) -> None:
        if n is not None and not 0 <= n <= self.max_logprobs:
            raise APIError(400, f"{param} must be in [0, {self.max_logprobs}] (--max-logprobs), got {n}", param=param)

    def decodable(self, token_id: int) -> bool:
        return 0 <= token_id < self.vocab_size and token_id not in self.unmapped_ids

    def check_model(self, name: str | None) -> None:
        if name not in (None, "", self.served_model_name):
            raise APIError(
                404,
                f"The model `{name}` does not exist; this server serves `{self.served_model_name}`",
                param="model",
                type="NotFoundError",
            )

    def max_tokens(self, prompt_len: int, requested: int | None, where: str = "messages") -> int:
        L = self.max_model_len
        if prompt_len >= L or (requested is not None and prompt_len + requested > L):
            asked = prompt_len + (requested or 0)
            raise APIError(
                400,
                f"This model's maximum context length is {L} tokens. However, you requested "
                f"{asked} tokens ({prompt_len} in the {where}, {requested or 0} in the "
                f"completion). Please reduce the length of the {where} or completion.",
                param="max_tokens" if prompt_len < L else where,
            )
        if requested is not None and requested < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {requested}", param="max_tokens")
        if requested is not None:
            return requested
        return min(L - prompt_len, self.sampling_defaults.get("max_tokens", L))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# Characters str.splitlines() breaks on that json.dumps(ensure_ascii=False) leaves raw: a client
# reading the stream line by line (httpx's iter_lines, many SSE libraries) would cut an event in two.
_LINE_BREAKS = {c: f"\\u{ord(c):04x}" for c in "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"}
_ESCAPE_BREAKS = str.maketrans(_LINE_BREAKS)


def sse(obj) -> str:
    """One server-sent event; its JSON never contains a character any reader splits lines on
    (they can only occur inside JSON strings, where the \\u escape means the same text)."""
    return f"data: {json.dumps(obj, ensure_ascii=False).translate(_ESCAPE_BREAKS)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }

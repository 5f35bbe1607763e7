"""OpenTelemetry traces (`--otlp-traces-endpoint`, issue 47), as vLLM names them.

One `llm_request` span (kind SERVER) per finished request, whose parent is the W3C
`traceparent` the request came with (so a router's span, or a client's, is its parent), with
vLLM's attributes: gen_ai.request.{id,temperature,top_p,max_tokens,n}, gen_ai.response.model,
gen_ai.usage.{prompt_tokens,completion_tokens} (and cached_tokens, spec_draft_tokens,
spec_accepted_tokens: k3serve's), and
gen_ai.latency.{time_in_queue,time_to_first_token,e2e,time_in_model_prefill,
time_in_model_decode,time_in_model_inference} in seconds. `k3serve router` makes a
`router_request` span per request and sends its context to the prefill and decode servers.
Spans leave through a batch processor to the OTLP/HTTP endpoint (protobuf; `/v1/traces` is
appended to a bare host:port). Needs `opentelemetry-sdk` and
`opentelemetry-exporter-otlp-proto-http` (`pip install 'k3serve[tracing]'`).
"""

from __future__ import annotations

import atexit
import contextvars
import logging
import threading
import time
from urllib.parse import urlparse

PIN = "opentelemetry-sdk==1.45.0 opentelemetry-exporter-otlp-proto-http==1.45.0"
# flush and shutdown wait this long for the collector: the exporter retries a batch for its own
# timeout (10 s), in the app's flush and again in the provider's shutdown at exit, so an
# unreachable collector held every shutdown 13-19 s; spans it has not taken by then are dropped
FLUSH_TIMEOUT_S = 2.0
log = logging.getLogger("k3serve.tracing")
REQUEST_SPAN, ROUTER_SPAN = "llm_request", "router_request"
# the incoming request's headers, for the span made when it finishes (set by the app's middleware)
HEADERS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("k3serve_trace_headers", default=None)
_EPOCH = time.time_ns() - time.monotonic_ns()  # monotonic stamps -> the wall-clock ns spans carry


def _ns(monotonic_s: float) -> int:
    return int(monotonic_s * 1e9) + _EPOCH


def traces_url(endpoint: str) -> str:
    u = urlparse(endpoint if "://" in endpoint else "http://" + endpoint)
    return u._replace(path=u.path if u.path not in ("", "/") else "/v1/traces").geturl()


class Tracing:
    def __init__(self, endpoint: str, service: str = "k3serve"):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError:
            raise ValueError(f"--otlp-traces-endpoint needs OpenTelemetry: pip install {PIN}") from None
        self.url = traces_url(endpoint)
        self._gone = False  # a flush or shutdown timed out: the collector does not answer
        # the SDK's own exit hook would shut down unbounded: ours bounds it
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}), shutdown_on_exit=False)
        atexit.register(self.shutdown)
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=self.url)))
        self.tracer = self.provider.get_tracer("k3serve")
        self.propagator = TraceContextTextMapPropagator()

    def parent(self, headers: dict | None):
        """The span context a request's headers carry (traceparent), or None."""
        return self.propagator.extract(headers) if headers else None

    def request_span(
        self,
        headers: dict | None,
        request_id: str,
        model: str,
        params,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        metrics: dict,
        arrival: float,
        end: float,
    ) -> None:
        """The finished request's span, from its engine stamps (monotonic seconds)."""
        from opentelemetry.trace import SpanKind

        m = metrics
        queued = m.get("scheduled_time", arrival)
        first = m.get("first_token_time", end)
        attrs = {
            "gen_ai.request.id": request_id,
            "gen_ai.response.model": model,
            "gen_ai.request.temperature": float(params.temperature),
            "gen_ai.request.top_p": float(params.top_p),
            "gen_ai.request.n": int(params.n),
            "gen_ai.usage.prompt_tokens": prompt_tokens,
            "gen_ai.usage.completion_tokens": completion_tokens,
            "gen_ai.usage.cached_tokens": cached_tokens,
            "gen_ai.latency.time_in_queue": max(0.0, queued - arrival),
            "gen_ai.latency.time_to_first_token": max(0.0, first - arrival),
            "gen_ai.latency.e2e": max(0.0, end - arrival),
            "gen_ai.latency.time_in_model_prefill": max(0.0, first - queued),
            "gen_ai.latency.time_in_model_decode": max(0.0, end - first),
            "gen_ai.latency.time_in_model_inference": max(0.0, end - queued),
        }
        if params.max_tokens is not None:
            attrs["gen_ai.request.max_tokens"] = int(params.max_tokens)
        if "spec_draft_tokens" in m:  # speculative decoding: k3serve's names beside vLLM's (it has none)
            attrs["gen_ai.usage.spec_draft_tokens"] = int(m["spec_draft_tokens"])
            attrs["gen_ai.usage.spec_accepted_tokens"] = int(m["spec_accepted_tokens"])
        span = self.tracer.start_span(
            REQUEST_SPAN, context=self.parent(headers), kind=SpanKind.SERVER, attributes=attrs, start_time=_ns(arrival)
        )
        span.end(end_time=_ns(end))

    def router_span(self, headers: dict | None, path: str):
        """A started `router_request` span and the headers that carry it on (traceparent)."""
        from opentelemetry.trace import SpanKind, set_span_in_context

        span = self.tracer.start_span(
            ROUTER_SPAN, context=self.parent(headers), kind=SpanKind.SERVER, attributes={"http.route": path}
        )
        carrier: dict = {}
        self.propagator.inject(carrier, context=set_span_in_context(span))
        return span, carrier

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Send the queued spans; False when the collector has not taken them in `timeout_s`."""
        return self._bounded(self.provider.force_flush, timeout_s, "flush")

    def shutdown(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        self._bounded(self.provider.shutdown, timeout_s, "shutdown")

    def _bounded(self, call, timeout_s: float, what: str) -> bool:
        """`call` on a daemon thread, waited for `timeout_s` at most: the batch processor ignores
        force_flush's timeout and an export blocks on its socket, so no argument bounds them.
        Once one call has timed out the collector is taken for gone: later ones (the shutdown
        after the app's flush) are started, so the exporter stops retrying, and not waited for."""
        done = threading.Event()

        def run():
            try:
                call()
            finally:
                done.set()

        threading.Thread(target=run, name=f"k3serve-tracing-{what}", daemon=True).start()
        if done.wait(0 if self._gone else timeout_s):
            return True
        if not self._gone:
            log.warning(
                "tracing: the collector at %s took no spans in %.0f s (%s): dropping them", self.url, timeout_s, what
            )
        self._gone = True
        return False


class TraceHeaders:
    """ASGI middleware: a request's W3C trace headers, for the span its Run makes (HEADERS)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        keep = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in scope["headers"]
            if k in (b"traceparent", b"tracestate")
        }
        token = HEADERS.set(keep or None)
        try:
            await self.app(scope, receive, send)
        finally:
            HEADERS.reset(token)

"""Prometheus metrics (prometheus-client), one registry per app (vLLM names, `k3serve:` prefix).

Counters: HTTP requests by endpoint and status, prompt / generation tokens, finished requests
by reason. Histograms: TTFT, TPOT, end-to-end latency. Gauges read at scrape time: running and
waiting requests, latent blocks and state slots used / total, prefix-cache queries, hit tokens,
hit rate, checkpoints stored / evicted / held and their bytes; speculative decoding drafts,
drafted and accepted tokens, mean acceptance length, accepted tokens per draft position.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
           80.0, 160.0)


class ServerMetrics:
    def __init__(self, engine):
        r = self.registry = CollectorRegistry()
        self.http = Counter("k3serve:http_requests", "HTTP requests by endpoint and status",
                            ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("k3serve:prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("k3serve:generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("k3serve:request_success", "Finished requests by finish reason",
                                ["finished_reason"], registry=r)
        self.ttft = Histogram("k3serve:time_to_first_token_seconds", "Time to first token", buckets=LATENCY,
                              registry=r)
        self.tpot = Histogram("k3serve:time_per_output_token_seconds", "Time per output token after the first",
                              buckets=LATENCY, registry=r)
        self.e2e = Histogram("k3serve:e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=LATENCY, registry=r)
        eng = engine.engine
        gauges = {
            "num_requests_running": ("Requests holding cache", lambda: len(eng.scheduler.running)),
            "num_requests_waiting": ("Requests queued", lambda: len(eng.scheduler.waiting)),
            "latent_blocks_used": ("MLA latent blocks in use", lambda: eng.cache.blocks.num_used),
            "latent_blocks_total": ("MLA latent blocks", lambda: eng.plan.num_blocks),
            "state_slots_used": ("KDA state slots in use", lambda: eng.cache.slots.num_used),
            "state_slots_total": ("KDA state slots", lambda: eng.plan.num_slots),
        }
        st, plan = eng.cache.checkpoints.stats, eng.plan
        store = eng.cache.checkpoints
        gauges.update({
            "prefix_cache_queries": ("Prefix-cache lookups at admission", lambda: st.queries),
            "prefix_cache_query_tokens": ("Prompt tokens looked up", lambda: st.query_tokens),
            "prefix_cache_hit_tokens": ("Prompt tokens restored from the prefix cache", lambda: st.hit_tokens),
            "prefix_cache_hit_rate": ("hit_tokens / query_tokens", lambda: st.hit_rate),
            "prefix_cache_checkpoints_stored": ("KDA checkpoints written", lambda: st.checkpoints_stored),
            "prefix_cache_checkpoints_evicted": ("KDA checkpoints evicted", lambda: st.checkpoints_evicted),
            "prefix_cache_checkpoints": ("KDA checkpoints held now", lambda: store.num_stored),
            "prefix_cache_checkpoint_bytes": ("State memory held by KDA checkpoints",
                                              lambda: store.num_stored * plan.slot_bytes),
            "prefix_cache_cached_free_blocks": ("Latent blocks kept for reuse, unreferenced",
                                                lambda: eng.cache.blocks.num_cached_free),
        })
        spec = eng.spec
        if spec is not None:
            ss = spec.stats
            gauges.update({
                "spec_decode_num_drafts": ("Verify passes with drafted tokens", lambda: ss.drafts),
                "spec_decode_num_draft_tokens": ("Drafted tokens", lambda: ss.draft_tokens),
                "spec_decode_num_accepted_tokens": ("Accepted drafted tokens", lambda: ss.accepted_tokens),
                "spec_decode_mean_acceptance_length": ("1 + accepted / drafts", lambda: ss.mean_acceptance_length),
            })
            per_pos = Gauge("k3serve:spec_decode_num_accepted_tokens_per_pos", "Accepted drafts by position",
                            ["position"], registry=r)
            for i in range(spec.cfg.num_speculative_tokens):
                per_pos.labels(str(i)).set_function(
                    lambda i=i: ss.accepted_per_position[i] if i < len(ss.accepted_per_position) else 0)
        for name, (doc, fn) in gauges.items():
            Gauge(f"k3serve:{name}", doc, registry=r).set_function(fn)

    def observe_request(self, prompt_tokens: int, output_tokens: int, reasons: list[str | None],
                        arrival: float, first_token: float | None, end: float) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(output_tokens)
        for reason in reasons:
            self.finished.labels(reason or "abort").inc()
        self.e2e.observe(end - arrival)
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            if output_tokens > 1:
                self.tpot.observe((end - first_token) / (output_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)

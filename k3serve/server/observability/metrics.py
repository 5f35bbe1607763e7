"""Prometheus metrics (prometheus-client), one registry per app.

Two families side by side:
  * `vllm:` names with vLLM's types and its `model_name` / `engine` labels, so a dashboard built
    for vLLM (and docs/grafana-k3serve.json) reads k3serve unchanged: running / waiting,
    kv_cache_usage_perc (MLA latent blocks), preemptions, prefix-cache queries / hits (tokens),
    prompt / generation tokens, request success by finish reason, TTFT, inter-token latency,
    TPOT, e2e, queue / prefill / decode time, prompt / generation length histograms, and the
    spec-decode draft / accepted counters;
  * `k3serve:` series for what vLLM has no name for (KDA state slots, checkpoints, HTTP status).
Pool levels and engine counters come from the engine's stats snapshot (`engine/stats.py`),
taken on the engine thread after every step and call, never from live scheduler objects.
References: vLLM `vllm/v1/metrics/loggers.py` (names, types, labels).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from k3serve.engine.stats import ITERATION_BUCKETS

LATENCY = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
LABELS = ("model_name", "engine")


class ServerMetrics:
    def __init__(self, engine, model_name: str = "k3serve"):
        r = self.registry = CollectorRegistry()
        lv = (model_name, "0")
        self.http = Counter(
            "k3serve:http_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed", LABELS, registry=r).labels(*lv)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generation tokens processed", LABELS, registry=r
        ).labels(*lv)
        self._success = Counter(
            "vllm:request_success", "Finished requests by finish reason", [*LABELS, "finished_reason"], registry=r
        )
        self.kv_transfer_bytes = Counter(
            "k3serve:kv_transfer_bytes",
            "Prefill hand-off bytes (latent rows + KDA state) served to decode engines or pulled from prefill ones",
            LABELS,
            registry=r,
        ).labels(*lv)
        self.kv_pulls = Counter(
            "k3serve:kv_pulls", "Prefill hand-offs this decode engine pulled", LABELS, registry=r
        ).labels(*lv)
        self.kv_pull_seconds = Counter(
            "k3serve:kv_pull_seconds",
            "Time spent pulling prefill hand-offs (request to installed bytes)",
            LABELS,
            registry=r,
        ).labels(*lv)
        self._lv = lv

        def hist(name: str, doc: str, buckets=LATENCY):
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(*lv)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token")
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between consecutive output tokens")
        self.tpot = hist("vllm:time_per_output_token_seconds", "Mean time per output token after the first")
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency")
        self.queue = hist("vllm:request_queue_time_seconds", "Time waiting before first scheduled")
        self.prefill = hist("vllm:request_prefill_time_seconds", "Time from first scheduled to first token")
        self.decode = hist("vllm:request_decode_time_seconds", "Time from first token to the last")
        self.req_prompt = hist("vllm:request_prompt_tokens", "Prompt length of finished requests", TOKENS)
        self.req_gen = hist("vllm:request_generation_tokens", "Generated tokens of finished requests", TOKENS)
        self.req_max_gen = hist(
            "vllm:request_max_num_generation_tokens",
            "Maximum generation tokens requested (max_tokens) of finished requests",
            TOKENS,
        )
        r.register(_EngineCollector(engine, lv))

    def observe_request(
        self,
        prompt_tokens: int,
        output_tokens: int,
        reasons: list[str | None],
        arrival: float,
        first_token: float | None,
        end: float,
        timings: dict | None = None,
        max_tokens: int | None = None,
    ) -> None:
        """One finished request; `timings` are the engine's monotonic stamps (scheduled_time, ...);
        `max_tokens` the generation tokens it asked for at most (None: not observed)."""
        self.prompt_tokens.inc(prompt_tokens)
        if max_tokens is not None:
            self.req_max_gen.observe(max_tokens)
        self.generation_tokens.inc(output_tokens)
        for reason in reasons:
            self._success.labels(*self._lv, reason or "abort").inc()
        self.e2e.observe(end - arrival)
        self.req_prompt.observe(prompt_tokens)
        self.req_gen.observe(output_tokens)
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            if output_tokens > 1:
                self.tpot.observe((end - first_token) / (output_tokens - 1))
        t = timings or {}
        arrived, scheduled, first, done = (
            t.get(k) for k in ("arrival_time", "scheduled_time", "first_token_time", "finish_time")
        )
        if arrived is not None and scheduled is not None:
            self.queue.observe(max(0.0, scheduled - arrived))
            if first is not None:
                self.prefill.observe(max(0.0, first - scheduled))
        if first is not None and done is not None:
            self.decode.observe(max(0.0, done - first))

    def observe_gap(self, seconds: float, tokens: int) -> None:
        """`tokens` new output tokens arrived `seconds` after the previous ones (one ITL each)."""
        for _ in range(tokens):
            self.itl.observe(seconds / tokens)

    def watch_handoffs(self, store, nixl) -> None:
        """Gauges of what a prefill server still holds for decode engines (both return to zero)."""
        g = Gauge(
            "k3serve:kv_handoffs_held",
            "Prefilled requests kept for a decode engine, not yet pulled",
            registry=self.registry,
        )
        g.set_function(lambda: len(store.held))
        lent = Gauge(
            "k3serve:kv_nixl_lent_bytes", "Hand-off bytes registered with NIXL, not yet read", registry=self.registry
        )
        lent.set_function(lambda: nixl.lent_bytes if nixl is not None else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Series read from the latest EngineStats snapshot at scrape time."""

    def __init__(self, engine, lv: tuple[str, str]):
        self.engine, self.lv = engine, lv
        eng = getattr(engine, "engine", None)  # an AsyncEngine's LLMEngine (a DP front: its first replica's)
        plan = getattr(eng, "plan", None)
        self.cache_info = {
            "block_size": str(getattr(plan, "block_size", "")),
            "num_gpu_blocks": str(getattr(plan, "num_blocks", "")),
            "num_state_slots": str(getattr(plan, "num_slots", "")),
            "cache_dtype": str(getattr(eng, "kv_dtype_name", "")),
            "enable_prefix_caching": str(getattr(getattr(eng, "cache", None), "prefix_caching", "")),
        }

    def collect(self):
        s = self.engine.stats

        def gauge(name, doc, value, labelled=True):
            g = GaugeMetricFamily(name, doc, labels=LABELS if labelled else None)
            g.add_metric(self.lv if labelled else [], value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(self.lv, value)
            return c

        def indexed(name, doc, label, values):
            """A counter per index of `values` (label `label` = "0", "1", ...)."""
            c = CounterMetricFamily(name, doc, labels=[*LABELS, label])
            for i, n in enumerate(values):
                c.add_metric([*self.lv, str(i)], n)
            return c

        yield gauge("vllm:num_requests_running", "Requests in model execution batches", s.num_running)
        if s.iteration_tokens:
            it = HistogramMetricFamily("vllm:iteration_tokens_total", "Tokens scheduled per engine step", labels=LABELS)
            cumulative, buckets = 0, []
            for bound, n in zip((*ITERATION_BUCKETS, float("inf")), s.iteration_tokens):
                cumulative += n
                buckets.append(("+Inf" if bound == float("inf") else str(float(bound)), cumulative))
            it.add_metric(self.lv, buckets, s.iteration_tokens_sum)
            yield it
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "The cache configuration (labels; value 1)", labels=list(self.cache_info)
        )
        info.add_metric(list(self.cache_info.values()), 1)
        yield info
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be processed", s.num_waiting)
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV-cache (MLA latent blocks) usage; 1 means 100 percent", s.kv_cache_usage
        )
        yield counter("vllm:num_preemptions", "Cumulative preemptions", s.num_preemptions)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens queried in the prefix cache", s.prefix_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache", s.prefix_hits)
        yield counter("vllm:spec_decode_num_drafts", "Verify passes with drafted tokens", s.spec_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Drafted tokens", s.spec_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Accepted drafted tokens", s.spec_accepted_tokens)
        yield indexed(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted drafts by position",
            "position",
            s.spec_accepted_per_position,
        )
        if s.spec_draft_lengths:  # adaptive drafting (spec_decode/adaptive.py): what it chose
            yield indexed(
                "k3serve:spec_decode_draft_length",
                "Decoding request-steps by the draft length the policy chose (0: decoded without drafts)",
                "length",
                s.spec_draft_lengths,
            )
            yield counter(
                "k3serve:spec_decode_skipped_steps",
                "Steps whose drafter did not run: by the measured costs and acceptance it could not pay",
                s.spec_skipped_steps,
            )
        if s.expert_tokens_per_rank:
            yield indexed(
                "k3serve:expert_parallel_tokens",
                "Token-to-expert assignments routed to each expert-parallel rank's experts",
                "rank",
                s.expert_tokens_per_rank,
            )
            mean = sum(s.expert_tokens_per_rank) / len(s.expert_tokens_per_rank)
            yield gauge(
                "k3serve:expert_parallel_imbalance",
                "Busiest expert-parallel rank's assignments / the mean (1 = balanced)",
                max(s.expert_tokens_per_rank) / mean if mean else 1.0,
            )
        if s.eplb_rebalances:
            yield counter(
                "k3serve:eplb_rebalances", "Expert-parallel load rebalances run (--enable-eplb)", s.eplb_rebalances
            )
            g = GaugeMetricFamily(
                "k3serve:eplb_imbalance",
                "The last rebalance's window: busiest rank's assignments / the mean, as run and as placed now",
                labels=[*LABELS, "placement"],
            )
            for which, v in zip(("before", "after"), s.eplb_balance):
                g.add_metric([*self.lv, which], v)
            yield g
        if s.tp_collectives:
            secs = CounterMetricFamily(
                "k3serve:tp_collective_seconds",
                "Seconds rank 0 spent in tensor-parallel collectives",
                labels=[*LABELS, "kind"],
            )
            nbytes = CounterMetricFamily(
                "k3serve:tp_collective_bytes",
                "Payload bytes of rank 0's tensor-parallel collectives",
                labels=[*LABELS, "kind"],
            )
            calls = CounterMetricFamily(
                "k3serve:tp_collectives", "Tensor-parallel collectives run by rank 0", labels=[*LABELS, "kind"]
            )
            for kind, n, b, t in s.tp_collectives:
                secs.add_metric([*self.lv, kind], t)
                nbytes.add_metric([*self.lv, kind], b)
                calls.add_metric([*self.lv, kind], n)
            yield from (secs, nbytes, calls)
        yield gauge(
            "k3serve:kda_state_slot_usage_perc", "KDA state slots in use; 1 means 100 percent", s.state_slot_usage
        )
        if s.tier_stats:
            yield from self._tiers(s.tier_stats)
        # the k3serve: series of the first release, unlabelled, kept for existing scrapers
        mean_accept = 1 + s.spec_accepted_tokens / s.spec_drafts if s.spec_drafts else 0.0
        plain = {
            "num_requests_running": ("Requests holding cache", s.num_running),
            "num_requests_waiting": ("Requests queued", s.num_waiting),
            "latent_blocks_used": ("MLA latent blocks in use", s.latent_blocks_used),
            "latent_blocks_total": ("MLA latent blocks", s.latent_blocks_total),
            "state_slots_used": ("KDA state slots in use", s.state_slots_used),
            "state_slots_total": ("KDA state slots", s.state_slots_total),
            "prefix_cache_queries": ("Prefix-cache lookups at admission", s.prefix_lookups),
            "prefix_cache_query_tokens": ("Prompt tokens looked up", s.prefix_queries),
            "prefix_cache_hit_tokens": ("Prompt tokens restored from the prefix cache", s.prefix_hits),
            "prefix_cache_hit_rate": ("hit_tokens / query_tokens", s.prefix_hits / max(1, s.prefix_queries)),
            "prefix_cache_checkpoints_stored": ("KDA checkpoints written", s.checkpoints_stored),
            "prefix_cache_checkpoints_evicted": ("KDA checkpoints evicted", s.checkpoints_evicted),
            "prefix_cache_checkpoints": ("KDA checkpoints held now", s.prefix_checkpoints),
            "prefix_cache_checkpoint_bytes": (
                "State memory held by KDA checkpoints",
                s.prefix_checkpoints * self.engine.info().slot_bytes,
            ),
            "prefix_cache_cached_free_blocks": (
                "Latent blocks kept for reuse, unreferenced",
                s.prefix_cached_free_blocks,
            ),
        }
        if self.engine.info().speculative:
            plain.update(
                {
                    "spec_decode_num_drafts": ("Verify passes with drafted tokens", s.spec_drafts),
                    "spec_decode_num_draft_tokens": ("Drafted tokens", s.spec_draft_tokens),
                    "spec_decode_num_accepted_tokens": ("Accepted drafted tokens", s.spec_accepted_tokens),
                    "spec_decode_mean_acceptance_length": ("1 + accepted / drafts", mean_accept),
                }
            )
        for name, (doc, value) in plain.items():
            yield gauge(f"k3serve:{name}", doc, value, labelled=False)

    def _tiers(self, values):
        """Per tier (label tier="cpu" | "disk"): the prefix-cache tiers' counters and bytes held."""
        from k3serve.cache.tiers import TIERS
        from k3serve.engine.stats import TIER_FIELDS

        docs = {
            "queries": "Lookups that ran past the device pools into this tier",
            "hits": "Entries this tier gave (cpu: loaded into the device pools; disk: read into host memory)",
            "hit_tokens": "Prompt tokens of prefix hits that loaded from host memory",
            "bytes_read": "Bytes read from this tier",
            "bytes_written": "Bytes written to this tier",
            "evictions": "Entries evicted from this tier to stay within its budget",
            "rejected": "Entries dropped as torn, corrupt or another model's (then recomputed)",
            "load_seconds": "Seconds spent loading entries from this tier",
        }
        n = len(TIER_FIELDS)
        for i, field in enumerate(TIER_FIELDS):
            if field == "bytes_held":
                fam = GaugeMetricFamily(
                    "k3serve:prefix_cache_tier_bytes", "Bytes this tier holds now", labels=[*LABELS, "tier"]
                )
            else:
                fam = CounterMetricFamily(f"k3serve:prefix_cache_tier_{field}", docs[field], labels=[*LABELS, "tier"])
            for j, tier in enumerate(TIERS):
                fam.add_metric([*self.lv, tier], values[j * n + i])
            yield fam

"""Prometheus metrics of the server, named like vLLM's (`specdecode:` for `vllm:`).

Token and speculative counters count the requests that completed (finish reason "stop" or
"length"), when they complete, so they add up to the usage objects the server returned;
`request_success_total{finished_reason}` also counts aborted requests (client gone). The
gauges are set after every engine step (`spec_decode_draft_limit`: the mean draft limit the
draft-length policy chose, K per batch size under "cost"); the latency histograms are observed
as tokens land (inter-token latency: a step's interval is shared out over the tokens it
brought).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specdecode.engine.engine import Event
from specdecode.engine.stats import EngineStats
from specdecode.types import RequestOutput

PREFIX = "specdecode:"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    """One registry per server (tests run several in one process)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        label = {"labelnames": ("model_name",), "registry": self.registry}

        def counter(name: str, doc: str, *extra: str) -> Counter:
            return Counter(
                PREFIX + name, doc, labelnames=("model_name", *extra), registry=self.registry
            )

        self.num_drafts = counter("spec_decode_num_drafts", "Drafts of at least one token.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Drafted tokens.")
        self.num_accepted = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted by verification."
        )
        self.accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose first position + 1 tokens were all accepted.",
            "position",
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of completed requests.")
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter(
            "prefix_cache_hits", "Prompt tokens the prefix cache gave (not prefilled)."
        )
        self.generation_tokens = counter(
            "generation_tokens", "Generated tokens of completed requests."
        )
        self.success = counter(
            "request_success", "Requests that left the engine.", "finished_reason"
        )
        self.preemptions = counter("num_preemptions", "Requests preempted (KV cache short).")
        self.kv_usage = Gauge(
            PREFIX + "kv_cache_usage_perc",
            "Share of the KV cache the running requests hold (1 = full).",
            **label,
        )
        self.running = Gauge(PREFIX + "num_requests_running", "Requests running.", **label)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting.", **label)
        self.draft_limit = Gauge(
            PREFIX + "spec_decode_draft_limit",
            "Mean draft limit (tokens a request may draft) chosen in the latest step.",
            **label,
        )
        buckets = {"buckets": LATENCY_BUCKETS, **label}
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time to first token.", **buckets
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between output tokens.", **buckets
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Request latency, end to end.", **buckets
        )
        self.model = model_name
        self._seen: dict[str, tuple[int, float]] = {}  # request id -> (tokens, time) so far
        self._preempted = 0  # the engine's preemptions counted so far
        self.running.labels(model_name).set(0)
        self.waiting.labels(model_name).set(0)

    def observe(self, events: list[Event]) -> None:
        """Latencies of one step's events (called in the engine thread)."""
        now = time.perf_counter()
        for event in events:
            req, out = event.request, event.output
            tokens = len(out.token_ids)
            seen = self._seen.get(req.request_id)
            if seen is None and req.t_first is not None:
                self.ttft.labels(self.model).observe(req.t_first - req.t_start)
                seen = (1, req.t_first)
            if seen is not None and tokens > seen[0]:
                share = (now - seen[1]) / (tokens - seen[0])
                for _ in range(tokens - seen[0]):
                    self.itl.labels(self.model).observe(share)
                seen = (tokens, now)
            if out.finished:
                self._seen.pop(req.request_id, None)
                self.e2e.labels(self.model).observe(now - req.t_start)
            elif seen is not None:
                self._seen[req.request_id] = seen

    def gauges(self, stats: EngineStats) -> None:
        """Running and waiting counts, KV cache usage, preemptions and the mean draft limit
        after a step; forgets the latency state of requests that left unfinished (engine
        thread)."""
        self.running.labels(self.model).set(stats.running)
        self.waiting.labels(self.model).set(stats.waiting)
        self.kv_usage.labels(self.model).set(stats.kv_cache_usage)
        self.preemptions.labels(self.model).inc(stats.num_preemptions - self._preempted)
        self._preempted = stats.num_preemptions
        self.draft_limit.labels(self.model).set(stats.draft_limit)
        for request_id in [r for r in self._seen if r not in stats.running_ids]:
            del self._seen[request_id]

    def completed(self, out: RequestOutput) -> None:
        """Count a request that completed (its usage was sent)."""
        assert out.metrics is not None
        spec, model = out.metrics.spec, self.model
        self.prompt_tokens.labels(model).inc(len(out.prompt_token_ids))
        self.prefix_queries.labels(model).inc(len(out.prompt_token_ids))
        self.prefix_hits.labels(model).inc(out.metrics.num_cached_tokens)
        self.generation_tokens.labels(model).inc(len(out.token_ids))
        self.num_drafts.labels(model).inc(spec.num_drafts)
        self.num_draft_tokens.labels(model).inc(spec.num_draft_tokens)
        self.num_accepted.labels(model).inc(spec.num_accepted_tokens)
        for position, count in enumerate(spec.accepted_per_position):
            self.accepted_per_pos.labels(model, str(position)).inc(count)
        self.success.labels(model, out.outputs[0].finish_reason or "").inc()

    def aborted(self) -> None:
        """Count a request that left unfinished (its client went away)."""
        self.success.labels(self.model, "abort").inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

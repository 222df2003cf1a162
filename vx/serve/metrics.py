"""Prometheus metrics of one server, in a registry of its own (no global state: two apps never mix counts).

Counters and histograms are updated as requests run; the engine gauges (KV cache, prefix cache, queues) are
read from `await llm.stats()` each time `/metrics` is scraped, and are NaN (unknown) when the engine does not
answer, never a stale value.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vx.outputs import EngineStats

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class ServerMetrics:
    """Every metric `vx serve` exports, registered in `self.registry`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "vx_requests", "Finished sequences (one per choice) by endpoint and finish reason; 'error' counts "
            "refused requests, 'abort' those the client dropped.", ["endpoint", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("vx_prompt_tokens", "Prompt tokens processed.", ["endpoint"], registry=r)
        self.generation_tokens = Counter("vx_generation_tokens", "Tokens generated.", ["endpoint"], registry=r)
        self.ttft = Histogram("vx_time_to_first_token_seconds", "From the HTTP request to its first token.",
                              ["endpoint"], buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vx_inter_token_latency_seconds", "Between two tokens of one sequence.",
                             ["endpoint"], buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vx_e2e_request_latency_seconds", "From the HTTP request to its last token.",
                             ["endpoint"], buckets=_E2E_BUCKETS, registry=r)
        self.num_running = Gauge("vx_num_requests_running", "Requests in the engine's running queue.", registry=r)
        self.num_waiting = Gauge("vx_num_requests_waiting", "Requests waiting to be scheduled.", registry=r)
        self.kv_blocks_total = Gauge("vx_kv_blocks_total", "Usable KV cache blocks.", registry=r)
        self.kv_blocks_in_use = Gauge("vx_kv_blocks_in_use", "KV cache blocks held by requests.", registry=r)
        self.kv_cache_usage = Gauge("vx_kv_cache_usage_ratio", "Fraction of KV cache blocks held by requests "
                                    "(0 to 1).", registry=r)
        self.prefix_cache_hit_rate = Gauge("vx_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache "
                                           "over prompt tokens looked up, since start (0 to 1).", registry=r)
        self.rejected = Counter("vx_rejected_requests", "HTTP requests refused before they ran, by reason "
                                "(unauthorized, too_many_requests, too_many_from_client, too_large, body_timeout, "
                                "invalid_json, shutting_down).", ["reason"], registry=r)
        self.in_flight = Gauge("vx_requests_in_flight", "Generation requests being handled now (what "
                               "--max-concurrent-requests limits).", registry=r)

    def record_error(self, endpoint: str) -> None:
        self.requests.labels(endpoint, "error").inc()

    @contextlib.contextmanager
    def errors_counted(self, endpoint: str) -> Iterator[None]:
        """Count any exception raised inside as a failed request of `endpoint` (unexpected ones too), and re-raise."""
        try:
            yield
        except Exception:
            self.record_error(endpoint)
            raise

    def update_engine(self, stats: EngineStats) -> None:
        """Set the gauges from an engine snapshot."""
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_blocks_total.set(stats.kv_blocks_total)
        self.kv_blocks_in_use.set(stats.kv_blocks_in_use)
        self.kv_cache_usage.set(stats.kv_blocks_in_use / stats.kv_blocks_total if stats.kv_blocks_total else 0.0)
        queried = stats.prefix_cache_queried_tokens
        self.prefix_cache_hit_rate.set(stats.prefix_cache_hit_tokens / queried if queried else 0.0)

    def clear_engine(self) -> None:
        """The engine did not answer: its gauges are unknown (NaN), not their last values."""
        for gauge in (self.num_running, self.num_waiting, self.kv_blocks_total, self.kv_blocks_in_use,
                      self.kv_cache_usage, self.prefix_cache_hit_rate):
            gauge.set(float("nan"))

    def render(self) -> bytes:
        """The text exposition of every metric."""
        return generate_latest(self.registry)


class RequestTimer:
    """Token timing of one engine request (all its choices): time to first token, inter-token latency, and the
    counts, reported to `metrics` under `endpoint`."""

    def __init__(self, metrics: ServerMetrics, endpoint: str, start: float) -> None:
        self.metrics = metrics
        self.endpoint = endpoint
        self.start = start  # time.perf_counter() when the HTTP request arrived
        self.last: float | None = None

    def prompt(self, num_tokens: int) -> None:
        self.metrics.prompt_tokens.labels(self.endpoint).inc(num_tokens)

    def tokens(self, num_new: int, steps: int) -> None:
        """`num_new` tokens arrived (over all choices) from `steps` engine steps (> 1 when outputs merged
        while the server was busy: the gap is then shared between them)."""
        if num_new <= 0:
            return
        now = time.perf_counter()
        self.metrics.generation_tokens.labels(self.endpoint).inc(num_new)
        if self.last is None:
            self.metrics.ttft.labels(self.endpoint).observe(now - self.start)
            steps -= 1
        elif steps > 0:
            gap = (now - self.last) / steps
            itl = self.metrics.itl.labels(self.endpoint)
            for _ in range(steps):
                itl.observe(gap)
        self.last = now

    def finished(self, finish_reasons: list[str]) -> None:
        """The request ended: one count per choice, and its end-to-end latency."""
        for reason in finish_reasons:
            self.metrics.requests.labels(self.endpoint, reason).inc()
        self.metrics.e2e.labels(self.endpoint).observe(time.perf_counter() - self.start)

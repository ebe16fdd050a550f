"""Prometheus metrics of ``jaxspec serve``: requests, latency, batch occupancy and speculation.

Names follow vLLM's where they mean the same thing (``spec_decode_*``, time to first token,
time per output token), under the ``jaxspec_`` prefix; ``VllmView`` serves them again under vLLM's own
``vllm:`` names, which routers read. Each server owns its own registry, so two servers in one process
(tests) never share counters. The mean acceptance length is
exported as a gauge and is also ``1 + rate(accepted) / rate(drafts)`` from the counters.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_asgi_app
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

OUTCOMES = ("stop", "length", "cancelled", "error", "rejected", "queue_full")
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
STEP_TOKEN_BUCKETS = tuple(range(1, 17)) + (24, 32)


class ServerMetrics:
    """Every series the server exports, in one registry (``asgi_app`` serves it)."""

    def __init__(self, queue_depth: Callable[[], float], active_slots: Callable[[], float],
                 compilations: Callable[[], float] = lambda: 0) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("jaxspec_requests", "Completions (one per choice) by outcome: stop (EOS or a stop "
                                "string), length, cancelled, error; HTTP requests refused before decoding: "
                                "rejected (bad request, 4xx), queue_full (429)", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # every outcome exported from the start, at 0
        self.prompt_tokens = Counter("jaxspec_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.prefix_queries = Counter("jaxspec_prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                      "(one lookup per admitted request)", registry=r)
        self.prefix_hits = Counter("jaxspec_prefix_cache_hits", "Prompt tokens of those found cached (their prefill "
                                   "skipped)", registry=r)
        self.generation_tokens = Counter("jaxspec_generation_tokens", "Tokens generated (rate() = tokens/s)",
                                         registry=r)
        Gauge("jaxspec_queue_depth", "Requests waiting for a batch slot", registry=r).set_function(queue_depth)
        Gauge("jaxspec_active_slots", "Batch slots decoding a request", registry=r).set_function(active_slots)
        Gauge("jaxspec_compilations", "Traces of the decoding executables; flat after the warm-up (a rise is a "
              "shape compiled while serving, stalling every slot)", registry=r).set_function(compilations)
        self.request_log_errors = Counter("jaxspec_request_log_errors", "--request-log lines that could not be "
                                          "written (a full disk: /health says degraded while writes fail)",
                                          registry=r)
        self.metrics_errors = Counter("jaxspec_metrics_errors", "Events whose metrics failed to record (a bug: the "
                                      "server log has the first one's stack)", registry=r)
        self.ttft = Histogram("jaxspec_time_to_first_token_seconds", "From arrival to the first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("jaxspec_time_per_output_token_seconds", "Per request: (last token - first token) "
                              "/ (tokens - 1)", buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("jaxspec_e2e_request_latency_seconds", "From arrival to the last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.iterations = Counter("jaxspec_iterations", "Decoding iterations (one LLM pass for all active slots) "
                                  "by the tree they ran", ["tree"], registry=r)
        self.iteration_seconds = Histogram("jaxspec_iteration_seconds", "Wall time of one decoding iteration",
                                           buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.step_tokens = Histogram("jaxspec_tokens_per_llm_step", "Tokens a request emits per LLM step "
                                     "(accepted draft tokens + 1)", buckets=STEP_TOKEN_BUCKETS, registry=r)
        self.drafts = Counter("jaxspec_spec_decode_num_drafts", "Slot-iterations that verified a draft", registry=r)
        self.draft_tokens = Counter("jaxspec_spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.accepted = Counter("jaxspec_spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_per_pos = Counter("jaxspec_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted "
                                        "at each tree depth (position 0 = depth 1)", ["position"], registry=r)
        Gauge("jaxspec_spec_decode_mean_acceptance_length", "1 + accepted tokens / drafts (tokens per LLM step "
              "of drafted slot-iterations)", registry=r).set_function(self.mean_acceptance_length)
        self.asgi_app = make_asgi_app(registry=r)
        self._totals = {"drafts": 0, "accepted": 0, "generated": 0}  # plain copies for the log line and gauge

    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts over the server's life (0 before any draft)."""
        drafts = self._totals["drafts"]
        return 1.0 + self._totals["accepted"] / drafts if drafts else 0.0

    def generated(self) -> int:
        return self._totals["generated"]

    def observe_iteration(self, stats) -> None:
        """One ``jaxspec.engine.core.IterationStats``: tree, wall time, per-slot tokens and acceptance."""
        self.iterations.labels(stats.tree).inc()
        self.iteration_seconds.observe(stats.seconds)
        for emitted, drafted, depth in zip(stats.emitted, stats.drafted, stats.accepted_depth):
            if emitted:
                self.step_tokens.observe(emitted)
            if drafted:
                self.drafts.inc()
                self.draft_tokens.inc(drafted)
                self.accepted.inc(depth)
                self._totals["drafts"] += 1
                self._totals["accepted"] += depth
                for pos in range(depth):
                    self.accepted_per_pos.labels(str(pos)).inc()

    def observe_tokens(self, count: int) -> None:
        self.generation_tokens.inc(count)
        self._totals["generated"] += count

    def observe_finished(self, outcome: str, arrival: float, first: float | None, last: float, tokens: int) -> None:
        """One finished completion: its outcome and latencies (``time.monotonic`` stamps; TTFT is observed
        as the first token arrives, by the caller)."""
        self.requests.labels(outcome).inc()
        if first is not None:
            self.e2e.observe(last - arrival)
            if tokens > 1:
                self.tpot.observe((last - first) / (tokens - 1))


# vLLM's name for each jaxspec series of the same quantity: routers (llm-d's endpoint picker, the Gateway API Inference
# Extension) and vLLM's Grafana dashboards read these names, so a jaxspec pod sits behind them as a vLLM pod does.
VLLM_NAMES = {
    "jaxspec_queue_depth": "vllm:num_requests_waiting",
    "jaxspec_active_slots": "vllm:num_requests_running",
    "jaxspec_prompt_tokens": "vllm:prompt_tokens",
    "jaxspec_generation_tokens": "vllm:generation_tokens",
    "jaxspec_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "jaxspec_time_per_output_token_seconds": "vllm:request_time_per_output_token_seconds",
    "jaxspec_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "jaxspec_spec_decode_num_drafts": "vllm:spec_decode_num_drafts",
    "jaxspec_spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "jaxspec_spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "jaxspec_spec_decode_num_accepted_tokens_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
}
# jaxspec_requests' outcomes of requests that reached the engine, as vLLM's finished_reason (the HTTP refusals,
# rejected and queue_full, never reach vLLM's engine either)
VLLM_FINISHED = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}
ENGINE = "jaxspec"  # the ``engine`` label of every vllm: series


def kv_cache_usage(batch) -> float:
    """Share (0..1) of the KV cache's token capacity, ``max_batch`` x ``max_model_len``, the live requests hold
    (vLLM's ``kv_cache_usage_perc``: a prefix kept only for reuse is free, as vLLM's evictable blocks are)."""
    held = sum(slot.committed for slot in list(batch.slots))
    return min(1.0, held / (batch.max_batch * batch.max_model_len))


class VllmView(Collector):
    """The server's own series again under vLLM's names, labelled ``model_name`` and ``engine`` as vLLM's are,
    read from the jaxspec series at every scrape (one source: the two names cannot disagree), plus the KV cache
    usage and ``vllm:cache_config_info`` that routers read."""

    def __init__(self, metrics: ServerMetrics, model_name: str, kv_usage: Callable[[], float],
                 cache_config: dict[str, str]) -> None:
        self.metrics, self.kv_usage = metrics, kv_usage
        self.labels = {"model_name": model_name, "engine": ENGINE}
        self.cache_config = cache_config
        self._reading = threading.local()  # this thread is reading the registry it sits in: yield nothing there

    def collect(self) -> Iterator[Metric]:
        if getattr(self._reading, "on", False):
            return
        self._reading.on = True
        try:
            families = list(self.metrics.registry.collect())
        finally:
            self._reading.on = False
        for family in families:
            if family.name == "jaxspec_requests":
                yield self._finished(family)
            elif family.name in VLLM_NAMES:
                yield self._renamed(family, VLLM_NAMES[family.name])
        usage = Metric("vllm:kv_cache_usage_perc", "KV cache usage (1 = 100%): tokens the live requests hold of "
                       "max_batch x max_model_len", "gauge")
        usage.add_sample("vllm:kv_cache_usage_perc", self.labels, self.kv_usage())
        yield usage
        info = Metric("vllm:cache_config_info", "The KV cache's configuration (block_size: the prefix cache's block "
                      "of tokens)", "gauge")
        info.add_sample("vllm:cache_config_info", {**self.labels, **self.cache_config}, 1.0)
        yield info

    def _renamed(self, family: Metric, name: str) -> Metric:
        out = Metric(name, family.documentation, family.type)
        for s in family.samples:
            out.add_sample(name + s.name[len(family.name):], {**s.labels, **self.labels}, s.value, s.timestamp)
        return out

    def _finished(self, family: Metric) -> Metric:
        out = Metric("vllm:request_success", "Finished requests by finished_reason (stop, length, abort, error)",
                     "counter")
        for s in family.samples:
            reason = VLLM_FINISHED.get(s.labels["outcome"])
            if reason is not None:
                out.add_sample("vllm:request_success" + s.name[len(family.name):],
                               {"finished_reason": reason, **self.labels}, s.value, s.timestamp)
        return out

"""Prometheus metrics of the server (a private registry rendered at ``GET /metrics``).

Besides our own ``gpullama_*`` names, the gauges that cluster routers scrape are also exported under the names of
the Kubernetes Gateway API inference extension's model-server protocol (vLLM's names, which its endpoint picker,
llm-d, AIBrix and Dynamo read): ``vllm:num_requests_waiting`` (TotalQueuedRequests), ``vllm:num_requests_running``
(TotalRunningRequests), ``vllm:kv_cache_usage_perc`` (KVCacheUtilization, 0 to 1; also under its older name
``vllm:gpu_cache_usage_perc``) and ``vllm:cache_config_info`` (the optional BlockSize and NumGPUBlocks labels of
the prefix-cache scorer). The LoRA-info gauge is not exported: gpullama serves no LoRA adapters.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
KNOWN_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/health", "/metrics",
                "/tokenize", "/detokenize", "/version"}
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """Request counts by status, token counters, latency histograms and the engine's queue gauges."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("gpullama_http_requests", "HTTP requests by route and status code.",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("gpullama_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("gpullama_generation_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram("gpullama_time_to_first_token_seconds", "Time from request arrival to the first token.",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("gpullama_inter_token_latency_seconds", "Time between consecutive generated tokens.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("gpullama_request_duration_seconds", "Generation request latency, arrival to last token.",
                             buckets=_TTFT_BUCKETS, registry=r)
        self.running = Gauge("gpullama_requests_running", "Requests in the engine's running batch.", registry=r)
        self.waiting = Gauge("gpullama_requests_waiting", "Requests queued in the engine.", registry=r)
        self.kv_blocks_used = Gauge("gpullama_kv_blocks_used", "KV-cache blocks held by requests.", registry=r)
        self.kv_blocks_total = Gauge("gpullama_kv_blocks_total", "KV-cache blocks in the pool.", registry=r)
        self.kv_usage = Gauge("gpullama_kv_cache_usage_ratio", "Share of the KV-cache blocks held by requests (0 to 1).",
                              registry=r)
        self.draft_tokens = Counter("gpullama_spec_decode_num_draft_tokens",
                                    "Speculative (n-gram) draft tokens checked.", registry=r)
        self.accepted_tokens = Counter("gpullama_spec_decode_num_accepted_tokens",
                                       "Speculative (n-gram) draft tokens accepted.", registry=r)
        self._drafts_seen = (0, 0)
        # the model-server protocol's names (docs/deploy.md, "Behind a Kubernetes inference gateway")
        self.protocol_waiting = Gauge("vllm:num_requests_waiting", "Requests queued in the engine (TotalQueuedRequests).",
                                      registry=r)
        self.protocol_running = Gauge("vllm:num_requests_running",
                                      "Requests in the engine's running batch (TotalRunningRequests).", registry=r)
        self.protocol_kv_usage = Gauge("vllm:kv_cache_usage_perc",
                                       "KV-cache usage, 0 to 1: 1 means 100 percent (KVCacheUtilization).", registry=r)
        self.protocol_kv_usage_old = Gauge("vllm:gpu_cache_usage_perc",
                                           "KV-cache usage, 0 to 1 (the older name of vllm:kv_cache_usage_perc).",
                                           registry=r)
        self.cache_config = Gauge("vllm:cache_config_info", "KV-cache layout: block size in tokens and pool blocks.",
                                  ["block_size", "num_gpu_blocks"], registry=r)
        self._cache_config_set = False

    def observe_request(self, path: str, status: int) -> None:
        """Count one finished HTTP request (unknown paths share one label)."""
        self.requests.labels(path if path in KNOWN_ROUTES else "other", str(status)).inc()

    def render(self, engine: Any | None) -> bytes:
        """The Prometheus text exposition, with the queue and KV-pool gauges read from ``engine`` now."""
        self.running.set(engine.num_running if engine is not None else 0)
        self.waiting.set(engine.num_waiting if engine is not None else 0)
        used = engine.kv_blocks_used if engine is not None else 0
        total = engine.kv_blocks_total if engine is not None else 0
        self.kv_blocks_used.set(used)
        self.kv_blocks_total.set(total)
        if engine is not None:  # the engine's running totals, as counters
            stats = engine.engine.stats
            drafts, accepted = stats.draft_tokens, stats.accepted_tokens
            self.draft_tokens.inc(max(0, drafts - self._drafts_seen[0]))
            self.accepted_tokens.inc(max(0, accepted - self._drafts_seen[1]))
            self._drafts_seen = (drafts, accepted)
        usage = used / total if total else 0.0
        self.kv_usage.set(usage)
        self.protocol_waiting.set(engine.num_waiting if engine is not None else 0)
        self.protocol_running.set(engine.num_running if engine is not None else 0)
        self.protocol_kv_usage.set(usage)
        self.protocol_kv_usage_old.set(usage)
        if engine is not None and not self._cache_config_set:
            self.cache_config.labels(str(engine.kv_block_size), str(total)).set(1)
            self._cache_config_set = True
        return generate_latest(self.registry)

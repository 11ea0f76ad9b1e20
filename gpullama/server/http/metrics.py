"""Prometheus metrics of the server (a private registry rendered at ``GET /metrics``).

Besides our own ``gpullama_*`` names, the gauges that cluster routers scrape are also exported under the names of
the Kubernetes Gateway API inference extension's model-server protocol (vLLM's names, which its endpoint picker,
llm-d, AIBrix and Dynamo read): ``vllm:num_requests_waiting`` (TotalQueuedRequests), ``vllm:num_requests_running``
(TotalRunningRequests), ``vllm:kv_cache_usage_perc`` (KVCacheUtilization, 0 to 1; also under its older name
``vllm:gpu_cache_usage_perc``) and ``vllm:cache_config_info`` (the optional BlockSize and NumGPUBlocks labels of
the prefix-cache scorer). The LoRA-info gauge is not exported: gpullama serves no LoRA adapters.

llama.cpp's ``llamacpp:*`` families are written as llama-server writes them (`LlamaCppCounters.text`: each with
HELP and TYPE, its counters named with their ``_total`` as given, ``n_tokens_max`` without), for the dashboards
and scripts made for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.utils import floatToGoString

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
KNOWN_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/health", "/metrics",
                "/tokenize", "/detokenize", "/version"}
CONTENT_TYPE = CONTENT_TYPE_LATEST


@dataclass
class LlamaCppCounters:
    """The totals behind llama.cpp's ``llamacpp:*`` families that the requests give (the engine's counters give
    the rest): prompt tokens computed and their seconds (arrival to each choice's first token), tokens generated
    and their seconds (first to last token), the longest sequence; and the same since the last scrape, for the
    throughput gauges (llama.cpp averages them over the window between two scrapes)."""

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    predicted_tokens: int = 0
    predicted_seconds: float = 0.0
    longest: int = 0  # prompt + generation of the longest sequence seen
    window: tuple[int, float, int, float] = (0, 0.0, 0, 0.0)  # the four totals at the last scrape

    def observe_prompt(self, tokens: int, seconds: float) -> None:
        """One choice's prompt is processed: `tokens` computed (its prefix-cache hits left out) in `seconds`."""
        self.prompt_tokens += tokens
        self.prompt_seconds += seconds

    def observe_choice(self, prompt_tokens: int, tokens: int, seconds: float) -> None:
        """One choice ended: `tokens` generated in `seconds` after its first, after a prompt of `prompt_tokens`."""
        self.predicted_tokens += tokens
        self.predicted_seconds += seconds
        self.longest = max(self.longest, prompt_tokens + tokens)

    def text(self, engine: Any | None) -> bytes:
        """The families in llama-server's text exposition, with the engine's step counters and queue now (an
        engine that has not loaded yet counts as idle); the throughput gauges cover the time since the last call."""
        return llamacpp_text([("", self.samples(engine))])

    def samples(self, engine: Any | None) -> list[tuple[str, str, str, float]]:
        """(name, help, kind, value) of each ``llamacpp:*`` family for `engine`; see `text`."""
        stats = engine.engine.stats if engine is not None else None
        totals = (self.prompt_tokens, self.prompt_seconds, self.predicted_tokens, self.predicted_seconds)
        d_prompt, d_prompt_s, d_predicted, d_predicted_s = (a - b for a, b in zip(totals, self.window))
        self.window = totals
        steps = stats.steps if stats else 0
        counters = (
            ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens",
             stats.prompt_tokens if stats else 0),
            ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache",
             stats.cached_tokens if stats else 0),
            ("prompt_seconds_total", "Total time spent processing prompts", self.prompt_seconds),
            ("tokens_predicted_total", "Number of generation tokens processed", self.predicted_tokens),
            ("tokens_predicted_seconds_total", "Total time spent generating tokens", self.predicted_seconds),
            ("n_decode_total", "Total number of engine steps (llama.cpp: llama_decode() calls)", steps),
            ("n_tokens_max", "Largest observed sequence length (prompt + generation)", self.longest),
            ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated",
             stats.draft_tokens if stats else 0),
            ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model",
             stats.accepted_tokens if stats else 0),
            ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps",
             stats.draft_checks if stats else 0),
        )
        gauges = (
            ("prompt_tokens_seconds", "Average prompt throughput in tokens/s",
             d_prompt / d_prompt_s if d_prompt_s > 0 else 0.0),
            ("predicted_tokens_seconds", "Average generation throughput in tokens/s",
             d_predicted / d_predicted_s if d_predicted_s > 0 else 0.0),
            ("requests_processing", "Number of requests processing", engine.num_running if engine else 0),
            ("requests_deferred", "Number of requests deferred", engine.num_waiting if engine else 0),
            ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
             (stats.scheduled_seqs if stats else 0) / max(steps, 1)),
        )
        return [(name, help_text, kind, value) for kind, items in (("counter", counters), ("gauge", gauges))
                for name, help_text, value in items]


def llamacpp_text(per_model: list[tuple[str, list[tuple[str, str, str, float]]]]) -> bytes:
    """The ``llamacpp:*`` families of each (model name, samples): HELP and TYPE once per family, then one sample per
    model, labelled ``model_name`` when the name is not empty (a server of several models)."""
    lines: list[str] = []
    for i, (name, help_text, kind, _) in enumerate(per_model[0][1] if per_model else []):
        lines += [f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}"]
        for model, samples in per_model:
            label = f'{{model_name="{_escape(model)}"}}' if model else ""
            lines.append(f"llamacpp:{name}{label} {floatToGoString(samples[i][3])}")
    return ("\n".join(lines) + "\n").encode()


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class ModelMetrics:
    """One model's series (its children of the labelled families) and llama.cpp counters: what a request's
    generation observes."""

    def __init__(self, metrics: ServerMetrics, name: str) -> None:
        self.name = name
        for attr in ("prompt_tokens", "generation_tokens", "ttft", "itl", "e2e"):
            setattr(self, attr, getattr(metrics, attr).labels(name))
        self.llamacpp = LlamaCppCounters()
        self.drafts_seen = (0, 0)


class ServerMetrics:
    """Request counts by status, token counters, latency histograms and the engines' queue gauges. With `labelled`
    (a server of several models) every series that describes one model's engine carries its ``model_name`` label
    (vLLM's label name); with one model they are unlabelled, as before."""

    def __init__(self, labelled: bool = False) -> None:
        self.registry = CollectorRegistry()
        self.labelled = labelled
        r = self.registry
        per_model = ["model_name"] if labelled else []
        self.requests = Counter("gpullama_http_requests", "HTTP requests by route and status code.",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("gpullama_prompt_tokens", "Prompt tokens processed.", per_model, registry=r)
        self.generation_tokens = Counter("gpullama_generation_tokens", "Tokens generated.", per_model, registry=r)
        self.ttft = Histogram("gpullama_time_to_first_token_seconds", "Time from request arrival to the first token.",
                              per_model, buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("gpullama_inter_token_latency_seconds", "Time between consecutive generated tokens.",
                             per_model, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("gpullama_request_duration_seconds", "Generation request latency, arrival to last token.",
                             per_model, buckets=_TTFT_BUCKETS, registry=r)
        self.running = Gauge("gpullama_requests_running", "Requests in the engine's running batch.", per_model,
                             registry=r)
        self.waiting = Gauge("gpullama_requests_waiting", "Requests queued in the engine.", per_model, registry=r)
        self.kv_blocks_used = Gauge("gpullama_kv_blocks_used", "KV-cache blocks held by requests.", per_model,
                                    registry=r)
        self.kv_blocks_total = Gauge("gpullama_kv_blocks_total", "KV-cache blocks in the pool.", per_model,
                                     registry=r)
        self.kv_usage = Gauge("gpullama_kv_cache_usage_ratio", "Share of the KV-cache blocks held by requests (0 to 1).",
                              per_model, registry=r)
        self.draft_tokens = Counter("gpullama_spec_decode_num_draft_tokens",
                                    "Speculative (n-gram) draft tokens checked.", per_model, registry=r)
        self.accepted_tokens = Counter("gpullama_spec_decode_num_accepted_tokens",
                                       "Speculative (n-gram) draft tokens accepted.", per_model, registry=r)
        self._drafts_seen = (0, 0)
        # the model-server protocol's names (docs/deploy.md, "Behind a Kubernetes inference gateway")
        self.protocol_waiting = Gauge("vllm:num_requests_waiting", "Requests queued in the engine (TotalQueuedRequests).",
                                      per_model, registry=r)
        self.protocol_running = Gauge("vllm:num_requests_running",
                                      "Requests in the engine's running batch (TotalRunningRequests).", per_model,
                                      registry=r)
        self.protocol_kv_usage = Gauge("vllm:kv_cache_usage_perc",
                                       "KV-cache usage, 0 to 1: 1 means 100 percent (KVCacheUtilization).", per_model,
                                       registry=r)
        self.protocol_kv_usage_old = Gauge("vllm:gpu_cache_usage_perc",
                                           "KV-cache usage, 0 to 1 (the older name of vllm:kv_cache_usage_perc).",
                                           per_model, registry=r)
        self.cache_config = Gauge("vllm:cache_config_info", "KV-cache layout: block size in tokens and pool blocks.",
                                  ["block_size", "num_gpu_blocks", *per_model], registry=r)
        self._cache_config_set: set[str] = set()
        self.llamacpp = LlamaCppCounters()
        self.models: dict[str, ModelMetrics] = {}

    def for_model(self, name: str) -> ServerMetrics | ModelMetrics:
        """What a request's generation on model `name` observes: these metrics themselves when unlabelled."""
        if not self.labelled:
            return self
        return self.models.setdefault(name, ModelMetrics(self, name))

    def observe_request(self, path: str, status: int) -> None:
        """Count one finished HTTP request (unknown paths share one label)."""
        self.requests.labels(path if path in KNOWN_ROUTES else "other", str(status)).inc()

    def render(self, engines: Any) -> bytes:
        """The Prometheus text exposition, with the queue and KV-pool gauges read from the engines now: `engines`
        is the one engine (or None) when unlabelled, else (model name, engine or None) for each model."""
        if not self.labelled:
            self._engine_gauges(engines, (), self)
            return generate_latest(self.registry) + self.llamacpp.text(engines)
        texts = []
        for name, engine in engines:
            model = self.for_model(name)
            self._engine_gauges(engine, (name,), model)
            texts.append((name, model.llamacpp.samples(engine)))
        return generate_latest(self.registry) + llamacpp_text(texts)

    def _engine_gauges(self, engine: Any | None, labels: tuple[str, ...], seen: Any) -> None:
        def put(gauge: Gauge, value: float) -> None:
            (gauge.labels(*labels) if labels else gauge).set(value)

        running = engine.num_running if engine is not None else 0
        waiting = engine.num_waiting if engine is not None else 0
        used = engine.kv_blocks_used if engine is not None else 0
        total = engine.kv_blocks_total if engine is not None else 0
        usage = used / total if total else 0.0
        for gauge, value in ((self.running, running), (self.waiting, waiting), (self.kv_blocks_used, used),
                             (self.kv_blocks_total, total), (self.kv_usage, usage), (self.protocol_waiting, waiting),
                             (self.protocol_running, running), (self.protocol_kv_usage, usage),
                             (self.protocol_kv_usage_old, usage)):
            put(gauge, value)
        if engine is not None:  # the engine's running totals, as counters
            stats = engine.engine.stats
            drafts, accepted = stats.draft_tokens, stats.accepted_tokens
            before = seen.drafts_seen if labels else self._drafts_seen
            if drafts < before[0] or accepted < before[1]:  # a new engine (the model was reloaded)
                before = (0, 0)
            for counter, delta in ((self.draft_tokens, drafts - before[0]), (self.accepted_tokens,
                                                                              accepted - before[1])):
                (counter.labels(*labels) if labels else counter).inc(max(0, delta))
            if labels:
                seen.drafts_seen = (drafts, accepted)
            else:
                self._drafts_seen = (drafts, accepted)
            key = labels[0] if labels else ""
            if key not in self._cache_config_set:
                self.cache_config.labels(str(engine.kv_block_size), str(total), *labels).set(1)
                self._cache_config_set.add(key)

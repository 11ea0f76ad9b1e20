"""What generation returns: whole completions and streamed deltas."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TopLogprob:
    """One of the most likely tokens at a position."""

    token_id: int
    token: str
    logprob: float


@dataclass
class TokenLogprob:
    """Log-probability of a generated token, with the top-N alternatives at its position."""

    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob] = field(default_factory=list)


@dataclass
class CompletionOutput:
    """One sample of a prompt (``SamplingParams.n`` of them per prompt), as vLLM's ``CompletionOutput``."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", or "error" (then `error` says why)
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None


@dataclass
class Completion:
    """The finished output of one prompt: its first sample's fields, and every sample in `outputs`."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", or "error" (then `error` says why)
    logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)  # all n samples, index order


@dataclass
class EmbeddingOutput:
    """The embedding of one input: its vector and the token ids it was computed from."""

    embedding: list[float]
    prompt_token_ids: list[int]


@dataclass
class RerankResult:
    """One document's place in a reranking: its index in the documents given, its score (the reranker's first
    output: for Qwen3-Reranker the probability of "yes"), the document itself and its prompt's token count."""

    index: int
    relevance_score: float
    document: str
    num_prompt_tokens: int


@dataclass
class StreamDelta:
    """What one engine step added to one request: new text, new token ids and, at the end, why it finished."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0
    error: BaseException | None = None  # with finish_reason "error": why this request alone failed
    embedding: list[float] | None = None  # an embedding request's vector (its only delta, finish_reason "stop")
    stop_reason: str | int | None = None  # with finish_reason "stop": the stop string or stop token id, if one
    # a progress delta (SamplingParams.return_progress): the prompt tokens processed so far, prefix-cache hits included
    num_computed_prompt_tokens: int | None = None

"""Admission: the one check a request passes before it may join the batch (the library and the server both use it).

The engine sees token ids and sampling parameters only (chat messages are checked above it, in `gpullama.chat`).
Everything a request carries is checked here, once, against fixed limits: the type and range of every sampling
field, the caps on list sizes (the OpenAI API's where it has one), token ids against the vocabulary, and the
prompt plus completion against the context and the KV pool. A refusal is a `RequestError` naming the field, so
one bad request is answered on its own and never reaches a step that other requests share.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpullama.checks import RequestError, check_count, kind
from gpullama.pooling_params import RANK, PoolingParams
from gpullama.sampling_params import SamplingParams

MAX_STOP = 4  # stop strings, as the OpenAI API allows
MAX_STOP_TOKEN_IDS = 1024  # extra stop token ids (vLLM's field; no OpenAI cap exists)
MAX_LOGIT_BIAS = 300  # logit_bias entries, as the OpenAI API allows


@dataclass(frozen=True)
class AdmissionLimits:
    """What a request is checked against: the vocabulary, the context and the KV pool."""

    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int
    hidden_size: int = 0  # the embedding size (0: unknown)
    pooling_type: str = "last"  # the model's pooling (ModelConfig.pooling_type)
    reranker: bool = False  # pooling_type rank and a classification head (`gpullama.model.RankHead`): it scores
    image_embedding_size: int = 0  # an image token's embedding width (ModelConfig.input_embedding_size; 0: hidden_size)


def check_sampling(params: SamplingParams, vocab_size: int) -> None:
    """Every sampling field's type and range, the list caps, and every token id within the vocabulary.
    A `top_k` of the vocabulary size or more keeps every token, the same as 0 (the sampler treats it so)."""
    try:
        params.validate()
    except ValueError as exc:
        name = str(exc).split(" ", 1)[0].removeprefix("SamplingParams.")
        raise RequestError(str(exc).replace(f"SamplingParams.{name}", f"'{name}'", 1), name) from None
    check_count("stop", len(params.stop), MAX_STOP)
    check_count("stop_token_ids", len(params.stop_token_ids), MAX_STOP_TOKEN_IDS)
    check_count("logit_bias", len(params.logit_bias), MAX_LOGIT_BIAS)
    check_count("preserved_token_ids", len(params.preserved_token_ids), MAX_STOP_TOKEN_IDS)
    for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids),
                      ("preserved_token_ids", params.preserved_token_ids)):
        outside = [t for t in ids if not 0 <= t < vocab_size]
        if outside:
            raise RequestError(
                f"'{name}' holds token id {outside[0]}, outside the vocabulary of {vocab_size} tokens", name)


def check_request(prompt_token_ids: list[int], params: SamplingParams, limits: AdmissionLimits) -> int:
    """Validate a request against the model and the engine; returns its resolved max_tokens (the rest of the
    context when `params.max_tokens` is None). Raises RequestError naming the field, the limit and both numbers."""
    if not isinstance(prompt_token_ids, list):
        raise RequestError(f"the prompt must be a list of token ids, got {kind(prompt_token_ids)}", "prompt")
    if limits.reranker:  # llama.cpp's server in reranking mode refuses completions too
        raise RequestError("this model is a reranker (pooling_type rank, a classification head): it scores "
                           "query-document pairs and does not generate text; use /rerank, /v1/score or LLM.rerank",
                           "model")
    n = len(prompt_token_ids)
    limit = limits.max_model_len
    vocab = limits.vocab_size
    if params.n != 1:
        raise RequestError(f"one engine request is one sample, got n={params.n}: LLM.generate/chat and the server "
                           "run n samples as n requests", "n")
    if n == 0:
        raise RequestError("the prompt is empty: it needs at least one token", "prompt")
    if n >= limit:  # before looking at each id: a prompt of millions of ids is refused by its length alone
        raise RequestError(
            f"This model's maximum context length is {limit} tokens, but the prompt has {n} tokens, leaving no room "
            f"for the completion (at most {limit - 1} prompt tokens). Please shorten the prompt.", "prompt", n, limit)
    bad = [t for t in prompt_token_ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab)]
    if bad:
        raise RequestError(f"prompt token id {str(bad[0])[:30]} is out of range: the vocabulary has {vocab} tokens",
                           "prompt")
    check_sampling(params, vocab)
    max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
    if n + max_tokens > limit:
        raise RequestError(
            f"This model's maximum context length is {limit} tokens. However, you requested {n + max_tokens} tokens "
            f"({n} in the prompt, {max_tokens} for the completion). Please reduce the prompt or 'max_tokens'.",
            "max_tokens", n, limit)
    if n + max_tokens > limits.kv_capacity_tokens:
        raise RequestError(
            f"the request needs up to {n + max_tokens} tokens of KV cache but the pool holds "
            f"{limits.kv_capacity_tokens}", "max_tokens")
    return max_tokens


def check_embedding_request(prompt_token_ids: list[int], pooling: PoolingParams, limits: AdmissionLimits) -> None:
    """Validate an embedding request: a prompt of 1 to `max_model_len` token ids inside the vocabulary and the KV
    pool (nothing is generated, so the whole context is the prompt's), pooling options within the model's size, and
    a model that pools (not a reranker); a reranker's request (kind `RANK`), a model that is one. Raises RequestError
    naming the field."""
    if not isinstance(prompt_token_ids, list):
        raise RequestError(f"the input must be a list of token ids, got {kind(prompt_token_ids)}", "prompt")
    n, limit, vocab = len(prompt_token_ids), limits.max_model_len, limits.vocab_size
    if n == 0:
        raise RequestError("the input is empty: it needs at least one token", "prompt")
    if n > limit:
        raise RequestError(f"This model's maximum context length is {limit} tokens, but the input has {n} tokens. "
                           "Please shorten the input.", "prompt")
    if n > limits.kv_capacity_tokens:
        raise RequestError(f"the input needs {n} tokens of KV cache but the pool holds {limits.kv_capacity_tokens}",
                           "prompt")
    bad = [t for t in prompt_token_ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab)]
    if bad:
        raise RequestError(f"input token id {str(bad[0])[:30]} is out of range: the vocabulary has {vocab} tokens",
                           "prompt")
    if pooling.kind == RANK:
        if not limits.reranker:
            raise RequestError("this model is not a reranker (a GGUF with pooling_type rank and a classification head, "
                               "cls.output.weight): it cannot rerank or score", "model")
        return
    if limits.pooling_type == RANK:
        raise RequestError("this model is a reranker (pooling_type rank): it has no embeddings", "model")
    try:
        pooling.validate(limits.hidden_size or None)
    except ValueError as exc:
        name = str(exc).split(" ", 1)[0].removeprefix("PoolingParams.")
        raise RequestError(str(exc).replace(f"PoolingParams.{name}", f"'{name}'", 1), name) from None


def check_images(images: list, prompt_len: int, limits: AdmissionLimits, max_num_batched_tokens: int) -> None:
    """Image spans (`gpullama.vision.ImageSpan`) inside the prompt, in order, not overlapping, each of the model's
    embedding size and, unless causal, no longer than one step's token budget (such an image is computed in one
    step)."""
    previous_end = 0
    for i, span in enumerate(images):
        shape = tuple(span.embeds.shape)
        width = limits.image_embedding_size or limits.hidden_size
        if len(shape) != 2 or (width and shape[1] != width):
            raise RequestError(f"image {i}: embeddings of shape {shape}, expected [tokens, {width}]", "images")
        if span.start < previous_end or span.end > prompt_len:
            raise RequestError(f"image {i}: tokens {span.start}..{span.end} are not inside the prompt of "
                               f"{prompt_len} tokens after the image before it", "images")
        if not span.causal and span.length > max_num_batched_tokens:
            raise RequestError(f"image {i} takes {span.length} tokens, more than max_num_batched_tokens "
                               f"({max_num_batched_tokens}): an image is computed in one step", "images")
        previous_end = span.end

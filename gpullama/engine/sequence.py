"""One request as the engine tracks it: its tokens, its KV blocks and its sampling state."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch

from gpullama.outputs import TokenLogprob
from gpullama.pooling_params import PoolingParams
from gpullama.sampling_params import SamplingParams

if TYPE_CHECKING:
    from gpullama.engine.ngram_proposer import TokenBuffer
    from gpullama.structured.sequence_grammar import SequenceGrammar
    from gpullama.vision import ImageSpan


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A request's token ids (prompt then output), its block table and its per-request sampling state; or, for an
    embedding request (`pooling` set), its prompt and the sum of its pooled hidden states so far."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, max_tokens: int,
                 pooling: PoolingParams | None = None, images: list[ImageSpan] | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens  # the resolved limit (params.max_tokens or the rest of the context)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose k/v sit in the pool
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at the first schedule
        self.state_slot = -1  # its slot of the recurrent layers' states while it runs (-1: none)
        # the block hashes of the latest state checkpoints it saved past its prompt's, oldest first (the engine keeps
        # `state_checkpoints.LATEST_KEPT` of them)
        self.state_checkpoints: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # the stop string or stop token id that ended it (vLLM's)
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.output_counts: dict[int, int] = {}  # token id -> times generated (presence/frequency penalties)
        self.sent_text_len = 0  # characters of output text already handed out
        self.text_parts: list[str] = []  # the output text handed out, piece by piece (joined by `text`)
        self.held_text = ""  # decoded text not handed out yet: a tail that may begin a stop string
        self.prefix_offset = 0  # detokenizer window: ids before read_offset were already turned into text
        self.read_offset = -1
        self.grammar: SequenceGrammar | None = None  # set by the engine when params.structured_output is given
        self.error: Exception | None = None  # why the engine failed this request alone (finish_reason "error")
        self.pooling = pooling  # an embedding request: prefill only, never samples, its KV blocks not kept
        self.pooled: torch.Tensor | None = None  # the pooled hidden states of the chunks computed so far (summed)
        self.embedding: list[float] | None = None  # the finished embedding
        self.spec_token_ids: list[int] = []  # draft tokens proposed for the next step (n-gram speculation)
        self.ngram_tokens: TokenBuffer | None = None  # its token ids as an array for the n-gram lookup
        self.images: list[ImageSpan] = list(images or [])  # embeddings in place of prompt tokens, by position
        # its LoRA adapters: (adapter id, scale) pairs, sorted by id, no zero scale (() : the base model); set by
        # the engine's admission from params.lora
        self.lora: tuple[tuple[int, float], ...] = ()

    @property
    def cache_salt(self) -> tuple | None:
        """What its prefix-cache keys are chained from: its adapters (None for the base model), so KV computed
        under one adapter is never served to a sequence under another."""
        return ("lora", self.lora) if self.lora else None

    def block_key(self, start: int, end: int) -> tuple:
        """What the prefix cache keys the tokens ``start .. end`` by: their ids, then the content hash of each image
        they overlap (the same text with another image is another prefix)."""
        ids = tuple(self.token_ids[start:end])
        keys = tuple(s.key for s in self.images if s.start < end and s.end > start)
        return ids + keys if keys else ids

    @property
    def text(self) -> str:
        """The output text handed out so far (without any stop string)."""
        if len(self.text_parts) > 1:  # join once, so reading it again costs nothing
            self.text_parts = ["".join(self.text_parts)]
        return self.text_parts[0] if self.text_parts else ""

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens."""
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        """How many tokens were generated."""
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def waits_for_grammar(self) -> bool:
        """True while its grammar is still compiling: it may prefill but not reach its sampling token."""
        return self.grammar is not None and not self.grammar.ready

    @property
    def is_finished(self) -> bool:
        """True once the sequence has left the engine."""
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Add a generated token."""
        self.token_ids.append(token_id)
        self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1

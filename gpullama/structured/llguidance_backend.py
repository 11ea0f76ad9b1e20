"""The llguidance implementation of the grammar backend (llguidance is imported when the first backend is built).

A spec compiles to an `llguidance.LLMatcher` at the start of its grammar (a template, never advanced); each
sequence's matcher is a deep copy of it. llguidance takes the vocabulary from our own tokenizer (`VocabView`):
no Hugging Face tokenizer or transformers at run time.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from gpullama.structured.backend import CompiledGrammar, GrammarBackend, GrammarMatcher
from gpullama.structured.bitmask import allow_only
from gpullama.structured.llguidance_grammars import (
    check,
    choice_lark,
    gbnf_lark,
    json_lark,
    json_schema_grammar,
    reason,
    regex_lark,
    tool_calls_lark,
)
from gpullama.structured.spec import StructuredOutput, StructuredOutputError
from gpullama.structured.structural_tag import StructuralTagError, structural_tag_grammar
from gpullama.structured.vocab import grammar_vocab, stop_token_ids

if TYPE_CHECKING:
    import llguidance

    from gpullama.tokenizer import Tokenizer

log = logging.getLogger("gpullama")


class VocabView:
    """The vocabulary as llguidance's `LLTokenizer` reads a `TokenizerWrapper`: each id's raw bytes (empty for
    special, unused and padding ids, so no grammar allows them), the EOS id, and an encoder (which llguidance's
    tokenize helpers call; the matchers never do, as every grammar turns forcing off)."""

    is_tokenizer_wrapper = True  # what LLTokenizer checks for

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None) -> None:
        self._tokenizer = tokenizer
        self.tokens: list[bytes] = grammar_vocab(tokenizer, vocab_size)
        self.stop_token_ids = stop_token_ids(tokenizer)
        self.eos_token_id = self.stop_token_ids[0] if tokenizer.eos_token_id is None else tokenizer.eos_token_id
        self.bos_token_id = None
        self.special_token_ids: list[int] = []  # special ids keep empty bytes: never text

    def __call__(self, text: bytes | str) -> list[int]:
        """Token ids of `text` (UTF-8 bytes or str)."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text)


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int | None = None) -> llguidance.LLTokenizer:
    """llguidance's view of `tokenizer`: raw token bytes (special ones empty), `vocab_size` wide, stop ids."""
    import llguidance

    view = VocabView(tokenizer, vocab_size)
    return llguidance.LLTokenizer(view, n_vocab=len(view.tokens), eos_token=view.stop_token_ids)


def _check_bitmask(bitmask: torch.Tensor, words: int) -> None:
    """ValueError unless llguidance may write `words` int32 words per row straight into `bitmask`'s memory."""
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2 \
            or not bitmask.is_contiguous() or bitmask.shape[1] != words:
        raise ValueError(f"bitmask must be a contiguous CPU int32 tensor of {words} words per row, got "
                         f"{bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}")


class LLGuidanceMatcher(GrammarMatcher):
    """An llguidance LLMatcher behind gpullama's matcher contract: a refused token leaves it unchanged (llguidance
    alone enters an error state), an accepted stop token terminates it (then only EOS is allowed), and rollback
    undoes the stop token too."""

    def __init__(self, handle: llguidance.LLMatcher, stop_ids: Sequence[int], words: int) -> None:
        self.handle = handle
        self._stop_ids = tuple(stop_ids)
        self._stops = frozenset(stop_ids)
        self._words = words
        self._terminated = False
        self._accepted = 0  # tokens the llguidance matcher consumed (stop tokens are not given to it)

    @property
    def live(self) -> bool:
        """Whether llguidance computes this matcher's next mask (not terminated, not in an error state)."""
        return not self._terminated and not self.handle.is_error()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` (EOS only once terminated)."""
        if not self.live:
            self._fill_stop(bitmask, row)
            return
        _check_bitmask(bitmask, self._words)
        target = bitmask[row]
        self.handle.unsafe_compute_mask_ptr(target.data_ptr(), self._words * 4)

    def _fill_stop(self, bitmask: torch.Tensor, row: int) -> None:
        if not self._terminated:
            log.warning("grammar matcher failed, only EOS is allowed now: %s", reason(self.handle.get_error()))
        allow_only(bitmask, row, self._stop_ids)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar does not allow it (or is terminated)."""
        token_id = int(token_id)
        if self._terminated:
            return False
        if token_id in self._stops:
            if not self.handle.is_accepting():
                return False
            self._terminated = True
            return True
        if self.handle.try_consume_tokens([token_id]) != 1:
            return False
        self._accepted += 1
        return True

    def rollback(self, num_tokens: int = 1) -> None:
        """Undo the last `num_tokens` accepted tokens (the stop token included)."""
        if num_tokens <= 0:
            return
        total = self._accepted + self._terminated
        if num_tokens > total:
            raise ValueError(f"cannot roll back {num_tokens} tokens, {total} accepted")
        if self._terminated:
            self._terminated = False
            num_tokens -= 1
        if num_tokens:
            self.handle.rollback(num_tokens)
            self._accepted -= num_tokens

    def is_terminated(self) -> bool:
        """Whether the grammar ended with an accepted EOS."""
        return self._terminated

    def reset(self) -> None:
        """Back to the start of the grammar."""
        self.handle.reset()
        self._terminated = False
        self._accepted = 0


class LLGuidanceBackend(GrammarBackend):
    """Grammar backend on llguidance: JSON compact (no free whitespace) and strict (no extra keys)."""

    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None, cache_size: int = 256) -> None:
        import llguidance

        size = int(vocab_size or tokenizer.vocab_size)
        super().__init__(size, stop_token_ids(tokenizer), cache_size)
        self._llg = llguidance
        self.tokenizer = ll_tokenizer(tokenizer, size)
        self.words = (size + 31) // 32
        self.fill_threads = min(4, self.compile_threads)
        self._executors: dict[int, llguidance.LLExecutor] = {}

    def grammar(self, spec: StructuredOutput) -> str:
        """The llguidance grammar text of `spec`; StructuredOutputError when it cannot be built."""
        matcher, kind = self._llg.LLMatcher, spec.kind
        param = spec.param or kind
        if kind == "json_schema":
            return matcher.grammar_from_lark(json_lark(spec.json_schema))
        if kind == "json_object":  # any object, compact (not strict: it names no property)
            return matcher.grammar_from_lark(json_lark({"type": "object"}, strict=False))
        if kind == "regex":
            return matcher.grammar_from_lark(regex_lark(spec.regex))
        if kind == "grammar":
            try:
                return matcher.grammar_from_lark(gbnf_lark(spec.grammar))
            except ValueError as e:
                raise StructuredOutputError(f"{param}: invalid grammar: {e}", param) from None
        if kind == "choice":
            return matcher.grammar_from_lark(choice_lark(spec.choice))
        if kind == "structural_tag":
            try:
                return structural_tag_grammar(spec.structural_tag)
            except StructuralTagError as e:
                raise StructuredOutputError(f"{param}: invalid structural tag: {e}", param) from None
        tools = spec.tool_calls
        params = tools.params or tuple(f"tools[{i}].function.parameters" for i in range(len(tools.tools)))
        for (_, schema), where in zip(tools.tools, params):  # name the tool whose schema is at fault
            check(matcher.grammar_from_json_schema(json_schema_grammar(json.loads(schema))), where, "JSON schema")
        return matcher.grammar_from_lark(tool_calls_lark(tools))

    def _compile(self, spec: StructuredOutput) -> Any:
        grammar = self.grammar(spec)
        template = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            param = spec.param or spec.kind
            what = "JSON schema" if spec.kind == "json_schema" else spec.kind.replace("_", " ")
            raise StructuredOutputError(f"{param}: invalid {what}: {reason(template.get_error())}", param)
        return template

    def matcher(self, compiled: CompiledGrammar) -> LLGuidanceMatcher:
        """A fresh matcher at the start of `compiled`."""
        return LLGuidanceMatcher(compiled.handle.deep_copy(), self.stop_token_ids, self.words)

    def fill_bitmask(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor,
                     rows: Sequence[int] | None = None, threads: int | None = None) -> None:
        """Fill row ``rows[i]`` for ``matchers[i]``: live llguidance matchers in one batched call on `threads`
        threads (default `fill_threads`). Use 1 when the CPU cores are busy with the model (docs/performance.md,
        "Constrained decoding")."""
        rows = list(range(len(matchers)) if rows is None else rows)
        if len(rows) != len(matchers):
            raise ValueError(f"{len(matchers)} matchers but {len(rows)} rows")
        live = []
        for m, row in zip(matchers, rows):
            if isinstance(m, LLGuidanceMatcher) and m.live:
                live.append((m.handle, int(row)))
            else:
                m.fill_bitmask(bitmask, row)
        if not live:
            return
        _check_bitmask(bitmask, self.words)
        if any(not 0 <= row < bitmask.shape[0] for _, row in live):
            raise ValueError(f"a row is outside the bitmask's {bitmask.shape[0]} rows")
        if len(live) == 1:
            handle, row = live[0]
            handle.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), self.words * 4)
            return
        n = max(1, int(threads or self.fill_threads))
        executor = self._executors.get(n)
        if executor is None:
            executor = self._executors[n] = self._llg.LLExecutor(num_threads=n)
        executor.unsafe_compute_mask_ptr(live, bitmask.data_ptr(), self.words * 4, bitmask.shape[0])

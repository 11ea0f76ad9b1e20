"""`SequenceGrammar`: what one constrained sequence holds of its grammar, from the compilation in flight to its
matcher. The engine keeps one on each constrained `Sequence` (`gpullama.engine.structured_output` fills it)."""

from __future__ import annotations

from concurrent.futures import Future

from gpullama.structured.backend import GrammarMatcher
from gpullama.structured.spec import StructuredOutput


class SequenceGrammar:
    """One constrained sequence's grammar: the compilation in flight, then its matcher (made on the step thread
    when the sequence first samples)."""

    __slots__ = ("spec", "future", "matcher")

    def __init__(self, spec: StructuredOutput, future: Future) -> None:
        self.spec = spec
        self.future = future
        self.matcher: GrammarMatcher | None = None

    @property
    def ready(self) -> bool:
        """Whether the compilation has finished (successfully or not): the sequence may sample."""
        return self.matcher is not None or self.future.done()

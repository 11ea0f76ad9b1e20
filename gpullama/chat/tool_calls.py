"""Tool calls in model output text, parsed whole or streamed: the calls and their pieces, and the scanner every
format's parser (`gpullama.chat.formats`) builds on.

A parser reads characters one at a time, so feeding any split of a text gives the same content and calls as
feeding it whole. A call is committed (its id and name streamed) once its name is read; until then its text is
held back, and released as content if it turns out not to be a call. Arguments stream as they are written.
"""

from __future__ import annotations

import json
import secrets
from collections import deque
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from typing import Any

WHITESPACE = " \t\r\n"
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")
Char = str | None  # one character, or None at the end of the text
Scan = Generator[None, Char, Any]


def new_call_id() -> str:
    """An OpenAI-style tool-call id: ``call_`` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    """One complete call: id, function name and arguments (JSON text, as the model wrote them)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        """The call as an OpenAI ``message.tool_calls`` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    """A streamed piece of call `index`: id and name in its first piece, then fragments of the arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        """The piece as an OpenAI ``delta.tool_calls`` entry."""
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, str] = {}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
        if self.name is not None:
            function["name"] = self.name
        function["arguments"] = self.arguments
        out["function"] = function
        return out


@dataclass
class ParsedDelta:
    """What one piece of text turned into: content text and tool-call pieces."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass
class ParsedOutput:
    """A whole output: its content (None when there is none) and its tool calls."""

    content: str | None
    tool_calls: list[ToolCall]


def accumulate(deltas: Iterable[ParsedDelta]) -> ParsedOutput:
    """Join streamed pieces as a client does: content concatenated, calls gathered by index."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        content.append(d.content)
        for t in d.tool_calls:
            call = calls.setdefault(t.index, {"id": None, "name": None, "arguments": []})
            call["id"] = call["id"] or t.id
            call["name"] = call["name"] or t.name
            call["arguments"].append(t.arguments)
    text = "".join(content)
    return ParsedOutput(text or None, [ToolCall(c["name"], "".join(c["arguments"]), c["id"])
                                       for _, c in sorted(calls.items())])


class NotACall(Exception):
    """The text held back is not a tool call after all."""


class _Bad(Exception):
    """A committed call's JSON is malformed at the current character."""


class EndOfText(Exception):
    """The text ended inside a call."""


class _StringDecoder:
    """Decodes a JSON string's body one character at a time (`closed` once its closing quote is read)."""

    def __init__(self) -> None:
        self.closed = False
        self._escape = ""
        self._high = ""  # a high surrogate waiting for its low half

    def feed(self, c: str) -> str:
        """Take one character; return the decoded text it completes."""
        if self._escape:
            self._escape += c
            if self._escape[1] == "u" and len(self._escape) < 6:
                return ""
            escape, self._escape = self._escape, ""
            return self._decode(escape)
        if c == "\\":
            self._escape = c
            return ""
        if c == '"':
            self.closed = True
            return self._flush()
        return self._flush() + c

    def _decode(self, escape: str) -> str:
        try:
            ch = json.loads(f'"{escape}"')
        except ValueError:
            return self._flush() + escape  # not a JSON escape: keep it as written
        if "\ud800" <= ch <= "\udbff":
            out, self._high = self._flush(), ch
            return out
        if "\udc00" <= ch <= "\udfff":
            if not self._high:
                return "\ufffd"
            pair, self._high = self._high + ch, ""
            return pair.encode("utf-16", "surrogatepass").decode("utf-16")
        return self._flush() + ch

    def _flush(self) -> str:
        out, self._high = ("\ufffd" if self._high else ""), ""
        return out


class ToolParser:
    """Base of the format parsers: content scanning, call regions, commit and release. Not thread-safe.

    `tool_names`: when given, only calls of these functions count (others stay content). `id_factory` makes
    the call ids. Feed text with `feed`, then call `finish` once; or `parse` a whole text.
    """

    name = "base"
    markers: tuple[str, ...] = ()  # open a call region anywhere in the content
    start_markers: tuple[str, ...] = ()  # open one only at the start of the text (after whitespace)
    start_chars: str = ""  # characters that open a region at the start of the text and belong to it
    open_chars: str = ""  # characters that open a region anywhere in the content and belong to it
    # the format's words that a vocabulary may hold as special tokens, which must then stay in the text it reads
    token_markers: tuple[str, ...] = ()
    args_keys: tuple[str, ...] = ("arguments", "parameters")

    def __init__(self, tool_names: Iterable[str] | None = None, id_factory: Callable[[], str] = new_call_id) -> None:
        self.tool_names = None if tool_names is None else frozenset(tool_names)
        self._new_id = id_factory
        self._calls = 0
        self._open: int | None = None  # index of the call being written
        self._open_has_args = False
        # content scanning
        self._at_start = True
        self._ws = ""  # whitespace held back (dropped when a call follows)
        self._marker = ""  # a partial marker held back
        self._after_call = False  # whitespace right after a call is dropped
        # the call region in progress
        self._region: Scan | None = None
        self._buf: list[str] = []
        self._trigger = ""
        self._region_ws = ""
        self._mark = 0
        self._committed = False
        # this feed's output
        self._content: list[str] = []
        self._deltas: dict[int, ToolCallDelta] = {}
        self._fragments: dict[int, list[str]] = {}  # argument text of this feed, by call index
        self._done = False

    # ---- public ----

    def feed(self, text: str) -> ParsedDelta:
        """Take the next piece of output text; return the content and call pieces it settles."""
        if self._done:
            raise RuntimeError("feed() after finish()")
        self._run(deque(text))
        return self._take()

    def finish(self) -> ParsedDelta:
        """The output ended: settle everything held back (an unfinished call ends where the text does)."""
        if not self._done:
            self._done = True
            queue: deque = deque()
            while self._region is not None:
                self._step_region(None, queue)
                self._run(queue)
            if self._marker or (self._ws and not self._after_call):
                self._emit(("" if self._after_call else self._ws) + self._marker)
            self._ws = self._marker = ""
        return self._take()

    def parse(self, text: str) -> ParsedOutput:
        """Content and calls of a whole output (use a fresh parser)."""
        return accumulate([self.feed(text), self.finish()])

    # ---- for the format's region scanner ----

    def _region_scan(self) -> Scan:
        """Read one call region, character by character (``c = yield``); return the first character it does
        not take (or None). Raise NotACall to release the text as content."""
        raise NotImplementedError
        yield  # pragma: no cover

    def _begin(self, name: str) -> None:
        index, self._calls = self._calls, self._calls + 1
        self._open, self._open_has_args, self._committed = index, False, True
        self._deltas[index] = ToolCallDelta(index, self._new_id(), name)

    def _args(self, text: str) -> None:
        if text and self._open is not None:
            self._open_has_args = True
            self._deltas.setdefault(self._open, ToolCallDelta(self._open))
            self._fragments.setdefault(self._open, []).append(text)

    def _end(self) -> None:
        if self._open is not None:
            if not self._open_has_args:
                self._args("{}")
            self._open = None

    def _set_mark(self) -> None:
        """If the region fails from here on, release the text from the current character only."""
        self._mark = len(self._buf) - 1

    def _valid_name(self, name: str) -> bool:
        return bool(name) and (self.tool_names is None or name in self.tool_names)

    # ---- scanning pieces ----

    def _skip_ws(self, c: Char) -> Scan:
        while c is not None and c in WHITESPACE:
            c = yield
        return c

    def _literal(self, c: Char, text: str) -> Scan:
        """`text` starting at `c` (_Bad at the first character that differs); return the character after it."""
        for expected in text:
            if c is None:
                raise EndOfText
            if c != expected:
                raise _Bad
            c = yield
        return c

    def _one_of(self, c: Char, options: tuple[str, ...]) -> Scan:
        """One of `options` starting at `c` (none is a prefix of another); return (which, the character after)."""
        read = ""
        while True:
            if c is None:
                raise EndOfText
            read += c
            if read in options:
                return read, (yield)
            if not any(o.startswith(read) for o in options):
                raise _Bad
            c = yield

    def _until(self, c: Char, stop: str) -> Scan:
        """The text from `c` up to `stop`; return (that text, the character after `stop`)."""
        text: list[str] = []
        n = len(stop)
        while True:
            if c is None:
                raise EndOfText
            text.append(c)
            if c == stop[-1] and len(text) >= n and "".join(text[-n:]) == stop:
                return "".join(text[:-n]), (yield)
            c = yield

    def _string(self) -> Scan:
        """The rest of a JSON string after its opening quote, decoded."""
        decoder, out = _StringDecoder(), []
        while not decoder.closed:
            c = yield
            if c is None:
                raise EndOfText
            out.append(decoder.feed(c))
        return "".join(out)

    def _value(self, c: Char, emit: Callable[[str], None] | None) -> Scan:
        """A JSON value starting at `c`, its text passed to `emit` as read (not validated: brackets and strings
        are followed to find its end); return the character after it."""
        emit = emit or (lambda text: None)
        if c is None:
            raise EndOfText
        if c in '{["':
            in_string, escaped = c == '"', False
            depth = 0 if in_string else 1
            emit(c)
            while True:
                c = yield
                if c is None:
                    raise EndOfText
                emit(c)
                if in_string:
                    if escaped:
                        escaped = False
                    elif c == "\\":
                        escaped = True
                    elif c == '"':
                        in_string = False
                        if depth == 0:
                            return (yield)
                elif c == '"':
                    in_string = True
                elif c in "{[":
                    depth += 1
                elif c in "}]":
                    depth -= 1
                    if depth == 0:
                        return (yield)
        text = []
        while c is not None and c not in WHITESPACE and c not in ",}]":
            text.append(c)
            c = yield
        emit("".join(text))
        return c

    def _call(self, c: Char) -> Scan:
        """A call object starting at `c` == '{': ``{"name": ..., "arguments": ...}`` (keys in any order, others
        skipped). Commits at the name; return the character after the object."""
        name: str | None = None
        early: list[str] = []  # arguments written before the name

        def out(text: str) -> None:
            self._args(text) if name is not None else early.append(text)

        seen_args = False
        try:
            c = yield from self._skip_ws((yield))
            while True:
                if c != '"':
                    raise _Bad
                key = yield from self._string()
                c = yield from self._skip_ws((yield))
                if c != ":":
                    raise _Bad
                c = yield from self._skip_ws((yield))
                if c is None:
                    raise EndOfText
                if key == "name" and name is None:
                    if c != '"':
                        raise _Bad
                    found = yield from self._string()
                    if not self._valid_name(found):
                        raise NotACall
                    name = found
                    self._begin(name)
                    self._args("".join(early))
                    c = yield
                elif key in self.args_keys and not seen_args:
                    seen_args = True
                    c = yield from self._arguments(c, out)
                else:
                    c = yield from self._value(c, None)
                c = yield from self._skip_ws(c)
                if c == ",":
                    c = yield from self._skip_ws((yield))
                elif c == "}":
                    if name is None:
                        raise NotACall
                    self._end()
                    return (yield)
                else:
                    raise _Bad
        except (_Bad, EndOfText) as e:
            if name is None:
                raise NotACall from None
            self._end()  # a committed call ends here; what follows is the region's business
            return None if isinstance(e, EndOfText) else c

    def _whole_call(self, c: Char) -> Scan:
        """A call object starting at `c` == '{' that counts only once it is complete: its keys are the name and
        the arguments (any other fails at once), the name is an offered tool's and the arguments parse as a JSON
        object. Commits the whole call then; anything else raises NotACall (the text stays content). Return the
        character after the object."""
        name: str | None = None
        parts: list[str] | None = None
        try:
            c = yield from self._skip_ws((yield))
            while True:
                if c != '"':
                    raise _Bad
                key = yield from self._string()
                if key != "name" and key not in self.args_keys:
                    raise NotACall
                c = yield from self._skip_ws((yield))
                if c != ":":
                    raise _Bad
                c = yield from self._skip_ws((yield))
                if c is None:
                    raise EndOfText
                if key == "name" and name is None:
                    if c != '"':
                        raise _Bad
                    name = yield from self._string()
                    if not self._valid_name(name):
                        raise NotACall
                    c = yield
                elif key != "name" and parts is None:
                    parts = []
                    c = yield from self._arguments(c, parts.append)
                else:
                    raise _Bad
                c = yield from self._skip_ws(c)
                if c == ",":
                    c = yield from self._skip_ws((yield))
                elif c == "}":
                    break
                else:
                    raise _Bad
        except (_Bad, EndOfText):
            raise NotACall from None
        arguments = "".join(parts) if parts is not None else "{}"
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if name is None or parts is None or not isinstance(parsed, dict):
            raise NotACall
        self._begin(name)
        self._args(arguments)
        self._end()
        return (yield)

    def _arguments(self, c: str, out: Callable[[str], None]) -> Scan:
        """The arguments value: an object as written, a JSON string holding JSON text decoded, null as {}."""
        if c == '"':
            decoder = _StringDecoder()
            while not decoder.closed:
                c = yield
                if c is None:
                    raise EndOfText
                out(decoder.feed(c))
            return (yield)
        if c in "{[":
            return (yield from self._value(c, out))
        parts: list[str] = []
        c = yield from self._value(c, parts.append)
        text = "".join(parts)
        out("{}" if text in ("", "null") else text)
        return c

    def _calls_list(self, c: Char) -> Scan:
        """``[call, call, ...]`` starting at `c` == '['; return the character after the ']'."""
        c = yield from self._skip_ws((yield))
        while True:
            if c == "]" and self._committed:
                return (yield)
            if c != "{":
                raise NotACall
            c = yield from self._call(c)
            c = yield from self._skip_ws(c)
            if c == ",":
                self._set_mark()
                c = yield from self._skip_ws((yield))
            elif c == "]":
                return (yield)
            elif c is None:
                return None
            else:
                self._set_mark()
                raise NotACall

    # ---- the driver ----

    def _run(self, queue: deque) -> None:
        while queue:
            c = queue.popleft()
            if self._region is not None:
                self._step_region(c, queue)
            else:
                self._content_char(c, queue)

    def _content_char(self, c: str, queue: deque) -> None:
        markers = self.markers + self.start_markers if self._at_start else self.markers
        if self._marker:
            candidate = self._marker + c
            if any(m.startswith(candidate) for m in markers):
                self._marker = candidate
                if candidate in markers:
                    self._open_region(candidate, None, queue)
                return
            first, rest = self._marker[0], self._marker[1:] + c
            self._marker = ""
            self._text(first)
            queue.extendleft(reversed(rest))
        elif c in WHITESPACE:
            self._ws += c
        elif (self._at_start and c in self.start_chars) or c in self.open_chars:
            self._open_region("", c, queue)
        elif any(m.startswith(c) for m in markers):
            self._marker = c
            if c in markers:
                self._open_region(c, None, queue)
        else:
            self._text(c)

    def _text(self, c: str) -> None:
        self._emit(("" if self._after_call else self._ws) + c)
        self._ws, self._at_start, self._after_call = "", False, False

    def _emit(self, text: str) -> None:
        if text:
            self._content.append(text)

    def _open_region(self, trigger: str, first: str | None, queue: deque) -> None:
        self._region_ws = "" if self._after_call else self._ws
        self._ws = self._marker = ""
        self._trigger, self._buf, self._mark, self._committed = trigger, [], 0, False
        self._at_start = False
        self._region = self._region_scan()
        next(self._region)
        if first is not None:
            self._step_region(first, queue)

    def _step_region(self, c: Char, queue: deque) -> None:
        if c is not None:
            self._buf.append(c)
        try:
            self._region.send(c)
            if c is None:  # a scanner must end at the end of the text
                raise RuntimeError(f"{type(self).__name__} region scanner did not end at the end of the text")
        except StopIteration as stop:
            self._region = None
            if not self._committed:
                self._release(queue)
                return
            self._after_call = True
            if stop.value is not None:
                queue.appendleft(stop.value)
        except NotACall:
            self._region = None
            self._release(queue)

    def _release(self, queue: deque) -> None:
        """The region is not (or no longer) calls: its text from the mark goes back to content scanning."""
        if self._committed:
            rest = self._buf[self._mark:]
            self._after_call = True
        else:  # a region opened by its first character gives that character back as text, or it would reopen
            first = "" if self._trigger or not self._buf else self._buf[0]
            self._emit(self._region_ws + self._trigger + first)
            rest = self._buf[len(first):]
            self._after_call = False
        self._buf = []
        queue.extendleft(reversed(rest))

    def _take(self) -> ParsedDelta:
        for index, delta in self._deltas.items():
            delta.arguments = "".join(self._fragments.get(index, ()))
        out = ParsedDelta("".join(self._content), list(self._deltas.values()))
        self._content, self._deltas, self._fragments = [], {}, {}
        return out

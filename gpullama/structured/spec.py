"""What a constrained sequence must produce: a JSON schema, any JSON object, a regex, a grammar or tool calls."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice", "structural_tag", "tool_calls")


class StructuredOutputError(ValueError):
    """A structured-output request that cannot be honoured; ``param`` names the request field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def canonical_json(value: Any) -> str:
    """Compact JSON text of `value`, keys in their given order (property order matters to a schema grammar)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})  # their values are data, not schemas
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def tuple_items(schema: Any) -> Any:
    """`schema` with every array-valued ``items`` (draft 4-7's tuple form) read as llama.cpp's converter reads it,
    an exact tuple: ``prefixItems``, every one required (``minItems``, unless given), none after them (draft
    2020-12 refuses an array there); ``items`` wins over a ``prefixItems`` beside it, as there."""
    if isinstance(schema, list):
        return [tuple_items(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):  # names to schemas (a property may be named "enum")
            out[key] = {name: tuple_items(sub) for name, sub in value.items()}
        else:
            out[key] = value if key in _DATA_KEYWORDS else tuple_items(value)
    if isinstance(out.get("items"), list):
        out["prefixItems"] = out.pop("items")
        out["items"] = False
        out.setdefault("minItems", len(out["prefixItems"]))
    return out


def check_json_schema(schema: Any, param: str = "json_schema") -> dict:
    """`schema` as a dict (parsed from JSON text if a string); StructuredOutputError unless it is a valid schema.

    Array-valued ``items`` are read as ``prefixItems`` (`tuple_items`); the schema is then checked against its own
    metaschema (its ``$schema``, else draft 2020-12) with `jsonschema`.
    """
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise StructuredOutputError(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(schema, dict):
        raise StructuredOutputError(f"{param} must be a JSON object, got {type(schema).__name__}", param)
    schema = tuple_items(schema)
    import jsonschema  # imported here: only requests with a schema pay for it

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        at = f" at '{where}'" if where else ""
        raise StructuredOutputError(f"{param} is not a valid JSON schema{at}: {e.message}", param) from None
    try:
        canonical_json(schema)
    except ValueError as e:
        raise StructuredOutputError(f"{param} is not valid JSON: {e}", param) from None
    return schema


@dataclass(frozen=True, eq=False)
class ToolCallGrammar:
    """Tool calls a grammar must force, in a model family's text format (see `gpullama.structured.tools`)."""

    format: str
    tools: tuple[tuple[str, str], ...]  # (function name, parameters schema as canonical JSON), in request order
    parallel: bool = False  # one or more calls (True) or exactly one
    params: tuple[str, ...] = ()  # request field naming each tool's parameters, for errors

    def key(self) -> tuple:
        """Hashable identity of the grammar."""
        return (self.format, self.tools, self.parallel)


@dataclass(frozen=True, eq=False)
class StructuredOutput:
    """One structured-output constraint: set exactly one field. Invalid values raise StructuredOutputError.

    - ``json_schema``: a JSON schema (dict or JSON text); output is one JSON value valid against it, compact
      (``{"a": 1, "b": [2, 3]}``), with no property that the schema does not name.
    - ``json_object``: any JSON object (compact).
    - ``regex``: text matching the regular expression in full.
    - ``grammar``: an EBNF (GBNF) grammar whose start rule is ``root``.
    - ``choice``: exactly one of the given strings.
    - ``structural_tag``: a structural tag in xgrammar's JSON format (the subset in docs/usage.md).
    - ``tool_calls``: tool calls (build it with ``gpullama.structured.tool_call_grammar``).

    ``reasoning`` (default True) lets a reasoning model think first: when the vocabulary spells the reasoning
    tags ``reasoning_tags`` (default ``<think>`` and ``</think>``; a chat format's own, such as Gemma 4's
    ``<|channel>thought`` and ``<channel|>``) with single tokens (see
    `gpullama.structured.reasoning_gate.reasoning_token_ids`), a reasoning block may open the output (or the
    prompt may have opened it) and runs free until the closing tag; the constraint applies to the answer after it.
    Neither is part of the key.
    """

    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    structural_tag: dict | str | None = None
    tool_calls: ToolCallGrammar | None = None
    reasoning: bool = field(default=True, compare=False)
    reasoning_tags: tuple[str, str] = field(default=("<think>", "</think>"), compare=False)
    param: str | None = field(default=None, compare=False)  # request field it came from, for error messages
    _key: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if (getattr(self, k) not in (None, False))]
        if len(given) != 1:
            which = ", ".join(given) if given else "none"
            raise StructuredOutputError(f"StructuredOutput needs exactly one constraint, got {which}", self.param)
        kind = given[0]
        param = self.param or kind
        if not isinstance(self.reasoning, bool):
            raise StructuredOutputError(f"StructuredOutput.reasoning must be True or False, got {self.reasoning!r}",
                                        self.param)
        tags = self.reasoning_tags
        if not (isinstance(tags, (tuple, list)) and len(tags) == 2 and all(isinstance(t, str) and t for t in tags)):
            raise StructuredOutputError("StructuredOutput.reasoning_tags must be two non-empty strings (open, close), "
                                        f"got {tags!r}", self.param)
        object.__setattr__(self, "reasoning_tags", tuple(tags))
        if kind == "json_schema":
            schema = check_json_schema(self.json_schema, param)
            object.__setattr__(self, "json_schema", schema)
            payload: Any = canonical_json(schema)
        elif kind == "json_object":
            if self.json_object is not True:
                raise StructuredOutputError(f"{param} must be True or False", param)
            payload = True
        elif kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                raise StructuredOutputError(f"{param} must be a non-empty string", param)
            payload = value
        elif kind == "choice":
            choices = self.choice
            if isinstance(choices, str) or not choices or not all(isinstance(c, str) and c for c in choices):
                raise StructuredOutputError(f"{param} must be a non-empty list of non-empty strings", param)
            payload = tuple(choices)
            object.__setattr__(self, "choice", payload)
        elif kind == "structural_tag":
            value = self.structural_tag
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise StructuredOutputError(f"{param} is not valid JSON: {e}", param) from None
            if not isinstance(value, dict):
                raise StructuredOutputError(f"{param} must be a JSON object", param)
            object.__setattr__(self, "structural_tag", value)
            payload = canonical_json(value)
        else:
            if not isinstance(self.tool_calls, ToolCallGrammar):
                raise StructuredOutputError(f"{param} must be a ToolCallGrammar", param)
            payload = self.tool_calls.key()
        object.__setattr__(self, "_key", (kind, payload))

    @property
    def kind(self) -> str:
        """Which constraint this is: one of json_schema, json_object, regex, grammar, choice, structural_tag,
        tool_calls."""
        return self._key[0]

    @property
    def key(self) -> tuple:
        """Hashable identity: two specs with equal keys compile to the same grammar."""
        return self._key

    def schema_text(self) -> str:
        """The JSON schema as compact JSON text (json_schema specs only)."""
        if self.kind != "json_schema":
            raise ValueError(f"a {self.kind} spec has no JSON schema")
        return self._key[1]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StructuredOutput) and other._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)

    @classmethod
    def from_response_format(cls, response_format: Any,
                             param: str = "response_format") -> StructuredOutput | None:
        """The spec of an OpenAI ``response_format`` (None for ``{"type": "text"}``); errors name the field."""
        if response_format is None:
            return None
        if not isinstance(response_format, dict):
            raise StructuredOutputError(f"{param} must be an object", param)
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True, param=param)
        if kind == "json_schema":
            inner = response_format.get("json_schema")
            if not isinstance(inner, dict):
                raise StructuredOutputError(f"{param}.json_schema must be an object", f"{param}.json_schema")
            if "schema" not in inner or inner["schema"] is None:
                return cls(json_object=True, param=f"{param}.json_schema")
            return cls(json_schema=inner["schema"], param=f"{param}.json_schema.schema")
        raise StructuredOutputError(
            f"{param}.type must be one of 'text', 'json_object', 'json_schema', got {kind!r}", f"{param}.type")

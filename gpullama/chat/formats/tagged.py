"""What the tagged formats share (Qwen3-Coder's XML, GLM-4.5's ``<arg_key>``/``<arg_value>``): a call's arguments
written one tag pair each, their values typed by the tool's parameters schema as llama.cpp types them, and the
scanner pieces that read such tags."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from gpullama.chat.tool_calls import NAME_CHARS, NotACall, Scan, ToolParser
from gpullama.structured.tools import value_types

_PYTHON_SCALARS = {"True": "true", "False": "false", "None": "null"}
_TYPE_OF = {bool: "boolean", int: "integer", float: "number", dict: "object", list: "array", type(None): "null"}


def typed_value(text: str, schema: Any, strings_win: bool = False) -> str:
    """The JSON text of a tagged argument's value `text`, as llama.cpp reads it: a string when the schema allows
    only strings (with `strings_win`, as llama.cpp's generic tagged parser reads GLM's: any schema that allows a
    string); otherwise the value as JSON when it parses to a type the schema allows (Python's True, False and None
    read as JSON's), else a string. No schema (an argument the tool does not name): JSON when it parses to anything
    but a string, else a string."""
    types = value_types(schema) if schema is not None else None
    if types is not None and strings_win and "string" in types:
        types = frozenset({"string"})
    if types != {"string"}:
        stripped = text.strip()
        candidate = _PYTHON_SCALARS.get(stripped, stripped)
        try:
            value = json.loads(candidate)
        except ValueError:
            value = None
        else:
            kind = _TYPE_OF.get(type(value), "string")
            allowed = kind != "string" if types is None else (
                kind in types or (kind == "integer" and "number" in types))
            if allowed:
                return candidate
    return json.dumps(text, ensure_ascii=False)


class TaggedToolParser(ToolParser):
    """Base of the tagged formats' parsers. `tool_names` may be a mapping of each offered tool's name to its
    parameters schema, which types the argument values (`typed_value`); without it, values are typed by their
    text. Arguments come out as compact JSON (``{"city":"Paris","days":3}``, llama.cpp's form), each argument
    streamed once its value is read. `strings_win`: see `typed_value`."""

    strings_win = False

    def __init__(self, tool_names: Iterable[str] | None = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(tool_names, *args, **kwargs)
        self.tool_schemas: dict[str, Any] = dict(tool_names) if isinstance(tool_names, Mapping) else {}
        self._schema: Any = None
        self._arg_count = 0

    def _open_call(self, name: str) -> None:
        """Commit a call of `name`; its arguments follow."""
        self._begin(name)
        self._schema, self._arg_count = self.tool_schemas.get(name), 0

    def _argument(self, key: str, text: str) -> None:
        """One argument of the open call, typed by its schema."""
        props = self._schema.get("properties") if isinstance(self._schema, dict) else None
        known = isinstance(props, dict) and key in props
        value = typed_value(text, (props[key] if props[key] is not None else {}) if known else None,
                            self.strings_win)
        self._args(("{" if self._arg_count == 0 else ",") + json.dumps(key, ensure_ascii=False) + ":" + value)
        self._arg_count += 1

    def _close_call(self) -> None:
        """The open call ends (its JSON object closed)."""
        if self._arg_count:
            self._args("}")
        self._end()

    # ---- scanner pieces ----

    def _name(self, c: Any, end: str) -> Scan:
        """A function name from `c` up to the character `end` (NotACall for anything else, or a name the
        offered tools lack); return (name, the character after `end`)."""
        name: list[str] = []
        while c is not None and c in NAME_CHARS:
            name.append(c)
            c = yield
        if c != end or not self._valid_name("".join(name)):
            raise NotACall
        return "".join(name), (yield)

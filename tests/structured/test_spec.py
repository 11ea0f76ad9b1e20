"""StructuredOutput and tool_call_grammar: validation, identity, OpenAI request mapping (no grammar engine)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpullama.structured import StructuredOutput, StructuredOutputError, tool_call_grammar

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_exactly_one_constraint():
    with pytest.raises(StructuredOutputError, match="exactly one constraint, got none"):
        StructuredOutput()
    with pytest.raises(StructuredOutputError, match="json_schema, regex"):
        StructuredOutput(json_schema=SCHEMA, regex="a+")
    assert StructuredOutput(json_object=True).kind == "json_object"
    assert StructuredOutput(regex="a+").kind == "regex"


@pytest.mark.parametrize("schema, message", [
    ({"type": "integr"}, "is not a valid JSON schema at 'type'"),
    ({"type": "object", "properties": {"a": {"minimum": "zero"}}}, "at 'properties/a/minimum'"),
    ({"type": "object", "required": "a"}, "at 'required'"),
    ("{not json", "is not valid JSON"),
    ([1, 2], "must be a JSON object"),
])
def test_invalid_schema_is_a_value_error_naming_the_field(schema, message):
    with pytest.raises(ValueError, match=message) as info:
        StructuredOutput(json_schema=schema, param="response_format.json_schema.schema")
    assert isinstance(info.value, StructuredOutputError)
    assert info.value.param == "response_format.json_schema.schema"
    assert "response_format.json_schema.schema" in str(info.value)


def test_schema_text_keeps_property_order_and_identity():
    a = StructuredOutput(json_schema={"type": "object", "properties": {"x": {}, "y": {}}})
    b = StructuredOutput(json_schema='{"type": "object", "properties": {"x": {}, "y": {}}}')
    c = StructuredOutput(json_schema={"type": "object", "properties": {"y": {}, "x": {}}})
    assert a == b and hash(a) == hash(b)
    assert a != c  # the order of properties is the order the grammar writes them in
    assert a.schema_text() == '{"type":"object","properties":{"x":{},"y":{}}}'
    assert len({a, b, c}) == 2


def test_schema_mutation_after_construction_does_not_change_the_key():
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    spec = StructuredOutput(json_schema=schema)
    key = spec.key
    schema["properties"]["z"] = {"type": "string"}
    assert spec.key == key


@pytest.mark.parametrize("kwargs, message", [
    (dict(regex=""), "regex must be a non-empty string"),
    (dict(grammar=3), "grammar must be a non-empty string"),
    (dict(choice="yes"), "choice must be a non-empty list"),
    (dict(choice=["yes", ""]), "choice must be a non-empty list"),
    (dict(structural_tag="[1"), "structural_tag is not valid JSON"),
    (dict(json_object="yes"), "json_object must be True"),
])
def test_other_fields_are_checked(kwargs, message):
    with pytest.raises(StructuredOutputError, match=message):
        StructuredOutput(**kwargs)


def test_from_response_format():
    assert StructuredOutput.from_response_format(None) is None
    assert StructuredOutput.from_response_format({"type": "text"}) is None
    assert StructuredOutput.from_response_format({"type": "json_object"}) == StructuredOutput(json_object=True)
    spec = StructuredOutput.from_response_format(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}})
    assert spec == StructuredOutput(json_schema=SCHEMA)
    assert spec.param == "response_format.json_schema.schema"
    no_schema = StructuredOutput.from_response_format({"type": "json_schema", "json_schema": {"name": "x"}})
    assert no_schema.kind == "json_object"


@pytest.mark.parametrize("response_format, param", [
    ({"type": "xml"}, "response_format.type"),
    ({}, "response_format.type"),
    ("json", "response_format"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}},
     "response_format.json_schema.schema"),
])
def test_from_response_format_errors_name_the_parameter(response_format, param):
    with pytest.raises(StructuredOutputError) as info:
        StructuredOutput.from_response_format(response_format)
    assert info.value.param == param


def test_tool_call_grammar_choices():
    assert tool_call_grammar([WEATHER], "auto") is None
    assert tool_call_grammar([WEATHER], "none") is None
    assert tool_call_grammar([WEATHER], None) is None
    required = tool_call_grammar([WEATHER, TIME], "required", format="hermes")
    assert required.kind == "tool_calls"
    tc = required.tool_calls
    assert [n for n, _ in tc.tools] == ["get_weather", "get_time"] and tc.parallel and tc.format == "hermes"
    assert tc.tools[1][1] == '{"type":"object","properties":{}}'  # no parameters: no arguments
    single = tool_call_grammar([WEATHER, TIME], "required", parallel_tool_calls=False)
    assert not single.tool_calls.parallel
    named = tool_call_grammar([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert [n for n, _ in named.tool_calls.tools] == ["get_time"] and not named.tool_calls.parallel
    assert named.tool_calls.params == ("tools[1].function.parameters",)
    assert tool_call_grammar([WEATHER, TIME], "get_time") == named
    assert named != single


@pytest.mark.parametrize("tools, choice, param", [
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], {"type": "function"}, "tool_choice"),
    ([], "required", "tools"),
    ([{"type": "function", "function": {"description": "no name"}}], "required", "tools[0].function.name"),
    ([{"type": "function", "function": {"name": ""}}], "required", "tools[0].function.name"),
    ([WEATHER, {"type": "function", "function": {"name": "x", "parameters": {"type": "objekt"}}}], "required",
     "tools[1].function.parameters"),
    ([{"type": "code_interpreter"}], "required", "tools[0].type"),
    ([WEATHER, WEATHER], "required", "tools"),
])
def test_tool_call_grammar_errors_name_the_parameter(tools, choice, param):
    with pytest.raises(StructuredOutputError) as info:
        tool_call_grammar(tools, choice)
    assert info.value.param == param


def test_importing_the_package_does_not_import_llguidance():
    code = ("import sys, gpullama.structured, gpullama.chat.formats, gpullama.chat.output; "
            "from gpullama.structured import StructuredOutput, tool_call_grammar; "
            "StructuredOutput(json_object=True); "
            "assert 'llguidance' not in sys.modules, 'llguidance imported'; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    subprocess.run([sys.executable, "-c", code], check=True)

"""JSON schemas are held to what the grammar enforces: every keyword outside the allow-list is refused with
its JSON path, every keyword on it is enforced by the compiled grammar (an instance that breaks it is
refused by the matcher), schemas nested too deeply are refused, and a regex matching nothing is refused."""

from __future__ import annotations

import json

import pytest

from cbd.engine.grammar.matcher import GrammarKind, GrammarSpec
from cbd.engine.grammar.schema_check import FORMATS, MAX_SCHEMA_DEPTH, check_schema, load_schema
from cbd.errors import InvalidRequest
from cbd.server.tool_calls import parse_tools
from grammar_cases import SCHEMAS, SEARCH, WEATHER

REFUSED = [
    ({"not": {}}, "$.not", "'not'"),
    ({"type": "object", "properties": {"a": {"type": "integer", "not": {"const": 1}}}}, "$.properties.a.not", "'not'"),
    ({"allOf": [{"type": "integer"}, {"type": "string"}]}, "$.allOf", "allOf"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "$.contains", "'contains'"),
    ({"type": "string", "format": "idn-email"}, "$.format", "idn-email"),
    ({"type": "string", "format": "regex"}, "$.format", "regex"),
    ({"if": {"type": "integer"}, "then": {"minimum": 5}}, "$.if", "'if'"),
    ({"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}, "$.dependentSchemas", "dependentSchemas"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "$.dependentRequired", "dependentRequired"),
    ({"anyOf": [{"type": "integer"}, {"type": "array", "uniqueItems": True}]}, "$.anyOf[1].uniqueItems", "uniqueItems"),
    ({"$defs": {"x": {"type": "string", "contentEncoding": "base64"}}}, "$.$defs.x.contentEncoding", "contentEncoding"),
    ({"$ref": "http://example.com/schema.json"}, "$.$ref", "local references"),
    ({"type": "object", "additionalProperties": {"else": {}}}, "$.additionalProperties.else", "'else'"),
]


@pytest.mark.parametrize(("schema", "path", "named"), REFUSED)
def test_a_keyword_the_grammar_would_not_enforce_is_refused_naming_it_and_its_path(schema, path, named) -> None:
    with pytest.raises(InvalidRequest) as info:
        load_schema(json.dumps(schema), "$")
    assert str(info.value).startswith(path + ":") and named in str(info.value), str(info.value)


def test_unique_items_beside_enforced_keywords_is_refused_at_its_own_path() -> None:
    with pytest.raises(InvalidRequest, match=r"^\$\.uniqueItems: the keyword 'uniqueItems'"):
        check_schema({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "$")


def test_metadata_keywords_pass_and_so_do_the_existing_test_schemas() -> None:
    check_schema({"title": "t", "description": "d", "examples": [1], "$comment": "c", "default": 1,
                  "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "integer"}, "$")  # fmt: skip
    for schema in [*SCHEMAS.values(), WEATHER, SEARCH]:
        check_schema(schema, "$")


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_depth_is_bounded_and_a_very_deep_tool_schema_is_invalid_not_a_recursion_error() -> None:
    check_schema(nested(MAX_SCHEMA_DEPTH), "$")
    with pytest.raises(InvalidRequest, match="nested too deeply"):
        check_schema(nested(MAX_SCHEMA_DEPTH + 1), "$")
    deep = '{"type": "object", "properties": {"a": ' * 5000 + "{}" + "}}" * 5000
    with pytest.raises(InvalidRequest, match=r"tool 'f': parameters is nested too deeply"):
        parse_tools([("f", "", deep)])
    with pytest.raises(InvalidRequest, match=r"parameters\.properties\.x\.not: the keyword 'not'"):
        parse_tools([("f", "", json.dumps({"type": "object", "properties": {"x": {"not": {}}}}))])


# Each allowed keyword, with an instance that breaks it: the compiled grammar must refuse the instance.
ENFORCED = [
    ({"type": "integer"}, '"a"'),
    ({"enum": ["x"]}, '"y"'),
    ({"const": "x"}, '"y"'),
    ({"type": "string", "nullable": True}, "1"),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "true"),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "true"),
    ({"allOf": [{"type": "integer"}]}, '"a"'),
    ({"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a"}, '"x"'),
    ({"definitions": {"a": {"type": "integer"}}, "$ref": "#/definitions/a"}, '"x"'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a": "x"}'),
    ({"type": "object", "properties": {"a": {}}, "required": ["a"]}, "{}"),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, '{"a": "x"}'),
    ({"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False}, '{"b": 1}'),
    (
        {
            "type": "object",
            "additionalProperties": {"type": "integer"},
            "patternProperties": {"^a": {"type": "string"}},
        },
        '{"ab": 1}',
    ),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "propertyNames": {"pattern": "^a"}}, '{"b": 1}'),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "minProperties": 1}, "{}"),
    ({"type": "object", "additionalProperties": True, "maxProperties": 1}, '{"a": 1, "b": 2}'),
    ({"type": "array", "items": {"type": "integer"}}, '["a"]'),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, '["a"]'),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": False}, "[1, 2]"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 1}, "[]"),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 1}, "[1, 2]"),
    ({"type": "string", "minLength": 2}, '"a"'),
    ({"type": "string", "maxLength": 1}, '"ab"'),
    ({"type": "string", "pattern": "^b+$"}, '"a"'),
    ({"type": "integer", "minimum": 5}, "1"),
    ({"type": "integer", "maximum": 5}, "7"),
    ({"type": "integer", "exclusiveMinimum": 5}, "5"),
    ({"type": "integer", "exclusiveMaximum": 5}, "5"),
    ({"type": "number", "minimum": 5}, "1.5"),
    ({"type": "integer", "multipleOf": 3}, "4"),
] + [({"type": "string", "format": f}, '"not one at all"') for f in sorted(FORMATS)]


@pytest.mark.parametrize(("schema", "instance"), ENFORCED)
def test_every_allowed_keyword_is_enforced_by_the_compiled_grammar(compiler, schema, instance) -> None:
    import xgrammar as xgr

    grammar = compiler.compile(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema)))
    matcher = xgr.GrammarMatcher(grammar.compiled)
    assert not (matcher.accept_string(instance) and matcher.is_completed()), (schema, instance)


def test_the_allow_list_is_what_the_enforcement_test_covers() -> None:
    from cbd.engine.grammar import schema_check as schema_check

    assert {k for schema, _ in ENFORCED for k in schema} == schema_check._ENFORCED


@pytest.mark.parametrize(
    ("kind", "source"), [(GrammarKind.REGEX, "[^\\s\\S]"), (GrammarKind.GRAMMAR, 'root ::= a\na ::= a "x"')]
)
def test_a_grammar_whose_language_is_empty_is_refused(compiler, kind, source) -> None:
    with pytest.raises(InvalidRequest, match="matches nothing"):
        compiler.compile(GrammarSpec(kind, source))
    compiler.compile(GrammarSpec(GrammarKind.REGEX, "a{0}"))  # only the empty reply: allowed (the stop token)

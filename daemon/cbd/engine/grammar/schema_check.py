"""JSON schemas held to what the grammar enforces: an allow-list of keywords, a bound on depth.

xgrammar (0.2.x) turns a schema into a grammar and silently skips keywords it cannot express (`not`,
`contains`, `if`/`then`/`else`, `dependentSchemas`, `uniqueItems`, most of `allOf`, some formats), so a
reply held to such a schema may still violate it. A schema is therefore refused (InvalidRequest naming
the keyword and its JSON path) unless every keyword in it is one the grammar enforces, or a metadata
keyword that constrains nothing. Each keyword was checked against the installed library: a schema with
it, and an instance that breaks it, which the compiled grammar must refuse (tests/unit/test_schema_check.py).

Known gap: `oneOf` is enforced as `anyOf` (an instance that matches two branches is let through); it
is allowed because tool schemas use it widely for unions whose branches do not overlap.
"""

from __future__ import annotations

import json
from typing import Any

from cbd.errors import InvalidRequest

MAX_SCHEMA_DEPTH = 64  # nested subschemas, at most (deeper schemas are refused; compile time grows with depth)

_METADATA = frozenset({
    "title", "description", "examples", "$comment", "default", "$schema", "$id", "deprecated", "readOnly",
    "writeOnly",
})  # fmt: skip
_ENFORCED = frozenset({
    "type", "enum", "const", "nullable", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
    "properties", "required", "additionalProperties", "unevaluatedProperties", "patternProperties",
    "propertyNames", "minProperties", "maxProperties",
    "items", "prefixItems", "unevaluatedItems", "minItems", "maxItems",
    "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
})  # fmt: skip
FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "uuid", "ipv4", "ipv6", "hostname", "uri", "uri-reference",
})  # fmt: skip
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> subschema
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items", "unevaluatedItems")


def load_schema(text: str, where: str) -> Any:
    """The schema in `text`, checked; InvalidRequest for text that is not JSON, nested too deeply, or a
    schema the grammar would not enforce. `where` names it in messages ("response_format.json_schema")."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"{where} is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest(
            f"{where} is nested too deeply (at most {MAX_SCHEMA_DEPTH} levels of subschemas)"
        ) from None
    check_schema(schema, where)
    return schema


def check_schema(schema: Any, where: str) -> None:
    """InvalidRequest naming the first keyword the grammar would not enforce, with its JSON path."""
    _check(schema, where, 0)


def _check(schema: Any, path: str, depth: int) -> None:
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidRequest(f"{path}: the schema is nested too deeply (at most {MAX_SCHEMA_DEPTH} levels)")
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{path} must be a JSON schema object (or a boolean)")
    for key, value in schema.items():
        here = f"{path}.{key}"
        if key in _METADATA:
            continue
        if key not in _ENFORCED:
            raise InvalidRequest(f"{here}: the keyword {key!r} is not supported (the reply would not be held to it)")
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            raise InvalidRequest(f"{here}: allOf with more than one schema is not supported (merge them)")
        if key == "format" and value not in FORMATS:
            raise InvalidRequest(f"{here}: format {value!r} is not supported; supported: {', '.join(sorted(FORMATS))}")
        if key == "$ref" and not (isinstance(value, str) and (value == "#" or value.startswith("#/"))):
            raise InvalidRequest(f"{here}: only local references (#/...) are supported")
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                _check(sub, f"{here}.{name}", depth + 1)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                _check(sub, f"{here}[{i}]", depth + 1)
        elif key in _SCHEMAS:
            _check(value, here, depth + 1)

"""A response format inside a structural tag (tools with a response format), converted where grammars compile.

The frontend writes the format into the tag as cbd's own element, `{"type": "response_format", "kind":
"json_schema" | "json_object" | "regex" | "grammar", "source": "..."}`; `expand` replaces each with
xgrammar's `grammar` element holding the format's EBNF, converted with the same JSON settings as the format
compiled alone (so its text is the same language with or without tools). The conversion of a JSON schema
can take seconds for a hostile one, so it runs here, inside the compile (a killable worker with budgets,
ipc/grammar_pool.py), never on a thread that serves other requests.
"""

from __future__ import annotations

import json
from typing import Any

from cbd.errors import InvalidRequest

JSON_SEPARATORS = (", ", ": ")  # compact JSON as models write it; no unbounded whitespace runs


def format_element(kind: str, source: str) -> dict[str, Any]:
    """The tag element that stands for a response format until `expand` converts it."""
    return {"type": "response_format", "kind": kind, "source": source}


def expand(tag_source: str) -> str:
    """The structural tag's JSON with every response-format element converted to a grammar element."""
    tag = json.loads(tag_source)
    found = False

    def walk(node: Any) -> Any:
        nonlocal found
        if isinstance(node, dict):
            if node.get("type") == "response_format":
                found = True
                return {"type": "grammar", "grammar": _ebnf(str(node.get("kind")), str(node.get("source", "")))}
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    expanded = walk(tag)
    return json.dumps(expanded) if found else tag_source


def _ebnf(kind: str, source: str) -> str:
    import xgrammar as xgr

    if kind == "grammar":
        return source
    try:
        if kind == "regex":
            return str(xgr.Grammar.from_regex(source))
        schema = source if kind == "json_schema" else '{"type": "object"}'
        return str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=JSON_SEPARATORS))
    except (RuntimeError, ValueError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidRequest(f"invalid response_format.{kind}: {first}") from None

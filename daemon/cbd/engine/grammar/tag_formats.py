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
    """The structural tag's JSON with its response-format element converted to a grammar element. The
    element is looked for only where the frontend puts it (an element of the tag's top-level `or`), so a
    tool's schema that happens to hold such an object (as a const, enum or example) is never rewritten."""
    tag = json.loads(tag_source)
    fmt = tag.get("format") if isinstance(tag, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") != "or" or not isinstance(fmt.get("elements"), list):
        return tag_source
    found = False
    for i, element in enumerate(fmt["elements"]):
        if isinstance(element, dict) and element.get("type") == "response_format":
            found = True
            kind, source = str(element.get("kind")), str(element.get("source", ""))
            fmt["elements"][i] = {"type": "grammar", "grammar": _ebnf(kind, source)}
    return json.dumps(tag) if found else tag_source


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

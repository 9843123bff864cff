"""Grammars shared by the grammar, tool and isolation tests: JSON schemas with their validators, a masked random
walk, and grammars whose compile or per-token mask work is built to exceed every budget."""

from __future__ import annotations

import json

import torch

from cbd.engine.grammar.matcher import GrammarCompiler, GrammarState, apply_bitmask

SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
             "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                                  "email": {"type": "string", "pattern": "^[a-z]{1,8}@x\\.org$"}},
                 "required": ["id", "email"]},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
        "required": ["user"]},
    "numbers": {"type": "object", "properties": {"x": {"type": "number", "minimum": -1.5, "maximum": 2.5},
                                                 "ok": {"type": "boolean"},
                                                 "note": {"type": ["string", "null"], "maxLength": 24}},
                "required": ["x", "ok", "note"]},
}  # fmt: skip


def walk(state: GrammarState, compiler: GrammarCompiler, seed: int, max_tokens: int = 400) -> list[int]:
    """Sample from random logits under the grammar's mask until it terminates. Tokens that can close a string,
    number or container get a bonus: a uniform walk would almost never end a free-form string."""
    generator = torch.Generator().manual_seed(seed)
    closing = torch.tensor([8.0 if any(c in t for c in b'"}]),') else 0.0 for t in compiler.info.decoded_vocab])
    closing[list(compiler.info.stop_token_ids)] = 14.0  # ends free text after a tool call soon
    bitmask = compiler.new_bitmask(1)
    tokens: list[int] = []
    while not state.finished and len(tokens) < max_tokens:
        logits = torch.randn(1, compiler.vocab_size, generator=generator) * 3 + closing
        state.fill(bitmask, 0)
        apply_bitmask(logits, bitmask)
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        assert state.accept(token)
        tokens.append(token)
    return tokens


# Ambiguous: the matcher's work per token grows with the length of the run of "a" (about cubically).
MASK_BOMB = 'root ::= x{700} "."\nx ::= x x | "a"'
# Counted repetitions in alternation: the compile grows with the square of the count, so 60 branches of
# ~5000 take minutes (one branch ~3 s on a 2-core CI host), far past every compile budget the tests set
# (at most 10 s) on any machine: what refuses them is the budget, never the machine being slow.
COMPILE_BOMB = "|".join(f"[a-z]{{1,{5000 + i}}}x{i}" for i in range(60))


def schema_bomb(tag: str) -> str:
    """A JSON schema within every static bound whose compile takes minutes (its pattern is
    COMPILE_BOMB); `tag`, in its description, makes each one distinct, so no cache answers it."""
    return json.dumps({"type": "string", "description": tag, "pattern": COMPILE_BOMB})


# Tool parameter schemas.
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}  # fmt: skip
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 30}}, "required": ["query"]}

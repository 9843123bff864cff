"""What grammar work costs on the CPU, per kind of grammar: the compile (as a compile worker does it) and
the token mask filled for each generated token (as the engine thread does it every step).

The embedded model's tokenizer (49,152 tokens). Each spec is compiled --rounds times by a fresh compiler
(no cache), one thread; the median is printed. Then one matcher walks the grammar for up to --tokens
tokens, each step filling the mask and accepting an allowed token drawn with a fixed seed (never the stop
token while another is allowed), and the mean and the largest fill are printed. A walk stops early when
its fills add up to --walk-seconds (the ambiguous grammar's fills grow with its length; the daemon ends
such a request with "grammar too expensive", see grammar_mask_budget_ms).

    python bench/grammar_cost.py [--rounds 3] [--tokens 64] [--walk-seconds 5]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
import statistics
import time
from typing import Any

import torch
from transformers import AutoTokenizer

from cbd.engine.grammar.matcher import GrammarCompiler, GrammarKind, GrammarSpec
from cbd.model.loader import resolve_checkpoint
from cbd.server.tool_calls import HERMES, Tool, ToolChoice, ToolChoiceMode, grammar_for

_WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "unit"],
}


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string", "maxLength": 8}
    for i in range(depth):
        schema = {"type": "object", "properties": {f"k{i}": schema, "n": {"type": "integer"}}, "required": [f"k{i}"]}
    return schema


def specs() -> dict[str, GrammarSpec]:
    tools = [
        Tool("get_weather", "", _WEATHER),
        Tool("search", "", {"type": "object", "properties": {"q": {"type": "string"}}}),
    ]
    tag = grammar_for(HERMES, tools, ToolChoice(ToolChoiceMode.REQUIRED))
    assert tag is not None
    return {
        "json_schema, small (3 fields)": GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(_WEATHER)),
        "json_schema, nested 32 deep": GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(_nested(32))),
        "json_object": GrammarSpec(GrammarKind.JSON_OBJECT),
        "regex (e-mail-like)": GrammarSpec(GrammarKind.REGEX, r"[a-z0-9._]{1,32}@[a-z0-9]{1,20}\.(com|org|net)"),
        "EBNF (arithmetic)": GrammarSpec(
            GrammarKind.GRAMMAR,
            'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= num | "(" expr ")"\nnum ::= [0-9]{1,6}',
        ),
        "structural tag, 2 tools (required)": tag,
        'ambiguous: x{700} "." / x ::= x x | "a"': GrammarSpec(
            GrammarKind.GRAMMAR, 'root ::= x{700} "."\nx ::= x x | "a"'
        ),
    }


def compile_ms(tokenizer: Any, spec: GrammarSpec, rounds: int) -> tuple[float, GrammarCompiler]:
    times, compiler = [], None
    for _ in range(rounds):
        compiler = GrammarCompiler(tokenizer, 49152, (tokenizer.eos_token_id,), cache_size=1, max_threads=1)
        start = time.perf_counter()
        compiler.compile(spec)
        times.append(1000 * (time.perf_counter() - start))
    assert compiler is not None
    return statistics.median(times), compiler


def walk(compiler: GrammarCompiler, spec: GrammarSpec, tokens: int, budget_s: float, stops: set[int]) -> list[float]:
    """Milliseconds of each mask fill along one walk through the grammar."""
    state = compiler.compile(spec).new_state()
    mask = compiler.new_bitmask(1)
    rng, fills, total = random.Random(0), [], 0.0
    for _ in range(tokens):
        start = time.perf_counter()
        state.fill(mask, 0)
        took = time.perf_counter() - start
        fills.append(1000 * took)
        total += took
        allowed = [t for t in _allowed(mask, compiler.vocab_size) if t not in stops]
        if not allowed or total > budget_s or state.finished:
            break
        _advance(state, allowed, rng, mask, compiler.vocab_size, stops)
    return fills


def _advance(
    state: Any, allowed: list[int], rng: random.Random, mask: torch.Tensor, vocab: int, stops: set[int]
) -> None:
    """Accept a random allowed token, preferring one after which more than the stop token may follow
    (so that short grammars such as json_object are walked further than `{}`)."""
    ahead = torch.zeros(2, mask.shape[1], dtype=mask.dtype)  # row 1: the mask after the token (state unchanged)
    for _ in range(20):
        token = rng.choice(allowed)
        state.fill_drafted(ahead, 0, [token])
        if any(t not in stops for t in _allowed(ahead[1:], vocab)):
            break
    assert state.accept(token)


def _allowed(mask: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids a one-row bitmask allows (bit t % 32 of word t // 32)."""
    bits = (mask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1  # [W, 32]
    return bits.flatten()[:vocab_size].nonzero().flatten().tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--walk-seconds", type=float, default=5.0)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_checkpoint(None))
    stops = {tokenizer.eos_token_id}
    version = importlib.metadata.version("xgrammar")
    print(f"xgrammar {version}; {args.rounds} compiles each (median), walks of up to {args.tokens} tokens")
    print(f"| {'grammar':<40} | compile ms | tokens walked | mask ms/token (mean) | mask ms (max) |")
    print(f"|{'-' * 42}|-----------:|--------------:|---------------------:|--------------:|")
    for name, spec in specs().items():
        ms, compiler = compile_ms(tokenizer, spec, args.rounds)
        fills = walk(compiler, spec, args.tokens, args.walk_seconds, stops)
        mean = statistics.mean(fills)
        print(f"| {name:<40} | {ms:10.1f} | {len(fills):13d} | {mean:20.3f} | {max(fills):13.3f} |", flush=True)


if __name__ == "__main__":
    main()

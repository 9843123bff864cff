"""Grammar compilation and matching against the embedded model's tokenizer: every masked walk through random
logits ends in text that the schema's own validator (jsonschema) accepts; bad specs are clear errors."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from cbd.engine.grammar.matcher import MAX_GRAMMAR_BYTES, GrammarKind, GrammarSpec
from cbd.errors import InvalidRequest
from grammar_cases import SCHEMAS, walk


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_masked_random_walks_validate_against_the_schema(compiler, name) -> None:
    grammar = compiler.compile(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMAS[name])))
    decode = compiler.info.decoded_vocab
    for seed in range(8):
        state = grammar.new_state()
        tokens = walk(state, compiler, seed)
        assert state.finished, f"no end within the budget: {tokens}"
        text = b"".join(decode[t] for t in tokens[:-1]).decode()  # the last token is the stop token
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_json_object_regex_and_ebnf(compiler) -> None:
    decode = compiler.info.decoded_vocab
    cases = [
        (GrammarSpec(GrammarKind.JSON_OBJECT), lambda text: isinstance(json.loads(text), dict)),
        (GrammarSpec(GrammarKind.REGEX, r"(yes|no)-[0-9]{3}"), lambda text: re.fullmatch(r"(yes|no)-[0-9]{3}", text)),
        (GrammarSpec(GrammarKind.GRAMMAR, 'root ::= "(" [a-c]+ ")"'),
         lambda text: text.startswith("(") and text.endswith(")") and set(text[1:-1]) <= set("abc")),
    ]  # fmt: skip
    for spec, check in cases:
        for seed in range(4):
            state = compiler.compile(spec).new_state()
            tokens = walk(state, compiler, seed)
            assert state.finished
            text = b"".join(decode[t] for t in tokens[:-1]).decode()
            assert check(text), (spec, text)


def test_states_of_one_grammar_continue_independently(compiler) -> None:
    """As the candidates of a fan-out do: each has its own state of the request's one compiled grammar."""
    grammar = compiler.compile(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMAS["flat"])))
    state, twin = grammar.new_state(), grammar.new_state()
    prefix = compiler.info.decoded_vocab
    for token in [t for t in range(compiler.vocab_size) if prefix[t] == b'{"'][:1]:
        assert state.accept(token) and twin.accept(token)
    a, b = walk(state, compiler, 1), walk(twin, compiler, 2)
    assert state.finished and twin.finished and a != b
    assert twin.num_accepted == len(b) + 1 and state.num_accepted == len(a) + 1


def test_a_rejected_token_leaves_the_state_unchanged(compiler) -> None:
    state = compiler.compile(GrammarSpec(GrammarKind.REGEX, "abc")).new_state()
    letter = {v: i for i, v in enumerate(compiler.info.decoded_vocab)}
    assert not state.accept(letter[b"z"]) and state.num_accepted == 0
    assert state.accept(letter[b"a"]) and state.num_accepted == 1


def test_a_repeated_spec_is_compiled_once(compiler) -> None:
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMAS["nested"]))
    assert compiler.compile(spec).compiled is compiler.compile(GrammarSpec(spec.kind, spec.source)).compiled


@pytest.mark.parametrize(
    "kind, source, match",
    [
        (GrammarKind.JSON_SCHEMA, "{not json", "json_schema is not valid JSON"),
        (GrammarKind.JSON_SCHEMA, '{"type": "nonsense"}', 'invalid json_schema: Unsupported type "nonsense"'),
        (GrammarKind.REGEX, "([", "invalid regex: Regex parsing error"),
        (GrammarKind.GRAMMAR, "root ::= ", "invalid grammar: EBNF parser error"),
        (GrammarKind.STRUCTURAL_TAG, "{}", "invalid structural_tag"),
    ],
)
def test_bad_specs_are_invalid_requests_with_a_readable_message(compiler, kind, source, match) -> None:
    with pytest.raises(InvalidRequest, match=match) as info:
        compiler.compile(GrammarSpec(kind, source))
    assert "/project/" not in str(info.value) and "\n" not in str(info.value)


def test_a_spec_over_the_limit_is_refused() -> None:
    with pytest.raises(InvalidRequest, match=f"at most {MAX_GRAMMAR_BYTES}"):
        GrammarSpec(GrammarKind.REGEX, "a" * (MAX_GRAMMAR_BYTES + 1))


def test_a_regex_anchor_is_taken_only_where_it_restates_a_whole_match() -> None:
    from cbd.engine.grammar.matcher import check_anchors

    for regex in ("abc", "^abc$", "^a|^b$", "(^a|b$)", "[^a]b", "[a^$]", r"a\^b\$", "x[]^]y"):
        check_anchors(regex)
    for regex in ("a^b", "a$b", "[a]^", r"\d$x"):
        with pytest.raises(InvalidRequest, match=r"\^ and \$ are taken only"):
            check_anchors(regex)

"""Constrained decoding in the engine with the embedded model: every candidate's reply validates against its
schema (jsonschema), greedy and sampled, n = 4, in sync and overlap mode, in a KV pool small enough to force
preemption; overlap and sync give the same tokens; unconstrained rows beside constrained ones sample exactly
what they sample alone."""

from __future__ import annotations

import json

import jsonschema
import pytest

from cbd.engine.grammar.matcher import GrammarCompiler, GrammarKind, GrammarSpec
from cbd.engine.sampling_params import SamplingParams
from grammar_cases import SCHEMAS
from helpers import make_core, run_all

pytestmark = pytest.mark.slow

SCHEMAS_HERE = {
    **SCHEMAS,
    "people": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                         "role": {"enum": ["admin", "user"]}}, "required": ["name", "role"]}},
}  # fmt: skip


@pytest.fixture(scope="module")
def compiler(default_model) -> GrammarCompiler:
    return GrammarCompiler(default_model.tokenizer, default_model.spec.vocab_size, default_model.eos_token_ids)


def chat(default_model, text: str) -> list[int]:
    rendered = default_model.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True
    )
    return list(rendered["input_ids"])


def workload(default_model, compiler) -> tuple[list[list[int]], list[SamplingParams], list[str]]:
    prompts, params, names = [], [], []
    for name, schema in sorted(SCHEMAS_HERE.items()):
        grammar = compiler.compile(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema)))
        for temperature in (0.0, 1.0):
            prompts.append(chat(default_model, f"Give me an example of {name} data as JSON."))
            params.append(SamplingParams(n=4, temperature=temperature, seed=11, max_tokens=160, grammar=grammar))
            names.append(name)
    return prompts, params, names


def test_replies_validate_in_sync_and_overlap_mode_under_preemption(default_model, compiler) -> None:
    prompts, params, names = workload(default_model, compiler)
    texts = {}
    for overlap in ("off", "on"):
        core = make_core(default_model, num_kv_blocks=72, max_num_seqs=24, overlap=overlap)
        results = run_all(core, prompts, params)
        assert core.scheduler.num_preemptions > 0  # the pool forced recomputation while grammars were live
        texts[overlap] = [r["text"] for r in results]
        for name, result in zip(names, results):
            assert sorted(result["finish"]) == [0, 1, 2, 3]
            for index, text in result["text"].items():
                assert result["finish"][index].value == "stop", (name, text)
                jsonschema.validate(json.loads(text), SCHEMAS_HERE[name])
    assert texts["on"] == texts["off"]  # the deferred, masked sampling of the overlap loop changes nothing


def test_unconstrained_rows_beside_constrained_ones_sample_what_they_sample_alone(default_model, compiler) -> None:
    plain = [chat(default_model, "Tell me about the sea."), chat(default_model, "Name three fruits.")]
    plain_params = [
        SamplingParams(max_tokens=24, temperature=0.0),
        SamplingParams(max_tokens=24, temperature=0.9, seed=5),
    ]
    alone = run_all(make_core(default_model, overlap="on"), plain, plain_params)
    prompts, params, _ = workload(default_model, compiler)
    mixed = run_all(make_core(default_model, overlap="on"), plain + prompts[:4], plain_params + params[:4])
    assert [r["tokens"] for r in mixed[:2]] == [r["tokens"] for r in alone]


def test_a_grammar_cut_by_max_tokens_ends_with_length(default_model, compiler) -> None:
    grammar = compiler.compile(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMAS_HERE["nested"])))
    result = run_all(make_core(default_model), [chat(default_model, "JSON please.")],
                     SamplingParams(max_tokens=3, temperature=0.0, grammar=grammar))[0]  # fmt: skip
    assert result["finish"][0].value == "length" and len(result["tokens"][0]) == 3


def test_ignore_eos_still_ends_at_the_end_of_the_grammar(default_model, compiler) -> None:
    grammar = compiler.compile(GrammarSpec(GrammarKind.REGEX, "(yes|no)"))
    result = run_all(make_core(default_model), [chat(default_model, "Is water wet?")],
                     SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, grammar=grammar))[0]  # fmt: skip
    assert result["finish"][0].value == "stop" and result["text"][0] in ("yes", "no")


def test_logprobs_are_of_the_constrained_distribution_and_stop_strings_still_apply(default_model, compiler) -> None:
    import math

    grammar = compiler.compile(GrammarSpec(GrammarKind.REGEX, "(yes|no)"))
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=20, grammar=grammar)
    result = run_all(make_core(default_model), [chat(default_model, "Is water wet?")], params)[0]
    first = result["outputs"][0].candidates[0].logprobs[0]
    # Fewer than 20 tokens can start "yes" or "no": the masked distribution's mass is all in the top 20.
    mass = sum(math.exp(lp) for _, lp in first.top if math.isfinite(lp))
    assert abs(mass - 1.0) < 1e-3 and math.isfinite(first.logprob)

    person = compiler.compile(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMAS_HERE["flat"])))
    params = SamplingParams(max_tokens=60, temperature=0.0, stop=('"age"',), grammar=person)
    result = run_all(make_core(default_model), [chat(default_model, "A person as JSON.")], params)[0]
    assert result["finish"][0].value == "stop" and result["text"][0].startswith('{"name": ')
    assert '"age"' not in result["text"][0]

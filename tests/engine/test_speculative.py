"""Speculative decoding (n-gram drafts from the sequence's own context, verified in one step).

The oracle is the same engine with `speculative="off"`: greedy outputs must be equal token for token,
and so must seeded samples (each position's draw uses the same position-keyed randomness, and a
draft is kept only where it equals that draw). A statistical test on a tiny model checks that the
tokens sampled at verified positions follow the model's own distribution (transformers' softmax)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from cbd.engine.core import EngineCore
from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sequence import FinishReason, Request, Sequence
from cbd.engine.spec.drafter import NgramDrafter, NgramIndex
from helpers import checked_step, eager_graphs, make_core, run_all

pytestmark = pytest.mark.first  # minutes on the CI machine: run before the other files

CODE = """def load(path):
    with open(path) as f:
        rows = [line.split(",") for line in f]
    return rows


def total(rows):
    return sum(float(row[2]) for row in rows)
"""


def _chat(loaded, text: str) -> list[int]:
    tok = loaded.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=False))  # fmt: skip


@pytest.fixture(scope="module")
def prompts(default_model):
    return {
        "copy": _chat(default_model, "Repeat this code exactly, renaming `rows` to `records`:\n\n" + CODE),
        "quote": _chat(default_model, "The tool returned: {\"status\": \"ok\", \"path\": \"/srv/data/2024/q3.csv\", "
                                      "\"rows\": 1842}. Quote the tool result back verbatim, then say done."),
        "plain": _chat(default_model, "Name three colours."),
    }  # fmt: skip


def _speculated(core: EngineCore) -> tuple[int, int]:
    stats = core.stats().speculation
    assert stats is not None
    return stats.num_draft_tokens, stats.num_accepted_tokens


def test_the_drafter_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    seq = Sequence(0, Request("r", [], SamplingParams(), 0), 0, [5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 3, 5, 6, 7], 3)
    drafter = NgramDrafter()
    assert drafter.propose(seq, 3) == [3, 5, 6]  # "5 6 7" last occurred at 7..9, followed by 3
    seq.token_ids += [3, 5]
    assert drafter.propose(seq, 2) == [6, 7]  # the index grew with the tokens: "7 3 5" was seen
    assert drafter.propose(seq, 0) == []
    fresh = Sequence(1, seq.request, 0, [1, 2, 3, 4], 1)
    assert drafter.propose(fresh, 4) == []  # nothing repeats
    index = NgramIndex()
    index.extend([1, 2, 1, 2], 4)
    assert index.positions[(1, 2)] == 2 and index.indexed == 3  # the suffix's own n-grams wait for a follower


@pytest.mark.parametrize("kind", ["copy", "quote", "plain"])
def test_greedy_outputs_equal_without_speculation(default_model, prompts, kind) -> None:
    params = SamplingParams(max_tokens=48, temperature=0.0, logprobs=2)
    results = {}
    for mode in ("off", "ngram"):
        core = make_core(default_model, speculative=mode, num_kv_blocks=512)
        results[mode] = run_all(core, [prompts[kind]], params)[0]
        assert core.block_manager.num_used_blocks == 0
        if mode == "ngram" and kind != "plain":
            drafted, accepted = _speculated(core)
            assert drafted > 0 and accepted > 0, (drafted, accepted)  # the feature ran
    off, on = results["off"], results["ngram"]
    assert on["tokens"] == off["tokens"] and on["text"] == off["text"] and on["finish"] == off["finish"]
    assert on["usage"] == off["usage"]
    lp_off = [(lp.token_id, lp.logprob) for o in off["outputs"] for d in o.candidates for lp in d.logprobs]
    lp_on = [(lp.token_id, lp.logprob) for o in on["outputs"] for d in o.candidates for lp in d.logprobs]
    # The same tokens; a verifying step's (1 + k)-row matmuls round differently from one-row decode, so
    # the logprobs agree to 1e-3 (not to a rounded third decimal, which flips at a rounding boundary).
    assert [t for t, _ in lp_on] == [t for t, _ in lp_off]
    assert max(abs(a - b) for (_, a), (_, b) in zip(lp_on, lp_off, strict=True)) <= 1e-3
    # A step that keeps drafts moves a candidate by several tokens in one output.
    if kind == "copy":
        assert max(len(d.token_ids) for o in on["outputs"] for d in o.candidates) > 1


def test_fan_out_and_seeded_sampling_equal_without_speculation(default_model, prompts) -> None:
    cases = [
        SamplingParams(max_tokens=40, temperature=0.0, n=4),
        SamplingParams(max_tokens=40, temperature=0.7, n=4, seed=11),
        SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=5),
    ]
    batch = [prompts["copy"], prompts["quote"], prompts["copy"]]
    results = {}
    for mode in ("off", "ngram"):
        core = make_core(default_model, speculative=mode, num_kv_blocks=1024)
        results[mode] = [(r["tokens"], r["finish"]) for r in run_all(core, batch, cases)]
        assert core.block_manager.num_used_blocks == 0
    assert results["ngram"] == results["off"]
    again = make_core(default_model, speculative="ngram", num_kv_blocks=1024)
    assert [(r["tokens"], r["finish"]) for r in run_all(again, batch, cases)] == results["ngram"]  # reproducible


@pytest.fixture(scope="module")
def copy_stops(default_model, prompts) -> tuple[str, int]:
    """A stop string and a stop token id from inside the greedy copy reply (60 tokens, speculation off),
    where drafts are kept in runs: a stop there ends a kept run part-way."""
    core = make_core(default_model, speculative="off", num_kv_blocks=512)
    full = run_all(core, [prompts["copy"]], SamplingParams(max_tokens=60, temperature=0.0))[0]
    tokens, text = full["tokens"][0], full["text"][0]
    return text[len(text) // 2 : len(text) // 2 + 6], tokens[len(tokens) * 2 // 3]


def test_stops_inside_a_kept_run_end_the_output_there(default_model, prompts, copy_stops) -> None:
    stop_string, stop_id = copy_stops
    cases = [
        SamplingParams(max_tokens=60, temperature=0.0, stop=[stop_string]),
        SamplingParams(max_tokens=60, temperature=0.0, stop_token_ids=[stop_id]),
        SamplingParams(max_tokens=23, temperature=0.0),  # max_tokens in the middle of a run
    ]
    for params in cases:
        out = {}
        for mode in ("off", "ngram"):
            core = make_core(default_model, speculative=mode, num_kv_blocks=512)
            r = run_all(core, [prompts["copy"]], params)[0]
            out[mode] = (r["tokens"], r["text"], r["finish"], r["usage"])
            assert core.block_manager.num_used_blocks == 0
        assert out["ngram"] == out["off"], params
    assert stop_string not in out["off"][1][0]


def test_session_turns_equal_without_speculation(default_model) -> None:
    turns = [
        "Here is a file:\n" + CODE + "\nRepeat it exactly.",
        " Now repeat only the function total, exactly.",
        " Repeat the first line of the file again.",
    ]
    answers = {}
    for mode in ("off", "ngram"):
        core = make_core(default_model, speculative=mode, num_kv_blocks=1024)
        sid = core.sessions.open().session_id
        got = []
        for text in turns:
            request = core.add_session_turn(
                sid, _chat(default_model, text), SamplingParams(max_tokens=40, temperature=0.0)
            )
            if mode == "ngram" and got:  # the history's n-gram index came with the session: not built again
                index = request.sequences[0].draft_index
                assert index is not None and index.indexed >= len(got[-1][0])
            tokens: list[int] = []
            cached = None
            while core.has_work():
                for out in checked_step(core):
                    if out.request_id == request.request_id:
                        tokens += [t for d in out.candidates for t in d.token_ids]
                        cached = out.usage.cached_prompt_tokens if out.finished and out.usage else cached
            got.append((tokens, cached))
        if mode == "ngram":
            assert _speculated(core)[1] > 0
        core.sessions.close(sid)
        core.check_integrity()
        assert core.block_manager.num_used_blocks == 0
        answers[mode] = got
    assert answers["ngram"] == answers["off"]


def _abort_during_verification(core: EngineCore, prompt: list[int], booked_after: bool = False) -> None:
    """Abort a request as soon as a step verifying its drafts has run (booked_after: while the step after
    it, booked as if every draft were kept, is in flight); nothing is left behind."""
    request = core.add_request(prompt, SamplingParams(max_tokens=60, temperature=0.0))
    wait = core.runner.wait
    aborted = []

    def wait_then_abort(step):
        result = wait(step)
        seq = request.sequences[0]
        if seq.num_draft and (seq.next_rows is not None or not booked_after) and not aborted:
            aborted.append(core.abort_request(request.request_id))
        return result

    core.runner.wait = wait_then_abort  # type: ignore[method-assign]
    while core.has_work():
        checked_step(core)
    assert aborted and request.sequences[0].num_draft == 0
    assert core.block_manager.num_used_blocks == 0


def test_abort_during_a_verifying_step_and_preemption_leave_no_blocks(default_model, prompts) -> None:
    _abort_during_verification(make_core(default_model, speculative="ngram", num_kv_blocks=512), prompts["copy"])
    # A pool too small for all four copies at once: sequences are preempted and recomputed; outputs as unconstrained.
    params = SamplingParams(max_tokens=40, temperature=0.0)
    batch = [prompts["copy"], prompts["quote"], prompts["copy"], prompts["quote"]]
    small = make_core(
        default_model, speculative="ngram", num_kv_blocks=50, block_size=8, max_num_seqs=4, enable_prefix_caching=False
    )
    got = [r["tokens"] for r in run_all(small, batch, params)]
    assert small.scheduler.num_preemptions > 0 and _speculated(small)[1] > 0
    assert small.block_manager.num_used_blocks == 0
    big = make_core(default_model, speculative="off", num_kv_blocks=1024)
    assert got == [r["tokens"] for r in run_all(big, batch, params)]


def test_auto_speculates_only_at_small_batches(default_model, prompts) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0)
    core = make_core(default_model, speculative="auto", speculative_max_batch=2, num_kv_blocks=1024)
    run_all(core, [prompts["copy"]] * 3, params)  # three at once: above the limit until one finishes
    wide = _speculated(core)[0]
    core = make_core(default_model, speculative="auto", speculative_max_batch=2, num_kv_blocks=1024)
    run_all(core, [prompts["copy"]], params)
    assert _speculated(core)[0] > 0 and wide == 0


class _FixedDrafter:
    """Proposes the same tokens at every step: every position after the first is verified."""

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, seq: Sequence, k: int, end: int | None = None) -> list[int]:
        return [self.token] * min(k, 2)


def test_sampled_tokens_at_verified_positions_follow_the_model(tiny_checkpoint, tiny_loaded) -> None:
    """Many seeds on a tiny model, with a drafter that always proposes the second token's most likely
    value: the second tokens (all sampled at verified positions) have the frequencies of the model's
    own distribution (transformers' softmax, marginalised over the first token), not inflated towards
    the draft; and each seed's tokens equal those without speculation."""
    from transformers import AutoModelForCausalLM

    prompt = [10, 11, 12, 13] * 4 + [10, 11]
    temperature, seeds = 1.0, 800
    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), dtype=torch.float32).eval()
    with torch.inference_mode():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        vocab = p1.shape[0]
        both = torch.tensor([prompt + [v] for v in range(vocab)])
        p2_given = torch.softmax(hf(both).logits[:, -1] / temperature, -1)
    p2 = (p1[:, None] * p2_given).sum(0)
    draft = int(p2.argmax())
    runs = {}
    for mode in ("off", "ngram"):
        core = make_core(tiny_loaded, speculative=mode, num_kv_blocks=2048, max_num_seqs=64)
        if mode == "ngram":
            core.scheduler.speculator.drafter = _FixedDrafter(draft)
        params = [SamplingParams(max_tokens=3, temperature=temperature, seed=s, ignore_eos=True) for s in range(seeds)]
        runs[mode] = [tuple(r["tokens"][0]) for r in run_all(core, [prompt] * seeds, params)]
        if mode == "ngram":
            drafted, accepted = _speculated(core)
            assert drafted >= seeds and 0 < accepted < drafted
    assert runs["ngram"] == runs["off"]
    seconds = Counter(t[1] for t in runs["ngram"])
    for token in set(seconds) | set(torch.topk(p2, 8).indices.tolist()):
        p = float(p2[token])
        bound = 4.5 * math.sqrt(p * (1 - p) / seeds) + 2 / seeds
        assert abs(seconds[token] / seeds - p) <= bound, (token, seconds[token] / seeds, p)


def test_drafts_use_only_what_the_step_leaves_over(tiny_loaded) -> None:
    """A pool that just fits two sequences' own tokens: drafts that would need more blocks are not made,
    so nothing is preempted for them, and the outputs are those without speculation."""
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    runs = {}
    for mode in ("off", "ngram"):
        core = make_core(tiny_loaded, speculative=mode, block_size=4, num_kv_blocks=8, enable_prefix_caching=False)
        if mode == "ngram":
            core.scheduler.speculator.drafter = _FixedDrafter(7)
        runs[mode] = [r["tokens"] for r in run_all(core, prompts, params)]
        assert core.scheduler.num_preemptions == 0, mode
        assert core.block_manager.num_used_blocks == 0
        if mode == "ngram":
            assert _speculated(core)[0] > 0  # it did speculate where blocks were free
    assert runs["ngram"] == runs["off"]


def test_the_overlap_loop_speculates_synchronously_with_the_same_outputs(default_model, prompts) -> None:
    """With overlap on (the GPU's loop, forced here), a speculating step first completes the step in flight;
    outputs equal those without speculation, also beside a grammar-constrained request (its masks are made
    synchronously in a speculating step) and a fan-out; and speculation does happen."""
    import json

    from cbd.engine.grammar.matcher import GrammarCompiler, GrammarKind, GrammarSpec

    compiler = GrammarCompiler(default_model.tokenizer, default_model.spec.vocab_size, default_model.eos_token_ids)
    schema = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
    grammar = compiler.compile(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema)))
    cases = [
        SamplingParams(max_tokens=40, temperature=0.0),
        SamplingParams(max_tokens=40, temperature=0.8, seed=3),
        SamplingParams(max_tokens=24, temperature=0.0, grammar=grammar),
        SamplingParams(max_tokens=20, temperature=0.0, n=2),
    ]
    batch = [prompts["copy"], prompts["quote"], prompts["quote"], prompts["plain"]]
    results = {}
    for mode in ("off", "ngram"):
        core = make_core(default_model, overlap="on", speculative=mode, num_kv_blocks=1024)
        results[mode] = [(r["tokens"], r["finish"]) for r in run_all(core, batch, cases)]
        assert core.block_manager.num_used_blocks == 0
        if mode == "ngram":
            assert _speculated(core)[1] > 0
    assert results["ngram"] == results["off"]


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_grammar_constrained_drafts_are_checked_and_equal_without_speculation(default_model, overlap: str) -> None:
    """A tool-call-like JSON object that copies the context: drafts pass the grammar's matcher first, each
    verifying row gets the mask of the grammar after the drafts before it; outputs equal speculation off,
    parse, and drafts were kept."""
    import json

    from cbd.engine.grammar.matcher import GrammarCompiler, GrammarKind, GrammarSpec

    compiler = GrammarCompiler(default_model.tokenizer, default_model.spec.vocab_size, default_model.eos_token_ids)
    schema = {"type": "object", "properties": {"status": {"type": "string"}, "path": {"type": "string"},
                                               "rows": {"type": "integer"}},
              "required": ["status", "path", "rows"]}  # fmt: skip
    grammar = compiler.compile(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema)))
    prompt = _chat(default_model, 'The tool returned {"status": "ok", "path": "/srv/data/2024/q3.csv", "rows": 1842} '
                                  'and {"status": "ok", "path": "/srv/data/2024/q3.csv", "rows": 1842}. Give it as JSON.')  # fmt: skip
    params = SamplingParams(max_tokens=48, temperature=0.0, grammar=grammar)
    # A reply whose whole object is drafted: the token that ends the grammar follows a kept run.
    short = _chat(default_model, 'Answer with the JSON object {"capital": "Paris"} and nothing else.')
    short_params = SamplingParams(max_tokens=30, temperature=0.0,
                                  grammar=compiler.compile(GrammarSpec(GrammarKind.JSON_OBJECT)))  # fmt: skip
    results = {}
    for mode in ("off", "ngram"):
        core = make_core(default_model, overlap=overlap, speculative=mode, num_kv_blocks=1024)
        results[mode] = [(r["tokens"], r["finish"]) for r in run_all(core, [prompt], params)]
        results[mode] += [(r["tokens"], r["finish"]) for r in run_all(core, [short], short_params)]
        assert core.block_manager.num_used_blocks == 0
        if mode == "ngram":
            drafted, kept = _speculated(core)
            assert kept > 0, (drafted, kept)
    assert results["ngram"] == results["off"]
    text = default_model.tokenizer.decode(results["off"][0][0][0], skip_special_tokens=True)
    assert set(json.loads(text)) == {"status", "path", "rows"}, text
    text = default_model.tokenizer.decode(results["off"][1][0][0], skip_special_tokens=True)
    assert json.loads(text) == {"capital": "Paris"}, text


def test_verifying_graph_layout_gives_the_same_outputs(default_model, prompts) -> None:
    """The packing and forward of the verifying CUDA graphs (each sequence's 1 + k tokens after the one
    before, the batch padded to a bucket with sequences of no tokens and the rows to the graph's token
    count, padding's K/V sent to the scratch block), run eagerly on the CPU: the same greedy tokens,
    logprobs included, as without speculation, with a block size that puts drafts past the end of a
    block; the graphs' forward served every verifying step."""

    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=2)
    for batch in ([prompts["copy"], prompts["quote"], prompts["plain"]], [prompts["copy"]]):
        off = run_all(make_core(default_model, speculative="off", num_kv_blocks=512, block_size=4), batch, params)
        core = make_core(default_model, speculative="ngram", num_kv_blocks=512, block_size=4)
        graphs = eager_graphs(core, 4)
        on = run_all(core, batch, params)
        assert core.block_manager.num_used_blocks == 0
        for a, b in zip(off, on):
            assert a["tokens"] == b["tokens"] and a["text"] == b["text"] and a["finish"] == b["finish"]
            lp_a = [(lp.token_id, lp.logprob) for o in a["outputs"] for d in o.candidates for lp in d.logprobs]
            lp_b = [(lp.token_id, lp.logprob) for o in b["outputs"] for d in o.candidates for lp in d.logprobs]
            assert [t for t, _ in lp_a] == [t for t, _ in lp_b]
            assert max(abs(x - y) for (_, x), (_, y) in zip(lp_a, lp_b)) < 1e-3  # fp32, other GEMM shapes
        steps = core.stats().speculation
        assert steps is not None and 0 < graphs.replays[1] <= steps.num_steps and graphs.replays[0] > 0
    # Alone, every verifying step after the prompt's is a graph's (beside others, some share a prefill step).
    assert graphs.replays[1] == steps.num_steps


def _record_launches(core: EngineCore) -> list[set[str]]:
    """The packed arrays of every step the runner launches (names only)."""
    seen: list[set[str]] = []
    launch = core.runner.launch

    def recording(batch):
        seen.append(set(batch.packed.int_fields))
        return launch(batch)

    core.runner.launch = recording  # type: ignore[method-assign]
    return seen


def _in_flight_cases(copy_stops: tuple[str, int]) -> list[SamplingParams]:
    stop_string, stop_id = copy_stops
    return [
        SamplingParams(max_tokens=60, temperature=0.0, logprobs=1),
        SamplingParams(max_tokens=48, temperature=0.8, seed=3),
        SamplingParams(max_tokens=40, temperature=0.0, n=2),
        SamplingParams(max_tokens=60, temperature=0.0, stop=[stop_string]),
        SamplingParams(max_tokens=60, temperature=0.0, stop_token_ids=[stop_id]),
        SamplingParams(max_tokens=23, temperature=0.0),
    ]


def _in_flight_batch(prompts) -> list[list[int]]:
    return [prompts["copy"], prompts["quote"], prompts["quote"], prompts["copy"], prompts["copy"], prompts["plain"]]


def _tokens_and_logprobs(got: list[dict]) -> tuple[list, list[int]]:
    return [(r["tokens"], r["finish"], r["usage"]) for r in got], [
        lp.token_id for o in got[0]["outputs"] for d in o.candidates for lp in d.logprobs
    ]


@pytest.fixture(scope="module")
def in_flight_off(default_model, prompts, copy_stops) -> tuple[list, list[int]]:
    """The oracle of the in-flight test: its batch with speculation off (overlap on, eager steps)."""
    core = make_core(default_model, overlap="on", speculative="off", num_kv_blocks=1024, block_size=4)
    got = run_all(core, _in_flight_batch(prompts), _in_flight_cases(copy_stops))
    assert core.block_manager.num_used_blocks == 0
    return _tokens_and_logprobs(got)


@pytest.mark.parametrize("graphs", [False, True])
def test_the_overlap_loop_verifies_drafts_with_a_step_in_flight(
    default_model, prompts, copy_stops, in_flight_off, graphs: bool
) -> None:
    """Overlap on (forced on the CPU): drafts follow a guess of the token in flight, and the step after a
    verifying one is launched before its kept count reaches the host (the device moves that step's inputs
    back by the drafts rejected). Outputs equal speculation off (eager steps) token for token: greedy,
    seeded, fan-out, stop strings and ids inside kept runs, max_tokens mid-run; with eager steps and with
    the verifying graphs' layout; and the in-flight paths did run."""

    stop_id = copy_stops[1]
    core = make_core(default_model, overlap="on", speculative="ngram", num_kv_blocks=1024, block_size=4)
    if graphs:
        eager_graphs(core, 8)
    launched = _record_launches(core)
    on, on_logprobs = _tokens_and_logprobs(run_all(core, _in_flight_batch(prompts), _in_flight_cases(copy_stops)))
    assert core.block_manager.num_used_blocks == 0
    assert _speculated(core)[1] > 0
    if graphs:  # the verifying graphs' layout did run
        assert core.runner.graphs is not None and core.runner.graphs.replays[1] > 0
    # A verifying step whose chunks' first tokens were in flight, and a step after drafts in flight.
    assert any({"verify_k", "carry_dst"} <= names for names in launched)
    assert any("carry_group" in names and "seq_group" in names for names in launched)
    assert any("row_group" in names for names in launched)  # a seeded row moved back on the device
    # Drafts looked up again on the device after the step in flight, some of them not the host's guess.
    assert any("redraft" in names for names in launched) and core.scheduler.speculator.num_device_drafted > 0
    assert (on, on_logprobs) == in_flight_off
    # The stop string and the stop id did end their replies early: shorter than the same greedy reply
    # without them (case 0), the stop id its last token.
    whole = on[0][0][0]
    for stopped in on[3:5]:
        assert stopped[1] == {0: FinishReason.STOP} and len(stopped[0][0]) < len(whole), stopped
    assert on[4][0][0][-1] == stop_id


def test_the_overlap_loop_with_drafts_in_flight_under_preemption_and_abort(default_model, prompts) -> None:
    """A pool too small for four copies at once, overlap on: sequences with drafts in flight are never
    preempted (they wait a step), others are, and outputs equal speculation off; an abort while drafts are
    in flight leaves no blocks behind."""
    params = SamplingParams(max_tokens=40, temperature=0.0)
    batch = [prompts["copy"], prompts["quote"], prompts["copy"], prompts["quote"]]
    got = {}
    for mode in ("off", "ngram"):
        small = make_core(default_model, overlap="on", speculative=mode, num_kv_blocks=50, block_size=8,
                          max_num_seqs=4, enable_prefix_caching=False)  # fmt: skip
        got[mode] = [r["tokens"] for r in run_all(small, batch, params)]
        assert small.scheduler.num_preemptions > 0
        assert small.block_manager.num_used_blocks == 0
    assert got["ngram"] == got["off"]
    core = make_core(default_model, overlap="on", speculative="ngram", num_kv_blocks=512)
    _abort_during_verification(core, prompts["copy"], booked_after=True)


def test_a_sequence_with_drafts_in_flight_waits_for_blocks_and_is_never_preempted(tiny_loaded) -> None:
    """Overlap on, every sequence drafting each step: the pool is filled while drafts are in flight, so the
    next step cannot grow them. A sequence whose drafts are in flight is left out of that step (its length
    is not known yet), never preempted; once the pool has room again, the outputs are those without
    speculation and every block is returned."""
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    off = [r["tokens"][0] for r in run_all(make_core(tiny_loaded, speculative="off"), prompts, params)]
    core = make_core(tiny_loaded, overlap="on", speculative="ngram", block_size=4, num_kv_blocks=64,
                     enable_prefix_caching=False)  # fmt: skip
    speculator, scheduler = core.scheduler.speculator, core.scheduler
    speculator.drafter, speculator.backoff = _FixedDrafter(7), False
    requests = [core.add_request(p, params) for p in prompts]
    victims: list[int] = []
    waited: list[Sequence] = []
    preempt, schedule = scheduler._preempt, scheduler.schedule

    def recording_preempt(seq, plan):
        victims.append(seq.num_draft)
        preempt(seq, plan)

    def recording_schedule(speculate=False):
        in_flight = [s for s in scheduler.running if s.num_draft]
        plan = schedule(speculate)
        waited.extend(s for s in in_flight if all(c.seq is not s for c in plan.chunks))
        return plan

    scheduler._preempt, scheduler.schedule = recording_preempt, recording_schedule  # type: ignore[method-assign]
    while not any(s.num_draft for r in requests for s in r.sequences):
        checked_step(core)
    bm = core.block_manager
    hog = bm.allocate_blocks(bm.num_free_blocks)  # nothing left to grow into
    for _ in range(3):
        core.step()
    assert waited and not any(victims), (len(waited), victims)
    bm.release(hog)
    while core.has_work():
        checked_step(core)
    assert [r.sequences[0].token_ids[len(p) :] for r, p in zip(requests, prompts)] == off
    assert bm.num_used_blocks == 0 and speculator.num_draft_tokens > 0


def _turn(core: EngineCore, session_id: str, prompt: list[int], tenant: str) -> tuple[list[int], int]:
    """One greedy turn; its tokens and the drafts kept while it ran."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, tenant=tenant)
    kept = _speculated(core)[1]
    request = core.add_session_turn(session_id, prompt, params)
    tokens: list[int] = []
    while core.has_work():
        for out in checked_step(core):
            if out.request_id == request.request_id:
                tokens += [t for d in out.candidates for t in d.token_ids]
    return tokens, _speculated(core)[1] - kept


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_tenant_s_finished_turn_drafts_for_its_other_sessions_and_never_another_tenant_s(
    tiny_loaded, overlap: str
) -> None:
    """Session a's turn ends; sessions b (same tenant) and c (another tenant) ask the same: b's drafts come
    from a's turn as well as its own context (more kept than with the index off), c's only from its own
    context; outputs equal speculation off; a's tokens leave the index when a closes."""
    prompt = [(i * 7919) % 250 + 3 for i in range(40)]
    got = {}
    for mode, index_tokens in (("off", 0), ("ngram", 0), ("ngram", 4096)):
        core = make_core(tiny_loaded, speculative=mode, overlap=overlap, speculative_index_tokens=index_tokens)
        a, b, c = (core.sessions.open().session_id for _ in range(3))
        turns = [_turn(core, a, prompt, "t1"), _turn(core, b, prompt, "t1"), _turn(core, c, prompt, "t2")]
        agents = core.scheduler.speculator.agents
        if index_tokens:
            assert agents is not None and agents.num_drafts > 0 and agents.num_tokens > 0
        else:
            assert agents is None
        for sid in (a, b, c):
            core.sessions.close(sid)
        if agents is not None:
            assert agents.num_tokens == 0  # each session's donor went with it
        assert core.block_manager.num_used_blocks == 0
        got[mode, index_tokens] = turns
    outputs = [[tokens for tokens, _ in turns] for turns in got.values()]
    assert outputs[0] == outputs[1] == outputs[2]
    (_, a_own), (_, b_own), (_, c_own) = got["ngram", 0]
    (_, a_idx), (_, b_idx), (_, c_idx) = got["ngram", 4096]
    assert a_idx == a_own and c_idx == c_own  # nothing of t1's reached t2's drafts
    assert b_idx > b_own, (b_idx, b_own)  # a's turn drafted for b, and the drafts were kept


def test_a_session_closed_during_its_turn_leaves_no_donor(tiny_loaded) -> None:
    core = make_core(tiny_loaded, speculative="ngram", overlap="on")
    agents = core.scheduler.speculator.agents
    assert agents is not None
    sid = core.sessions.open().session_id
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, tenant="t1")
    core.add_session_turn(sid, [(i * 31) % 250 + 3 for i in range(20)], params)
    checked_step(core)
    core.sessions.close(sid)  # the turn runs on; its result is not kept, nor are its tokens as a donor
    while core.has_work():
        checked_step(core)
    assert agents.num_tokens == 0
    core.add_request([5, 6, 7, 8, 9], params)  # a plain request's turn is kept
    while core.has_work():
        checked_step(core)
    assert agents.num_tokens > 0 and core.block_manager.num_used_blocks == 0


class _BlindAfterGuess:
    """The n-gram drafter, except that its drafts after a guess of tokens in flight are never right: a kept
    draft there is one the device looked up (device/draft_lookup.py)."""

    def __init__(self) -> None:
        self.ngram = NgramDrafter()

    def propose(self, seq: Sequence, k: int, end: int | None = None) -> list[int]:
        drafts = self.ngram.propose(seq, k, end)
        if end is not None and end > seq.num_known_tokens and drafts:
            return [drafts[0]] + [0] * (len(drafts) - 1)  # its first stands for the token in flight
        return drafts


def test_a_masked_step_verifies_the_drafts_the_device_looked_up(default_model, prompts) -> None:
    """Overlap on: a constrained sequence that is not due to draft (so the loop stays overlapped) beside a
    copying one whose drafts the device looks up again: the step is sampled under masks, and the host
    verifies the drafts the device put in it, not its own guess. Outputs equal speculation off."""
    import json

    from cbd.engine.grammar.matcher import GrammarCompiler, GrammarKind, GrammarSpec

    compiler = GrammarCompiler(default_model.tokenizer, default_model.spec.vocab_size, default_model.eos_token_ids)
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    grammar = compiler.compile(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema)))
    constrained = _chat(default_model, "Give a JSON object with a name for a cat.")
    batch = [prompts["copy"], constrained]
    cases = [
        SamplingParams(max_tokens=60, temperature=0.0),
        SamplingParams(max_tokens=40, temperature=0.0, grammar=grammar),
    ]
    results = {}
    for mode in ("off", "ngram"):
        core = make_core(default_model, overlap="on", speculative=mode, num_kv_blocks=1024, block_size=4)
        if mode == "ngram":
            core.scheduler.speculator.drafter = _BlindAfterGuess()
        masked: list[set[str]] = []  # the packed arrays of the steps sampled under masks
        launch = core.runner.launch

        def recording(step_batch, launch=launch, masked=masked):
            if step_batch.meta.masked:
                masked.append(set(step_batch.packed.int_fields))
            return launch(step_batch)

        core.runner.launch = recording  # type: ignore[method-assign]
        requests = [core.add_request(p, c) for p, c in zip(batch, cases)]
        requests[1].sequences[0].draft_retry_step = 10**9  # never due to draft: no synchronous step
        ids = [r.request_id for r in requests]
        got: dict[str, list[int]] = {rid: [] for rid in ids}
        while core.has_work():
            for out in checked_step(core):
                got[out.request_id] += [t for d in out.candidates for t in d.token_ids]
        results[mode] = [got[rid] for rid in ids]
        assert core.block_manager.num_used_blocks == 0
        if mode == "ngram":
            assert any({"redraft", "verify_k"} <= names for names in masked)
            assert core.scheduler.speculator.num_device_drafted > 0 and _speculated(core)[1] > 0
    assert results["ngram"] == results["off"]

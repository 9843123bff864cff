"""Budgets of grammar work: a grammar whose token masks grow too expensive is ended with its documented
error while a greedy stream beside it keeps advancing (and samples what it samples alone); the compile
pool refuses a compile past its time budget, stops a cancelled compile by killing its worker, and caches
its outcomes."""

from __future__ import annotations

import asyncio

import pytest

from cbd.engine.grammar.matcher import GrammarKind, GrammarSpec
from cbd.engine.outputs import RequestOutput
from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sequence import FinishReason
from cbd.errors import InvalidRequest
from cbd.ipc.grammar_pool import CompileBudget, GrammarPool, GrammarSource
from grammar_cases import COMPILE_BOMB, MASK_BOMB, schema_bomb
from helpers import checked_step, make_core, run_all


def test_a_grammar_over_its_mask_budget_ends_with_an_error_while_a_greedy_stream_advances(
    default_model, compiler
) -> None:
    overlap = "on"  # the deferred-sampling loop (the daemon test runs the sync one)
    plain, bomb_prompt = [0, 30, 31, 32], [0, 40, 41, 42]
    greedy = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)
    alone = run_all(make_core(default_model, overlap=overlap), [plain], greedy)[0]["tokens"][0]

    core = make_core(default_model, overlap=overlap, grammar_mask_budget_ms=1.0, grammar_mask_budget_steps=3)
    bomb = SamplingParams(  # its outputs after the first held to its end: the error must reach the one handed over
        max_tokens=1000,
        temperature=0.0,
        grammar=compiler.compile(GrammarSpec(GrammarKind.GRAMMAR, MASK_BOMB)),
        stream_interval=1000,
    )
    delivered: list[RequestOutput] = []
    plain_id = core.add_request(plain, greedy).request_id
    bomb_id = core.add_request(bomb_prompt, bomb, on_output=delivered.append).request_id
    tokens: dict[str, list[int]] = {plain_id: [], bomb_id: []}
    ended, plain_tokens_when_bomb_ended = None, 0
    for _ in range(5000):
        if not core.has_work():
            break
        for out in checked_step(core):
            tokens[out.request_id] += [t for d in out.candidates for t in d.token_ids]
            if out.request_id == bomb_id and out.finished:
                ended, plain_tokens_when_bomb_ended = out, len(tokens[plain_id])
        core.deliver()
    assert ended is not None and ended.candidates[0].finish_reason is FinishReason.ERROR
    assert ended.error is not None and ended.error.startswith("grammar too expensive"), ended.error
    assert len(delivered) == 2  # the first token at once; the rest, held, with the end
    last = delivered[-1]  # what the callback got: the held tokens and the end, with the error
    assert last.finished and last.error == ended.error and last.candidates[0].finish_reason is FinishReason.ERROR
    assert [t for out in delivered for d in out.candidates for t in d.token_ids] == tokens[bomb_id]
    assert 0 < len(tokens[bomb_id]) < 1000  # it ran, under its grammar, and was cut long before its end
    assert plain_tokens_when_bomb_ended < 160  # the greedy stream was still running then ...
    assert tokens[plain_id] == alone  # ... went on to its end, and sampled what it samples alone
    assert not core.live.live  # nothing left behind


def test_an_ordinary_grammar_stays_within_the_default_budget(default_model, compiler) -> None:
    grammar = compiler.compile(GrammarSpec(GrammarKind.REGEX, "[a-z ]{1,200}\\."))
    params = SamplingParams(max_tokens=60, temperature=0.0, grammar=grammar)
    result = run_all(make_core(default_model), [[0, 30, 31, 32]], params)[0]
    assert result["finish"][0] in (FinishReason.STOP, FinishReason.LENGTH)


@pytest.fixture(scope="module")
def grammars(default_model) -> GrammarSource:
    return GrammarSource(default_model.checkpoint_dir, default_model.spec.vocab_size, default_model.eos_token_ids)


def test_the_pool_refuses_past_the_time_budget_kills_on_cancel_and_caches_outcomes(grammars) -> None:
    async def scenario() -> None:
        pool = GrammarPool(grammars, CompileBudget(workers=1, timeout=1.0, memory_mib=1024))
        try:
            ok = await pool.compile(GrammarSpec(GrammarKind.REGEX, "[a-z]+"))
            assert ok.compiled is None and ok.serialized  # crosses serialized; never compiled in the frontend
            bomb = GrammarSpec(GrammarKind.REGEX, COMPILE_BOMB)
            with pytest.raises(InvalidRequest, match=r"compile budget of 1 s \(grammar_compile_timeout\)"):
                await pool.compile(bomb)
            assert pool.num_killed == 1
            with pytest.raises(InvalidRequest, match="grammar_compile_timeout"):
                await pool.compile(bomb)  # the refusal is cached: no second worker is spent on it
            assert pool.num_killed == 1

            task = asyncio.ensure_future(pool.compile(GrammarSpec(GrammarKind.REGEX, COMPILE_BOMB + "|y")))
            for _ in range(3000):  # until its worker (a fresh one) has started and runs the compile
                if pool.num_compiling:
                    break
                await asyncio.sleep(0.01)
            assert pool.num_compiling == 1
            waiting = asyncio.ensure_future(pool.compile(GrammarSpec(GrammarKind.REGEX, "[0-9]+")))
            await asyncio.sleep(0)
            task.cancel()  # within its budget: its worker is killed, and the queued compile gets a fresh one
            with pytest.raises(asyncio.CancelledError):
                await task
            assert pool.num_killed == 2
            assert (await waiting).serialized
            with pytest.raises(InvalidRequest, match="matches nothing"):
                await pool.compile(GrammarSpec(GrammarKind.REGEX, "[^\\s\\S]"))
        finally:
            pool.close()

    asyncio.run(scenario())


def test_six_bombs_compile_at_most_k_at_once_and_each_is_refused_naming_its_limit(grammars) -> None:
    async def scenario() -> None:
        pool = GrammarPool(grammars, CompileBudget(workers=2, timeout=1.0, memory_mib=1024))
        try:
            bombs = [asyncio.ensure_future(pool.compile(GrammarSpec(GrammarKind.JSON_SCHEMA, schema_bomb(f"b{i}"))))
                     for i in range(6)]  # fmt: skip
            running: list[int] = []
            while not all(b.done() for b in bombs):
                running.append(pool.num_compiling)
                await asyncio.sleep(0.01)
            assert max(running) == 2  # two at once, and never more: the other four waited their turn
            for bomb in bombs:
                with pytest.raises(InvalidRequest, match=r"compile budget of 1 s \(grammar_compile_timeout\)"):
                    bomb.result()
            assert pool.num_killed == 6 and pool.num_compiling == 0
            assert (await pool.compile(GrammarSpec(GrammarKind.REGEX, "[a-z]+"))).serialized  # the pool still serves
        finally:
            pool.close()

    asyncio.run(scenario())


def test_the_engines_grammar_cache_is_bounded_in_bytes(compiler, monkeypatch) -> None:
    from cbd.engine.grammar import matcher as grammar_module
    from cbd.engine.grammar.matcher import GrammarCompiler

    fresh = GrammarCompiler(None, compiler.vocab_size, (), info=compiler.info, max_threads=1)
    specs = [GrammarSpec(GrammarKind.REGEX, f"[a-z]{{1,{40 + i}}}") for i in range(6)]
    first = compiler.compile(specs[0]).compiled.memory_size_bytes
    monkeypatch.setattr(grammar_module, "MAX_CACHED_GRAMMAR_BYTES", 3 * first)
    for spec in specs:
        fresh.load(spec, compiler.compile(spec).compiled.serialize_json())
    assert 0 < fresh.cached_bytes <= 3 * first
    assert fresh.cached(specs[-1]) and not fresh.cached(specs[0])  # the least recently used went first

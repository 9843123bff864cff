"""A request's outputs gathered by its interval (engine/stream_interval.py): the first token at once, then a
delivery when a candidate has gathered the interval, a candidate ends or the request ends; everything
delivered in order, nothing lost; the class (and so the default interval) from the first output."""

from __future__ import annotations

import msgspec

from cbd.engine.outputs import CandidateDelta, RequestOutput, TokenLogprob, Usage, merge_outputs
from cbd.engine.sampling_params import PRIORITY_BATCH, PRIORITY_INTERACTIVE
from cbd.engine.sequence import FinishReason
from cbd.engine.stream_interval import StreamInterval, gathers


def step(*tokens: list[int], priority: int | None = None, finish: bool = False) -> RequestOutput:
    reason = FinishReason.LENGTH if finish else None
    deltas = [CandidateDelta(i, list(t), "", finish_reason=reason) for i, t in enumerate(tokens)]
    return RequestOutput("r", deltas, finished=finish, priority=priority)


def deliveries(stream: list[RequestOutput], own: int | None, batch: int = 4, asked: int | None = None):
    """The groups of the stream's outputs delivered together; each delivery must be its group merged."""
    got: list[list[RequestOutput]] = []
    gathering = StreamInterval(own, batch, asked)
    held: list[RequestOutput] = []
    copies = [msgspec.convert(msgspec.to_builtins(o), RequestOutput) for o in stream]
    for out in stream:
        held.append(out)
        due = gathering.add(out)
        if due is not None:
            assert due == merge_outputs(held)
            got.append(held)
            held = []
    assert stream == copies  # the outputs added are never changed
    return got


def test_a_batch_stream_sends_its_first_token_at_once_then_every_interval_and_its_end() -> None:
    stream = [step([i], priority=PRIORITY_BATCH if i == 0 else None) for i in range(10)] + [step([10], finish=True)]
    got = deliveries(stream, None)
    assert [[o.candidates[0].token_ids[0] for o in d] for d in got] == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    assert [o for d in got for o in d] == stream  # in order, each once


def test_an_interactive_stream_passes_each_output_on_unless_it_asks_for_an_interval() -> None:
    stream = [step([i], priority=PRIORITY_INTERACTIVE if i == 0 else None) for i in range(6)]
    assert [len(d) for d in deliveries(stream, None)] == [1] * 6
    assert [len(d) for d in deliveries(stream, 2)] == [1, 2, 2]  # its own interval; the last 1 still held


def test_several_tokens_per_step_and_a_candidate_that_ends_early() -> None:
    first = step([1], [2], priority=PRIORITY_BATCH)
    drafts = step([1, 2, 3], [4])  # one candidate kept three tokens in one step (speculation)
    more = step([5], [6])
    ends = RequestOutput("r", [CandidateDelta(0, [7], ""), CandidateDelta(1, [8], "", finish_reason=FinishReason.STOP)])
    got = deliveries([first, drafts, more, ends], None)
    assert got == [[first], [drafts, more], [ends]]  # candidate 0 reached 4 at `more`; candidate 1 ended


def test_a_stream_whose_first_outputs_carry_no_token_holds_them_with_the_first_token() -> None:
    empty = RequestOutput("r", [], priority=PRIORITY_BATCH)
    token = step([3])
    assert deliveries([empty, token], None) == [[empty, token]]


def test_a_request_that_asked_for_batch_is_gathered_until_its_first_output_says_otherwise() -> None:
    # It asked for batch but runs interactive (a session turn of an interactive session): each step at once.
    stream = [step([0], priority=PRIORITY_INTERACTIVE), step([1]), step([2])]
    assert [len(d) for d in deliveries(stream, None, asked=PRIORITY_BATCH)] == [1, 1, 1]


def test_only_an_interval_above_one_gathers() -> None:
    assert gathers(None, 8) and gathers(5, 1) and gathers(2, 8)
    assert not gathers(None, 1) and not gathers(1, 8)  # its own 1 wins over the batch setting


def test_a_delivery_is_its_outputs_merged_field_by_field() -> None:
    lp = [TokenLogprob(5, -0.5, [(5, -0.5), (6, -1.5)])]
    first = RequestOutput("r", [CandidateDelta(1, [1], "a"), CandidateDelta(0, [2], "b")], priority=PRIORITY_BATCH,
                          queue_seconds=0.25, prompt_usage=Usage(3, 1, 0))  # fmt: skip
    second = RequestOutput("r", [CandidateDelta(1, [5], "c", logprobs=lp), CandidateDelta(0, [3], "")])
    third = RequestOutput("r", [CandidateDelta(0, [4], "d", logprobs=lp)])
    last = RequestOutput(
        "r", [CandidateDelta(1, [], "", finish_reason=FinishReason.ERROR, usage=Usage(3, 0, 2)),
              CandidateDelta(0, [], "", finish_reason=FinishReason.ERROR, usage=Usage(3, 0, 3))],
        finished=True, usage=Usage(3, 0, 5), error="too expensive", turn_ok=False,
    )  # fmt: skip
    got = deliveries([first, second, third, last], None)
    assert got == [[first], [second, third, last]]  # the first token at once; the rest at the end
    # The rule spelled out (merge_outputs and the gathering share it): candidates in index order, each's tokens,
    # text and logprobs in order, its last finish reason and usage; the request's last usage, error and outcome.
    assert merge_outputs(got[1]) == RequestOutput(
        "r", [CandidateDelta(0, [3, 4], "d", lp, FinishReason.ERROR, Usage(3, 0, 3)),
              CandidateDelta(1, [5], "c", lp, FinishReason.ERROR, Usage(3, 0, 2))],
        finished=True, usage=Usage(3, 0, 5), error="too expensive", turn_ok=False,
    )  # fmt: skip
    assert merge_outputs([first, second]).queue_seconds == 0.25  # the first queue time and class
    assert merge_outputs([first, second]).priority == PRIORITY_BATCH
    assert merge_outputs([first, second]).prompt_usage == Usage(3, 1, 0)  # and the prompt's first counts
    assert merge_outputs([second, third]).prompt_usage is None

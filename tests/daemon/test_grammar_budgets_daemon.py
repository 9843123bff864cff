"""Grammar budgets through a real daemon: a compile past its time budget is refused with INVALID_ARGUMENT
naming the limit while a plain request sent meanwhile is answered; a grammar whose masks grow too
expensive ends with its documented error while a greedy stream keeps advancing; schema keywords the
grammar would not enforce, and a regex that matches nothing, are INVALID_ARGUMENT."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import grpc
import pytest

from cbd_client import CbdError, Client
from daemon_process import DaemonProcess, serving
from grammar_cases import COMPILE_BOMB, MASK_BOMB
from helpers import poll_until

pytestmark = pytest.mark.slow
ASK = [{"role": "user", "content": "Write something."}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    flags = ("--grammar-compile-timeout", "8", "--grammar-compile-workers", "1", "--grammar-mask-budget-ms", "1")
    with serving(tmp_path_factory.mktemp("cbd"), *flags) as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon: DaemonProcess) -> Iterator[Client]:
    with Client(daemon.address, timeout=300) as c:
        yield c


def test_a_compile_past_its_budget_is_refused_while_a_plain_request_is_answered(
    daemon: DaemonProcess, client: Client
) -> None:
    failure: list[CbdError] = []

    def bomb() -> None:
        try:
            client.generate(ASK, max_tokens=4, response_format={"type": "regex", "regex": COMPILE_BOMB})
        except CbdError as exc:
            failure.append(exc)

    thread = threading.Thread(target=bomb)
    thread.start()
    # The bomb has reached its worker once one runs (its compile is refused only after 8 s).
    poll_until(daemon.grammar_worker_pids, 60, what="the bomb's compile worker")
    try:
        plain = client.generate("Hello", max_tokens=4, temperature=0.0)
        still_compiling = thread.is_alive()  # the plain request did not wait for the compile
    finally:
        thread.join()
    assert plain.candidates[0].finish_reason == "length" and len(plain.candidates[0].token_ids) == 4
    assert still_compiling
    assert failure and failure[0].code == grpc.StatusCode.INVALID_ARGUMENT
    assert "grammar_compile_timeout" in failure[0].details, failure[0].details


def test_a_grammar_over_its_mask_budget_ends_with_its_error_while_a_greedy_stream_advances(client) -> None:
    counts: list[int] = []
    stream = client.stream("Tell me a long story.", max_tokens=160, temperature=0.0, ignore_eos=True)
    counts.append(len(next(stream).token_ids))  # the greedy stream runs before the bomb arrives
    with pytest.raises(CbdError, match="grammar too expensive") as info:
        client.generate(
            ASK, max_tokens=1000, temperature=0.0, response_format={"type": "grammar", "grammar": MASK_BOMB}
        )
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    at_error = sum(counts)
    counts += [len(d.token_ids) for d in stream]
    assert at_error < 160 and sum(counts) == 160  # it kept going after the bomb ended, to its full length


@pytest.mark.parametrize(
    ("schema", "match"),
    [
        ({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}, r"properties\.a\.not: the keyword 'not'"),
        ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}, r"json_schema\.contains"),
        ({"type": "string", "format": "idn-email"}, r"json_schema\.format: format 'idn-email'"),
        ({"type": "object", "dependentSchemas": {"a": {}}}, r"json_schema\.dependentSchemas"),
        ({"if": {"type": "integer"}, "then": {"minimum": 1}}, r"json_schema\.if"),
    ],
)
def test_schema_keywords_the_grammar_would_not_enforce_are_invalid_argument(client, schema, match) -> None:
    with pytest.raises(CbdError, match=match) as info:
        client.generate(ASK, max_tokens=4, response_format={"type": "json_schema", "json_schema": json.dumps(schema)})
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_tool_parameters_nested_5000_deep_and_an_empty_regex_are_invalid_argument(client) -> None:
    deep = '{"type": "object", "properties": {"a": ' * 5000 + "{}" + "}}" * 5000
    with pytest.raises(CbdError, match="nested too deeply") as info:
        client.generate(ASK, max_tokens=4, tools=[{"name": "f", "parameters": deep}])
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(CbdError, match="matches nothing") as info:
        client.generate(ASK, max_tokens=4, response_format={"type": "regex", "regex": "[^\\s\\S]"})
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert client.stats().kv_blocks_used == 0

"""Chat Completions and Completions replies folded from Generate streams, without a daemon: what each
streamed chunk says (legacy logprobs' offsets across chunks; no chunk for a delta that says nothing)."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")
from cbd.gateway.replies import Reply  # noqa: E402
from cbd_client.v1 import cbd_pb2 as pb  # noqa: E402


def test_streamed_legacy_logprobs_offsets_continue_and_silent_chat_deltas_are_skipped() -> None:
    def delta(*tokens: str, index: int = 0, finish: int = 0) -> pb.GenerateResponse:
        lps = [pb.TokenLogprob(token_id=i, logprob=-0.5, token=t) for i, t in enumerate(tokens)]
        c = pb.CandidateDelta(index=index, text="".join(tokens), token_ids=list(range(len(tokens))), logprobs=lps,
                              finish_reason=finish)  # fmt: skip
        return pb.GenerateResponse(candidates=[c])

    streamed = Reply("completion", "r", 0, "m", 1, 1)
    chunks = [
        c for d in (delta(" a"), delta(" canvas", " of", finish=pb.FINISH_REASON_LENGTH)) for c in streamed.add(d)
    ]
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == [0, 2, 9] == streamed.whole()["choices"][0]["logprobs"]["text_offset"]
    chat = Reply("chat", "r", 0, "m", 1, None)
    silent = pb.GenerateResponse(candidates=[pb.CandidateDelta(index=0, token_ids=[7])])  # a held-back token
    assert len(chat.add(silent)) == 1  # the first chunk still says the role
    assert chat.add(silent) == []  # nothing to say: no chunk
    done = chat.add(pb.GenerateResponse(candidates=[pb.CandidateDelta(index=0, finish_reason=pb.FINISH_REASON_STOP)]))
    assert [c["choices"][0]["finish_reason"] for c in done] == ["stop"]

"""The frontend's half of detokenisation: the text of candidates the engine process did not detokenise.

The engine process detokenises only candidates with stop strings (their text decides when they stop);
the deltas of every other candidate arrive with text "" and get their text here, in the frontend, so
the engine loop spends nothing on it. The rule is the engine's own (OutputProcessor.on_token without
stop strings): every token adds its text, except the token that ended the candidate with reason STOP
(an end-of-sequence or stop token, or the token that completed its grammar), which adds none.
"""

from __future__ import annotations

from typing import Any

from cbd.engine.detokenizer import IncrementalDetokenizer
from cbd.engine.outputs import RequestOutput
from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sequence import FinishReason


class RequestText:
    """Fills in the text of one request's outputs (None when the engine process makes all of it)."""

    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip = params.skip_special_tokens
        self._candidates: dict[int, IncrementalDetokenizer] = {}

    @classmethod
    def for_request(cls, tokenizer: Any | None, params: SamplingParams) -> RequestText | None:
        if tokenizer is None or params.stop:
            return None
        return cls(tokenizer, params)

    def fill(self, output: RequestOutput) -> None:
        for delta in output.candidates:
            if not delta.token_ids:
                continue
            detok = self._candidates.get(delta.index)
            if detok is None:
                detok = self._candidates[delta.index] = IncrementalDetokenizer(self._tokenizer, self._skip)
            ids = delta.token_ids
            if delta.finish_reason is FinishReason.STOP:
                ids = ids[:-1]  # the token that stopped it has no text
            delta.text = detok.push(ids[0]) if len(ids) == 1 else "".join([detok.push(t) for t in ids])

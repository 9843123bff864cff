"""The Cbd servicer: validate and convert, delegate to the engine, stream results back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from cbd.engine.engine import Engine
from cbd.engine.outputs import RequestOutput
from cbd.engine.sampling_params import MAX_CANDIDATES, MAX_LOGPROBS, MAX_STOP_STRINGS
from cbd.errors import EngineStopped, Unimplemented
from cbd.server import convert, status
from cbd.server.metrics import Metrics
from cbd.server.prompts import PromptEncoder
from cbd_client.v1 import cbd_pb2 as pb
from cbd_client.v1.cbd_pb2_grpc import CbdServicer as _Base


class CbdService(_Base):
    def __init__(self, metrics: Metrics | None = None) -> None:
        self.engine: Engine | None = None  # set once the model is loaded and warm
        self.prompts = PromptEncoder(None)
        self.started_at = time.monotonic()
        self.metrics = metrics or Metrics()
        self.metrics.watch_engine(
            lambda: self.engine.stats() if self.engine else None,
            lambda: self.engine.num_live_requests if self.engine else 0,
        )

    def attach(self, engine: Engine) -> None:
        self.prompts = PromptEncoder(engine.loaded.tokenizer)
        self.engine = engine

    def detach(self) -> None:
        self.engine = None

    def _engine(self) -> Engine:
        if self.engine is None:
            raise EngineStopped("the daemon is warming up or shutting down; retry shortly")
        return self.engine

    @status.streaming
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:  # noqa: N802
        engine = self._engine()
        if request.session_id:
            raise Unimplemented("sessions (session_id) are not implemented in this version")
        params = convert.sampling_params(request)
        prompt = self.prompts.encode(request)
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        arrived = time.monotonic()
        request_id = engine.submit(  # makes an id when the caller sent none
            prompt, params, request.request_id or None, lambda out: loop.call_soon_threadsafe(outputs.put_nowait, out)
        )
        output: RequestOutput | None = None
        waiting_first_token = True
        try:
            while output is None or not output.finished:
                output = await outputs.get()
                elapsed = time.monotonic() - arrived
                if waiting_first_token and any(d.token_ids for d in output.candidates):
                    self.metrics.first_token.observe(elapsed)
                    waiting_first_token = False
                self.metrics.observe(output, elapsed)
                yield convert.response(output)
        finally:
            if output is None or not output.finished:  # cancelled, deadline passed, or the client went away
                engine.abort(request_id)
                self.metrics.cancelled(time.monotonic() - arrived)

    @status.unary
    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:  # noqa: N802
        self._engine()
        ids = self.prompts.encode(request)
        return pb.TokenizeResponse(token_ids=ids, count=len(ids))

    @status.unary
    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:  # noqa: N802
        engine = self._engine()
        loaded, config, core = engine.loaded, engine.config, engine.core
        return pb.ModelInfo(
            model=loaded.name,
            architecture=loaded.spec.model_type,
            context_length=core.max_model_len,
            vocab_size=loaded.spec.vocab_size,
            dtype=str(loaded.model.embed_tokens.weight.dtype).removeprefix("torch."),
            device=str(loaded.model.embed_tokens.weight.device),
            block_size=config.block_size,
            num_kv_blocks=core.block_manager.num_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_n=MAX_CANDIDATES,
            max_logprobs=MAX_LOGPROBS,
            max_stop_strings=MAX_STOP_STRINGS,
            max_queued_requests=config.max_queued_requests,
            eos_token_ids=loaded.eos_token_ids,
            has_chat_template=self.prompts.has_chat_template,
        )

    @status.unary
    async def GetStats(self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext) -> pb.Stats:  # noqa: N802
        engine = self._engine()
        s = engine.stats()
        return pb.Stats(
            running=s.num_running,
            waiting=s.num_waiting,
            live_requests=engine.num_live_requests,
            kv_blocks_total=s.num_blocks,
            kv_blocks_used=s.num_blocks_used,
            kv_blocks_free=s.num_blocks_free,
            kv_blocks_cached=s.num_blocks_cached,
            uptime_seconds=time.monotonic() - self.started_at,
            num_preemptions=s.num_preemptions,
            num_steps=s.num_steps,
            generated_tokens=s.num_generated_tokens,
        )

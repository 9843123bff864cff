"""A turn of a session from a Generate call: render or tokenize its input, queue it, wait until queued.

A chat turn also opens a turn of the session's chat log (server/chats.py) and settles it from the
engine's answers: refused, or the turn's outputs. `accepted` waits for the engine to take a turn without
leaking it when the caller gives up meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any

from cbd.engine import api
from cbd.engine.outputs import RequestOutput
from cbd.engine.sampling_params import SamplingParams
from cbd.engine.sessions.records import TurnInput
from cbd.errors import InvalidRequest
from cbd.ipc.remote import RemoteEngine
from cbd.server.chats import ChatLogs
from cbd.server.prompts import PromptEncoder
from cbd.server.session_messages import retention
from cbd.server.tool_calls import Tool
from cbd_client.v1 import cbd_pb2 as pb

# Runs a prompt's tokenizing or rendering work: (client text size, work, *args) -> its result.
PromptWork = Callable[..., Awaitable[Any]]


async def submit_turn(
    engine: RemoteEngine, prompts: PromptEncoder, chats: ChatLogs, prompt_work: PromptWork,
    request: pb.GenerateRequest, sid: str, request_id: str | None, params: SamplingParams,
    deliver: Callable[[RequestOutput], None], tools: list[Tool], size: int,
) -> str:  # fmt: skip
    """Queue a turn of the session whose engine key is `sid`; `deliver` is called on this event loop
    with each output. size: the turn's client text in characters."""
    parent = request.parent_candidate if request.HasField("parent_candidate") else None
    idle = request.expected_idle_ms / 1000 if request.HasField("expected_idle_ms") else None
    keep = retention(request.retention)
    loop = asyncio.get_running_loop()
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidRequest("a turn needs an input: set one of text, chat or tokens")
    if kind != "chat" and request.whole_conversation:
        raise InvalidRequest("whole_conversation needs chat input")
    if kind == "chat" and request.chat.continue_final_message:
        raise InvalidRequest("continue_final_message is for calls without a session_id (a turn's reply is a new "
                             "message of the session)")  # fmt: skip
    if kind != "chat":
        tokens = await prompt_work(size, prompts.continuation, request, kind)
        turn = TurnInput(tokens, False, parent, idle, keep)
        future = engine.submit_turn(sid, turn, params, request_id=request_id, on_output=deliver)
        return await accepted(engine, future)
    # A chat turn: the whole conversation is rendered (its common prefix with the history keeps its
    # KV). The log takes no other turn from begin_turn until this one has ended, and the messages a
    # turn renders never change, so the history read cannot be stale even when rendering awaits the
    # prompt threads (a close or expiry meanwhile: the engine refuses the turn, which settles the log).
    new_messages = prompts.messages(request.chat)
    whole = request.whole_conversation
    if sid not in chats.logs:  # a session restored or taken over since: its transcript is its note
        chats.restore(await asyncio.wrap_future(engine.ask(api.SessionNote(sid))))
    chat = chats.begin_turn(sid, parent, new_messages, params.n, whole)
    try:
        size += 0 if whole else sum(len(m.get("content") or "") for m in chat.base)
        tokens = await prompt_work(size, prompts.render, chat.messages, True, tools)

        def on_chat_output(out: RequestOutput) -> None:  # on the event loop, whether or not anyone listens
            chats.on_output(sid, chat, out)
            deliver(out)

        future = engine.submit_turn(
            sid,
            TurnInput(tokens, True, parent, idle, keep, extends=whole),
            params,
            request_id=request_id,
            on_output=on_chat_output,
        )
    except BaseException:
        chats.refused(sid, chat)
        raise

    def settled(f: Future[str]) -> None:  # on this event loop
        if f.exception() is not None:  # refused; a turn that ran settles the log through its outputs
            loop.call_soon_threadsafe(chats.refused, sid, chat)

    future.add_done_callback(settled)
    return await accepted(engine, future)


async def accepted(engine: RemoteEngine, future: Future[str]) -> str:
    """The request id of a queued turn. The engine answers whether or not this caller still waits: a caller
    that gives up first gets the turn aborted once accepted (its ABORT output settles what the turn
    changed), or nothing if it was refused."""
    waiting = asyncio.wrap_future(future)
    waiting.add_done_callback(lambda w: w.cancelled() or w.exception())  # read here if nobody waits any more
    try:
        return await asyncio.shield(waiting)
    except asyncio.CancelledError:
        future.add_done_callback(
            lambda f: engine.abort(f.result()) if not f.cancelled() and f.exception() is None else None
        )
        raise

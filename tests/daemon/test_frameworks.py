"""Agent frameworks, unchanged, against a real `cbd openai` gateway and daemon (the default model): the
OpenAI Agents SDK (its default Responses model), LangChain, pydantic-ai and instructor, each pointed at
the gateway by base URL and key.

The model is tiny, so every case decodes greedily and bounds the loop with the framework's own knobs. A
tool returns a number the model cannot guess (SECRET); the assertions are properties of correct serving:
the call came back well formed, the framework ran it, its output reached the gateway in the next request
and that request was answered; structured output validates against its schema.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import agents
import httpx
import instructor
import openai
import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from pydantic_ai import Agent, NativeOutput, RunContext
from pydantic_ai.messages import ModelRequest, ModelResponse, ToolReturnPart
from pydantic_ai.models import openai as pydantic_ai_openai
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings
from pydantic_ai.tools import ToolDefinition
from pydantic_ai.usage import UsageLimits

from daemon_process import DaemonProcess
from gateway_stack import TOKEN, Stack, stack

pytestmark = pytest.mark.slow
SECRET = 48213
QUESTION = "What is the secret number?"
INSTRUCTIONS = "Use the tool to answer."


def get_secret_number() -> int:
    """Returns the secret number."""
    return SECRET


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


class Secret(BaseModel):
    number: int


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, tenant_daemon: DaemonProcess) -> Iterator[Stack]:
    yield from stack(tmp_path_factory.mktemp("frameworks"), tenant_daemon)


def stored_input(gw: Stack, response_id: str) -> list[dict[str, Any]]:
    """The input items the gateway stored for a response: what the framework really sent."""
    got = httpx.get(f"{gw.url}/v1/responses/{response_id}/input_items", params={"order": "asc", "limit": 100},
                    headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)  # fmt: skip
    assert got.status_code == 200, got.text
    return got.json()["data"]


# --- OpenAI Agents SDK: its default model class, OpenAIResponsesModel, over /v1/responses ---------------


def run_agents(gw: Stack, main: Callable[[], Awaitable[Any]]) -> Any:
    """main() run with the SDK's default client pointed at the gateway, and that client closed in its loop."""

    async def run() -> Any:
        async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TOKEN, max_retries=0) as client:
            agents.set_default_openai_client(client, use_for_tracing=False)
            return await main()

    agents.set_tracing_disabled(True)
    return asyncio.run(run())


def secret_agent(output_type: type | None = None) -> Any:
    used: list[int] = []

    def once() -> int:
        used.append(SECRET)
        return get_secret_number()

    # The first turn names the tool (tool_choice: one call, not a list of them; a tiny model given
    # "required" repeats the call until max_output_tokens). reset_tool_choice (the SDK's default) drops the
    # choice once the tool ran. With an output_type the tool is offered until it has answered, so the next
    # turn can only answer in the schema.
    secret = agents.function_tool(once, name_override="get_secret_number", description_override=get_secret_number.__doc__,
                                  is_enabled=(lambda ctx, agent: not used) if output_type else True)  # fmt: skip
    settings = agents.ModelSettings(temperature=0, max_tokens=60, tool_choice="get_secret_number")
    return agents.Agent(name="assistant", instructions=INSTRUCTIONS, tools=[secret], model_settings=settings,
                        output_type=output_type, reset_tool_choice=True)  # fmt: skip


def assert_tool_round_trip(gw: Stack, result: Any) -> None:
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    assert result.new_items[0].raw_item.name == "get_secret_number"
    assert result.new_items[1].output == SECRET
    ids = [r.response_id for r in result.raw_responses]
    assert len(ids) == 2 and all(i.startswith("resp_") for i in ids)  # both turns went to /v1/responses
    sent = stored_input(gw, ids[1])
    outputs = [item for item in sent if item["type"] == "function_call_output"]
    assert [o["output"] for o in outputs] == [str(SECRET)]
    assert outputs[0]["call_id"] == result.new_items[0].raw_item.call_id


def test_agents_sdk_tool_round_trip(gw: Stack) -> None:
    result = run_agents(gw, lambda: agents.Runner.run(secret_agent(), QUESTION, max_turns=3))
    assert_tool_round_trip(gw, result)
    assert isinstance(result.final_output, str) and result.final_output.strip()


def test_agents_sdk_output_type_with_tools(gw: Stack) -> None:
    result = run_agents(gw, lambda: agents.Runner.run(secret_agent(Secret), QUESTION, max_turns=3))
    assert_tool_round_trip(gw, result)
    assert isinstance(result.final_output, Secret)


def test_agents_sdk_streamed_run(gw: Stack) -> None:
    async def run() -> tuple[Any, list[Any]]:
        streamed = agents.Runner.run_streamed(secret_agent(), QUESTION, max_turns=3)
        return streamed, [event async for event in streamed.stream_events()]

    result, events = run_agents(gw, run)
    assert_tool_round_trip(gw, result)
    raw = [e.data for e in events if e.type == "raw_response_event"]
    deltas = "".join(d.delta for d in raw if d.type == "response.output_text.delta")
    assert deltas and deltas == result.final_output
    named = [e.name for e in events if e.type == "run_item_stream_event"]
    assert named == ["tool_called", "tool_output", "message_output_created"]
    assert [d.type for d in raw].count("response.completed") == 2


# --- LangChain (langchain-openai) --------------------------------------------------------------------------


def chat_openai(gw: Stack, **kwargs: Any) -> Any:
    return ChatOpenAI(base_url=f"{gw.url}/v1", api_key=TOKEN, model="cbd", temperature=0, max_tokens=60,
                      max_retries=0, **kwargs)  # fmt: skip


def langchain_round_trip(gw: Stack, **kwargs: Any) -> Any:
    secret = tool(get_secret_number)
    llm = chat_openai(gw, **kwargs)
    messages: list[Any] = [HumanMessage(QUESTION)]
    asked = llm.bind_tools([secret], tool_choice="get_secret_number").invoke(messages)
    assert [(c["name"], c["args"]) for c in asked.tool_calls] == [("get_secret_number", {})]
    messages += [asked, ToolMessage(str(secret.invoke({})), tool_call_id=asked.tool_calls[0]["id"])]
    final = llm.bind_tools([secret]).invoke(messages)  # the result sent back; the model may answer freely
    assert not final.tool_calls and final.text.strip()
    return final


def test_langchain_bind_tools_round_trip(gw: Stack) -> None:
    langchain_round_trip(gw)


def test_langchain_responses_api_round_trip(gw: Stack) -> None:
    final = langchain_round_trip(gw, use_responses_api=True)
    response_id = final.response_metadata["id"]
    sent = stored_input(gw, response_id)
    assert [o["output"] for o in sent if o["type"] == "function_call_output"] == [str(SECRET)]


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output_validates(gw: Stack, method: str) -> None:
    city = chat_openai(gw).with_structured_output(City, method=method).invoke("Name a city in France.")
    assert isinstance(city, City) and city.name.strip()


def test_langchain_structured_output_json_mode(gw: Stack) -> None:
    # json_mode constrains to a JSON object, not to the schema: the object is the property served.
    out = (
        chat_openai(gw)
        .with_structured_output(City, method="json_mode", include_raw=True)
        .invoke("Name a city in France; answer in JSON with the fields name and country.")
    )
    assert isinstance(json.loads(out["raw"].content), dict)


# --- pydantic-ai (slim, openai) ----------------------------------------------------------------------------


def pydantic_agent(gw: Stack, model_class: str, output_type: Any) -> Any:
    provider = OpenAIProvider(openai_client=openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=TOKEN, max_retries=0))
    model = getattr(pydantic_ai_openai, model_class)("cbd", provider=provider)
    agent = Agent(model, output_type=output_type, instructions=INSTRUCTIONS,
                  model_settings=ModelSettings(temperature=0, max_tokens=60), retries=1)  # fmt: skip

    # Offered on the first step only (pydantic-ai's `prepare` knob): tool output mode forces some tool
    # call every step, and a tiny model keeps choosing this one; then only the output can be called.
    async def first_step_only(ctx: RunContext[None], tool_def: ToolDefinition) -> ToolDefinition | None:
        return tool_def if ctx.run_step <= 1 else None

    agent.tool_plain(prepare=first_step_only)(get_secret_number)
    return agent


def assert_pydantic_round_trip(result: Any) -> None:
    messages = result.all_messages()
    returned = [i for i, m in enumerate(messages) if isinstance(m, ModelRequest)
                and any(isinstance(p, ToolReturnPart) and p.content == SECRET for p in m.parts)]  # fmt: skip
    assert returned, "the tool's result was never sent back"
    assert any(isinstance(m, ModelResponse) for m in messages[returned[0] + 1 :])  # and answered
    assert isinstance(result.output, Secret)


@pytest.mark.parametrize("model_class", ["OpenAIChatModel", "OpenAIResponsesModel"])
def test_pydantic_ai_output_type_with_tools(gw: Stack, model_class: str) -> None:
    agent = pydantic_agent(gw, model_class, Secret)
    assert_pydantic_round_trip(agent.run_sync(QUESTION, usage_limits=UsageLimits(request_limit=4)))


def test_pydantic_ai_native_output_with_tools(gw: Stack) -> None:
    agent = pydantic_agent(gw, "OpenAIChatModel", NativeOutput(Secret))
    assert_pydantic_round_trip(agent.run_sync(QUESTION, usage_limits=UsageLimits(request_limit=4)))


# --- instructor --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA])
def test_instructor_modes(gw: Stack, mode: instructor.Mode) -> None:
    client = instructor.from_openai(openai.OpenAI(base_url=f"{gw.url}/v1", api_key=TOKEN, max_retries=0), mode=mode)
    city = client.chat.completions.create(model="cbd", response_model=City, max_retries=0, temperature=0,
                                          max_tokens=60, messages=[{"role": "user", "content": "Name a city in France."}])  # fmt: skip
    assert isinstance(city, City) and city.name.strip()

"""The openai-agents SDK (issue 48) against `pdserve serve` (PD + MTP): an agent on the SDK's
default model class, the Responses one, with one function tool and an output type, run end to end,
whole and streamed. The first turn must call the tool (tool_choice required: the grammar makes the
bundled model's call valid); the SDK then resets tool_choice, sends the call and its output back
as input items, and the model's JSON (text.format json_schema) is the final output."""
from __future__ import annotations

import asyncio
from typing import Literal

import openai
import pytest
from pydantic import BaseModel
from structured_harness import MODEL


class Report(BaseModel):
    """The agent's output type: its final turn is JSON under `text.format` json_schema, so it ends
    (the bundled model left to itself may write until max_tokens, which the SDK takes as failure)."""

    weather: Literal["sunny", "rainy"]
    city: Literal["Paris", "Rome", "Oslo"]


@pytest.fixture
def agent_setup(servers):
    agents = pytest.importorskip("agents")  # in the test extras; absent only in a bare install
    client = openai.AsyncOpenAI(base_url=servers.served["pd_mtp"].url + "/v1", api_key="unused", max_retries=0,
                                timeout=120)
    agents.set_default_openai_client(client, use_for_tracing=False)
    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=200,
                                    temperature=0.0)
    agent = agents.Agent(name="weather", instructions="Answer with the weather.", model=MODEL,
                         tools=[get_weather], model_settings=settings, output_type=Report)
    return agents, agent, calls


def _check(agents, result, calls: list[str]) -> None:
    assert len(calls) == 1 and calls[0] in ("Paris", "Rome", "Oslo")
    kinds = [type(item) for item in result.new_items]
    assert kinds[:2] == [agents.ToolCallItem, agents.ToolCallOutputItem], kinds
    assert result.new_items[1].output == f"sunny in {calls[0]}"
    assert isinstance(result.final_output, Report)
    assert len(result.raw_responses) == 2
    assert result.raw_responses[1].usage.input_tokens > result.raw_responses[0].usage.input_tokens


def test_agent_with_a_function_tool(agent_setup):
    agents, agent, calls = agent_setup
    result = asyncio.run(asyncio.wait_for(agents.Runner.run(agent, "Weather in Paris?", max_turns=3), 240))
    _check(agents, result, calls)


def test_agent_streamed(agent_setup):
    agents, agent, calls = agent_setup

    async def run():
        result = agents.Runner.run_streamed(agent, "Weather in Rome?", max_turns=3)
        kinds = [event.type async for event in result.stream_events()]
        return result, kinds

    result, kinds = asyncio.run(asyncio.wait_for(run(), 240))
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    _check(agents, result, calls)

"""POST /v1/responses (issue 48 item 1) with the official `openai` client, PD+MTP and colocated
(`pdserve serve` on the bundled model, tests/structured_harness.py): text as the chat path gives
it, the typed event stream in OpenAI's order, function tools (forced, named, auto), `text.format`
json_schema, conversation items, and the 400s of a stateless server. The bundled model writes
gibberish, so structure comes from grammars (tool_choice required / json_schema)."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from structured_harness import MODEL

CONFIGS = ["pd_mtp", "colocated"]
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
        "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
                                                                              "maximum": 7}}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Forecast for a city.", "parameters": CITY},
         {"type": "function", "name": "get_time", "description": "Time in a zone.",
          "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                         "additionalProperties": False}}]
PROMPT = "What is the weather in Paris for the next two days?"
MESSAGE_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                  "response.output_text.done", "response.content_part.done", "response.output_item.done"]
CALL_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done"]


def _squeeze(kinds: list[str]) -> list[str]:
    """Event types with runs of one type as one (deltas come in any number)."""
    return [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]


def _check_stream(events) -> tuple[list[str], object]:
    """The envelope every stream has: created, in_progress, ..., a final event holding the response;
    sequence numbers 0, 1, 2, ...; returns the event types between and the final response."""
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    return kinds[2:-1], events[-1].response


@pytest.mark.parametrize("config", CONFIGS)
def test_text_equals_the_chat_path_streamed_or_not(servers, config):
    client = servers.client(config)
    kwargs = dict(model=MODEL, max_output_tokens=24, temperature=0.0)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=24, temperature=0.0)
    whole = client.responses.create(input=PROMPT, **kwargs)
    assert whole.object == "response" and whole.model == MODEL
    assert whole.output_text == chat.choices[0].message.content
    assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert [item.type for item in whole.output] == ["message"]
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.usage.total_tokens == chat.usage.total_tokens

    events = list(client.responses.create(input=PROMPT, stream=True, **kwargs))
    kinds, final = _check_stream(events)
    assert _squeeze(kinds) == MESSAGE_EVENTS
    assert kinds.count("response.output_text.delta") > 1
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas == done.text == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens and final.status == whole.status


def _call_of(response) -> tuple[str, str]:
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].call_id.startswith("call_") and calls[0].status == "completed", \
        response.output
    jsonschema.validate(json.loads(calls[0].arguments), {t["name"]: t["parameters"] for t in TOOLS}[calls[0].name])
    return calls[0].name, calls[0].arguments


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_time"}])
def test_forced_function_call_streamed_or_not(servers, config, tool_choice):
    client = servers.client(config)
    kwargs = dict(model=MODEL, input=PROMPT, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
                  max_output_tokens=120, temperature=1.0, extra_body={"seed": 7})
    whole = client.responses.create(**kwargs)
    assert whole.status == "completed" and [item.type for item in whole.output] == ["function_call"]
    name, arguments = _call_of(whole)
    if isinstance(tool_choice, dict):
        assert name == "get_time"

    events = list(client.responses.create(stream=True, **kwargs))
    kinds, final = _check_stream(events)
    assert _squeeze(kinds) == CALL_EVENTS
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(fragments) > 1, "the arguments came in one piece"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert "".join(fragments) == done.arguments == arguments
    assert _call_of(final) == (name, arguments)
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.name == name and added.item.arguments == "" and added.item.status == "in_progress"


@pytest.mark.parametrize("config", CONFIGS)
def test_auto_renders_the_tools_and_answers(servers, config):
    """auto: the tools are in the prompt (the template renders them) and the answer is what the
    model wrote: text here, since the bundled model never writes a call unprompted."""
    client = servers.client(config)
    kwargs = dict(model=MODEL, input=PROMPT, max_output_tokens=16, temperature=0.0)
    auto = client.responses.create(tools=TOOLS, tool_choice="auto", **kwargs)
    plain = client.responses.create(**kwargs)
    assert auto.usage.input_tokens > plain.usage.input_tokens + 50
    assert auto.tool_choice == "auto" and [t.name for t in auto.tools] == ["get_weather", "get_time"]
    assert all(item.type in ("message", "function_call") for item in auto.output)
    assert auto.output_text == "".join(c.text for item in auto.output if item.type == "message"
                                       for c in item.content)


@pytest.mark.parametrize("config", CONFIGS)
def test_text_format_json_schema(servers, config):
    client = servers.client(config)
    text = {"format": {"type": "json_schema", "name": "forecast", "schema": CITY, "strict": True}}
    for i in range(3):
        r = client.responses.create(model=MODEL, input=PROMPT, text=text, max_output_tokens=60, temperature=1.0,
                                    extra_body={"seed": i})
        assert r.status == "completed", r
        jsonschema.validate(json.loads(r.output_text), CITY)
        assert r.text.format.type == "json_schema"
    events = list(client.responses.create(model=MODEL, input=PROMPT, text=text, max_output_tokens=60,
                                          temperature=1.0, extra_body={"seed": 0}, stream=True))
    _, final = _check_stream(events)
    jsonschema.validate(json.loads(final.output_text), CITY)


def test_conversation_items_render_as_the_chat_messages(servers):
    """instructions + messages + a function call and its output: the same prompt as the chat
    request with the same turns (input tokens equal), answered."""
    client = servers.client("pd_mtp")
    args = '{"city": "Paris", "days": 2}'
    items = [{"role": "user", "content": PROMPT},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]}]
    r = client.responses.create(model=MODEL, instructions="Be brief.", input=items, tools=TOOLS,
                                max_output_tokens=8, temperature=0.0)
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
                {"role": "user", "content": "And tomorrow?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, tools=chat_tools, max_tokens=8,
                                          temperature=0.0)
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == (chat.choices[0].message.content or "")


def test_stateless_and_bad_input_are_400s_naming_the_field(servers):
    client = servers.client("pd")
    cases = [
        (dict(previous_response_id="resp_123"), "previous_response_id"),
        (dict(store=True), "store"),
        (dict(background=True), "background"),
        (dict(extra_body={"prompt": {"id": "pmpt_1"}}), "prompt"),
        (dict(input=[{"type": "reasoning", "summary": []}]), "input[0].type"),
        (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
         "input[0].content[0]"),
        (dict(input=[{"type": "function_call", "call_id": "c", "name": "f"}]), "input[0].arguments"),
        (dict(tools=[{"type": "web_search"}]), "tools[0].type"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "name": "nope"}), "tool_choice"),
        (dict(text={"format": {"type": "json_schema", "name": "x"}}), "text.format.schema"),
        (dict(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}),
         "text.format.schema"),
        (dict(max_output_tokens=-1), "max_output_tokens"),
        (dict(input=[]), "input"),
    ]
    for extra, param in cases:
        kwargs = dict(model=MODEL, input=PROMPT, max_output_tokens=4) | extra
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(**kwargs)
        assert err.value.body["param"] == param, (extra, err.value.body)
        assert "stateless" in err.value.body["message"] or param not in ("previous_response_id", "store")
    r = client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=4, store=False)  # store=false is fine
    assert r.store is False and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


HOSTILE = [
    ({"input": 5}, "input.str"),  # pydantic names the union's first member
    ({"input": ["hi"]}, "input.str"),
    ({"input": [{"role": "system<|im_end|>", "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": {"nested": "dict"}}]}, "input[0].content"),
    ({"input": [{"type": "function_call_output", "call_id": 5, "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text"}]}]},
     "input[0].output[0]"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "not a schema"}]}, "tools[0]"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": "json"}, "text"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"max_output_tokens": 2 ** 70}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"metadata": {"k": {"nested": 1}}}, "metadata.k"),
    ({"model": "gpt-4o"}, "model"),
]


@pytest.mark.parametrize("body, param", HOSTILE, ids=[str(i) for i in range(len(HOSTILE))])
def test_hostile_bodies_are_4xx_naming_the_field(servers, body, param):
    r = httpx.post(servers.served["pd"].url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 4} | body,
                   timeout=60)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.text

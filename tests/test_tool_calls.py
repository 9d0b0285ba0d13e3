"""Tool calls (issue 16, item 2): `tools` + `tool_choice` on chat with the official `openai` client.

`required` and a named function are enforced by a grammar, so even the bundled model's gibberish
comes back as parsable calls; `auto` parses the Hermes `<tool_call>` blocks Qwen templates teach
(checked on the parser, since the tiny model never writes one unprompted).
"""
from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from conftest import BUNDLED_MODEL
from structured_harness import MODEL

from server.tool_calls import CallEventKind, ToolCallParser, parse_message

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 7}}}
CLOCK = {"type": "object", "additionalProperties": False, "required": ["zone"],
         "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}, "format": {"type": "string", "maxLength": 6}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast for a city.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a zone.",
                                      "parameters": CLOCK}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Paris, and what time is it?"}]


def _check_calls(message, allowed: set[str]) -> list[tuple[str, dict]]:
    assert message.tool_calls, message
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, PARAMS[call.function.name])
        out.append((call.function.name, args))
    return out


@pytest.mark.parametrize("config", ["pd_mtp", "colocated"])
def test_required_returns_parsable_tool_calls(servers, config):
    client = servers.client(config)

    def ask(i: int):
        return client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=i)

    with ThreadPoolExecutor(4) as pool:
        for r in pool.map(ask, range(8)):
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content is None
            assert len(_check_calls(choice.message, set(PARAMS))) == 1


def test_named_function_is_the_one_called(servers):
    client = servers.client("pd_mtp")
    for i in range(4):
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=120, seed=i,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
        assert r.choices[0].finish_reason == "tool_calls"
        assert [name for name, _ in _check_calls(r.choices[0].message, {"get_time"})] == ["get_time"]


def test_parallel_required_calls_are_each_valid(servers):
    """parallel_tool_calls (the default): one or more blocks; each that closes is a valid call."""
    client = servers.client("pd")
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                       max_tokens=200, temperature=1.0, seed=3)
    choice = r.choices[0]
    _check_calls(choice.message, set(PARAMS))
    assert choice.finish_reason in ("tool_calls", "length")


def _reassemble(stream) -> tuple[dict[int, dict], str, str | None, int]:
    """What the OpenAI SDK's stream helpers do: join every tool-call delta by index; also counts
    the deltas that carried a non-empty arguments fragment."""
    calls: dict[int, dict] = {}
    content, finish, fragments = "", None, 0
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = d.id or entry["id"]
                if d.function is not None:
                    entry["name"] += d.function.name or ""
                    entry["arguments"] += d.function.arguments or ""
                    fragments += bool(d.function.arguments)
            finish = c.finish_reason or finish
    return calls, content, finish, fragments


@pytest.mark.parametrize("config", ["pd_mtp", "colocated"])
def test_forced_call_cut_by_max_tokens_has_no_markup(servers, config):
    """tool_choice required, max_tokens too small for the call: finish_reason length, no
    `<tool_call>` markup in content, streamed or not; the call keeps the arguments written so far."""
    client = servers.client(config)
    kwargs = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  temperature=1.0, seed=5)
    full = client.chat.completions.create(max_tokens=160, **kwargs)
    assert full.choices[0].finish_reason == "tool_calls"
    n = full.usage.completion_tokens
    for max_tokens in (2, n // 2, n - 2):  # in the head, in the arguments, at the closing brace
        whole = client.chat.completions.create(max_tokens=max_tokens, **kwargs).choices[0]
        assert whole.finish_reason == "length" and whole.message.content is None, whole
        calls, content, finish, _ = _reassemble(client.chat.completions.create(stream=True, max_tokens=max_tokens,
                                                                                **kwargs))
        assert finish == "length" and content == ""
        assert [(c["name"], c["arguments"]) for c in calls.values()] == \
            [(t.function.name, t.function.arguments) for t in whole.message.tool_calls or []]
        for call in whole.message.tool_calls or []:
            assert "tool_call>" not in call.function.arguments
            assert full.choices[0].message.tool_calls[0].function.arguments.startswith(call.function.arguments)
    assert calls, "the latest cut should have left a call started"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_deltas_reassemble_to_the_non_streamed_call(servers, tool_choice):
    client = servers.client("pd_mtp")
    kwargs = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice=tool_choice, max_tokens=160,
                  temperature=1.0, seed=11)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls, content, finish, fragments = _reassemble(client.chat.completions.create(stream=True, **kwargs))
    assert fragments > 1, "the arguments came in one delta, not in fragments as OpenAI streams them"
    assert finish == whole.finish_reason == "tool_calls"
    assert content == (whole.message.content or "")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_auto_and_none_render_and_answer(servers):
    """auto renders the tools through the chat template (a longer prompt than none) and answers
    with content when the model writes no block; a tool-result turn renders too."""
    client = servers.client("colocated")
    kwargs = dict(model=MODEL, messages=USER, tools=TOOLS, max_tokens=24, temperature=0.0)
    auto = client.chat.completions.create(tool_choice="auto", **kwargs)
    none = client.chat.completions.create(tool_choice="none", **kwargs)
    assert auto.usage.prompt_tokens > none.usage.prompt_tokens + 50
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8, temperature=0.0)
    assert r.usage.prompt_tokens > auto.usage.prompt_tokens


def test_bundled_template_renders_tools_and_tool_turns():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(BUNDLED_MODEL))
    text = tok.apply_chat_template(USER + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]},
        {"role": "tool", "tool_call_id": "c", "content": "12:00"}], tools=TOOLS, tokenize=False,
        add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and "<tools>\n" + json.dumps(TOOLS[0]) in text
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call><|im_end|>' in text
    assert "<tool_response>\n12:00\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    # Without tools the template is the plain ChatML it always was.
    assert tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True) == \
        f"<|im_start|>user\n{USER[0]['content']}<|im_end|>\n<|im_start|>assistant\n"


def test_tool_errors_are_bad_requests(servers):
    client = servers.client("pd")
    cases = [
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools[0]"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
              tool_choice="required"), "tools"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, **extra)
        assert err.value.body["param"] == param, (extra, err.value.body)


# -- the auto-mode parser --------------------------------------------------------------------

QWEN_ANSWER = ('Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


def test_parser_finds_hermes_blocks():
    parsed = parse_message(QWEN_ANSWER, "stop")
    assert parsed.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Rome", "days": 2}), ("get_time", {"zone": "CET"})]
    assert parsed.finish_reason == "tool_calls"
    plain = parse_message("no calls <tool_ here", "stop")
    assert plain.content == "no calls <tool_ here" and not plain.tool_calls and plain.finish_reason == "stop"
    broken = parse_message("<tool_call>\n{not json}\n</tool_call>", "stop")
    assert broken.content == "<tool_call>\n{not json}\n</tool_call>" and not broken.tool_calls
    unfinished = parse_message('ok <tool_call>\n{"name": "get_time", "argu', "length")
    assert unfinished.content == 'ok <tool_call>\n{"name": "get_time", "argu' and unfinished.finish_reason == "length"


def test_parser_is_split_invariant():
    """Fed in any pieces (as a stream is), the parser gives what it gives for the whole text, and
    the streamed argument fragments of each call join to its arguments."""
    whole = parse_message(QWEN_ANSWER, "stop")
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(QWEN_ANSWER)), rng.randint(1, 30)))
        pieces = [QWEN_ANSWER[a:b] for a, b in zip([0, *cuts], [*cuts, len(QWEN_ANSWER)])]
        parser, content, events = ToolCallParser(), "", []
        for piece in pieces:
            text, new = parser.push(piece)
            content, events = content + text, events + new
        rest, new = parser.finish()
        content, events = content + rest, events + new
        assert content == whole.content
        assert [c.function for c in parser.calls] == [c.function for c in whole.tool_calls]
        streamed = ["".join(e.text for e in events if e.index == i and e.kind == CallEventKind.ARGUMENTS)
                    for i in range(len(parser.calls))]
        assert streamed == [c.function.arguments for c in whole.tool_calls]
        assert [e.kind for e in events if e.index == 0][0] == CallEventKind.STARTED
        assert [e.kind for e in events if e.index == 0][-1] == CallEventKind.DONE


def test_parser_streams_arguments_in_fragments():
    """The arguments stream as they are written, not in one piece when the block closes."""
    parser = ToolCallParser()
    _, started = parser.push('<tool_call>\n{"name": "get_weather", "arguments": {"city": ')
    assert [e.kind for e in started] == [CallEventKind.STARTED, CallEventKind.ARGUMENTS]
    assert started[0].call.function.name == "get_weather" and started[1].text == '{"city":'
    _, more = parser.push('"Rome", "days": 2}')
    assert [(e.kind, e.text) for e in more] == [(CallEventKind.ARGUMENTS, ' "Rome", "days": 2')]
    _, closing = parser.push("}\n</tool_call>")
    assert [(e.kind, e.text) for e in closing] == [(CallEventKind.ARGUMENTS, "}"), (CallEventKind.DONE, "")]
    assert parser.calls[0].function.arguments == '{"city": "Rome", "days": 2}'


def test_parser_cut_short_call_is_no_content():
    """A call max_tokens cut: forced, no markup is content, the call keeps what was written and
    the finish stays `length`; a forced block cut before its head gives no call and no content."""
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    for forced in (True, False):
        parsed = parse_message(cut, "length", forced=forced)
        assert parsed.content is None and parsed.finish_reason == "length"
        assert [(c.function.name, c.function.arguments) for c in parsed.tool_calls] == [("get_weather",
                                                                                           '{"city": "Pa')]
    for head in ('<tool_call>\n{"name": "get_w', "<tool_"):
        parsed = parse_message(head, "length", forced=True)
        assert parsed.content is None and not parsed.tool_calls and parsed.finish_reason == "length"
    assert parse_message("<tool_", "length").content == "<tool_"  # auto: it may have been text

"""Tool calling on /v1/chat/completions: `tools` + `tool_choice` in, `tool_calls` out.

The format is the Hermes one that Qwen2/Qwen3 chat templates teach their models:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- `tools` are rendered by the checkpoint's own chat template (`apply_chat_template(tools=...)`).
- `tool_choice="none"`: the tools are not rendered and nothing is parsed.
- `"auto"`: the model writes what it likes; `<tool_call>` blocks in its output become `tool_calls`.
- `"required"` / a named function: a grammar (an xgrammar structural tag) forces the output to be
  one or more such blocks (exactly one for a named function, or with `parallel_tool_calls=false`),
  each with a declared name and arguments that follow that tool's `parameters` schema.

One parser serves both answers: the non-streaming message is the streaming parser fed the whole
text at once, so streamed deltas reassemble to exactly the non-streamed call. A call's arguments
stream in fragments as they are written (as OpenAI streams them), and are the text the model
wrote, so the fragments join to the non-streamed arguments. A forced call that max_tokens cuts
short is a call with the arguments written so far and `finish_reason: "length"`, never markup
in `content`.
"""
from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictStr, ValidationError

from engine.types import FinishReason, GrammarKind, GrammarSpec
from server.errors import APIError
from server.response_bodies import FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOL_CALLS_FINISH = "tool_calls"


class ToolChoice(enum.StrEnum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"  # {"type": "function", "function": {"name": ...}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class FunctionDef(_Strict):
    name: StrictStr
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


@dataclass
class ToolPlan:
    """What a request asks of tools: what to render, what to enforce, whether to parse."""

    choice: ToolChoice
    tools: list[ToolDef] = field(default_factory=list)
    grammar: GrammarSpec | None = None

    @property
    def forced(self) -> bool:
        """The grammar allows only tool-call blocks."""
        return self.choice in (ToolChoice.REQUIRED, ToolChoice.NAMED)

    @property
    def parses(self) -> bool:
        return self.choice != ToolChoice.NONE and bool(self.tools)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template expects them (OpenAI's shape), or None to render none."""
        if not self.parses:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel: bool) -> ToolPlan:
    defs = _parse_tools(tools)
    choice, named = _parse_choice(tool_choice, defs)
    plan = ToolPlan(choice, defs)
    if choice in (ToolChoice.REQUIRED, ToolChoice.NAMED):
        chosen = [t for t in defs if named is None or t.function.name == named]
        one = choice == ToolChoice.NAMED or not parallel
        plan.grammar = _grammar(chosen, one)  # checked by the caller, off the event loop (as "tools")
    return plan


def _parse_tools(tools: list[Any] | None) -> list[ToolDef]:
    defs = []
    for i, raw in enumerate(tools or []):
        try:
            tool = ToolDef.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise APIError(400, f"tools[{i}]: {where}: {first['msg']}", param=f"tools[{i}]") from None
        if not tool.function.name:
            raise APIError(400, f"tools[{i}].function.name must not be empty", param=f"tools[{i}].function.name")
        defs.append(tool)
    names = [t.function.name for t in defs]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: function names must be unique", param="tools")
    return defs


def _parse_choice(tool_choice: Any, defs: list[ToolDef]) -> tuple[ToolChoice, str | None]:
    if tool_choice is None:
        return (ToolChoice.AUTO if defs else ToolChoice.NONE), None
    if isinstance(tool_choice, str) and tool_choice in ("none", "auto", "required"):
        choice = ToolChoice(tool_choice)
        if choice == ToolChoice.REQUIRED and not defs:
            raise APIError(400, "tool_choice: 'required' needs at least one tool in tools", param="tool_choice")
        return choice, None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not (isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(name, str)):
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    if name not in {t.function.name for t in defs}:
        raise APIError(400, f"tool_choice: function {name!r} is not one of the tools", param="tool_choice")
    return ToolChoice.NAMED, name


def _grammar(tools: list[ToolDef], exactly_one: bool) -> GrammarSpec:
    """Hermes blocks of the given tools, separated by a newline; at most one block if asked."""
    tags = [{
        "type": "tag",
        "begin": f'{OPEN}\n{{"name": {json.dumps(t.function.name, ensure_ascii=False)}, "arguments": ',
        # At most one space at any whitespace: a bounded schema then always ends (and json.dumps' style fits).
        "content": {"type": "json_schema", "json_schema": t.function.parameters or {"type": "object"},
                    "max_whitespace_cnt": 1},
        "end": f"}}\n{CLOSE}",
    } for t in tools]
    fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
           "stop_after_first": exactly_one}
    return GrammarSpec(GrammarKind.STRUCTURAL_TAG, json.dumps({"type": "structural_tag", "format": fmt},
                                                              ensure_ascii=False))


def _as_call(body: str) -> FunctionCall | None:
    """A block's JSON as a call, or None when it is not `{"name": str, "arguments": object}`."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        return FunctionCall(name=obj["name"], arguments=args)
    return FunctionCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))


def _new_call(name: str, arguments: str = "") -> ToolCall:
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=name, arguments=arguments))


# The head of a block up to its arguments, which then stream as they are written. It must be
# followed by the arguments' first character, so that where the head ends cannot depend on how
# the text was split into pieces.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')
# What may still turn out to be the block's closing brace (and the whitespace around it): held back.
_TAIL = re.compile(r"\s*(?:\}\s*)?$")


class CallEventKind(enum.StrEnum):
    STARTED = "started"      # id and name are known; arguments follow
    ARGUMENTS = "arguments"  # a fragment of the arguments' text
    DONE = "done"            # the block closed (complete) or the generation ended inside it (not complete)


@dataclass
class CallEvent:
    kind: CallEventKind
    index: int       # the call's position among this message's calls
    call: ToolCall   # arguments: as far as they have been streamed
    text: str = ""   # ARGUMENTS: the new fragment
    complete: bool = True  # DONE: False when the generation ended before the block closed


class ToolCallParser:
    """Splits generated text into content and tool calls, incrementally.

    Text outside blocks is content, except a tail that may be the start of `<tool_call>` (held
    back until it is known) and whitespace that only separates blocks (dropped). Once a block's
    head (`{"name": ..., "arguments": `) is in, the call starts and its arguments stream as they
    are written, as OpenAI streams them; a block without that head becomes a call when it closes,
    if its JSON is one, and content verbatim otherwise. A call the generation cut short keeps the
    arguments written so far (not complete). `forced` (tool_choice required or named: the grammar
    allows only blocks): nothing unfinished is ever content, so no markup reaches `content`.
    """

    def __init__(self, forced: bool = False) -> None:
        self.forced = forced
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._inside = False
        self._pending_ws = ""
        self._open: ToolCall | None = None  # the call whose block is being written
        self._args_at = 0   # where its arguments start in the block
        self._sent = 0      # characters of its arguments streamed

    def push(self, text: str) -> tuple[str, list[CallEvent]]:
        self._buf += text
        content, events = "", []
        while True:
            if self._inside:
                end = self._buf.find(CLOSE)
                body = self._buf[:end] if end >= 0 else self._buf[: len(self._buf) - _partial_prefix_len(self._buf,
                                                                                                           CLOSE)]
                events += self._stream_args(body)
                if end < 0:
                    break
                self._buf, self._inside = self._buf[end + len(CLOSE):], False
                closed, verbatim = self._close(body)
                events += closed
                content += self._content(verbatim)
                continue
            start = self._buf.find(OPEN)
            if start >= 0:
                content += self._content(self._buf[:start])
                self._buf, self._inside = self._buf[start + len(OPEN):], True
                continue
            keep = _partial_prefix_len(self._buf, OPEN)
            content += self._content(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            break
        return content, events

    def finish(self) -> tuple[str, list[CallEvent]]:
        """The generation ended: a call cut short is done (not complete); whatever else is held
        back is content, unless the output was forced to be calls."""
        rest, events = "", []
        if self._open is not None:
            events.append(CallEvent(CallEventKind.DONE, len(self.calls) - 1, self._open, complete=False))
            self._open = None
        elif not self.forced:
            rest = (OPEN if self._inside else "") + self._buf
        self._buf, self._inside = "", False
        return (self._content(rest) if rest else ""), events

    def _stream_args(self, body: str) -> list[CallEvent]:
        """Start the block's call once its head is in; stream its arguments but a possible closing brace."""
        events = []
        if self._open is None:
            head = _HEAD.match(body)
            if head is None:
                return []
            try:
                name = json.loads(head.group(1))
            except json.JSONDecodeError:
                return []
            self._open, self._args_at, self._sent = _new_call(name), head.end(), 0
            self.calls.append(self._open)
            events.append(CallEvent(CallEventKind.STARTED, len(self.calls) - 1, self._open))
        args = body[self._args_at:]
        upto = _TAIL.search(args).start()
        if upto > self._sent:
            fragment, self._sent = args[self._sent:upto], upto
            self._open.function.arguments += fragment
            events.append(CallEvent(CallEventKind.ARGUMENTS, len(self.calls) - 1, self._open, fragment))
        return events

    def _close(self, body: str) -> tuple[list[CallEvent], str]:
        """A block closed: its events, or the block as content when it is no call."""
        if self._open is not None:
            call, self._open = self._open, None
            return [CallEvent(CallEventKind.DONE, len(self.calls) - 1, call)], ""
        function = _as_call(body.strip())
        if function is None:
            return [], OPEN + body + CLOSE
        call = _new_call(function.name)
        self.calls.append(call)
        index = len(self.calls) - 1
        call.function.arguments = function.arguments
        return [CallEvent(CallEventKind.STARTED, index, call),
                CallEvent(CallEventKind.ARGUMENTS, index, call, function.arguments),
                CallEvent(CallEventKind.DONE, index, call)], ""

    def _content(self, text: str) -> str:
        text = self._pending_ws + text
        body = text.rstrip()
        self._pending_ws = text[len(body):]
        return body


def _partial_prefix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


@dataclass
class ParsedMessage:
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None


def finish_reason_for(calls: list[ToolCall], finish: str | None) -> str | None:
    """OpenAI's `tool_calls` when the model stopped after calling tools (a call cut short by
    max_tokens keeps `length`)."""
    return TOOL_CALLS_FINISH if calls and finish == FinishReason.STOP else finish


def parse_message(text: str, finish: str | None, forced: bool = False) -> ParsedMessage:
    parser = ToolCallParser(forced)
    content, _ = parser.push(text)
    content += parser.finish()[0]
    return ParsedMessage(content or None, parser.calls, finish_reason_for(parser.calls, finish))


def call_deltas(events: list[CallEvent]) -> list[ToolCallDelta]:
    """Chat stream deltas, as OpenAI sends them: a call's first delta has its id, type, name and
    empty arguments; the arguments follow in fragments (one delta per call per chunk)."""
    out: list[ToolCallDelta] = []
    for e in events:
        if e.kind == CallEventKind.DONE:
            continue
        if not out or out[-1].index != e.index:
            out.append(ToolCallDelta(index=e.index))
        delta = out[-1]
        if e.kind == CallEventKind.STARTED:
            delta.id, delta.type = e.call.id, "function"
            delta.function = FunctionCallDelta(name=e.call.function.name, arguments="")
        else:
            delta.function = delta.function or FunctionCallDelta(arguments="")
            delta.function.arguments = (delta.function.arguments or "") + e.text
    return out

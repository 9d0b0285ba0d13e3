"""The output of a Responses API request: its items (`message`, `function_call`) built from the
generated text as it comes, and the typed stream events that build them, in OpenAI's order.

One builder serves both answers: the non-streamed response is the builder fed the whole text at
once, so a stream's events reassemble to exactly the non-streamed output. Text is fed in pieces
that end at each `>` (where `<tool_call>` and `</tool_call>` end), so within a piece content
always precedes call events and the items come out in the order the model wrote them.
"""
from __future__ import annotations

import copy
import re
import uuid
from typing import Any

from server.tool_calls import CallEvent, CallEventKind, ToolCallParser

_PIECES = re.compile(r"[^>]*>|[^>]+")


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str = "") -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class OutputBuilder:
    """`push` the generated text as it comes, then `finish`; each returns the stream events (without
    sequence numbers) that turn `items` into what they are now."""

    def __init__(self, parser: ToolCallParser | None) -> None:
        self.parser = parser  # None: no tools, all text is the message
        self.items: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None  # the message item being written
        self._calls: dict[int, dict[str, Any]] = {}  # the parser's call index -> its function_call item

    def push(self, text: str) -> list[dict[str, Any]]:
        if self.parser is None:
            return self._content(text)
        events = []
        for piece in _PIECES.findall(text):
            content, calls = self.parser.push(piece)
            events += self._content(content) + self._call_events(calls)
        return events

    def finish(self, complete: bool) -> list[dict[str, Any]]:
        """The generation ended; `complete`: it was not cut short (max_output_tokens)."""
        events = []
        if self.parser is not None:
            content, calls = self.parser.finish()
            events += self._content(content) + self._call_events(calls)
        return events + self._close_message("completed" if complete else "incomplete")

    def _content(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = []
        if self._message is None:
            self._message = {"id": _item_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                             "content": [_text_part()]}
            self.items.append(self._message)
            events += [self._item_event("response.output_item.added", self._message),
                       self._part_event("response.content_part.added")]
        self._message["content"][0]["text"] += text
        return events + [{"type": "response.output_text.delta", **self._where(self._message), "content_index": 0,
                          "delta": text, "logprobs": []}]

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        if self._message is None:
            return []
        part = self._message["content"][0]
        done_text = {"type": "response.output_text.done", **self._where(self._message), "content_index": 0,
                     "text": part["text"], "logprobs": []}
        events = [done_text, self._part_event("response.content_part.done")]
        self._message["status"] = status
        events.append(self._item_event("response.output_item.done", self._message))
        self._message = None
        return events

    def _call_events(self, calls: list[CallEvent]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for e in calls:
            if e.kind == CallEventKind.STARTED:
                events += self._close_message("completed")
                item = {"id": _item_id("fc"), "type": "function_call", "status": "in_progress", "call_id": e.call.id,
                        "name": e.call.function.name, "arguments": ""}
                self._calls[e.index] = item
                self.items.append(item)
                events.append(self._item_event("response.output_item.added", item))
                continue
            item = self._calls[e.index]
            if e.kind == CallEventKind.ARGUMENTS:
                item["arguments"] += e.text
                events.append({"type": "response.function_call_arguments.delta", **self._where(item), "delta": e.text})
                continue
            item["status"] = "completed" if e.complete else "incomplete"
            events += [{"type": "response.function_call_arguments.done", **self._where(item), "name": item["name"],
                        "arguments": item["arguments"]}, self._item_event("response.output_item.done", item)]
        return events

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _item_event(self, kind: str, item: dict[str, Any]) -> dict[str, Any]:
        return {"type": kind, "output_index": self.items.index(item), "item": copy.deepcopy(item)}

    def _part_event(self, kind: str) -> dict[str, Any]:
        return {"type": kind, **self._where(self._message), "content_index": 0,
                "part": copy.deepcopy(self._message["content"][0])}

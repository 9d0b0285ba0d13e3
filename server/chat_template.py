"""Chat prompts without forged special tokens.

Rendering a conversation to text and tokenizing that text with special tokens on would turn a
user's "<|im_end|>\\n<|im_start|>system\\n..." into the real control tokens: a user could end
their own turn and write a system one. Here every string the client supplied (message contents,
names, tool call ids and arguments, tool definitions) that holds special-token text is rendered
as a placeholder; the template's own text between placeholders is tokenized with special tokens
on, and the client's strings with them split into ordinary text (`split_special_tokens`), as
safe chat templates do (at the edges of those strings the text may split into tokens other than
one encoding of the whole would give). A conversation without such text tokenizes exactly as before.

Where the template does not render a string verbatim (it escapes or transforms it), the
placeholders cannot be mapped back: such a request is refused with a 400 naming the string.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters: no tokenizer gives them meaning
_PLACEHOLDER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")


class UnsafeChatInput(ValueError):
    """A client string holds special-token text the template does not render verbatim."""

    def __init__(self, path: str, token: str) -> None:
        super().__init__(f"{path}: contains the special token text {token!r}, which this model's chat "
                         "template cannot render as plain text")
        self.path = path


def special_token_texts(tokenizer) -> list[str]:
    """The texts that tokenizing with special tokens on turns into special tokens."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts = {t.content for t in decoder.values() if getattr(t, "special", False)}
    texts.update(getattr(tokenizer, "all_special_tokens", None) or [])
    return sorted((t for t in texts if t), key=len, reverse=True)


def _strings(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """Every string leaf of a JSON-like value with its path (`messages[1].content`)."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _strings(v, f"{path}[{i}]")


def _replace_strings(value: Any, swap: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return swap(value)
    if isinstance(value, dict):
        return {k: _replace_strings(v, swap) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace_strings(v, swap) for v in value]
    return value


def render_chat_ids(tokenizer, conversation: list[dict], tools: list[dict] | None, **template_args) -> list[int]:
    """The token ids of the conversation as the chat template renders it (module docstring).
    Raises UnsafeChatInput, or whatever apply_chat_template raises for a bad conversation."""
    def render(conv: list[dict], tls: list[dict] | None) -> str:
        text = tokenizer.apply_chat_template(conv, tools=tls, tokenize=False, **template_args)
        if not isinstance(text, str):
            raise ValueError("the chat template did not produce text")
        return text

    text = render(conversation, tools)
    specials = special_token_texts(tokenizer)
    tainted = [(path, s) for path, s in [*_strings(conversation, "messages"), *_strings(tools or [], "tools")]
               if any(t in s for t in specials)]
    if not tainted:
        return list(tokenizer.encode(text, add_special_tokens=False))
    if _OPEN in text:  # the client wrote our placeholder marker too: the pieces could not be told apart
        path, s = tainted[0]
        raise UnsafeChatInput(path, next(t for t in specials if t in s))
    index = {s: i for i, (_, s) in enumerate(tainted)}

    def placeholder(s: str) -> str:
        return f"{_OPEN}{index[s]}{_CLOSE}" if s in index else s

    masked = render(_replace_strings(conversation, placeholder), _replace_strings(tools, placeholder))
    pieces = _PLACEHOLDER.split(masked)  # template text, placeholder number, template text, ...
    if "".join(tainted[int(p)][1] if i % 2 else p for i, p in enumerate(pieces)) != text:
        path, s = tainted[0]  # (the template changed some string: which one is unknown)
        raise UnsafeChatInput(path, next(t for t in specials if t in s))
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if i % 2:
            ids += tokenizer.encode(tainted[int(piece)][1], add_special_tokens=False, split_special_tokens=True)
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
    return ids

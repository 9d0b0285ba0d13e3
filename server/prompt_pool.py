"""Tokenizing and chat-templating prompts off the event loop, after a length bound that needs no
tokenizing.

Every prompt is tokenized on one thread of its own: the fast tokenizer releases the GIL while it
encodes, so a prompt of megabytes costs its own request seconds but stalls no other stream. One
thread, because a Hugging Face fast tokenizer may not be entered from two threads at once
("Already borrowed"); the event loop itself only decodes.

Before that, a prompt that no tokenization could fit into the context is refused at once: a token
stands for at most `max_token_chars` characters of text (the longest string in the vocabulary;
byte-level vocabularies spell each byte as one character, so it bounds characters too), and a
normalizer may shorten the text before it is split (NFC composes up to three characters into one),
so more than `NORMALIZER_SLACK x max_token_chars x max_model_len` characters is always too long.
"""
from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from server.errors import APIError

T = TypeVar("T")

NORMALIZER_SLACK = 4


class PromptPool:
    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        # The most characters a prompt that fits max_model_len tokens can have.
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1) if tokenizer is not None else 1
        self.max_chars = NORMALIZER_SLACK * max(longest, 1) * max_model_len

    def check_length(self, num_chars: int, param: str) -> None:
        if self.tokenizer is not None and num_chars > self.max_chars:
            raise APIError(400, f"{param}: {num_chars} characters cannot fit in max_model_len={self.max_model_len} "
                                f"tokens of this model (at most {self.max_chars} characters can)", param=param,
                           code="context_length_exceeded")

    async def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """`fn(*args, **kwargs)` on the tokenizer's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

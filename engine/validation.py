"""The one place prompts and context lengths are checked, for the offline API, the engine
processes and the HTTP front end alike (each used to carry its own copy)."""
from __future__ import annotations

from collections.abc import Sequence


class InputError(ValueError):
    """Bad input. The message names the field first (`prompt: ...`); `param` and `code` let the
    HTTP front end answer with an OpenAI error body without parsing the message."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str = "prompt") -> None:
    bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InputError(f"{param}: token id {bad!r} is outside the vocabulary [0, {vocab_size})", param)


def check_prompt(ids: Sequence[int], vocab_size: int, max_model_len: int, param: str = "prompt") -> None:
    """A prompt must be non-empty token ids of the vocabulary that leave room for one new token."""
    if not ids:
        raise InputError(f"{param} must not be empty", param)
    check_token_ids(ids, vocab_size, param)
    if len(ids) >= max_model_len:
        raise InputError(f"{param}: {len(ids)} tokens leave no room to generate within the context length "
                         f"(max_model_len={max_model_len})", param, "context_length_exceeded")


def check_resumed_outputs(outputs: Sequence[int], prompt_len: int, max_tokens: int, vocab_size: int,
                          max_model_len: int) -> None:
    """The streamed outputs of a resumed request (failover): vocabulary ids that leave room, within
    max_tokens and the context length, for at least one more token (else the request was done)."""
    if not outputs:
        return
    check_token_ids(outputs, vocab_size, "output_token_ids")
    if len(outputs) >= max_tokens:
        raise InputError(f"output_token_ids: {len(outputs)} tokens already reach max_tokens={max_tokens}",
                         "output_token_ids")
    if prompt_len + len(outputs) >= max_model_len:
        raise InputError(f"output_token_ids: prompt ({prompt_len}) + outputs ({len(outputs)}) leave no room within "
                         f"max_model_len={max_model_len}", "output_token_ids", "context_length_exceeded")


def resolve_max_tokens(prompt_len: int, max_tokens: int | None, max_model_len: int) -> int | None:
    """`max_tokens` for a prompt of `prompt_len` tokens: None means "up to the context length";
    asking for more than fits is an error. Non-integers pass through for SamplingParams to refuse."""
    if max_tokens is None:
        return max_model_len - prompt_len
    if isinstance(max_tokens, int) and max_tokens >= 1 and prompt_len + max_tokens > max_model_len:
        raise InputError(f"max_tokens: this model's maximum context length is {max_model_len} tokens; the prompt "
                         f"has {prompt_len} and max_tokens asks for {max_tokens} more",
                         "max_tokens", "context_length_exceeded")
    return max_tokens

"""Types shared by every package: roles, modes, finish reasons, sampling parameters, logprobs.

A leaf module: it imports nothing of ours, so the scheduler, the worker, KV transfer and the
server can all use it without pulling each other in. `SamplingParams` and `TokenLogprobs` are
msgspec structs so they travel typed on the server <-> engine wire.
"""
from __future__ import annotations

import enum

import msgspec


class EngineRole(enum.StrEnum):
    """What one engine process does."""

    COLOCATED = "colocated"  # prefill and decode in one process
    PREFILL = "prefill"      # P: prefill, sample t0, hand the KV to a decode instance
    DECODE = "decode"        # D: reserve blocks, pull the KV from P, decode


class KVTransferMode(enum.StrEnum):
    """How a prefill engine ships a prompt's KV (its --kv-transfer-mode)."""

    LAYERWISE = "layerwise"          # each layer as the forward writes it, overlapping the prefill
    AFTER_PREFILL = "after-prefill"  # the whole prompt's KV in one message once the prefill finished


class ServeMode(enum.StrEnum):
    """Which engine roles the front end routes to."""

    PD = "pd"
    COLOCATED = "colocated"


class FinishReason(enum.StrEnum):
    STOP = "stop"          # EOS, a stop token id or a stop string
    LENGTH = "length"      # max_tokens or the context length
    ABORT = "abort"        # client disconnect, cancel, engine shutdown
    ERROR = "error"
    # Internal to a prefill engine: t0 is sampled and the request goes on at a decode instance.
    # Never sent to the front end (the request is not finished from the client's point of view).
    HANDED_OFF = "handed_off"


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of one generated token: its own, its rank, and the top-n alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


class GrammarKind(enum.StrEnum):
    """What `GrammarSpec.text` holds (worker/structured.py compiles each kind)."""

    JSON_OBJECT = "json_object"  # any JSON object; `text` is unused
    JSON_SCHEMA = "json_schema"  # a JSON schema, as JSON text
    STRUCTURAL_TAG = "structural_tag"  # an xgrammar structural tag, as JSON text (tool calls: server/tool_calls.py)


class GrammarSpec(msgspec.Struct, frozen=True):
    """Structured output: every generated token must keep the output inside this grammar, and the
    request may only end (EOS) where the grammar is complete. The text is the compile-cache key."""

    kind: GrammarKind
    text: str = ""


class SamplingParams(msgspec.Struct, kw_only=True):
    """Per-request sampling parameters, validated on construction and on decoding (a bad field
    raises ValueError naming it)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # top-n logprobs per generated token (0: just the sampled token's)
    # Top-n logprobs per prompt token after the first, as vLLM's prompt_logprobs (0: just the prompt
    # token's own). Computed where the prompt is prefilled; such a request skips the prefix cache.
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    grammar: GrammarSpec | None = None  # structured output (response_format, tool_choice)

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        for name, ok, want in self._checks():
            if not ok:
                raise ValueError(f"{name} must be {want}, got {getattr(self, name)!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])

    def _checks(self) -> list[tuple[str, bool, str]]:
        def is_int(x: object) -> bool:
            return isinstance(x, int)

        return [
            ("max_tokens", is_int(self.max_tokens) and self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", is_int(self.top_k) and self.top_k >= 0, "0/-1 (off) or a positive integer"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("min_tokens", is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
             "an integer in [0, max_tokens]"),
            ("logprobs", self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= 20),
             "None or an integer in [0, 20]"),
            ("prompt_logprobs",
             self.prompt_logprobs is None or (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
             "None or an integer in [0, 20]"),
            ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("seed", self.seed is None or is_int(self.seed), "None or an integer"),
            # A grammar ends the output at EOS once it is complete: neither may hold EOS back.
            ("ignore_eos", not (self.ignore_eos and self.grammar is not None), "false with a grammar "
             "(response_format / tool_choice)"),
            ("min_tokens", self.min_tokens == 0 or self.grammar is None, "0 with a grammar "
             "(response_format / tool_choice)"),
        ]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

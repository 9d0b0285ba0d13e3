"""Types shared by every package: roles, modes, finish reasons, sampling parameters, logprobs.

A leaf module: it imports nothing of ours, so the scheduler, the worker, KV transfer and the
server can all use it without pulling each other in. `SamplingParams` and `TokenLogprobs` are
msgspec structs so they travel typed on the server <-> engine wire.
"""
from __future__ import annotations

import enum
import math
import struct

import msgspec

# Bounds on what a request may ask for. Every field is checked where a SamplingParams is built
# (the HTTP front end, the offline API) and again where the engine decodes one from the wire, so
# nothing outside them reaches the sampler's tensors (int32 top-k and token ids, float32 floats).
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# vLLM has no upper bound on the temperature; a float32 beyond ~3.4e38 is inf, and inf turns the
# logits into NaN. 100 already flattens any distribution to uniform within float32 rounding.
MAX_TEMPERATURE = 100.0
# A seen token's logit is divided (or multiplied) by the penalty: outside these bounds ordinary
# logits leave float32's range (1e-40 is 0 in float32: vLLM's `> 0` check lets that through).
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20
_FLT_MAX = 3.4028234663852886e38


def to_float32(x: float) -> float:
    """`x` as a float32 tensor holds it: inf beyond float32's range, 0 or subnormal when tiny."""
    if math.isnan(x) or abs(x) > _FLT_MAX:
        return x if math.isnan(x) else math.copysign(math.inf, x)
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # rounds past FLT_MAX
        return math.copysign(math.inf, x)


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
        def is_int(x: object, low: int = 0, high: int = INT32_MAX) -> bool:
            return isinstance(x, int) and not isinstance(x, bool) and low <= x <= high

        def in_f32(x: object, low: float, high: float) -> bool:
            """In [low, high] both as given and as the float32 the sampler computes with."""
            return (isinstance(x, int | float) and low <= x <= high
                    and to_float32(low) <= to_float32(x) <= to_float32(high))

        def maybe_int(x: object, high: int) -> bool:
            return x is None or is_int(x, 0, high)

        stops = self.stop_token_ids
        return [
            ("max_tokens", is_int(self.max_tokens, 1), f"an integer in [1, {INT32_MAX}]"),
            ("temperature", in_f32(self.temperature, 0.0, MAX_TEMPERATURE), f"in [0, {MAX_TEMPERATURE:g}]"),
            ("top_p", in_f32(self.top_p, 0.0, 1.0) and to_float32(self.top_p) > 0, "in (0, 1] (as a float32)"),
            ("top_k", is_int(self.top_k), f"0/-1 (off) or an integer in [1, {INT32_MAX}]"),
            ("min_p", in_f32(self.min_p, 0.0, 1.0), "in [0, 1]"),
            ("min_tokens", is_int(self.min_tokens) and self.min_tokens <= self.max_tokens,
             "an integer in [0, max_tokens]"),
            ("logprobs", maybe_int(self.logprobs, MAX_LOGPROBS), f"None or an integer in [0, {MAX_LOGPROBS}]"),
            ("prompt_logprobs", maybe_int(self.prompt_logprobs, MAX_LOGPROBS),
             f"None or an integer in [0, {MAX_LOGPROBS}]"),
            ("repetition_penalty", in_f32(self.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
             f"in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]"),
            ("frequency_penalty", in_f32(self.frequency_penalty, -2.0, 2.0), "in [-2, 2]"),
            ("presence_penalty", in_f32(self.presence_penalty, -2.0, 2.0), "in [-2, 2]"),
            ("seed", self.seed is None or is_int(self.seed, INT64_MIN, INT64_MAX),
             f"None or an integer in [{INT64_MIN}, {INT64_MAX}]"),
            ("stop_token_ids", stops is None or (len(stops) <= MAX_STOP_TOKEN_IDS and all(is_int(t) for t in stops)),
             f"at most {MAX_STOP_TOKEN_IDS} token ids, each in [0, {INT32_MAX}]"),
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

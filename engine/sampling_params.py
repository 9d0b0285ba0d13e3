"""Per-request sampling parameters, validated on construction (a bad field raises ValueError naming it)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # top-n logprobs per generated token (0: just the sampled token's)
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "0/-1 (off) or a positive integer"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("min_tokens", isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
             "an integer in [0, max_tokens]"),
            ("logprobs", self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             "None or an integer in [0, 20]"),
            ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("seed", self.seed is None or isinstance(self.seed, int), "None or an integer"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"{name} must be {want}, got {getattr(self, name)!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

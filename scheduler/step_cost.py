"""What one engine step costs this engine, fitted from the steps it ran: seconds = fixed + per_token * tokens.

The scheduler asks it one question (docs/architecture.md, "Batching prompts"): up to how many
prefill tokens is a prompt worth putting in a step that already prefills another one? Batching it
saves the new prompt one step's fixed cost and delays the prompts already in the step by its own
compute, so it pays while its tokens cost less than a step's fixed part: fixed / per_token tokens.

Both parts depend on the model and the machine far more than on anything the scheduler sees: a
4M-parameter model's step is mostly Python (a large fixed part, a tiny per-token one: batch
everything), a 0.5B one's on a CPU is mostly arithmetic (a 200-token prompt costs many fixed parts:
batch nothing). So they are measured, not configured.
"""
from __future__ import annotations

from collections import deque

# Steps the fit looks back on: enough to span decode and prefill steps, few enough to follow a
# change of load (another process taking a core).
WINDOW = 64


class StepCost:
    def __init__(self, window: int = WINDOW) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._fitted: tuple[float, float] | None = None  # (fixed, per_token) seconds
        self._stale = False  # samples came since the fit: refit when next asked, not on every step

    def record(self, tokens: int, seconds: float) -> None:
        """One step that scheduled `tokens` tokens and took `seconds`, schedule to update."""
        if tokens > 0:
            self._samples.append((tokens, seconds))
            self._stale = True

    def reset(self) -> None:
        self._samples.clear()
        self._fitted, self._stale = None, False

    def _current(self) -> tuple[float, float] | None:
        if self._stale:
            self._fitted, self._stale = self._fit(), False
        return self._fitted

    def shared_prefill_tokens(self) -> int | None:
        """The most tokens a prompt may have left to prefill to join a step that prefills others
        (fixed / per_token); None while the steps seen cannot tell the two parts apart."""
        fitted = self._current()
        if fitted is None:
            return None
        fixed, per_token = fitted
        return round(fixed / per_token)

    def predict(self, tokens: int) -> float | None:
        """Seconds a step of `tokens` tokens should take; None while the fit is unknown."""
        fitted = self._current()
        if fitted is None:
            return None
        fixed, per_token = fitted
        return fixed + per_token * tokens

    def _fit(self) -> tuple[float, float] | None:
        """Least squares over the window. Needs steps of clearly different sizes (the largest at
        least twice the smallest): with one size, fixed and per-token cost are indistinguishable."""
        samples = self._samples
        sizes = [t for t, _ in samples]
        if len(samples) < 2 or max(sizes) < 2 * min(sizes):
            return None
        n = len(samples)
        mean_t = sum(sizes) / n
        mean_s = sum(s for _, s in samples) / n
        var = sum((t - mean_t) ** 2 for t in sizes)
        per_token = sum((t - mean_t) * (s - mean_s) for t, s in samples) / var
        if per_token <= 0:  # noise swamped the tokens' cost: no evidence either way
            return None
        return max(0.0, mean_s - per_token * mean_t), per_token

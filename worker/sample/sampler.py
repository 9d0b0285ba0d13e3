"""Token sampler: penalties, bans, temperature, top-k / top-p / min-p, seeded sampling, logprobs.

The sampler turns one step's logits ``[B, V]`` into one token per row. It is split
into reusable stages because the rejection sampler of speculative decoding needs
the *target distribution* (``compute_probs``) and the *draw* (``sample_from_probs``)
separately:

    raw logprobs (if asked) -> apply_penalties_and_bans -> compute_probs -> sample_from_probs

Reproducibility contract: a random row with its own ``torch.Generator`` draws
exactly ``V`` uniform variates (turned into exponentials) from that generator per sampled token, and
every other stage is row-wise. Its token therefore depends only on its seed, its
generator's history and its own logits -- never on the batch size, its position
in the batch or the other rows. Rows without a generator draw from the sampler's
default generator (by inverse CDF, one uniform each).

Non-finite logits follow worker/fused_ops.py's rule (NaN as -inf, +inf as the largest float32,
applied after temperature; a row with no finite logit gives token 0), so every stage's ids are in
[0, vocab) whatever the model or the request's settings produced.
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker import fused_ops

logger = logging.getLogger(__name__)

# Temperatures below this are treated as greedy: dividing by them would overflow
# the logits, and the distribution is a point mass at that precision anyway.
GREEDY_TEMPERATURE_EPS = 1e-5

# -log(1 - U) is exactly 0.0 when U = 0; probs / 0 would give inf (or NaN for a
# zero-probability token, and argmax picks NaN). Clamping to the smallest normal
# float keeps zero-probability tokens at exactly 0 and changes nothing else.
_MIN_EXP_SAMPLE = torch.finfo(torch.float32).tiny


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


_MASK64 = (1 << 64) - 1


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers, through splitmix64 (distinct inputs give unrelated streams).

    ``torch.Generator.manual_seed(s)`` and ``manual_seed(s + 1)`` are already unrelated
    streams, but ``(seed, position)`` pairs need one integer each that never collides for
    nearby pairs: hashing, not adding, gives that.
    """
    x = 0x9E3779B97F4A7C15
    for part in parts:
        x = (x ^ (part & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
        x ^= x >> 31
    return x >> 1


def position_generator(seed: int, position: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator of output position ``position`` of a request with ``seed``
    (docs/architecture.md, speculative decoding).

    Randomness keyed by (seed, output index) only, never by a stream's history, is what makes a
    seeded token the same on P or D, in any slot, before or after preemption, and what lets the
    drafter draw a draft with the very noise its verifier will use. A fresh generator costs
    little on CPU next to the V variates drawn from it.
    """
    return make_generator(mix_seed(seed, position), device)


@dataclass
class SamplingMetadata:
    """Per-step, per-row sampling settings, built by the model runner from its slot arrays.

    Tensors are ``[B]`` and live on the logits' device. The optional ``no_*`` flags
    are host-side summaries; pass them when known (the runner has the CPU arrays)
    so the sampler never reads device tensors back to decide what to skip. When
    left as ``None`` they are computed from the tensors (a device sync on GPU).
    """

    temperature: torch.Tensor  # [B] float32; 0.0 means greedy for that row
    top_k: torch.Tensor  # [B] int32; 0 means off
    top_p: torch.Tensor  # [B] float32; 1.0 means off
    min_p: torch.Tensor  # [B] float32; 0.0 means off
    generators: list[torch.Generator | None]  # per row; None -> sampler's default generator
    repetition_penalty: torch.Tensor  # [B] float32; 1.0 off (HF: prompt+output tokens)
    frequency_penalty: torch.Tensor  # [B] float32; 0.0 off (OpenAI: output token counts)
    presence_penalty: torch.Tensor  # [B] float32; 0.0 off (OpenAI: output token presence)
    prompt_token_ids: list[list[int]] | None  # per row; needed only when some penalty is on
    output_token_ids: list[list[int]] | None  # per row; needed only when some penalty is on
    banned_token_ids: list[list[int]] | None  # per row tokens forbidden this step; None = none
    max_num_logprobs: int  # -1: no logprobs; else top-n (0: only the sampled token's logprob)
    all_greedy: bool  # every row greedy: skip probabilities and random draws entirely
    no_greedy: bool | None = None  # no row greedy: skip the one-hot / argmax that only greedy rows use
    no_penalties: bool | None = None
    no_top_k: bool | None = None
    no_top_p: bool | None = None
    no_min_p: bool | None = None
    # [B, V] bool: tokens a grammar allows at each row (structured output); None = no grammar.
    allowed_token_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.no_greedy is None:
            self.no_greedy = not bool((self.temperature < GREEDY_TEMPERATURE_EPS).any())
        if self.no_penalties is None:
            self.no_penalties = not bool(
                (self.repetition_penalty != 1.0).any()
                or (self.frequency_penalty != 0.0).any()
                or (self.presence_penalty != 0.0).any()
            )
        if self.no_top_k is None:
            self.no_top_k = not bool((self.top_k > 0).any())
        if self.no_top_p is None:
            self.no_top_p = not bool((self.top_p < 1.0).any())
        if self.no_min_p is None:
            self.no_min_p = not bool((self.min_p > 0.0).any())

    @property
    def num_rows(self) -> int:
        return len(self.generators)

    @classmethod
    def from_lists(
        cls,
        temperature: Sequence[float],
        *,
        top_k: Sequence[int] | None = None,
        top_p: Sequence[float] | None = None,
        min_p: Sequence[float] | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
        repetition_penalty: Sequence[float] | None = None,
        frequency_penalty: Sequence[float] | None = None,
        presence_penalty: Sequence[float] | None = None,
        prompt_token_ids: list[list[int]] | None = None,
        output_token_ids: list[list[int]] | None = None,
        banned_token_ids: list[list[int]] | None = None,
        max_num_logprobs: int = -1,
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """Build metadata from per-row Python values; omitted settings are off for every row.

        The skip flags are derived from the Python values, so no device sync happens.
        """
        n = len(temperature)

        def col(values: Sequence[float] | Sequence[int] | None, default: float | int) -> list:
            if values is None:
                return [default] * n
            if len(values) != n:
                raise ValueError(f"expected {n} per-row values (one per temperature), got {len(values)}")
            return list(values)

        temps = col(temperature, 1.0)
        ks, ps, mps = col(top_k, 0), col(top_p, 1.0), col(min_p, 0.0)
        rps, fps, pps = col(repetition_penalty, 1.0), col(frequency_penalty, 0.0), col(presence_penalty, 0.0)
        gens = list(generators) if generators is not None else [None] * n
        if len(gens) != n:
            raise ValueError(f"expected {n} generators (one per row), got {len(gens)}")

        def f32(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        return cls(
            temperature=f32(temps),
            top_k=torch.tensor(ks, dtype=torch.int32, device=device),
            top_p=f32(ps),
            min_p=f32(mps),
            generators=gens,
            repetition_penalty=f32(rps),
            frequency_penalty=f32(fps),
            presence_penalty=f32(pps),
            prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids,
            banned_token_ids=banned_token_ids,
            max_num_logprobs=max_num_logprobs,
            all_greedy=all(t < GREEDY_TEMPERATURE_EPS for t in temps),
            no_greedy=all(t >= GREEDY_TEMPERATURE_EPS for t in temps),
            no_penalties=all(r == 1.0 for r in rps) and all(f == 0.0 for f in fps) and all(p == 0.0 for p in pps),
            no_top_k=all(k <= 0 for k in ks),
            no_top_p=all(p >= 1.0 for p in ps),
            no_min_p=all(m <= 0.0 for m in mps),
        )

    def select_rows(self, rows: Sequence[int]) -> SamplingMetadata:
        """Metadata for a subset / repetition of rows (e.g. one row per verified position in
        speculative decoding). A repeated generator is shared, so its rows draw in order."""
        idx = torch.tensor(list(rows), dtype=torch.long, device=self.temperature.device)

        def pick(lists: list[list[int]] | None) -> list[list[int]] | None:
            return None if lists is None else [lists[i] for i in rows]

        return SamplingMetadata(
            temperature=self.temperature[idx],
            top_k=self.top_k[idx],
            top_p=self.top_p[idx],
            min_p=self.min_p[idx],
            generators=[self.generators[i] for i in rows],
            repetition_penalty=self.repetition_penalty[idx],
            frequency_penalty=self.frequency_penalty[idx],
            presence_penalty=self.presence_penalty[idx],
            prompt_token_ids=pick(self.prompt_token_ids),
            output_token_ids=pick(self.output_token_ids),
            banned_token_ids=pick(self.banned_token_ids),
            max_num_logprobs=self.max_num_logprobs,
            # A subset keeps every "off" property of the whole; "on" may become
            # "off" but skipping less work is only slower, never wrong.
            all_greedy=self.all_greedy,
            no_greedy=self.no_greedy,
            no_penalties=self.no_penalties,
            no_top_k=self.no_top_k,
            no_top_p=self.no_top_p,
            no_min_p=self.no_min_p,
            allowed_token_mask=None if self.allowed_token_mask is None else self.allowed_token_mask[idx],
        )


@dataclass
class LogprobsTensors:
    """Logprobs of the raw model distribution (before penalties and temperature)."""

    token_ids: torch.Tensor  # [B, 1 + n] int32: column 0 the sampled token, then the top-n
    logprobs: torch.Tensor  # [B, 1 + n] float32
    ranks: torch.Tensor  # [B] int32: rank of the sampled token (1 = most likely)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int32
    logprobs: LogprobsTensors | None = None  # when max_num_logprobs >= 0


def _flat_row_token_index(
    token_lists: Sequence[Sequence[int]], rows: Sequence[int], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """Flat ``row * V + token`` indices of the listed rows' tokens, ids outside [0, V) dropped
    (a -1 placeholder or an id beyond a padded vocab must not index another row)."""
    lengths = [len(token_lists[r]) for r in rows]
    if sum(lengths) == 0:
        return torch.empty(0, dtype=torch.long, device=device)
    tokens = torch.tensor(
        list(itertools.chain.from_iterable(token_lists[r] for r in rows)), dtype=torch.long
    )
    row_ids = torch.repeat_interleave(
        torch.tensor(list(rows), dtype=torch.long), torch.tensor(lengths, dtype=torch.long)
    )
    valid = (tokens >= 0) & (tokens < vocab_size)
    return (row_ids[valid] * vocab_size + tokens[valid]).to(device, non_blocking=True)


def _token_counts(
    token_lists: Sequence[Sequence[int]], rows: Sequence[int], num_rows: int, vocab_size: int,
    device: torch.device,
) -> torch.Tensor:
    """``[B, V]`` occurrence counts of each row's tokens (rows not listed stay 0)."""
    flat = _flat_row_token_index(token_lists, rows, vocab_size, device)
    return torch.bincount(flat, minlength=num_rows * vocab_size).view(num_rows, vocab_size)


class Sampler:
    """Stateless apart from the default generator used by rows without their own seed."""

    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu") -> None:
        self._seed = seed
        self._default_generators: dict[torch.device, torch.Generator] = {}
        self.default_generator(torch.device(device))
        logger.debug("Sampler ready (seed=%s, device=%s)", seed, device)

    def default_generator(self, device: torch.device) -> torch.Generator:
        # One generator per device: logits may live on a device other than the one
        # named at construction (e.g. tests on CPU with a GPU-configured sampler).
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        gen = self._default_generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._default_generators[device] = gen
        return gen

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        return self.forward(logits, meta)

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of ``logits`` ``[B, V]``."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        if logits.shape[0] != meta.num_rows:
            raise ValueError(f"logits have {logits.shape[0]} rows but the metadata has {meta.num_rows}")
        # Sampling maths in fp32 whatever the model's dtype (bf16 softmax/cumsum is too coarse).
        logits = logits.float()

        raw_logprobs = torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs >= 0 else None

        logits = self.apply_penalties_and_bans(logits, meta)
        if meta.all_greedy:
            sampled = fused_ops.argmax(logits)
        else:
            sampled = self.sample_from_probs(self.compute_probs(logits, meta), meta)

        logprobs = None
        if raw_logprobs is not None:
            logprobs = self.gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled.to(torch.int32), logprobs=logprobs)

    # ------------------------------------------------------------------ stages

    def apply_penalties_and_bans(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Repetition / frequency / presence penalties, then banned tokens and tokens outside the
        row's grammar set to -inf.

        Returns a new tensor; the caller's logits are left untouched (the runner may
        still need them, e.g. for raw logprobs).
        """
        num_rows, vocab = logits.shape
        if not meta.no_penalties:
            logits = self._apply_penalties(logits, meta)
        if meta.banned_token_ids is not None and any(meta.banned_token_ids):
            rows_with_bans = [r for r, ids in enumerate(meta.banned_token_ids) if ids]
            flat = _flat_row_token_index(meta.banned_token_ids, rows_with_bans, vocab, logits.device)
            logits = logits.reshape(-1).index_fill(0, flat, float("-inf")).view(num_rows, vocab)
        if meta.allowed_token_mask is not None:
            allowed = meta.allowed_token_mask.to(logits.device, non_blocking=True)
            logits = logits.masked_fill(~allowed, float("-inf"))
        return logits

    def _apply_penalties(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        num_rows, vocab = logits.shape
        if meta.output_token_ids is None:
            raise ValueError("a penalty is on but SamplingMetadata.output_token_ids is None")
        # The per-row lists are host data anyway; reading the penalties back lets us
        # skip rows (and long prompts) whose penalties are off.
        rep = meta.repetition_penalty.tolist()
        freq = meta.frequency_penalty.tolist()
        pres = meta.presence_penalty.tolist()
        rep_rows = [r for r in range(num_rows) if rep[r] != 1.0]
        out_rows = [r for r in range(num_rows) if rep[r] != 1.0 or freq[r] != 0.0 or pres[r] != 0.0]

        output_counts = _token_counts(meta.output_token_ids, out_rows, num_rows, vocab, logits.device)
        output_counts = output_counts.to(logits.dtype)

        if rep_rows:
            if meta.prompt_token_ids is None:
                raise ValueError("repetition_penalty is on but SamplingMetadata.prompt_token_ids is None")
            prompt_counts = _token_counts(meta.prompt_token_ids, rep_rows, num_rows, vocab, logits.device)
            seen = (prompt_counts > 0) | (output_counts > 0)
            penalty = meta.repetition_penalty.to(logits.dtype).unsqueeze(1)
            # HF semantics: shrink towards zero from both sides, i.e. a seen token
            # always becomes less likely whatever the sign of its logit.
            penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, penalised, logits)

        # OpenAI semantics: linear in the output count, plus a flat presence term.
        logits = (
            logits
            - meta.frequency_penalty.to(logits.dtype).unsqueeze(1) * output_counts
            - meta.presence_penalty.to(logits.dtype).unsqueeze(1) * (output_counts > 0).to(logits.dtype)
        )
        return logits

    def compute_probs(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The final target distribution ``[B, V]`` for already-penalised logits.

        Random rows: softmax(logits / T) restricted by top-k, then top-p, then min-p,
        renormalised. Greedy rows: a one-hot at the argmax of the logits.
        Ties at the k-th largest value are all kept by top-k.

        Non-finite logits (module docstring): a NaN or +inf logit after the temperature -- a penalty
        or a small temperature can overflow --, or a row with no finite logit, makes the softmax's
        sum and so its whole row NaN. On a CPU one look at each row's first probability finds
        them, and only then (rarely) is the batch computed again under the rule; elsewhere the
        rule is applied every time, as that look would cost a device sync.
        """
        if logits.device.type != "cpu":
            return self._probs(logits, meta, finite=True)
        probs = self._probs(logits, meta, finite=False)
        if bool(probs[:, 0].isnan().any()):
            probs = self._probs(logits, meta, finite=True)
        return probs

    def _probs(self, logits: torch.Tensor, meta: SamplingMetadata, finite: bool) -> torch.Tensor:
        """compute_probs, `finite`: under the non-finite rule (NaN as -inf, +inf as the largest
        float32; a row with no finite logit gets no mass at all, so it draws token 0)."""
        logits = logits.float()
        if meta.no_greedy:
            one_hot = greedy = None
            temperature = meta.temperature
        else:
            greedy = meta.temperature < GREEDY_TEMPERATURE_EPS
            one_hot = torch.zeros_like(logits).scatter_(1, fused_ops.argmax(logits).unsqueeze(1), 1.0)
            if meta.all_greedy:
                return one_hot
            # Greedy rows divide by 1 (their values are replaced by the one-hot below).
            temperature = torch.where(greedy, torch.ones_like(meta.temperature), meta.temperature)
        logits = logits / temperature.to(logits.dtype).unsqueeze(1)
        if finite:
            logits = fused_ops.finite_logits(logits)

        if not (meta.no_top_k and meta.no_top_p):
            logits = self._apply_top_k_top_p(logits, meta)
        if not meta.no_min_p:
            # probs < min_p * max_prob  <=>  logit < max_logit + log(min_p); log(0) = -inf
            # turns the filter off for rows with min_p = 0 without a separate mask.
            max_logit = logits.max(dim=-1, keepdim=True).values
            threshold = max_logit + torch.log(meta.min_p.to(logits.dtype)).unsqueeze(1)
            logits = logits.masked_fill(logits < threshold, float("-inf"))

        probs = torch.softmax(logits, dim=-1)
        if finite:
            probs = probs.nan_to_num_(0.0)
        return probs if greedy is None else torch.where(greedy.unsqueeze(1), one_hot, probs)

    @staticmethod
    def _apply_top_k_top_p(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Mask (to -inf) tokens outside top-k and then outside top-p, with one sort."""
        vocab = logits.shape[1]
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)

        if not meta.no_top_k:
            k = meta.top_k.to(torch.long)
            k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)
            kth_value = sorted_logits.gather(1, (k - 1).unsqueeze(1))
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_value, float("-inf"))

        if not meta.no_top_p:
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            # Keep token i iff the mass strictly before it is < p: the smallest prefix
            # whose cumulative probability reaches p. Position 0 has zero mass before
            # it, and is forced on anyway so rounding can never empty a row.
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            drop = mass_before >= meta.top_p.to(sorted_probs.dtype).unsqueeze(1)
            drop[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))

        return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)

    def sample_from_probs(self, probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Draw one token per row from ``probs`` ``[B, V]`` (rows need not be normalised).

        Rows with their own generator (seeded or keyed noise): exponential race -- with q_i ~ Exp(1)
        i.i.d., argmax_i p_i / q_i is distributed as p / sum(p) -- from ``V`` uniforms of that
        generator, so the token depends on nothing but the generator and the row, and a draft drawn
        from the same noise is coupled to it. The other random rows: inverse CDF, one uniform each
        from the default generator (the first token whose cumulative mass exceeds u * total; a token
        of zero mass adds nothing to the sum and is never picked): V uniforms and their logs cost
        many times a row's cumulative sum. Greedy rows: the argmax of their (one-hot) row.
        """
        num_rows, vocab = probs.shape
        if num_rows == 0:
            return torch.empty(0, dtype=torch.long, device=probs.device)
        if meta.all_greedy:
            return fused_ops.argmax(probs)
        probs = probs.float()
        greedy = None if meta.no_greedy else (meta.temperature < GREEDY_TEMPERATURE_EPS).tolist()
        keyed = [r for r, g in enumerate(meta.generators) if g is not None]
        unkeyed = [r for r in range(num_rows) if meta.generators[r] is None and not (greedy and greedy[r])]
        sampled = fused_ops.argmax(probs) if greedy is not None else torch.empty(num_rows, dtype=torch.long,
                                                                                 device=probs.device)
        if unkeyed:
            rows = probs if len(unkeyed) == num_rows else probs[torch.tensor(unkeyed, device=probs.device)]
            cdf = rows.cumsum(dim=-1)
            u = torch.rand(len(unkeyed), 1, generator=self.default_generator(probs.device), device=probs.device)
            total = cdf[:, -1:].contiguous()
            # (capped at the last token of nonzero mass, the first to reach the total, should rounding
            # ever put u * total at the total: a banned or masked token must never come out)
            tokens = torch.minimum(torch.searchsorted(cdf, u * total, right=True),
                                   torch.searchsorted(cdf, total)).squeeze(1)
            # A total that is NaN (NaN given as a probability) finds no place in the cdf: index V,
            # which is no token. Token 0 then, as for a row of no mass (compute_probs never gives NaN).
            tokens = tokens.masked_fill_(tokens >= vocab, 0)
            if len(unkeyed) == num_rows:
                return tokens
            sampled[torch.tensor(unkeyed, device=probs.device)] = tokens
        if keyed:
            q = torch.empty(len(keyed), vocab, dtype=torch.float32, device=probs.device)
            for i, r in enumerate(keyed):
                gen = meta.generators[r]
                if gen.device.type != probs.device.type:
                    raise ValueError(
                        f"row {r}: its generator is on {gen.device} but the logits are on {probs.device}; "
                        "create per-request generators on the model's device"
                    )
                q[i].uniform_(generator=gen)  # contiguous row view: exactly V draws
            # Exp(1) = -log(1 - U), transformed for all rows at once: uniform_ plus one vectorised
            # log1p costs much less than exponential_ on CPU.
            q.neg_().log1p_().neg_()
            rows = probs if len(keyed) == num_rows else probs[torch.tensor(keyed, device=probs.device)]
            race = fused_ops.argmax(rows / q.clamp_min_(_MIN_EXP_SAMPLE))
            if len(keyed) == num_rows and greedy is None:
                return race
            keep = race if greedy is None else torch.where(
                torch.tensor([greedy[r] for r in keyed], device=probs.device), sampled[keyed], race)
            sampled[torch.tensor(keyed, device=probs.device)] = keep
        return sampled

    @staticmethod
    def gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_top: int) -> LogprobsTensors:
        sampled = sampled.to(torch.long).unsqueeze(1)
        sampled_logprob = raw_logprobs.gather(1, sampled)
        # Rank 1 = most likely; tokens tied with the sampled one share its (best) rank.
        ranks = (raw_logprobs > sampled_logprob).sum(dim=-1) + 1
        num_top = min(num_top, raw_logprobs.shape[1])
        if num_top > 0:
            top_logprobs, top_ids = raw_logprobs.topk(num_top, dim=-1)  # sorted, descending
            token_ids = torch.cat([sampled, top_ids], dim=1)
            logprobs = torch.cat([sampled_logprob, top_logprobs], dim=1)
        else:
            token_ids, logprobs = sampled, sampled_logprob
        return LogprobsTensors(
            token_ids=token_ids.to(torch.int32),
            logprobs=logprobs.float(),
            ranks=ranks.to(torch.int32),
        )

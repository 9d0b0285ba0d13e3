"""How many draft tokens to propose each step (0..K), so that speculation never slows serving.

Expected tokens per request-step with k drafts is ``E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i``
where ``a_i`` is the acceptance rate of draft ``i`` given drafts ``1..i-1`` were accepted
(a running mean of verified drafts, then an EWMA). A step's cost ``C(b, k)`` -- verifying ``b * (1 + k)`` tokens
plus drafting ``k`` -- is measured online from the runner's own step timings (the median of
the last few), per batch-size bucket, plus the time the engine spends outside the runner
between steps. Greedy and sampling steps keep separate tables: sampling (softmax, the drafter's
own distribution, keyed noise) makes a verify step cost more than argmax does. The policy picks
the k that maximises ``E(k) / C(b, k)`` (tokens per second;
``b`` cancels); a bucket the batch only passes through (draining, or filling up again after a wave
of requests under load) is never measured -- it interpolates its neighbours' timings. Ideas from vLLM's
disable-by-batch-size and from goodput-based SmartSpec, but measured rather than configured:
on a CPU a verify step's cost grows with its rows, so the best k depends on the batch.

Every k of a bucket is first held for a few steps to measure it (warm-up), and the bucket
re-measures its least recently timed k (while k=0 wins: the k closest to winning) -- soon at first,
then every `explore_every` steps --
so a changed machine load or workload is noticed; so is a k in use whose recent steps cost
clearly more or less than its estimate says (that surprise re-measures it at once).
Acceptance is only observed while drafting; a k=0 regime keeps its
old estimate until the next exploration. While k=0 wins, only the k closest to winning is re-measured on
schedule, the others rarely: at a big batch each measured step costs several plain ones, plus the MTP layer's
backfill over the positions skipped meanwhile.
For the same reason re-measurements back off while they keep confirming the decision, a due one -- and a warm-up
too -- waits for a moment with few skipped positions (new rows, a stash flush), and a bucket whose neighbour has
measured k already warms k up with one measurement of its own. Resuming drafting while much backfill is pending
takes a wider margin, so that a decision near break-even does not flip with the noise and pay a backfill each time.
"""
from __future__ import annotations

import enum
import logging
import statistics
from collections import deque
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


# Fixed settings of the policy. None is a knob: each was chosen once, and the run that showed it
# is cited where there is one, by file, date and commit; those runs are in the git history of
# benchmarks/results/ (bench_spec.txt, spec_serving.md, bench_spec_adaptive.txt).
PRIOR_ACCEPTANCE = 0.5    # each draft's acceptance before any is verified
ACCEPTANCE_ALPHA = 0.01   # the EWMA's weight of one verified draft, once the plain mean has 1/alpha of them
# What a position's prior weighs, in verified drafts (see record_acceptance).
PRIOR_DRAFTS = 16
WARMUP_SAMPLES = 3        # timed steady k=0 steps of a bucket before it exploits
# Measurements (k, then k=0) of each k>0 in a warm-up; one where a neighbouring bucket has measured k
# already (bench_spec.txt, 2026-12-01 21:30, commit 24dd08a).
WARMUP_PAIRS = 2
HOLD_STEPS = 3            # a measurement holds k this long past the transition step (bench_spec.txt, 22:36)
# Decisions in a row at a bucket before it is measured for itself: a bucket the batch only passes
# through is not (spec_serving.md, 2026-12-03 17:03, commit 982ed38).
SETTLE_DECISIONS = 16
# How much faster drafting must look than not drafting, plus DOUBT over the number of cost ratios
# behind it (bench_spec_adaptive.txt: the 0.2/n doubt; spec_serving.md, 2026-12-03 12:34: the
# fewest drafts within the margin of the best).
MARGIN = 1.03
DOUBT = 0.2
# Re-measure when the skipped MTP positions are at most this many per row (bench_spec.txt,
# 2026-12-01 18:40: the backfill of a resumed drafting step at 16 rows).
BACKFILL_PER_ROW = 8
OTHERS_EVERY = 8          # while k=0 wins, a k other than the closest is re-measured after this many intervals
# Added to the margin while the rows have much backfill pending (bench_spec.txt, 2026-12-01 22:36, 59d46d8).
RESUME_MARGIN = 0.1
# Plain steps after drafting that run slower (see Exploration; spec_serving.md, 2026-12-03 14:20 / 14:26).
SETTLE_STEPS = 2


class SpecPolicyMode(enum.StrEnum):
    ADAPTIVE = "adaptive"
    FIXED = "fixed"


def batch_bucket(batch_size: int) -> int:
    """Buckets of similar cost: exact up to 4, then halfway points between powers of two."""
    if batch_size <= 4:
        return batch_size
    p = 1 << (batch_size.bit_length() - 1)
    return p if batch_size < p + p // 2 else p + p // 2


def paired_ratio(timed_k: list[tuple[float, int]], timed_0: list[tuple[float, int]]) -> float:
    """C(k)/C(0) from (seconds, batch size) steps of k and of k=0 timed in one bucket: batch size by
    batch size where both were timed at one, else per row. A bucket spans up to a third more rows
    (12..15), and under load the batch moves within it during a measurement: a verify step's cost
    grows with its rows where a plain one's hardly does, so k steps at the bucket's low end against
    k=0 steps at its high end would make k look cheaper than it is and have the policy draft where
    drafting loses (benchmarks/results/spec_serving.md)."""
    common = {n for _, n in timed_k} & {n for _, n in timed_0}
    if common:
        return statistics.median(statistics.median(t for t, n in timed_k if n == rows)
                                 / statistics.median(t for t, n in timed_0 if n == rows) for rows in common)
    return statistics.median(t / n for t, n in timed_k) / statistics.median(t / n for t, n in timed_0)


@dataclass
class Ewma:
    value: float
    count: int = 0

    def update(self, x: float, alpha: float) -> None:
        self.value = x if self.count == 0 else self.value + alpha * (x - self.value)
        self.count += 1


@dataclass
class RecentMedian:
    """Median of the last `size` samples, each stamped with the bucket's decision counter. On a
    shared machine step times spike (another process takes the core), and one spike must not
    flip the decision the way it moves a mean."""

    size: int = 9
    samples: deque = field(default_factory=deque)  # (stamp, seconds, batch size)
    count: int = 0
    _median: float | None = None  # cached: steps are timed every step, read only when deciding afresh

    def update(self, stamp: int, x: float, batch_size: int = 0) -> None:
        self.samples.append((stamp, x, batch_size))
        if len(self.samples) > self.size:
            self.samples.popleft()
        self.count += 1
        self._median = None

    @property
    def value(self) -> float:
        if self._median is None:
            self._median = statistics.median(x for _, x, _ in self.samples) if self.samples else 0.0
        return self._median


@dataclass
class BucketCosts:
    """Step seconds per k for one batch-size bucket."""

    steps: list[RecentMedian]
    last_measured: list[int]          # decision counter when each k was last explored
    decisions: int = 0
    explorations: int = 0
    confirmed: int = 0                # re-measurements in a row that left the decision as it was

    ratios: list[RecentMedian] = field(default_factory=list)  # per k: C(k) / C(0) from explorations
    visits: Ewma = field(default_factory=lambda: Ewma(0.0))   # decisions per visit (the batch staying here)

    def ratio(self, k: int) -> float | None:
        return self.ratios[k].value if self.ratios[k].count else None


BucketKey = tuple[int, bool]  # (batch_bucket, whether the step samples)


@dataclass
class Exploration:
    """k held for a few steps, compared with k=0 steps right next to it: on a machine whose speed
    drifts (other processes come and go) the ratio of the two compares like with like. The k=0 steps
    are those just before when there are (a k=0 regime), else k=0 held right after, past the
    `SETTLE_STEPS` that follow drafting: on a CPU the plain steps right after drafting run slower
    for a while (the forward and the sampler alike: the heavier steps' after-effects on the caches),
    and timing those would make k look cheaper than it is when held."""

    bucket: BucketKey
    k: int
    plan: list[int]
    before: int | None = None         # a re-measurement: the bucket's decision when it started
    timed_k: list[tuple[float, int]] = field(default_factory=list)  # (seconds, batch size)
    timed_0: list[tuple[float, int]] = field(default_factory=list)


@dataclass
class Held:
    """A k=0 decision kept for a few decisions of its bucket without re-evaluating the estimates
    (whose cost is not negligible on a big batch's step), unless the re-measurement it was waiting
    for falls due."""

    bucket: BucketKey
    until: int                        # the bucket's decision counter up to which it holds
    stale: int                        # the k whose re-measurement is next
    interval: int
    batch_size: int                   # the batch size it was decided at (for holds_k0)
    costs: BucketCosts
    due_from: int                     # the first decision at which the re-measurement may fall due


@dataclass
class SpecPolicy:
    num_spec: int
    mode: SpecPolicyMode = SpecPolicyMode.ADAPTIVE
    # The knobs: each switches a mechanism whose cost or gain a run showed (cited as above), and the
    # tests turn it to single the mechanism out. Re-measuring and its back-off: bench_spec.txt (2026-12-01 18:40,
    # 92cf44b: the b16/b32 losses were the measurements and their backfill).
    explore_every: int = 500          # decisions per bucket between re-measurements (at most) ...
    first_reexplore: int = 32         # ... starting this soon and doubling
    # Re-measure a k in use whose recent median is this far off its estimate (bench_spec.txt,
    # 2026-12-03 12:36, f52e291; spec_serving.md, 2026-12-03 14:20 / 14:26: a tighter one re-measured on noise).
    surprise: float = 0.25
    # A k=0 decision stands this many decisions, without the estimates' bookkeeping (see Held;
    # bench_spec.txt, 2026-12-03 12:36, be28ee0).
    hold_decisions: int = 32
    acceptance: list[Ewma] = field(default_factory=list)
    buckets: dict[BucketKey, BucketCosts] = field(default_factory=dict)
    # The engine's time between runner steps: the median of the last few, not a mean. On a decode engine
    # some gaps carry per-request work (a prompt's KV landing) or another process's turn on the core,
    # which drafting does not amortise; counted as per-step overhead they made drafting look better.
    overhead: RecentMedian = field(default_factory=lambda: RecentMedian(size=31))
    chosen_k_counts: list[int] = field(default_factory=list)  # decisions per k (exported as a metric)
    _exploration: Exploration | None = None
    _clock: int = 0                   # decisions so far, every bucket
    _drafted_at: int = -(1 << 30)     # the _clock of the last decision to draft
    _held: Held | None = None
    _current: BucketKey | None = None  # the bucket of the last decision ...
    _streak: int = 0                  # ... and how many decisions in a row it has been
    # Per bucket, every bucket nearest first (see _nearest); rebuilt when a bucket is added.
    _order: dict[BucketKey, list[BucketKey]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.acceptance = [Ewma(PRIOR_ACCEPTANCE) for _ in range(self.num_spec)]
        self.chosen_k_counts = [0] * (self.num_spec + 1)

    # -- observations ----------------------------------------------------------------------

    def record_acceptance(self, num_drafts: list[int], num_accepted: list[int]) -> None:
        """One verify step: row r verified num_drafts[r] drafts and accepted num_accepted[r]."""
        self._held = None
        for i in range(self.num_spec):
            seen = [m > i for k, m in zip(num_drafts, num_accepted) if k > i and m >= i]
            if not seen:
                continue
            est, n = self.acceptance[i], len(seen)
            if not est.count and i:
                # The prior of a later position: the one before it (conditional acceptance varies
                # little along the chain on the bundled model, benchmarks/results/bench_spec.txt).
                est.value = self.acceptance[i - 1].value
            # A plain mean of everything seen, the prior counted as `PRIOR_DRAFTS` of them, until
            # there are 1/alpha observations (the first few drafts must not count for more than they
            # are worth: a later position sees drafts only while k reaches it, and 16 unlucky ones in
            # a warm-up kept k=2 out at batch 1, T=1, for thousands of steps), an EWMA after that;
            # a batch of n observations weighs like n single updates.
            alpha = max(1 - (1 - ACCEPTANCE_ALPHA) ** n, n / (est.count + n + PRIOR_DRAFTS))
            est.value += alpha * (sum(seen) / n - est.value)
            est.count += n

    def record_step(self, batch_size: int, k: int, seconds: float, sampled: bool = False) -> None:
        """The time of a step steady at k (InputBatch.steady_with: every row decoded and verified k
        drafts; no stash flush) that proposed k for the next; `sampled`: some row drew from a
        distribution (else all are greedy)."""
        costs = self._bucket(batch_size, sampled)
        costs.steps[k].update(costs.decisions, seconds, batch_size)
        e = self._exploration
        if e is not None and e.bucket == (batch_bucket(batch_size), sampled) and k in (e.k, 0):
            (e.timed_k if k == e.k else e.timed_0).append((seconds, batch_size))

    def record_overhead(self, seconds: float) -> None:
        """Engine time between two runner steps (scheduling, output processing)."""
        self.overhead.update(self._clock, seconds)

    # -- the decision ----------------------------------------------------------------------

    def expected_tokens(self, k: int) -> float:
        total, run = 1.0, 1.0
        for i in range(k):
            run *= self.acceptance[i].value
            total += run
        return total

    def choose(self, batch_size: int, pending: int = 0, sampled: bool = False) -> int:
        """k for the next step of `batch_size` sampling rows; `pending`: the positions whose MTP
        layer those rows skipped so far (the backfill the first drafting step would pay);
        `sampled`: some row samples (else all are greedy)."""
        if self.mode is SpecPolicyMode.FIXED or batch_size == 0:
            k = self.num_spec
        else:
            k = self._adaptive(batch_size, pending, sampled)
        self.chosen_k_counts[k] += 1
        self._clock += 1
        if k:
            self._drafted_at = self._clock
        return k

    def holds_k0(self, batch_size: int, sampled: bool = False) -> bool:
        """Whether the held k=0 decision stands for this decision (then counted as chosen) without
        looking at anything else: same batch size and kind of step, and no re-measurement can fall
        due yet (else choose() decides, from the pending backfill). Most steps under load end here."""
        held = self._held
        if (held is None or held.batch_size != batch_size or held.bucket[1] != sampled
                or held.costs.decisions >= min(held.until, held.due_from - 1)):
            return False
        held.costs.decisions += 1
        self.chosen_k_counts[0] += 1
        self._clock += 1
        self._streak += 1  # (the same batch size: the same bucket)
        return True

    def _adaptive(self, batch_size: int, pending: int, sampled: bool) -> int:
        bucket = (batch_bucket(batch_size), sampled)
        costs = self._bucket(batch_size, sampled)
        costs.decisions += 1
        self._visit(bucket)
        e = self._exploration
        if e is not None and e.bucket == bucket and e.plan:
            return e.plan.pop(0)
        if e is None and self._holds(bucket, costs, pending, batch_size):
            return 0
        self._held = None
        if e is not None:
            self._finish(e)
        estimates = self.cost_estimates(bucket)

        unmeasured = self._unmeasured(bucket, costs)
        # A bucket passed through briefly (a batch draining, or filling up again under load: each
        # time for a few steps) decides from its neighbours' timings, and a measurement started there
        # would be abandoned when the batch moves on; one the batch stays at, or one nothing is known
        # about, gets measured.
        stays = self._stays(costs)
        settled = stays or None in estimates
        interval = self._interval(costs)
        stale = stalest = min(range(self.num_spec + 1), key=lambda k: costs.last_measured[k])
        if self.num_spec > 1 and estimates[0] is not None and not self.best_k(bucket, estimates):
            # Not drafting wins: only the k that comes closest is re-measured on schedule (at a big
            # batch each measurement costs a few steps at several times a plain one, plus the backfill and the
            # slow plain steps after it); the others rarely.
            rates = self._rates(estimates)
            stale = max(range(1, self.num_spec + 1), key=rates.__getitem__)
            if costs.decisions - costs.last_measured[stalest] > OTHERS_EVERY * interval:
                stale = stalest
        # A due re-measurement, and a warm-up (the rows of a bucket that settles have been skipping the
        # MTP layer at their previous batch size), wait for a moment with little backfill to pay
        # (new rows, a flush), up to 4 intervals (a warm-up: 4 first ones, see below).
        little = pending <= BACKFILL_PER_ROW * batch_size
        due = stays and self._due(costs, stale, interval, little)
        # Resuming drafting first pays the backfill of every skipped position: with much of it
        # pending, drafting must win by `RESUME_MARGIN` more (near break-even, the decision would
        # flip with the noise and pay a backfill at each flip).
        best = self.best_k(bucket, estimates, 0.0 if little else RESUME_MARGIN)
        if not due and self._surprised(costs, best, estimates):
            stale, due = best, True
        # (The warm-up's wait is bounded by the first re-measurement interval, not the current one, which
        # grows with every measurement: the last k of a warm-up would wait ~1000 decisions for its turn.)
        warm = bool(unmeasured) and settled and (unmeasured[0] == 0 or little or costs.decisions
                                                 > SETTLE_DECISIONS + 4 * self.first_reexplore)
        if warm or due:
            return self._explore(bucket, costs, unmeasured[0] if warm else stale, None if warm else best)
        # (Held only when k=0 wins without the resume margin too: else a drop in pending resumes at once.)
        if not best and not unmeasured and (little or not self.best_k(bucket, estimates)):
            self._held = Held(bucket, costs.decisions + self.hold_decisions, stale, interval, batch_size, costs,
                              costs.last_measured[stale] + interval + 1)
        return best

    def _visit(self, bucket: BucketKey) -> None:
        """Count the decision towards the current visit of `bucket` (a visit ends when a decision is
        taken at another bucket)."""
        if bucket != self._current:
            if self._current is not None:
                self.buckets[self._current].visits.update(self._streak, 0.25)
            self._current, self._streak = bucket, 0
        self._streak += 1

    def _stays(self, costs: BucketCosts) -> bool:
        """Whether the batch stays at the current bucket (`costs`): for a while now, or usually (so a
        re-measurement may start as the batch arrives, when the rows have the least backfill pending)."""
        return self._streak > SETTLE_DECISIONS or costs.visits.value > SETTLE_DECISIONS

    def _unmeasured(self, bucket: BucketKey, costs: BucketCosts) -> list[int]:
        """The k, largest first, that `bucket` has not measured enough yet (its warm-up)."""
        def unmeasured_k(k: int) -> bool:
            if not k:
                return costs.steps[0].count < WARMUP_SAMPLES
            # One measurement of its own suffices where a neighbour has measured k already: the
            # ratios of nearby batch sizes are alike, and one ratio still carries the full doubt.
            count = costs.ratios[k].count
            return count < 1 or (count < WARMUP_PAIRS and not self._neighbour_measured(bucket, k))

        return [k for k in range(self.num_spec, -1, -1) if unmeasured_k(k)]

    def warmed_up(self, batch_size: int, sampled: bool = False) -> bool:
        """Whether the bucket of `batch_size` has measured every k and is not measuring
        one now (benchmarks time the steady state: a long-running server pays its warm-up once)."""
        if self.mode is SpecPolicyMode.FIXED:
            return True
        bucket = (batch_bucket(batch_size), sampled)
        costs = self.buckets.get(bucket)
        if costs is None or (self._exploration is not None and self._exploration.bucket == bucket):
            return False
        return not self._unmeasured(bucket, costs)

    def _holds(self, bucket: BucketKey, costs: BucketCosts, pending: int, batch_size: int) -> bool:
        """Whether the held k=0 decision (if any) still stands for this decision of `bucket`."""
        held = self._held
        return (held is not None and held.bucket == bucket and costs.decisions <= held.until
                and not self._due(costs, held.stale, held.interval, pending <= BACKFILL_PER_ROW * batch_size))

    def _explore(self, bucket: BucketKey, costs: BucketCosts, k: int, before: int | None) -> int:
        """Start measuring k at `bucket`: hold k (its first step is a transition, not timed), and take
        the k=0 steps just before it for the ratio, else hold k=0 right after; `before`: the decision
        a re-measurement may confirm."""
        costs.explorations += 1
        settled = self._clock - self._drafted_at > SETTLE_STEPS + HOLD_STEPS
        recent = [(x, rows) for stamp, x, rows in costs.steps[0].samples
                  if settled and stamp >= costs.decisions - HOLD_STEPS]
        after = k and len(recent) < HOLD_STEPS
        plan = [k] * HOLD_STEPS + ([0] * (SETTLE_STEPS + HOLD_STEPS + 1) if after else [])
        costs.last_measured[k] = costs.last_measured[0] = costs.decisions
        self._exploration = Exploration(bucket, k, plan, before, timed_0=[] if after else recent)
        return k

    def _due(self, costs: BucketCosts, stale: int, interval: int, little: bool) -> bool:
        """Whether re-measuring `stale` is due: overdue, and a moment with little backfill to pay
        (or overdue by 4 intervals)."""
        overdue = costs.decisions - costs.last_measured[stale]
        return overdue > interval and (little or overdue > 4 * interval)

    def _finish(self, e: Exploration) -> None:
        """Record a finished (or abandoned: the batch moved on) measurement's ratio C(k)/C(0)."""
        self._held = None
        if e.k and e.timed_k and e.timed_0:
            ratio = paired_ratio(e.timed_k, e.timed_0[-HOLD_STEPS:])
            explored = self.buckets[e.bucket]
            explored.ratios[e.k].update(explored.decisions, ratio)
            if e.before is not None:
                explored.confirmed = explored.confirmed + 1 if self.best_k(e.bucket) == e.before else 0
        self._exploration = None

    def _interval(self, costs: BucketCosts) -> int:
        """Decisions between re-measurements: early and often while the estimates rest on few
        samples, then every explore_every, doubling (at most three times) while re-measurements keep confirming
        the decision (at a batch where drafting is near break-even each one costs a backfill
        transition and changes nothing)."""
        every = self.explore_every << min(costs.confirmed, 3)
        return min(every, self.first_reexplore << costs.explorations)

    def _surprised(self, costs: BucketCosts, k: int, estimates: list[float | None]) -> bool:
        """Whether the k in use costs clearly more or less than its estimate (k=0's cost times the
        measured ratio): the workload or the machine changed since the ratio was measured. Judged
        on a full window of steps since k was last measured, and not sooner than 4 windows after."""
        since, window = costs.last_measured[k], costs.steps[k].size
        if not k or estimates[k] is None or costs.decisions - since <= 4 * window:
            return False
        recent = [x for stamp, x, _ in costs.steps[k].samples if stamp > since + 2 * HOLD_STEPS + 1]
        if len(recent) < window:
            return False
        return abs(statistics.median(recent) / estimates[k] - 1) > self.surprise

    def _neighbour_measured(self, bucket: BucketKey, k: int) -> bool:
        """Whether another bucket within a factor of 2 in batch size has a warmed-up ratio for k."""
        size = bucket[0]
        return any(key != bucket and size / 2 <= key[0] <= size * 2 and c.ratios[k].count >= WARMUP_PAIRS
                   for key, c in self.buckets.items())

    def cost_estimates(self, bucket: BucketKey) -> list[float | None]:
        """Seconds per step for each k at `bucket`: k=0 as measured (or read off other buckets, see
        _between); k>0 as that times the measured ratio C(k)/C(0) here (or read off others the same
        way), else the raw measurement."""
        base = self._between(bucket, lambda c: c.steps[0].value if c.steps[0].count else None)
        out: list[float | None] = [base]
        for k in range(1, self.num_spec + 1):
            ratio = self._between(bucket, lambda c, k=k: c.ratio(k))
            if ratio is not None and base is not None:
                out.append(base * ratio)
            else:
                out.append(self._nearest(bucket, lambda c, k=k: c.steps[k].value if c.steps[k].count else None))
        return out

    def _between(self, bucket: BucketKey, get) -> float | None:
        """`get` of `bucket` itself, else interpolated linearly in batch size between the nearest
        smaller and larger buckets of the same kind of step that have it, else the nearest bucket's.
        A step's cost and its ratios C(k)/C(0) grow with the rows, so a batch draining through 4 rows
        that took batch 1's C(2)/C(0) would judge k=2 cheaper than it is at 4 rows and draft where it
        loses (the buckets a batch only passes through have no measurements of their own;
        benchmarks/results/spec_serving.md)."""
        own = self.buckets.get(bucket)
        if own is not None and (value := get(own)) is not None:
            return value
        size, sampled = bucket
        below = above = None  # (batch bucket, value)
        for (other, kind), costs in self.buckets.items():
            if kind != sampled or (value := get(costs)) is None:
                continue
            if other < size and (below is None or other > below[0]):
                below = (other, value)
            elif other > size and (above is None or other < above[0]):
                above = (other, value)
        if below is None or above is None:
            return self._nearest(bucket, get)
        (x0, y0), (x1, y1) = below, above
        return y0 + (y1 - y0) * (size - x0) / (x1 - x0)

    def _nearest(self, bucket: BucketKey, get) -> float | None:
        """`get` of the nearest bucket that has it: the closest batch size (what a step's cost ratios
        depend on most), the same kind of step first among equals."""
        size, sampled = bucket
        order = self._order.get(bucket)
        if order is None:  # (called several times a step: sort once per bucket, not per call)
            order = self._order[bucket] = sorted(self.buckets, key=lambda b: (abs(b[0] - size), b[1] != sampled, b))
        for key in order:
            value = get(self.buckets[key])
            if value is not None:
                return value
        return None

    def best_k(self, bucket: BucketKey | int, estimates: list[float | None] | None = None, extra: float = 0.0) -> int:
        """The k of the highest expected tokens/s. Drafting must beat k=0 by `margin` plus a doubt
        that shrinks with the number of cost ratios behind it (timings are noisy, and in doubt
        not drafting is the safe choice). An int `bucket` means greedy steps; `estimates`: the
        bucket's cost_estimates, when the caller has them; `extra`: margin on top (resuming)."""
        if isinstance(bucket, int):
            bucket = (bucket, False)
        if estimates is None:
            estimates = self.cost_estimates(bucket)
        if estimates[0] is None:
            return self.num_spec
        rates = self._rates(estimates)
        best = max(range(1, self.num_spec + 1), key=rates.__getitem__, default=0)
        # The fewest drafts within `margin` of the best: a longer chain must win clearly too (its
        # estimate rests on the acceptance of later positions and on noisier, costlier timings).
        best = min((k for k in range(1, best + 1) if rates[k] * MARGIN >= rates[best]), default=best)
        evidence = self._nearest(bucket, lambda c: c.ratios[best].count or None) or 1
        return best if rates[best] > rates[0] * (MARGIN + extra + DOUBT / evidence) else 0

    def _rates(self, estimates: list[float | None]) -> list[float]:
        """Expected tokens per second of each k (0.0 where its cost is unknown)."""
        overhead = self.overhead.value
        return [self.expected_tokens(k) / (c + overhead) if c is not None else 0.0 for k, c in enumerate(estimates)]

    def _bucket(self, batch_size: int, sampled: bool = False) -> BucketCosts:
        bucket = (batch_bucket(batch_size), sampled)
        costs = self.buckets.get(bucket)
        if costs is None:
            n = self.num_spec + 1
            costs = BucketCosts([RecentMedian() for _ in range(n)], [0] * n, ratios=[RecentMedian() for _ in range(n)])
            self.buckets[bucket] = costs
            self._order.clear()
        return costs

    def summary(self) -> str:
        acc = " ".join(f"{a.value:.2f}" for a in self.acceptance)
        parts = []
        for (bucket, sampled), costs in sorted(self.buckets.items()):
            ms = " ".join(f"{c.value * 1e3:.1f}" for c in costs.steps)
            ratios = " ".join(f"{r:.2f}" if (r := costs.ratio(k)) is not None else "-"
                              for k in range(1, self.num_spec + 1))
            kind = " sampled" if sampled else ""
            parts.append(f"b{bucket}{kind}: [{ms}] ms, C(k)/C(0) [{ratios}] -> k={self.best_k((bucket, sampled))} "
                         f"({costs.explorations} measurements in {costs.decisions} decisions)")
        return f"acceptance [{acc}]; " + "; ".join(parts)

"""The statistics of timings, in one place for the runner and the results: summaries of rounds,
the one bootstrap (paired rounds of a group, or two runs' rounds resampled apart), speedups and
their 95% intervals, the precision a speedup met, the stop rule that reads them, and the rounds a
burst of load disturbed.

The runner's side only (the main environment, with SciPy): the worker side times rounds
(:mod:`harness.worker.measure`) and never summarises them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from harness.spec.errors import HarnessError
from harness.spec.status import StopReason
from harness.spec.timing import MIN_BLOCK_ROUNDS, TimingRules  # read at call time: a test may change it here

MIN_PRECISION_ROUNDS = 10  # a 95% interval from fewer paired rounds is too coarse to call precise


def half_width(point: float, lo: float, hi: float) -> float:
    """The larger side of the interval ``[lo, hi]`` relative to ``point`` (NaN without an interval)."""
    if not (point > 0 and lo == lo and hi == hi):  # NaN compares unequal to itself
        return float("nan")
    return max(hi - point, point - lo) / point


def precision_met(point: float, lo: float, hi: float, n_rounds: int, target: float) -> bool:
    """True when a speedup's interval is within ``target`` of it (relative) from enough paired rounds."""
    w = half_width(point, lo, hi)
    return n_rounds >= MIN_PRECISION_ROUNDS and w == w and w <= target


@dataclass
class Stats:
    """Summary of per-call times in seconds."""

    median_s: float
    iqr_s: float
    min_s: float
    mean_s: float
    stdev_s: float
    n_samples: int

    @classmethod
    def of(cls, samples) -> "Stats":
        a = np.asarray(samples, dtype=np.float64)
        if a.size == 0:
            nan = float("nan")
            return cls(nan, nan, nan, nan, nan, 0)
        q1, med, q3 = np.percentile(a, [25, 50, 75])
        return cls(float(med), float(q3 - q1), float(a.min()), float(a.mean()),
                   float(a.std(ddof=1)) if a.size > 1 else 0.0, int(a.size))

    def as_dict(self) -> dict:
        return asdict(self)



SPREAD_LIMIT = 0.10  # an IQR above this share of the median makes the median less trustworthy


def spread(iqr_s: float, median_s: float) -> float:
    """The IQR relative to the median (NaN without a median)."""
    return iqr_s / median_s if median_s else float("nan")


def paired_speedup(baseline, other, n_boot: int = 2000, seed: int = 0, blocks=None) -> tuple[float, float, float]:
    """One speedup ``median(baseline) / median(other)`` with its 95% interval: :func:`speedup_intervals`
    of that pair alone (the variation between its blocks is then learnt from its own blocks only)."""
    return speedup_intervals({0: (baseline, other, blocks)}, n_boot, seed)[0]


def speedup_intervals(pairs: dict, n_boot: int = 2000, seed: int = 0) -> dict:
    """Speedups ``median(baseline) / median(other)`` over rounds taken in turn, with 95% intervals, for
    the pairs of one comparison group: ``{key: (baseline, other, blocks)} -> {key: (point, lo, hi)}``.

    A rerun differs from a run in two ways, and the interval covers both (a two-level model of rounds
    within worker processes, as in Kalibera and Jones, "Rigorous benchmarking in reasonable time", 2013):

    - the rounds: round ``i`` of both sides ran back to back, so a bootstrap that resamples round
      indices jointly (within each block) measures how far the medians move from round noise, while
      drifts of the machine that hit both sides cancel out;
    - the blocks: ``blocks`` labels each round with the fresh worker process that took it
      (:meth:`harness.spec.timing.TimingRules.round_process`: every process of every pass). A process
      is an independent draw of what no round can resample: its memory layout, the kernels a library
      picked at start, when in the run it was taken. How far the speedups of a pair's blocks scatter
      beyond what their rounds explain estimates that variance; a pair has two or three blocks, too few
      to estimate it alone, so the estimate is pooled over the pairs of the group (a variance in
      relative terms: the speedups' logarithms), its degrees of freedom summed. A pair whose blocks
      scatter far more than the others' (an F test at 1%: a backend that depends on its process much
      more than the rest) is left out of the pool and keeps its own estimate, with its own few
      degrees of freedom, so that neither it nor the pool is misjudged.

    Each side of the interval (in the logarithm) is Student's t times the root of the two variances:
    the rounds' (the bootstrap's reach on that side, in standard errors) and the blocks' over the
    pair's blocks, with Satterthwaite's degrees of freedom (those of the pool counted less what its
    pairs share through the baseline's rounds, :func:`_shared_degrees_of_freedom`): more blocks
    narrow it, more rounds only narrow the round term. Without a second block anywhere in the group
    the interval covers the rounds alone.

    The bootstrap also takes a block's rounds as exchangeable, which they are not when the machine's
    state changes how the two sides compare (another tenant's load slowed NumPy by 40% and native by
    15% for a few seconds on the 2-core development VM). So the interval also covers half the
    difference between the speedups of the pair's first and second halves (from MIN_BLOCK_ROUNDS rounds
    each): where both halves agree this adds nothing, where they disagree no amount of further rounds
    from the same stretch narrows it below that.
    """
    parts = {key: _Pair.of(b, o, blocks, n_boot, seed) for key, (b, o, blocks) in pairs.items()}
    pooled = between_block_variance(parts)
    return {key: part.interval(*pooled[key]) for key, part in parts.items()}


@dataclass
class _Pair:
    """One speedup's pieces before the block variance is pooled: the point, the bootstrap's interval and
    its standard error (of the logarithm), the blocks' own log speedups with their rounds, the halves' check."""

    point: float
    lo: float = float("nan")
    hi: float = float("nan")
    within: float = float("nan")  # standard error of log(point) from the rounds (resampled within blocks)
    n: int = 0
    block_logs: tuple = ()  # log speedup of each block of MIN_BLOCK_ROUNDS rounds or more
    block_ids: tuple = ()  # those blocks' labels
    block_rounds: tuple = ()
    drift: float = 0.0  # one standard error of the halves' disagreement, in ratio terms

    @classmethod
    def of(cls, baseline, other, blocks, n_boot: int, seed: int) -> "_Pair":
        b = np.asarray(baseline, dtype=np.float64)
        o = np.asarray(other, dtype=np.float64)
        n = min(b.size, o.size)
        if n == 0:
            return cls(float("nan"))
        b, o = b[:n], o[:n]
        point = float(np.median(b) / np.median(o))
        if n < 3:
            return cls(point, n=n)
        labels = np.asarray(list(blocks)[:n]) if blocks is not None else np.zeros(n, dtype=int)
        if labels.size < n:  # rounds of no known block: one of their own
            labels = np.concatenate([labels, np.full(n - labels.size, -1)])
        strata = [np.flatnonzero(labels == k) for k in np.unique(labels)]
        med_b, med_o = resampled_medians([b, o], n_boot, np.random.default_rng(seed),
                                         strata if len(strata) > 1 else None)
        ratios = med_b / med_o
        lo, hi = np.percentile(ratios, [2.5, 97.5])
        # the percentile interval's half-width in standard errors: a resampled median is lumpy, and its
        # standard deviation overstates the spread its central 95% show
        within = float(np.log(hi / lo) / (2 * 1.959964)) if lo > 0 else float("nan")
        full = [(k, i) for k, i in zip(np.unique(labels), strata) if i.size >= MIN_BLOCK_ROUNDS]
        logs = tuple(float(np.log(np.median(b[i]) / np.median(o[i]))) for _, i in full)
        drift = 0.0
        if n >= 2 * MIN_BLOCK_ROUNDS:  # the stretch's two halves, adjacent in time: a drift check, one standard error
            drift = _block_standard_error(b, o, [slice(0, n // 2), slice(n // 2, n)])
        return cls(point, float(lo), float(hi), within, n, logs, tuple(int(k) for k, _ in full),
                   tuple(i.size for _, i in full), drift)

    @property
    def block_variance(self) -> float:
        """The variance of this pair's block log speedups (NaN with fewer than two blocks)."""
        return float(np.var(self.block_logs, ddof=1)) if len(self.block_logs) > 1 else float("nan")

    @property
    def excess(self) -> tuple[float, int]:
        """The variance of this pair's block log speedups beyond what their rounds explain, and its
        degrees of freedom (0 with fewer than two blocks)."""
        k = len(self.block_logs)
        if k < 2 or not self.within == self.within:
            return 0.0, 0
        rounds_part = float(np.mean([self.within ** 2 * self.n / m for m in self.block_rounds]))
        return self.block_variance - rounds_part, k - 1

    def interval(self, between: float, df: int) -> tuple[float, float, float]:
        point = self.point
        if not self.within == self.within:
            return point, self.lo, self.hi
        k = max(1, len(self.block_logs))
        block_term = between / k if df else 0.0
        variance = self.within ** 2 + block_term
        rounds_df = max(1, self.n - k)
        df_eff = variance ** 2 / ((block_term ** 2 / df if df else 0.0) + self.within ** 4 / rounds_df) \
            if variance > 0 else rounds_df
        t = t_quantile(0.975, df_eff)
        # each side keeps the bootstrap's own reach (a resampled median's interval is not symmetric), in
        # standard errors, and adds the block term to it
        below, above = (float(np.log(point / self.lo)) / 1.959964, float(np.log(self.hi / point)) / 1.959964) \
            if self.lo > 0 else (self.within, self.within)
        lo = point * float(np.exp(-t * np.sqrt(below ** 2 + block_term)))
        hi = point * float(np.exp(t * np.sqrt(above ** 2 + block_term)))
        if self.drift:  # in ratio terms (point times e^(-+w/point)): a wide one never reaches zero or below
            lo, hi = min(lo, point * float(np.exp(-self.drift / point))), max(hi, point * float(np.exp(self.drift / point)))
        return point, float(lo), float(hi)


HETEROGENEITY_LEVEL = 0.99  # a pair's blocks scatter beyond the pool's at this F quantile: it keeps its own estimate


def between_block_variance(parts: dict) -> dict:
    """Per pair (``{key: _Pair}``), the variance of a block's log speedup beyond its rounds' noise to use,
    and its degrees of freedom: pooled over the pairs (weighted by their degrees of freedom; never below
    0), save those whose blocks scatter significantly more than the rest of the pool's, which keep their
    own. ``(0, 0)`` where nothing in the group has two blocks."""
    from scipy.stats import f

    excess = {k: p.excess for k, p in parts.items()}
    total = {k: p.block_variance for k, p in parts.items()}
    pool = {k for k, (_, d) in excess.items() if d > 0}
    while len(pool) > 1:  # leave out the pair that stands out most, until none does
        worst, worst_ratio = None, 1.0
        for k in pool:
            rest_df = sum(excess[j][1] for j in pool if j != k)
            rest = sum(total[j] * excess[j][1] for j in pool if j != k) / rest_df
            ratio = total[k] / rest if rest > 0 else float("inf")
            if ratio > f.ppf(HETEROGENEITY_LEVEL, excess[k][1], rest_df) and ratio > worst_ratio:
                worst, worst_ratio = k, ratio
        if worst is None:
            break
        pool.discard(worst)
    df = sum(excess[k][1] for k in pool)
    between = max(0.0, sum(excess[k][0] * excess[k][1] for k in pool) / df) if df else 0.0
    df = _shared_degrees_of_freedom([parts[k] for k in pool], df)
    return {k: ((max(0.0, excess[k][0]), excess[k][1]) if excess[k][1] and k not in pool else (between, df))
            for k in parts}


def _shared_degrees_of_freedom(pool: list, df: int) -> float:
    """The degrees of freedom of the pooled block variance, less what the pairs share.

    Every speedup of a group is over the same baseline rounds: the baseline's process effects (and
    its rounds' noise) enter every pair's blocks alike, so that part of the pooled variance has only
    the blocks' own degrees of freedom, however many pairs there are. How much of it is shared is
    what the pairs' block deviations have in common (their mean cross-product over their mean
    square); Satterthwaite's formula then weighs the shared part's few degrees of freedom and the
    rest's many."""
    devs = []
    for p in pool:
        mean = float(np.mean(p.block_logs))
        devs.append({k: v - mean for k, v in zip(p.block_ids, p.block_logs)})
    if len(devs) < 2 or not df:
        return df
    cross, square = [], [sum(v * v for v in d.values()) / (len(d) - 1) for d in devs]
    for i in range(len(devs)):
        for j in range(i + 1, len(devs)):
            common = devs[i].keys() & devs[j].keys()
            if len(common) > 1:
                cross.append(sum(devs[i][k] * devs[j][k] for k in common) / (len(common) - 1))
    if not cross or not np.mean(square) > 0:
        return df
    shared = min(1.0, max(0.0, float(np.mean(cross) / np.mean(square))))
    own_df = max(1, int(np.median([len(d) for d in devs])) - 1)  # the blocks of one pair
    return 1.0 / (shared ** 2 / own_df + (1 - shared) ** 2 / df)


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (SciPy's)."""
    from scipy.stats import t

    return float(t.ppf(p, df))


def _block_standard_error(b: np.ndarray, o: np.ndarray, blocks: list) -> float:
    """One standard error of the mean of the speedups measured on each block of paired rounds
    (slices or index arrays; for two blocks, half their difference)."""
    per = [np.median(b[s]) / np.median(o[s]) for s in blocks]
    return float(np.std(per, ddof=1)) / np.sqrt(len(per))


def disturbed(samples: list[float]) -> list[bool]:
    """Which rounds a burst of load slowed: over 5% and over five robust standard deviations
    (1.4826 median absolute deviations) slower than the median of the cell's rounds.

    Only slow rounds: nothing makes code run faster than it can. The median and its
    deviation stay on the undisturbed rounds while fewer than half are disturbed."""
    import statistics

    if len(samples) < 4:
        return [False] * len(samples)
    med = statistics.median(samples)
    mad = statistics.median(abs(s - med) for s in samples)
    fence = med + max(5 * 1.4826 * mad, 0.05 * med)
    return [s > fence for s in samples]


BOOT_CHUNK = 1 << 21  # resampled values held at once (16 MB of indices), however many rounds a side has


def resampled_medians(arrays: list, n_boot: int, rng, strata: list | None = None) -> list:
    """The medians of ``n_boot`` bootstrap resamples of each of ``arrays`` (of one length), resampled
    jointly: resample ``i`` takes the same indices from every array, so paired rounds stay paired.
    With ``strata`` (index arrays that partition the rounds: a group's worker processes) each
    resample draws every stratum's rounds from that stratum alone. Drawn a block of resamples at a
    time so that memory stays bounded (without strata, the same draws, in the same order, as one
    ``(n_boot, n)`` array of indices). The project's one bootstrap."""
    n = len(arrays[0])
    rows = max(1, BOOT_CHUNK // n)
    out = [np.empty(n_boot) for _ in arrays]
    for start in range(0, n_boot, rows):
        k = min(rows, n_boot - start)
        if strata is None:
            idx = rng.integers(0, n, size=(k, n))
        else:
            idx = np.concatenate([s[rng.integers(0, s.size, size=(k, s.size))] for s in strata], axis=1)
        for x, med in zip(arrays, out):
            med[start:start + k] = np.median(x[idx], axis=1)
    return out


def ratio_interval(a, b, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float, float]:
    """``median(b) / median(a)`` of two sets of rounds timed apart (two runs), with a percentile-bootstrap
    interval, resampling each side on its own."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.size == 0 or b.size == 0:
        nan = float("nan")
        return nan, nan, nan
    point = float(np.median(b) / np.median(a))
    if a.size < 3 or b.size < 3:
        return point, float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    (med_a,) = resampled_medians([a], n_boot, rng)
    (med_b,) = resampled_medians([b], n_boot, rng)
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(med_b / med_a, [tail, 100 - tail])
    return point, float(lo), float(hi)


def mann_whitney_p(a, b) -> float:
    """Two-sided Mann-Whitney U p-value of two sets of rounds (NaN with fewer than 3 on a side)."""
    from scipy.stats import mannwhitneyu

    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.size < 3 or b.size < 3:
        return float("nan")
    if np.array_equal(np.sort(a), np.sort(b)):
        return 1.0
    return float(mannwhitneyu(a, b, alternative="two-sided").pvalue)


RECHECK_GROWTH = 1.25  # a cell short of its target is re-checked at most this much later (in rounds)


class StopRule:
    """When the interleaved rounds of a comparison group have enough samples.

    The floor: every cell has ``min_rounds`` rounds and ``min_time_s`` of timed calls. With a
    ``target`` (the config's ``speedup_precision``), the rounds also go on until the 95%
    interval of every speedup over ``baseline`` is within ``target`` of its value (at least
    MIN_PRECISION_ROUNDS pairs). Whatever is unmet, the group stops once it has run
    ``max_time_s`` per cell in all. The runner asks before every round (the first time with
    no samples) with the cells still running; a cell that fails drops out of ``samples``
    but its share of the time cap stays, as its failed request took time too. One rule
    object serves one group.

    In one pass (``pass_limit`` 1) the rounds go on for the target. With several passes (the
    runner visits the group again, later in the run, with fresh worker processes, and calls
    :meth:`start_pass` before each visit), every pass takes ``pass_rounds`` rounds and its
    share of ``min_time_s`` and no more: the rounds of one stretch cannot narrow what the
    interval learns from the passes' disagreement, more passes can. After ``passes`` passes
    the target is checked at the end of each; while it is unmet another pass follows (reason
    ``"pass"``), up to ``pass_limit`` passes and the time cap, for the cells in ``pending``
    (those still short of it) and the baseline: a cell whose speedup is precise is done.

    ``intervals({cell: (baseline_samples, samples, blocks)}) -> {cell: (point, lo, hi)}`` gives the
    intervals the results report (:func:`speedup_intervals`: the variation between blocks pooled over
    the group's speedups, the cells a later pass no longer times included), so stopping for precision
    and the ``precision_met`` column agree by construction. It costs milliseconds, too much for
    every round of a long group, so a cell found short of the target is only re-checked once
    its rounds reach where the shrinking of the interval (as one over the root of the rounds)
    predicts the target, and at most RECHECK_GROWTH times later.

    The rule stops on the interval's width, never on where it lies, so it does not steer the
    speedup itself; taking the first width under the target slightly favours a narrow draw,
    which the floor of MIN_PRECISION_ROUNDS pairs keeps small.

    After ``done`` returns True, ``reason`` (a :class:`StopReason`) says why; ``widths`` holds each cell's
    relative half-width at its last check."""

    def __init__(self, timing: TimingRules, intervals: Callable[[dict], dict] | None = None):
        """``timing``: the group's timing settings with their derived rules (a ``TimingConfig``);
        ``intervals``: what reports the group's speedups with their intervals, needed with a precision target."""
        if timing.speedup_precision is not None and intervals is None:
            raise HarnessError("a precision target needs the interval function that reports the speedups")
        self.timing = timing
        self.intervals = intervals
        self.pass_index = 0  # the pass under way, from 0
        self.n_cells = 0  # the most cells seen in one call: the cap's multiplier
        self.reason: StopReason | None = None
        self.widths: dict[str, float] = {}
        self.n_checks = 0  # interval evaluations so far (their cost is what the schedule bounds)
        self._next_check: dict[str, int] = {}  # cell -> rounds before its interval is worth computing again
        self._pass_start: dict[str, int] = {}  # cell -> its rounds before the pass under way
        self.pending: set[str] | None = None  # after a pass that checked the target: the cells still short of it

    @property
    def target(self) -> float | None:
        """The precision a speedup's interval must reach (``timing.speedup_precision``; None: the floor alone)."""
        return self.timing.speedup_precision

    # what of the rule carries from one pass to the next (a group run saves it between passes, so a
    # pass run on another process or host, or after --resume, stops by the same rule)
    _CARRIED = ("pass_index", "n_cells", "reason", "widths", "n_checks", "pending")

    def state(self) -> dict:
        """The rule's state between passes, as plain JSON values."""
        out = {k: getattr(self, k) for k in self._CARRIED}
        out["pending"] = sorted(self.pending) if self.pending is not None else None
        out["next_check"] = dict(self._next_check)
        return out

    def restore(self, state: dict | None) -> "StopRule":
        """Take up the state :meth:`state` saved (None: as new); returns the rule."""
        if state:
            for k in self._CARRIED:
                setattr(self, k, state[k])
            self.pending = set(state["pending"]) if state["pending"] is not None else None
            self._next_check = dict(state["next_check"])
        return self

    def start_pass(self, index: int, samples: dict[str, list[float]]) -> None:
        """Pass ``index`` (from 0) begins, after the rounds in ``samples`` (by cell id)."""
        self.pass_index = index
        self.reason = None
        self._pass_start = {c: len(s) for c, s in samples.items()}

    def done(self, samples: dict[str, list[float]], inner: dict[str, int], baseline: str | None,
             elapsed_s: float, blocks=None, settled: dict[str, list[float]] | None = None) -> bool:
        """True when the rounds so far (per-call seconds per round, by cell id; all passes) are
        enough, for now (``reason`` ``"pass"``) or for good.

        ``elapsed_s``: the seconds the group's rounds took so far, all passes; ``blocks``: each
        round's block label, for the intervals; ``settled``: the rounds of the group's cells this
        pass no longer times (their speedups were precise), which the intervals pool over too."""
        self.n_cells = max(self.n_cells, len(samples))
        capped = elapsed_s >= self.timing.max_time_s * max(1, self.n_cells)
        if self._floor(samples, inner):
            if self.pass_index + 1 < self.timing.pass_count:
                self.reason = StopReason.CAP if capped else StopReason.PASS
                return True
            if self.target is None or baseline not in samples or len(samples) < 2:
                self.reason = StopReason.FLOOR
                return True
            if self.timing.pass_limit > 1:  # the pass has its rounds; what it lacks, only another pass can give
                self.pending = self._short(samples, baseline, blocks, settled or {})
                if not self.pending:
                    self.reason = StopReason.TARGET
                elif self.pass_index + 1 < self.timing.pass_limit and not capped:
                    self.reason = StopReason.PASS
                else:
                    self.reason = StopReason.CAP
                return True
            if self._precise(samples, baseline, blocks, settled or {}):
                self.reason = StopReason.TARGET
                return True
        if capped:
            self.reason = StopReason.CAP
            return True
        return False

    def _floor(self, samples: dict[str, list[float]], inner: dict[str, int]) -> bool:
        """Every cell has this pass's rounds and share of the timed seconds, and from the ``passes``-th
        pass on the whole floor."""
        for c, s in samples.items():
            new = s[self._pass_start.get(c, 0):]
            if len(new) < self.timing.pass_rounds or sum(new) * inner[c] < self.timing.min_time_s / self.timing.pass_count:
                return False
            if self.pass_index + 1 >= self.timing.pass_count and (len(s) < self.timing.min_rounds or sum(s) * inner[c] < self.timing.min_time_s):
                return False
        return True

    def _check(self, samples: dict[str, list[float]], baseline: str, blocks, settled: dict) -> set[str]:
        """The cells of ``samples`` whose speedup's interval is not yet within the target; every interval
        computed at once (their block variation is pooled), each cell's width kept."""
        base = samples[baseline]
        pairs = {c: (base, s, blocks) for c, s in {**settled, **samples}.items() if c != baseline}
        short = set()
        for c, (point, lo, hi) in self.intervals(pairs).items():
            if c not in samples:
                continue
            self.n_checks += 1
            self.widths[c] = half_width(point, lo, hi)
            if not precision_met(point, lo, hi, min(len(base), len(samples[c])), self.target):
                short.add(c)
        return short

    def _short(self, samples: dict[str, list[float]], baseline: str, blocks, settled: dict) -> set[str]:
        """The cells whose speedup's interval is not yet within the target (every one is checked)."""
        return self._check(samples, baseline, blocks, settled)

    def _precise(self, samples: dict[str, list[float]], baseline: str, blocks, settled: dict) -> bool:
        """Every speedup's interval within the target, checked once every cell has the rounds its last
        check predicted it needs."""
        n_base = len(samples[baseline])
        cells = [c for c in samples if c != baseline]
        if any(min(n_base, len(samples[c])) < max(MIN_PRECISION_ROUNDS, self._next_check.get(c, 0)) for c in cells):
            return False
        short = self._check(samples, baseline, blocks, settled)
        for c in short:
            n, w = min(n_base, len(samples[c])), self.widths[c]
            predicted = n * (w / self.target) ** 2 if w == w else n + 1
            self._next_check[c] = int(min(max(predicted, n + 1), n * RECHECK_GROWTH + 1))
        return not short


def stop_rule(timing: TimingRules) -> StopRule:
    """A fresh stop rule for one group timed with ``timing`` (its ``TimingConfig``).

    A precision target reads the speedups' intervals through :func:`speedup_intervals`."""
    return StopRule(timing, speedup_intervals if timing.speedup_precision is not None else None)

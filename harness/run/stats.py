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
    """Speedup ``median(baseline) / median(other)`` over rounds taken in turn, with a 95% interval.

    Rounds are paired (round ``i`` of both ran back to back), so the bootstrap resamples
    round indices jointly: drifts of the machine that hit both sides cancel out.

    The bootstrap takes the rounds as exchangeable, which they are not when the machine's
    state changes how the two sides compare (another tenant's load slowed NumPy by 40% and
    native by 15% for a few seconds on the 2-core development VM). So the interval also
    covers half the difference between the speedups of the run's first and second halves
    (from MIN_BLOCK_ROUNDS rounds each): where both halves agree this adds nothing, where
    they disagree no amount of further rounds from the same stretch narrows it below that.

    ``blocks`` labels each round with the worker process that took it (see
    :meth:`harness.spec.timing.TimingRules.round_block`: one per fresh process, of every pass
    over the group). Blocks are independent draws of what a round cannot resample: which
    fresh process one got (its memory layout, the kernels a library picked at start) and
    when in the run it was taken. With ``k`` blocks of MIN_BLOCK_ROUNDS rounds or more, the
    interval also covers the 95% interval of the mean of the per-block speedups (Student's t
    with ``k - 1`` degrees of freedom times their standard error): two blocks must agree
    closely to give a tight figure, and more blocks narrow that term; more rounds do not.
    """
    b = np.asarray(baseline, dtype=np.float64)
    o = np.asarray(other, dtype=np.float64)
    n = min(b.size, o.size)
    if n == 0:
        nan = float("nan")
        return nan, nan, nan
    b, o = b[:n], o[:n]
    point = float(np.median(b) / np.median(o))
    if n < 3:
        return point, float("nan"), float("nan")
    med_b, med_o = resampled_medians([b, o], n_boot, np.random.default_rng(seed))
    lo, hi = np.percentile(med_b / med_o, [2.5, 97.5])
    widenings = []
    if n >= 2 * MIN_BLOCK_ROUNDS:  # the stretch's two halves, adjacent in time: a drift check, one standard error
        widenings.append(_block_standard_error(b, o, [slice(0, n // 2), slice(n // 2, n)]))
    if blocks is not None:
        labels = np.asarray(blocks[:n])
        by_block = [np.flatnonzero(labels == k) for k in np.unique(labels)]
        by_block = [i for i in by_block if i.size >= MIN_BLOCK_ROUNDS]
        if len(by_block) > 1:  # its processes and passes: independent draws, a t interval
            widenings.append(t_quantile(0.975, len(by_block) - 1) * _block_standard_error(b, o, by_block))
    for w in widenings:  # in ratio terms (point times e^(-+w/point)): a wide one never reaches zero or below
        lo, hi = min(lo, point * float(np.exp(-w / point))), max(hi, point * float(np.exp(w / point)))
    return point, float(lo), float(hi)


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


def resampled_medians(arrays: list, n_boot: int, rng) -> list:
    """The medians of ``n_boot`` bootstrap resamples of each of ``arrays`` (of one length), resampled
    jointly: resample ``i`` takes the same indices from every array, so paired rounds stay paired.
    Drawn a block of resamples at a time so that memory stays bounded (the same draws, in the same
    order, as one ``(n_boot, n)`` array of indices). The project's one bootstrap."""
    n = len(arrays[0])
    rows = max(1, BOOT_CHUNK // n)
    out = [np.empty(n_boot) for _ in arrays]
    for start in range(0, n_boot, rows):
        k = min(rows, n_boot - start)
        idx = rng.integers(0, n, size=(k, n))
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

    ``interval(baseline_samples, samples, blocks=...) -> (point, lo, hi)`` is the interval the
    results report (the paired bootstrap over blocks), so stopping for precision and the
    ``precision_met`` column agree by construction. It costs milliseconds, too much for
    every round of a long group, so a cell found short of the target is only re-checked once
    its rounds reach where the shrinking of the interval (as one over the root of the rounds)
    predicts the target, and at most RECHECK_GROWTH times later.

    The rule stops on the interval's width, never on where it lies, so it does not steer the
    speedup itself; taking the first width under the target slightly favours a narrow draw,
    which the floor of MIN_PRECISION_ROUNDS pairs keeps small.

    After ``done`` returns True, ``reason`` (a :class:`StopReason`) says why; ``widths`` holds each cell's
    relative half-width at its last check."""

    def __init__(self, timing: TimingRules, interval: Callable[..., tuple[float, float, float]] | None = None):
        """``timing``: the group's timing settings with their derived rules (a ``TimingConfig``);
        ``interval``: what reports a speedup's interval, needed with a precision target."""
        if timing.speedup_precision is not None and interval is None:
            raise HarnessError("a precision target needs the interval function that reports the speedups")
        self.timing = timing
        self.interval = interval
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
             elapsed_s: float, blocks=None) -> bool:
        """True when the rounds so far (per-call seconds per round, by cell id; all passes) are
        enough, for now (``reason`` ``"pass"``) or for good.

        ``elapsed_s``: the seconds the group's rounds took so far, all passes; ``blocks``: each
        round's block label, for the interval."""
        self.n_cells = max(self.n_cells, len(samples))
        capped = elapsed_s >= self.timing.max_time_s * max(1, self.n_cells)
        if self._floor(samples, inner):
            if self.pass_index + 1 < self.timing.passes:
                self.reason = StopReason.CAP if capped else StopReason.PASS
                return True
            if self.target is None or baseline not in samples or len(samples) < 2:
                self.reason = StopReason.FLOOR
                return True
            if self.timing.pass_limit > 1:  # the pass has its rounds; what it lacks, only another pass can give
                self.pending = self._short(samples, baseline, blocks)
                if not self.pending:
                    self.reason = StopReason.TARGET
                elif self.pass_index + 1 < self.timing.pass_limit and not capped:
                    self.reason = StopReason.PASS
                else:
                    self.reason = StopReason.CAP
                return True
            if self._precise(samples, baseline, blocks):
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
            if len(new) < self.timing.pass_rounds or sum(new) * inner[c] < self.timing.min_time_s / self.timing.passes:
                return False
            if self.pass_index + 1 >= self.timing.passes and (len(s) < self.timing.min_rounds or sum(s) * inner[c] < self.timing.min_time_s):
                return False
        return True

    def _short(self, samples: dict[str, list[float]], baseline: str, blocks) -> set[str]:
        """The cells whose speedup's interval is not yet within the target (every one is checked)."""
        short = set()
        for c in samples:
            if c != baseline:
                n = min(len(samples[baseline]), len(samples[c]))
                point, lo, hi = self.interval(samples[baseline], samples[c], blocks=blocks)
                self.n_checks += 1
                self.widths[c] = half_width(point, lo, hi)
                if not precision_met(point, lo, hi, n, self.target):
                    short.add(c)
        return short

    def _precise(self, samples: dict[str, list[float]], baseline: str, blocks) -> bool:
        """Every speedup's interval within the target; the cell last found short is checked first."""
        base = samples[baseline]
        cells = sorted((c for c in samples if c != baseline), key=lambda c: -self._next_check.get(c, 0))
        for c in cells:
            n = min(len(base), len(samples[c]))
            if n < max(MIN_PRECISION_ROUNDS, self._next_check.get(c, 0)):
                return False
            point, lo, hi = self.interval(base, samples[c], blocks=blocks)
            self.n_checks += 1
            w = self.widths[c] = half_width(point, lo, hi)
            if not precision_met(point, lo, hi, n, self.target):
                predicted = n * (w / self.target) ** 2 if w == w else n + 1
                self._next_check[c] = int(min(max(predicted, n + 1), n * RECHECK_GROWTH + 1))
                return False
        return True


def stop_rule(timing: TimingRules) -> StopRule:
    """A fresh stop rule for one group timed with ``timing`` (its ``TimingConfig``).

    A precision target reads the speedups' intervals through :func:`paired_speedup`."""
    return StopRule(timing, paired_speedup if timing.speedup_precision is not None else None)

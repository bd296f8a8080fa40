"""The statistics of a timing: summaries of samples, paired speedups and their intervals, the
precision a speedup met, and the rounds a burst of load disturbed. The one timing loop and the
stop rule that reads these live in :mod:`harness.worker.measure`; this module only summarises."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from harness.spec.timing import MIN_BLOCK_ROUNDS  # read at call time: a test may change it here

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
        import numpy as np

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
    import numpy as np  # here, not at the top: the stop rule's pure-Python helpers run where numpy may not

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
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_boot, n))
    ratios = np.median(b[idx], axis=1) / np.median(o[idx], axis=1)
    lo, hi = np.percentile(ratios, [2.5, 97.5])
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
    """The ``p`` quantile (``p`` > 0.5) of Student's t with ``df`` degrees of freedom, found by bisection
    on the closed form of its distribution for whole ``df`` (Abramowitz and Stegun 26.7.3-4): the
    standard library's, so the worker side needs no SciPy (it agrees with ``scipy.stats.t.ppf`` to
    about 1e-13)."""
    target = 2 * p - 1  # P(|T| < t)
    lo, hi = 0.0, 1.0
    while _t_central(hi, df) < target:
        hi *= 2
    while hi - lo > 1e-14 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_central(mid, df) < target else (lo, mid)
    return (lo + hi) / 2


def _t_central(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with ``df`` (a whole number) degrees of freedom."""
    import math

    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2:  # theta + sin(theta) (cos + 2/3 cos^3 + 2*4/(3*5) cos^5 + ...), times 2/pi
        term, total = math.cos(theta), 0.0
        for k in range(3, df + 1, 2):
            total += term
            term *= c2 * (k - 1) / k
        return 2 / math.pi * (theta + math.sin(theta) * total)
    term, total = 1.0, 0.0  # sin(theta) (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
    for k in range(2, df + 1, 2):
        total += term
        term *= c2 * (k - 1) / k
    return math.sin(theta) * total


def _block_standard_error(b: np.ndarray, o: np.ndarray, blocks: list) -> float:
    """One standard error of the mean of the speedups measured on each block of paired rounds
    (slices or index arrays; for two blocks, half their difference)."""
    import numpy as np

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

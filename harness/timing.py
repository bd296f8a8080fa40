"""Statistics of timing samples and of paired speedups. The one timing loop lives in
:mod:`harness.measure`; this module only summarises."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from harness.measure import MIN_BLOCK_ROUNDS


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
    :meth:`harness.measure.TimingPolicy.round_block`: one per fresh process, of every pass
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
            from scipy.stats import t

            widenings.append(float(t.ppf(0.975, len(by_block) - 1)) * _block_standard_error(b, o, by_block))
    for w in widenings:
        lo, hi = min(lo, point - w), max(hi, point + w)
    return point, float(lo), float(hi)


def _block_standard_error(b: np.ndarray, o: np.ndarray, blocks: list) -> float:
    """One standard error of the mean of the speedups measured on each block of paired rounds
    (slices or index arrays; for two blocks, half their difference)."""
    per = [np.median(b[s]) / np.median(o[s]) for s in blocks]
    return float(np.std(per, ddof=1)) / np.sqrt(len(per))


def spread_warnings(timings) -> list[str]:
    """Cells whose interquartile range exceeds SPREAD_LIMIT of the median: their figures deserve less trust."""
    import pandas as pd

    from harness.labels import backend_label, group_label

    df = pd.DataFrame(timings)
    if df.empty:
        return []
    df["label"] = backend_label(df)
    warn = []
    for _, r in df.iterrows():
        if r.get("status") == "ok" and r.get("median_s") and pd.notna(r.get("iqr_s")) and r.get("workload") != "train":
            rel = spread(r["iqr_s"], r["median_s"])
            if np.isfinite(rel) and rel > SPREAD_LIMIT:
                warn.append(f"{r['label']} ({r['workload']} {group_label(r)}): IQR is {rel:.0%} of the median")
    return warn

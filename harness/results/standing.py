"""How far a figure can be trusted, decided once for every reader.

Each timed cell's time and each ratio (a speedup over the baseline, a paired setting's speedup) has one
:class:`Standing`: ``trusted``, or what keeps it from being so, in the order a reader must hear it:

- ``contended``: it (or what it is a ratio over) was timed while other processes loaded the cores (the
  busy-machine guard's reading, ``contended`` and ``contention`` columns);
- ``unsteady``: the fresh worker processes its rounds came from disagree by more than
  :data:`UNSTEADY_SPREAD` of its median (``process_spread``): the machine's speed moved while it ran;
- ``imprecise``: the ratio's 95% interval is wider than the run's precision target, which is named;
- ``not significant``: the ratio's 95% interval holds 1x: no difference is shown.

:func:`with_standing` adds the columns (:data:`STANDING_COLUMNS`) to a timings table; ``harness.load_run``
hands them out, and the terminal, the reports, the plots, ``harness compare``, the multi-run report and the
pytest-benchmark export all render these values (:func:`mark`, :func:`legend`), never a judgement of their own.
"""

from __future__ import annotations

from enum import Enum

import numpy as np
import pandas as pd

from harness.results.labels import MISSED_MARK

#: a cell whose worker processes' medians lie further apart than this share of its median ran on an unsteady
#: machine (pyperf warns at a standard deviation of 10% of the mean: "the result may be unstable")
UNSTEADY_SPREAD = 0.10


class Standing(str, Enum):
    """What a figure can be trusted for (members are strings: tables and JSON hold the plain words)."""

    TRUSTED = "trusted"
    CONTENDED = "contended"
    UNSTEADY = "unsteady"
    IMPRECISE = "imprecise"
    NOT_SIGNIFICANT = "not significant"

    def __str__(self) -> str:
        return self.value

    @property
    def disturbed(self) -> bool:
        """The machine, not the code, may have moved the figure: contended or unsteady."""
        return self in (Standing.CONTENDED, Standing.UNSTEADY)


#: the mark each standing puts beside a figure, in text (so it survives greyscale and plain terminals)
MARKS = {Standing.TRUSTED: "", Standing.CONTENDED: "(contended)", Standing.UNSTEADY: "(unsteady)",
         Standing.IMPRECISE: MISSED_MARK, Standing.NOT_SIGNIFICANT: "(n.s.)"}

#: the columns :func:`with_standing` adds: each timed cell's time, its speedup over the baseline and its
#: speedup over the paired setting's first value, each with the evidence in words
STANDING_COLUMNS = ("time_standing", "time_standing_why", "speedup_standing", "speedup_standing_why",
                    "setting_standing", "setting_standing_why")


def _num(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if np.isfinite(f) else None


def _get(row, key):
    v = row.get(key) if hasattr(row, "get") else None
    return None if v is None or (not isinstance(v, (list, tuple, np.ndarray)) and pd.isna(v)) else v


def _contended(row) -> bool:
    v = _get(row, "contended")
    return v is not None and bool(v)


def _spread(row) -> float | None:
    return _num(_get(row, "process_spread"))


def _timed(row) -> bool:
    return str(_get(row, "status")) == "ok" and _num(_get(row, "median_s")) is not None \
        and _get(row, "workload") != "train"


def target_text(target) -> str:
    """A precision target as a reader reads it: ``±5%``, ``±2.5%``."""
    return f"±{float(target) * 100:.3g}%"


def time_standing(row) -> tuple[Standing | None, str]:
    """A timed cell's own time: contended, unsteady or trusted, with the evidence (None for a cell not timed)."""
    if not _timed(row):
        return None, ""
    if _contended(row):
        return Standing.CONTENDED, str(_get(row, "contention") or "timed while other processes loaded the cores")
    spread = _spread(row)
    if spread is not None and spread > UNSTEADY_SPREAD:
        seen = str(_get(row, "contention") or "")
        return Standing.UNSTEADY, (f"its {_count(row)}worker processes disagree by {spread:.0%} (above "
                                   f"{UNSTEADY_SPREAD:.0%})" + (f"; the guard saw: {seen}" if seen else ""))
    return Standing.TRUSTED, ""


def _count(row) -> str:
    n = _num(_get(row, "n_worker_processes"))
    return f"{int(n)} " if n else ""


def ratio_standing(value, lo, hi, target=None, met=None, sides=()) -> tuple[Standing | None, str]:
    """A ratio's standing and evidence: ``sides`` the rows it is a ratio of (their time standings come
    first: a ratio of a contended or unsteady cell is so too), ``target`` the precision target its interval
    is held to (``met``: the stop rule's own verdict, where it judged one), then whether the interval holds
    1x. None without a finite ratio."""
    if _num(value) is None:
        return None, ""
    for kind in (Standing.CONTENDED, Standing.UNSTEADY):
        for side, name in sides:
            standing, why = time_standing(side)
            if standing == kind:
                return kind, f"{name}: {why}" if name else why
    v, a, b = _num(value), _num(lo), _num(hi)
    wide = None
    if a is not None and b is not None and v > 0:
        wide = max(b - v, v - a) / v
    if met is None and _num(target) is not None and wide is not None:
        met = wide <= float(target)
    if met is not None and not bool(met) and _num(target) is not None:
        reached = f"±{wide:.1%}" if wide is not None else "too few rounds"
        return Standing.IMPRECISE, f"interval {reached}, wider than its {target_text(target)} target"
    if a is not None and b is not None and a <= 1 <= b:
        return Standing.NOT_SIGNIFICANT, f"interval [{a:.3g}, {b:.3g}] holds 1x"
    return Standing.TRUSTED, ""


def _reference_ids(df: pd.DataFrame) -> tuple[list, list]:
    """Per row, the cell id of what its speedup is over and of its paired setting's first value (None)."""
    from harness.results.schema import setting_values

    if "cell_id" not in df:  # rows that name no cell (a table put together by hand): nothing to look up
        return [None] * len(df), [None] * len(df)
    ids = df["cell_id"].astype(str)
    over = df["speedup_over"] if "speedup_over" in df else pd.Series([None] * len(df), index=df.index)
    speedup_ref = [f"{c.rsplit('|', 1)[0]}|{o}" if isinstance(o, str) and o else None for c, o in zip(ids, over)]
    setting_ref: list = [None] * len(df)
    if "setting_baseline" in df:
        cols = ["dtype", "threads"]
        at = {}
        for _, r in df.iterrows():
            at[(r.get("group"), str(r["cell_id"]).rsplit("|", 1)[-1], tuple(str(r.get(c)) for c in cols))] = r["cell_id"]
        for i, (_, r) in enumerate(df.iterrows()):
            base = r.get("setting_baseline")
            if not isinstance(base, str) or not base:
                continue
            values = setting_values(base)
            key = tuple(str(values.get(c, r.get(c))) for c in cols)
            setting_ref[i] = at.get((r.get("group"), str(r["cell_id"]).rsplit("|", 1)[-1], key))
    return speedup_ref, setting_ref


def with_standing(timings: pd.DataFrame) -> pd.DataFrame:
    """``timings`` with :data:`STANDING_COLUMNS` (computed once: a table that has them is returned as it is).
    A run's own rows only: what a speedup is over is looked up among them."""
    if timings is None or len(timings) == 0:
        out = timings.copy() if timings is not None else pd.DataFrame()
        for c in STANDING_COLUMNS:
            if c not in out:
                out[c] = pd.Series(dtype=object)
        return out
    if all(c in timings for c in STANDING_COLUMNS):
        return timings
    df = timings.copy()
    rows = df.to_dict("records")
    by_id = {r.get("cell_id"): r for r in rows}
    speedup_ref, setting_ref = _reference_ids(df)
    cols: dict[str, list] = {c: [] for c in STANDING_COLUMNS}
    for r, sref, tref in zip(rows, speedup_ref, setting_ref):
        t, twhy = time_standing(r)
        s, swhy = None, ""
        lo, hi = _num(r.get("speedup_lo")), _num(r.get("speedup_hi"))
        if _timed(r) and not (lo is not None and lo == hi):  # the reference's own 1x is no ratio
            ref = by_id.get(sref)
            name = (f"what it is over ({r.get('speedup_over')})" if ref is not None else "")
            s, swhy = ratio_standing(r.get("speedup"), lo, hi, r.get("speedup_precision"), _met(r),
                                     [(r, "")] + ([(ref, name)] if ref is not None else []))
        g, gwhy = None, ""
        glo, ghi = _num(r.get("setting_speedup_lo")), _num(r.get("setting_speedup_hi"))
        if _timed(r) and not (glo is not None and glo == ghi):
            ref = by_id.get(tref)
            g, gwhy = ratio_standing(r.get("setting_speedup"), glo, ghi, r.get("speedup_precision"), None,
                                     [(r, "")] + ([(ref, f"its {r.get('setting_baseline')} cell")]
                                                  if ref is not None else []))
        for name, value in (("time_standing", t), ("time_standing_why", twhy), ("speedup_standing", s),
                            ("speedup_standing_why", swhy), ("setting_standing", g), ("setting_standing_why", gwhy)):
            cols[name].append(value.value if isinstance(value, Standing) else (value or None))
    for name, values in cols.items():
        df[name] = pd.Series(values, index=df.index, dtype=object)
    return df


def _met(row):
    v = row.get("precision_met")
    return None if v is None or pd.isna(v) else bool(v)


def _has(row, key: str) -> bool:
    try:
        return key in row.keys()
    except AttributeError:
        return False


def _alone(row, column: str) -> tuple[Standing | None, str]:
    """A row's standing of ``column`` from the row alone (a table without :data:`STANDING_COLUMNS`: what its
    speedup is over is not at hand, so only its own time and interval are read)."""
    if column == "time":
        return time_standing(row)
    if _get(row, "status") is not None and not _timed(row):  # a bare ratio (no status) is judged as it is
        return None, ""
    lo, hi = _num(row.get(f"{column}_speedup_lo" if column == "setting" else "speedup_lo")), \
        _num(row.get(f"{column}_speedup_hi" if column == "setting" else "speedup_hi"))
    if lo is not None and lo == hi:
        return None, ""
    value = row.get("setting_speedup" if column == "setting" else "speedup")
    return ratio_standing(value, lo, hi, row.get("speedup_precision"), _met(row) if column == "speedup" else None,
                          [(row, "")])


def of(row, column: str = "speedup") -> Standing | None:
    """A row's standing of ``column`` (``speedup``, ``setting``, ``time``) from its :data:`STANDING_COLUMNS`."""
    if not _has(row, f"{column}_standing"):
        return _alone(row, column)[0]
    v = _get(row, f"{column}_standing")
    return Standing(v) if v is not None else None


def why(row, column: str = "speedup") -> str:
    """The evidence behind :func:`of`, in words ("" for a trusted figure)."""
    if not _has(row, f"{column}_standing"):
        return _alone(row, column)[1]
    return str(_get(row, f"{column}_standing_why") or "")


def mark(row, column: str = "speedup") -> str:
    """The text mark a figure carries beside it ("" for a trusted one or none)."""
    s = of(row, column)
    return MARKS[s] if s is not None else ""


def marked(text: str, row, column: str = "speedup") -> str:
    """``text`` followed by its :func:`mark` (as it is for ``-``, an empty text or a trusted figure)."""
    m = mark(row, column)
    return f"{text} {m}" if m and text not in ("", "-") else text


def precision_targets(timings: pd.DataFrame) -> list[float]:
    """The precision targets a run's timed cells were held to, ascending (empty: it set none)."""
    if "speedup_precision" not in timings or not len(timings):
        return []
    return sorted({float(v) for v in timings["speedup_precision"] if _num(v) is not None})


def imprecise_name(timings: pd.DataFrame) -> str:
    """What the imprecise mark means in this run: ``interval wider than ±5%`` (its one target), ``interval
    wider than its precision target`` (several), ``no precision target`` (none set)."""
    targets = precision_targets(timings)
    if not targets:
        return "no precision target"
    if len(targets) == 1:
        return f"interval wider than {target_text(targets[0])}"
    return "interval wider than its precision target"


def legend(timings: pd.DataFrame, columns=("speedup",)) -> str:
    """One sentence naming each mark the figures of ``timings`` carry ("" when none does)."""
    df = with_standing(timings)
    seen = {Standing(v) for c in columns for v in df.get(f"{c}_standing", pd.Series(dtype=object)).dropna()}
    words = {Standing.CONTENDED: "timed while other processes loaded the cores (it or what it is over)",
             Standing.UNSTEADY: f"its worker processes disagree by more than {UNSTEADY_SPREAD:.0%}",
             Standing.IMPRECISE: imprecise_name(df),
             Standing.NOT_SIGNIFICANT: "not significant, the 95% interval holds 1x"}
    parts = [f"{MARKS[s]} {words[s]}" for s in Standing if s in seen and s != Standing.TRUSTED]
    return "; ".join(parts)


def counts(timings: pd.DataFrame, column: str = "time") -> dict[Standing, int]:
    """How many figures of ``column`` hold each standing (only those present)."""
    df = with_standing(timings)
    out: dict[Standing, int] = {}
    for v in df.get(f"{column}_standing", pd.Series(dtype=object)).dropna():
        out[Standing(v)] = out.get(Standing(v), 0) + 1
    return out


def _samples(row, key: str = "samples_s") -> list:
    v = _get(row, key)
    return [float(x) for x in v] if v is not None else []


def lead(best, runner_up) -> tuple[tuple[float, float, float], Standing | None, str]:
    """How much faster a group's fastest cell is than its runner-up: the runner-up's time over the fastest's
    from the rounds they took in turn, with the paired 95% interval (from the medians alone, without an
    interval, where a row has no rounds), its standing and evidence. A fastest cell is a winner only where
    this interval lies above 1x."""
    from harness.run.stats import paired_speedup

    a, b = _samples(runner_up), _samples(best)
    if len(a) >= 3 and len(b) >= 3:
        blocks = _get(best, "samples_block")
        value = paired_speedup(a, b, blocks=list(blocks) if blocks is not None else None)
    else:
        ma, mb = _num(_get(runner_up, "median_s")), _num(_get(best, "median_s"))
        value = (ma / mb if ma and mb else float("nan"), float("nan"), float("nan"))
    standing, evidence = ratio_standing(*value, sides=[(best, ""), (runner_up, "the runner-up")])
    if standing == Standing.TRUSTED and not (_num(value[1]) or 0) > 1:  # no interval: nothing shown to differ
        standing, evidence = Standing.NOT_SIGNIFICANT, "no interval: the rows hold no rounds"
    return value, standing, evidence


#: what ``harness run --fail-on`` can fail on: a cell's status (mismatch; failed: error, timeout, oom,
#: diverged or mismatch) or its time's standing (contended, unsteady)
FAIL_ON = ("mismatch", "failed", "contended", "unsteady")


def failing(timings: pd.DataFrame, reasons) -> list[str]:
    """The cells of a run that ``--fail-on`` ``reasons`` (names of :data:`FAIL_ON`) fails it on, each
    ``cell_id: why``."""
    from harness.spec.status import FAILED

    df = with_standing(pd.DataFrame(timings))
    out = []
    for r in df.to_dict("records"):
        status, time = str(r.get("status")), r.get("time_standing")
        why_ = ("mismatch" if "mismatch" in reasons and status == "mismatch"
                else status if "failed" in reasons and status in {str(s) for s in FAILED}
                else time if isinstance(time, str) and time in reasons else None)
        if why_:
            out.append(f"{r['cell_id']}: {why_}")
    return out

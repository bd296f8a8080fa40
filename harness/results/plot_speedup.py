"""Speedup figures: over the baseline, over a paired setting, and one run against another."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pandas as pd

from harness.results.labels import MISSED_MARK, MISSED_NAME, backend_label, group_label, setting_label, sweep_order
from harness.results.standing import MARKS, Standing, imprecise_name, ratio_standing, target_text
from harness.results.standing import of as standing_of
from harness.spec.status import Status
from harness.results.plot_style import _number_axis, _palette, _save
from harness.results.schema import setting_values


#: the keys a sweep varies that lay out a figure's panels, in the order a row's name gives them
SWEPT = ("workload", "dtype", "threads", "batch")
#: the swept key that becomes the columns, the first of these that varies (at most MAX_COLUMNS values)
COLUMN_KEYS = ("batch", "threads", "dtype")
MAX_COLUMNS = 6


def _key_name(key: str, value) -> str:
    """A swept key's value as a panel names it: ``B=16``, ``2 thr``, ``bfloat16``, ``forward``."""
    return {"batch": f"B={value}", "threads": f"{value} thr"}.get(key, str(value))


def facets(df: pd.DataFrame, omit: tuple[str, ...] = ()) -> tuple[pd.DataFrame, list, list, str]:
    """Lay ``df``'s rows out as panels, rows x columns by what the run swept: a column per value of the
    first of :data:`COLUMN_KEYS` that varies, a row per problem and every other swept key (workload, dtype,
    threads). Returns the rows with ``facet_row`` and ``facet_col`` (sortable keys) and ``row_name`` and
    ``col_name``; the rows' and columns' keys in order; and what every panel shares (the figure's title).
    ``omit``: keys that are no panel's (a paired setting's, drawn inside the panels)."""
    swept = [k for k in SWEPT if k in df and k not in omit and df[k].nunique() > 1]
    col = next((k for k in COLUMN_KEYS if k in swept and df[k].nunique() <= MAX_COLUMNS), None)
    hidden = tuple(k for k in ("batch", "dtype", "threads") if k in swept or k in omit)
    problem = df.apply(lambda r: group_label(r, omit=hidden), axis=1)
    order = {p: i for i, p in enumerate(dict.fromkeys(problem))}
    in_row = [k for k in swept if k != col]
    several = len(order) > 1
    common = "" if several else str(problem.iloc[0])
    if "workload" not in swept:
        common = f"{common} · {df['workload'].iloc[0]}" if common else str(df["workload"].iloc[0])
    rows, names = [], []
    for (_, r), prob in zip(df.iterrows(), problem):
        rows.append((order[prob] if several else 0,) + tuple(sweep_order(k, r[k]) for k in in_row))
        names.append(" · ".join(([prob] if several else []) + [_key_name(k, r[k]) for k in in_row]))
    out = df.assign(facet_row=rows, row_name=names,
                    facet_col=[sweep_order(col, v) for v in df[col]] if col else [(0,)] * len(df),
                    col_name=[_key_name(col, v) for v in df[col]] if col else [""] * len(df))
    return out, sorted(set(out["facet_row"])), sorted(set(out["facet_col"])), common


def _wrap(text: str, width: int) -> str:
    """``text`` in lines of ``width``, each mark kept on one line with the word after it (``† interval``)."""
    kept = text
    for sign in MARKS.values():
        if sign:
            kept = kept.replace(f"{sign} ", f"{sign}\u00a0")  # textwrap breaks at plain spaces only
    return textwrap.fill(kept, width).replace("\u00a0", " ")


def _marks(kinds) -> tuple[list[str], list[bool], str]:
    """Per point, the text mark of its standing and whether it is drawn hollow (a disturbed machine timed it:
    contended or unsteady), and the legend of the marks drawn ("" when every point is trusted)."""
    kinds = [Standing(k) if isinstance(k, str) and k else None for k in kinds]
    seen = [k for k in Standing if k in kinds and k != Standing.TRUSTED]
    words = {Standing.CONTENDED: "timed while other processes loaded the cores",
             Standing.UNSTEADY: "its worker processes disagree",
             Standing.NOT_SIGNIFICANT: "not significant, the interval holds 1x"}
    parts = []
    for k in seen:
        hollow = ", hollow" if k.disturbed else ""
        parts.append(f"{MARKS[k]}{hollow}: {words.get(k, '')}" if k != Standing.IMPRECISE else "")
    return ([MARKS[k] if k else "" for k in kinds], [bool(k and k.disturbed) for k in kinds],
            "; ".join(p for p in parts if p))


def _layout(plt, cells: list, row_keys: list, col_keys: list, panel_w: float, panel_h: float):
    """The figure and each panel's axes, ``{(row, col): ax}``: a grid of rows x columns, or, with one column
    or a grid mostly empty, the panels in order, at most three to a row."""
    import math

    if len(col_keys) > 1 and len(cells) >= 0.5 * len(row_keys) * len(col_keys):
        nrow, ncol = len(row_keys), len(col_keys)
        place = {c: (row_keys.index(c[0]), col_keys.index(c[1])) for c in cells}
    else:
        ncol = min(3, len(cells))
        nrow = math.ceil(len(cells) / ncol)
        place = {c: divmod(i, ncol) for i, c in enumerate(cells)}
    fig, axes = plt.subplots(nrow, ncol, figsize=(panel_w * ncol, panel_h * nrow + 0.6), squeeze=False)
    used = set(place.values())
    for i in range(nrow):
        for j in range(ncol):
            if (i, j) not in used:
                axes[i, j].set_visible(False)
    return fig, axes, {c: axes[i, j] for c, (i, j) in place.items()}


def _draw_points(items: pd.DataFrame, out: Path, xlabel: str, title: str, row_keys: list, col_keys: list,
                 imprecise: str = MISSED_NAME):
    """A figure of speedups drawn as points with their 95% intervals, a panel per facet (:func:`facets`), on one
    log x axis centred on 1x and shared by every panel, the value beside each interval; each backend in its
    colour and its variant's marker, named on its row; the rows without a value marked "not timed: why".

    ``items``: ``facet_row``, ``facet_col``, ``row_name``, ``col_name``, ``name`` (a row's text), ``label``
    (its backend, for colour and marker), ``value``, ``lo``, ``hi`` (NaN value: not timed), ``why`` and
    ``standing`` (:class:`harness.results.standing.Standing` of the ratio: its value carries the standing's
    mark, a point a disturbed machine timed is drawn hollow, and the x axis's label says what each mark
    drawn means); ``imprecise``: what the imprecise mark means here (``interval wider than ±5%``)."""
    from harness.results.plot_style import _setup, backend_marker

    plt, sns = _setup()
    timed = items[items["value"].notna()]
    if timed.empty:
        return None
    signs, hollow, legend = _marks(items["standing"])
    items = items.assign(sign=signs, hollow=hollow)
    if Standing.IMPRECISE.value in set(timed["standing"].dropna()):
        kept = f"{MISSED_MARK} {imprecise}".replace(" ", "\u00a0")  # one line: the mark with what it means
        legend = "; ".join(p for p in (kept, legend) if p)
    if legend and xlabel.endswith(")"):  # the marks' legend, where the figure has one
        xlabel = f"{xlabel[:-1]}; {legend})"
    # one order of rows in every panel: the fastest overall at the top, so that panels read alike
    rank = timed.groupby("name")["value"].median().sort_values(ascending=False)
    order = {n: i for i, n in enumerate(list(rank.index) + sorted(set(items["name"]) - set(rank.index)))}
    cells = sorted(set(zip(items["facet_row"], items["facet_col"])))
    n_rows = int(items.groupby(["facet_row", "facet_col"]).size().max())
    # a panel's plotting area keeps its width whatever the length of its rows' names beside it
    width = 3.7 + 0.062 * max(len(str(n)) for n in items["name"])
    fig, axes, where = _layout(plt, cells, row_keys, col_keys, width, 0.36 * n_rows + 1.25)
    # symmetric about 1x: the same distance stands for the same factor faster or slower, in every panel
    ends = np.concatenate([timed[c].dropna().to_numpy(dtype=float) for c in ("value", "lo", "hi")])
    ends = ends[np.isfinite(ends) & (ends > 0)]
    reach = max(float(np.max(np.abs(np.log10(ends)))), np.log10(1.25))
    half = reach * 1.12 + 0.12
    xlim = (10 ** -half, 10 ** half)
    palette = _palette(sns, timed["label"])
    for cell in cells:
        ax = where[cell]
        d = items[(items["facet_row"] == cell[0]) & (items["facet_col"] == cell[1])]
        d = d.assign(rank=d["name"].map(order), timed=d["value"].notna())
        d = d.sort_values(["timed", "rank"], ascending=[True, False])  # bottom up: not timed, slowest, ..., fastest
        ax.set_xscale("log")
        ax.set_xlim(*xlim)
        ax.axvline(1.0, color="black", lw=1, ls="--", zorder=1)
        for y, (_, r) in enumerate(d.iterrows()):
            if not r["timed"]:
                ax.annotate(f"not timed: {r['why']}", (1.0, y), xytext=(-4, 0), textcoords="offset points",
                            va="center", ha="right", fontsize=8, color="#a00000", style="italic")
                continue
            v, lo, hi = float(r["value"]), r["lo"], r["hi"]
            has = pd.notna(lo) and pd.notna(hi) and float(hi) > float(lo)
            err = [[max(v - float(lo), 0)], [max(float(hi) - v, 0)]] if has else None
            # a point a disturbed machine timed is hollow, its edge in the backend's colour: told apart in greyscale
            face = {"markerfacecolor": "white", "markeredgecolor": palette[r["label"]], "markeredgewidth": 1.6} \
                if r["hollow"] else {"markeredgecolor": "#222222", "markeredgewidth": 0.6}
            ax.errorbar([v], [y], xerr=err, fmt=backend_marker(r["label"]), color=palette[r["label"]], ms=7,
                        capsize=3, elinewidth=1.6, zorder=3, **face)
            # the value beside its interval, on the side away from the 1x line (unless the panel's edge is there)
            left, right = (float(lo), float(hi)) if has else (v, v)
            span = np.log10(xlim[1] / xlim[0])
            text = f"{v:.3g}x" + (f" {r['sign']}" if r["sign"] else "")
            room = 0.08 + 0.016 * len(text)  # the share of the panel the text takes: a mark needs more of it
            at_left = v < 1 and np.log10(left / xlim[0]) / span > room or np.log10(right / xlim[0]) / span > 1 - room
            ax.annotate(text, (left if at_left else right, y), xytext=(-8 if at_left else 8, 0),
                        textcoords="offset points", va="center", ha="right" if at_left else "left", fontsize=8)
        ax.set_yticks(range(len(d)), list(d["name"]), fontsize=8)
        ax.set_ylim(-0.6, max(len(d), 1) - 0.4)
        _number_axis(ax.xaxis, "x")
        ax.tick_params(axis="x", labelsize=8)
        name = " · ".join(n for n in (d["row_name"].iloc[0], d["col_name"].iloc[0]) if n)
        ax.set_title(textwrap.fill(name, 48), fontsize=9)
        ax.set_xlabel(_wrap(xlabel, int(width * 72 / (8 * 0.62))), fontsize=8)  # within its panel
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _save(plt, fig, axes, axes.size, out)


def plot_speedup(timings: pd.DataFrame, out: Path):
    """Each comparison group's speedups over its baseline (its time over each backend's: above 1x, faster) as
    points with their 95% intervals, on one log axis centred on 1x; panels rows x columns by what the run
    swept (:func:`facets`); the group's cells with no speedup (failed, unsupported, unavailable) keep a row
    that says why."""
    timed = (timings["status"] == Status.OK) & timings["speedup"].notna()
    if not timed.any():
        return None
    groups = set(timings.loc[timed, "group"]) if "group" in timings else None
    df = timings[timings["group"].isin(groups)] if groups is not None else timings
    df, row_keys, col_keys, common = facets(df.copy())
    df["label"] = backend_label(df)
    ok = (df["status"] == Status.OK) & df["speedup"].notna()
    over = df.loc[ok & df["speedup_over"].notna(), "speedup_over"] if "speedup_over" in df else df.iloc[:0]["baseline"]
    refs = list(dict.fromkeys(over if len(over) else df.loc[ok, "baseline"]))  # a failed baseline's stand-in
    items = df.assign(name=df["label"], value=df["speedup"].where(ok), lo=df["speedup_lo"].where(ok),
                      hi=df["speedup_hi"].where(ok), why=df["status"].astype(str),
                      standing=[_kind(r, "speedup") for r in df.to_dict("records")])
    ref = refs[0] if len(refs) == 1 else "each group's baseline"
    xlabel = f"speedup over {ref} (its time / this one's; 95% CI)"
    title = f"{common}: speedup over {ref}" if common else f"speedup over {ref}"
    return _draw_points(items, out, xlabel, title, row_keys, col_keys, imprecise_name(df))


def _kind(row, column: str) -> str | None:
    """A row's standing of ``column`` as drawn: the reference's own 1x carries its cell's time standing (a
    contended baseline is drawn hollow too)."""
    kind = standing_of(row, column)
    if kind is None:
        kind = standing_of(row, "time")
        kind = kind if kind is not None and kind.disturbed else None
    return kind.value if kind is not None else None


def plot_settings(timings: pd.DataFrame, out: Path):
    """Per problem, each backend's speedup at every paired setting over its own at the first one
    (``setting_speedup``: the first setting's time over this one's, above 1x this setting is faster), as
    points with the paired 95% interval on one log axis centred on 1x; panels rows x columns by the other
    swept keys; cells that did not run keep a row that says why."""
    if "setting_baseline" not in timings:
        return None
    # training cells run alone, never paired: they have no setting ratio to draw
    df = timings[timings["setting_baseline"].notna() & (timings["workload"] != "train")].copy()
    if df.empty:
        return None
    base = setting_values(df["setting_baseline"].iloc[0])
    keys = list(base)
    df["setting"] = df.apply(lambda r: setting_label(r, keys), axis=1)
    df = df[df["setting"] != setting_label(base, keys)]  # each backend's first setting is its own 1x
    if df.empty or df["setting_speedup"].isna().all():
        return None
    df, row_keys, col_keys, common = facets(df, omit=tuple(keys))
    df["label"] = backend_label(df)
    against = setting_label(base, keys)
    several = df["setting"].nunique() > 1
    items = df.assign(name=df["label"] + (" · " + df["setting"] if several else ""), value=df["setting_speedup"],
                      lo=df["setting_speedup_lo"], hi=df["setting_speedup_hi"],
                      why=[s if s != Status.OK else f"no {against} cell" for s in df["status"]],
                      standing=[_kind(r, "setting") for r in df.to_dict("records")])
    setting = " · ".join(dict.fromkeys(df["setting"]))
    xlabel = f"speedup over {against} ({against}'s time / {setting}'s; paired 95% CI)"
    title = f"{setting} against {against}, same backend" + (f": {common}" if common else "")
    return _draw_points(items, out, xlabel, title, row_keys, col_keys, imprecise_name(df))


def plot_runs(pairs: pd.DataFrame, keys: dict[str, str], out: Path):
    """Several runs' common cells: each later run's speedup over the first per cell (the first's median over
    the later one's, :func:`harness.results.multi.run_pairs`), as points with their 95% intervals on one log
    axis centred on 1x, a panel per later run, each point labelled with its value and named on its row.
    ``keys``: each run's short name (A, B, ...)."""
    if pairs is None or pairs.empty or pairs["ratio"].isna().all():
        return None
    first = next(iter(keys))
    items = pairs.assign(facet_row=[(list(keys).index(r),) for r in pairs["run_id"]], facet_col=[(0,)] * len(pairs),
                         row_name=[f"{keys[r]} against {keys[first]}" for r in pairs["run_id"]], col_name="",
                         name=pairs["label"] + " · " + pairs["problem"], value=pairs["ratio"], lo=pairs["ratio_lo"],
                         hi=pairs["ratio_hi"],
                         why=[b if a == Status.OK else a for a, b in zip(pairs["status_a"], pairs["status_b"])],
                         standing=[_pair_kind(r) for r in pairs.to_dict("records")])
    rows = sorted(set(items["facet_row"]))
    targets = sorted({float(p) for p in pairs["precision"].dropna()}) if "precision" in pairs else []
    return _draw_points(items, out, f"speedup over run {keys[first]} (its median / this run's; 95% CI)",
                        "each later run against the first, per cell both have", rows, [(0,)],
                        f"interval wider than {target_text(targets[0])}" if len(targets) == 1 else MISSED_NAME)


def _pair_kind(pair: dict) -> str | None:
    """One run's ratio over another's as drawn: disturbed where either cell's time was, else by its interval
    against the tighter precision target (:func:`harness.results.standing.ratio_standing`)."""
    time = pair.get("time_standing")
    if isinstance(time, str) and Standing(time).disturbed:
        return time
    kind, _ = ratio_standing(pair.get("ratio"), pair.get("ratio_lo"), pair.get("ratio_hi"), pair.get("precision"))
    return kind.value if kind is not None else None

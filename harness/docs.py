"""The measured tables of ``docs/experiments.md``, generated from the run folders under ``results/examples/``.

A table of the page sits between two markers; the prose around it is written by hand::

    <!-- table: speedups sobel -->
    | problem | numpy | torch | ... |
    ...
    <!-- /table -->

The opening marker names the kind of table, the run folder(s) it reads (comma-separated, under
``results/examples/``) and options as ``key=value``:

* ``speedups RUNS [device=cpu|gpu] [workload=W] [threads=column]``: a row per comparison group, a
  column per backend; the baseline's cell is ``1 (its median)``, the others the speedup with its
  95% interval, ``†`` where the interval missed its precision target (target not met), the cell's status, or
  ``not in config`` where the row's group had no such backend.
* ``ms RUNS``: like ``speedups``, with each cell's milliseconds per call instead of its speedup
  (for comparing problems with one another on one backend: a GRU's step against an LSTM's).
* ``steps RUNS``: a row per cell: ms per step, compile seconds, speedup.

Any other ``key=value`` names a results column and keeps the rows whose value reads ``value``
(``model=gru``, ``batch=32``, ``bidirectional=True``).
* ``training RUNS``: training cells ordered by time to target.
* ``dtypes RUNS``: a row per problem and backend, a column per dtype, and each other dtype against
  float32: ms per call for timed steps and the speedup over float32 (float32's time over this dtype's:
  above 1, the dtype is faster, as every ratio of the harness reads); for training runs the final loss and
  training seconds, and the loss's relative difference (what a mixed-precision type buys, and what it
  costs); where the run paired the dtypes (``pair_over: [dtype]``), the speedup carries its paired 95% interval.
* ``settings RUNS``: for a run that paired settings (``pair_over``), a row per problem and backend,
  a column of ms per call per setting, and each later setting's speedup over the first (the backend's
  time there over its time at this one: above 1, this setting is faster) with its paired 95% interval.
* ``epochs RUNS``: training time and final loss, a row per batch and a column per backend and threads.
* ``host RUNS``: a line per run saying on which machine (CPU model, cores, AVX-512/AVX512-BF16, its
  measured float32 GEMM peak, GPU) and on which day it ran.

A run folder that does not exist yet gives a line that says how to make it. :func:`render_page`
rewrites every table; :func:`check_page` lists the tables whose text differs from their runs.

The config reference of ``docs/configs.md`` (between ``<!-- config-reference -->`` and
``<!-- /config-reference -->``) is generated the same way, from the schema's own field descriptions
(:func:`config_keys`): :func:`write_config_page` rewrites it, :func:`check_config_page` says whether it
is stale, and a key without a description is an error, not a row.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from harness.spec import writes
from harness.spec.dtype import DType
from harness.spec.errors import HarnessError
from harness.results import standing
from harness.results.schema import SPEEDUP_BLOCK, setting_values
from harness.spec.status import Status

OPEN = re.compile(r"^<!-- table: (?P<spec>.+?) -->\s*$")
CLOSE = "<!-- /table -->"
KINDS = ("speedups", "ms", "steps", "training", "epochs", "dtypes", "settings", "host")
OPTIONS = ("device", "workload", "threads")  # the options that are not column filters


@dataclass
class TableSpec:
    kind: str
    runs: list[str]
    options: dict[str, str]
    text: str  # the spec as written in the marker
    line: int  # 1-based line of the opening marker

    @classmethod
    def parse(cls, text: str, line: int, where: str) -> "TableSpec":
        words = text.split()
        if len(words) < 2 or words[0] not in KINDS:
            raise HarnessError(f"{where}:{line}: table marker {text!r}: expected '<kind> <runs> [key=value ...]' "
                               f"with kind one of {', '.join(KINDS)}")
        options = {}
        for w in words[2:]:
            key, eq, value = w.partition("=")
            if not eq:
                raise HarnessError(f"{where}:{line}: table marker {text!r}: expected key=value, got {w!r}")
            options[key] = value
        return cls(words[0], words[1].split(","), options, text, line)


# -- formatting ------------------------------------------------------------------------------
def _sig(v: float) -> str:
    """Three significant digits, trailing zeros kept (``4.80``, ``16.0``, ``596``)."""
    return f"{v:#.3g}".rstrip(".")


def fmt_duration(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale or unit == "µs":
            return f"{_sig(seconds / scale)} {unit}"
    return f"{seconds} s"


def _ok(v) -> bool:
    return v is not None and not pd.isna(v)


def _speedup(r) -> str:
    s = f"{r['speedup']:.2f}x"
    if _ok(r.get("speedup_lo")) and _ok(r.get("speedup_hi")):
        s += f" [{r['speedup_lo']:.2f}, {r['speedup_hi']:.2f}]"
    return standing.marked(s, r)


def _is_baseline(r) -> bool:
    from harness.results.labels import backend_name

    return backend_name(r) == r.get("baseline") or (f"{r['backend']}:{r['variant']}" == r.get("baseline"))


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


# -- the tables ------------------------------------------------------------------------------
def _load(examples: Path, runs: list[str]) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    from harness.results.labels import backend_label
    from harness.results.store import load_run

    timings, curves = [], []
    for name in runs:
        if not (examples / name / "run.json").exists():
            return None
        run = load_run(examples / name)
        timings.append(run.timings)
        curves.append(run.curves)
    df = pd.concat(timings, ignore_index=True)
    df["label"] = backend_label(df)
    return df, pd.concat(curves, ignore_index=True)


def _filter(df: pd.DataFrame, spec: TableSpec, default_workloads=None) -> pd.DataFrame:
    for key, value in spec.options.items():
        if key in OPTIONS:
            continue
        if key not in df.columns:
            raise HarnessError(f"table {spec.text!r} (line {spec.line}): no results column {key!r} to filter on")
        df = df[df[key].astype(str) == value]
    if "device" in spec.options:
        df = df[df["device"] == spec.options["device"]]
    if "workload" in spec.options:
        df = df[df["workload"] == spec.options["workload"]]
    elif default_workloads is not None:
        df = df[df["workload"].isin(default_workloads)]
    return df


def _problem(r, several_workloads: bool, omit=()) -> str:
    from harness.results.labels import group_label

    label = group_label(r, omit=omit)
    return f"{label} {r['workload']}" if several_workloads else label


def _cell(r) -> str:
    if r["status"] != Status.OK:
        return str(r["status"])
    if _is_baseline(r) and _ok(r.get("median_s")):
        return f"1 ({fmt_duration(r['median_s'])})"
    return _speedup(r) if _ok(r.get("speedup")) else fmt_duration(r["median_s"])


def _ms(r) -> str:
    return f"{r['median_s'] * 1e3:.3g}" if r["status"] == Status.OK and _ok(r.get("median_s")) else str(r["status"])


#: a table's cell for a backend its row's comparison group did not have: said, never left blank
ABSENT = "not in config"


def speedups(df: pd.DataFrame, spec: TableSpec, cell=_cell) -> list[str]:
    df = _filter(df, spec, default_workloads=("forward", "train_step"))
    by_threads = spec.options.get("threads") == "column"
    several = df["workload"].nunique() > 1
    labels = list(dict.fromkeys(df["label"]))
    rows = []
    for _, g in df.groupby(SPEEDUP_BLOCK, sort=False, dropna=False):
        head = g.iloc[0]
        row = [_problem(head, several, omit=("threads",) if by_threads else ())]
        if by_threads:
            row.append(str(head["threads"]))
        cells = {r["label"]: cell(r) for _, r in g.iterrows()}
        rows.append(row + [cells.get(label, ABSENT) for label in labels])
    heads = labels if cell is _cell else [f"{label} ms" for label in labels]
    return _table(["problem"] + (["threads"] if by_threads else []) + heads, rows)


def steps(df: pd.DataFrame, spec: TableSpec) -> list[str]:
    df = _filter(df, spec, default_workloads=("forward", "train_step"))
    several = df["workload"].nunique() > 1
    rows = []
    for _, r in df.iterrows():
        if r["status"] != Status.OK:
            rows.append([_problem(r, several), r["label"], r["status"], "-", "-"])
            continue
        sp = "1" if _is_baseline(r) else _speedup(r) if _ok(r.get("speedup")) else "-"
        rows.append([_problem(r, several), r["label"], f"{r['median_s'] * 1e3:.2f}", f"{r['compile_s']:.1f}", sp])
    baseline = df["baseline"].dropna().iloc[0] if df["baseline"].notna().any() else "the baseline"
    return _table(["problem", "backend", "ms per step", "compile s", f"speedup over {baseline} [95% CI]"], rows)


def training(df: pd.DataFrame, curves: pd.DataFrame, spec: TableSpec) -> list[str]:
    df = _filter(df, spec, default_workloads=("train",))
    df = df[df["status"] == Status.OK].copy()
    df["order"] = df["time_to_target_s"].fillna(float("inf"))
    rows = []
    for _, r in df.sort_values(["order", "train_s"], kind="stable").iterrows():
        seen = curves[curves["cell_id"] == r["cell_id"]]["examples"]
        ttt = f"{r['time_to_target_s']:.2f} s" if _ok(r["time_to_target_s"]) else "not reached"
        rows.append([r["label"], ttt, str(int(seen.max())) if len(seen) else "-", f"{r['final_loss']:.3f}",
                     f"{r['compile_s']:.2f} s"])
    unit = "sentences" if df["tokens"].fillna(False).astype(bool).any() else "sequences"
    return _table(["backend", "time to target", f"{unit} trained", "final loss", "compile"], rows)


def epochs(df: pd.DataFrame, spec: TableSpec) -> list[str]:
    df = _filter(df, spec, default_workloads=("train",))
    df = df[df["status"] == Status.OK]
    labels = list(dict.fromkeys(df["label"]))
    columns = sorted({(r["label"], int(r["threads"])) for _, r in df.iterrows()}, key=lambda c: (labels.index(c[0]), c[1]))
    rows = []
    for batch, g in df.groupby("batch", sort=True):
        cells = {(r["label"], int(r["threads"])): f"{r['train_s']:.2f} s, {r['final_loss']:.2f}" for _, r in g.iterrows()}
        rows.append([str(batch)] + [cells.get(c, ABSENT) for c in columns])
    heads = [f"{label}, {t} thread" + ("s" if t != 1 else "") for label, t in columns]
    return _table(["batch"] + heads, rows)


def dtypes(df: pd.DataFrame, spec: TableSpec) -> list[str]:
    """See the module docstring: the same problem and backend across dtypes, float32 the reference."""
    df = _filter(df, spec)
    train = bool(len(df)) and (df["workload"] == "train").all()
    if not train:
        df = df[df["workload"] != "train"]
    several = df["workload"].nunique() > 1
    # the widest first (float64, float32, then the reduced types); each against float32
    order = sorted((d for d in DType if d in set(df["dtype"])), key=lambda d: -d.n_bytes)
    others = [d for d in order if d != DType.FLOAT32] if DType.FLOAT32 in order else []
    problems: dict[tuple[str, str], dict[str, object]] = {}
    for _, r in df.iterrows():
        problems.setdefault((_problem(r, several, omit=("dtype",)), r["label"]), {})[r["dtype"]] = r

    def ok(r) -> bool:
        return r is not None and r["status"] == Status.OK and _ok(r.get("final_loss" if train else "median_s"))

    rows = []
    for (problem, label), by_dtype in problems.items():
        row = [problem, label]
        for d in order:
            r = by_dtype.get(d)
            if r is None:
                row.append(ABSENT)
            elif not ok(r):
                row.append(str(r["status"]))
            else:
                row.append(f"{r['final_loss']:.4f} ({r['train_s']:.1f} s)" if train else _ms(r))
        for d in others:
            low, ref = by_dtype.get(d), by_dtype.get(DType.FLOAT32)
            if not (ok(low) and ok(ref)):
                row.append("-")  # no ratio without both cells
            elif train:
                row.append(f"{(low['final_loss'] - ref['final_loss']) / ref['final_loss'] * 100:+.2f}%")
            elif _ok(low.get("setting_speedup")) and str(low.get("setting_baseline")).startswith("dtype=float32"):
                # timed in one group with its float32 cell (pair_over): the paired interval
                s, lo, hi = low["setting_speedup"], low["setting_speedup_lo"], low["setting_speedup_hi"]
                row.append(f"{s:.2f}x [{lo:.2f}, {hi:.2f}]" if _ok(lo) and _ok(hi) else f"{s:.2f}x")
            else:  # timed apart: float32's median over this dtype's, without an interval
                row.append(f"{ref['median_s'] / low['median_s']:.2f}x")
        rows.append(row)
    heads = [f"{d} final loss (train s)" if train else f"{d} ms" for d in order]
    heads += [f"{d} loss vs float32" if train else f"{d} speedup over float32" for d in others]
    return _table(["problem", "backend"] + heads, rows)


def settings(df: pd.DataFrame, spec: TableSpec) -> list[str]:
    """See the module docstring: a paired run's (``pair_over``) settings of each backend side by side."""
    df = _filter(df, spec, default_workloads=("forward", "train_step"))
    df = df[df["setting_baseline"].notna()] if "setting_baseline" in df else df.iloc[:0]
    if df.empty:
        raise HarnessError(f"table {spec.text!r} (line {spec.line}): the run paired no settings (pair_over)")
    from harness.results.labels import setting_label

    base = setting_values(df["setting_baseline"].iloc[0])
    keys = list(base)
    several = df["workload"].nunique() > 1
    first = setting_label(base, keys)
    order = [first] + [o for o in dict.fromkeys(setting_label(r, keys) for _, r in df.iterrows()) if o != first]
    problems: dict[tuple[str, str], dict[str, object]] = {}
    for _, r in df.iterrows():
        problems.setdefault((_problem(r, several, omit=tuple(keys)), r["label"]), {})[setting_label(r, keys)] = r
    rows = []
    for (problem, label), at in problems.items():
        row = [problem, label] + [_ms(at[o]) if o in at else ABSENT for o in order]
        for o in order[1:]:
            r = at.get(o)
            if r is None or r["status"] != Status.OK or not _ok(r.get("setting_speedup")):
                row.append("-")
                continue
            s, lo, hi = r["setting_speedup"], r.get("setting_speedup_lo"), r.get("setting_speedup_hi")
            row.append(f"{s:.2f}x [{lo:.2f}, {hi:.2f}]" if _ok(lo) and _ok(hi) else f"{s:.2f}x")
        rows.append(row)
    heads = [f"{o} ms" for o in order] + [f"{o} speedup over {first}" for o in order[1:]]
    return _table(["problem", "backend"] + heads, rows)


def host(examples: Path, spec: TableSpec) -> list[str]:
    """One line per run: where and when it ran (:func:`harness.results.labels.machine_label`), and its folder."""
    import json

    from harness.results.labels import gemm_peak_text, machine_label

    lines = []
    for name in spec.runs:
        meta = json.loads((examples / name / "run.json").read_text())
        day = str(meta.get("started", "?"))[:10]
        peak = gemm_peak_text(meta)
        lines.append(f"*Run `results/examples/{name}`: {day}, on {machine_label(meta)}"
                     + (f"; {peak} measured at its start" if peak else "") + ".*")
    return lines


def render_table(spec: TableSpec, examples: Path) -> list[str]:
    """The lines between a table's markers."""
    loaded = _load(examples, spec.runs)
    if loaded is None:
        missing = [r for r in spec.runs if not (examples / r / "run.json").exists()]
        return [f"*Not measured yet: no run in `results/examples/{missing[0]}`; `harness reproduce --only "
                f"{','.join(missing)} --out results/examples` on a machine that can run it, then `harness docs`.*"]
    if spec.kind == "host":
        return host(examples, spec)
    df, curves = loaded
    if spec.kind == "speedups":
        return speedups(df, spec)
    if spec.kind == "ms":
        return speedups(df, spec, cell=_ms)
    if spec.kind == "steps":
        return steps(df, spec)
    if spec.kind == "training":
        return training(df, curves, spec)
    if spec.kind == "dtypes":
        return dtypes(df, spec)
    if spec.kind == "settings":
        return settings(df, spec)
    return epochs(df, spec)


# -- the page --------------------------------------------------------------------------------
def _blocks(lines: list[str], where: str):
    """(spec, first body line index, closing marker index) for every table of the page."""
    i = 0
    while i < len(lines):
        m = OPEN.match(lines[i])
        if m:
            spec = TableSpec.parse(m["spec"], i + 1, where)
            j = i + 1
            while j < len(lines) and lines[j].strip() != CLOSE:
                if OPEN.match(lines[j]):
                    break
                j += 1
            if j >= len(lines) or lines[j].strip() != CLOSE:
                raise HarnessError(f"{where}:{i + 1}: table {spec.text!r} has no closing {CLOSE}")
            yield spec, i + 1, j
            i = j
        i += 1


def render_page(page: Path, examples: Path) -> tuple[str, list[TableSpec]]:
    """The page with every table regenerated, and the tables whose text changed."""
    try:
        lines = page.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise HarnessError(f"{page}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise HarnessError(f"{page}: not UTF-8 text (byte {exc.start}: {exc.reason}); expected the experiments page") from None
    out, changed, last = [], [], 0
    blocks = list(_blocks(lines, str(page)))
    if not blocks:
        raise HarnessError(f"{page}: no generated tables (markers '<!-- table: KIND RUNS -->' ... '{CLOSE}')")
    check_examples(examples, [spec for spec, _, _ in blocks])
    for spec, body, close in blocks:
        out += lines[last:body]
        generated = [""] + render_table(spec, examples) + [""]
        if lines[body:close] != generated:
            changed.append(spec)
        out += generated
        last = close
    out += lines[last:]
    return "\n".join(out) + "\n", changed


def check_examples(examples: Path, specs: list[TableSpec]) -> None:
    """Refuse an ``--examples`` folder that is missing, not a folder, or holds none of the page's runs: read
    from it, every table would say "not measured yet" (a mistyped path would wipe the page)."""
    examples = Path(examples)
    if not examples.is_dir():
        what = "no such folder" if not os.path.lexists(examples) else "not a folder"
        raise HarnessError(f"--examples {examples}: {what}; expected the folder of the page's runs (results/examples)")
    wanted = list(dict.fromkeys(run for spec in specs for run in spec.runs))
    if not any((examples / run / "run.json").is_file() for run in wanted):
        shown = ", ".join(wanted[:4]) + (", ..." if len(wanted) > 4 else "")
        raise HarnessError(f"--examples {examples}: holds none of the page's runs ({shown}); expected the folder of "
                           f"the committed runs (results/examples); the page is left as it is")


def check_page(page: Path, examples: Path) -> list[TableSpec]:
    """The tables of the page that differ from what their runs give (empty: the page agrees); a HarnessError
    where the text around them promises what the runs do not hold (:func:`promise_problems`), which no
    regeneration fixes: the text is written by hand."""
    changed = render_page(page, examples)[1]
    problems = promise_problems(page, examples)
    if problems:
        raise HarnessError("the page's text promises what its runs do not hold (edit the text, or run what it "
                           "promises):\n  " + "\n  ".join(problems))
    return changed


def write_page(page: Path, examples: Path) -> list[TableSpec]:
    """Rewrite the page's tables from their runs; the tables changed. Every file this and :func:`redraw` may
    write (the page, each run's report and plots) is checked first (:mod:`harness.spec.writes`)."""
    writes.check_file(page, "--page", probe=False)
    for run in run_folders(examples):
        writes.check_no_links(examples, run)
        writes.check_only_files(run)
    text, changed = render_page(page, examples)
    if changed:
        writes.write_file(page, text)
    return changed


# -- what a section's text promises, against what its runs hold -------------------------------------
_WORDS = {"one": 1, "two": 2, "three": 3, "four": 4}
_WHOLE = r"(?<![\d.])\d+(?!\d|\.\d)"  # a whole number, not part of a figure (the 2 of "2.35x", the 6 of "23.6")
_NUMBERS = rf"({_WHOLE}(?:(?:, | and | or | to ){_WHOLE})*)"
#: phrases of a section's **Measured** text that name what ran, and the column of the runs' cells each names
_PROMISES = (
    (re.compile(r"\bbatch(?:es)? " + _NUMBERS), "batch"),
    (re.compile(r"\bthreads " + _NUMBERS), "threads"),
    (re.compile(rf"\b(one|two|three|four|{_WHOLE}) threads?\b"), "threads"),
    (re.compile(r"\bhidden " + _NUMBERS), "hidden_size"),
    (re.compile(r"\b(?:input|vocabulary) " + _NUMBERS), "input_size"),
    (re.compile(r"\bT " + _NUMBERS), "seq_len"),
)


def _measured_texts(lines: list[str]) -> list[tuple[int, str, str]]:
    """Each section's **Measured** text, ``(line, section title, text)``: from that paragraph to the section's
    first generated table, fenced code left out (a command to run is no claim about what ran)."""
    out, title, start, text, fenced = [], "", None, [], False
    for i, line in enumerate(lines, 1):
        if line.startswith("## "):
            title, start, text = line[3:], None, []
            continue
        if line.startswith("```"):
            fenced = not fenced
            continue
        if start is None and line.startswith("**Measured**"):
            start = i
        if start is not None and not fenced:
            if OPEN.match(line) and not line.startswith("<!-- table: host"):
                out.append((start, title, " ".join(text)))
                start, text = None, []
            elif not line.startswith("<!--") and not line.startswith("*Run "):
                text.append(line)
    return out


def _section_runs(lines: list[str], start: int) -> list[str]:
    """The runs the generated tables of the section holding line ``start`` read."""
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    first = max(i for i in range(start) if lines[i].startswith("## ") or i == 0)
    runs = []
    for line in lines[first:end]:
        m = OPEN.match(line)
        if m:
            runs += m.group("spec").split()[1].split(",")
    return list(dict.fromkeys(runs))


def _promised(text: str) -> dict[str, set]:
    """What a **Measured** text says ran: the batches, thread counts, sizes (``{column: values}``) and the
    backends it names in backticks (``{"label": names}``)."""
    import backends

    out: dict[str, set] = {}
    plain = text.replace("`", "")
    for pattern, column in _PROMISES:
        for m in pattern.finditer(plain):
            numbers = re.split(r", | and | or | to ", m.group(1))
            out.setdefault(column, set()).update(_WORDS.get(n, None) or int(n) for n in numbers)
    for name in re.findall(r"`([a-z][a-z0-9_]*(?::[a-z0-9_]+)?)`", text):
        try:
            backends.ref(name).backend_class()
        except HarnessError:
            continue
        out.setdefault("label", set()).add(name)
    return out


def promise_problems(page: Path, examples: Path) -> list[str]:
    """Where a section's **Measured** text names a batch, a thread count, a size or a backend that none of
    its runs' cells has, or the page shows a figure that is not there (empty: every such promise is kept).
    Sections whose runs are not there are skipped."""
    from harness.results.store import load_run

    lines = Path(page).read_text(encoding="utf-8").splitlines()
    problems = []
    for line, title, text in _measured_texts(lines):
        runs = [r for r in _section_runs(lines, line) if (Path(examples) / r / "run.json").exists()]
        if not runs:
            continue
        cells = pd.concat([load_run(Path(examples) / r).timings for r in runs], ignore_index=True)
        names = {str(b) if str(v) in ("default", "None", "nan") else f"{b}:{v}"
                 for b, v in zip(cells["backend"], cells["variant"])} | set(cells["backend"].astype(str))
        for column, values in _promised(text).items():
            held = names if column == "label" else {int(v) for v in cells[column].dropna()}
            missing = sorted(values - held, key=str)
            if missing:
                what = {"label": "backend", "hidden_size": "hidden size", "input_size": "input size",
                        "seq_len": "sequence length"}.get(column, column)
                problems.append(f"{page}:{line}: section {title!r} names {what} {', '.join(map(str, missing))}, "
                                f"which none of its runs ({', '.join(runs)}) has")
    for i, text in enumerate(lines, 1):  # every figure the page shows is one its runs have
        for link in re.findall(r"!\[[^\[\]]*\]\(([^()]+)\)", text):  # no bracket inside: linear on any line
            _, sep, inside = link.partition("results/examples/")
            figure = Path(examples) / inside if sep else Path(page).parent / link
            if not figure.is_file():
                problems.append(f"{page}:{i}: the figure {link} is not there")
    return problems


# -- the committed runs' plots and reports, checked like the tables --------------------------------
def run_folders(examples: Path) -> list[Path]:
    """The run folders under ``examples`` (those with a run.json)."""
    examples = Path(examples)
    return sorted(p for p in examples.iterdir() if (p / "run.json").is_file()) if examples.is_dir() else []


def stale_drawings(examples: Path) -> dict[Path, list[str]]:
    """Per run folder, why its plots or report are not what today's ``harness report`` makes of it."""
    from harness.results.plots import check_plots
    from harness.results.report import check_report

    found = {}
    for run in run_folders(examples):
        problems = check_plots(run) + check_report(run)
        if problems:
            found[run] = problems
    return found


def redraw(examples: Path) -> list[Path]:
    """Redraw the plots and rewrite the report of every run whose drawings are stale; the runs redrawn."""
    from harness.results.report import write_report

    stale = list(stale_drawings(examples))
    for run in stale:  # every run it redraws, before the first is written
        writes.check_no_links(examples, run)
        writes.check_only_files(run)
    for run in stale:
        write_report(run)
    still = stale_drawings(examples)
    if still:  # a plot that failed to draw leaves the report's note and no stamp: say so, not "redrawn"
        raise HarnessError("; ".join(problem for problems in still.values() for problem in problems)
                           + " (after redrawing: `harness plot RUN` shows why)")
    return stale


# -- the config reference of docs/configs.md, from the schema's own descriptions --------------------
CONFIG_PAGE = Path(__file__).resolve().parents[1] / "docs" / "configs.md"


def config_page() -> Path:
    """The project's config page, as a path from the current folder where it lies below it."""
    try:
        return CONFIG_PAGE.relative_to(Path.cwd())
    except ValueError:
        return CONFIG_PAGE
REFERENCE_OPEN, REFERENCE_CLOSE = "<!-- config-reference -->", "<!-- /config-reference -->"


@dataclass
class ConfigKey:
    """One key of a config as the reference shows it."""

    path: str  # model.hidden
    type: str
    default: str
    allowed: str
    meaning: str


def _sections() -> dict[str, type]:
    """The ``model:`` and ``task:`` mappings, validated by the spec's dataclasses rather than by pydantic."""
    from harness.spec.model import ModelSpec, TaskSpec

    return {"model": ModelSpec, "task": TaskSpec}


def _number(v) -> str:
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, int) and v >= 10**6:
        for base in (2, 10):
            exp = round(math.log(v + 1, base))
            if base**exp == v:
                return f"{base}^{exp}"
            if base**exp - 1 == v:
                return f"{base}^{exp} - 1"
    return f"{v:g}".replace("e-0", "e-") if isinstance(v, float) else str(v)


def _yaml(v) -> str:
    """A value as a config writes it (flow style)."""
    import yaml

    if v is None:
        return "unset"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (int, float)):
        return _number(v)
    if isinstance(v, str):
        return v if v and yaml.safe_load(v) == v else json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_yaml(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_yaml(x)}" for k, x in v.items()) + "}"
    return str(v)


_TYPE_WORDS = {int: "integer", float: "number", bool: "boolean", str: "text", type(None): "null", Any: "any",
               "int": "integer", "float": "number", "bool": "boolean", "str": "text", "None": "null",
               "Bptt": "text or mapping"}


def _type(annotation) -> str:
    """A field's type in words: ``integer or list of integer``, ``mapping of text to text``."""
    from pydantic import BaseModel

    if isinstance(annotation, str):  # a dataclass field under postponed annotations: "int | None"
        return " or ".join(_TYPE_WORDS.get(part.strip(), part.strip()) for part in annotation.split("|"))
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return "text"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(_type(a) for a in args))
    if origin is list:
        return f"list of {_type(args[0])}" if args and args[0] is not Any else "list"
    if origin is dict:
        return "mapping" if not args or args[1] is Any else f"mapping of {_type(args[0])} to {_type(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"
    return _TYPE_WORDS.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _literals(annotation) -> list:
    """Every value a ``Literal`` inside the annotation allows."""
    if typing.get_origin(annotation) is typing.Literal:
        return list(typing.get_args(annotation))
    return [v for a in typing.get_args(annotation) for v in _literals(a)]


def _allowed(values=None, bounds=()) -> str:
    parts = []
    if isinstance(values, str):
        parts.append(values)
    elif values:
        parts.append(", ".join(_yaml(v) for v in values))
    parts += [f"{sign} {_number(limit)}" for sign, limit in bounds]
    return "; ".join(parts)


def _pydantic_keys(model, prefix: str = "") -> list[ConfigKey]:
    """The keys of a pydantic model of the schema, its nested models' and sections' after it."""
    import annotated_types as at
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    signs = ((at.Ge, "ge", "≥"), (at.Gt, "gt", ">"), (at.Le, "le", "≤"), (at.Lt, "lt", "<"))
    keys, nested = [], []
    for name, info in model.model_fields.items():
        path = prefix + name
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            nested.append((ann, path + "."))
        elif name in _sections() and not prefix:
            nested.append((_sections()[name], path + "."))
        if info.default_factory is not None:
            default = info.default_factory()
            default = "(below)" if isinstance(default, BaseModel) or (name in _sections() and not default) else _yaml(default)
        else:
            default = "required" if info.default is PydanticUndefined else _yaml(info.default)
        bounds = [(sign, getattr(m, attr)) for m in info.metadata for kind, attr, sign in signs if isinstance(m, kind)]
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        keys.append(ConfigKey(path, _type(ann), default, _allowed(extra.get("allowed") or _literals(ann), bounds),
                              info.description or ""))
    for inner, inner_prefix in nested:
        keys += _pydantic_keys(inner, inner_prefix) if hasattr(inner, "model_fields") else _dataclass_keys(inner, inner_prefix)
    return keys


def _dataclass_keys(cls, prefix: str) -> list[ConfigKey]:
    """The keys of a ``model:`` or ``task:`` mapping, from its dataclass's fields (:func:`harness.spec.model._key`)."""
    keys = []
    for f in dataclasses.fields(cls):
        meta = f.metadata
        minimum = meta.get("minimum")
        keys.append(ConfigKey(prefix + f.name, _type(f.type), _yaml(meta.get("default")),
                              _allowed(meta.get("allowed"), [("≥", minimum)] if minimum is not None else []),
                              meta.get("description") or ""))
    return keys


def config_keys() -> list[ConfigKey]:
    """Every key a config may hold, in the order of the schema; a HarnessError naming each key that has no
    description (``Field(description=...)`` in harness/config/schema.py, ``_key`` in harness/spec/model.py)."""
    from harness.config.loader import PROFILES_DESCRIPTION
    from harness.config.schema import RawConfig

    keys = _pydantic_keys(RawConfig)
    keys.insert(next(i for i, k in enumerate(keys) if "." in k.path),
                ConfigKey("profiles", "mapping of text to mapping", "{}", "", PROFILES_DESCRIPTION))
    missing = [k.path for k in keys if not k.meaning.strip()]
    if missing:
        raise HarnessError(f"config keys without a description: {', '.join(missing)}; the config reference "
                           f"(docs/configs.md) is made from them: add Field(description=...) in harness/config/schema.py "
                           f"(model. and task. keys: _key(...) in harness/spec/model.py)")
    return keys


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def config_reference() -> list[str]:
    """The reference's Markdown: a table per section (the top level, then each mapping of keys)."""
    keys = config_keys()
    lines = ["", "<!-- generated by `harness docs` from harness/config/schema.py and harness/spec/model.py -->"]
    sections = list(dict.fromkeys(k.path.rpartition(".")[0] for k in keys))
    for section in sections:
        lines += ["", f"### `{section}:`" if section else "### Top level", "",
                  "| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
        for k in keys:
            if k.path.rpartition(".")[0] == section:
                cells = [f"`{k.path}`", k.type, f"`{k.default}`" if k.default not in ("required", "(below)", "unset")
                         else k.default, _cell(k.allowed), _cell(k.meaning)]
                lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def render_config_page(page: Path) -> tuple[str, bool]:
    """The page with its reference regenerated, and whether that changed it."""
    try:
        lines = Path(page).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise HarnessError(f"{page}: {exc.strerror or exc}; expected the config page (--configs)") from None
    except UnicodeDecodeError as exc:
        raise HarnessError(f"{page}: not UTF-8 text (byte {exc.start}: {exc.reason}); expected the config page") from None
    if lines.count(REFERENCE_OPEN) != 1 or lines.count(REFERENCE_CLOSE) != 1 or \
            lines.index(REFERENCE_OPEN) > lines.index(REFERENCE_CLOSE):
        raise HarnessError(f"{page}: expected one config reference between '{REFERENCE_OPEN}' and '{REFERENCE_CLOSE}'")
    start, close = lines.index(REFERENCE_OPEN) + 1, lines.index(REFERENCE_CLOSE)
    generated = config_reference()
    text = "\n".join(lines[:start] + generated + lines[close:]) + "\n"
    return text, lines[start:close] != generated


def check_config_page(page: Path = CONFIG_PAGE) -> bool:
    """True when the page's config reference differs from what the schema gives today."""
    return render_config_page(page)[1]


def write_config_page(page: Path = CONFIG_PAGE) -> bool:
    """Rewrite the page's config reference from the schema; whether it changed."""
    writes.check_file(page, "--configs", probe=False)
    text, changed = render_config_page(page)
    if changed:
        writes.write_file(page, text, "--configs")
    return changed

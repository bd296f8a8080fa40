"""Do the 95% intervals of a config's speedups hold what a rerun changes? Runs a config K times back
to back (``harness run``) and sets each run's intervals against the spread of the K points.

Per speedup (a cell with an interval, in every run):

- ``held``: in how many runs the interval held the median of the other runs' points (a rerun's
  figure); a calibrated 95% interval holds it less often than 95% because the others' median is
  itself a draw: ``expected`` is what a calibrated interval gives for this K (normal points, by
  simulation);
- ``half-width``: the median over the runs of the interval's relative half-width (in the logarithm);
- ``needs``: 1.96 standard deviations of the K points' logarithms, the half-width a 95% interval
  needs when each run's point scatters that much about the truth, and ``width/needs``;
- ``met``: the runs that met the precision target, and whether each met run's point lies within
  its target of the other runs' median;
- an A/A cell (``baseline_twice: true``, added with ``--aa``) also counts the runs whose interval
  held 1, its truth.

Overall: the share of all (run, speedup) pairs held, the median of ``width/needs`` over the
speedups and the pooled ratio (median half-width over 1.96 times the root of the speedups' mean
variance). The load average before and after each run is printed beside the table: on a shared
machine, read the figures with it.

The machine's steadiness between the runs is measured too, since no interval from within one run can
foresee a machine that changes between runs: every timed cell's own time (its median, the baseline's
included) across the K runs, as the spread ``max / min - 1``. On a steady machine the cells' times
move by a few percent between runs (median 1-3% on the 2-core development VM when it was steady);
where their median spread is over STEADY_SPREAD the table says that the machine moved between the
runs, and the coverage then measures the machine as much as the intervals (on that VM's unsteady
host the same cells moved 7-59% between runs 30 s apart, with nothing else running on it).

    python benchmarks/calibration.py configs/quick.yaml -k 4 --out /tmp/cal-quick
    python benchmarks/calibration.py configs/quick.yaml -k 4 --out /tmp/cal-quick --aa
    python benchmarks/calibration.py --runs /tmp/cal-quick/run-*      # the table of runs made before

Paths are the caller's (``harness run`` runs from the caller's folder); what it writes goes through the
harness's one write rule, and inside the project only under ``results/``. A bad input is one ``error:``
line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.spec import writes  # noqa: E402
from harness.spec.errors import HarnessError  # noqa: E402


def expected_coverage(k: int, n: int = 200_000, seed: int = 0) -> float:
    """How often a calibrated 95% interval (point +- 1.96 sd) holds the median of ``k - 1`` other points
    drawn like it: the benchmark's ``held`` share for a perfect interval."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, k))
    others = np.median(x[:, 1:], axis=1)
    return float(np.mean(np.abs(x[:, 0] - others) <= 1.959964))


def source_config(config: str) -> Path:
    """The config argument as ``harness run`` takes it, from the caller's folder: a file, or a shipped config's name."""
    from harness.cli import _config_path

    path = _config_path(Path(config))
    if not path.is_file():
        raise HarnessError(f"{config}: expected a config file, got {'a folder' if path.is_dir() else 'no file'}")
    return path


def check_out(out: Path, k: int, names: list[str], runs_made: bool = True) -> Path:
    """Refuse, before any run, an ``--out`` the write rule forbids: a file, a folder inside a run, one among
    the project's own files (inside the project, only under ``results/``); any of the files ``names`` it would
    write there that is a link or not a regular file; a ``run-i`` that is a run already."""
    writes.check_folder(out, "--out")
    writes.check_outside_project(out, ROOT, "--out")
    for name in names:
        writes.check_file(out / name, "--out", probe=False)
    for i in range(k if runs_made else 0):
        path = out / f"run-{i + 1}"
        writes.check_folder(path, "--out", may_be_run=True, probe=False)
        if os.path.lexists(path / "run.json"):
            raise HarnessError(f"--out {out}: {path} is a run already; choose another --out")
    return out


def run_config(source: Path, out: Path, k: int, aa: bool, extra: list[str]) -> list[Path]:
    """``harness run`` of ``source`` ``k`` times into ``out/run-i``, with the load before and after each, from
    the caller's folder (its relative paths and shipped names mean what they mean to ``harness run``)."""
    if aa:  # the same config with the A/A check on, in its first document (later ones inherit it)
        import yaml

        docs = list(yaml.safe_load_all(source.read_text(encoding="utf-8")))
        if not docs or not isinstance(docs[0], dict):
            raise HarnessError(f"{source}: expected a config (a mapping), got {type(docs[0] if docs else None).__name__}")
        docs[0]["baseline_twice"] = True
        writes.make_folder(out)
        copy = out / source.name
        writes.write_file(copy, yaml.safe_dump_all(docs, sort_keys=False), "--out")
        source = copy
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    runs = []
    for i in range(k):
        path = out / f"run-{i + 1}"
        before = os.getloadavg()
        cmd = [sys.executable, "-m", "harness.cli", "run", str(source), "--out", str(path), *extra]
        print(f"[{i + 1}/{k}] load {before[0]:.2f}: {' '.join(cmd)}", flush=True)
        done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL)
        if done.returncode:
            raise SystemExit(f"error: harness run exited with {done.returncode} ({path})")
        print(f"    load after: {os.getloadavg()[0]:.2f}", flush=True)
        runs.append(path)
    return runs


def check_runs(runs: list[Path]) -> list[Path]:
    """``--runs`` as run folders, at least two (the spread between runs is what the table sets intervals against)."""
    if len(runs) < 2:
        raise HarnessError(f"--runs: expected at least 2 runs (the spread between runs is what it measures), "
                           f"got {len(runs)}")
    for path in runs:
        if not writes.is_run_folder(path):
            what = "no such folder" if not os.path.lexists(path) else "not a run folder (no run.json and timings.parquet)"
            raise HarnessError(f"--runs {path}: {what}")
    return runs


STEADY_SPREAD = 0.05  # a machine whose cells' times move more than this between runs (median over cells) moved


def cells_of(runs: list[Path]) -> tuple[dict, list[dict], dict]:
    """Per speedup (by cell id), its label and, per run, (point, lo, hi, met, target); each run's facts;
    and per timed cell (by label), its median time in every run."""
    import harness
    from harness.results.labels import backend_label, group_label

    cells: dict[str, dict] = {}
    times: dict[str, list[float]] = {}
    facts = []
    for path in runs:
        run = harness.load_run(path)
        t = run.timings.assign(label=backend_label(run.timings))
        meta = run.meta
        facts.append({"run": str(path), "started": meta.get("started"), "finished": meta.get("finished"),
                      "loadavg_end": meta.get("loadavg_end"), "steal_share": meta.get("steal_share")})
        for _, row in t.iterrows():
            if row["status"] == "ok" and np.isfinite(row.get("median_s", np.nan)):
                times.setdefault(f"{row['label']} · {group_label(row)}", []).append(float(row["median_s"]))
            if row["status"] != "ok" or not np.isfinite(row.get("speedup_lo", np.nan)) \
                    or row["label"] == row.get("speedup_over"):
                continue
            entry = cells.setdefault(row["cell_id"], {"label": f"{row['label']} · {group_label(row)}",
                                                      "aa": bool(str(row.get("copy")) not in ("None", "nan")),
                                                      "runs": []})
            met = row.get("precision_met")
            entry["runs"].append((float(row["speedup"]), float(row["speedup_lo"]), float(row["speedup_hi"]),
                                  None if met is None or met != met else bool(met), row.get("speedup_precision")))
    return ({c: e for c, e in cells.items() if len(e["runs"]) == len(runs)}, facts,
            {c: v for c, v in times.items() if len(v) == len(runs)})


def steadiness(times: dict[str, list[float]]) -> tuple[str, dict]:
    """How far each timed cell's own time moved between the runs (``max / min - 1`` of its medians):
    a line that says whether the machine held steady, and the figures."""
    spreads = {c: max(v) / min(v) - 1 for c, v in times.items() if len(v) > 1 and min(v) > 0}
    if not spreads:
        return "", {}
    median = float(np.median(list(spreads.values())))
    worst = max(spreads, key=spreads.get)
    figures = {"median_time_spread": median, "max_time_spread": spreads[worst], "max_spread_cell": worst,
               "steady": median <= STEADY_SPREAD}
    if figures["steady"]:
        verdict = "the machine held steady between the runs"
    else:
        verdict = ("the machine moved between the runs: the coverage below measures the machine as much as "
                   "the intervals (no interval from within one run foresees it)")
    return (f"each timed cell's own time across the runs moved by median {median:.1%} (max {spreads[worst]:.1%}: "
            f"{worst}): {verdict}"), figures


def table(cells: dict, k: int) -> tuple[str, dict]:
    """The per-speedup table and the overall figures."""
    lines = ["| speedup | points | held | half-width | needs | width/needs | met (agree) | A/A held 1 |",
             "|---|---|---|---|---|---|---|---|"]
    held_all, ratios, variances, widths, n_met, n_agree, aa_held, aa_n = [], [], [], [], 0, 0, 0, 0
    for entry in sorted(cells.values(), key=lambda e: e["label"]):
        pts = np.array([r[0] for r in entry["runs"]])
        logs = np.log(pts)
        half = np.array([np.log(r[2] / r[1]) / 2 for r in entry["runs"]])
        held, agree, met = [], [], []
        for i, (p, lo, hi, ok, target) in enumerate(entry["runs"]):
            others = float(np.median(np.delete(pts, i)))
            held.append(lo <= others <= hi)
            if ok:
                met.append(i)
                agree.append(abs(np.log(p / others)) <= float(target))
        sd = float(np.std(logs, ddof=1))
        needs = 1.959964 * sd
        ratio = float(np.median(half) / needs) if needs > 0 else float("inf")
        held_all += held
        ratios.append(ratio)
        variances.append(sd ** 2)
        widths += list(half)
        n_met += len(met)
        n_agree += sum(agree)
        aa = ""
        if entry["aa"]:
            ones = sum(r[1] <= 1.0 <= r[2] for r in entry["runs"])
            aa_held += ones
            aa_n += k
            aa = f"{ones}/{k}"
        lines.append(f"| {entry['label']} | {', '.join(f'{p:.3g}' for p in pts)} | {sum(held)}/{k} | "
                     f"{np.median(half):.2%} | {needs:.2%} | {ratio:.2f} | {len(met)}/{k} ({sum(agree)}) | {aa} |")
    spread = 1.959964 * np.sqrt(np.mean(variances)) if variances else 0.0
    pooled = float(np.median(widths) / spread) if spread > 0 else float("nan") if not variances else float("inf")
    overall = {"speedups": len(cells), "runs": k, "held": float(np.mean(held_all)) if held_all else float("nan"),
               "expected_held": expected_coverage(k), "median_width_over_needs": float(np.median(ratios)) if ratios else float("nan"),
               "pooled_width_over_needs": pooled, "met": n_met, "met_agree": n_agree, "pairs": len(held_all),
               "aa_held_one": aa_held, "aa_runs": aa_n}
    lines.append(f"| **overall** ({len(cells)} speedups x {k} runs) | | {sum(held_all)}/{len(held_all)} "
                 f"= {overall['held']:.0%} (calibrated: {overall['expected_held']:.0%}) | {np.median(widths):.2%} | | "
                 f"median {overall['median_width_over_needs']:.2f}, pooled {pooled:.2f} | {n_met}/{len(held_all)} ({n_agree}) | "
                 + (f"{aa_held}/{aa_n}" if aa_n else "") + " |")
    return "\n".join(lines), overall


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", help="the config to run K times (a file, or a shipped config's name)")
    ap.add_argument("-k", type=int, default=4, help="runs (default 4, at least 2)")
    ap.add_argument("--out", type=Path, help="where the runs go (run-1 ... run-K) and calibration.md/.json")
    ap.add_argument("--aa", action="store_true", help="turn the A/A check on (baseline_twice: true)")
    ap.add_argument("--runs", type=Path, nargs="+", help="runs made before: only the table")
    ap.add_argument("--profile", help="passed to harness run")
    args = ap.parse_args(argv)
    try:
        return _main(args)
    except HarnessError as exc:  # one line, as the harness's CLI says it
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _main(args) -> int:
    extra = ["--profile", args.profile] if args.profile else []
    names = ["calibration.md", "calibration.json"]
    if args.runs:
        runs = check_runs(args.runs)
        out = args.out or Path(runs[0]).parent
        check_out(out, 0, names, runs_made=False)
    elif args.config and args.out:
        if args.k < 2:
            raise HarnessError(f"-k: expected at least 2 runs (the spread between runs is what it measures), got {args.k}")
        source = source_config(args.config)
        check_out(args.out, args.k, names + ([source.name] if args.aa else []))
        out = args.out
        runs = run_config(source, args.out, args.k, args.aa, extra)
    else:
        raise HarnessError("expected CONFIG with --out, or --runs")
    cells, facts, times = cells_of(runs)
    if not cells:
        raise HarnessError(f"the {len(runs)} runs share no speedup with an interval in every run: nothing to set "
                           f"against the spread")
    text, overall = table(cells, len(runs))
    steady, overall["steadiness"] = steadiness(times)
    load = ", ".join(f"{f['loadavg_end'][0]:.2f}" if f.get("loadavg_end") else "?" for f in facts)
    head = (f"{len(runs)} runs ({runs[0]} ...), load average (1 min) at each run's end: {load}; "
            f"steal: {', '.join(str(f.get('steal_share')) for f in facts)}" + (f"; {steady}" if steady else ""))
    print(head + "\n\n" + text)
    writes.write_file(out / "calibration.md", head + "\n\n" + text + "\n", "--out")
    writes.write_file(out / "calibration.json", json.dumps({"overall": overall, "runs": facts, "cells": cells},
                                                           indent=2, default=str), "--out")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

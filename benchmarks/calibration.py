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


def expected_coverage(k: int, n: int = 200_000, seed: int = 0) -> float:
    """How often a calibrated 95% interval (point +- 1.96 sd) holds the median of ``k - 1`` other points
    drawn like it: the benchmark's ``held`` share for a perfect interval."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, k))
    others = np.median(x[:, 1:], axis=1)
    return float(np.mean(np.abs(x[:, 0] - others) <= 1.959964))


def run_config(config: str, out: Path, k: int, aa: bool, extra: list[str]) -> list[Path]:
    """``harness run`` of ``config`` ``k`` times into ``out/run-i``, with the load before and after each."""
    source = Path(config)
    if aa:  # the same config with the A/A check on, in its first document (later ones inherit it)
        import yaml

        docs = list(yaml.safe_load_all(source.read_text()))
        docs[0]["baseline_twice"] = True
        out.mkdir(parents=True, exist_ok=True)
        source = out / source.name
        source.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    runs = []
    for i in range(k):
        path = out / f"run-{i + 1}"
        before = os.getloadavg()
        cmd = [sys.executable, "-m", "harness.cli", "run", str(source), "--out", str(path), *extra]
        print(f"[{i + 1}/{k}] load {before[0]:.2f}: {' '.join(cmd)}", flush=True)
        done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
        if done.returncode:
            raise SystemExit(f"harness run exited with {done.returncode} ({path})")
        print(f"    load after: {os.getloadavg()[0]:.2f}", flush=True)
        runs.append(path)
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
    pooled = float(np.median(widths) / (1.959964 * np.sqrt(np.mean(variances)))) if variances else float("nan")
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
    ap.add_argument("config", nargs="?", help="the config to run K times")
    ap.add_argument("-k", type=int, default=4, help="runs (default 4)")
    ap.add_argument("--out", type=Path, help="where the runs go (run-1 ... run-K) and calibration.md/.json")
    ap.add_argument("--aa", action="store_true", help="turn the A/A check on (baseline_twice: true)")
    ap.add_argument("--runs", type=Path, nargs="+", help="runs made before: only the table")
    ap.add_argument("--profile", help="passed to harness run")
    args = ap.parse_args(argv)
    extra = ["--profile", args.profile] if args.profile else []
    if args.runs:
        runs = args.runs
    elif args.config and args.out:
        runs = run_config(args.config, args.out, args.k, args.aa, extra)
    else:
        ap.error("expected CONFIG with --out, or --runs")
    cells, facts, times = cells_of(runs)
    text, overall = table(cells, len(runs))
    steady, overall["steadiness"] = steadiness(times)
    load = ", ".join(f"{f['loadavg_end'][0]:.2f}" if f.get("loadavg_end") else "?" for f in facts)
    head = (f"{len(runs)} runs ({runs[0]} ...), load average (1 min) at each run's end: {load}; "
            f"steal: {', '.join(str(f.get('steal_share')) for f in facts)}" + (f"; {steady}" if steady else ""))
    print(head + "\n\n" + text)
    out = args.out or Path(runs[0]).parent
    if args.out or args.runs:
        (out / "calibration.md").write_text(head + "\n\n" + text + "\n")
        (out / "calibration.json").write_text(json.dumps({"overall": overall, "runs": facts,
                                                          "cells": cells}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

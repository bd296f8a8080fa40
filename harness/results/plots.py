"""Plots drawn from the results tables only (never from the runner's state).

Each plot is made only when the run has the data for it; ``make_plots`` returns the
files it wrote.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# the figures, each in its own module; re-exported here, where notebooks and the report find them
from harness.results.labels import backend_label, fmt_seconds, group_label, optional_text, setting_label  # noqa: F401
from harness.results.plot_roofline import arithmetic_intensity, plot_roofline  # noqa: F401
from harness.results.plot_speedup import plot_runs, plot_settings, plot_speedup  # noqa: F401
from harness.results.plot_style import _hue, _palette, _shade, backend_colour, backend_marker  # noqa: F401
from harness.results.plot_sweeps import (crossover_batch, plot_crossover, plot_scaling, plot_threads,  # noqa: F401
                                         plot_threads_batch)
from harness.results.plot_training import plot_loss_vs_time, plot_train_tradeoff  # noqa: F401
from harness.spec.writes import prepare_folder, remove_file, write_file


@dataclass(frozen=True)
class Plot:
    """One plot a run can have: its file under ``plots/``, what draws it from the run's tables
    (``draw(run, path)``, None when the run has nothing to show there) and its caption in the report."""

    file: str
    draw: Callable
    caption: str


# The plots, in the order the report shows them: a new plot is added here, and only here.
PLOTS = (
    Plot("speedup.png", lambda run, out: plot_speedup(run.timings, out),
         "Speedup over the baseline (its time over each backend's: right of the dashed 1x line, faster) per "
         "comparison group, from rounds timed in turn: points with the 95% intervals of the table, on one log axis "
         "for every panel; panels in rows and columns by what the run swept."),
    Plot("settings.png", lambda run, out: plot_settings(run.timings, out),
         "Each backend's speedup at a paired setting (pair_over: dtype, threads) over its own at the first one "
         "(that one's time over this one's: right of the dashed 1x line, faster), from rounds taken in turn in one "
         "group: points with the paired 95% intervals."),
    Plot("loss_vs_time.png", lambda run, out: plot_loss_vs_time(run.curves, out),
         "Evaluation loss against training wall-clock (evaluation time excluded); dashed red, the target where the "
         "run set one; dotted grey, the task's loss floor where it is known. With several dtypes, a panel per backend "
         "holds each dtype's curve."),
    Plot("scaling.png", lambda run, out: plot_scaling(run.timings, out),
         "Median time per call against each size the run varied, all else fixed."),
    Plot("roofline.png", lambda run, out: plot_roofline(run.timings, out),
         "Achieved GFLOP/s per cell against the estimated arithmetic intensity of a step's matrix products; "
         "the line is the GEMM peak measured at the start of the run."),
    Plot("threads_batch.png", lambda run, out: plot_threads_batch(run.timings, out),
         "Time per example over threads x batch."),
    Plot("threads.png", lambda run, out: plot_threads(run.timings, out),
         "Time per step against threads, a line per backend; dotted, its one-thread time divided by the thread "
         "count (perfect scaling)."),
    Plot("crossover.png", lambda run, out: plot_crossover(run.timings, out),
         "CPU and GPU time per example against batch size; the dotted line marks where the GPU starts to win."),
    Plot("train_tradeoff.png", lambda run, out: plot_train_tradeoff(run.timings, out),
         "Training time for the run's examples against the loss reached, per backend, threads and batch."),
)


def make_plots(run_dir) -> list[Path]:
    """Draw every plot the run has data for into ``run_dir/plots`` (PNG, and SVG beside each), each file
    stamped with what it was drawn from (:func:`plots_digest`) and listed in ``plots/plots.json``;
    files an earlier drawing left there that this one does not draw are removed."""
    from harness.results.store import load_run

    run = load_run(run_dir)
    folder = prepare_folder(Path(run_dir) / "plots", below=run_dir)  # before drawing: no link among what it replaces
    made = [p for p in (plot.draw(run, folder / plot.file) for plot in PLOTS) if p is not None]
    files = sorted(f.name for p in made for f in (p, p.with_suffix(".svg")) if f.exists())
    digest = plots_digest(run_dir)
    for name in files:
        _stamp(folder / name, _file_digest(digest, name))
    for old in _drawn_files(folder):
        if old.name not in files:
            remove_file(old, run=run_dir)
    write_file(folder / MANIFEST, json.dumps({"digest": digest, "files": files}, indent=1) + "\n", run=run_dir)
    return made


# -- plots checked like tables: what drew each file, and whether today's code draws the same ----------
#: the list of a run's plots and what they were drawn from, beside them
MANIFEST = "plots.json"
#: the text key of the stamp in a PNG, and its marker in an SVG
STAMP_KEY = "harness-plot"
#: the code that decides what a plot shows: a change here redraws every committed run's plots
PLOT_CODE = ("harness/results/plots.py", "harness/results/plot_style.py", "harness/results/plot_speedup.py",
             "harness/results/plot_training.py", "harness/results/plot_sweeps.py", "harness/results/plot_roofline.py",
             "harness/results/labels.py", "harness/results/schema.py",
             "harness/results/standing.py")  # the marks every speedup figure carries
#: the tables a plot is drawn from
PLOT_INPUTS = ("timings.parquet", "curves.parquet")


def _drawn_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix in (".png", ".svg")) if folder.is_dir() else []


def plotting_code_digest(backend_names) -> str:
    """A hash of the plotting code and of what the colours of ``backend_names`` (a run's backends) depend on:
    each one's hue and its class's variants. Backends the run does not hold (a plugin installed since) do not
    enter it, so the stamp of a run's plots is the same wherever its backends are registered alike."""
    import hashlib

    import backends

    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for rel in PLOT_CODE:
        h.update(rel.encode() + b"\0" + (root / rel).read_bytes())
    for name in sorted(set(backend_names)):
        try:
            variants = list(backends.backend_class(name).variants)
        except Exception:
            variants = []
        hue = ",".join(f"{v:.4f}" for v in _hue(name))
        h.update(f"{name}:{hue}:{','.join(map(str, variants))};".encode())
    return h.hexdigest()


def _run_backends(run_dir) -> set[str]:
    """The backend names a run's tables hold (what its plots colour)."""
    import pandas as pd

    names: set[str] = set()
    for name in PLOT_INPUTS:
        path = Path(run_dir) / name
        if path.exists():
            try:
                names.update(map(str, pd.read_parquet(path, columns=["backend"])["backend"].dropna().unique()))
            except (OSError, ValueError, KeyError):  # a table without the column (or damaged): its bytes still count
                pass
    return names


def plots_digest(run_dir) -> str:
    """What a run's plots are drawn from: its tables' bytes and the plotting code (:func:`plotting_code_digest`
    of the backends they hold)."""
    import hashlib

    h = hashlib.sha256(plotting_code_digest(_run_backends(run_dir)).encode())
    for name in PLOT_INPUTS:
        path = Path(run_dir) / name
        h.update(name.encode() + b"\0" + (path.read_bytes() if path.exists() else b"-"))
    return h.hexdigest()[:32]


def _file_digest(digest: str, name: str) -> str:
    import hashlib

    return hashlib.sha256(f"{digest}/{name}".encode()).hexdigest()[:32]


def _stamp(path: Path, value: str) -> None:
    """Write ``value`` into the file: a PNG text chunk, or a comment after an SVG's XML declaration."""
    if path.suffix == ".png":
        from PIL import Image
        from PIL.PngImagePlugin import PngInfo

        with Image.open(path) as image:
            image.load()
            info = PngInfo()
            for k, v in image.text.items():
                if k != STAMP_KEY:
                    info.add_text(k, v)
            info.add_text(STAMP_KEY, value)
            write_file(path, lambda tmp: image.save(tmp, format="PNG", pnginfo=info), run=path.parent.parent)
    else:
        text = path.read_text()
        head, sep, rest = text.partition("?>")
        write_file(path, f"{head}{sep}\n<!-- {STAMP_KEY}: {value} -->{rest}" if sep else f"<!-- {STAMP_KEY}: {value} -->\n{text}",
                   run=path.parent.parent)


def read_stamp(path: Path) -> str | None:
    """The stamp a plot file carries (None: none, or not a readable image)."""
    try:
        if path.suffix == ".png":
            from PIL import Image

            with Image.open(path) as image:
                return image.text.get(STAMP_KEY)
        found = re.search(rf"<!-- {STAMP_KEY}: (\w+) -->", path.read_text()[:4000])
        return found.group(1) if found else None
    except (OSError, ValueError, SyntaxError):
        return None


def check_plots(run_dir) -> list[str]:
    """Why the run's plots are not what ``harness plot`` draws from it today (empty: they are)."""
    folder = Path(run_dir) / "plots"
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        listed, digest = list(manifest["files"]), str(manifest["digest"])
    except (OSError, ValueError, KeyError, TypeError):
        return [f"{folder}: no {MANIFEST} (not drawn by today's harness plot)"]
    problems = []
    if digest != plots_digest(run_dir):
        problems.append(f"{folder}: drawn from other rows or by other plotting code than today's")
    for name in listed:
        stamp = read_stamp(folder / name)
        if stamp is None:
            problems.append(f"{folder / name}: missing, or without the stamp of the drawing")
        elif stamp != _file_digest(digest, name):
            problems.append(f"{folder / name}: not the plot drawn under this name")
    extra = [p.name for p in _drawn_files(folder) if p.name not in listed]
    if extra:
        problems.append(f"{folder}: {', '.join(extra)} not drawn by harness plot")
    return problems

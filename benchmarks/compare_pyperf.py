"""The harness's absolute time of one NumPy SGD step against pyperf's, back to back.

The same cells (one config, NumPy only, one thread) are timed twice: by pyperf, as a user who
trusts it would (fresh processes x values, pinned to one CPU, one BLAS/OpenMP thread, a plain
``backends.create("numpy")``, ``prepare``, ``sgd_step(x, y, 0.005)`` loop), and by ``harness run``.
Both take the problem, parameters and batch from the config through the harness's own spec
(``reference.init_params``, ``make_dataset``), so only the timers differ.

pyperf starts its workers with a clean environment (PATH, HOME and what ``--inherit-environ``
names): what the harness sets for its workers beyond the thread counts, the allocator settings
of the config's ``env`` above all (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``), is
not there unless passed on. ``--pyperf-env`` says which environments pyperf runs under:
``plain`` (the thread counts alone, as a plain pyperf run pinned to one thread has them),
``harness`` (the variables of the harness's worker for this cell, read from
:func:`harness.run.client.worker_settings`) and ``harness+reference`` (those, and one float64
reference step before the timed ones, as a worker's verification ran it while NumPy's
huge-page advice was on for it: with the raised malloc thresholds the heap kept the
reference's huge pages for the step's buffers). The table gives the harness's time over each.

The caller's variables that steer a numerical library (``OPENBLAS_CORETYPE``, ``OPENBLAS_L2_SIZE``,
``OMP_*``, ...: :mod:`harness.spec.tuning`) decide which kernels both tools run, so each comparison is
made in one of two set-ups, both tools alike (``--setup``): ``inherited``, where the harness's workers
inherit them as usual and pyperf is told to pass them on (``--inherit-environ``), and ``clean``, where
the harness runs with ``clean_env: true`` and pyperf as it starts by default, neither with them. Each
set-up prints the variables both tools' workers got and the BLAS kernel each ran (the harness's
``blas_kernel`` column, and the same reading in pyperf's workers, kept in its metadata), and the
harness's own reading of the machine while it timed (other processes' CPU in cores, load average).

    python benchmarks/compare_pyperf.py                       # 3 repeats of 6 processes x 5 values, CPU 0
    python benchmarks/compare_pyperf.py --repeat 2 --out /tmp/cmp
    OPENBLAS_CORETYPE=Haswell python benchmarks/compare_pyperf.py --setup inherited,clean --pyperf-env harness

Prints the load average before and after each tool: on a shared machine, read the ratios
together with it. pyperf runs in a session of its own, as each harness worker does: with
the kernel's autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``) a session
is one group sharing the CPU with every other, and a worker in the caller's session would
get a smaller share than the harness's on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]

# three shapes: WildML's Elman language model at vocabulary 2000 (batch 1 and 16) and an
# LSTM on dense input; every cell one NumPy thread
CONFIG = textwrap.dedent("""\
    name: compare-pyperf
    seed: 10
    dtype: float32
    model: {kind: elman, hidden: 100, activation: tanh, bias: false, head: softmax_xent, bptt: {truncated: 4}}
    task: {kind: lm_markov, vocab: 2000, seq_len: 20, n_sequences: 64, n_eval: 16}
    workloads: [train_step]
    batch: [1, 16]
    threads: [1]
    backends: [numpy]
    baseline: numpy
    train: {lr: 0.005}
    ---
    model: {kind: lstm, hidden: 128, bias: true, head: mse, bptt: full}
    task: {kind: random, input_size: 64, output_size: 64, seq_len: 25, n_sequences: 64, n_eval: 16}
    batch: [16]
    """)


def label(cell) -> str:
    """A short name of a cell's shape (the table's first column, pyperf's benchmark name)."""
    p = cell.problem
    return f"{p.model.kind} in{p.input_size} H{p.model.hidden} T{p.seq_len} B{p.batch}"


def cells(config_path: str) -> list:
    from harness.config import load_config

    return [c for group in load_config(config_path).groups() for c in group]


# -- pyperf's side: this file run as a pyperf Runner (its workers run it again with --worker) ----------

def plain_step(cell, reference_first: bool = False):
    """A time function for pyperf: ``loops`` plain SGD steps of the cell's problem on its batch.

    ``reference_first``: one float64 reference step on the same batch before the timed ones, as a worker's
    verification ran it before this project kept NumPy's huge-page advice off for it."""
    import numpy as np

    import backends
    from harness.spec import reference
    from harness.spec.data import make_dataset

    p = cell.problem
    data = make_dataset(cell.task, p.model, cell.seed, p.master_dtype)
    x, y = data.batch(np.arange(p.batch) % data.n_sequences)  # the worker's batch (CellState)
    b = backends.create("numpy")
    params = reference.init_params(p.model, p.input_size, p.output_size, cell.seed, p.dtype)
    b.prepare(p, params, device="cpu", threads=1)
    lr = cell.train.lr
    if reference_first:
        reference.sgd_step(p.model, reference.params_like(params, np.float64), x, y, lr)
    clock = __import__("time").perf_counter

    def time_func(loops: int) -> float:
        step = b.sgd_step
        t0 = clock()
        for _ in range(loops):
            step(x, y, lr)
        return clock() - t0

    return time_func


def pyperf_main() -> None:
    import pyperf

    def forward(cmd, args):
        cmd.extend(["--config", args.config] + (["--reference-first"] if args.reference_first else []))

    runner = pyperf.Runner(add_cmdline_args=forward)
    runner.argparser.add_argument("--config", required=True)
    runner.argparser.add_argument("--reference-first", action="store_true")
    args = runner.parse_args()
    for cell in cells(args.config):
        step = plain_step(cell, args.reference_first)
        runner.bench_time_func(label(cell), step, metadata={"blas_kernel": blas_kernel()})


def blas_kernel() -> str:
    """The BLAS kernels loaded in this process, as the harness's ``blas_kernel`` column writes them."""
    from harness.results.caveats import kernel_text
    from harness.worker.blas_probe import kernels

    return kernel_text(kernels()) or "unreported"


# -- the comparison ----------------------------------------------------------------------------------

SETUPS = ("inherited", "clean")


def environments(config_path: str, setup: str) -> dict[str, dict[str, str]]:
    """The variables pyperf's workers get under each ``--pyperf-env`` choice in a set-up (one cell stands for
    all: every cell is NumPy with one thread). In the ``inherited`` set-up every choice also carries the
    caller's steering variables that the harness's workers inherit (:func:`harness.run.client.process_environ`);
    in the ``clean`` set-up neither tool's workers get them."""
    from harness.run import envs
    from harness.run.client import CALLER, process_environ, worker_settings

    cell = cells(config_path)[0]
    environment, settings = worker_settings(cell.backend, "cpu", cell.problem.dtype, cell.threads, cell.env)
    _, record = process_environ(environment, settings, cell.env, clean=setup == "clean")
    caller = {k: v["value"] for k, v in record.items() if v["origin"] == CALLER and not v.get("removed")}
    harness_env = {k: v for k, v in settings.items() if k not in ("HARNESS_CPUS", "PYTHONUNBUFFERED")}
    plain = {v: "1" for v in envs.THREAD_VARS}
    return {"harness": {**caller, **harness_env}, "plain": {**caller, **plain},
            "harness+reference": {**caller, **harness_env}}


def config_text(setup: str) -> str:
    """The comparison's config in a set-up: ``clean`` runs the harness's workers with ``clean_env: true``."""
    return CONFIG.replace("baseline: numpy\n", "baseline: numpy\nclean_env: true\n") if setup == "clean" else CONFIG


def run_pyperf(config_path: str, env: dict[str, str], out: Path, args, reference_first: bool = False) -> dict[str, dict]:
    """pyperf's medians per cell label, with its processes' spread."""
    import pyperf

    cmd = [sys.executable, str(HERE), "--config", config_path, "--processes", str(args.processes),
           "--values", str(args.values), "--affinity", str(args.cpu), "--quiet", "-o", str(out)]
    if env:
        cmd += ["--inherit-environ", ",".join(sorted(env))]
    if reference_first:
        cmd.append("--reference-first")
    full = {**os.environ, **env, "COMPARE_PYPERF_CHILD": "1"}
    for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX", "MALLOC_TOP_PAD_"):
        if k not in env:
            full.pop(k, None)
    # a session of its own, as the harness starts each worker: with the kernel's autogroup scheduling a
    # session is one group sharing the CPU fairly with every other, so on a busy machine a process in the
    # caller's session gets a smaller share than a worker in its own (pyperf read 1.5-4x the harness's
    # wall times that way on the 2-core VM under a load of 7)
    subprocess.run(cmd, check=True, env=full, cwd=str(ROOT), start_new_session=True)
    found = {}
    for bench in pyperf.BenchmarkSuite.load(str(out)).get_benchmarks():
        per_process = [statistics.median(r.values) for r in bench.get_runs() if r.values]
        found[bench.get_name()] = {"median_s": bench.median(), "n_processes": len(per_process),
                                   "process_spread": (max(per_process) - min(per_process)) / bench.median(),
                                   "blas_kernel": bench.get_metadata().get("blas_kernel", "unreported")}
    return found


def run_harness(config_path: str, out: Path) -> dict[str, dict]:
    """The harness's medians per cell label, with the processes their rounds came from."""
    import harness

    subprocess.run([sys.executable, "-m", "harness.cli", "run", config_path, "--out", str(out)], check=True,
                   cwd=str(ROOT), stdout=subprocess.DEVNULL)
    run = harness.load_run(out)
    by_id = {c.cell_id: label(c) for c in cells(config_path)}
    found = {}
    for _, row in run.timings.iterrows():
        found[by_id[row["cell_id"]]] = {
            "median_s": float(row["median_s"]), "iqr_s": float(row["iqr_s"]),
            "n_processes": int(row["n_worker_processes"]),
            "process_spread": float(row["process_spread"]) if row["process_spread"] is not None else float("nan"),
            "blas_kernel": row.get("blas_kernel") or "unreported", "contention": row.get("contention") or "unsampled"}
    seen = (run.meta.get("conditions") or {}).get("run") or {}
    found[None] = {"others_cores": seen.get("others_cores"), "load_max": seen.get("load_max")}
    return found


#: the agreement the comparison looks for between the two tools' medians
AGREE = 0.02


def _t(s: float) -> str:
    return f"{s * 1e6:.0f} us" if s < 1e-3 else f"{s * 1e3:.3g} ms"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=6, help="pyperf's worker processes (besides its calibration)")
    ap.add_argument("--values", type=int, default=5, help="pyperf's values per process")
    ap.add_argument("--cpu", type=int, default=0, help="the CPU pyperf's workers are pinned to (the harness pins "
                                                      "its one-thread workers to the first of its own)")
    ap.add_argument("--pyperf-env", default="plain,harness,harness+reference",
                    help="comma-separated: plain, harness, harness+reference (see the module)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of the whole comparison, back to back (their ratios "
                                                          "are summed up by their median)")
    ap.add_argument("--setup", default="inherited,clean",
                    help="comma-separated: inherited (both tools' workers get the caller's steering variables), "
                         "clean (neither does)")
    ap.add_argument("--out", type=Path, help="keep the config, pyperf's JSON and the harness's runs here")
    args = ap.parse_args(argv)

    out = args.out or Path(tempfile.mkdtemp(prefix="compare-pyperf-"))
    out.mkdir(parents=True, exist_ok=True)
    env_names = [e for e in args.pyperf_env.split(",") if e]
    for setup in [s for s in args.setup.split(",") if s]:
        if setup not in SETUPS:
            ap.error(f"--setup: expected {', '.join(SETUPS)}, got {setup!r}")
        compare(setup, env_names, out / setup, args)


def compare(setup: str, env_names: list[str], out: Path, args) -> None:
    """One set-up's comparison: its environments stated, each repeat's table, the medians over repeats."""
    out.mkdir(parents=True, exist_ok=True)
    config_path = str(out / "compare_pyperf.yaml")
    Path(config_path).write_text(config_text(setup))
    envs_by_name = environments(config_path, setup)
    print(f"== set-up {setup}: " + ("the caller's steering variables reach both tools' workers" if setup == "inherited"
                                    else "neither tool's workers get the caller's steering variables"), flush=True)
    print("pyperf environments:", json.dumps({e: envs_by_name[e] for e in env_names}), flush=True)
    labels = [label(c) for c in cells(config_path)]
    history: list[tuple[dict, dict]] = []
    for r in range(args.repeat):
        results, ran = {}, {}
        order = env_names + [None]  # None: the harness; every other round in reverse, so a drift of load favours none
        for name in order if r % 2 == 0 else order[::-1]:
            print(f"[{setup} {r + 1}] {'harness run' if name is None else f'pyperf ({name} env)'}, "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
            if name is None:
                ran = run_harness(config_path, out / f"harness-{r + 1}")
            else:
                results[name] = run_pyperf(config_path, envs_by_name[name], out / f"pyperf-{name}-{r + 1}.json", args,
                                           reference_first=name.endswith("+reference"))
        seen = ran[None]
        print(f"[{setup} {r + 1}] done, load {os.getloadavg()[0]:.2f}; while the harness timed: other processes' CPU "
              f"{seen['others_cores']} cores, load average up to {seen['load_max']}", flush=True)
        print("BLAS kernels: harness " + "; ".join(f"{lab}: {ran[lab]['blas_kernel']}" for lab in labels) + " | "
              + " | ".join(f"pyperf {e}: " + "; ".join(dict.fromkeys(results[e][lab]["blas_kernel"] for lab in labels))
                           for e in env_names), flush=True)
        head = ["shape"] + [f"pyperf {e} env" for e in env_names] + ["harness"] + [f"harness / pyperf {e}" for e in env_names]
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for lab in labels:
            h = ran[lab]
            cols = [lab]
            for e in env_names:
                p = results[e][lab]
                cols.append(f"{_t(p['median_s'])} ({p['n_processes']} proc, spread {p['process_spread']:.1%})")
            cols.append(f"{_t(h['median_s'])} ({h['n_processes']} proc, spread {h['process_spread']:.1%}, "
                        f"IQR {h['iqr_s'] / h['median_s']:.1%})")
            cols += [f"{h['median_s'] / results[e][lab]['median_s']:.3f}" for e in env_names]
            print("| " + " | ".join(cols) + " |", flush=True)
        history.append((results, ran))
    if len(history) > 1:  # each tool's median over the repeats, and the paired ratios
        # A shared VM's speed drifts by several percent within a minute, so a ratio is read within a repeat
        # (the two tools back to back) and the repeats' ratios are summed up by their median: the drift
        # between repeats then moves both tools alike.
        print(f"over the {len(history)} repeats: median of each tool's medians; median of the repeats' ratios "
              f"(each repeat's ratio); within {AGREE:.0%}: whether that median lies within it")
        head = (["shape"] + [f"pyperf {e} env" for e in env_names] + ["harness"]
                + [f"harness / pyperf {e}" for e in env_names] + [f"within {AGREE:.0%}"])
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for lab in labels:
            h = statistics.median(ran[lab]["median_s"] for _, ran in history)
            p = {e: statistics.median(res[e][lab]["median_s"] for res, _ in history) for e in env_names}
            ratios = {e: [ran[lab]["median_s"] / res[e][lab]["median_s"] for res, ran in history] for e in env_names}
            paired = {e: statistics.median(ratios[e]) for e in env_names}
            cols = [lab] + [_t(p[e]) for e in env_names] + [_t(h)]
            cols += [f"{paired[e]:.3f} ({' / '.join(f'{x:.3f}' for x in ratios[e])})" for e in env_names]
            cols.append(", ".join("yes" if abs(paired[e] - 1) <= AGREE else "no" for e in env_names))
            print("| " + " | ".join(cols) + " |", flush=True)
    print(f"files: {out}")


if __name__ == "__main__":
    if os.environ.get("COMPARE_PYPERF_CHILD") or "--worker" in sys.argv:
        pyperf_main()
    else:
        main()

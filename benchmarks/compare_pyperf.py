"""The harness's absolute time of one NumPy SGD step against pyperf's, in short turns taken in turn.

The same cells (one config, NumPy only, one thread) are timed by both tools: by pyperf, as a user who
trusts it would (fresh processes x values, pinned to one CPU, one BLAS/OpenMP thread, a plain
``backends.create("numpy")``, ``prepare``, ``sgd_step(x, y, 0.005)`` loop), and by the harness's own
timing of a comparison group (:class:`harness.run.group.GroupRun`: a fresh worker, its warm-up,
verification against the reference, calibrated rounds). Both take the problem, parameters and batch
from the config through the harness's own spec (``reference.init_params``, ``make_dataset``), so only
the timers differ.

A shared VM's speed drifts by 20-40% over minutes, more than the 2% the comparison looks for, so the
two tools never take turns minutes apart: the comparison is a series of short turns, and in each turn
every shape is timed by one fresh worker process of each tool, back to back (a few seconds apart), the
tools' order alternating from turn to turn as the harness orders its own rounds
(:func:`harness.worker.measure.round_order`: harness first, pyperf first, pyperf first, harness first,
...), so a drift within a turn favours neither. Each tool calibrates once, in the first turn (the
harness its calls per round, pyperf its loops per value), and every later turn runs that many
(``--loops``), so turns are alike. A shape's ratio is the **median over turns of each turn's ratio**
(the harness's median over pyperf's, of that turn's values), with a 95% bootstrap interval over turns:
each turn's ratio is read within seconds, so a drift between turns moves both tools alike and cancels;
the ratio of the medians of all turns' pooled values is printed beside it.

pyperf starts its workers with a clean environment (PATH, HOME and what ``--inherit-environ``
names): what the harness sets for its workers beyond the thread counts, the allocator settings
of the config's ``env`` above all (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``), is
not there unless passed on. ``--pyperf-env`` says which environments pyperf runs under:
``harness`` (the default: the variables of the harness's worker for this cell, read from
:func:`harness.run.client.worker_settings`), ``plain`` (the thread counts alone, as a plain pyperf
run pinned to one thread has them) and ``harness+reference`` (the harness's, and one float64
reference step before the timed ones, as a worker's verification ran it while NumPy's huge-page
advice was on for it: with the raised malloc thresholds the heap kept the reference's huge pages
for the step's buffers). Each environment named takes its own process in every turn.

The caller's variables that steer a numerical library (``OPENBLAS_CORETYPE``, ``OPENBLAS_L2_SIZE``,
``OMP_*``, ...: :mod:`harness.spec.tuning`) decide which kernels both tools run, so each comparison is
made in one of two set-ups, both tools alike (``--setup``): ``inherited``, where the harness's workers
inherit them as usual and pyperf is told to pass them on (``--inherit-environ``), and ``clean``, where
the harness runs with ``clean_env: true`` and pyperf as it starts by default, neither with them. Each
set-up prints the variables both tools' workers got and the BLAS kernel each ran (the harness's
worker's reading, and the same reading in pyperf's workers, kept in its metadata), and the harness's
own reading of the machine over the turns (other processes' CPU in cores, steal, load average).

    python benchmarks/compare_pyperf.py                       # 8 turns x 3 shapes per set-up, CPU 0
    python benchmarks/compare_pyperf.py --turns 4 --out /tmp/cmp
    OPENBLAS_CORETYPE=Haswell python benchmarks/compare_pyperf.py --setup inherited,clean --pyperf-env harness

pyperf runs in a session of its own, as each harness worker does: with the kernel's autogroup
scheduling (``/proc/sys/kernel/sched_autogroup_enabled``) a session is one group sharing the CPU
with every other, and a worker in the caller's session would get a smaller share than the
harness's on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from harness.spec.errors import HarnessError  # noqa: E402

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
        cmd.extend(["--config", args.config, "--cell", str(args.cell)]
                   + (["--reference-first"] if args.reference_first else []))

    runner = pyperf.Runner(add_cmdline_args=forward)
    runner.argparser.add_argument("--config", required=True)
    runner.argparser.add_argument("--cell", type=int, required=True, help="which of the config's cells (from 0)")
    runner.argparser.add_argument("--reference-first", action="store_true")
    args = runner.parse_args()
    cell = cells(args.config)[args.cell]
    step = plain_step(cell, args.reference_first)
    runner.bench_time_func(label(cell), step, metadata={"blas_kernel": blas_kernel()})


def blas_kernel() -> str:
    """The BLAS kernels loaded in this process, as the harness's ``blas_kernel`` column writes them."""
    from harness.results.caveats import kernel_text
    from harness.worker.blas_probe import kernels

    return kernel_text(kernels()) or "unreported"


# -- the comparison's arithmetic (no timing here) -------------------------------------------------------

SETUPS = ("inherited", "clean")

#: the agreement the comparison looks for between the two tools' times
AGREE = 0.02

#: the harness's name among the tools of a turn (pyperf's are its environments' names)
HARNESS = "harness"


def schedule(n_shapes: int, tools: list[str], turns: int) -> list[tuple[int, int, str]]:
    """The running order, ``(turn, shape, tool)``: turn by turn, every shape in each, each shape's tools one
    process each, back to back, in the order the harness gives its own interleaved rounds
    (:func:`harness.worker.measure.round_order` of the turn: every tool goes first as often as last)."""
    from harness.worker.measure import round_order

    return [(t, s, tool) for t in range(turns) for s in range(n_shapes) for tool in round_order(list(tools), t)]


def agreement(harness_turns: list[list[float]], pyperf_turns: list[list[float]], n_boot: int = 2000,
              seed: int = 0) -> dict:
    """How far the harness's times lie from pyperf's over paired turns (the values of each tool's process in
    turn ``i``; per call, in seconds).

    ``ratio``: the median over turns of the turn's ratio (median of the harness's values over the median of
    pyperf's), read within a turn so that the machine's drift between turns cancels; ``lo``/``hi``: its 95%
    percentile-bootstrap interval, resampling turns (NaN with fewer than 3); ``pooled``: the median of all
    the harness's values over the median of all pyperf's; ``turn_ratios``; ``within``: whether ``ratio``
    lies within :data:`AGREE` of 1."""
    import numpy as np

    from harness.run.stats import resampled_medians
    from harness.spec.errors import HarnessError

    pairs = [(h, p) for h, p in zip(harness_turns, pyperf_turns) if h and p]
    if not pairs or len(pairs) != len(harness_turns) or len(harness_turns) != len(pyperf_turns):
        raise HarnessError(f"agreement: expected values of both tools in every turn, got {len(harness_turns)} "
                           f"turn(s) of the harness and {len(pyperf_turns)} of pyperf, {len(pairs)} with both")
    ratios = [statistics.median(h) / statistics.median(p) for h, p in pairs]
    ratio = statistics.median(ratios)
    lo = hi = float("nan")
    if len(ratios) >= 3:
        (meds,) = resampled_medians([np.asarray(ratios, dtype=np.float64)], n_boot, np.random.default_rng(seed))
        lo, hi = (float(x) for x in np.percentile(meds, [2.5, 97.5]))
    pooled = (statistics.median([v for h, _ in pairs for v in h])
              / statistics.median([v for _, p in pairs for v in p]))
    return {"ratio": ratio, "lo": lo, "hi": hi, "pooled": pooled, "turn_ratios": ratios, "within": within(ratio)}


def within(ratio: float) -> bool:
    """Whether a ratio of the two tools' times says they agree: within :data:`AGREE` of 1 as the table prints it
    (three decimals: 1.020 agrees, 1.021 does not)."""
    return round(abs(ratio - 1), 3) <= AGREE


def turn_spread(turns: list[list[float]]) -> float:
    """How far one tool's turns' medians lie apart: slowest minus fastest over their median (the drift between
    turns and each process's own draw, which the turn ratios cancel and the pooled values keep)."""
    medians = [statistics.median(v) for v in turns if v]
    return (max(medians) - min(medians)) / statistics.median(medians) if medians else float("nan")


# -- the comparison ----------------------------------------------------------------------------------

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


#: pyperf's values per process take about this long each (its --min-time default): the harness's rounds are
#: made as long, so that a turn of each tool times the same stretch
VALUE_S = 0.1


def config_text(setup: str, values: int = 5) -> str:
    """The comparison's config in a set-up: one worker process per cell and turn, ``values`` rounds of about
    :data:`VALUE_S` each as pyperf takes its values; ``clean`` runs the harness's workers with ``clean_env: true``."""
    timing = (f"timing: {{processes: 1, min_processes: 1, passes: 1, min_rounds: {max(3, values)}, "
              f"min_time_s: {max(3, values) * VALUE_S:g}}}\n")
    extra = timing + ("clean_env: true\n" if setup == "clean" else "")
    return CONFIG.replace("baseline: numpy\n", "baseline: numpy\n" + extra)


def pyperf_turn(config_path: str, index: int, env: dict[str, str], out: Path, args, loops: int | None = None,
                reference_first: bool = False) -> dict:
    """One pyperf process timing cell ``index`` (after a calibration process where ``loops`` is None): its
    values (seconds per call), the loops per value and the BLAS kernel it ran."""
    import pyperf

    from harness.spec import writes

    # pyperf writes its file itself: into a fresh private folder, then the copy kept in --out by the write rule
    kept, private = out, Path(tempfile.mkdtemp(prefix="compare-pyperf-turn-"))
    out = private / kept.name
    cmd = [sys.executable, str(HERE), "--config", config_path, "--cell", str(index), "--processes", "1",
           "--values", str(args.values), "--warmups", "1", "--affinity", str(args.cpu), "--quiet", "-o", str(out)]
    if loops:
        cmd += ["--loops", str(loops)]
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
    # its one line per process ("Mean +- std dev") is left out: the table says what the turns found
    try:
        subprocess.run(cmd, check=True, env=full, cwd=str(ROOT), start_new_session=True, stdout=subprocess.DEVNULL)
        bench = pyperf.Benchmark.load(str(out))
        writes.write_file(kept, out.read_bytes(), "--out")
    finally:
        shutil.rmtree(private, ignore_errors=True)
    timed = [r for r in bench.get_runs() if r.values]
    return {"values": list(bench.get_values()), "loops": timed[-1].get_loops(),
            "blas_kernel": bench.get_metadata().get("blas_kernel", "unreported")}


def harness_turn(cell, inner: int | None) -> dict:
    """One fresh harness worker timing ``cell`` as a run's group does (start, warm-up, verification, rounds;
    calibrated where ``inner`` is None): its rounds (seconds per call), its calls per round and the BLAS
    kernel it ran."""
    from harness.results.caveats import kernel_text
    from harness.run.group import GroupRun
    from harness.spec.status import Status

    state = GroupRun([cell])
    if inner:
        state.inner[cell.cell_id] = inner
    state.run_pass()
    outcome = state.outcomes[cell.cell_id]
    if outcome.status != Status.OK or not outcome.samples:
        raise SystemExit(f"harness: {label(cell)}: {outcome.status}: {outcome.error}")
    return {"values": list(outcome.samples), "inner": state.inner[cell.cell_id],
            "blas_kernel": kernel_text(outcome.blas) or "unreported"}


def _t(s: float) -> str:
    return f"{s * 1e6:.0f} us" if s < 1e-3 else f"{s * 1e3:.3g} ms"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=8, help="turns per set-up: in each, every shape is timed by one "
                                                        "fresh process of each tool, back to back")
    ap.add_argument("--values", type=int, default=5, help="values per process: pyperf's values, the harness's rounds "
                                                         "(about 0.1 s each)")
    ap.add_argument("--cpu", type=int, default=0, help="the CPU pyperf's workers are pinned to (the harness pins "
                                                      "its one-thread workers to the first of its own)")
    ap.add_argument("--pyperf-env", default="harness",
                    help="comma-separated: harness, plain, harness+reference (see the module)")
    ap.add_argument("--setup", default="inherited,clean",
                    help="comma-separated: inherited (both tools' workers get the caller's steering variables), "
                         "clean (neither does)")
    ap.add_argument("--out", type=Path, help="keep the configs, pyperf's JSON and every turn's values here")
    args = ap.parse_args(argv)
    try:
        return _main(args)
    except HarnessError as exc:  # one line, as the harness's CLI says it
        print(f"error: {exc}", file=sys.stderr)
        return 2


def check_out(out: Path, setups: list[str]) -> Path:
    """Refuse, before any turn, an ``--out`` the write rule forbids (a file, a folder inside a run, one among the
    project's own files, a link or a device where a set-up's files go); the folder, absolute (pyperf's processes
    run from the project's folder: a relative path keeps meaning the caller's)."""
    from harness.spec import writes

    writes.check_folder(out, "--out")
    writes.check_outside_project(out, ROOT, "--out")
    for setup in setups:
        writes.check_folder(out / setup, "--out", probe=False)
        for name in ("compare_pyperf.yaml", "turns.json"):
            writes.check_file(out / setup / name, "--out", probe=False)
    return Path(os.path.abspath(out))


def _main(args) -> int:
    if args.turns < 1 or args.values < 1:
        raise HarnessError(f"--turns and --values: expected at least 1, got {args.turns} and {args.values}")
    env_names = [e for e in args.pyperf_env.split(",") if e]
    for e in env_names:
        if e not in ("harness", "plain", "harness+reference"):
            raise HarnessError(f"--pyperf-env: expected harness, plain or harness+reference, got {e!r}")
    setups = [s for s in args.setup.split(",") if s]
    for setup in setups:
        if setup not in SETUPS:
            raise HarnessError(f"--setup: expected {', '.join(SETUPS)}, got {setup!r}")
    if not env_names or not setups:
        raise HarnessError("--pyperf-env and --setup: expected at least one name each")
    out = check_out(args.out, setups) if args.out else Path(tempfile.mkdtemp(prefix="compare-pyperf-"))
    began = time.monotonic()
    for setup in setups:
        compare(setup, env_names, out / setup, args)
    print(f"files: {out}; {time.monotonic() - began:.0f} s in all")
    return 0


def compare(setup: str, env_names: list[str], out: Path, args) -> None:
    """One set-up's comparison: its environments stated, its turns run, each shape's agreement."""
    from harness.run import guard

    from harness.spec import writes

    writes.make_folder(out)
    config_path = str(out / "compare_pyperf.yaml")
    writes.write_file(config_path, config_text(setup, args.values), "--out")
    envs_by_name = environments(config_path, setup)
    print(f"== set-up {setup}: " + ("the caller's steering variables reach both tools' workers" if setup == "inherited"
                                    else "neither tool's workers get the caller's steering variables"), flush=True)
    print("pyperf environments:", json.dumps({e: envs_by_name[e] for e in env_names}), flush=True)
    shapes = cells(config_path)
    labels = [label(c) for c in shapes]
    pyperf_env = {f"pyperf {e}": e for e in env_names}  # each pyperf environment is a tool of its own in a turn
    tools = [HARNESS, *pyperf_env]
    # per shape and tool: each turn's result; the calibration of the first turn, fixed for the rest
    ran: dict[tuple[int, str], list[dict]] = {(s, tool): [] for s in range(len(shapes)) for tool in tools}
    calibrated: dict[tuple[int, str], int] = {}
    sampler = guard.Sampler().start()
    began = time.monotonic()
    said = -1
    try:
        for turn, s, tool in schedule(len(shapes), tools, args.turns):
            if turn != said:
                said = turn
                print(f"[{setup} turn {turn + 1}/{args.turns}] load {os.getloadavg()[0]:.2f}", flush=True)
            if tool == HARNESS:
                got = harness_turn(shapes[s], calibrated.get((s, tool)))
                calibrated[(s, tool)] = got["inner"]
            else:
                name = pyperf_env[tool]
                got = pyperf_turn(config_path, s, envs_by_name[name], out / f"pyperf-{name}-{s}-{turn + 1}.json", args,
                                  calibrated.get((s, tool)), reference_first=name.endswith("+reference"))
                calibrated[(s, tool)] = got["loops"]
            ran[(s, tool)].append(got)
    finally:
        sampler.stop()
    seen = sampler.window(began, time.monotonic()) or {}
    print(f"[{setup}] done in {time.monotonic() - began:.0f} s, load {os.getloadavg()[0]:.2f}; over the turns: other "
          f"processes' CPU {seen.get('others_cores')} cores (most {seen.get('others_cores_max')}), steal "
          f"{seen.get('steal_share', 0):.1%}, load average up to {seen.get('load_max')}", flush=True)
    print("BLAS kernels: " + " | ".join(
        f"{tool}: " + "; ".join(dict.fromkeys(r["blas_kernel"] for s in range(len(shapes)) for r in ran[(s, tool)]))
        for tool in tools), flush=True)
    print("calls per value (fixed after the first turn): " + "; ".join(
        f"{lab}: " + ", ".join(f"{tool} {calibrated[(s, tool)]}" for tool in tools) for s, lab in enumerate(labels)))
    print(f"per shape, over {args.turns} turns: each tool's median of all its values (processes; how far its turns' "
          f"medians lie apart); harness / pyperf: the median of the turns' ratios [95% interval over turns] "
          f"(the ratio of the pooled medians); within {AGREE:.0%}: the median of the turns' ratios")
    head = (["shape", "harness"] + [f"{t} env" for t in tools[1:]] + [f"harness / {t}" for t in tools[1:]]
            + [f"within {AGREE:.0%}"])
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    kept = {"setup": setup, "conditions": seen, "shapes": {}}
    for s, lab in enumerate(labels):
        values = {tool: [r["values"] for r in ran[(s, tool)]] for tool in tools}
        cols = [lab]
        for tool in tools:
            pooled = [v for turn in values[tool] for v in turn]
            cols.append(f"{_t(statistics.median(pooled))} ({len(values[tool])} proc, turns "
                        f"{turn_spread(values[tool]):.1%} apart)")
        found = {tool: agreement(values[HARNESS], values[tool]) for tool in tools[1:]}
        for tool in tools[1:]:
            a = found[tool]
            cols.append(f"{a['ratio']:.3f} [{a['lo']:.3f}, {a['hi']:.3f}] ({a['pooled']:.3f})")
        cols.append(", ".join("yes" if found[tool]["within"] else "no" for tool in tools[1:]))
        print("| " + " | ".join(cols) + " |", flush=True)
        kept["shapes"][lab] = {"values": values, "agreement": found}
    writes.write_file(out / "turns.json", json.dumps(kept, indent=1), "--out")


if __name__ == "__main__":
    if os.environ.get("COMPARE_PYPERF_CHILD") or "--worker" in sys.argv:
        pyperf_main()
    else:
        raise SystemExit(main())

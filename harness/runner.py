"""Config -> cells -> worker processes -> results.

The cells of one comparison group (same problem, different backends) are timed
side by side: each gets its own warmed worker, and the workers take their rounds in
turn (A B C A B C ...), so a drift of the machine's speed hits every backend alike
and the speedup comes from paired rounds with a bootstrap interval.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from itertools import groupby
from pathlib import Path

import numpy as np

from harness import envs, machine
from harness.config import Cell, RunConfig
from harness.errors import HarnessError
from harness.results import RunStore
from harness.timing import Stats, paired_speedup

PROJECT_ROOT = Path(__file__).resolve().parent.parent
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS", "NUMBA_NUM_THREADS")
OOM_MARKERS = ("MemoryError", "std::bad_alloc", "out of memory", "OutOfMemory", "RESOURCE_EXHAUSTED")


class WorkerFailure(Exception):
    """A worker that crashed, hung, ran out of memory or reported an error."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


def worker_cpus(threads: int) -> list[int]:
    """The cores a worker with ``threads`` threads is confined to: the first ``threads`` of
    the runner's own, or none (no confinement) when more threads than cores are asked for."""
    try:
        mine = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return []
    return mine[:threads] if threads <= len(mine) else []


def worker_environment(cell_backend: str, device: str, dtype: str, threads: int, extra: dict[str, str]) -> tuple[str | None, dict]:
    """The isolated environment name and the full process environment for one worker."""
    import backends

    name, variant = backends.split_name(cell_backend)
    cls = backends.backend_class(name)
    env = envs.worker_environ(cls.environment)
    env.update(extra)
    for var in THREAD_VARS:
        env[var] = str(threads)
    env["HARNESS_THREADS"] = str(threads)
    cpus = worker_cpus(threads)
    if cpus:
        env["HARNESS_CPUS"] = ",".join(map(str, cpus))
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU cell must not quietly use a GPU
    env.update(cls.environment_variables(variant or cls.variants[0], threads, device, dtype))
    env["PYTHONUNBUFFERED"] = "1"
    return cls.environment, env


class Worker:
    """A worker subprocess and its JSON line protocol, with timeouts."""

    def __init__(self, environment: str | None, env: dict, label: str):
        python = str(envs.ensure_env(environment)) if environment else sys.executable
        self.label = label
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([python, "-m", "harness.worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, env=env, cwd=str(PROJECT_ROOT), start_new_session=True)
        self.buf = b""
        self.env = {k: env[k] for k in env if k in THREAD_VARS or k.startswith(("MALLOC_", "XLA_", "THEANO", "PYTENSOR", "JAX_", "CUDA_", "HARNESS_CPUS"))}

    def stderr_tail(self, n: int = 20) -> str:
        self.stderr.flush()
        self.stderr.seek(0)
        lines = self.stderr.read().decode("utf-8", "replace").strip().splitlines()
        return "\n".join(lines[-n:])

    def request(self, msg: dict, timeout_s: float) -> dict:
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died() from None
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.kill()
                raise WorkerFailure("timeout", f"no answer to {msg['cmd']!r} within {timeout_s:g} s\n{self.stderr_tail()}")
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise self._died()
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        reply = json.loads(line)
        if "diverged" in reply:
            raise WorkerFailure("diverged", reply["diverged"])
        if "error" in reply:
            text = reply["error"]
            status = "oom" if any(m in text for m in OOM_MARKERS) else "error"
            raise WorkerFailure(status, f"{text}\n{reply.get('traceback', '')}".strip())
        return reply

    def _died(self) -> WorkerFailure:
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.returncode
        tail = self.stderr_tail()
        if code == -signal.SIGKILL or any(m in tail for m in OOM_MARKERS):
            return WorkerFailure("oom", f"worker killed (exit {code}); likely out of memory\n{tail}")
        return WorkerFailure("error", f"worker exited with code {code}\n{tail}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request({"cmd": "quit"}, 10)
                self.proc.wait(timeout=10)
            except (WorkerFailure, subprocess.TimeoutExpired):
                pass
        self.kill()
        self.stderr.close()


@dataclass
class Outcome:
    """What happened to one cell."""

    cell: Cell
    status: str = "ok"
    error: str = ""
    compile_s: float | None = None
    samples: list | None = None
    peak_rss_mb: float | None = None
    versions: dict | None = None
    data_meta: dict | None = None
    train: dict | None = None
    worker_env: dict | None = None
    verify: dict | None = None


def _base_row(cell: Cell) -> dict:
    import backends

    p, m = cell.problem, cell.problem.model
    name, variant = backends.split_name(cell.backend)
    if variant is None:
        try:
            variant = backends.backend_class(name).variants[0]
        except HarnessError:  # a backend that cannot even be imported here
            variant = "default"
    return {
        "cell_id": cell.cell_id, "group": cell.group_key, "backend": name, "variant": variant,
        "device": p.device, "model": m.kind, "task": cell.task.kind, "workload": p.workload, "dtype": p.dtype,
        "batch": p.batch, "seq_len": p.seq_len, "input_size": p.input_size, "hidden_size": m.hidden,
        "output_size": p.output_size, "threads": cell.threads, "bptt": str(m.bptt), "layers": m.layers,
        "activation": m.activation if m.kind == "elman" else "lstm", "head": m.head, "output_act": m.output_act,
        "peephole": m.peephole, "bias": m.bias, "tokens": p.tokens, "sweep": json.dumps(cell.point, default=str),
        "host": machine.host_name(),
    }


class Runner:
    """Runs the cells of one config into one results folder."""

    def __init__(self, config: RunConfig, store: RunStore, console=None):
        self.config = config
        self.store = store
        self.console = console
        self.gemm_peaks: dict[str, float] = dict(store.meta.get("gemm_peak_gflops", {}))

    # -- progress helpers ----------------------------------------------------------
    def _say(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text, highlight=False)

    # -- running ---------------------------------------------------------------------
    def pending_groups(self) -> list[list[Cell]]:
        """The comparison groups still to run (all of them, or those a resumed run lacks)."""
        cells = self.config.cells()
        done = self.store.done_cells()
        groups = [list(g) for _, g in groupby(cells, key=lambda c: c.group_key)]
        todo = [g for g in groups if not all(c.cell_id in done for c in g)]
        if len(todo) < len(groups):
            self._say(f"resuming: {len(groups) - len(todo)} of {len(groups)} comparison groups already done")
        return todo

    def run(self, progress=None, executor=None) -> None:
        """Run every pending group here, one at a time, or hand them to ``executor``
        (an object with ``run(runner, groups, progress, task_id)``, e.g. the Dask one)."""
        todo = self.pending_groups()
        task_id = progress.add_task("cells", total=sum(len(g) for g in todo)) if progress else None
        if executor is not None:
            executor.run(self, todo, progress, task_id)
            return
        self._measure_gemm_peaks()
        self.store.meta.setdefault("hosts", {})[machine.host_name()] = {
            "machine": self.store.meta.get("machine"), "gemm_peak_gflops": self.gemm_peaks}
        for group in todo:
            rows, curves = self.run_group(group, progress, task_id)
            self.store.add(rows, curves)
            if progress is not None:
                progress.advance(task_id, len(group))

    def run_group(self, group: list[Cell], progress=None, task_id=None) -> tuple[list[dict], list[dict]]:
        """Time one comparison group side by side and return its result rows and curve points."""
        return self._rows(self._run_group(group, progress, task_id))

    def _measure_gemm_peaks(self, cells: list[Cell] | None = None) -> None:
        """The machine's GEMM peak per dtype and thread count, for roofline and %-of-peak figures."""
        for dtype, threads in dict.fromkeys((c.problem.dtype, c.threads) for c in (cells or self.config.cells())):
            key = f"{dtype}|threads={threads}"
            if key not in self.gemm_peaks:
                _, env = worker_environment("numpy", "cpu", dtype, threads, self.config.raw.env)
                w = Worker(None, env, "gemm-peak")
                try:
                    self.gemm_peaks[key] = w.request({"cmd": "gemm_peak", "dtype": dtype, "n": 1024}, 120)["gflops"]
                except WorkerFailure as exc:
                    self._say(f"warning: GEMM peak measurement failed: {exc}")
                finally:
                    w.close()
        self.store.meta["gemm_peak_gflops"] = self.gemm_peaks

    def _screen(self, cell: Cell) -> Outcome | None:
        """Availability and support, decided in this process without importing heavy libraries."""
        import backends

        try:
            b = backends.create(cell.backend)
            ok, why = b.availability()
            if ok and cell.problem.device != "cpu":
                ok, why = b.device_availability(cell.problem.device)
        except HarnessError as exc:
            return Outcome(cell, "unavailable", str(exc))
        if not ok:
            return Outcome(cell, "unavailable", why)
        ok, why = b.supports(cell.problem)
        if not ok:
            return Outcome(cell, "unsupported", why)
        return None

    def _start(self, cell: Cell, describe) -> tuple[Worker | None, Outcome]:
        outcome = Outcome(cell)
        p = cell.problem
        try:
            environment, env = worker_environment(cell.backend, p.device, p.dtype, cell.threads, cell.env)
            if environment and envs.env_python(environment) is None:
                describe(f"creating isolated environment {environment!r} (first use)")
            worker = Worker(environment, env, cell.backend)
        except HarnessError as exc:
            outcome.status, outcome.error = "unavailable", str(exc)
            return None, outcome
        outcome.worker_env = worker.env
        timeout = cell.timing["timeout_s"]
        try:
            describe(f"{cell.backend}: starting")
            init = worker.request({"cmd": "init", "backend": cell.backend, "problem": p.to_mapping(),
                                   "task": cell.task.to_mapping(), "seed": self.config.raw.seed,
                                   "threads": cell.threads, "lr": cell.train["lr"]}, timeout)
            outcome.versions, outcome.data_meta = init.get("versions"), init.get("data_meta")
            describe(f"{cell.backend}: compiling / warming up")
            # training must start from the shared initial parameters: compile only, no warm steps
            n_warm = 0 if p.workload == "train" else cell.timing["warmup"]
            warm = worker.request({"cmd": "warmup", "n": n_warm}, timeout)
            outcome.compile_s, outcome.peak_rss_mb = warm["compile_s"], warm["peak_rss_mb"]
            if p.workload != "train" and cell.timing["verify"]:
                describe(f"{cell.backend}: verifying against the reference")
                outcome.verify = worker.request({"cmd": "verify"}, timeout)
                if not outcome.verify["ok"]:
                    v = outcome.verify
                    raise WorkerFailure("mismatch", f"does not match the reference on this cell: {v['worst']} "
                                                    f"off by {v['ratio']:.3g}x the bound {v['bound']}")
        except WorkerFailure as exc:
            outcome.status, outcome.error = exc.status, str(exc)
            worker.close()
            return None, outcome
        return worker, outcome

    def _run_group(self, group: list[Cell], progress, task_id) -> list[Outcome]:
        head = group[0]
        label = f"{head.problem.workload} {head.problem.model.describe()} B={head.problem.batch} {head.problem.dtype} threads={head.threads}"

        def describe(text):
            if progress is not None:
                progress.update(task_id, description=f"{label} · {text}")

        outcomes: dict[str, Outcome] = {}
        workers: dict[str, Worker] = {}
        try:
            for cell in group:
                screened = self._screen(cell)
                if screened is not None:
                    outcomes[cell.cell_id] = screened
                    continue
                if cell.problem.workload == "train":
                    outcomes[cell.cell_id] = self._train_cell(cell, describe)
                    continue
                worker, outcome = self._start(cell, describe)
                outcomes[cell.cell_id] = outcome
                if worker is not None:
                    workers[cell.cell_id] = worker
            if workers:
                self._interleave(group, workers, outcomes, describe)
        finally:
            for w in workers.values():
                w.close()
        return [outcomes[c.cell_id] for c in group]

    def _train_cell(self, cell: Cell, describe) -> Outcome:
        worker, outcome = self._start(cell, describe)
        if worker is None:
            return outcome
        try:
            describe(f"{cell.backend}: training")
            budget = cell.train.get("time_budget_s")
            timeout = cell.timing["timeout_s"] + (3 * budget if budget else 0)
            result = worker.request({"cmd": "train", "train": {**cell.train, "seed": self.config.raw.seed}}, timeout)
            outcome.train = result
            outcome.samples = result["step_samples"]
            outcome.peak_rss_mb = result["peak_rss_mb"]
            if result["status"] != "ok":
                outcome.status, outcome.error = result["status"], str(result["stop"])
        except WorkerFailure as exc:
            outcome.status, outcome.error = exc.status, str(exc)
        finally:
            worker.close()
        return outcome

    def _interleave(self, group, workers: dict[str, Worker], outcomes: dict[str, Outcome], describe) -> None:
        timing = group[0].timing
        round_s = timing["round_s"] or max(0.005, timing["min_time_s"] / timing["min_rounds"])
        inner, samples = {}, {cid: [] for cid in workers}
        alive = dict(workers)

        def fail(cid, exc):
            outcomes[cid].status, outcomes[cid].error = exc.status, str(exc)
            alive.pop(cid).close()

        for cid, w in list(alive.items()):
            try:
                inner[cid] = w.request({"cmd": "calibrate", "target_s": round_s}, timing["timeout_s"])["inner"]
            except WorkerFailure as exc:
                fail(cid, exc)
        start = time.monotonic()
        cap = timing["max_time_s"] * max(1, len(alive))
        n_round = 0
        while alive:
            n_round += 1
            describe(f"round {n_round} ({', '.join(c.backend for c in group if c.cell_id in alive)})")
            for cid in list(alive):
                try:
                    reply = alive[cid].request({"cmd": "rounds", "n": 1, "inner": inner[cid]}, timing["timeout_s"])
                    samples[cid] += reply["samples"]
                    outcomes[cid].peak_rss_mb = reply["peak_rss_mb"]
                except WorkerFailure as exc:
                    fail(cid, exc)
            enough = all(len(samples[c]) >= timing["min_rounds"]
                         and sum(samples[c]) * inner[c] >= timing["min_time_s"] for c in alive)
            if enough or time.monotonic() - start >= cap:
                break
        for cid in workers:
            outcomes[cid].samples = samples[cid]

    # -- results rows ------------------------------------------------------------------
    def _rows(self, outcomes: list[Outcome]) -> tuple[list[dict], list[dict]]:
        import backends

        base_name = outcomes[0].cell.baseline
        base = next((o for o in outcomes if o.cell.backend == base_name), None)
        rows, curves = [], []
        versions = self.store.meta.setdefault("versions", {})
        for o in outcomes:
            row = _base_row(o.cell)
            p = o.cell.problem
            stats = Stats.of(o.samples or [])
            row.update(status=o.status, error=o.error[-4000:] if o.error else "", compile_s=o.compile_s,
                       peak_rss_mb=o.peak_rss_mb, **stats.as_dict(), baseline=base_name,
                       samples_s=[float(s) for s in (o.samples or [])])
            if o.status == "ok" and stats.n_samples:
                work = "train_step" if p.workload == "train" else p.workload
                row["gflops"] = p.flops(work) / stats.median_s / 1e9
            row["gemm_peak_gflops"] = self.gemm_peaks.get(f"{p.dtype}|threads={o.cell.threads}")
            if (o.status == "ok" and p.workload != "train" and base is not None and base.status == "ok"
                    and base.samples and o.samples):
                row["speedup"], row["speedup_lo"], row["speedup_hi"] = paired_speedup(base.samples, o.samples)
            if o.verify:
                row["verified_ratio"] = o.verify["ratio"]
                _conformance_entry(self.store.meta, o.cell.backend, o.verify)
            if o.data_meta and "loss_floor" in o.data_meta:
                row["loss_floor"] = o.data_meta["loss_floor"]
            if o.versions:
                name = backends.split_name(o.cell.backend)[0]
                versions[name] = o.versions
            if o.worker_env:
                self.store.meta.setdefault("worker_env", {})[o.cell.backend] = o.worker_env
            if o.train:
                t = o.train
                row.update(time_to_target_s=t["time_to_target_s"], train_s=t["train_s"], eval_s=t["eval_s"])
                evals = [c["loss"] for c in t["curve"] if c["split"] == "eval"]
                row["final_loss"] = evals[-1] if evals else None
                for c in t["curve"]:
                    curves.append({k: row[k] for k in ("cell_id", "group", "backend", "variant", "device", "model",
                                                       "task", "dtype", "batch", "hidden_size", "threads", "bptt")}
                                  | c | {"time_to_target_s": t["time_to_target_s"], "target_loss": o.cell.train.get("target_loss"),
                                         "loss_floor": row.get("loss_floor")})
            rows.append(row)
        return rows, curves


def _conformance_entry(meta: dict, backend: str, verify: dict) -> None:
    """run.json's per-backend summary of the cell checks (a ratio <= 1 is within SPEC bounds)."""
    entry = meta.setdefault("conformance", {}).setdefault(
        backend, {"verified_cells": 0, "mismatches": 0, "worst_ratio": 0.0, "bound": verify["bound"]})
    entry["verified_cells"] += 1
    entry["mismatches"] += 0 if verify["ok"] else 1
    entry["worst_ratio"] = max(entry["worst_ratio"], verify["ratio"])


def new_run_meta(config: RunConfig) -> dict:
    """The run.json of a run that is starting."""
    now = datetime.now(timezone.utc)
    run_id = f"{config.name}-{now.strftime('%Y%m%d-%H%M%S')}"
    return {
        "run_id": run_id, "name": config.name, "config_path": config.path,
        "config": [raw.model_dump() for raw, _ in config.parts],
        "config_source": config.source, "baseline": config.baseline, "machine": machine.machine_info(),
        "git_commit": machine.git_commit(), "started": now.isoformat(), "finished": None,
        "env": dict(config.raw.env), "cpu_times_start": machine.cpu_times(), "harness_python": sys.version.split()[0],
    }


def finish_meta(store: RunStore, interrupted: bool = False) -> None:
    """Close the run's metadata: end time, load and steal share over the run."""
    meta = store.meta
    meta["finished"] = None if interrupted else datetime.now(timezone.utc).isoformat()
    meta["interrupted"] = interrupted
    end = machine.cpu_times()
    meta["steal_share"] = machine.steal_share(meta.get("cpu_times_start", {}), end)
    meta["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    statuses = meta.get("cells", {})
    meta["summary"] = {s: sum(1 for v in statuses.values() if v == s) for s in sorted(set(statuses.values()))}
    store.save()


def summarise(timings) -> list[dict]:
    """Per comparison group and backend: median, speedup and interval, status (for the console table)."""
    out = []
    for row in timings:
        out.append({k: row.get(k) for k in ("group", "backend", "variant", "workload", "status", "median_s", "iqr_s",
                                            "speedup", "speedup_lo", "speedup_hi", "compile_s", "time_to_target_s",
                                            "final_loss", "error")})
    return out


def spread_warnings(timings) -> list[str]:
    """Cells whose interquartile range exceeds 10% of the median: their figures deserve less trust."""
    import pandas as pd

    from harness.plots import backend_label, group_label

    df = pd.DataFrame(timings)
    if df.empty:
        return []
    df["label"] = backend_label(df)
    warn = []
    for _, r in df.iterrows():
        if r.get("status") == "ok" and r.get("median_s") and pd.notna(r.get("iqr_s")) and r.get("workload") != "train":
            rel = r["iqr_s"] / r["median_s"]
            if np.isfinite(rel) and rel > 0.10:
                warn.append(f"{r['label']} ({r['workload']} {group_label(r)}): IQR is {rel:.0%} of the median")
    return warn

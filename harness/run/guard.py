"""The busy-machine guard: how much of the CPU other processes took while cells were timed.

A figure is only as good as the machine it was taken on. pyperf warns after the fact that "the
benchmark result may be unstable" and ``pyperf system tune`` prepares a machine; this guard says
which cells were timed while something else loaded the cores, with the evidence:

* :class:`Sampler` reads, twice a second through the run, the load average, the CPU time of the
  whole machine, the time the hypervisor stole and the CPU time of the harness's own processes
  (the runner and every worker it started). The difference is other processes' CPU, in cores.
* Each stretch of timed rounds (:attr:`harness.run.group.GroupRun.windows`) is summed up by
  :meth:`Sampler.window`; a cell's summaries are kept with it, and :func:`judge` calls it
  contended when other processes took more cores than the cell left free (by
  :data:`OTHERS_MARGIN_CORES`) or the hypervisor stole more than :data:`STEAL_LIMIT`.
* The GEMM peak is measured at the run's end as well as its start: :func:`peak_evidence` reads a
  drop between them, or a multi-thread peak below the one-thread one, as a busy machine.
* :func:`busy_now` samples a second before anything runs, and :func:`busy_warning` names the
  processes that take the CPU, so a run started on a busy machine says so at once.

psutil (a dependency of the runner's environment) reads the processes; it is imported where used.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from harness.spec.errors import HarnessError
from harness.worker.cpu_roofs import read_peak_key

#: a cell is contended when other processes used more than the cores it left free by this many cores
OTHERS_MARGIN_CORES = 0.25
#: ... or when the hypervisor stole more than this share of the CPU time while it was timed
STEAL_LIMIT = 0.05
#: a GEMM peak at the run's end below this share of the one at its start: the machine got busier
PEAK_DROP = 0.8
#: ``harness run`` warns at its start when other processes use this many cores
BUSY_START_CORES = 0.5
#: seconds between two samples
INTERVAL_S = 0.5


@dataclass(frozen=True)
class Sample:
    """One reading: seconds on ``time.monotonic``'s clock, the 1-minute load average, and CPU seconds
    summed over every core since boot: busy (not idle, not waiting, not stolen), stolen, all, and the
    busy seconds of the harness's own processes."""

    t: float
    load: float
    busy_s: float
    steal_s: float
    total_s: float
    ours_s: float


def own_cpu_s(root: int | None = None) -> float:
    """CPU seconds of process ``root`` (default: this one) and every process it started, the ended
    ones it reaped included (their time is in its ``children_*`` counts)."""
    import psutil

    try:
        proc = psutil.Process(root or os.getpid())
        procs = [proc] + proc.children(recursive=True)
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:  # ended between the listing and the reading
            continue
    return total


def read_sample() -> Sample:
    """The machine's and the harness's CPU time now."""
    import psutil

    c = psutil.cpu_times()
    busy = c.user + c.nice + c.system + getattr(c, "irq", 0.0) + getattr(c, "softirq", 0.0)
    steal = getattr(c, "steal", 0.0)
    total = busy + c.idle + getattr(c, "iowait", 0.0) + steal
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return Sample(time.monotonic(), load, busy, steal, total, own_cpu_s())


def summarise(samples: list[Sample]) -> dict | None:
    """What a run of samples says: seconds covered, other processes' CPU in cores (mean, and the most
    between two samples), the stolen share of CPU time, the load average (mean and most). None for
    fewer than two samples."""
    if len(samples) < 2:
        return None
    first, last = samples[0], samples[-1]
    seconds = last.t - first.t
    if seconds <= 0:
        return None

    def others(a: Sample, b: Sample) -> float:
        dt = b.t - a.t
        return max(0.0, ((b.busy_s - a.busy_s) - (b.ours_s - a.ours_s)) / dt) if dt > 0 else 0.0

    total = last.total_s - first.total_s
    loads = [s.load for s in samples]
    # a window in which the harness's own CPU seconds went down read a worker's seconds between its
    # parent's reading and its own (it was reaped in between): its busy seconds are no one else's
    kept = [(a, b) for a, b in zip(samples, samples[1:]) if b.ours_s >= a.ours_s and b.t > a.t]
    windows = [others(a, b) for a, b in kept]
    # the mean over the same windows as the most (time-weighted), never above the machine's cores: a mean
    # over the whole stretch would count a reaped worker's seconds as another process's
    spans = [b.t - a.t for a, b in kept]
    mean = sum(w * dt for w, dt in zip(windows, spans)) / sum(spans) if spans else others(first, last)
    cores = total / seconds if total > 0 else None
    mean = min(mean, max(windows, default=mean), cores if cores else mean)
    return {"seconds": round(seconds, 3), "n_samples": len(samples),
            "others_cores": round(mean, 3),
            "others_cores_max": round(max(windows, default=0.0), 3),
            "steal_share": round((last.steal_s - first.steal_s) / total, 4) if total > 0 else 0.0,
            "load_mean": round(sum(loads) / len(loads), 2), "load_max": round(max(loads), 2)}


class Sampler:
    """Samples the machine every ``interval_s`` in a thread of its own from :meth:`start` to :meth:`stop`;
    ``probe`` takes one sample (:func:`read_sample`; a test hands in its own)."""

    def __init__(self, probe=read_sample, interval_s: float = INTERVAL_S, keep: int = 100_000):
        self.probe = probe
        self.interval_s = interval_s
        self.keep = keep
        self.samples: list[Sample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self) -> Sample | None:
        """One sample now, kept with the others (None where the machine cannot be read)."""
        try:
            s = self.probe()
        except (OSError, ImportError):
            return None
        with self._lock:
            self.samples.append(s)
            if len(self.samples) > self.keep:  # a very long run keeps every other old sample
                self.samples = self.samples[: self.keep // 2: 2] + self.samples[self.keep // 2:]
        return s

    def start(self) -> "Sampler":
        if self._thread is None:
            self.take()
            self._thread = threading.Thread(target=self._loop, name="harness-guard", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.take()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.take()

    def window(self, start: float, end: float) -> dict | None:
        """:func:`summarise` of the stretch from ``start`` to ``end`` (``time.monotonic``): the samples in it
        and the last one before and the first one after it (a sample is taken now if none is yet)."""
        with self._lock:
            have_after = any(s.t >= end for s in self.samples)
        if not have_after:
            self.take()
        with self._lock:  # in time order: the thread's samples and those taken on demand may interleave
            samples = sorted(self.samples, key=lambda s: s.t)
        before = [s for s in samples if s.t <= start]
        inside = [s for s in samples if start < s.t < end]
        after = [s for s in samples if s.t >= end]
        picked = before[-1:] + inside + after[:1]
        out = summarise(picked)
        if out is not None:
            out["cores"] = os.cpu_count()
        return out


def note_windows(sampler: Sampler, state) -> None:
    """Keep with each cell of a comparison group's pass what the machine did while it was timed: each stretch
    of rounds in ``state.windows`` (:class:`harness.run.group.GroupRun`) summed up by ``sampler`` and added to
    its cells' ``conditions``, the stretches then cleared. The one place a cell's readings are taken, whether
    the pass ran in the runner or in a Dask task on another host."""
    for began, ended, ids in state.windows:
        seen = sampler.window(began, ended)
        for cid in ids:
            outcome = state.outcomes.get(cid)
            if outcome is not None and seen is not None:
                outcome.conditions = (outcome.conditions or []) + [seen]
    state.windows.clear()


def combine(entries: list) -> dict | None:
    """Several :meth:`Sampler.window` summaries (a cell's passes) as one, weighted by their seconds."""
    entries = [e for e in entries or [] if e and e.get("seconds")]
    if not entries:
        return None
    seconds = sum(e["seconds"] for e in entries)

    def mean(key):
        return round(sum(e[key] * e["seconds"] for e in entries) / seconds, 4)

    return {"seconds": round(seconds, 3), "n_samples": sum(e["n_samples"] for e in entries),
            "others_cores": mean("others_cores"), "others_cores_max": max(e["others_cores_max"] for e in entries),
            "steal_share": mean("steal_share"), "load_mean": mean("load_mean"),
            "load_max": max(e["load_max"] for e in entries), "cores": entries[0].get("cores")}


def judge(conditions: dict | None, threads: int, cores: int | None = None) -> tuple[bool | None, str]:
    """Whether a cell with ``threads`` threads was timed on a contended machine, and the evidence in words
    (None and "" when nothing was sampled)."""
    if not conditions:
        return None, ""
    cores = cores or conditions.get("cores") or os.cpu_count() or 1
    free = max(0, cores - threads)
    others, steal = conditions["others_cores"], conditions["steal_share"]
    contended = others > free + OTHERS_MARGIN_CORES or steal > STEAL_LIMIT
    text = (f"other processes used {others:.2g} of {cores} cores while it was timed (at most "
            f"{conditions['others_cores_max']:.2g}; its {threads} thread(s) left {free} free), load average up to "
            f"{conditions['load_max']:.2f}, steal {steal:.1%}")
    return contended, text


def peak_evidence(start: dict, end: dict | None) -> list[str]:
    """What the GEMM peaks at the run's start and end say of a busy machine: a peak that fell by more than
    :data:`PEAK_DROP` between them, and a peak at more threads below the one at fewer (the other cores
    were busy when it was measured). Keys as :func:`harness.worker.cpu_roofs.peak_key` (plain dtypes only)."""
    out = []
    parsed = {}
    for when, peaks in (("start", start or {}), ("end", end or {})):
        plain = {}
        for key, rate in peaks.items():
            try:
                dtype, threads, library = read_peak_key(key)
            except HarnessError:
                continue
            if rate is not None and library in (None, "numpy"):
                plain.setdefault((when, dtype, threads), {})[library] = float(rate)
        # NumPy's own product where the run keeps it apart: the plain key is the best of every library (the
        # engine's FMA peak among them), which is not what was measured again at the end
        parsed.update({k: rates.get("numpy", rates.get(None)) for k, rates in plain.items()})
    for (when, dtype, threads), rate in sorted(parsed.items()):
        if when == "end":
            before = parsed.get(("start", dtype, threads))
            if before and rate < PEAK_DROP * before:
                out.append(f"the {dtype} GEMM peak at {threads} thread(s) fell from {before:.4g} GFLOP/s at the run's "
                           f"start to {rate:.4g} at its end")
        fewer = [(t, r) for (w, d, t), r in parsed.items() if w == when and d == dtype and t < threads]
        for t, r in fewer:
            if rate < r:
                out.append(f"the {dtype} GEMM peak at {threads} threads ({rate:.4g} GFLOP/s) was below the one at {t} "
                           f"({r:.4g}) at the run's {when}: the other cores were busy")
    return out


def top_processes(seconds: float = 1.0, n: int = 5) -> list[dict]:
    """The processes (the harness's own left out) that used the most CPU over ``seconds``: name, pid,
    user and CPU share (1.0: one core)."""
    import psutil

    mine = {os.getpid()}
    try:
        mine |= {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        pass
    procs = []
    for p in psutil.process_iter(["pid", "name", "username"]):
        if p.pid in mine:
            continue
        try:
            p.cpu_percent(None)
            procs.append(p)
        except psutil.Error:
            continue
    time.sleep(seconds)
    out = []
    for p in procs:
        try:
            share = p.cpu_percent(None) / 100.0
        except psutil.Error:
            continue
        if share > 0.02:
            out.append({"name": p.info.get("name") or "?", "pid": p.pid, "user": p.info.get("username"),
                        "cpu": round(share, 2)})
    return sorted(out, key=lambda d: -d["cpu"])[:n]


def busy_now(sampler: Sampler, seconds: float = 0.5) -> dict | None:
    """Other processes' CPU, steal and load over the next ``seconds`` (the sampler's probe), and, when the
    machine is busy, the processes that take it (:func:`top_processes`, over the same second)."""
    first = sampler.take()
    if first is None:
        return None
    top = None
    try:
        top = top_processes(seconds)
    except (ImportError, OSError):
        time.sleep(seconds)
    last = sampler.take()
    state = summarise([first, last]) if last is not None else None
    if state is None:
        return None
    state["cores"] = os.cpu_count()
    state["loadavg"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    if is_busy(state):
        state["top"] = top or []
    return state


def is_busy(state: dict | None) -> bool:
    """True when a :func:`busy_now` reading shows other processes at :data:`BUSY_START_CORES` or more, or steal."""
    return bool(state) and (state["others_cores"] >= BUSY_START_CORES or state["steal_share"] > STEAL_LIMIT)


def busy_warning(state: dict | None) -> str | None:
    """What ``harness run`` says at its start on a busy machine (None on a quiet one): how busy, who takes
    the CPU, and what that does to the run."""
    if not is_busy(state):
        return None
    who = ", ".join(f"{p['name']} (pid {p['pid']}, {p['cpu']:.0%})" for p in state.get("top") or []) or "no single process"
    load = ", ".join(f"{v:.2f}" for v in state.get("loadavg") or [state["load_max"]])
    return (f"the machine is busy: other processes used {state['others_cores']:.2g} of {state['cores']} cores over "
            f"half a second (load average {load}; steal {state['steal_share']:.1%}); the most: {who}. Timings taken now "
            f"are slower and noisier, and more threads gain less than they can; cells timed while it stays so are "
            f"marked contended in the summary and the report, and their speedups are not called winners. For figures "
            f"to keep, wait for these to finish or stop them, and rerun.")


def run_conditions(sampler: Sampler, start_state: dict | None, started: float, peaks_start: dict,
                   peaks_end: dict | None) -> dict:
    """run.json's ``conditions``: the reading before the run, the whole run's summary, the GEMM peaks at the
    end and the run-level evidence of a busy machine (:func:`peak_evidence`)."""
    return {"sampled_every_s": sampler.interval_s, "at_start": start_state,
            "run": sampler.window(started, time.monotonic()),
            "gemm_peak_gflops_end": peaks_end, "evidence": peak_evidence(peaks_start, peaks_end)}

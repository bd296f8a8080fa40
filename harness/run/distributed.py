"""Running a config's comparison groups on a Dask cluster (``harness run --executor dask``).

The unit of distribution is a pass over a comparison group, never a single cell: the cells
of a group are timed side by side in interleaved rounds, so they must share one host. On a
Dask worker a pass runs exactly as it does locally (:meth:`GroupRun.run_pass`: a fresh worker
subprocess per cell, the same verification and timing); a group with ``timing.passes`` gets
its next pass as a new task on the same host, queued behind the passes already asked for (so
its passes lie apart), and its rows stream back into the one run folder as groups finish.

What a Dask worker must declare (``dask worker ADDRESS --nthreads 1 --resources "cores=N"``,
plus ``GPU=1`` on a GPU host): ``cores`` is how many cores its timed groups may use, and a
group asks for as many as its largest ``threads``; a group with a GPU cell also asks for
``GPU``. One thread per worker means one group at a time, so two timed groups never share a
worker's cores. ``--executor dask-local --workers N`` starts such a cluster on this machine,
each worker confined to its own slice of the cores.

A worker that dies mid-group: the scheduler hands the group to another worker once
(``distributed.scheduler.allowed-failures``, set to 1 for the local cluster); a group that
still fails is recorded with status ``error`` and the reason, never silently lost.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from harness.spec.errors import HarnessError
from harness.spec.status import Status

#: a group whose worker dies is handed to another worker this many times before it is recorded as failed
GROUP_RETRIES = 1


def _import_distributed():
    try:
        import distributed
    except ImportError as exc:
        raise HarnessError(f"the dask executors need dask.distributed ({exc}); install it with "
                           "pip install 'rnn-harness[dask]'") from None
    return distributed


def group_resources(group) -> dict[str, int]:
    """The Dask worker resources one comparison group needs: its cores, and a GPU if any cell uses one."""
    need = {"cores": max(c.threads for c in group)}
    if any(c.problem.device == "gpu" for c in group):
        need["GPU"] = 1
    return need


def unmet_need(need: dict[str, int], offers: list[dict[str, float]]) -> str | None:
    """Why no worker can take a group needing ``need`` (None when one can)."""
    if any(all(offer.get(k, 0) >= v for k, v in need.items()) for offer in offers):
        return None
    wanted = ", ".join(f"{k}={v}" for k, v in need.items())
    seen = "; ".join(", ".join(f"{k}={v:g}" for k, v in sorted(o.items())) or "none" for o in offers) or "no workers"
    return f"unavailable: no Dask worker declares the resources this group needs ({wanted}); workers declare: {seen}"


_HOST_PEAKS: dict[str, float] = {}  # GEMM peaks this worker process measured (per dtype and threads)
_HOST_ROOFS: dict[str, dict] = {}  # this host's GPU roofs, once measured


def _pin_to_worker_cpus() -> None:
    """Confine this task's thread (and the worker subprocesses it starts) to the Dask worker's cores."""
    try:
        from distributed import get_worker

        cpus = getattr(get_worker(), "harness_cpus", None)
    except (ImportError, ValueError):
        cpus = None
    if cpus:
        os.sched_setaffinity(0, set(cpus))


def run_group_task(config, group, saved: dict | None = None) -> dict:
    """Run one pass over a comparison group on this (Dask worker's) host, from where ``saved`` (a
    :meth:`GroupRun.saved` of its earlier passes, or None) left it: the same
    :meth:`GroupRun.run_pass` a local run makes, with the same stop rule carried in ``saved``.
    Returns this host's facts and either the group's outcomes (it is finished) or ``saved`` for
    its next pass; each timed cell keeps what the busy-machine guard read on this host while it
    was timed (:func:`harness.run.guard.note_windows`), as in a local run."""
    from harness.run import guard, machine, roofs
    from harness.run.group import GroupRun

    _pin_to_worker_cpus()
    _HOST_PEAKS.update(roofs.gemm_peaks(group, _HOST_PEAKS))
    if "roofs" not in _HOST_ROOFS:
        found = roofs.gpu_roofs(group)
        if found is not None:
            _HOST_ROOFS["roofs"] = found
    state = GroupRun.restore(group, saved)
    # the busy-machine guard on the host that times the group, as a local run's runner samples its own
    sampler = guard.Sampler().start()
    try:
        state.run_pass()
    finally:
        sampler.stop()
    guard.note_windows(sampler, state)
    done = {"outcomes": state.ordered() if state.finished else None,
            "saved": None if state.finished else state.saved()}
    return {**done, "host": machine.host_name(), "machine": machine.machine_info(),
            "gemm_peak_gflops": dict(_HOST_PEAKS), "gpu_roofs": _HOST_ROOFS.get("roofs"), "address": _worker_host()}


def _worker_host() -> str | None:
    """The address of this Dask worker's host, as ``client.submit(workers=...)`` takes it (None off a worker)."""
    from urllib.parse import urlparse

    try:
        from distributed import get_worker

        return urlparse(get_worker().address).hostname
    except (ImportError, ValueError):
        return None


def merge_fragment(meta: dict, result: dict) -> None:
    """Fold the facts of the host a group's pass ran on into run.json's ``hosts`` (its machine and roofs)."""
    from harness.run import machine

    machine.record_host(meta, result["host"], result["machine"], result["gemm_peak_gflops"], result.get("gpu_roofs"))


def _local_worker_plugin(slices: list[list[int]], runner_pid: int):
    """A Dask worker plugin for the local cluster's workers: each gets its own slice of this machine's
    cores, and dies with the runner (``runner_pid``, their parent) however the runner dies, as the
    benchmark workers it starts die with it (:mod:`harness.worker.lifeline`)."""
    from distributed.diagnostics.plugin import WorkerPlugin

    class LocalWorker(WorkerPlugin):
        name = "harness-local-worker"

        def setup(self, worker):
            from harness.worker import lifeline

            # set on the worker process's main thread (its event loop), which lives as long as it
            lifeline.die_with_parent(runner_pid)
            index = int(worker.name) if str(worker.name).isdigit() else 0
            worker.harness_cpus = slices[index % len(slices)]

    return LocalWorker()


def _usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_slices(n_workers: int) -> list[list[int]]:
    """This process's cores split into ``n_workers`` disjoint, contiguous slices (at least one core each)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if n_workers > len(cpus):
        raise HarnessError(f"--workers {n_workers}: this machine lets the harness use {len(cpus)} cores, and each "
                           "local Dask worker needs a core of its own so timed groups never share one")
    per = len(cpus) // n_workers
    return [cpus[i * per:(i + 1) * per] for i in range(n_workers)]


@dataclass
class DaskExecutor:
    """Hands comparison groups to a Dask cluster: an existing one (``scheduler`` address) or a local one."""

    scheduler: str | None = None
    n_workers: int | None = None  # a LocalCluster of this many worker processes when no scheduler is given
    _cluster: object = field(default=None, repr=False)

    def _connect(self):
        distributed = _import_distributed()
        import dask

        if self.scheduler:
            try:
                return distributed.Client(self.scheduler, timeout="30s")
            except (OSError, TimeoutError) as exc:
                raise HarnessError(f"--scheduler {self.scheduler}: cannot reach the Dask scheduler: {exc}") from None
        slices = cpu_slices(self.n_workers or 2)
        with dask.config.set({"distributed.scheduler.allowed-failures": GROUP_RETRIES}):
            self._cluster = distributed.LocalCluster(
                n_workers=len(slices), threads_per_worker=1, processes=True, dashboard_address=None,
                resources={"cores": len(slices[0])}, silence_logs=40)
        client = distributed.Client(self._cluster)
        client.register_plugin(_local_worker_plugin(slices, os.getpid()))
        return client

    def check_cells(self, cells) -> None:
        """Before a run starts: a local cluster whose workers' slices of cores are too small for the
        threads of some cell raises, naming the largest ``--workers`` that would hold them."""
        if self.scheduler or not cells:
            return
        n = self.n_workers or 2
        cpu_slices(n)  # fewer cores than workers: its own message
        usable = _usable_cpus()
        per = usable // n
        need = max(c.threads for c in cells)
        if need <= per:
            return
        fits = usable // need
        hint = (f"--workers {fits} would give each worker {usable // fits} cores" if fits >= 1 else
                f"no --workers would: the harness may use {usable} cores here")
        raise HarnessError(f"--executor dask-local --workers {n}: each worker holds {per} of this machine's {usable} "
                           f"cores, and cells of this run need {need} threads; {hint}")

    def run(self, runner, groups, progress=None, task_id=None) -> None:
        """Run ``groups`` on the cluster, adding each group's rows to ``runner.store`` as it finishes."""
        distributed = _import_distributed()
        client = self._connect()
        futures = {}
        try:
            offers = [w.get("resources", {}) for w in client.scheduler_info()["workers"].values()]
            def submit(group, saved, host=None):
                """One pass; a group's next pass queues behind every pass asked for before it, on the
                host of its first (elsewhere only if that host has left the cluster)."""
                where = {"workers": [host], "allow_other_workers": True} if host else {}
                fut = client.submit(run_group_task, runner.config, group, saved, resources=group_resources(group),
                                    pure=False, key=f"harness-group-{os.urandom(6).hex()}", **where)
                futures[fut] = group
                return fut

            for group in groups:
                why = unmet_need(group_resources(group), offers)
                if why is not None:
                    self._record_failed(runner, group, Status.UNAVAILABLE, why)
                    self._advance(progress, task_id, group, len(futures))
                    continue
                submit(group, runner.store.unfinished(group[0].key))
            pending = len(futures)
            queue = distributed.as_completed(list(futures))
            for fut in queue:
                group = futures[fut]
                try:
                    result = fut.result()
                except Exception as exc:  # the group's worker died twice, or the task itself failed
                    where = getattr(getattr(exc, "last_worker", None), "address", None)
                    detail = f" (last on {where})" if where else ""
                    self._record_failed(runner, group, Status.ERROR, f"the Dask task running this group failed{detail}: "
                                                               f"{type(exc).__name__}: {exc}")
                else:
                    merge_fragment(runner.store.meta, result)
                    if result["saved"] is not None:  # kept for --resume, and on to the next pass
                        runner.store.keep_unfinished(group[0].key, result["saved"])
                        queue.add(submit(group, result["saved"], result["address"]))
                        continue
                    runner.store.add_group(result["outcomes"], result["gemm_peak_gflops"], result["gpu_roofs"])
                pending -= 1
                self._advance(progress, task_id, group, pending)
            # groups finished in any order; keep the table in the config's order, as a local run has it
            order = {cell.cell_id: i for i, cell in enumerate(runner.config.cells())}
            runner.store.timings.sort(key=lambda row: order.get(row["cell_id"], len(order)))
            runner.store.save()
        finally:
            for fut in futures:
                fut.cancel()
            client.close()
            if self._cluster is not None:
                self._cluster.close()
                self._cluster = None

    @staticmethod
    def _record_failed(runner, group, status: str, reason: str) -> None:
        from harness.run.group import Outcome

        runner.store.add_group([Outcome(cell, status, reason) for cell in group])  # host None: it ran nowhere

    @staticmethod
    def _advance(progress, task_id, group, pending: int) -> None:
        if progress is not None:
            progress.update(task_id, description=f"dask: {pending} groups queued or running")
            progress.advance(task_id, len(group))

"""The processes the harness starts die with the process that started them, however it died.

A worker that the runner has stopped (``SIGSTOP``, while another worker of its group is timed)
never reads the end of its input, and a runner killed with ``SIGKILL`` (the kernel's OOM killer, a
CI job's timeout) cannot end its workers itself. So the parent puts its pid in the child's
environment (:func:`child_environ`) and every program of the harness that runs as a child (the
benchmark workers, in the main or an isolated environment, the BLAS probe, the local Dask cluster's
workers) calls :func:`die_with_parent` first thing:

* on Linux the kernel then sends the child ``SIGKILL`` the moment its parent exits
  (``prctl(PR_SET_PDEATHSIG)``); ``SIGKILL`` ends a stopped process too;
* a child whose parent died before it got that far exits at once;
* where ``prctl`` is missing, a thread polls the parent's pid instead. That ends a running child
  within a second, but not a stopped one: the run folder's ``workers.json`` names the workers
  the runner had running, and ``--resume`` ends any that is left (:func:`end_stale`).

Standard library only, and Python 3.9 syntax: isolated environments run this module too.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from harness.spec import writes
from harness.spec.errors import HarnessError

#: the environment variable that carries the parent's pid to a child
PARENT_VAR = "HARNESS_PARENT_PID"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: where the runner lists the workers it has running, in its results folder
WORKERS_FILE = "workers.json"


def child_environ(env: dict | None = None) -> dict:
    """``env`` (default: this process's environment) with this process named as the child's parent."""
    env = dict(os.environ if env is None else env)
    env[PARENT_VAR] = str(os.getpid())
    return env


def parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send this process ``sig`` when its parent exits; False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _kernel_guard() -> bool:
    """Ask the kernel for SIGKILL when this process's parent exits; False where it cannot."""
    return parent_death_signal(signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch(parent: int, every_s: float = 0.5) -> None:
    while os.getppid() == parent:
        time.sleep(every_s)
    os._exit(1)


def die_with_parent(parent: int | None = None) -> str:
    """Tie this process's life to its parent's: ``"kernel"`` (prctl), ``"watch"`` (a polling thread)
    or ``"none"`` (no parent was named: run by hand). ``parent`` defaults to :data:`PARENT_VAR`,
    which is then removed from the environment, so this process's own children do not take it."""
    if parent is None:
        try:
            parent = int(os.environ.pop(PARENT_VAR, ""))
        except ValueError:
            return "none"
    how = "kernel" if _kernel_guard() else "watch"
    # the parent died before the guard was set (or while it was being set): nothing would send the
    # signal now. A parent that is alive but not ours (an interpreter started through a wrapper)
    # is not a reason to quit.
    if os.getppid() != parent and not _alive(parent):
        os._exit(1)
    if how == "watch":
        threading.Thread(target=_watch, args=(os.getppid(),), name="harness-lifeline", daemon=True).start()
    return how


# -- the run folder's record, for platforms without the guarantee ------------------------------


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, from /proc), None where unknown: with the
    pid it names one process, where a pid alone may since have been given to another."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        if fields[0] == b"Z":  # exited, not yet reaped
            return None
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


class WorkerRecord:
    """The workers a run has running, listed in its folder (``workers.json``: pid and start time)."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / WORKERS_FILE
        self.live: dict[int, int | None] = {}

    def add(self, pid: int) -> None:
        self.live[pid] = start_ticks(pid)
        self._write()

    def remove(self, pid: int) -> None:
        if self.live.pop(pid, 0) != 0:
            self._write()

    def _write(self) -> None:
        rows = [{"pid": pid, "start_ticks": ticks} for pid, ticks in self.live.items()]
        try:
            if not rows:  # none running: no file (a finished run's folder has none)
                self.path.unlink(missing_ok=True)
                return
            writes.write_file(self.path, json.dumps({"runner": os.getpid(), "workers": rows}), run=self.path.parent)
        except (OSError, HarnessError):  # the record is a safety net; a disk that refuses it must not stop the run
            pass


def end_stale(folder: Path) -> list[int]:
    """End every worker a killed runner of the run in ``folder`` left running (a platform without
    the kernel's guarantee); the pids ended. A pid that now names another process (its start time
    differs) is left alone. The record is cleared."""
    path = Path(folder) / WORKERS_FILE
    try:
        rows = json.loads(path.read_text()).get("workers", [])
    except (OSError, ValueError, AttributeError):
        return []
    ended = []
    for row in rows:
        try:
            pid, ticks = int(row["pid"]), row.get("start_ticks")
        except (KeyError, TypeError, ValueError):
            continue
        now = start_ticks(pid)
        if ticks is None or now is None or now != ticks:  # gone, or the pid was reused
            continue
        try:  # a worker leads its own process group: end what it started too
            os.killpg(pid, signal.SIGKILL) if os.getpgid(pid) == pid else os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue
        ended.append(pid)
    try:
        path.unlink()
    except OSError:
        pass
    return ended

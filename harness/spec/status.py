"""The words a cell or a conformance case ends in: one set, used by the worker, the runner, the
results and every reader of them.

A cell ends ``ok`` or in one of the failures (it ran and broke: ``error``, ``timeout``, ``oom``,
``diverged``, ``mismatch`` against the reference) or was never run (``unsupported``: the backend
says it cannot do this problem, with its reason; ``unavailable``: the backend cannot run here at
all). A conformance case ends ``pass`` or ``fail``, or ``error``, ``unsupported``, ``unavailable``.
Members are strings (``Status.OK == "ok"``), so tables and JSON hold the plain words.
"""

from __future__ import annotations

from enum import Enum


class Status(str, Enum):
    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    OOM = "oom"
    DIVERGED = "diverged"
    MISMATCH = "mismatch"
    UNSUPPORTED = "unsupported"
    UNAVAILABLE = "unavailable"
    PASS = "pass"  # conformance cases only
    FAIL = "fail"  # conformance cases only

    def __str__(self) -> str:
        return self.value


#: the statuses of a cell that ran and broke
FAILED = frozenset({Status.ERROR, Status.TIMEOUT, Status.OOM, Status.DIVERGED, Status.MISMATCH})
#: every status a cell can end in (a results row with another one is unfinished)
CELL_FINAL = frozenset({Status.OK, Status.UNSUPPORTED, Status.UNAVAILABLE}) | FAILED
#: the statuses of a conformance case that count against the backend
CASE_FAILED = frozenset({Status.FAIL, Status.ERROR, Status.UNAVAILABLE})


class StopReason(str, Enum):
    """Why a comparison group's interleaved rounds stopped (the ``stop_reason`` column): ``floor`` (no
    precision target, or no baseline left to measure speedups against: the floor of rounds and time was
    all it needed), ``target`` (every speedup within its precision), ``cap`` (the time cap, or the last
    pass allowed) or, between passes, ``pass`` (another pass is to come)."""

    FLOOR = "floor"
    TARGET = "target"
    CAP = "cap"
    PASS = "pass"

    def __str__(self) -> str:
        return self.value


class TrainStop(str, Enum):
    """Why a training cell stopped: its loss ``target`` held for ``patience`` evaluations, its
    ``time_budget`` ran out, or it ran all its ``epochs``."""

    TARGET = "target"
    TIME_BUDGET = "time_budget"
    EPOCHS = "epochs"

    def __str__(self) -> str:
        return self.value

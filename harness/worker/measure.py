"""The one clock loop and the one stop rule.

Every timed loop of the project goes through here: the worker's warm-up, rounds,
training steps and GEMM peak, the BLAS probe, and the benchmark scripts. The clock is
``time.perf_counter_ns`` and the code under test is ``sync()``-ed before every read, so
asynchronous backends (JAX, CUDA) are charged for the work they queued. The stop rule
reads a group's timing settings and the rules derived from them
(:class:`harness.spec.timing.TimingRules`, on which the config's ``TimingConfig`` is built).

Worker-safe: the standard library, the spec layer and the statistics of :mod:`harness.worker.stats`.
"""

from __future__ import annotations

import time
from typing import Callable

from harness.worker.stats import MIN_PRECISION_ROUNDS, half_width, paired_speedup, precision_met
from harness.spec.timing import TimingRules
from harness.spec.errors import HarnessError
from harness.spec.status import StopReason

MAX_INNER = 10_000  # calls per round at most: beyond that a round's clock reads are noise-free enough


_clock = time.perf_counter_ns  # bound once: a global lookup less between the code under test and the clock


def _no_sync() -> None:
    pass


def clock_ns() -> int:
    """The clock every measurement reads (monotonic, nanoseconds)."""
    return _clock()


def time_once(fn: Callable[[], object], sync: Callable[[], None] = _no_sync) -> tuple[float, object]:
    """Seconds of one ``fn()`` from a synced start to a synced end, and what it returned."""
    sync()
    t0 = _clock()
    out = fn()
    sync()
    return (_clock() - t0) / 1e9, out


def time_rounds(call: Callable[[], object], sync: Callable[[], None] = _no_sync, n_rounds: int = 1, inner: int = 1,
                after_round: Callable[[], None] | None = None) -> list[float]:
    """``n_rounds`` rounds of ``inner`` calls each; seconds per call of each round.

    ``after_round`` runs outside the clock after each round (e.g. a divergence check)."""
    out = []
    for _ in range(n_rounds):
        sync()
        t0 = _clock()
        for _ in range(inner):
            call()
        sync()
        out.append((_clock() - t0) / 1e9 / inner)
        if after_round is not None:
            after_round()
    return out


def time_interleaved(calls: dict[str, Callable[[], object]], n_rounds: int, inner: int = 1,
                     syncs: dict[str, Callable[[], None]] | None = None) -> dict[str, list[float]]:
    """Rounds of several calls taken in turn (A B C, then C B A, ...): per key, seconds per call of each round.

    Alternating the order cancels a drift of the machine and any advantage of going first."""
    syncs = syncs or {}
    samples: dict[str, list[float]] = {k: [] for k in calls}
    for r in range(n_rounds):
        for k in round_order(list(calls), r):
            samples[k] += time_rounds(calls[k], syncs.get(k, _no_sync), 1, inner)
    return samples


def round_order(keys: list, r: int) -> list:
    """The order of round ``r`` of interleaved contenders: as given on even rounds, reversed on odd ones."""
    return keys if r % 2 == 0 else keys[::-1]


def best_rate(call: Callable[[], object], work: float, seconds: float, sync: Callable[[], None] = _no_sync) -> float:
    """``work`` per second of the fastest of repeated calls during about ``seconds`` (at least one)."""
    best = float("inf")
    end = _clock() + int(seconds * 1e9)
    while best == float("inf") or _clock() < end:
        best = min(best, time_rounds(call, sync)[0])
    return work / best


class Stopwatch:
    """Accumulates the seconds of the timed sections of a longer loop (training: steps, not evaluations)."""

    def __init__(self, sync: Callable[[], None] = _no_sync):
        self.sync = sync
        self.total_s = 0.0

    def time(self, fn: Callable[[], object]) -> tuple[float, object]:
        """Time one ``fn()`` (synced) and add it to the total; its seconds and result."""
        dt, out = time_once(fn, self.sync)
        self.total_s += dt
        return dt, out


def elapsed_s(start_ns: int) -> float:
    """Seconds since ``start_ns`` (a :func:`clock_ns` reading), for wall-clock budgets."""
    return (_clock() - start_ns) / 1e9


def calibrate(one_call_s: float, round_s: float) -> int:
    """The inner loop count that makes a round of calls of ``one_call_s`` last ``round_s`` (1 to MAX_INNER)."""
    return max(1, min(MAX_INNER, int(round(round_s / max(one_call_s, 1e-9)))))


RECHECK_GROWTH = 1.25  # a cell short of its target is re-checked at most this much later (in rounds)


class StopRule:
    """When the interleaved rounds of a comparison group have enough samples.

    The floor: every cell has ``min_rounds`` rounds and ``min_time_s`` of timed calls. With a
    ``target`` (the config's ``speedup_precision``), the rounds also go on until the 95%
    interval of every speedup over ``baseline`` is within ``target`` of its value (at least
    MIN_PRECISION_ROUNDS pairs). Whatever is unmet, the group stops once it has run
    ``max_time_s`` per cell in all. The runner asks before every round (the first time with
    no samples) with the cells still running; a cell that fails drops out of ``samples``
    but its share of the time cap stays, as its failed request took time too. One rule
    object serves one group.

    In one pass (``pass_limit`` 1) the rounds go on for the target. With several passes (the
    runner visits the group again, later in the run, with fresh worker processes, and calls
    :meth:`start_pass` before each visit), every pass takes ``pass_rounds`` rounds and its
    share of ``min_time_s`` and no more: the rounds of one stretch cannot narrow what the
    interval learns from the passes' disagreement, more passes can. After ``passes`` passes
    the target is checked at the end of each; while it is unmet another pass follows (reason
    ``"pass"``), up to ``pass_limit`` passes and the time cap, for the cells in ``pending``
    (those still short of it) and the baseline: a cell whose speedup is precise is done.

    ``interval(baseline_samples, samples, blocks=...) -> (point, lo, hi)`` is the interval the
    results report (the paired bootstrap over blocks), so stopping for precision and the
    ``precision_met`` column agree by construction. It costs milliseconds, too much for
    every round of a long group, so a cell found short of the target is only re-checked once
    its rounds reach where the shrinking of the interval (as one over the root of the rounds)
    predicts the target, and at most RECHECK_GROWTH times later.

    The rule stops on the interval's width, never on where it lies, so it does not steer the
    speedup itself; taking the first width under the target slightly favours a narrow draw,
    which the floor of MIN_PRECISION_ROUNDS pairs keeps small.

    After ``done`` returns True, ``reason`` (a :class:`StopReason`) says why; ``widths`` holds each cell's
    relative half-width at its last check."""

    def __init__(self, timing: TimingRules, interval: Callable[..., tuple[float, float, float]] | None = None):
        """``timing``: the group's timing settings with their derived rules (a ``TimingConfig``);
        ``interval``: what reports a speedup's interval, needed with a precision target."""
        target = timing.speedup_precision
        if target is not None and interval is None:
            raise HarnessError("a precision target needs the interval function that reports the speedups")
        self.min_rounds = timing.min_rounds
        self.min_time_s = timing.min_time_s
        self.max_time_s = timing.max_time_s
        self.target = target
        self.interval = interval
        self.passes = timing.passes
        self.pass_limit = timing.pass_limit
        self.pass_rounds = timing.pass_rounds
        self.pass_index = 0  # the pass under way, from 0
        self.n_cells = 0  # the most cells seen in one call: the cap's multiplier
        self.reason: StopReason | None = None
        self.widths: dict[str, float] = {}
        self.n_checks = 0  # interval evaluations so far (their cost is what the schedule bounds)
        self._next_check: dict[str, int] = {}  # cell -> rounds before its interval is worth computing again
        self._pass_start: dict[str, int] = {}  # cell -> its rounds before the pass under way
        self.pending: set[str] | None = None  # after a pass that checked the target: the cells still short of it

    # what of the rule carries from one pass to the next (a group run saves it between passes, so a
    # pass run on another process or host, or after --resume, stops by the same rule)
    _CARRIED = ("pass_index", "n_cells", "reason", "widths", "n_checks", "pending")

    def state(self) -> dict:
        """The rule's state between passes, as plain JSON values."""
        out = {k: getattr(self, k) for k in self._CARRIED}
        out["pending"] = sorted(self.pending) if self.pending is not None else None
        out["next_check"] = dict(self._next_check)
        return out

    def restore(self, state: dict | None) -> "StopRule":
        """Take up the state :meth:`state` saved (None: as new); returns the rule."""
        if state:
            for k in self._CARRIED:
                setattr(self, k, state[k])
            self.pending = set(state["pending"]) if state["pending"] is not None else None
            self._next_check = dict(state["next_check"])
        return self

    def start_pass(self, index: int, samples: dict[str, list[float]]) -> None:
        """Pass ``index`` (from 0) begins, after the rounds in ``samples`` (by cell id)."""
        self.pass_index = index
        self.reason = None
        self._pass_start = {c: len(s) for c, s in samples.items()}

    def done(self, samples: dict[str, list[float]], inner: dict[str, int], baseline: str | None,
             elapsed_s: float, blocks=None) -> bool:
        """True when the rounds so far (per-call seconds per round, by cell id; all passes) are
        enough, for now (``reason`` ``"pass"``) or for good.

        ``elapsed_s``: the seconds the group's rounds took so far, all passes; ``blocks``: each
        round's block label, for the interval."""
        self.n_cells = max(self.n_cells, len(samples))
        capped = elapsed_s >= self.max_time_s * max(1, self.n_cells)
        if self._floor(samples, inner):
            if self.pass_index + 1 < self.passes:
                self.reason = StopReason.CAP if capped else StopReason.PASS
                return True
            if self.target is None or baseline not in samples or len(samples) < 2:
                self.reason = StopReason.FLOOR
                return True
            if self.pass_limit > 1:  # the pass has its rounds; what it lacks, only another pass can give
                self.pending = self._short(samples, baseline, blocks)
                if not self.pending:
                    self.reason = StopReason.TARGET
                elif self.pass_index + 1 < self.pass_limit and not capped:
                    self.reason = StopReason.PASS
                else:
                    self.reason = StopReason.CAP
                return True
            if self._precise(samples, baseline, blocks):
                self.reason = StopReason.TARGET
                return True
        if capped:
            self.reason = StopReason.CAP
            return True
        return False

    def _floor(self, samples: dict[str, list[float]], inner: dict[str, int]) -> bool:
        """Every cell has this pass's rounds and share of the timed seconds, and from the ``passes``-th
        pass on the whole floor."""
        for c, s in samples.items():
            new = s[self._pass_start.get(c, 0):]
            if len(new) < self.pass_rounds or sum(new) * inner[c] < self.min_time_s / self.passes:
                return False
            if self.pass_index + 1 >= self.passes and (len(s) < self.min_rounds or sum(s) * inner[c] < self.min_time_s):
                return False
        return True

    def _short(self, samples: dict[str, list[float]], baseline: str, blocks) -> set[str]:
        """The cells whose speedup's interval is not yet within the target (every one is checked)."""
        short = set()
        for c in samples:
            if c != baseline:
                n = min(len(samples[baseline]), len(samples[c]))
                point, lo, hi = self.interval(samples[baseline], samples[c], blocks=blocks)
                self.n_checks += 1
                self.widths[c] = half_width(point, lo, hi)
                if not precision_met(point, lo, hi, n, self.target):
                    short.add(c)
        return short

    def _precise(self, samples: dict[str, list[float]], baseline: str, blocks) -> bool:
        """Every speedup's interval within the target; the cell last found short is checked first."""
        base = samples[baseline]
        cells = sorted((c for c in samples if c != baseline), key=lambda c: -self._next_check.get(c, 0))
        for c in cells:
            n = min(len(base), len(samples[c]))
            if n < max(MIN_PRECISION_ROUNDS, self._next_check.get(c, 0)):
                return False
            point, lo, hi = self.interval(base, samples[c], blocks=blocks)
            self.n_checks += 1
            w = self.widths[c] = half_width(point, lo, hi)
            if not precision_met(point, lo, hi, n, self.target):
                predicted = n * (w / self.target) ** 2 if w == w else n + 1
                self._next_check[c] = int(min(max(predicted, n + 1), n * RECHECK_GROWTH + 1))
                return False
        return True


def stop_rule(timing: TimingRules) -> StopRule:
    """A fresh stop rule for one group timed with ``timing`` (its ``TimingConfig``).

    A precision target reads the speedups' intervals through :func:`harness.worker.stats.paired_speedup`."""
    return StopRule(timing, paired_speedup if timing.speedup_precision is not None else None)

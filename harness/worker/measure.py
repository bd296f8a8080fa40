"""The one clock loop.

Every timed loop of the project goes through here: the worker's warm-up, rounds,
training steps and GEMM peak, the BLAS probe, and the benchmark scripts. The clock is
``time.perf_counter_ns`` and the code under test is ``sync()``-ed before every read, so
asynchronous backends (JAX, CUDA) are charged for the work they queued. When a group's
rounds have enough samples is the stop rule's to say (:class:`harness.run.stats.StopRule`,
on the runner's side).

Worker-safe: the standard library alone.
"""

from __future__ import annotations

import time
from typing import Callable


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
    """Rounds of several calls taken in turn, in the order :func:`round_order` gives each round: per
    key, seconds per call of each round."""
    syncs = syncs or {}
    samples: dict[str, list[float]] = {k: [] for k in calls}
    for r in range(n_rounds):
        for k in round_order(list(calls), r):
            samples[k] += time_rounds(calls[k], syncs.get(k, _no_sync), 1, inner)
    return samples


def round_order(keys: list, r: int) -> list:
    """The order of round ``r`` (from 0) of interleaved contenders, for every interleaved loop of the
    project: rotated by ``r // 2`` places, and reversed on odd rounds (A B C, C B A, B C A, A C B, C A B,
    B A C for three: every order once in six rounds). Each contender goes first, last and in between
    equally often and follows each other one as often as it precedes it, so neither a drift of the
    machine nor an advantage of a place in the round (a cache warmed or cooled by the one before)
    favours one; the order follows from ``r`` alone, so a run's rounds say which it was."""
    if not keys:
        return []
    k = (r // 2) % len(keys)
    turned = keys[k:] + keys[:k]
    return turned if r % 2 == 0 else turned[::-1]


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

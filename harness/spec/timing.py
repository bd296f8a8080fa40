"""What follows from a config's ``timing:`` settings: the rules between them, in one place.

:class:`TimingRules` holds the derived rules (how long a round aims to be, how many passes a group
gets at most, how many rounds each pass takes, how many fresh worker processes a cell gets and which
one takes a given round). The config's ``TimingConfig`` is built on it (it adds the settings, their
defaults and their validation); the stop rule and the group runner read these properties from it.
Standard library only: the worker side may import this module.
"""

from __future__ import annotations

MIN_ROUND_S = 0.005  # a round shorter than this is dominated by the clock and the protocol
MIN_BLOCK_ROUNDS = 5  # rounds a block (a half of the rounds, a process, a pass) needs to give a speedup of its own


class TimingRules:
    """The rules derived from the timing settings; a subclass provides ``min_rounds``, ``min_time_s``,
    ``round_s``, ``passes`` (None: :attr:`pass_count`'s default), ``max_passes``, ``processes`` and
    ``min_processes``."""

    @property
    def pass_count(self) -> int:
        """The passes every group gets at least: ``passes``, else a pass for each of ``min_processes``'
        processes, at most two (one where ``processes`` asks for several in one pass). Processes a pass
        apart lie apart in time, so a speedup's interval sees what moves between them (a host's speed that
        drifts over minutes), at the cost of processes side by side: the same starts, the same rounds."""
        if self.passes is not None:
            return self.passes
        return 1 if self.processes > 1 else min(2, self.min_processes)

    @property
    def target_round_s(self) -> float:
        """The length one round aims at: ``round_s``, else ``min_time_s / min_rounds`` (at least 5 ms)."""
        return self.round_s or max(MIN_ROUND_S, self.min_time_s / self.min_rounds)

    @property
    def pass_limit(self) -> int:
        """The most passes a group gets: ``max_passes``, else :attr:`pass_count`."""
        return self.max_passes or self.pass_count

    @property
    def pass_rounds(self) -> int:
        """Rounds every pass over a group takes at least: its share of ``min_rounds`` and, when the
        rounds fall into several blocks (worker processes, of one pass or several), MIN_BLOCK_ROUNDS
        per process of the pass."""
        share = -(-self.min_rounds // self.pass_count)
        if self.pass_count * self.processes_per_pass > 1:
            share = max(share, MIN_BLOCK_ROUNDS * self.processes_per_pass)
        return share

    @property
    def processes_per_pass(self) -> int:
        """How many fresh worker processes a timed cell starts in each pass (they take its rounds in turn):
        the setting ``processes`` (per pass), or more where the setting ``min_processes`` (over all
        ``passes``) asks for more; each one is a block of a speedup's interval."""
        return max(self.processes, -(-self.min_processes // self.pass_count))

    def round_process(self, n_pass: int, n_round: int) -> int:
        """The worker process (numbered across passes, from 0) that takes the ``n_round``-th round of the
        ``n_pass``-th pass: the pass's process ``n_round % processes_per_pass``."""
        return n_pass * self.processes_per_pass + n_round % self.processes_per_pass

    def round_block(self, n_pass: int, n_round: int) -> int:
        """The block of the ``n_round``-th round (from 0) of the ``n_pass``-th pass (from 0), as
        :func:`harness.run.stats.speedup_intervals` reads it: the worker process that took it
        (:meth:`round_process`), since every fresh process is an independent draw of what its rounds
        cannot resample."""
        return self.round_process(n_pass, n_round)

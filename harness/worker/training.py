"""A ``train`` cell's training run, in its worker: SGD epochs, evaluated as they go.

Worker-safe: numpy and this package only.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from harness.spec.status import Status, TrainStop
from harness.worker import measure, protocol


class DivergedError(Exception):
    """The loss became NaN or infinite."""


class TrainingLoop:
    """SGD epochs over a cell's data from its current parameters, with the evaluation loss taken every
    ``eval_every`` examples (and at the start and the end); the clock counts training steps only.

    Training stops at the first of: the evaluation loss at or below ``target_loss`` for ``patience``
    evaluations in a row (the time to target is the steps' time then), the steps' time past
    ``time_budget_s``, the last epoch. A non-finite training or evaluation loss ends it as diverged.
    With ``halve_lr_on_rise`` the rate halves after each evaluation whose loss exceeds the one before.
    """

    def __init__(self, backend, data, batch: int, evaluate: Callable[[], float], lr: float,
                 settings: protocol.TrainSettings):
        self.backend, self.data, self.batch, self.evaluate = backend, data, batch, evaluate
        self.settings = settings
        self.lr = lr  # the starting rate
        self.rng = np.random.default_rng(settings.seed)
        self.step_clock = measure.Stopwatch(backend.sync)
        self.eval_clock = measure.Stopwatch(backend.sync)
        self.curve: list[dict] = []  # evaluation points, each after the mean training loss since the last one
        self.steps: list[float] = []  # seconds of each step
        self.running: list[float] = []  # training losses since the last evaluation
        self.examples = 0
        self.next_eval = settings.eval_every
        self.streak = 0  # evaluations in a row at or below the target
        self.time_to_target: float | None = None
        self.epoch = 0
        self.stop: TrainStop | str | None = None
        self.status = Status.OK

    def run(self) -> protocol.TrainReply:
        """Train until a stop; the reply holds the curve, the steps' times and why it stopped."""
        try:
            self.evaluate_now()
            self.epochs()
            if self.curve[-1]["examples"] != self.examples:
                self.evaluate_now()
        except DivergedError as exc:
            self.status, self.stop = Status.DIVERGED, str(exc)
        return protocol.TrainReply(curve=self.curve, step_samples=self.steps, train_s=self.step_clock.total_s,
                                   eval_s=self.eval_clock.total_s, time_to_target_s=self.time_to_target,
                                   stop=self.stop, status=self.status, examples=self.examples, final_lr=self.lr)

    def epochs(self) -> None:
        """Epoch after epoch until a stop, or all of them (stop: ``epochs``)."""
        for self.epoch in range(self.settings.epochs):
            self.one_epoch()
            if self.stop is not None:  # a target met at the start stops here too, where an epoch takes no step
                return
        self.stop = TrainStop.EPOCHS

    def one_epoch(self) -> None:
        """The data's sequences in a fresh order, a batch per step, until a stop."""
        B = self.batch
        order = self.rng.permutation(self.data.n_sequences)
        for i in range(0, self.data.n_sequences - B + 1, B):
            self.step(order[i : i + B])
            if self.stop is not None:
                return

    def step(self, rows) -> None:
        """One timed SGD step on ``rows`` of the data; an evaluation when one is due, and the time budget."""
        x, y = self.data.batch(rows)
        dt, loss = self.step_clock.time(lambda: self.backend.sgd_step(x, y, self.lr))
        self.steps.append(dt)
        loss = float(loss)
        if not math.isfinite(loss):
            raise DivergedError(f"training loss became {loss}")
        self.running.append(loss)
        self.examples += self.batch
        if self.examples >= self.next_eval:
            self.next_eval += self.settings.eval_every
            self.evaluate_now()
        budget = self.settings.time_budget_s
        if self.stop is None and budget is not None and self.step_clock.total_s >= budget:
            self.stop = TrainStop.TIME_BUDGET

    def evaluate_now(self) -> None:
        """The evaluation loss (untimed by the steps' clock) on the curve, after the training losses since
        the last one; then the rate and the target react to it."""
        _, loss = self.eval_clock.time(self.evaluate)
        clock = self.step_clock.total_s
        if self.running:
            self._point(clock, float(np.mean(self.running)), "train")
            self.running.clear()
        previous = next((c["loss"] for c in reversed(self.curve) if c["split"] == "eval"), None)
        self._point(clock, loss, "eval")
        if not math.isfinite(loss):
            raise DivergedError(f"evaluation loss became {loss}")
        if self.settings.halve_lr_on_rise and previous is not None and loss > previous:
            self.lr *= 0.5
        self._toward_target(loss, clock)

    def _toward_target(self, loss: float, clock: float) -> None:
        target = self.settings.target_loss
        if target is None:
            return
        self.streak = self.streak + 1 if loss <= target else 0
        if self.streak >= self.settings.patience and self.time_to_target is None:
            self.time_to_target = clock
            self.stop = TrainStop.TARGET

    def _point(self, clock: float, loss: float, split: str) -> None:
        self.curve.append({"epoch": self.epoch, "examples": self.examples, "wall_s": clock, "loss": loss,
                           "split": split, "lr": self.lr})

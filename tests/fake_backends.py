"""Backends for testing the runner: the reference itself, and ones that misbehave on purpose.

Registered through HARNESS_BACKENDS (see backends/__init__.py), so workers load them
exactly as they load real backends.
"""

import os
import signal
import time

import numpy as np

from backends.base import Backend
from harness.spec import reference as ref


class RefBackend(Backend):
    """The oracle as a backend: correct and slow; ``slow`` sleeps to make a clear speed gap."""
    knows = frozenset({"gru", "bidirectional"})  # the GRU and bidirectional layers are in its supports()

    name = "ref"
    variants = ("plain", "slow")

    def prepare(self, problem, params, device="cpu", threads=1):
        self.problem = problem
        self.params = {k: v.copy() for k, v in params.items()}

    def _pause(self):
        if self.variant == "slow":
            time.sleep(0.002)

    def forward(self, x):
        self._pause()
        return ref.outputs(self.problem.model, self.params, x)

    def loss_and_grads(self, x, y):
        return ref.loss_and_grads(self.problem.model, self.params, x, y)

    def sgd_step(self, x, y, lr):
        self._pause()
        loss, self.params = ref.sgd_step(self.problem.model, self.params, x, y, lr)
        return loss

    def get_params(self):
        return {k: v.copy() for k, v in self.params.items()}


class BadBackend(RefBackend):
    """Fails on purpose during the timed rounds, in the way its variant names."""

    name = "bad"
    variants = ("crash", "hang", "diverge", "oom", "killed", "raise", "unsupported", "wrong")

    def supports(self, problem):
        if self.variant == "unsupported":
            return False, "unsupported: this test backend supports nothing"
        return True, ""

    def warm_up(self, batch):
        self.calls = 0

    def sgd_step(self, x, y, lr):
        self.calls += 1
        if self.variant == "wrong":  # a subtly wrong gradient: 1% too large a step
            return super().sgd_step(x, y, lr * 1.01)
        if self.calls > 3:  # survive warm-up and calibration, fail inside the rounds
            if self.variant == "crash":
                os._exit(3)
            if self.variant == "hang":
                time.sleep(3600)
            if self.variant == "diverge":
                return float("nan")
            if self.variant == "oom":  # an allocation the machine cannot satisfy
                np.empty(1 << 60, dtype=np.uint8)
            if self.variant == "killed":  # killed from outside (a user, a supervisor): not out of memory
                os.kill(os.getpid(), signal.SIGKILL)
            if self.variant == "raise":
                raise RuntimeError("kernel exploded")
        return super().sgd_step(x, y, lr)


class GateBackend(RefBackend):
    """The reference, except that a cell at batch > 1 waits in ``prepare`` until the test opens the gate.

    ``HARNESS_TEST_GATE`` names a folder: the worker writes ``waiting`` there when it starts to wait and goes on
    once ``open`` exists. A test thereby knows that the batch-1 group has finished and that no other can."""

    name = "gate"
    variants = ("plain",)

    def prepare(self, problem, params, device="cpu", threads=1):
        gate = os.environ.get("HARNESS_TEST_GATE")
        if gate and problem.batch > 1 and not os.path.exists(os.path.join(gate, "open")):
            open(os.path.join(gate, "waiting"), "w").close()
            while not os.path.exists(os.path.join(gate, "open")):
                time.sleep(0.02)
        super().prepare(problem, params, device, threads)


class DenseElmanBackend(RefBackend):
    """A corner of the spec, as a plugin might implement it: a one-layer Elman tanh cell on dense inputs
    with full BPTT (biases or none, float64 or float32), like a wrapper of ``torch.nn.RNN``."""

    knows = frozenset()
    name = "dense"
    variants = ("default",)

    def supports(self, problem):
        m = problem.model
        if m.kind != "elman" or m.activation != "tanh" or problem.tokens or m.layers != 1 or m.bptt.mode != "full":
            return False, "unsupported: dense implements one layer of the tanh Elman cell on dense inputs, full BPTT"
        if problem.dtype not in ("float64", "float32"):
            return False, f"unsupported: dense runs float64 and float32, not {problem.dtype}"
        return self.supports_device(problem.device)

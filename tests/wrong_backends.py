"""Backends that are wrong on purpose, by a little: the verification must catch each of them.

Each is the numpy backend with one deliberate error in what it computes:

- ``wrong:scaled``: the gradient (and so the update) of one tensor is 1.01 times the right one;
- ``wrong:nobias``: the recurrent bias gets no gradient (it never moves); on a model without
  biases, the output weights ``W_hy`` instead;
- ``wrong:window``: truncated BPTT with a window one step shorter than the model asks for
  (``full`` becomes ``truncated: T - 2``), or ``truncated: window_k`` when that is set.

Registered through HARNESS_BACKENDS like tests/fake_backends.py, so workers load them too.
"""

from dataclasses import replace

import numpy as np

from backends.numpy_backend import NumpyBackend
from harness.spec.model import Bptt

SCALE = 1.01


class WrongBackend(NumpyBackend):
    """The numpy backend with one error, named by the variant."""

    name = "wrong"
    variants = ("scaled", "nobias", "window")
    scaled_tensor = "W_hh"
    window_k = None  # the wrong window's K; None: one step shorter than the model's

    def _bias(self) -> str:
        if not self.problem.model.bias:
            return "W_hy"
        return "b_h" if self.problem.model.kind == "elman" else "b"

    def prepare(self, problem, params, device="cpu", threads=1):
        inner = problem
        if self.variant == "window":
            bptt = problem.model.bptt
            k = bptt.k - 1 if bptt.mode == "truncated" else problem.seq_len - 2
            k = k if self.window_k is None else self.window_k
            inner = replace(problem, model=replace(problem.model, bptt=Bptt("truncated", k)))
        super().prepare(inner, params, device, threads)
        self.problem = problem

    def loss_and_grads(self, x, y):
        loss, grads = super().loss_and_grads(x, y)
        if self.variant == "scaled":
            grads[self.scaled_tensor] = grads[self.scaled_tensor] * SCALE
        elif self.variant == "nobias":
            grads[self._bias()] = np.zeros_like(grads[self._bias()])
        return loss, grads

    def sgd_step(self, x, y, lr):
        params = self._impl.params  # updated in place by the step
        before = {k: v.copy() for k, v in params.items()}
        loss = super().sgd_step(x, y, lr)
        if self.variant == "scaled":
            k = self.scaled_tensor
            params[k][...] = before[k] + SCALE * (params[k] - before[k])
        elif self.variant == "nobias":
            params[self._bias()][...] = before[self._bias()]
        return loss

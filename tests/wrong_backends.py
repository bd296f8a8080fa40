"""Backends that are wrong on purpose, by a little: the verification must catch each of them.

Each is the numpy backend with one deliberate error in what it computes:

- ``wrong:scaled``: the gradient (and so the update) of one tensor is 1.01 times the right one
  (``factor``: 1.05 for the mixed-precision checks);
- ``wrong:nobias``: the recurrent bias gets no gradient (it never moves); on a model without
  biases, the output weights ``W_hy`` instead;
- ``wrong:window``: truncated BPTT with a window one step shorter than the model asks for
  (``full`` becomes ``truncated: T - 2``), or ``truncated: window_k`` when that is set;

- ``wrong:nodtype`` (bfloat16, float16): ignores the dtype and computes in float32, without the
  products' roundings;
- ``wrong:lossscale`` (float16): the loss scale divided out of the gradients is the default 1024
  whatever ``train.loss_scale`` says, so every gradient (and update) is ``loss_scale / 1024`` times
  the right one;

and, for the GRU:

- ``wrong:gateorder``: reads the gate blocks in the order z, r, n instead of r, z, n;
- ``wrong:nobhn``: leaves out the recurrent bias ``b_hn`` (as if it were zero; it never moves);
- ``wrong:resetform``: applies the reset in the other form (before the recurrent product where the
  model asks for after, and the other way round; ``b_hn`` then is zero or ignored).

Registered through HARNESS_BACKENDS like tests/fake_backends.py, so workers load them too.
"""

from dataclasses import replace

import numpy as np

from backends.numpy_backend import NumpyBackend
from harness.spec.model import DEFAULT_LOSS_SCALE, Bptt, Problem

SCALE = 1.01


class WrongBackend(NumpyBackend):
    """The numpy backend with one error, named by the variant."""

    name = "wrong"
    variants = ("scaled", "nobias", "window", "gateorder", "nobhn", "resetform", "lossscale", "nodtype")
    scaled_tensor = "W_hh"
    factor = SCALE  # wrong:scaled's gradient factor
    window_k = None  # the wrong window's K; None: one step shorter than the model's

    def _bias(self) -> str:
        if not self.problem.model.bias:
            return "W_hy"
        return "b_h" if self.problem.model.kind == "elman" else "b"

    def supports(self, problem: Problem):
        if self.variant in ("gateorder", "nobhn", "resetform") and problem.model.kind != "gru":
            return False, "unsupported: a GRU error"
        if self.variant == "nobhn" and "b_hn" not in problem.model.param_names():
            return False, "unsupported: the model has no b_hn"
        if self.variant == "lossscale" and problem.dtype != "float16":
            return False, "unsupported: a loss-scale error (float16 only)"
        if self.variant == "nodtype" and not problem.reduced:
            return False, "unsupported: a mixed-precision error"
        return super(WrongBackend, self).supports(problem)

    def _swap(self, params: dict) -> dict:
        """The gate blocks r and z swapped in every gate-wide tensor (its own inverse)."""
        H = self.problem.model.hidden
        out = dict(params)
        for k, v in params.items():
            if v.shape[-1] == 3 * H and not k.startswith("W_hy") and k != "b_y":
                out[k] = np.concatenate([v[..., H : 2 * H], v[..., :H], v[..., 2 * H :]], axis=-1)
        return out

    def prepare(self, problem, params, device="cpu", threads=1):
        inner, self.problem, self._kept = problem, problem, {}
        if self.variant == "window":
            bptt = problem.model.bptt
            k = bptt.k - 1 if bptt.mode == "truncated" else problem.seq_len - 2
            k = k if self.window_k is None else self.window_k
            inner = replace(problem, model=replace(problem.model, bptt=Bptt("truncated", k)))
        elif self.variant == "gateorder":
            params = self._swap(params)
        elif self.variant == "nobhn":  # b_hn held at zero inside, reported as given
            self._kept = {k: np.array(v) for k, v in params.items() if k.startswith("b_hn")}
            params = {k: (np.zeros_like(v) if k in self._kept else v) for k, v in params.items()}
        elif self.variant == "nodtype":
            inner = replace(problem, dtype="float32", loss_scale=None)
        elif self.variant == "resetform":
            inner = replace(problem, model=replace(problem.model, reset_after=not problem.model.reset_after))
            names = inner.model.param_names()
            self._kept = {k: np.array(v) for k, v in params.items() if k not in names}
            H = problem.model.hidden
            params = {k: params.get(k, np.zeros(H, np.asarray(params["W_hy"]).dtype)) for k in names}
        super().prepare(inner, params, device, threads)
        self.problem = problem

    def _outer(self, tensors: dict, fill) -> dict:
        """Inner tensors as the problem names them: swapped back, kept ones filled in, extra ones dropped."""
        if self.variant == "gateorder":
            return self._swap(tensors)
        if self.variant in ("nobhn", "resetform"):
            out = {k: tensors[k] for k in tensors if k in self.problem.model.param_names()}
            out.update({k: fill(v) for k, v in self._kept.items()})
            return {k: out[k] for k in self.problem.model.param_names()}
        return tensors

    def loss_and_grads(self, x, y):
        loss, grads = super().loss_and_grads(x, y)
        grads = self._outer(grads, np.zeros_like)
        if self.variant == "scaled":
            grads[self.scaled_tensor] = grads[self.scaled_tensor] * self.factor
        elif self.variant == "lossscale":
            grads = {k: g * self._lossscale_factor() for k, g in grads.items()}
        elif self.variant == "nobias":
            grads[self._bias()] = np.zeros_like(grads[self._bias()])
        return loss, grads

    def sgd_step(self, x, y, lr):
        params = self._impl.params  # updated in place by the step
        before = {k: v.copy() for k, v in params.items()}
        loss = super().sgd_step(x, y, lr)
        if self.variant == "scaled":
            k = self.scaled_tensor
            params[k][...] = before[k] + self.factor * (params[k] - before[k])
        elif self.variant == "lossscale":
            for k in params:
                params[k][...] = before[k] + self._lossscale_factor() * (params[k] - before[k])
        elif self.variant in ("nobias", "nobhn"):
            for k in ([self._bias()] if self.variant == "nobias" else self._kept):
                params[k][...] = before[k]
        return loss

    def get_params(self):
        return self._outer(super().get_params(), np.copy)

    def _lossscale_factor(self) -> float:
        return self.problem.objective_scale / DEFAULT_LOSS_SCALE

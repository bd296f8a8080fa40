"""A single-layer Elman RNN in plain NumPy with full BPTT: the smallest complete backend.

It implements the part of the spec it was written for and says ``unsupported: <why>`` for the
rest (LSTM and GRU cells, stacked layers, truncated gradients), which the harness reports as such.
It declares none of ``knows`` (the GRU, bidirectional layers, mixed precision): the harness refuses
those problems for it with the reason.
"""

from __future__ import annotations

import numpy as np

from backends.base import Backend, unsupported


def _act(name, a):
    if name == "tanh":
        return np.tanh(a)
    if name == "relu":
        return np.maximum(a, 0)
    return 1 / (1 + np.exp(-a))


def _act_grad(name, h):
    """d act / d a in terms of the output ``h``."""
    if name == "tanh":
        return 1 - h * h
    if name == "relu":
        return (h > 0).astype(h.dtype)
    return h * (1 - h)


class ExampleElmanBackend(Backend):
    """Elman RNN, one layer, full BPTT, both heads, token or dense input, float32 or float64."""

    name = "example"  # must equal the entry point's name

    def supports(self, problem):
        ok, why = self.supports_device(problem.device)
        if not ok:
            return ok, why
        m = problem.model
        if m.kind != "elman":
            return unsupported(f"{self.name} implements the elman cell only, not {m.kind}")
        if m.layers != 1:
            return unsupported(f"{self.name} has one recurrent layer, not {m.layers}")
        if m.bptt.mode != "full":
            return unsupported(f"{self.name} computes full BPTT only, not {m.bptt}")
        return True, ""

    def prepare(self, problem, params, device="cpu", threads=1):
        self.problem = problem
        self.params = {k: np.array(v, dtype=problem.dtype) for k, v in params.items()}

    # -- the network ----------------------------------------------------------------
    def _forward(self, x):
        m, p = self.problem.model, self.params
        T, B = x.shape[:2]
        h = np.zeros((T + 1, B, m.hidden), p["W_hh"].dtype)
        for t in range(T):
            a = (p["W_xh"][x[t]] if self.problem.tokens else x[t] @ p["W_xh"]) + h[t] @ p["W_hh"]
            h[t + 1] = _act(m.activation, a + p["b_h"] if m.bias else a)
        z = h[1:] @ p["W_hy"] + (p["b_y"] if m.bias else 0)
        return h, z

    def _head(self, z):
        """Outputs: softmax probabilities, or the mse head's (activated) output."""
        m = self.problem.model
        if m.head == "softmax_xent":
            e = np.exp(z - z.max(axis=-1, keepdims=True))
            return e / e.sum(axis=-1, keepdims=True)
        return np.tanh(z) if m.output_act == "tanh" else z

    def forward(self, x):
        return self._head(self._forward(np.asarray(x))[1])

    def loss_and_grads(self, x, y):
        m, p = self.problem.model, self.params
        x, y = np.asarray(x), np.asarray(y)
        T, B = x.shape[:2]
        h, z = self._forward(x)
        out = self._head(z)
        if m.head == "softmax_xent":
            picked = out[np.arange(T)[:, None], np.arange(B)[None, :], y]
            total = -np.log(picked).sum()
            dz = out.copy()
            dz[np.arange(T)[:, None], np.arange(B)[None, :], y] -= 1
        else:
            diff = out - y
            total = 0.5 * (diff * diff).sum()
            dz = diff * (1 - out * out) if m.output_act == "tanh" else diff
        dz /= B  # the objective sums over time and averages over the batch
        grads = {"W_hy": np.einsum("tbh,tbo->ho", h[1:], dz), "W_xh": np.zeros_like(p["W_xh"]),
                 "W_hh": np.zeros_like(p["W_hh"])}
        db = np.zeros(m.hidden, p["W_hh"].dtype)
        dh_next = np.zeros((B, m.hidden), p["W_hh"].dtype)
        for t in reversed(range(T)):
            da = (dz[t] @ p["W_hy"].T + dh_next) * _act_grad(m.activation, h[t + 1])
            grads["W_hh"] += h[t].T @ da
            if self.problem.tokens:
                np.add.at(grads["W_xh"], x[t], da)
            else:
                grads["W_xh"] += x[t].T @ da
            db += da.sum(axis=0)
            dh_next = da @ p["W_hh"].T
        if m.bias:
            grads["b_h"], grads["b_y"] = db, dz.sum(axis=(0, 1))
        return float(total / (B * T)), grads

    def sgd_step(self, x, y, lr):
        loss, grads = self.loss_and_grads(x, y)
        clip = self.problem.model.clip
        for k, g in grads.items():
            self.params[k] -= lr * (np.clip(g, -clip, clip) if clip else g)
        return loss

    def get_params(self):
        return {k: v.copy() for k, v in self.params.items()}

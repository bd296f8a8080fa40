"""The NumPy oracle: SPEC.md written out as plainly as possible.

Every backend is judged against this file, so it favours obviousness over
speed: one step at a time, one layer at a time, shapes stated once.

Shapes (time-major, row vectors)::

    x  (T, B) int token ids   or  (T, B, D) floats
    y  (T, B) int class ids   or  (T, B, O) floats
    h, c  (B, H)              z  (T, B, O) logits / pre-activations

Parameters, per layer ``l`` (suffix ``_l`` past the first layer)::

    elman  W_xh (D, H)  W_hh (H, H)   b_h (H)
    lstm   W_ih (D, 4H) W_hh (H, 4H)  b (4H)   [p_i, p_f, p_o (H)]
    head   W_hy (H, O)  b_y (O)

Gradients are of the objective ``L = (1/B) sum_{b,t} l(b,t)``; the loss returned is
the reported one, ``sum l / (B*T)``.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from harness.spec.model import ModelSpec

__all__ = ["init_params", "forward", "outputs", "head", "loss_and_grads", "sgd_update", "sgd_step", "as_model"]


def as_model(model: Any) -> ModelSpec:
    """Accept a :class:`ModelSpec` or the mapping a config's ``model:`` section holds."""
    return model if isinstance(model, ModelSpec) else ModelSpec.from_mapping(model)


def _sfx(layer: int) -> str:
    return "" if layer == 0 else f"_{layer}"


def init_params(model, input_size: int, output_size: int, seed: int, dtype="float64") -> dict[str, np.ndarray]:
    """Initial parameters: drawn in float64 from ``default_rng(seed)`` in canonical order, then cast."""
    spec = as_model(model)
    rng = np.random.default_rng(seed)
    H = spec.hidden
    p: dict[str, np.ndarray] = {}

    def uniform(fan: int, shape) -> np.ndarray:
        bound = 1.0 / np.sqrt(fan)
        return rng.uniform(-bound, bound, size=shape)

    for layer in range(spec.layers):
        s, din = _sfx(layer), (input_size if layer == 0 else H)
        if spec.kind == "elman":
            p["W_xh" + s] = uniform(din, (din, H))
            p["W_hh" + s] = uniform(H, (H, H))
            if spec.bias:
                p["b_h" + s] = np.zeros(H)
        else:
            p["W_ih" + s] = uniform(H, (din, 4 * H))
            p["W_hh" + s] = uniform(H, (H, 4 * H))
            if spec.bias:
                p["b" + s] = np.zeros(4 * H)
            if spec.peephole:
                for gate in ("p_i", "p_f", "p_o"):
                    p[gate + s] = np.zeros(H)
    p["W_hy"] = uniform(H, (H, output_size))
    if spec.bias:
        p["b_y"] = np.zeros(output_size)
    assert list(p) == spec.param_names()
    return {k: v.astype(dtype) for k, v in p.items()}


def _sigmoid(a):
    return 1.0 / (1.0 + np.exp(-a))


def _act(name: str, a):
    if name == "tanh":
        return np.tanh(a)
    if name == "relu":
        return np.maximum(a, 0)
    return _sigmoid(a)


def _act_grad(name: str, h):
    """d act / d a, written in terms of the output ``h = act(a)``."""
    if name == "tanh":
        return 1 - h * h
    if name == "relu":
        return (h > 0).astype(h.dtype)
    return h * (1 - h)


def _project(W, x_t):
    """``x_t W``: a row gather for token ids, a product for dense rows."""
    return W[x_t] if x_t.dtype.kind in "iu" else x_t @ W


def forward(model, params, x, state=None):
    """Run the network over ``x``; returns ``(z, cache)``.

    ``state`` optionally gives each layer's starting ``h`` (and ``c``) as a list of
    ``(h, c)`` pairs; the default is zeros. ``cache["layers"][l]`` holds ``inp`` (the
    layer's input), ``h`` and ``c`` of shape (T+1, B, H) with index 0 the starting
    state, and for the LSTM the gate activations ``i, f, g, o`` of shape (T, B, H).
    """
    spec, p = as_model(model), params
    T, B = x.shape[:2]
    H = spec.hidden
    dtype = p["W_hy"].dtype
    inp = x
    layers = []
    for layer in range(spec.layers):
        s = _sfx(layer)
        h = np.zeros((T + 1, B, H), dtype)
        c = np.zeros((T + 1, B, H), dtype)
        if state is not None:
            h[0], c[0] = state[layer]
        cache = {"inp": inp, "h": h, "c": c}
        if spec.kind == "elman":
            b = p.get("b_h" + s, 0)
            for t in range(T):
                h[t + 1] = _act(spec.activation, _project(p["W_xh" + s], inp[t]) + h[t] @ p["W_hh" + s] + b)
        else:
            b = p.get("b" + s, 0)
            gates = {k: np.zeros((T, B, H), dtype) for k in "ifgo"}
            zero = np.zeros(H, dtype)
            pi, pf, po = (p.get(k + s, zero) for k in ("p_i", "p_f", "p_o"))
            for t in range(T):
                a = _project(p["W_ih" + s], inp[t]) + h[t] @ p["W_hh" + s] + b
                ai, af, ag, ao = np.split(a, 4, axis=-1)  # gate order i, f, g, o
                i = _sigmoid(ai + pi * c[t])
                f = _sigmoid(af + pf * c[t])
                g = np.tanh(ag)
                c[t + 1] = f * c[t] + i * g
                o = _sigmoid(ao + po * c[t + 1])
                h[t + 1] = o * np.tanh(c[t + 1])
                for k, v in zip("ifgo", (i, f, g, o)):
                    gates[k][t] = v
            cache.update(gates)
        layers.append(cache)
        inp = h[1:]
    z = inp @ p["W_hy"] + p.get("b_y", 0)
    return z, {"layers": layers}


def outputs(model, params, x):
    """What inference returns: softmax probabilities, or ``z`` / ``tanh(z)`` for the mse head."""
    spec = as_model(model)
    z, _ = forward(spec, params, x)
    if spec.head == "softmax_xent":
        e = np.exp(z - z.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    return np.tanh(z) if spec.output_act == "tanh" else z


def head(model, z, y):
    """Per-element loss ``l`` (T, B) and ``dL/dz`` (T, B, O) for the objective ``L = sum l / B``."""
    spec = as_model(model)
    B = z.shape[1]
    if spec.head == "softmax_xent":
        m = z.max(axis=-1, keepdims=True)
        lse = m + np.log(np.exp(z - m).sum(axis=-1, keepdims=True))
        l = lse[..., 0] - np.take_along_axis(z, y[..., None], axis=-1)[..., 0]
        dz = np.exp(z - lse)
        np.put_along_axis(dz, y[..., None], np.take_along_axis(dz, y[..., None], axis=-1) - 1, axis=-1)
        return l, dz / B
    out = np.tanh(z) if spec.output_act == "tanh" else z
    diff = out - y
    l = 0.5 * (diff * diff).sum(axis=-1)
    dz = diff / B
    if spec.output_act == "tanh":
        dz = dz * (1 - out * out)
    return l, dz


def _elman_backward(spec, p, s, cache, dh_out, t0, t1, grads, want_dx):
    """Backprop through steps t1..t0 of one Elman layer; ``h[t0]`` (= h_{t0-1}) is held constant."""
    x, h = cache["inp"], cache["h"]
    W_xh, W_hh = p["W_xh" + s], p["W_hh" + s]
    dx = np.zeros(x.shape[:2] + (W_xh.shape[0],), h.dtype) if want_dx else None
    dh_next = np.zeros_like(h[0])
    for t in range(t1, t0 - 1, -1):
        da = (dh_out[t] + dh_next) * _act_grad(spec.activation, h[t + 1])
        if x.dtype.kind in "iu":
            np.add.at(grads["W_xh" + s], x[t], da)
        else:
            grads["W_xh" + s] += x[t].T @ da
        grads["W_hh" + s] += h[t].T @ da
        if spec.bias:
            grads["b_h" + s] += da.sum(axis=0)
        dh_next = da @ W_hh.T
        if want_dx:
            dx[t] = da @ W_xh.T
    return dx


def _lstm_backward(spec, p, s, cache, dh_out, t0, t1, grads, want_dx):
    """Backprop through steps t1..t0 of one LSTM layer; ``h[t0]``, ``c[t0]`` are held constant."""
    x, h, c = cache["inp"], cache["h"], cache["c"]
    W_ih, W_hh = p["W_ih" + s], p["W_hh" + s]
    H = h.shape[-1]
    zero = np.zeros(H, h.dtype)
    pi, pf, po = (p.get(k + s, zero) for k in ("p_i", "p_f", "p_o"))
    dx = np.zeros(x.shape[:2] + (W_ih.shape[0],), h.dtype) if want_dx else None
    dh_next = np.zeros_like(h[0])
    dc_next = np.zeros_like(c[0])
    for t in range(t1, t0 - 1, -1):
        i, f, g, o = (cache[k][t] for k in "ifgo")
        c_prev, c_t = c[t], c[t + 1]
        tc = np.tanh(c_t)
        dh = dh_out[t] + dh_next
        dao = dh * tc * o * (1 - o)
        dc = dc_next + dh * o * (1 - tc * tc) + dao * po
        dai = dc * g * i * (1 - i)
        daf = dc * c_prev * f * (1 - f)
        dag = dc * i * (1 - g * g)
        da = np.concatenate([dai, daf, dag, dao], axis=-1)
        if x.dtype.kind in "iu":
            np.add.at(grads["W_ih" + s], x[t], da)
        else:
            grads["W_ih" + s] += x[t].T @ da
        grads["W_hh" + s] += h[t].T @ da
        if spec.bias:
            grads["b" + s] += da.sum(axis=0)
        if spec.peephole:
            grads["p_i" + s] += (dai * c_prev).sum(axis=0)
            grads["p_f" + s] += (daf * c_prev).sum(axis=0)
            grads["p_o" + s] += (dao * c_t).sum(axis=0)
        dh_next = da @ W_hh.T
        dc_next = dc * f + dai * pi + daf * pf
        if want_dx:
            dx[t] = da @ W_ih.T
    return dx


def _backward_window(spec, p, cache, dh_top, t0, t1, grads):
    """Backprop ``dh_top`` (gradient w.r.t. the top layer's h_t) through steps t1..t0 of every layer.

    Layer l-1 feeds layer l only at the same step, so whole layers can be done top-down.
    """
    layer_backward = _elman_backward if spec.kind == "elman" else _lstm_backward
    dh = dh_top
    for layer in reversed(range(spec.layers)):
        dh = layer_backward(spec, p, _sfx(layer), cache["layers"][layer], dh, t0, t1, grads, want_dx=layer > 0)


def loss_and_grads(model, params, x, y):
    """Reported loss and the gradients of the objective, honouring ``bptt`` (SPEC.md)."""
    spec, p = as_model(model), params
    T, B = x.shape[:2]
    z, cache = forward(spec, p, x)
    l, dz = head(spec, z, y)
    loss = float(l.sum() / (B * T))
    grads = {k: np.zeros_like(v) for k, v in p.items()}
    mode, K = spec.bptt.mode, spec.bptt.k
    if mode == "tail":  # only the last K steps contribute, the output layer included
        dz[: max(0, T - K)] = 0
    h_top = cache["layers"][-1]["h"][1:]
    grads["W_hy"] += np.einsum("tbh,tbo->ho", h_top, dz)
    if spec.bias:
        grads["b_y"] += dz.sum(axis=(0, 1))
    dh_top = dz @ p["W_hy"].T
    if mode == "full":
        _backward_window(spec, p, cache, dh_top, 0, T - 1, grads)
    elif mode == "tail":
        _backward_window(spec, p, cache, dh_top, max(0, T - K), T - 1, grads)
    else:  # truncated: output t reaches back through steps t, t-1, ..., t-K only
        for t in range(T):
            only_t = np.zeros_like(dh_top)
            only_t[t] = dh_top[t]
            _backward_window(spec, p, cache, only_t, max(0, t - K), t, grads)
    return loss, grads


def sgd_update(params, grads, lr: float, clip: float | None = None) -> dict[str, np.ndarray]:
    """Plain SGD, ``p - lr * g``, with every gradient element clipped to [-clip, clip] first."""
    out = {}
    for k, v in params.items():
        g = grads[k] if clip is None else np.clip(grads[k], -clip, clip)
        out[k] = (v - np.asarray(lr, v.dtype) * g).astype(v.dtype)
    return out


def sgd_step(model, params, x, y, lr: float):
    """One training step: ``(loss before the update, updated parameters)``."""
    spec = as_model(model)
    loss, grads = loss_and_grads(spec, params, x, y)
    return loss, sgd_update(params, grads, lr, spec.clip)


def params_like(params: Mapping[str, np.ndarray], dtype) -> dict[str, np.ndarray]:
    """A copy of ``params`` cast to ``dtype``."""
    return {k: np.asarray(v).astype(dtype) for k, v in params.items()}

"""The NumPy oracle: SPEC.md written out as plainly as possible.

Every backend is judged against this file, so it favours obviousness over
speed: one step at a time, one layer at a time, shapes stated once.

Shapes (time-major, row vectors)::

    x  (T, B) int token ids   or  (T, B, D) floats
    y  (T, B) int class ids   or  (T, B, O) floats
    h, c  (B, H)              z  (T, B, O) logits / pre-activations

Parameters, per layer ``l`` (suffix ``_l`` past the first layer) and direction
(suffix ``_rev`` after it for the reverse one of a bidirectional layer); ``D`` is
``2H`` above the first layer of a bidirectional network, as are ``W_hy``'s rows::

    elman  W_xh (D, H)  W_hh (H, H)   b_h (H)
    lstm   W_ih (D, 4H) W_hh (H, 4H)  b (4H)   [p_i, p_f, p_o (H)]     gates i, f, g, o
    gru    W_ih (D, 3H) W_hh (H, 3H)  b (3H)   [b_hn (H), reset after] gates r, z, n
    head   W_hy (H, O)  b_y (O)

A reverse direction is the same cell run over the time-reversed input; its outputs
are reversed back and concatenated to the forward ones, ``[h_t, h_t_rev]`` (B, 2H).

Gradients are of the objective ``L = (1/B) sum_{b,t} l(b,t)``; the loss returned is
the reported one, ``sum l / (B*T)``.

Every matrix product goes through ``mm`` of a :class:`Precision`: a plain product in
float64 or float32, and under mixed precision (``bfloat16``, ``float16``) the product of
the inputs rounded to that type, summed in float32 (exact products: two 8- or 11-bit
significands fit float32's 24), while gathers, sums, element-wise maths, the state, the
head and the loss stay float32. ``float16`` scales the objective by the loss scale before
the backward pass and divides the gradients by it after.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from harness.spec.dtype import DType
from harness.spec.model import ModelSpec, layer_suffix, master_dtype, objective_scale

__all__ = ["init_params", "forward", "outputs", "head", "loss_and_grads", "sgd_update", "sgd_step", "as_model",
           "Precision", "EXACT"]


def round_to(a, dtype: str) -> np.ndarray:
    """``a`` rounded to ``dtype`` (nearest, ties to even) and held in float32 again; beyond the type's
    range it is infinite (a float16 overflow, which makes the step's gradient non-finite)."""
    if dtype == DType.BFLOAT16:  # the one NumPy lacks
        import ml_dtypes  # only mixed precision needs it; workers of other dtypes never import it

        low = ml_dtypes.bfloat16
    else:
        low = np.dtype(dtype)
    with np.errstate(over="ignore"):
        return np.asarray(a, np.float32).astype(low).astype(np.float32)


@dataclass(frozen=True)
class Precision:
    """Where a step rounds. ``gemm``: the type every matrix product's inputs (activations, weights and
    gradients alike) are rounded to, the products summed in float32; None: plain products in the
    arrays' own dtype. ``loss_scale``: multiplies the objective before the backward pass; the
    gradients are divided by it before clipping and the update."""

    gemm: str | None = None
    loss_scale: float = 1.0
    # not the spec's: each product's result rounded to ``gemm`` as well, as autocast and libraries whose
    # products write the low type do; the verification reads it to see where such roundings move a result
    outputs: bool = False

    @classmethod
    def of(cls, dtype: str, loss_scale: float | None = None, outputs: bool = False) -> "Precision":
        """The roundings of a step in ``dtype`` (SPEC.md): none for float32 and float64; ``outputs`` adds
        the rounding of every product's result (not the spec's: see the field)."""
        if not DType.of(dtype).reduced:
            return EXACT
        return cls(dtype, objective_scale(dtype, loss_scale), outputs)

    @property
    def reduced(self) -> bool:
        return self.gemm is not None

    def mm(self, a, b):
        """``a @ b``; under mixed precision of the inputs rounded to ``gemm``, accumulated in float32."""
        if self.gemm is None:
            return a @ b
        with np.errstate(invalid="ignore"):  # inf * 0 after an overflow: the gradient is non-finite anyway
            product = round_to(a, self.gemm) @ round_to(b, self.gemm)
        return round_to(product, self.gemm) if self.outputs else product


EXACT = Precision()


def _arrays(params, precision: Precision) -> dict[str, np.ndarray]:
    """The parameters as the step reads them: float32 masters under mixed precision, else as given."""
    return params_like(params, np.float32) if precision.reduced else dict(params)


def as_model(model: Any) -> ModelSpec:
    """Accept a :class:`ModelSpec` or the mapping a config's ``model:`` section holds."""
    return model if isinstance(model, ModelSpec) else ModelSpec.from_mapping(model)


def _sfx(layer: int, direction: int = 0) -> str:
    return layer_suffix(layer, direction)


def init_params(model, input_size: int, output_size: int, seed: int, dtype="float64") -> dict[str, np.ndarray]:
    """Initial parameters: drawn in float64 from ``default_rng(seed)`` in canonical order, then cast (to
    float32 for bfloat16 and float16: the master copy)."""
    spec = as_model(model)
    rng = np.random.default_rng(seed)
    H = spec.hidden
    p: dict[str, np.ndarray] = {}

    def uniform(fan: int, shape) -> np.ndarray:
        bound = 1.0 / np.sqrt(fan)
        return rng.uniform(-bound, bound, size=shape)

    for name, shape in spec.param_shapes(input_size, output_size).items():
        if len(shape) == 1:  # biases and peepholes
            p[name] = np.zeros(shape)
        elif spec.kind == "elman" and name != "W_hy" and not name.startswith("W_hh"):
            p[name] = uniform(shape[0], shape)  # W_xh: U(+-1/sqrt(its input width))
        else:
            p[name] = uniform(H, shape)
    assert list(p) == spec.param_names()
    return {k: v.astype(master_dtype(dtype)) for k, v in p.items()}


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


def _project(mm, W, x_t):
    """``x_t W``: a row gather for token ids (no product, so no rounding), a product for dense rows."""
    return W[x_t] if x_t.dtype.kind in "iu" else mm(x_t, W)


def _elman_forward(spec, p, s, x, h, mm):
    """Fill ``h[1:]`` (T, B, H) from ``h[0]``; returns the gate cache (none for Elman)."""
    b = p.get("b_h" + s, 0)
    for t in range(x.shape[0]):
        h[t + 1] = _act(spec.activation, _project(mm, p["W_xh" + s], x[t]) + mm(h[t], p["W_hh" + s]) + b)
    return {}


def _lstm_forward(spec, p, s, x, h, c, mm):
    """Fill ``h[1:]``, ``c[1:]`` from ``h[0]``, ``c[0]``; returns the gates ``i, f, g, o`` (T, B, H)."""
    T, B, H = x.shape[0], h.shape[1], h.shape[2]
    b = p.get("b" + s, 0)
    gates = {k: np.zeros((T, B, H), h.dtype) for k in "ifgo"}
    zero = np.zeros(H, h.dtype)
    pi, pf, po = (p.get(k + s, zero) for k in ("p_i", "p_f", "p_o"))
    for t in range(T):
        a = _project(mm, p["W_ih" + s], x[t]) + mm(h[t], p["W_hh" + s]) + b
        ai, af, ag, ao = np.split(a, 4, axis=-1)  # gate order i, f, g, o
        i = _sigmoid(ai + pi * c[t])
        f = _sigmoid(af + pf * c[t])
        g = np.tanh(ag)
        c[t + 1] = f * c[t] + i * g
        o = _sigmoid(ao + po * c[t + 1])
        h[t + 1] = o * np.tanh(c[t + 1])
        for k, v in zip("ifgo", (i, f, g, o)):
            gates[k][t] = v
    return gates


def _gru_forward(spec, p, s, x, h, mm):
    """Fill ``h[1:]`` from ``h[0]``; returns the gates ``r, z, n`` and ``un`` (T, B, H).

    ``a = x_t W_ih + b`` and ``u = h_{t-1} W_hh`` split in gate order r, z, n;
    ``r = sigmoid(a_r + u_r)``, ``z = sigmoid(a_z + u_z)``, and with ``W_hn = W_hh[:, 2H:]``
    reset after (the default): ``n = tanh(a_n + r * un)``, ``un = u_n + b_hn = h_{t-1} W_hn + b_hn``;
    reset before (Cho et al.): ``n = tanh(a_n + (r * h_{t-1}) W_hn)`` (``un`` unused, zero);
    ``h_t = (1 - z) * n + z * h_{t-1}``.
    """
    T, B, H = x.shape[0], h.shape[1], h.shape[2]
    b, b_hn, W_hh = p.get("b" + s, 0), p.get("b_hn" + s, 0), p["W_hh" + s]
    W_hrz, W_hn = W_hh[:, : 2 * H], W_hh[:, 2 * H :]
    gates = {k: np.zeros((T, B, H), h.dtype) for k in ("r", "z", "n", "un")}
    for t in range(T):
        a_r, a_z, a_n = np.split(_project(mm, p["W_ih" + s], x[t]) + b, 3, axis=-1)  # gate order r, z, n
        u_r, u_z = np.split(mm(h[t], W_hrz), 2, axis=-1)
        r = _sigmoid(a_r + u_r)
        z = _sigmoid(a_z + u_z)
        if spec.reset_after:
            un = mm(h[t], W_hn) + b_hn
            n = np.tanh(a_n + r * un)
            gates["un"][t] = un
        else:
            n = np.tanh(a_n + mm(r * h[t], W_hn))
        h[t + 1] = (1 - z) * n + z * h[t]
        for k, v in zip("rzn", (r, z, n)):
            gates[k][t] = v
    return gates


def forward(model, params, x, state=None, precision: Precision = EXACT):
    """Run the network over ``x``; returns ``(z, cache)``.

    ``state`` optionally gives each layer's starting ``h`` (and ``c``) as a list of
    ``(h, c)`` pairs (forward direction); the default is zeros. ``cache["layers"][l][d]``
    is direction ``d`` of layer ``l``: ``inp`` (the input it reads, time-reversed for
    ``d = 1``), ``h`` and ``c`` of shape (T+1, B, H) in its own time order with index 0 the
    starting state, and the cell's gate activations of shape (T, B, H).
    """
    spec, p, mm = as_model(model), _arrays(params, precision), precision.mm
    T, B = x.shape[:2]
    H = spec.hidden
    dtype = p["W_hy"].dtype
    inp = x if x.dtype.kind in "iu" else x.astype(dtype, copy=False)
    layers = []
    for layer in range(spec.layers):
        dirs = []
        for d in range(spec.directions):
            s = _sfx(layer, d)
            h = np.zeros((T + 1, B, H), dtype)
            c = np.zeros((T + 1, B, H), dtype)
            if state is not None and d == 0:
                h[0], c[0] = state[layer]
            seq = inp if d == 0 else inp[::-1]
            if spec.kind == "elman":
                gates = _elman_forward(spec, p, s, seq, h, mm)
            elif spec.kind == "lstm":
                gates = _lstm_forward(spec, p, s, seq, h, c, mm)
            else:
                gates = _gru_forward(spec, p, s, seq, h, mm)
            dirs.append({"inp": seq, "h": h, "c": c, **gates})
        layers.append(dirs)
        # the layer's output at t: [h_t, h_t_rev] (the reverse run's step T-1-t)
        inp = np.concatenate([dirs[0]["h"][1:]] + [dd["h"][1:][::-1] for dd in dirs[1:]], axis=-1)
    z = mm(inp, p["W_hy"]) + p.get("b_y", 0)
    return z, {"layers": layers, "top": inp}


def outputs(model, params, x, precision: Precision = EXACT):
    """What inference returns: softmax probabilities, or ``z`` / ``tanh(z)`` for the mse head."""
    spec = as_model(model)
    z, _ = forward(spec, params, x, precision=precision)
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


def _elman_backward(spec, p, s, cache, dh_out, t0, t1, grads, want_dx, mm):
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
            grads["W_xh" + s] += mm(x[t].T, da)
        grads["W_hh" + s] += mm(h[t].T, da)
        if spec.bias:
            grads["b_h" + s] += da.sum(axis=0)
        dh_next = mm(da, W_hh.T)
        if want_dx:
            dx[t] = mm(da, W_xh.T)
    return dx


def _lstm_backward(spec, p, s, cache, dh_out, t0, t1, grads, want_dx, mm):
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
            grads["W_ih" + s] += mm(x[t].T, da)
        grads["W_hh" + s] += mm(h[t].T, da)
        if spec.bias:
            grads["b" + s] += da.sum(axis=0)
        if spec.peephole:
            grads["p_i" + s] += (dai * c_prev).sum(axis=0)
            grads["p_f" + s] += (daf * c_prev).sum(axis=0)
            grads["p_o" + s] += (dao * c_t).sum(axis=0)
        dh_next = mm(da, W_hh.T)
        dc_next = dc * f + dai * pi + daf * pf
        if want_dx:
            dx[t] = mm(da, W_ih.T)
    return dx


def _gru_backward(spec, p, s, cache, dh_out, t0, t1, grads, want_dx, mm):
    """Backprop through steps t1..t0 of one GRU layer; ``h[t0]`` is held constant.

    With ``dh`` the gradient reaching ``h_t``: ``h_{t-1}`` gets ``dh z`` directly,
    ``da_z = dh (h_{t-1} - n) z (1 - z)``, ``da_n = dh (1 - z) (1 - n^2)``; ``da_n`` reaches
    ``r`` and ``h_{t-1}`` through ``r * un`` (reset after) or ``(r * h_{t-1}) W_hn`` (reset before).
    """
    x, h = cache["inp"], cache["h"]
    W_ih, W_hh = p["W_ih" + s], p["W_hh" + s]
    H = h.shape[-1]
    W_hrz, W_hn = W_hh[:, : 2 * H], W_hh[:, 2 * H :]
    dW_hh = grads["W_hh" + s]
    dx = np.zeros(x.shape[:2] + (W_ih.shape[0],), h.dtype) if want_dx else None
    dh_next = np.zeros_like(h[0])
    for t in range(t1, t0 - 1, -1):
        r, z, n, un = (cache[k][t] for k in ("r", "z", "n", "un"))
        h_prev = h[t]
        dh = dh_out[t] + dh_next
        dan = dh * (1 - z) * (1 - n * n)
        daz = dh * (h_prev - n) * z * (1 - z)
        if spec.reset_after:
            dun = dan * r  # gradient of un = h_{t-1} W_hn + b_hn
            dar = dan * un * r * (1 - r)
            dW_hh[:, 2 * H :] += mm(h_prev.T, dun)
            if spec.bias:
                grads["b_hn" + s] += dun.sum(axis=0)
            dh_prev = mm(dun, W_hn.T)
        else:
            drh = mm(dan, W_hn.T)  # gradient of r * h_{t-1}
            dar = drh * h_prev * r * (1 - r)
            dW_hh[:, 2 * H :] += mm((r * h_prev).T, dan)
            dh_prev = drh * r
        drz = np.concatenate([dar, daz], axis=-1)
        dW_hh[:, : 2 * H] += mm(h_prev.T, drz)
        dh_next = dh * z + dh_prev + mm(drz, W_hrz.T)
        da = np.concatenate([dar, daz, dan], axis=-1)
        if x.dtype.kind in "iu":
            np.add.at(grads["W_ih" + s], x[t], da)
        else:
            grads["W_ih" + s] += mm(x[t].T, da)
        if spec.bias:
            grads["b" + s] += da.sum(axis=0)
        if want_dx:
            dx[t] = mm(da, W_ih.T)
    return dx


_BACKWARD = {"elman": _elman_backward, "lstm": _lstm_backward, "gru": _gru_backward}


def _backward_window(spec, p, cache, dh_top, t0, t1, grads, mm):
    """Backprop ``dh_top`` (gradient w.r.t. the top layer's output at each step, (T, B, dirs*H))
    through steps t1..t0 of every layer (a window other than the whole sequence: one direction only).

    Layer l-1 feeds layer l only at the same step, so whole layers can be done top-down; a
    reverse direction takes its slice of the gradient time-reversed and gives its input's back.
    """
    layer_backward = _BACKWARD[spec.kind]
    H, T = spec.hidden, dh_top.shape[0]
    dh = dh_top
    for layer in reversed(range(spec.layers)):
        dx = 0
        for d, dcache in enumerate(cache["layers"][layer]):
            dh_d = dh[..., d * H : (d + 1) * H]
            if d == 0:
                got = layer_backward(spec, p, _sfx(layer, d), dcache, dh_d, t0, t1, grads, layer > 0, mm)
            else:
                assert (t0, t1) == (0, T - 1), "a reverse direction is backpropagated over the whole sequence"
                got = layer_backward(spec, p, _sfx(layer, d), dcache, dh_d[::-1], t0, t1, grads, layer > 0, mm)
                got = got[::-1] if got is not None else None
            dx = dx + got if got is not None else None
        dh = dx


def loss_and_grads(model, params, x, y, precision: Precision = EXACT):
    """Reported loss and the gradients of the objective, honouring ``bptt`` (SPEC.md) and ``precision``'s
    roundings (its loss scale multiplies ``dL/dz`` and divides the gradients again)."""
    spec, p, mm = as_model(model), _arrays(params, precision), precision.mm
    T, B = x.shape[:2]
    z, cache = forward(spec, p, x, precision=precision)
    l, dz = head(spec, z, y)
    loss = float(l.sum() / (B * T))
    dz = dz * np.asarray(precision.loss_scale, dz.dtype) if precision.loss_scale != 1 else dz
    grads = {k: np.zeros_like(v) for k, v in p.items()}
    mode, K = spec.bptt.mode, spec.bptt.k
    if mode == "tail":  # only the last K steps contribute, the output layer included
        dz[: max(0, T - K)] = 0
    assert mode == "full" or not spec.bidirectional, "bidirectional layers need bptt full"
    h_top = cache["top"]
    grads["W_hy"] += mm(h_top.reshape(T * B, -1).T, dz.reshape(T * B, -1))
    if spec.bias:
        grads["b_y"] += dz.sum(axis=(0, 1))
    dh_top = mm(dz, p["W_hy"].T)
    if mode == "full":
        _backward_window(spec, p, cache, dh_top, 0, T - 1, grads, mm)
    elif mode == "tail":
        _backward_window(spec, p, cache, dh_top, max(0, T - K), T - 1, grads, mm)
    else:  # truncated: output t reaches back through steps t, t-1, ..., t-K only
        for t in range(T):
            only_t = np.zeros_like(dh_top)
            only_t[t] = dh_top[t]
            _backward_window(spec, p, cache, only_t, max(0, t - K), t, grads, mm)
    if precision.loss_scale != 1:
        grads = {k: g / np.asarray(precision.loss_scale, g.dtype) for k, g in grads.items()}
    return loss, grads


def sgd_update(params, grads, lr: float, clip: float | None = None) -> dict[str, np.ndarray]:
    """Plain SGD, ``p - lr * g``, with every gradient element clipped to [-clip, clip] first."""
    out = {}
    for k, v in params.items():
        g = grads[k] if clip is None else np.clip(grads[k], -clip, clip)
        out[k] = (v - np.asarray(lr, v.dtype) * g).astype(v.dtype)
    return out


def sgd_step(model, params, x, y, lr: float, precision: Precision = EXACT):
    """One training step: ``(loss before the update, updated parameters)``. Under mixed precision a
    non-finite gradient (a float16 overflow) makes the loss NaN: the cell is diverged."""
    spec = as_model(model)
    loss, grads = loss_and_grads(spec, params, x, y, precision)
    if precision.reduced and not all(np.isfinite(g).all() for g in grads.values()):
        loss = float("nan")
    return loss, sgd_update(_arrays(params, precision), grads, lr, spec.clip)


def params_like(params: Mapping[str, np.ndarray], dtype) -> dict[str, np.ndarray]:
    """A copy of ``params`` cast to ``dtype``."""
    return {k: np.asarray(v).astype(dtype) for k, v in params.items()}

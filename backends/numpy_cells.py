"""The ``numpy`` backend's cells: one layer's parameters and buffers, and its step maths per cell kind.

Each function runs one layer (one direction) over every step, in place in the layer's buffers
(:class:`Layer`): the forward recurrence from the projected inputs ``a`` (one recurrent GEMM a step,
two for the GRU before its reset), the backward sweep from ``dL/dh`` seeded from above (one GEMM a
step), and the weight gradients as single GEMMs over the sweep's steps. ``buf`` is the owner's
buffers for the batch shape (``T``, ``B``, the sweep's first step ``t0``, the open windows ``S``);
``mm`` is the problem's product (``np.matmul``, or its mixed-precision rounding).
"""

from __future__ import annotations

import numpy as np

from harness.spec.model import layer_suffix


def sigmoid_(a: np.ndarray) -> None:
    """In place ``1 / (1 + exp(-a))``, the reference's formula."""
    np.negative(a, out=a)
    np.exp(a, out=a)
    np.add(a, 1, out=a)
    np.reciprocal(a, out=a)


class Layer:
    """One recurrent layer's parameters (shared with the owner, updated in place) and buffers."""

    def __init__(self, spec, p: dict[str, np.ndarray], dtype, tokens: bool, layer: int, direction: int = 0):
        s = layer_suffix(layer, direction)
        self.index, self.direction = layer, direction
        self.hidden, self.activation = spec.hidden, spec.activation
        self.lstm, self.gru = spec.kind == "lstm", spec.kind == "gru"
        self.reset_after = self.gru and spec.reset_after
        self.in_name = spec.input_weight + s
        self.hh_name = "W_hh" + s
        self.b_name = (spec.bias_name + s) if spec.bias else None
        self.bhn_name = "b_hn" + s if self.reset_after and spec.bias else None
        self.peep_names = tuple(k + s for k in ("p_i", "p_f", "p_o")) if spec.peephole else None
        self.W_in, self.W_hh = p[self.in_name], p[self.hh_name]
        self.b = p[self.b_name] if self.b_name else None
        self.b_hn = p[self.bhn_name] if self.bhn_name else None
        if self.peep_names:
            self.p_i, self.p_f, self.p_o = (p[k] for k in self.peep_names)
            self.p_if = np.empty((2, spec.hidden), dtype)  # refreshed each call: p_i, p_f stacked
        self.sparse_input = layer == 0 and tokens
        self.single = not spec.bidirectional

    def allocate(self, T: int, B: int, S: int, H: int, top: bool, dtype) -> None:
        """Buffers for sequences of length T, batch B and S open truncation windows."""
        G = (4 if self.lstm else 3 if self.gru else 1) * H
        e = lambda *shape: np.empty(shape, dtype)  # noqa: E731
        self.a = e(T, B, G)  # pre-activations, then (LSTM) the gate activations i, f, ., o, (GRU) r, z, .
        self.h = np.zeros((T + 1, B, H), dtype)  # h[0] = h_{-1} = 0 is never written
        self.das = e(T, S, B, G)  # per-window dL/da (S = 1 unless truncated)
        self.das_rows = self.das.reshape(T, S * B, G)
        self.da = self.das[:, 0] if S == 1 else e(T, B, G)  # summed over windows
        self.dh = e(S, B, H)
        self.dh_rows = self.dh.reshape(S * B, H)
        # dL/dh from above: the output layer's (T, B, H), or the layer above's per-window (T, S, B, H).
        # With few rows, OpenBLAS computes W_hy dz^T (H x T*B) faster than dz W_hy^T,
        # so the top layer then keeps it transposed and reads it through a strided view.
        self.up_t = e(H, T * B) if top and T * B < H and self.single else None
        if self.up_t is not None:
            self.up = self.up_t.T.reshape(T, B, H)
        else:
            self.up = e(T, B, H) if top else e(T, S, B, H)
        if self.lstm:
            self.tmp_bh, self.tmp_sbh, self.tmp_tbh, self.tmp_b2h = e(B, H), e(S, B, H), e(T, B, H), e(B, 2, H)
            self.gates5 = self.a.reshape(T, B, 4, H)
            self.das5 = self.das.reshape(T, S, B, 4, H)
            self.c = np.zeros((T + 1, B, H), dtype)
            self.g = e(T, B, H)  # tanh of the g gate (its slot in ``a`` holds a discarded sigmoid)
            self.tc = e(T, B, H)  # tanh(c_t)
            self.rec = e(B, G)
            self.k_o = e(T, B, H)  # dL/da_o = dh * k_o
            self.k_c = e(T, B, H)  # dc += dh * k_c
            self.k_ifg = e(T, B, 3, H)  # (dL/da_i, dL/da_f, dL/da_g) = dc * k_ifg
            self.f_c = e(T, B, H) if self.peep_names else self.gates5[:, :, 1]  # dc_{t-1} = dc * f_c
            self.dc = e(S, B, H)
            self.dc_wide = self.dc[:, :, None, :]
        elif self.gru:
            self.gates4 = self.a.reshape(T, B, 3, H)
            self.das4 = self.das.reshape(T, S, B, 3, H)
            self.rec = e(B, G)
            self.n = e(T, B, H)
            self.un = e(T, B, H) if self.reset_after else None  # h_{t-1} W_hn + b_hn
            self.rh = np.zeros((T, B, H), dtype) if not self.reset_after else None  # r * h_{t-1}
            self.k_n, self.k_z, self.k_r = e(T, B, H), e(T, B, H), e(T, B, H)  # dL/da_n = dh k_n, ...
            self.du = e(S, B, G)  # the recurrent side's dL/du: (da_r, da_z, da_n r) after the reset
            self.du4 = self.du.reshape(S, B, 3, H)
            self.du_rows = self.du.reshape(S * B, G)
            self.tmp_sbh, self.tmp_tbh = e(S, B, H), e(T, B, H)
            self.tmp_rows = self.tmp_sbh.reshape(S * B, H)
            self.du_all = e(T, B, G)
        else:
            self.act_grad = e(T, B, H)


# -- forward -------------------------------------------------------------------------
def elman_forward(layer: Layer, a, mm) -> None:
    """``h_t = act(a_t + h_{t-1} W_hh)`` for every step, into ``layer.h[1:]``."""
    h, W_hh = layer.h, layer.W_hh
    act = layer.activation
    for t in range(a.shape[0]):
        ht = h[t + 1]
        if t:
            mm(h[t], W_hh, out=ht)
            np.add(ht, a[t], out=ht)
        else:
            np.copyto(ht, a[0])
        if act == "tanh":
            np.tanh(ht, out=ht)
        elif act == "relu":
            np.maximum(ht, 0, out=ht)
        else:
            sigmoid_(ht)


def gru_forward(layer: Layer, a, mm) -> None:
    """The GRU over every step: r and z kept in their pre-activations' slots of ``a``, n in ``layer.n``."""
    h, n, H = layer.h, layer.n, layer.h.shape[-1]
    W_hh, rec, g4 = layer.W_hh, layer.rec, layer.gates4
    W_hrz, W_hn = W_hh[:, : 2 * H], W_hh[:, 2 * H :]
    for t in range(a.shape[0]):
        at, nt = a[t], n[t]
        r, z = g4[t, :, 0], g4[t, :, 1]
        if layer.reset_after:
            mm(h[t], W_hh, out=rec)
            np.add(at[:, : 2 * H], rec[:, : 2 * H], out=at[:, : 2 * H])
            sigmoid_(at[:, : 2 * H])
            un = layer.un[t]
            np.copyto(un, rec[:, 2 * H :])
            if layer.b_hn is not None:
                np.add(un, layer.b_hn, out=un)
            np.multiply(r, un, out=nt)
        else:
            mm(h[t], W_hrz, out=rec[:, : 2 * H])
            np.add(at[:, : 2 * H], rec[:, : 2 * H], out=at[:, : 2 * H])
            sigmoid_(at[:, : 2 * H])
            np.multiply(r, h[t], out=layer.rh[t])
            mm(layer.rh[t], W_hn, out=nt)
        np.add(nt, at[:, 2 * H :], out=nt)
        np.tanh(nt, out=nt)
        ht = h[t + 1]  # (1 - z) n + z h_{t-1} = n + z (h_{t-1} - n)
        np.subtract(h[t], nt, out=ht)
        np.multiply(ht, z, out=ht)
        np.add(ht, nt, out=ht)


def lstm_forward(layer: Layer, a, mm) -> None:
    """The LSTM over every step (peepholes optional): the gates in place in ``a``, c and tanh(c) kept."""
    h, c, g, tc = layer.h, layer.c, layer.g, layer.tc
    H, W_hh, rec = h.shape[-1], layer.W_hh, layer.rec
    gates5, peep = layer.gates5, layer.peep_names is not None
    if peep:
        np.copyto(layer.p_if[0], layer.p_i)
        np.copyto(layer.p_if[1], layer.p_f)
    tmp = layer.tmp_bh
    for t in range(a.shape[0]):
        at = a[t]
        if t:
            mm(h[t], W_hh, out=rec)
            np.add(at, rec, out=at)
        np.tanh(at[:, 2 * H:3 * H], out=g[t])
        i, f, o = gates5[t, :, 0], gates5[t, :, 1], gates5[t, :, 3]
        if peep:
            np.multiply(c[t][:, None, :], layer.p_if, out=layer.tmp_b2h)
            np.add(gates5[t, :, :2], layer.tmp_b2h, out=gates5[t, :, :2])
            sigmoid_(at[:, :2 * H])
        else:  # one pass over all four gates beats three calls; the g slot is not read
            sigmoid_(at)
        np.multiply(f, c[t], out=c[t + 1])
        np.multiply(i, g[t], out=tmp)
        np.add(c[t + 1], tmp, out=c[t + 1])
        if peep:
            np.multiply(c[t + 1], layer.p_o, out=tmp)
            np.add(o, tmp, out=o)
            sigmoid_(o)
        np.tanh(c[t + 1], out=tc[t])
        np.multiply(o, tc[t], out=h[t + 1])


# -- backward ------------------------------------------------------------------------
def seed(layer: Layer, buf, s: int, top: bool) -> None:
    """Add step s's gradient from above into ``dh``; in a truncated sweep, open output s's window."""
    dh, up = layer.dh, layer.up
    if not buf.truncated:
        np.add(dh, up[s], out=dh)
        return
    r = s % buf.S  # the slot of output s+K+1, whose window closed at step s+1
    if top:
        np.copyto(dh[r], up[s])
    else:
        dh[r].fill(0)
        np.add(dh, up[s], out=dh)
    if layer.lstm:
        layer.dc[r].fill(0)


def gru_backward(layer: Layer, buf, top: bool, mm, one) -> None:
    """The GRU's backward sweep: every step's ``dL/da`` (per window) into ``layer.das``."""
    t0, T, H = buf.t0, buf.T, layer.hidden
    g4 = layer.gates4[t0:]
    r, z, n, h_prev = g4[:, :, 0], g4[:, :, 1], layer.n[t0:], layer.h[t0:T]
    k_n, k_z, k_r = layer.k_n[t0:], layer.k_z[t0:], layer.k_r[t0:]
    np.multiply(n, n, out=k_n)
    np.subtract(one, k_n, out=k_n)
    np.subtract(one, z, out=k_z)
    np.multiply(k_n, k_z, out=k_n)  # k_n = (1 - z)(1 - n^2)
    np.multiply(k_z, z, out=k_z)
    tmp_t = layer.tmp_tbh[t0:]
    np.subtract(h_prev, n, out=tmp_t)
    np.multiply(k_z, tmp_t, out=k_z)  # k_z = (h_{t-1} - n) z (1 - z)
    np.subtract(one, r, out=k_r)
    np.multiply(k_r, r, out=k_r)  # k_r = r (1 - r) un (after), r (1 - r) h_{t-1} (before)
    np.multiply(k_r, layer.un[t0:] if layer.reset_after else h_prev, out=k_r)
    dh, dh_rows, das4, das_rows = layer.dh, layer.dh_rows, layer.das4, layer.das_rows
    du, du4, du_rows, tmp, tmp_rows = layer.du, layer.du4, layer.du_rows, layer.tmp_sbh, layer.tmp_rows
    W_hh = layer.W_hh
    W_hrz_T, W_hn_T = W_hh[:, : 2 * H].T, W_hh[:, 2 * H :].T
    dh.fill(0)
    for s in range(T - 1, t0 - 1, -1):
        seed(layer, buf, s, top)
        d4 = das4[s]
        dan = d4[:, :, 2]
        np.multiply(dh, layer.k_n[s], out=dan)
        np.multiply(dh, layer.k_z[s], out=d4[:, :, 1])
        if layer.reset_after:
            np.multiply(dan, layer.k_r[s], out=d4[:, :, 0])
            if s > t0:  # dh_{t-1} = dh z + (da_r, da_z, da_n r) W_hh^T
                np.copyto(du4[:, :, :2], d4[:, :, :2])
                np.multiply(dan, layer.gates4[s, :, 0], out=du4[:, :, 2])
                mm(du_rows, W_hh.T, out=tmp_rows)
        else:
            mm(dan.reshape(-1, H), W_hn_T, out=tmp_rows)  # dL/d(r h_{t-1})
            np.multiply(tmp, layer.k_r[s], out=d4[:, :, 0])
            if s > t0:  # dh_{t-1} = dh z + dL/d(r h) r + (da_r, da_z) W_hrz^T
                np.multiply(tmp, layer.gates4[s, :, 0], out=tmp)
                tmp_rows += mm(das_rows[s][:, : 2 * H], W_hrz_T)
        if s > t0:
            np.multiply(dh, layer.gates4[s, :, 1], out=dh)
            np.add(dh, tmp, out=dh)


def elman_backward(layer: Layer, buf, top: bool, mm, one) -> None:
    """The Elman layer's backward sweep: every step's ``dL/da`` (per window) into ``layer.das``."""
    t0, T = buf.t0, buf.T
    hw, dg = layer.h[t0 + 1:], layer.act_grad[t0:]
    act = layer.activation
    if act == "tanh":
        np.multiply(hw, hw, out=dg)
        np.subtract(one, dg, out=dg)
    elif act == "relu":
        np.greater(hw, 0, out=dg)
    else:
        np.subtract(one, hw, out=dg)
        np.multiply(dg, hw, out=dg)
    dh, dh_rows, das, das_rows, W_hh_T = layer.dh, layer.dh_rows, layer.das, layer.das_rows, layer.W_hh.T
    dh.fill(0)
    for s in range(T - 1, t0 - 1, -1):
        seed(layer, buf, s, top)
        np.multiply(dh, layer.act_grad[s], out=das[s])
        if s > t0:
            mm(das_rows[s], W_hh_T, out=dh_rows)


def lstm_backward(layer: Layer, buf, top: bool, mm, one) -> None:
    """The LSTM's backward sweep: every step's ``dL/da`` (per window) into ``layer.das``."""
    t0, T = buf.t0, buf.T
    g5 = layer.gates5[t0:]
    i, f, o = g5[:, :, 0], g5[:, :, 1], g5[:, :, 3]
    g, c_prev, tc = layer.g[t0:], layer.c[t0:T], layer.tc[t0:]
    k_o, k_c, tmp = layer.k_o[t0:], layer.k_c[t0:], layer.tmp_tbh[t0:]
    k_i, k_f, k_g = (layer.k_ifg[t0:, :, j] for j in range(3))
    np.subtract(one, o, out=k_o)
    np.multiply(k_o, o, out=k_o)
    np.multiply(k_o, tc, out=k_o)  # tanh(c) o (1 - o)
    np.multiply(tc, tc, out=k_c)
    np.subtract(one, k_c, out=k_c)
    np.multiply(k_c, o, out=k_c)  # o (1 - tanh(c)^2)
    np.subtract(one, i, out=k_i)
    np.multiply(k_i, i, out=k_i)
    np.multiply(k_i, g, out=k_i)  # g i (1 - i)
    np.subtract(one, f, out=k_f)
    np.multiply(k_f, f, out=k_f)
    np.multiply(k_f, c_prev, out=k_f)  # c_{t-1} f (1 - f)
    np.multiply(g, g, out=k_g)
    np.subtract(one, k_g, out=k_g)
    np.multiply(k_g, i, out=k_g)  # i (1 - g^2)
    if layer.peep_names:  # o's peephole feeds dc; i's and f's feed dc_{t-1}
        np.multiply(k_o, layer.p_o, out=tmp)
        np.add(k_c, tmp, out=k_c)
        f_c = layer.f_c[t0:]
        np.multiply(k_i, layer.p_i, out=f_c)
        np.add(f_c, f, out=f_c)
        np.multiply(k_f, layer.p_f, out=tmp)
        np.add(f_c, tmp, out=f_c)
    dh, dc, dh_rows, das_rows, das5 = layer.dh, layer.dc, layer.dh_rows, layer.das_rows, layer.das5
    dc_wide, tmp, W_hh_T = layer.dc_wide, layer.tmp_sbh, layer.W_hh.T
    dh.fill(0)
    dc.fill(0)
    for s in range(T - 1, t0 - 1, -1):
        seed(layer, buf, s, top)
        np.multiply(dh, layer.k_o[s], out=das5[s, :, :, 3])
        np.multiply(dh, layer.k_c[s], out=tmp)
        np.add(dc, tmp, out=dc)
        np.multiply(dc_wide, layer.k_ifg[s], out=das5[s, :, :, :3])
        if s > t0:
            mm(das_rows[s], W_hh_T, out=dh_rows)
            np.multiply(dc, layer.f_c[s], out=dc)


def weight_grads(layer: Layer, buf, inp, below: Layer | None, g: dict, sparse_rows: dict, mm) -> None:
    """Single GEMMs over the window: W_hh, W_in, bias, peepholes into ``g`` (a token table's as rows in
    ``sparse_rows``); and dL/dh for the layer below."""
    t0, T, H = buf.t0, buf.T, layer.hidden
    if buf.S > 1:
        np.sum(layer.das, axis=1, out=layer.da)
    da = layer.da[t0:]
    da_rows = da.reshape(-1, da.shape[-1])
    t1 = max(t0, 1)  # h[0] = 0 adds nothing to W_hh's gradient
    h_rows = layer.h[t1:T].reshape(-1, H)
    if layer.reset_after:  # the recurrent side's gradient: (da_r, da_z, da_n r)
        du = layer.du_all[t0:]
        np.copyto(du, da)
        du4 = du.reshape(T - t0, buf.B, 3, H)
        np.multiply(du4[:, :, 2], layer.gates4[t0:, :, 0], out=du4[:, :, 2])
        mm(h_rows.T, layer.du_all[t1:].reshape(-1, 3 * H), out=g[layer.hh_name])
        if layer.bhn_name:
            np.sum(du4[:, :, 2].reshape(-1, H), axis=0, out=g[layer.bhn_name])
    elif layer.gru:  # (r h_{t-1}) W_hn: W_hn's gradient reads r h_{t-1}
        dW = g[layer.hh_name]
        dW[:, : 2 * H] = mm(h_rows.T, layer.da[t1:, :, : 2 * H].reshape(-1, 2 * H))
        dW[:, 2 * H :] = mm(layer.rh[t1:T].reshape(-1, H).T, layer.da[t1:, :, 2 * H :].reshape(-1, H))
    else:
        mm(h_rows.T, layer.da[t1:].reshape(-1, da.shape[-1]), out=g[layer.hh_name])
    if layer.sparse_input:
        sparse_rows[layer.in_name] = (inp[t0:].reshape(-1), da_rows)
    else:
        mm(inp[t0:].reshape(-1, inp.shape[-1]).T, da_rows, out=g[layer.in_name])
    if layer.b_name:
        np.sum(da_rows, axis=0, out=g[layer.b_name])
    if layer.peep_names:
        tmp, da4 = layer.tmp_tbh[t0:], da.reshape(T - t0, buf.B, 4, H)
        p_i, p_f, p_o = layer.peep_names
        for name, gate, c in ((p_i, 0, layer.c[t0:T]), (p_f, 1, layer.c[t0:T]), (p_o, 3, layer.c[t0 + 1:])):
            np.multiply(da4[:, :, gate], c, out=tmp)
            np.sum(tmp.reshape(-1, H), axis=0, out=g[name])
    if below is not None:  # per window, so each output's window bounds the layer below too
        mm(layer.das_rows[t0:].reshape(-1, da.shape[-1]), layer.W_in.T, out=below.up[t0:].reshape(-1, H))

"""The step: ``_run`` and its stages (``_forward``, the head, ``_output_backward``, ``_backward``,
``_update``), which walk the layers and directions and call each cell's kernels."""

from __future__ import annotations

import numpy as np

from backends.numba_kernels.codes import (
    _ELMAN, _LSTM, _GRU, _SOFTMAX, _OUTPUTS, _STEP, _KIND, _ACT, _HEAD, _TOKENS, _LAYERS, _BIAS, _PEEP,
    _CLIP, _LO, _LANES, _RESET, _DIRS, _RAFTER)
from backends.numba_kernels.elman import _elman_backward, _elman_forward
from backends.numba_kernels.lstm import _lstm_backward, _lstm_forward
from backends.numba_kernels.gru import _gru_after_grads, _gru_backward, _gru_before_grads, _gru_forward
from backends.numba_kernels.head import _head, _outputs


def _run(mode, w, g, ws, x_tok, x_dense, y_tok, y_dense, lr, clip):
    """One call: outputs (mode 0, into ``ws.Z``), loss and gradients into ``g`` (1), or a full SGD step on ``w`` (2).

    ``w`` and ``g`` are the parameters and their gradients (``backends.numba_state.Params``), ``ws``
    the batch shape's buffers and model codes (``Work``): three struct arguments, built once, whose
    type Numba's dispatcher reads in one look per call. Returns the loss (0 for outputs)."""
    cfg = ws.cfg
    _check_ids(mode, cfg, x_tok, y_tok, w.W0.shape[1], w.Why.shape[1])
    _forward(w, ws, x_tok, x_dense)
    if mode == _OUTPUTS:
        _outputs(cfg[_HEAD], ws.Z)
        return 0.0
    loss = _head(cfg, ws.T, ws.B, y_tok, y_dense, ws.Z, ws.dZ) / (ws.B * ws.T)
    _output_backward(w, g, ws)
    _backward(w, g, ws, x_tok, x_dense)
    if mode == _STEP:
        _update(w, g, ws, lr, clip)
    return loss


def _check_ids(mode, cfg, x_tok, y_tok, D, O):
    """Refuse token or class ids outside the weights they index (the kernels do not check bounds)."""
    if cfg[_TOKENS] != 0 and not _ids_in_range(x_tok, D):
        raise ValueError("token id out of range for the input size")
    if mode != _OUTPUTS and cfg[_HEAD] == _SOFTMAX and not _ids_in_range(y_tok, O):
        raise ValueError("class id out of range for the output size")


def _ids_in_range(ids, limit):
    """Whether every id lies in [0, limit): the kernels index without bounds checks."""
    for t in range(ids.shape[0]):
        for b in range(ids.shape[1]):
            if ids[t, b] < 0 or ids[t, b] >= limit:
                return False
    return True


def _forward(w, ws, x_tok, x_dense):
    """All layers in order, each direction's input projection of all steps in one GEMM, then ``Z = h W_hy + b_y``.

    Layer ``l``'s direction ``d`` is unit ``u = l * dirs + d`` of the stacked arrays. A reverse
    direction runs the same kernels on its inputs reversed in time (token ids through ``x_rev``,
    projections flipped in place), so its ``Hs`` rows are in its own order; its outputs are
    reversed back into the layer's ``[h_t, h_t_rev]`` rows ``Hc[l]``."""
    cfg, T, B = ws.cfg, ws.T, ws.B
    tokens, L, dirs = cfg[_TOKENS] != 0, cfg[_LAYERS], cfg[_DIRS]
    XP, x_rev = ws.XP, ws.x_rev
    XP2 = XP.reshape(T * B, XP.shape[2])
    if tokens and dirs == 2:
        for t in range(T):
            for b in range(B):
                x_rev[t, b] = x_tok[T - 1 - t, b]
    for l in range(L):
        gather = tokens and l == 0  # the first layer's projection of a token is a row of W0
        for d in range(dirs):
            if l > 0:
                np.dot(_layer_out(ws, l - 1), w.Wr[l * dirs + d - dirs], XP2)
            elif not tokens:
                np.dot(x_dense.reshape(T * B, x_dense.shape[2]), w.W0[d], XP2)
            if d == 1 and not gather:
                _flip_time(XP)
            _unit_forward(w, ws, l * dirs + d, gather, x_rev if d == 1 else x_tok, w.W0[d])
        if dirs == 2:
            _join_directions(ws, l)
    Z = ws.Z
    np.dot(_layer_out(ws, L - 1), w.Why, Z)
    if cfg[_BIAS] != 0:  # without biases b_y stays zero, so adding it is skipped
        by = w.by
        for r in range(T * B):
            for k in range(Z.shape[1]):
                Z[r, k] += by[k]


def _layer_out(ws, l):
    """Layer ``l``'s outputs as (T*B, dirs*H) rows: its ``Hs`` after the start state, or its ``[h_t, h_t_rev]``."""
    T, B = ws.T, ws.B
    if ws.cfg[_DIRS] == 1:
        return ws.Hs[l, 1:].reshape(T * B, ws.Hs.shape[3])
    return ws.Hc[l].reshape(T * B, ws.Hc.shape[3])


def _unit_forward(w, ws, u, gather, ids, W0):
    """Unit ``u``'s recurrence over all steps, by its cell's kernel, from the projections in ``ws.XP``."""
    cfg = ws.cfg
    kind = cfg[_KIND]
    if kind == _ELMAN:
        _elman_forward(cfg[_ACT], gather, ids, ws.XP, W0, w.Whh[u], w.bb[u], ws.Hs[u], ws.tmp)
    elif kind == _LSTM:
        _lstm_forward(gather, ids, ws.XP, W0, w.Whh[u], w.bb[u], w.P[u], ws.Hs[u], ws.Cs[u], ws.Gs[u], ws.TCs[u],
                      ws.tmp)
    else:
        _gru_forward(cfg[_RAFTER] != 0, gather, ids, ws.XP, W0, w.Whh[u], w.bb[u], w.bhn[u], ws.Hs[u], ws.Gs[u],
                     ws.TCs[u], ws.tmp)


def _join_directions(ws, l):
    """``Hc[l, t] = [h_t, h_t_rev]``: the forward unit's rows and the reverse unit's, put back in time order."""
    T, B = ws.T, ws.B
    Hs, Hc = ws.Hs, ws.Hc
    H = Hs.shape[3]
    for t in range(T):
        for b in range(B):
            out, hf, hr = Hc[l, t, b], Hs[2 * l, t + 1, b], Hs[2 * l + 1, T - t, b]
            for j in range(H):
                out[j] = hf[j]
            for j in range(H):
                out[H + j] = hr[j]


def _flip_time(a):
    """Reverse the leading (time) axis of ``a`` in place: a reverse direction runs on, and hands back,
    its steps in its own order."""
    T = a.shape[0]
    for t in range(T // 2):
        x, y = a[t].reshape(a[t].size), a[T - 1 - t].reshape(a[t].size)
        for k in range(x.size):
            v = x[k]
            x[k] = y[k]
            y[k] = v


def _output_backward(w, g, ws):
    """From ``dZ``, over the steps that carry gradient: ``W_hy``'s and ``b_y``'s gradients, and dL/d(top
    layer's output) into ``dH`` (one direction) or ``dHc[0]`` (both)."""
    cfg, T, B = ws.cfg, ws.T, ws.B
    lo = cfg[_LO]
    n = T - lo
    dZr = ws.dZ[lo * B:]
    np.dot(_layer_out(ws, cfg[_LAYERS] - 1)[lo * B:].T, dZr, g.Why)
    gby = g.by
    gby[:] = 0
    if cfg[_BIAS] != 0:
        for r in range(n * B):
            for k in range(gby.size):
                gby[k] += dZr[r, k]
    if cfg[_DIRS] == 1:
        np.dot(dZr, w.Why.T, ws.dH[0, lo:].reshape(n * B, ws.dH.shape[3]))
    else:
        np.dot(dZr, w.Why.T, ws.dHc[0].reshape(T * B, ws.dHc.shape[3]))


def _backward(w, g, ws, x_tok, x_dense):
    """BPTT through the layers top-down: each unit's ``dL/da`` into ``DAs`` (summed over lanes), then the
    gradients it gives (recurrent side, biases, input side) and dL/d(layer below's output).

    Lanes exist only for truncated windows (one direction). A reverse unit's ``dL/da`` comes out in its
    own time order and is flipped back before the input side's gradients."""
    cfg = ws.cfg
    L, dirs, nl = cfg[_LAYERS], cfg[_DIRS], cfg[_LANES]
    g.bb[:] = 0
    g.P[:] = 0
    g.bhn[:] = 0
    for l in range(L - 1, -1, -1):
        if dirs == 2:
            _split_directions(ws)
        for d in range(dirs):
            u = l * dirs + d
            _unit_backward(w, ws, u, d, nl > 1 and l < L - 1)
            if nl > 1:
                _sum_lanes(ws)
            _recurrent_grads(g, ws, u)
            _bias_grads(g, ws, u)
            if d == 1:
                _flip_time(ws.DAs)
            if l > 0:
                _grads_below(w, g, ws, l, d)
            elif cfg[_TOKENS] != 0:
                _token_grads(g, ws, x_tok, d)
            else:
                lo, B = cfg[_LO], ws.B
                n = ws.T - lo
                np.dot(x_dense[lo:].reshape(n * B, x_dense.shape[2]).T, ws.DAs[lo:].reshape(n * B, ws.DAs.shape[2]),
                       g.W0[d])


def _split_directions(ws):
    """Each direction's share of dL/d(layer output) from ``dHc[0]`` into ``dH``, the reverse one in its own order."""
    T, B = ws.T, ws.B
    dHc, dH = ws.dHc, ws.dH
    H = dH.shape[3]
    for t in range(T):
        for b in range(B):
            src, df, dr = dHc[0, t, b], dH[0, t, b], dH[1, T - 1 - t, b]
            for j in range(H):
                df[j] = src[j]
            for j in range(H):
                dr[j] = src[H + j]


def _unit_backward(w, ws, u, d, lanes_in):
    """Unit ``u``'s BPTT by its cell's kernel, from ``dH[d]`` (or, with ``lanes_in``, ``dHl``) into the lanes."""
    cfg, T, B = ws.cfg, ws.T, ws.B
    kind, lo, reset = cfg[_KIND], cfg[_LO], cfg[_RESET] != 0
    G = ws.DAs.shape[2]
    lanes = ws.DAs.reshape(T, 1, B, G) if cfg[_LANES] == 1 else ws.DAl
    if kind == _ELMAN:
        _elman_backward(cfg[_ACT], lo, reset, lanes_in, ws.Hs[u], w.Whh[u], ws.dH[d], ws.dHl, lanes, ws.dhn)
    elif kind == _LSTM:
        _lstm_backward(lo, reset, lanes_in, ws.Hs[u], ws.Cs[u], ws.Gs[u], ws.TCs[u], w.Whh[u], w.P[u], ws.dH[d],
                       ws.dHl, lanes, ws.dhn, ws.dcn)
    else:
        _gru_backward(cfg[_RAFTER] != 0, lo, reset, lanes_in, ws.Hs[u], ws.Gs[u], ws.TCs[u], w.Whh[u], ws.dH[d],
                      ws.dHl, lanes, ws.dhn, ws.dus, ws.dan, ws.drh)


def _sum_lanes(ws):
    """``DAs[s] = sum of DAl[s]`` over the lanes, for the steps that carry gradient."""
    DAs, DAl = ws.DAs, ws.DAl
    nl, G = DAl.shape[1], DAs.shape[2]
    for s in range(ws.cfg[_LO], ws.T):
        for b in range(ws.B):
            acc = DAs[s, b]
            acc[:] = 0
            for r in range(nl):
                src = DAl[s, r, b]
                for j in range(G):
                    acc[j] += src[j]


def _recurrent_grads(g, ws, u):
    """``W_hh``'s gradient (and the reset-after GRU's ``b_hn``'s) from unit ``u``'s ``dL/da`` and its inputs."""
    cfg, B = ws.cfg, ws.B
    lo = cfg[_LO]
    n = ws.T - lo
    H, G = ws.Hs.shape[3], ws.DAs.shape[2]
    h_prev = ws.Hs[u, lo:ws.T].reshape(n * B, H)
    if cfg[_KIND] != _GRU:
        np.dot(h_prev.T, ws.DAs[lo:].reshape(n * B, G), g.Whh[u])
    elif cfg[_RAFTER] != 0:
        _gru_after_grads(g, ws, u, h_prev)
    else:
        _gru_before_grads(g, ws, u, h_prev)


def _bias_grads(g, ws, u):
    """Unit ``u``'s bias gradient and, for an LSTM with them, its peepholes' (``dL/da`` against the cell states)."""
    cfg, B = ws.cfg, ws.B
    lo = cfg[_LO]
    DAs = ws.DAs
    H, G = ws.Hs.shape[3], DAs.shape[2]
    if cfg[_BIAS] != 0:
        gb = g.bb
        for s in range(lo, ws.T):
            for b in range(B):
                for j in range(G):
                    gb[u, j] += DAs[s, b, j]
    if cfg[_KIND] == _LSTM and cfg[_PEEP] != 0:
        gP, Cs = g.P, ws.Cs
        for s in range(lo, ws.T):
            for b in range(B):
                for j in range(H):
                    gP[u, 0, j] += DAs[s, b, j] * Cs[u, s, b, j]
                    gP[u, 1, j] += DAs[s, b, H + j] * Cs[u, s, b, j]
                    gP[u, 2, j] += DAs[s, b, 3 * H + j] * Cs[u, s + 1, b, j]


def _grads_below(w, g, ws, l, d):
    """Layer ``l``'s (l > 0) input weights' gradient, and dL/d(layer below's output) into ``dH``, ``dHl``
    (lanes) or ``dHc[0]`` (both directions adding in)."""
    cfg, T, B = ws.cfg, ws.T, ws.B
    lo, nl, dirs = cfg[_LO], cfg[_LANES], cfg[_DIRS]
    n = T - lo
    u = l * dirs + d
    G = ws.DAs.shape[2]
    DAr = ws.DAs[lo:].reshape(n * B, G)
    Wr = w.Wr[u - dirs]
    np.dot(_layer_out(ws, l - 1)[lo * B:].T, DAr, g.Wr[u - dirs])
    if dirs == 2:
        dHc = ws.dHc
        HD = dHc.shape[3]
        np.dot(DAr, Wr.T, dHc[d].reshape(T * B, HD))
        if d == 1:
            a, c = dHc[0].reshape(T * B * HD), dHc[1].reshape(T * B * HD)
            for k in range(a.size):
                a[k] += c[k]
    elif nl == 1:
        np.dot(DAr, Wr.T, ws.dH[0, lo:].reshape(n * B, ws.dH.shape[3]))
    else:
        dHl = ws.dHl
        np.dot(ws.DAl[lo:].reshape(n * nl * B, G), Wr.T, dHl[lo:].reshape(n * nl * B, dHl.shape[3]))


def _token_grads(g, ws, x_tok, d):
    """The first layer's token rows of ``W0[d]``: each gathered row gets its ``dL/da`` rows, and ``rows``
    (count in its last slot) lists the rows touched, each once, for the update and the clean-up.

    ``gW0`` is all zeros on entry; the update zeroes the rows it touched."""
    cfg, T, B = ws.cfg, ws.T, ws.B
    mark, rows, DAs = ws.mark, ws.rows, ws.DAs
    G = DAs.shape[2]
    count = rows[T * B] if d == 1 else 0
    g0 = g.W0[d]
    for s in range(cfg[_LO], T):
        for b in range(B):
            row = x_tok[s, b]
            if mark[row] == 0:
                mark[row] = 1
                rows[count] = row
                count += 1
            g_row = g0[row]
            src = DAs[s, b]
            for j in range(G):
                g_row[j] += src[j]
    rows[T * B] = count
    if d == cfg[_DIRS] - 1:
        for k in range(count):
            mark[rows[k]] = 0


def _update(w, g, ws, lr, clip):
    """``p -= lr * clip(g)`` for every parameter the model has (missing ones stay zero)."""
    cfg = ws.cfg
    do_clip = cfg[_CLIP] != 0
    if cfg[_TOKENS] != 0:
        # rows never gathered have zero gradient, so p - lr * 0 leaves them as they are
        rows, n_rows = ws.rows, ws.rows[ws.T * ws.B]
        for d in range(cfg[_DIRS]):
            for k in range(n_rows):
                row = rows[k]
                _sgd(w.W0[d, row], g.W0[d, row], lr, clip, do_clip)
                g.W0[d, row] = 0
    else:
        _sgd(w.W0, g.W0, lr, clip, do_clip)
    _sgd(w.Wr, g.Wr, lr, clip, do_clip)
    _sgd(w.Whh, g.Whh, lr, clip, do_clip)
    _sgd(w.Why, g.Why, lr, clip, do_clip)
    if cfg[_BIAS] != 0:
        _sgd(w.bb, g.bb, lr, clip, do_clip)
        _sgd(w.by, g.by, lr, clip, do_clip)
        if cfg[_KIND] == _GRU and cfg[_RAFTER] != 0:
            _sgd(w.bhn, g.bhn, lr, clip, do_clip)
    if cfg[_KIND] == _LSTM and cfg[_PEEP] != 0:
        _sgd(w.P, g.P, lr, clip, do_clip)


def _sgd(p, g, lr, clip, do_clip):
    """``p -= lr * clip(g)`` elementwise, in the parameters' dtype."""
    pf = p.reshape(p.size)
    gf = g.reshape(g.size)
    if do_clip:
        for k in range(pf.size):
            v = gf[k]
            if v > clip:
                v = clip
            elif v < -clip:
                v = -clip
            pf[k] = pf[k] - lr * v
    else:
        for k in range(pf.size):
            pf[k] = pf[k] - lr * gf[k]

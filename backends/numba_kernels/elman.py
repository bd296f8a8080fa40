"""The Elman cell's kernels: one layer direction's forward sweep and its backward sweep over the lanes
(layout and lanes in :mod:`backends.numba_kernels`)."""

from __future__ import annotations

import numpy as np

from backends.numba_kernels.codes import _RELU, _TANH
from backends.numba_kernels.maths import _exp, _tanh


def _elman_forward(act, gather, x_tok, XP, W0, Whh_l, b_l, Hl, tmp):
    """``Hl[t+1] = act(XP[t] + Hl[t] @ W_hh + b)``, XP being a row gather of W0 when ``gather``."""
    T, B, H = Hl.shape[0] - 1, Hl.shape[1], Hl.shape[2]
    one = Hl.dtype.type(1)
    zero = Hl.dtype.type(0)
    for t in range(T):
        np.dot(Hl[t], Whh_l, tmp)
        hn = Hl[t + 1]
        for b in range(B):
            src = W0[x_tok[t, b]] if gather else XP[t, b]
            a_row = tmp[b]
            h_row = hn[b]
            if act == _TANH:
                for j in range(H):
                    h_row[j] = _tanh(src[j] + a_row[j] + b_l[j])
            elif act == _RELU:
                for j in range(H):
                    a = src[j] + a_row[j] + b_l[j]
                    h_row[j] = a if a > zero else zero
            else:
                for j in range(H):
                    h_row[j] = one / (one + _exp(-(src[j] + a_row[j] + b_l[j])))


def _elman_backward(act, lo, reset, lanes_in, Hl, Whh_l, dH, dHl, DAl, dhn):
    """BPTT through one Elman layer for steps T-1..lo, one lane per open truncation window.

    ``dH`` (T, B, H) feeds lane ``s % lanes`` at step s (the top layer); with ``lanes_in``
    the gradient arrives per lane in ``dHl`` (T, lanes, B, H) from the layer above.
    Writes ``DAl`` (T, lanes, B, H), the gradient w.r.t. the pre-activations.
    """
    T, B, H = Hl.shape[0] - 1, Hl.shape[1], Hl.shape[2]
    nl = dhn.shape[0]
    one = Hl.dtype.type(1)
    zero = Hl.dtype.type(0)
    dhn[:] = zero
    for s in range(T - 1, lo - 1, -1):
        own = s % nl
        if reset:
            dhn[own] = zero
        hs = Hl[s + 1]
        for r in range(nl):
            for b in range(B):
                d_row = dhn[r, b]
                da = DAl[s, r, b]
                h_row = hs[b]
                if lanes_in:
                    src = dHl[s, r, b]
                    for j in range(H):
                        d_row[j] += src[j]
                elif r == own:
                    src = dH[s, b]
                    for j in range(H):
                        d_row[j] += src[j]
                if act == _TANH:
                    for j in range(H):
                        da[j] = d_row[j] * (one - h_row[j] * h_row[j])
                elif act == _RELU:
                    for j in range(H):
                        da[j] = d_row[j] if h_row[j] > zero else zero
                else:
                    for j in range(H):
                        da[j] = d_row[j] * (h_row[j] * (one - h_row[j]))
        if s > lo:
            np.dot(DAl[s].reshape(nl * B, H), Whh_l.T, dhn.reshape(nl * B, H))

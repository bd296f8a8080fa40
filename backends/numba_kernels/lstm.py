"""The LSTM cell's kernels: one layer direction's forward sweep (gates i, f, g, o; optional peepholes)
and its backward sweep over the lanes (layout and lanes in :mod:`backends.numba_kernels`)."""

from __future__ import annotations

import numpy as np

from backends.numba_kernels.maths import _exp, _tanh


def _lstm_forward(gather, x_tok, XP, W0, Whh_l, b_l, P_l, Hl, Cl, Gl, TCl, tmp):
    """One LSTM layer over all steps; stores h, c, the gates (i, f, g, o) and tanh(c) for BPTT.

    Each row is done in short passes that touch few arrays: LLVM vectorises a loop only when it
    can rule out aliasing with a handful of runtime checks, and the gates' exp/tanh are the cost.
    """
    T, B, H = Hl.shape[0] - 1, Hl.shape[1], Hl.shape[2]
    one = Hl.dtype.type(1)
    p_i, p_f, p_o = P_l[0], P_l[1], P_l[2]
    for t in range(T):
        np.dot(Hl[t], Whh_l, tmp)
        for b in range(B):
            src = W0[x_tok[t, b]] if gather else XP[t, b]
            a = tmp[b]
            gates = Gl[t, b]
            for k in range(4 * H):
                gates[k] = src[k] + a[k] + b_l[k]
            gi, gf, gg, go = gates[:H], gates[H:2 * H], gates[2 * H:3 * H], gates[3 * H:]
            cp, cn, hn, tc = Cl[t, b], Cl[t + 1, b], Hl[t + 1, b], TCl[t, b]
            for j in range(H):
                gi[j] = one / (one + _exp(-(gi[j] + p_i[j] * cp[j])))
            for j in range(H):
                gf[j] = one / (one + _exp(-(gf[j] + p_f[j] * cp[j])))
            for j in range(H):
                gg[j] = _tanh(gg[j])
            for j in range(H):
                cn[j] = gf[j] * cp[j] + gi[j] * gg[j]
            for j in range(H):
                go[j] = one / (one + _exp(-(go[j] + p_o[j] * cn[j])))
            for j in range(H):
                tc[j] = _tanh(cn[j])
            for j in range(H):
                hn[j] = go[j] * tc[j]


def _lstm_backward(lo, reset, lanes_in, Hl, Cl, Gl, TCl, Whh_l, P_l, dH, dHl, DAl, dhn, dcn):
    """BPTT through one LSTM layer for steps T-1..lo with lanes as in :func:`_elman_backward`."""
    T, B, H = Hl.shape[0] - 1, Hl.shape[1], Hl.shape[2]
    nl = dhn.shape[0]
    one = Hl.dtype.type(1)
    zero = Hl.dtype.type(0)
    p_i, p_f, p_o = P_l[0], P_l[1], P_l[2]
    dhn[:] = zero
    dcn[:] = zero
    for s in range(T - 1, lo - 1, -1):
        own = s % nl
        if reset:
            dhn[own] = zero
            dcn[own] = zero
        for r in range(nl):
            for b in range(B):
                dh, dc, da = dhn[r, b], dcn[r, b], DAl[s, r, b]
                gates, tc, cp = Gl[s, b], TCl[s, b], Cl[s, b]
                if lanes_in:
                    src = dHl[s, r, b]
                    for j in range(H):
                        dh[j] += src[j]
                elif r == own:
                    src = dH[s, b]
                    for j in range(H):
                        dh[j] += src[j]
                gi, gf, gg, go = gates[:H], gates[H:2 * H], gates[2 * H:3 * H], gates[3 * H:]
                dai, daf, dag, dao = da[:H], da[H:2 * H], da[2 * H:3 * H], da[3 * H:]
                # short passes over few arrays each, so that every loop vectorises
                for j in range(H):
                    dao[j] = dh[j] * tc[j] * go[j] * (one - go[j])
                for j in range(H):
                    dc[j] = dc[j] + dh[j] * go[j] * (one - tc[j] * tc[j]) + dao[j] * p_o[j]
                for j in range(H):
                    dai[j] = dc[j] * gg[j] * gi[j] * (one - gi[j])
                for j in range(H):
                    daf[j] = dc[j] * cp[j] * gf[j] * (one - gf[j])
                for j in range(H):
                    dag[j] = dc[j] * gi[j] * (one - gg[j] * gg[j])
                for j in range(H):
                    dc[j] = dc[j] * gf[j] + dai[j] * p_i[j] + daf[j] * p_f[j]
        if s > lo:
            np.dot(DAl[s].reshape(nl * B, 4 * H), Whh_l.T, dhn.reshape(nl * B, H))

"""The GRU cell's kernels: one layer direction's forward and backward sweeps (gates r, z, n; the reset
after or before the recurrent product), and the weight gradients that differ between the two forms."""

from __future__ import annotations

import numpy as np

from backends.numba_kernels.codes import _BIAS, _LO
from backends.numba_kernels.maths import _exp, _tanh


def _gru_forward(after, gather, x_tok, XP, W0, Whh_l, b_l, bhn_l, Hl, Gl, TCl, tmp):
    """One GRU layer over all steps; stores h, the gates (r, z, n) and, for BPTT, ``h W_hn + b_hn``
    (reset after) or ``r * h_{t-1}`` (reset before) in ``TCl``.

    After the reset the gates are one product ``h W_hh`` (H, 3H) per step. Before it, ``Whh_l``
    holds ``W_hh[:, :2H]`` and ``W_hh[:, 2H:]`` one after the other (see ``_pack``), so that both
    products read contiguous matrices: ``h W_rz``, then ``(r * h) W_n``.
    """
    T, B, H = Hl.shape[0] - 1, Hl.shape[1], Hl.shape[2]
    H2 = 2 * H
    one = Hl.dtype.type(1)
    flat = Whh_l.reshape(3 * H * H)
    W_rz, W_n = flat[:2 * H * H].reshape(H, H2), flat[2 * H * H:].reshape(H, H)
    tflat = tmp.reshape(tmp.size)
    u_rz, v = tflat[:B * H2].reshape(B, H2), tflat[B * H2:].reshape(B, H)
    b_rz, b_n = b_l[:H2], b_l[H2:]
    for t in range(T):
        if after:
            np.dot(Hl[t], Whh_l, tmp)
        else:
            np.dot(Hl[t], W_rz, u_rz)
        for b in range(B):
            src = W0[x_tok[t, b]] if gather else XP[t, b]
            gates = Gl[t, b]
            u = tmp[b] if after else u_rz[b]
            rz = gates[:H2]
            for k in range(H2):
                rz[k] = one / (one + _exp(-(src[k] + u[k] + b_rz[k])))
            if after:
                r, un, cand, s_n = gates[:H], TCl[t, b], gates[H2:], src[H2:]
                for j in range(H):
                    un[j] = u[H2 + j] + bhn_l[j]
                for j in range(H):
                    cand[j] = _tanh(s_n[j] + b_n[j] + r[j] * un[j])
            else:
                r, rh, hp = gates[:H], TCl[t, b], Hl[t, b]
                for j in range(H):
                    rh[j] = r[j] * hp[j]
        if not after:
            np.dot(TCl[t], W_n, v)
            for b in range(B):
                src = W0[x_tok[t, b]] if gather else XP[t, b]
                cand, s_n, vb = Gl[t, b, H2:], src[H2:], v[b]
                for j in range(H):
                    cand[j] = _tanh(s_n[j] + b_n[j] + vb[j])
        for b in range(B):
            z, cand, hp, hn = Gl[t, b, H:H2], Gl[t, b, H2:], Hl[t, b], Hl[t + 1, b]
            for j in range(H):
                hn[j] = cand[j] + z[j] * (hp[j] - cand[j])


def _gru_backward(after, lo, reset, lanes_in, Hl, Gl, TCl, Whh_l, dH, dHl, DAl, dhn, dus, dan, drh):
    """BPTT through one GRU layer for steps T-1..lo with lanes as in :func:`_elman_backward`.

    ``DAl`` gets dL/d(gate pre-activations) (r, z, n); the recurrent side's products read ``dus``:
    after the reset ``(da_r, da_z, da_n r)`` against ``W_hh``, before it ``(da_r, da_z)`` against
    ``W_rz`` and ``da_n`` (in ``dan``) against ``W_n``, whose product ``d(r h)`` also feeds ``da_r``.
    """
    T, B, H = Hl.shape[0] - 1, Hl.shape[1], Hl.shape[2]
    H2 = 2 * H
    nl = dhn.shape[0]
    one = Hl.dtype.type(1)
    zero = Hl.dtype.type(0)
    flat = Whh_l.reshape(3 * H * H)
    W_rz, W_n = flat[:2 * H * H].reshape(H, H2), flat[2 * H * H:].reshape(H, H)
    drz = dus.reshape(dus.size)[:nl * B * H2].reshape(nl * B, H2)
    dhn[:] = zero
    for s in range(T - 1, lo - 1, -1):
        own = s % nl
        if reset:
            dhn[own] = zero
        for r in range(nl):
            for b in range(B):
                dh, da = dhn[r, b], DAl[s, r, b]
                gates, hp = Gl[s, b], Hl[s, b]
                if lanes_in:
                    src = dHl[s, r, b]
                    for j in range(H):
                        dh[j] += src[j]
                elif r == own:
                    src = dH[s, b]
                    for j in range(H):
                        dh[j] += src[j]
                rg, z, cand = gates[:H], gates[H:H2], gates[H2:]
                da_r, da_z, da_n = da[:H], da[H:H2], da[H2:]
                for j in range(H):
                    da_n[j] = dh[j] * (one - z[j]) * (one - cand[j] * cand[j])
                for j in range(H):
                    da_z[j] = dh[j] * (hp[j] - cand[j]) * (z[j] * (one - z[j]))
                if after:
                    un, du = TCl[s, b], dus[r, b]
                    for j in range(H):
                        da_r[j] = da_n[j] * un[j] * (rg[j] * (one - rg[j]))
                    for k in range(H2):
                        du[k] = da[k]
                    for j in range(H):
                        du[H2 + j] = da_n[j] * rg[j]
                else:
                    dn = dan[r, b]
                    for j in range(H):
                        dn[j] = da_n[j]
                for j in range(H):
                    dh[j] = dh[j] * z[j]
        if after:
            if s > lo:
                np.dot(dus.reshape(nl * B, 3 * H), Whh_l.T, drh.reshape(nl * B, H))
                for r in range(nl):
                    for b in range(B):
                        dh, d_in = dhn[r, b], drh[r, b]
                        for j in range(H):
                            dh[j] += d_in[j]
            continue
        np.dot(dan.reshape(nl * B, H), W_n.T, drh.reshape(nl * B, H))  # dL/d(r h_{t-1})
        for r in range(nl):
            for b in range(B):
                dh, d_rh, rg, hp = dhn[r, b], drh[r, b], Gl[s, b, :H], Hl[s, b]
                da_r, dz, d_rz = DAl[s, r, b, :H], DAl[s, r, b, H:H2], drz[r * B + b]
                for j in range(H):
                    da_r[j] = d_rh[j] * hp[j] * (rg[j] * (one - rg[j]))
                for j in range(H):
                    d_rz[j] = da_r[j]
                for j in range(H):
                    d_rz[H + j] = dz[j]
                for j in range(H):
                    dh[j] += d_rh[j] * rg[j]
        if s > lo:
            np.dot(drz, W_rz.T, drh.reshape(nl * B, H))
            for r in range(nl):
                for b in range(B):
                    dh, d_in = dhn[r, b], drh[r, b]
                    for j in range(H):
                        dh[j] += d_in[j]


def _gru_after_grads(g, ws, u, h_prev):
    """Reset after: the recurrent side saw ``(da_r, da_z, da_n r)`` (built in ``DUs``); ``b_hn`` gets ``da_n r``."""
    cfg, B = ws.cfg, ws.B
    lo = cfg[_LO]
    n = ws.T - lo
    DUs, DAs, Gs = ws.DUs, ws.DAs, ws.Gs
    H, G = ws.Hs.shape[3], DAs.shape[2]
    H2 = 2 * H
    for s in range(lo, ws.T):
        for b in range(B):
            du, da, rg = DUs[s, b], DAs[s, b], Gs[u, s, b]
            for k in range(H2):
                du[k] = da[k]
            for j in range(H):
                du[H2 + j] = da[H2 + j] * rg[j]
    DUr = DUs[lo:].reshape(n * B, G)
    np.dot(h_prev.T, DUr, g.Whh[u])
    if cfg[_BIAS] != 0:
        gbhn = g.bhn
        for r in range(n * B):
            for j in range(H):
                gbhn[u, j] += DUr[r, H2 + j]


def _gru_before_grads(g, ws, u, h_prev):
    """Reset before: ``W_rz`` against ``h_{t-1}`` and ``W_n`` against ``r h_{t-1}``, into the packed halves."""
    lo, B = ws.cfg[_LO], ws.B
    n = ws.T - lo
    H, G = ws.Hs.shape[3], ws.DAs.shape[2]
    H2 = 2 * H
    DAr = ws.DAs[lo:].reshape(n * B, G)
    flat = ws.DUs.reshape(ws.DUs.size)
    d_rz, d_n = flat[:n * B * H2].reshape(n * B, H2), flat[n * B * H2:n * B * G].reshape(n * B, H)
    for r in range(n * B):
        da, a_rz, a_n = DAr[r], d_rz[r], d_n[r]
        for k in range(H2):
            a_rz[k] = da[k]
        for j in range(H):
            a_n[j] = da[H2 + j]
    g_flat = g.Whh[u].reshape(3 * H * H)
    np.dot(h_prev.T, d_rz, g_flat[:2 * H * H].reshape(H, H2))
    np.dot(ws.TCs[u, lo:].reshape(n * B, H).T, d_n, g_flat[2 * H * H:].reshape(H, H))

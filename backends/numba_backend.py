"""SPEC.md as Numba kernels: fused per-step loops around BLAS products, one compiled graph per dtype.

The whole step (forward, head, BPTT, SGD update) runs in one ``@njit`` call. Model
choices (cell, activation, reset form, head, bptt mode, bias, peepholes, layers, directions,
token or dense input) are small integers read at run time, so every model of the conformance matrix
shares the same two compiled specialisations (float32 and float64), and
``cache=True`` keeps them on disk for the next process. ``_run`` takes the parameters, their
gradients and the batch shape's workspace as three structs (``backends/numba_state.py``, built once
each) and goes through the step's stages: ``_forward``, ``_head``, ``_output_backward``, ``_backward``
and ``_update``.

Layout of the state the kernels share (``G = H`` for Elman, ``4H`` for the LSTM, ``3H`` for the
GRU; a layer's directions are units ``u = l * dirs + d``, ``dirs`` 2 for bidirectional layers): the
fields of ``Params`` (the gradients have the same), then some of ``Work``'s::

    W0 (dirs, D, G)  layer 0 input weights     Wr ((L-1)*dirs, dirs*H, G)  input weights above it
    Whh (U, H, G)   bb (U, G)   P (U, 3, H) peepholes i, f, o   bhn (U, H)   Why (dirs*H, O)   by (O)
    Hs, Cs (U, T+1, B, H)  index 0 the zero start state;  Gs (U, T, B, G) gates (i, f, g, o / r, z, n);
    TCs (U, T, B, H) tanh(c_t), or the GRU's h W_hn + b_hn (reset after) / r * h_{t-1} (before);
    Hc (L, T, B, 2H) a bidirectional layer's outputs [h_t, h_t_rev];  Z, dZ (T*B, O)

The GRU after the reset takes one (B, H) x (H, 3H) product per step, forward and backward, as
the LSTM does; before the reset it takes two (``r`` comes between them), and keeps ``W_hh`` as
``W_hh[:, :2H]`` and ``W_hh[:, 2H:]`` one after the other in the same buffer (``_pack``) so that
both products read contiguous matrices. A reverse direction runs the same kernels on its inputs
reversed in time; its outputs are reversed back into ``Hc``, its gradients flipped back once.

Missing biases and peepholes are zero arrays that are read but never updated, which is
exactly what the reference computes with (it adds ``0`` for them).

``truncated: K`` gives each output its own window (SPEC.md); instead of one backward
pass per output, the backward sweep carries ``K+1`` "lanes" at once: lane ``t % (K+1)``
holds output ``t``'s gradient while ``s`` runs from ``t`` down to ``t-K``, and is reset
when its window closes. Weight gradients are linear in the lanes, so they are GEMMs over
all steps of the lane sum; only the recurrent product is per step.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import numpy as np

from backends.base import Backend, unsupported
from harness.spec.model import layer_suffix

# codes the kernels branch on (module-level ints are compile-time constants for Numba)
_ELMAN, _LSTM, _GRU = 0, 1, 2
_TANH, _RELU, _SIGMOID = 0, 1, 2
_SOFTMAX, _MSE, _MSE_TANH = 0, 1, 2
_OUTPUTS, _GRADS, _STEP = 0, 1, 2
# slots of the int64 ``cfg`` vector
_KIND, _ACT, _HEAD, _TOKENS, _LAYERS, _BIAS, _PEEP, _CLIP, _LO, _LANES, _RESET, _DIRS, _RAFTER = range(13)
_N_CFG = 13


# -- elementwise maths ------------------------------------------------------------------------------------
# libm's tanh/exp are scalar calls, so a loop over them does not vectorise. These are the Cephes
# polynomials (float32: expf/tanhf, float64: exp/tanh), written so LLVM vectorises them; the tests
# hold them to 2 ulp of the correctly rounded values. The Python bodies below are what they compute;
# _install_math() gives Numba the compiled versions.

_EXP32 = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
_EXP64_P = (1.26177193074810590878e-4, 3.02994407707441961300e-2, 9.99999999999999999910e-1)
_EXP64_Q = (3.00198505138664455042e-6, 2.52448340349684104192e-3, 2.27265548208155028766e-1, 2.00000000000000000009)
_TANH32 = (-5.70498872745e-3, 2.06390887954e-2, -5.37397155531e-2, 1.33314422036e-1, -3.33332819422e-1)
_TANH64_P = (-9.64399179425052238628e-1, -9.92877231001918586564e1, -1.61468768441708447952e3)
_TANH64_Q = (1.12811678491632931402e2, 2.23548839060100448583e3, 4.84406305325125486048e3)
_LOG2E = 1.4426950408889634074
# exp arguments are clamped to where 2**n stays a normal float; below the low end the result is 0
_EXP_RANGE = {32: (-87.0, 88.0), 64: (-708.0, 709.0)}


def _exp(x):
    """exp(x); 0 below -87 (float32) / -708 (float64), finite at the top of the range."""
    return math.exp(x)


def _tanh(x):
    """tanh(x)."""
    return math.tanh(x)


def _install_math():
    """Register the vectorisable float32/float64 versions of :func:`_exp` and :func:`_tanh` with Numba."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic, overload

    @intrinsic
    def float_from_bits(typingctx, bits, like):
        # the float whose IEEE pattern is ``bits``: how exp builds 2**n without a libm call
        if not isinstance(like, types.Float) or not isinstance(bits, types.Integer):
            return None
        width = like.bitwidth

        def codegen(context, builder, sig, args):
            v = args[0]
            if width == 32:
                return builder.bitcast(builder.trunc(v, ir.IntType(32)), ir.FloatType())
            return builder.bitcast(v, ir.DoubleType())

        return like(bits, like), codegen

    @overload(_exp)
    def exp_impl(x):
        if not isinstance(x, types.Float):
            return None
        ft = np.float32 if x.bitwidth == 32 else np.float64
        lo, hi = (ft(v) for v in _EXP_RANGE[x.bitwidth])
        log2e, half, one, two, zero = ft(_LOG2E), ft(0.5), ft(1), ft(2), ft(0)
        if x.bitwidth == 32:
            c1, c2 = ft(0.693359375), ft(-2.12194440e-4)
            p0, p1, p2, p3, p4, p5 = (ft(v) for v in _EXP32)

            def exp32(x):
                xc = hi if x > hi else x  # comparisons written so that NaN passes through
                xc = lo if xc < lo else xc
                n = np.floor(log2e * xc + half)
                r = xc - n * c1
                r = r - n * c2
                p = (((((p0 * r + p1) * r + p2) * r + p3) * r + p4) * r + p5) * (r * r) + r + one
                return zero if x < lo else p * float_from_bits((np.int32(n) + 127) << 23, x)

            return exp32
        c1, c2 = ft(6.93145751953125e-1), ft(1.42860682030941723212e-6)
        P0, P1, P2 = _EXP64_P
        Q0, Q1, Q2, Q3 = _EXP64_Q

        def exp64(x):
            xc = hi if x > hi else x
            xc = lo if xc < lo else xc
            n = np.floor(log2e * xc + half)
            r = xc - n * c1
            r = r - n * c2
            rr = r * r
            px = r * ((P0 * rr + P1) * rr + P2)
            e = one + two * (px / (((Q0 * rr + Q1) * rr + Q2) * rr + Q3 - px))
            return zero if x < lo else e * float_from_bits((np.int32(n) + 1023) << 52, x)

        return exp64

    @overload(_tanh)
    def tanh_impl(x):
        if not isinstance(x, types.Float):
            return None
        ft = np.float32 if x.bitwidth == 32 else np.float64
        one, two, cut = ft(1), ft(2), ft(0.625)
        if x.bitwidth == 32:
            t0, t1, t2, t3, t4 = (ft(v) for v in _TANH32)

            def tanh32(x):
                ax = abs(x)
                big = one - two / (_exp(ax + ax) + one)
                z = x * x
                small = ((((t0 * z + t1) * z + t2) * z + t3) * z + t4) * z * x + x
                return small if not ax >= cut else (big if x >= 0 else -big)

            return tanh32
        P0, P1, P2 = _TANH64_P
        Q0, Q1, Q2 = _TANH64_Q

        def tanh64(x):
            ax = abs(x)
            big = one - two / (_exp(ax + ax) + one)
            s = x * x
            small = x + x * s * (((P0 * s + P1) * s + P2) / (((s + Q0) * s + Q1) * s + Q2))
            return small if not ax >= cut else (big if x >= 0 else -big)

        return tanh64


# -- kernels: plain Python here, compiled by _compiled() on first use -------------------------------------


def _ids_in_range(ids, limit):
    """Whether every id lies in [0, limit): the kernels index without bounds checks."""
    for t in range(ids.shape[0]):
        for b in range(ids.shape[1]):
            if ids[t, b] < 0 or ids[t, b] >= limit:
                return False
    return True


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


def _rowsum(a):
    """Sum of a 1-D array; compiled with reassociation so it vectorises."""
    s = a.dtype.type(0)
    for k in range(a.size):
        s += a[k]
    return s


def _rowmax(a):
    """Largest element of a non-empty 1-D array (a NaN still ends as a NaN loss through its own exp).

    Four running maxima instead of one: a single chain of compare-selects is latency-bound,
    and LLVM does not vectorise the select form of a float max without fast-math selects.
    """
    n = a.size
    m0 = m1 = m2 = m3 = a[0]
    n4 = n - n % 4
    for k in range(0, n4, 4):
        m0 = a[k] if a[k] > m0 else m0
        m1 = a[k + 1] if a[k + 1] > m1 else m1
        m2 = a[k + 2] if a[k + 2] > m2 else m2
        m3 = a[k + 3] if a[k + 3] > m3 else m3
    for k in range(n4, n):
        m0 = a[k] if a[k] > m0 else m0
    m0 = m1 if m1 > m0 else m0
    m2 = m3 if m3 > m2 else m2
    return m2 if m2 > m0 else m0


def _sqdist(a, b):
    """Squared distance of two 1-D arrays; compiled with reassociation so it vectorises."""
    s = a.dtype.type(0)
    for k in range(a.size):
        d = a[k] - b[k]
        s += d * d
    return s


def _head(cfg, T, B, y_tok, y_dense, Z, dZ):
    """Summed loss over all rows of Z, and dL/dz into dZ for the rows from step ``lo`` on."""
    O = Z.shape[1]
    head = cfg[_HEAD]
    r0 = cfg[_LO] * B
    one = Z.dtype.type(1)
    half = Z.dtype.type(0.5)
    nb = Z.dtype.type(B)
    total = 0.0
    if head == _SOFTMAX:
        for r in range(T * B):
            z = Z[r]
            dz = dZ[r]  # scratch for the exponentials on rows that carry no gradient
            y = y_tok[r // B, r % B]
            m = _rowmax(z)
            for k in range(O):
                dz[k] = _exp(z[k] - m)
            s = _rowsum(dz)
            lse = m + math.log(s)
            total += lse - z[y]
            if r >= r0:
                scale = one / (s * nb)
                for k in range(O):
                    dz[k] = dz[k] * scale
                dz[y] = (_exp(z[y] - lse) - one) / nb
    else:
        yf = y_dense.reshape(T * B, O)
        for r in range(T * B):
            z, dz, yr = Z[r], dZ[r], yf[r]
            if head == _MSE_TANH:
                for k in range(O):
                    dz[k] = _tanh(z[k])
            else:
                for k in range(O):
                    dz[k] = z[k]
            total += half * _sqdist(dz, yr)
            if r >= r0:
                if head == _MSE_TANH:
                    for k in range(O):
                        dz[k] = (dz[k] - yr[k]) / nb * (one - dz[k] * dz[k])
                else:
                    for k in range(O):
                        dz[k] = (dz[k] - yr[k]) / nb
    return total


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


def _layer_out(ws, l):
    """Layer ``l``'s outputs as (T*B, dirs*H) rows: its ``Hs`` after the start state, or its ``[h_t, h_t_rev]``."""
    T, B = ws.T, ws.B
    if ws.cfg[_DIRS] == 1:
        return ws.Hs[l, 1:].reshape(T * B, ws.Hs.shape[3])
    return ws.Hc[l].reshape(T * B, ws.Hc.shape[3])


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


def _outputs(head, Z):
    """The model's outputs in place of the logits: softmax rows, ``tanh(z)``, or ``z`` as it is."""
    O = Z.shape[1]
    for r in range(Z.shape[0]):
        z = Z[r]
        if head == _SOFTMAX:
            m = _rowmax(z)
            for k in range(O):
                z[k] = _exp(z[k] - m)
            s = _rowsum(z)
            for k in range(O):
                z[k] = z[k] / s
        elif head == _MSE_TANH:
            for k in range(O):
                z[k] = _tanh(z[k])


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


_FASTMATH = {"_rowsum": {"reassoc"}, "_sqdist": {"reassoc"}}
_KERNELS = ("_ids_in_range", "_elman_forward", "_lstm_forward", "_gru_forward", "_elman_backward",
            "_lstm_backward", "_gru_backward", "_flip_time", "_sgd", "_rowsum", "_rowmax", "_sqdist", "_head",
            "_check_ids", "_layer_out", "_forward", "_unit_forward", "_join_directions", "_outputs",
            "_output_backward", "_backward", "_split_directions", "_unit_backward", "_sum_lanes", "_recurrent_grads",
            "_gru_after_grads", "_gru_before_grads", "_bias_grads", "_grads_below", "_token_grads", "_update", "_run")


def _compiled():
    """The compiled ``_run``; the first call swaps every kernel above for its ``njit`` dispatcher.

    The kernels call each other through module globals, so they are swapped in place;
    ``cache=True`` stores the machine code beside this file (or in ``NUMBA_CACHE_DIR``).
    """
    import numba

    module = globals()
    if not isinstance(module["_run"], numba.core.dispatcher.Dispatcher):
        _install_math()
        for name in _KERNELS:
            # relaxed flags only where a reduction should vectorise; elsewhere the maths stays IEEE
            fastmath = _FASTMATH.get(name, False)
            module[name] = numba.njit(cache=True, nogil=True, error_model="numpy", fastmath=fastmath)(module[name])
    return module["_run"]


# -- the backend ------------------------------------------------------------------------------------------


def _lanes(bptt, T: int) -> tuple[int, int, int]:
    """``(lo, lanes, reset)``: first step that gets gradient, open windows at once, whether they close."""
    bptt = bptt.effective(T)
    if bptt.mode == "tail":
        return T - bptt.k, 1, 0
    if bptt.mode == "truncated":
        return 0, bptt.k + 1, 1
    return 0, 1, 0


@dataclass
class _Workspace:
    arrays: dict  # the buffers by name (numba_state.WORK_FIELDS)
    struct: object  # numba_state.Work over them, with the int64 codes and this T's bptt window


_MAX_SHAPES = 8  # (T, B) workspaces kept at once


class NumbaBackend(Backend):
    """SPEC.md in Numba: fused @njit step loops around BLAS GEMMs, cached across processes."""
    knows = frozenset({"gru", "bidirectional", "reduced"})  # these spec additions are in its supports()

    name = "numba"
    package = "numba"
    variants = ("default",)

    def availability(self) -> tuple[bool, str]:
        """Whether numba (and scipy, whose BLAS numba's ``np.dot`` calls) can be imported; imports neither."""
        if importlib.util.find_spec("numba") is None:
            return False, "unavailable: numba not installed (pip install 'rnn-harness[numba]')"
        if importlib.util.find_spec("scipy") is None:
            return False, "unavailable: numba's np.dot needs scipy for BLAS (pip install scipy)"
        return True, ""

    def versions(self) -> dict[str, str]:
        """numba, llvmlite, numpy, and scipy (whose OpenBLAS does the GEMMs)."""
        import llvmlite
        import numba
        import scipy

        return {"numba": numba.__version__, "llvmlite": llvmlite.__version__, "numpy": np.__version__,
                "scipy": scipy.__version__}

    def supports(self, problem) -> tuple[bool, str]:
        """Every SPEC.md model (elman, lstm, gru, bidirectional layers), head, bptt mode, float32 and float64,
        on the CPU."""
        if problem.reduced:
            return unsupported(f"{self.full_name}'s compiled step multiplies in the parameters' dtype (float32 or "
                               f"float64); Numba has no bfloat16 type and no step that rounds the products' inputs "
                               f"to {problem.dtype} is written")
        return self.supports_device(problem.device)

    def prepare(self, problem, params, device="cpu", threads=1) -> None:
        """Copy the parameters into unit-stacked arrays; BLAS threads come from the worker's environment."""
        self._run = _compiled()
        self.problem = problem
        spec = problem.model
        dt = np.dtype(problem.dtype)
        L, H, dirs = spec.layers, spec.hidden, spec.directions
        G = spec.gates * H
        self._packed = spec.kind == "gru" and not spec.reset_after  # W_hh kept as (W_rz, W_n), see _pack
        names = self._name_map(spec)
        shapes = spec.param_shapes(problem.input_size, problem.output_size)

        def stacked(i, shape):
            """The stacked array ``i`` of ``_weights``, filled from the parameters that live in it."""
            a = np.zeros(shape, dt)
            for name, (j, idx) in names.items():
                if j == i:
                    v = np.asarray(params[name], dt).reshape(shapes[name])
                    a[idx] = _pack(v) if self._packed and name.startswith("W_hh") else v
            return a

        D = problem.input_size
        U = L * dirs  # units: a layer's directions
        self._weights = (
            stacked(0, (dirs, D, G)),  # W0
            stacked(1, ((L - 1) * dirs, dirs * H, G)),  # Wr
            stacked(2, (U, H, G)),  # Whh
            stacked(3, (U, G)),  # bb
            stacked(4, (U, 3, H)),  # P
            stacked(5, (dirs * H, problem.output_size)),  # Why
            stacked(6, (problem.output_size,)),  # by
            stacked(7, (U, H)),  # bhn
        )
        self._W0, self._Why = self._weights[0], self._weights[5]
        self._grads = tuple(np.zeros_like(w) for w in self._weights)
        from backends import numba_state  # after _compiled(): it needs Numba

        # the same arrays as the step's struct arguments, built once
        self._w, self._g = (numba_state.params(dict(zip(numba_state.PARAM_FIELDS, a)))
                            for a in (self._weights, self._grads))
        self._names = names
        self._dtype = dt
        self._clip = dt.type(spec.clip if spec.clip is not None else 0)
        head = _SOFTMAX if spec.head == "softmax_xent" else (_MSE_TANH if spec.output_act == "tanh" else _MSE)
        self._cfg = {
            _KIND: {"elman": _ELMAN, "lstm": _LSTM, "gru": _GRU}[spec.kind],
            _ACT: {"tanh": _TANH, "relu": _RELU, "sigmoid": _SIGMOID}[spec.activation],
            _HEAD: head, _TOKENS: int(problem.tokens), _LAYERS: L, _BIAS: int(spec.bias),
            _PEEP: int(spec.peephole), _CLIP: int(spec.clip is not None),
            _DIRS: dirs, _RAFTER: int(spec.reset_after),
        }
        self._work: dict[tuple[int, int], _Workspace] = {}
        # the kernels keep one zero-size stand-in per unused input so the signature never changes
        self._no_tokens = np.zeros((0, 0), np.int64)
        self._no_dense = np.zeros((0, 0, 0), dt)

    @staticmethod
    def _name_map(spec) -> dict[str, tuple[int, tuple]]:
        """Parameter name -> (index into the stacked arrays, index within it); unit ``l * dirs + d``."""
        names, dirs = {}, spec.directions
        for l in range(spec.layers):
            for d in range(dirs):
                s, u = layer_suffix(l, d), l * dirs + d
                names[spec.input_weight + s] = (0, (d,)) if l == 0 else (1, (u - dirs,))
                names["W_hh" + s] = (2, (u,))
                names[spec.bias_name + s] = (3, (u,))
                for k, p in enumerate(("p_i", "p_f", "p_o")):
                    names[p + s] = (4, (u, k))
                names["b_hn" + s] = (7, (u,))
        names["W_hy"], names["b_y"] = (5, ()), (6, ())
        return {k: names[k] for k in spec.param_names()}

    def _workspace(self, T: int, B: int) -> _Workspace:
        """Buffers for one (T, B), allocated on its first use and kept for the next few shapes."""
        ws = self._work.get((T, B))
        if ws is not None:
            return ws
        if len(self._work) >= _MAX_SHAPES:
            del self._work[next(iter(self._work))]
        spec, dt = self.problem.model, self._dtype
        L, H, dirs = spec.layers, spec.hidden, spec.directions
        U = L * dirs
        _, D, G = self._W0.shape
        O = self._Why.shape[1]
        lo, nl, reset = _lanes(spec.bptt, T)
        lstm, gru, bi = spec.kind == "lstm", spec.kind == "gru", dirs == 2
        cfg = np.zeros(_N_CFG, np.int64)
        for k, v in self._cfg.items():
            cfg[k] = v
        cfg[_LO], cfg[_LANES], cfg[_RESET] = lo, nl, reset
        none4 = (0, 0, 0, 0)
        arrays = {
            "Hs": np.zeros((U, T + 1, B, H), dt),
            "Cs": np.zeros((U, T + 1, B, H) if lstm else none4, dt),
            "Gs": np.zeros((U, T, B, G) if lstm or gru else none4, dt),  # gates (lstm i, f, g, o; gru r, z, n)
            "TCs": np.zeros((U, T, B, H) if lstm or gru else none4, dt),  # tanh(c); gru h W_hn + b_hn or r h
            "XP": np.zeros((T, B, G), dt),
            "tmp": np.zeros((B, G), dt),
            "Z": np.zeros((T * B, O), dt),
            "dZ": np.zeros((T * B, O), dt),
            "dH": np.zeros((dirs, T, B, H), dt),
            "dHl": np.zeros((T, nl, B, H) if nl > 1 and L > 1 else none4, dt),
            "DAs": np.zeros((T, B, G), dt),
            "DAl": np.zeros((T, nl, B, G) if nl > 1 else none4, dt),
            "dhn": np.zeros((nl, B, H), dt),
            "dcn": np.zeros((nl, B, H) if lstm else (0, 0, 0), dt),
            "mark": np.zeros(D if self.problem.tokens else 0, np.int8),
            "rows": np.zeros(T * B + 1, np.int64),  # (+ their count)
            "Hc": np.zeros((L, T, B, 2 * H) if bi else none4, dt),  # a bidirectional layer's [h_t, h_t_rev]
            "dHc": np.zeros((2, T, B, 2 * H) if bi else none4, dt),  # dL/d those rows (and a second buffer)
            "x_rev": np.zeros((T, B) if bi and self.problem.tokens else (0, 0), np.int64),
            "DUs": np.zeros((T, B, G) if gru else (0, 0, 0), dt),  # the recurrent side's dL/du
            "dus": np.zeros((nl, B, G) if gru else (0, 0, 0), dt),  # one step's of it, per lane
            "dan": np.zeros((nl, B, H) if gru else (0, 0, 0), dt),
            "drh": np.zeros((nl, B, H) if gru else (0, 0, 0), dt),
        }
        from backends import numba_state

        ws = self._work[(T, B)] = _Workspace(arrays, numba_state.work(T, B, cfg, arrays))
        return ws

    def _inputs(self, x):
        """``(x_tok, x_dense, T, B)`` as the kernel takes them."""
        x = np.asarray(x)
        if self.problem.tokens:
            if x.ndim != 2 or x.dtype.kind not in "iu":
                raise ValueError(f"expected token ids of shape (T, B), got {x.dtype} {x.shape}")
            return _writable(x, np.int64), self._no_dense, x.shape[0], x.shape[1]
        if x.ndim != 3 or x.shape[2] != self._W0.shape[1]:
            raise ValueError(f"expected dense inputs of shape (T, B, {self._W0.shape[1]}), got {x.shape}")
        return self._no_tokens, _writable(x, self._dtype), x.shape[0], x.shape[1]

    def _targets(self, y, T, B):
        y = np.asarray(y)
        O = self._Why.shape[1]
        if self.problem.model.head == "softmax_xent":
            if y.shape != (T, B):
                raise ValueError(f"expected class ids of shape ({T}, {B}), got {y.shape}")
            return _writable(y, np.int64), self._no_dense
        if y.shape != (T, B, O):
            raise ValueError(f"expected targets of shape ({T}, {B}, {O}), got {y.shape}")
        return self._no_tokens, _writable(y, self._dtype)

    def _call(self, mode, x, y, lr=0.0):
        x_tok, x_dense, T, B = self._inputs(x)
        if y is None:
            y_tok, y_dense = self._no_tokens, self._no_dense
        else:
            y_tok, y_dense = self._targets(y, T, B)
        ws = self._workspace(T, B)
        loss = self._run(mode, self._w, self._g, ws.struct, x_tok, x_dense, y_tok, y_dense, self._dtype.type(lr),
                         self._clip)
        return loss, ws

    def warm_up(self, batch) -> None:
        """Compile (or load from the disk cache) and touch this batch shape's buffers; parameters stay."""
        x, y = batch
        if y is None or self.problem.workload == "forward":
            self._call(_OUTPUTS, x, None)
        else:
            self._call(_GRADS, x, y)
            self._grads[0].fill(0)

    def forward(self, x) -> np.ndarray:
        """Softmax probabilities, or ``z`` / ``tanh(z)`` for the mse head, shaped (T, B, O)."""
        _, ws = self._call(_OUTPUTS, x, None)
        T, B = np.shape(x)[:2]
        return ws.arrays["Z"].reshape(T, B, -1).copy()

    def loss_and_grads(self, x, y):
        """Reported loss and copies of the gradients of the objective."""
        loss, _ = self._call(_GRADS, x, y)
        grads = self._named(self._grads)
        if self.problem.tokens:
            self._grads[0].fill(0)  # the step relies on a zero token-gradient buffer
        return float(loss), grads

    def sgd_step(self, x, y, lr: float) -> float:
        """Forward, BPTT and the in-place SGD update in one compiled call; returns the loss before it."""
        loss, _ = self._call(_STEP, x, y, lr)
        return float(loss)

    def _named(self, arrays) -> dict[str, np.ndarray]:
        out = {name: arrays[i][idx].copy() for name, (i, idx) in self._names.items()}
        if self._packed:
            out.update({k: _unpack(v) for k, v in out.items() if k.startswith("W_hh")})
        return out

    def get_params(self) -> dict[str, np.ndarray]:
        """Copies of the parameters under SPEC.md's names."""
        return self._named(self._weights)

    def close(self) -> None:
        """Drop the buffers."""
        self._work = {}


def _pack(W: np.ndarray) -> np.ndarray:
    """A reset-before GRU's ``W_hh`` (H, 3H) as the kernels keep it: ``W_hh[:, :2H]`` then ``W_hh[:, 2H:]``,
    each row-major, in the same (H, 3H) buffer, so that both of a step's products read contiguous matrices."""
    H = W.shape[0]
    return np.concatenate([W[:, :2 * H].ravel(), W[:, 2 * H:].ravel()]).reshape(W.shape)


def _unpack(W: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_pack`."""
    H = W.shape[0]
    flat = W.ravel()
    return np.concatenate([flat[:2 * H * H].reshape(H, 2 * H), flat[2 * H * H:].reshape(H, H)], axis=1)


def _writable(a: np.ndarray, dtype) -> np.ndarray:
    """C-contiguous, writable, of ``dtype``: read-only or strided arrays would compile a new signature."""
    if a.dtype != dtype or not a.flags.c_contiguous or not a.flags.writeable:
        return np.array(a, dtype=dtype, order="C")
    return a

"""SPEC.md as Numba kernels: fused per-step loops around BLAS products, one compiled graph per dtype.

The whole step (forward, head, BPTT, SGD update) runs in one ``@njit`` call. Model
choices (cell, activation, head, bptt mode, bias, peepholes, layers, token or dense
input) are small integers read at run time, so every model of the conformance matrix
shares the same two compiled specialisations (float32 and float64), and
``cache=True`` keeps them on disk for the next process.

Layout of the state the kernels share (``G = H`` for Elman, ``4H`` for the LSTM)::

    W0 (D, G)  layer 0 input weights      Wr (L-1, H, G)  input weights of layers 1..L-1
    Whh (L, H, G)   bb (L, G)   P (L, 3, H) peepholes i, f, o   Why (H, O)   by (O)
    Hs, Cs (L, T+1, B, H)  index 0 the zero start state;  Gs (L, T, B, 4H) gates i, f, g, o;
    TCs (L, T, B, H) tanh(c_t);  Z, dZ (T*B, O)

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
_ELMAN, _LSTM = 0, 1
_TANH, _RELU, _SIGMOID = 0, 1, 2
_SOFTMAX, _MSE, _MSE_TANH = 0, 1, 2
_OUTPUTS, _GRADS, _STEP = 0, 1, 2
# slots of the int64 ``cfg`` vector
_KIND, _ACT, _HEAD, _TOKENS, _LAYERS, _BIAS, _PEEP, _CLIP, _LO, _LANES, _RESET = range(11)
_N_CFG = 11


# -- elementwise maths ------------------------------------------------------------------------------------
# libm's tanh/exp are scalar calls that cost 20-50x NumPy's SIMD loops here. These are the Cephes
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


def _run(mode, cfg, T, B, x_tok, x_dense, y_tok, y_dense, lr, clip,
         W0, Wr, Whh, bb, P, Why, by, gW0, gWr, gWhh, gb, gP, gWhy, gby,
         Hs, Cs, Gs, TCs, XP, tmp, Z, dZ, dH, dHl, DAs, DAl, dhn, dcn, mark, rows):
    """One call: outputs (mode 0, into Z), loss and gradients (1), or a full SGD step (2).

    The arrays come flat, in the order of ``NumbaBackend``'s ``_weights``, ``_grads`` and a
    workspace's ``arrays`` (which name them): passed as three tuples instead, numba's dispatcher
    types the tuples on every call, measured 0.3 us (3-6%) slower per step at a tiny shape."""
    kind, act, tokens, L = cfg[_KIND], cfg[_ACT], cfg[_TOKENS] != 0, cfg[_LAYERS]
    lo, nl, reset = cfg[_LO], cfg[_LANES], cfg[_RESET] != 0
    bias = cfg[_BIAS] != 0  # without biases bb and by stay zero, so adding them is skipped
    D, G = W0.shape[0], W0.shape[1]
    H, O = Why.shape[0], Why.shape[1]
    zero = Z.dtype.type(0)
    if tokens and not _ids_in_range(x_tok, D):
        raise ValueError("token id out of range for the input size")
    if mode != _OUTPUTS and cfg[_HEAD] == _SOFTMAX and not _ids_in_range(y_tok, O):
        raise ValueError("class id out of range for the output size")

    # forward, layer by layer: the input projection of all steps is one GEMM
    for l in range(L):
        gather = tokens and l == 0
        if l > 0:
            np.dot(Hs[l - 1, 1:].reshape(T * B, H), Wr[l - 1], XP.reshape(T * B, G))
        elif not tokens:
            np.dot(x_dense.reshape(T * B, D), W0, XP.reshape(T * B, G))
        if kind == _ELMAN:
            _elman_forward(act, gather, x_tok, XP, W0, Whh[l], bb[l], Hs[l], tmp)
        else:
            _lstm_forward(gather, x_tok, XP, W0, Whh[l], bb[l], P[l], Hs[l], Cs[l], Gs[l], TCs[l], tmp)
    np.dot(Hs[L - 1, 1:].reshape(T * B, H), Why, Z)
    if bias:
        for r in range(T * B):
            for k in range(O):
                Z[r, k] += by[k]

    if mode == _OUTPUTS:
        for r in range(T * B):
            z = Z[r]
            if cfg[_HEAD] == _SOFTMAX:
                m = _rowmax(z)
                for k in range(O):
                    z[k] = _exp(z[k] - m)
                s = _rowsum(z)
                for k in range(O):
                    z[k] = z[k] / s
            elif cfg[_HEAD] == _MSE_TANH:
                for k in range(O):
                    z[k] = _tanh(z[k])
        return 0.0

    loss = _head(cfg, T, B, y_tok, y_dense, Z, dZ) / (B * T)

    # output layer, over the steps that carry gradient
    n = T - lo
    dZr = dZ[lo * B:]
    np.dot(Hs[L - 1, 1 + lo:].reshape(n * B, H).T, dZr, gWhy)
    gby[:] = zero
    if bias:
        for r in range(n * B):
            for k in range(O):
                gby[k] += dZr[r, k]
    np.dot(dZr, Why.T, dH[lo:].reshape(n * B, H))

    # layers top-down; lanes exist only for truncated windows
    gb[:] = zero
    gP[:] = zero
    lanes = DAs.reshape(T, 1, B, G) if nl == 1 else DAl
    for l in range(L - 1, -1, -1):
        lanes_in = nl > 1 and l < L - 1
        if kind == _ELMAN:
            _elman_backward(act, lo, reset, lanes_in, Hs[l], Whh[l], dH, dHl, lanes, dhn)
        else:
            _lstm_backward(lo, reset, lanes_in, Hs[l], Cs[l], Gs[l], TCs[l], Whh[l], P[l], dH, dHl, lanes, dhn, dcn)
        if nl > 1:
            for s in range(lo, T):
                for b in range(B):
                    acc = DAs[s, b]
                    acc[:] = zero
                    for r in range(nl):
                        src = DAl[s, r, b]
                        for j in range(G):
                            acc[j] += src[j]
        DAr = DAs[lo:].reshape(n * B, G)
        np.dot(Hs[l, lo:T].reshape(n * B, H).T, DAr, gWhh[l])
        if bias:
            for r in range(n * B):
                for j in range(G):
                    gb[l, j] += DAr[r, j]
        if kind == _LSTM and cfg[_PEEP] != 0:
            for s in range(lo, T):
                for b in range(B):
                    for j in range(H):
                        gP[l, 0, j] += DAs[s, b, j] * Cs[l, s, b, j]
                        gP[l, 1, j] += DAs[s, b, H + j] * Cs[l, s, b, j]
                        gP[l, 2, j] += DAs[s, b, 3 * H + j] * Cs[l, s + 1, b, j]
        if l > 0:
            np.dot(Hs[l - 1, 1 + lo:].reshape(n * B, H).T, DAr, gWr[l - 1])
            if nl == 1:
                np.dot(DAr, Wr[l - 1].T, dH[lo:].reshape(n * B, H))
            else:
                np.dot(DAl[lo:].reshape(n * nl * B, G), Wr[l - 1].T, dHl[lo:].reshape(n * nl * B, H))
        elif tokens:
            # gW0 is all zeros on entry; the step below zeroes the rows it touched
            count = 0
            for s in range(lo, T):
                for b in range(B):
                    row = x_tok[s, b]
                    if mark[row] == 0:
                        mark[row] = 1
                        rows[count] = row
                        count += 1
                    g_row = gW0[row]
                    src = DAs[s, b]
                    for j in range(G):
                        g_row[j] += src[j]
            for k in range(count):
                mark[rows[k]] = 0
            rows[T * B] = count
        else:
            np.dot(x_dense[lo:].reshape(n * B, D).T, DAr, gW0)

    if mode == _STEP:
        do_clip = cfg[_CLIP] != 0
        if tokens:
            # rows never gathered have zero gradient, so p - lr * 0 leaves them as they are
            for k in range(rows[T * B]):
                row = rows[k]
                _sgd(W0[row], gW0[row], lr, clip, do_clip)
                gW0[row] = zero
        else:
            _sgd(W0, gW0, lr, clip, do_clip)
        _sgd(Wr, gWr, lr, clip, do_clip)
        _sgd(Whh, gWhh, lr, clip, do_clip)
        _sgd(Why, gWhy, lr, clip, do_clip)
        if bias:
            _sgd(bb, gb, lr, clip, do_clip)
            _sgd(by, gby, lr, clip, do_clip)
        if kind == _LSTM and cfg[_PEEP] != 0:
            _sgd(P, gP, lr, clip, do_clip)
    return loss


_FASTMATH = {"_rowsum": {"reassoc"}, "_sqdist": {"reassoc"}}
_KERNELS = ("_ids_in_range", "_elman_forward", "_lstm_forward", "_elman_backward", "_lstm_backward",
            "_sgd", "_rowsum", "_rowmax", "_sqdist", "_head", "_run")


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
    cfg: np.ndarray  # the int64 codes, with this T's bptt window
    arrays: tuple  # Hs ... rows, in the order _run takes them


_MAX_SHAPES = 8  # (T, B) workspaces kept at once


class NumbaBackend(Backend):
    """SPEC.md in Numba: fused @njit step loops around BLAS GEMMs, cached across processes."""

    name = "numba"
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
        """Every SPEC.md model, head, bptt mode and dtype, on the CPU."""
        ok, why = self.supports_device(problem.device)
        if ok and problem.model.kind == "gru":
            return unsupported(f"{self.full_name}: its kernels implement the elman and lstm cells only, not gru")
        if ok and problem.model.bidirectional:
            return unsupported(f"{self.full_name}: its kernels run one direction per layer, not bidirectional layers")
        return ok, why

    def prepare(self, problem, params, device="cpu", threads=1) -> None:
        """Copy the parameters into layer-stacked arrays; BLAS threads come from the worker's environment."""
        self._run = _compiled()
        self.problem = problem
        spec = problem.model
        dt = np.dtype(problem.dtype)
        L, H = spec.layers, spec.hidden
        G = 4 * H if spec.kind == "lstm" else H
        win, bias = ("W_xh", "b_h") if spec.kind == "elman" else ("W_ih", "b")

        def get(name, shape):
            return np.array(params[name], dtype=dt, order="C") if name in params else np.zeros(shape, dt)

        sfx = [layer_suffix(l) for l in range(L)]
        self._W0 = get(win, None)
        self._Wr = np.stack([get(win + s, None) for s in sfx[1:]]) if L > 1 else np.zeros((0, H, G), dt)
        self._Whh = np.stack([get("W_hh" + s, None) for s in sfx])
        self._bb = np.stack([get(bias + s, (G,)) for s in sfx])
        self._P = np.stack([np.stack([get(p + s, (H,)) for p in ("p_i", "p_f", "p_o")]) for s in sfx])
        self._Why = get("W_hy", None)
        self._by = get("b_y", (self._Why.shape[1],))
        self._weights = (self._W0, self._Wr, self._Whh, self._bb, self._P, self._Why, self._by)
        self._grads = tuple(np.zeros_like(w) for w in self._weights)
        self._names = self._name_map(spec, win, bias)
        self._dtype = dt
        self._clip = dt.type(spec.clip if spec.clip is not None else 0)
        head = _SOFTMAX if spec.head == "softmax_xent" else (_MSE_TANH if spec.output_act == "tanh" else _MSE)
        self._cfg = {
            _KIND: _LSTM if spec.kind == "lstm" else _ELMAN,
            _ACT: {"tanh": _TANH, "relu": _RELU, "sigmoid": _SIGMOID}[spec.activation],
            _HEAD: head, _TOKENS: int(problem.tokens), _LAYERS: L, _BIAS: int(spec.bias),
            _PEEP: int(spec.peephole), _CLIP: int(spec.clip is not None),
        }
        self._work: dict[tuple[int, int], _Workspace] = {}
        # the kernels keep one zero-size stand-in per unused input so the signature never changes
        self._no_tokens = np.zeros((0, 0), np.int64)
        self._no_dense = np.zeros((0, 0, 0), dt)

    @staticmethod
    def _name_map(spec, win, bias) -> dict[str, tuple[int, tuple]]:
        """Parameter name -> (index into the stacked arrays, index within it)."""
        names = {}
        for l in range(spec.layers):
            s = layer_suffix(l)
            names[win + s] = (0, ()) if l == 0 else (1, (l - 1,))
            names["W_hh" + s] = (2, (l,))
            names[bias + s] = (3, (l,))
            for k, p in enumerate(("p_i", "p_f", "p_o")):
                names[p + s] = (4, (l, k))
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
        L, H = spec.layers, spec.hidden
        D, G = self._W0.shape
        O = self._Why.shape[1]
        lo, nl, reset = _lanes(spec.bptt, T)
        lstm = spec.kind == "lstm"
        cfg = np.zeros(_N_CFG, np.int64)
        for k, v in self._cfg.items():
            cfg[k] = v
        cfg[_LO], cfg[_LANES], cfg[_RESET] = lo, nl, reset
        arrays = (
            np.zeros((L, T + 1, B, H), dt),  # Hs
            np.zeros((L, T + 1, B, H) if lstm else (0, 0, 0, 0), dt),  # Cs
            np.zeros((L, T, B, G) if lstm else (0, 0, 0, 0), dt),  # Gs
            np.zeros((L, T, B, H) if lstm else (0, 0, 0, 0), dt),  # TCs
            np.zeros((T, B, G), dt),  # XP
            np.zeros((B, G), dt),  # tmp
            np.zeros((T * B, O), dt),  # Z
            np.zeros((T * B, O), dt),  # dZ
            np.zeros((T, B, H), dt),  # dH
            np.zeros((T, nl, B, H) if nl > 1 and L > 1 else (0, 0, 0, 0), dt),  # dHl
            np.zeros((T, B, G), dt),  # DAs
            np.zeros((T, nl, B, G) if nl > 1 else (0, 0, 0, 0), dt),  # DAl
            np.zeros((nl, B, H), dt),  # dhn
            np.zeros((nl, B, H) if lstm else (0, 0, 0), dt),  # dcn
            np.zeros(D if self.problem.tokens else 0, np.int8),  # mark
            np.zeros(T * B + 1, np.int64),  # rows (+ their count)
        )
        ws = self._work[(T, B)] = _Workspace(cfg, arrays)
        return ws

    def _inputs(self, x):
        """``(x_tok, x_dense, T, B)`` as the kernel takes them."""
        x = np.asarray(x)
        if self.problem.tokens:
            if x.ndim != 2 or x.dtype.kind not in "iu":
                raise ValueError(f"expected token ids of shape (T, B), got {x.dtype} {x.shape}")
            return _writable(x, np.int64), self._no_dense, x.shape[0], x.shape[1]
        if x.ndim != 3 or x.shape[2] != self._W0.shape[0]:
            raise ValueError(f"expected dense inputs of shape (T, B, {self._W0.shape[0]}), got {x.shape}")
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
        loss = self._run(mode, ws.cfg, T, B, x_tok, x_dense, y_tok, y_dense, self._dtype.type(lr), self._clip,
                         *self._weights, *self._grads, *ws.arrays)
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
        return ws.arrays[6].reshape(T, B, -1).copy()

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
        return {name: arrays[i][idx].copy() for name, (i, idx) in self._names.items()}

    def get_params(self) -> dict[str, np.ndarray]:
        """Copies of the parameters under SPEC.md's names."""
        return self._named(self._weights)

    def close(self) -> None:
        """Drop the buffers."""
        self._work = {}


def _writable(a: np.ndarray, dtype) -> np.ndarray:
    """C-contiguous, writable, of ``dtype``: read-only or strided arrays would compile a new signature."""
    if a.dtype != dtype or not a.flags.c_contiguous or not a.flags.writeable:
        return np.array(a, dtype=dtype, order="C")
    return a

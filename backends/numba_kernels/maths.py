"""Vectorisable exp and tanh for the kernels.

libm's tanh/exp are scalar calls, so a loop over them does not vectorise. These are the Cephes
polynomials (float32: expf/tanhf, float64: exp/tanh), written so LLVM vectorises them; the tests
hold them to 2 ulp of the correctly rounded values. The Python bodies below are what they compute;
_install_math() gives Numba the compiled versions.
"""

from __future__ import annotations

import math

import numpy as np

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


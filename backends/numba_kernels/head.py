"""The output layer's kernels: the loss and its gradient at the outputs (softmax cross-entropy, mse with
a linear or tanh output), the outputs alone for inference, and the row reductions they use."""

from __future__ import annotations

import math

from backends.numba_kernels.codes import _HEAD, _LO, _MSE_TANH, _SOFTMAX
from backends.numba_kernels.maths import _exp, _tanh


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

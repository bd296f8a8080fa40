"""The Numba step's kernels, by cell kind: ``elman``, ``lstm``, ``gru``, the output layer (``head``), the
step that walks layers and directions (``step``), the vectorisable maths (``maths``) and the integer
codes they branch on (``codes``). Plain Python until :func:`compiled` swaps each for its ``njit``
dispatcher; ``import backends.numba_kernels`` needs no Numba.

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

import types

from backends.numba_kernels import elman, gru, head, lstm, maths, step

#: the modules whose functions are kernels; they call each other through their module globals
_MODULES = (elman, lstm, gru, head, step)
#: relaxed flags only where a reduction should vectorise; elsewhere the maths stays IEEE
_FASTMATH = {"_rowsum": {"reassoc"}, "_sqdist": {"reassoc"}}


def compiled():
    """The compiled ``_run``; the first call swaps every kernel for its ``njit`` dispatcher.

    The kernels call each other through module globals (a kernel's own module's, or the name it imported
    from a sibling), so every module that holds a kernel's name gets the dispatcher; ``cache=True``
    stores the machine code beside each file (or in ``NUMBA_CACHE_DIR``).
    """
    import numba

    if isinstance(step._run, numba.core.dispatcher.Dispatcher):
        return step._run
    maths._install_math()
    kernels = {name: fn for module in _MODULES for name, fn in vars(module).items()
               if isinstance(fn, types.FunctionType) and fn.__module__ == module.__name__}
    jitted = {name: numba.njit(cache=True, nogil=True, error_model="numpy", fastmath=_FASTMATH.get(name, False))(fn)
              for name, fn in kernels.items()}
    for module in _MODULES:
        for name in set(vars(module)) & set(jitted):
            setattr(module, name, jitted[name])
    return step._run

"""Triton kernels of the ``cuda`` backend, one module per kernel family, and the engine that launches them.

Every module holds ``@triton.jit`` kernels and a thin wrapper per kernel that picks the block
size and the launch grid (the layout of Triton's tutorials 02-fused-softmax and 05-layer-norm):

    activations   the shared device functions (sigmoid, a stable tanh, the Elman nonlinearities)
    elementwise   one kernel per element-wise operation (cuda:naive) and the SGD update with clipping
    lstm          the fused LSTM step, forward and backward (peepholes optional)
    elman         the fused Elman step, forward and backward
    persistent    the persistent recurrent kernel: every time step of a layer in one launch, W_hh resident

GEMMs are cuBLAS through torch; only the element-wise work and the persistent recurrence are Triton.
The engine, by stage, imports neither torch nor triton at import time (the ``Net`` does, when built):

    net           Net: the parameters and state on the device, and the calls the backend makes
    graphed       GraphedNet: the same step replayed from CUDA graphs (cuda:graph)
    forward       every layer over all steps: per-gate, grouped, fused, wavefront, persistent
    head          logits, outputs, the loss and dL/dz
    backward      the training pass: forward, head, BPTT by stages
    weight_grads  the parameter gradients from the stages' da
    unfused       the cells op by op, forward and backward (cuda:naive, cuda:grouped)
    products      the GEMMs against a unit's weights in either layout
    streams       the wavefront's streams and events
    records       the forward record and the backward carry of a unit

The kernel modules import triton at import time: the backend imports them lazily, in ``prepare``.
Triton decides at decoration time whether a kernel is compiled or interpreted, so
``TRITON_INTERPRET=1`` (Triton's interpreter on CPU tensors, what CI checks the numerics with)
must be set before the first of them is imported.
"""

from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (>= 1): Triton's ``tl.arange`` extents."""
    return 1 << max(0, int(n) - 1).bit_length()


def ew_block(n: int) -> int:
    """Elements per program of an element-wise kernel over ``n`` elements.

    On a GPU 1024 (4 warps x 8 elements per thread keeps loads vectorised); under the
    interpreter, where programs run one after another in NumPy, as few programs as possible."""
    if interpreting():
        return min(next_pow2(n), 1 << 16)
    return 1024

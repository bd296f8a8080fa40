"""What the cuda backend's passes keep between steps: a unit's forward record and its backward carry.

Plain holders, no torch: the forward pass fills a :class:`Cache` per unit (a layer's direction), the
backward pass reads it and carries a :class:`Back` from stage to stage.
"""

from __future__ import annotations


class Cache:
    """One direction of one layer's forward record: ``inp`` the input it reads (time-reversed for a
    reverse direction), ``hs``/``cs`` (T+1, B, H) with the zero start at 0, ``gates`` (T, B, 4H): the
    LSTM's i, f, g, o, or the GRU's r, z, n and ``un`` (reset after) or ``r * h_prev`` (reset before)."""

    def __init__(self, inp, hs, cs, gates):
        self.inp, self.hs, self.cs, self.gates = inp, hs, cs, gates


class Back:
    """One layer's backward carry between stages and what it leaves for the combined GEMMs."""

    def __init__(self, da_all=None):
        self.da_all = da_all  # full / tail: every step's da in one (T, B, GB) buffer
        self.n_stages = 0
        self.dh_rec = None
        self.dc = None  # LSTM: dL/dc; GRU: the part of dL/dh_prev outside the dh_rec GEMM
        self.segments: list[tuple[int, int, object]] = []  # (first step, end step, da rows)
        self.dx: dict[int, object] = {}  # stage -> gradient w.r.t. the layer's input rows (wavefront)

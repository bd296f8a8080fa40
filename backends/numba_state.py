"""The Numba step's state as three structs: the parameters, their gradients and a workspace.

Imported by :func:`backends.numba_backend._compiled` only, so that ``import backends.numba_backend``
needs no Numba. The structs are ``numba.experimental.structref`` types: each is built once (per
``prepare``, per batch shape) and handed to every step as one argument. A structref's type is its
field types, so it pickles by name into ``cache=True``'s index and a second process loads the compiled
step from disk (a jitclass's type carries a per-process id and would compile again in every process).
Typing a struct argument reads the type it carries; plain tuples would be typed element by element on
every call.
"""

from __future__ import annotations

import numba
from numba.core import types
from numba.experimental import structref
from numba.extending import typeof_impl

# the stacked parameter arrays (layout in backends.numba_backend's docstring)
PARAM_FIELDS = ("W0", "Wr", "Whh", "bb", "P", "Why", "by", "bhn")
# a workspace: the batch shape and its int64 model codes, then the buffers (shapes in NumbaBackend._workspace)
WORK_FIELDS = ("T", "B", "cfg", "Hs", "Cs", "Gs", "TCs", "XP", "tmp", "Z", "dZ", "dH", "dHl", "DAs", "DAl", "dhn",
               "dcn", "mark", "rows", "Hc", "dHc", "x_rev", "DUs", "dus", "dan", "drh")


@structref.register
class ParamsType(types.StructRef):
    """Numba type of :class:`Params`."""


class Params(structref.StructRefProxy):
    """The parameters (or their gradients) as one struct; the arrays are shared with the caller's."""


@structref.register
class WorkType(types.StructRef):
    """Numba type of :class:`Work`."""


class Work(structref.StructRefProxy):
    """One batch shape's buffers as one struct; the arrays are shared with the caller's."""


structref.define_proxy(Params, ParamsType, PARAM_FIELDS)
structref.define_proxy(Work, WorkType, WORK_FIELDS)


# numba's generic typeof tries the buffer protocol on any object before it looks for the type a proxy carries
@typeof_impl.register(Params)
@typeof_impl.register(Work)
def _typeof_struct(val, c):
    return val._type


@numba.njit(cache=True)
def _new_params(W0, Wr, Whh, bb, P, Why, by, bhn):
    return Params(W0, Wr, Whh, bb, P, Why, by, bhn)


@numba.njit(cache=True)
def _new_work(T, B, cfg, Hs, Cs, Gs, TCs, XP, tmp, Z, dZ, dH, dHl, DAs, DAl, dhn, dcn, mark, rows, Hc, dHc, x_rev,
              DUs, dus, dan, drh):
    return Work(T, B, cfg, Hs, Cs, Gs, TCs, XP, tmp, Z, dZ, dH, dHl, DAs, DAl, dhn, dcn, mark, rows, Hc, dHc, x_rev,
                DUs, dus, dan, drh)


def params(arrays: dict) -> Params:
    """A :class:`Params` over ``arrays`` (by the names of ``PARAM_FIELDS``), built by a disk-cached function:
    the proxy's own constructor would compile again in every process."""
    return _new_params(*(arrays[k] for k in PARAM_FIELDS))


def work(T: int, B: int, cfg, arrays: dict) -> Work:
    """A :class:`Work` for one (T, B) over ``cfg`` and ``arrays`` (by the names of ``WORK_FIELDS``)."""
    return _new_work(T, B, cfg, *(arrays[k] for k in WORK_FIELDS[3:]))

"""SPEC.md as Numba kernels: fused per-step loops around BLAS products, one compiled graph per dtype.

The whole step (forward, head, BPTT, SGD update) runs in one ``@njit`` call. Model
choices (cell, activation, reset form, head, bptt mode, bias, peepholes, layers, directions,
token or dense input) are small integers read at run time, so every model of the conformance matrix
shares the same two compiled specialisations (float32 and float64), and
``cache=True`` keeps them on disk for the next process. ``_run`` takes the parameters, their
gradients and the batch shape's workspace as three structs (``backends/numba_state.py``, built once
each) and goes through the step's stages: ``_forward``, ``_head``, ``_output_backward``, ``_backward``
and ``_update``.

The kernels, by cell kind, and the layout of the state they share are in :mod:`backends.numba_kernels`;
the state's structs in ``backends/numba_state.py``; this module holds the class.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import numpy as np

from backends.base import Backend, unsupported
from backends.numba_kernels.codes import (
    _ACT, _BIAS, _CLIP, _DIRS, _ELMAN, _GRADS, _GRU, _HEAD, _KIND, _LANES, _LAYERS, _LO, _LSTM, _MSE, _MSE_TANH,
    _N_CFG, _OUTPUTS, _PEEP, _RAFTER, _RELU, _RESET, _SIGMOID, _SOFTMAX, _STEP, _TANH, _TOKENS)
from backends.numba_kernels.maths import _EXP_RANGE, _exp, _tanh  # noqa: F401  (the tests hold them to 2 ulp)
from harness.spec.model import layer_suffix


def _compiled():
    """The compiled step (:func:`backends.numba_kernels.compiled`; Numba is imported here, not before)."""
    from backends.numba_kernels import compiled

    return compiled()


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

"""Theano: ``theano.scan`` over the step, ``theano.grad``, and the SGD step as one
``theano.function(..., updates=[...])``, the way the original WildML RNN tutorial did it.

Theano-PyMC 1.1.2 needs numpy < 1.24, so it runs in the isolated environment
``theano`` (built by the harness from the recipe this class declares). In the main environment this module only answers
whether that environment exists or can be created; theano is imported only inside it.

The graph (shared with backends/pytensor_backend.py, PyTensor being Theano's fork),
for ``bptt: full``: each layer's input projection is one gather (tokens) or one GEMM
(dense) before its scan, the scan carries only the recurrence, and the output layer is
one GEMM after it. ``bptt: tail K`` is ``scan(truncate_gradient=K)`` with the loss that
is differentiated restricted to the last K steps, which is what the tutorial's output
layer inside the scan gives: nothing before step T-K reaches any gradient.
``bptt: truncated K`` (a window of K+1 steps behind every output) has no scan option:
after the forward scans, every output t > K gets its own window, steps t-K..t started
from the forward state after step t-K-1 with its gradient cut (``disconnected_grad``),
and all T-K-1 windows run as one scan of K+1 steps over (T-K-1)*B rows; outputs t <= K
reach back to the start, so their gradient is the forward scan's own.

The cells are Elman, LSTM and GRU (both reset forms: reset after is one recurrent product
per step, reset before two, ``r`` multiplying ``h`` between them). A bidirectional layer
(``bptt: full`` only) projects its input once per direction, and its scan carries both
directions' states side by side, the reverse one over the time-reversed projection, its
states reversed back and concatenated to the forward ones.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import sys
from types import SimpleNamespace

import numpy as np

from backends.base import Backend, unsupported
from harness.spec.environments import Recipe
from harness.spec.model import Problem, layer_suffix

ENVIRONMENT = "theano"


def merge_flags(ours: str, theirs: str | None) -> str:
    """``ours`` then ``theirs`` in one ``THEANO_FLAGS``-style string (the later entry wins)."""
    return ",".join(part for part in (ours, theirs) if part)


class ScanGraphBackend(Backend):
    """The scan-based graph and its three functions; subclasses supply the library."""
    knows = frozenset({"gru", "bidirectional", "reduced"})  # these spec additions are in its supports()

    compile_heavy = True

    # -- what a subclass provides ---------------------------------------------------------
    def _library(self) -> SimpleNamespace:
        """Namespace with tensor, shared, scan, grad, function, config, sigmoid, disconnected_grad
        and ``input(name, dtype, shape)`` (a symbolic input; ``shape`` may be used as static)."""
        raise NotImplementedError

    # -- protocol -------------------------------------------------------------------------
    def supports(self, problem: Problem) -> tuple[bool, str]:
        if problem.device != "cpu":
            return unsupported(f"{self.full_name} runs on the CPU only")
        if problem.reduced:
            return unsupported(f"{self.full_name}'s scan graph computes in the parameters' dtype (float32 or "
                               f"float64); a graph that rounds only the products' inputs to {problem.dtype} is not "
                               f"written (the library has no bfloat16 type, and a float16 graph would round every "
                               f"intermediate)")
        return True, ""

    def prepare(self, problem: Problem, params: dict[str, np.ndarray], device: str = "cpu", threads: int = 1) -> None:
        lib = self._library()
        self.problem = problem
        self._lib = lib
        self._fns: dict[str, object] = {}
        self._names = list(params)
        self._shared = {k: lib.shared(np.array(v, dtype=problem.dtype), name=k) for k, v in params.items()}
        with self._library_flags():
            self._build(lib)

    def warm_up(self, batch) -> None:
        x, y = batch
        if self.problem.workload == "forward":
            self._function("forward")(self._x(x))
            return
        step = self._function("step")
        # run it once (JIT linkers compile on the first call), then put the parameters back
        saved = self.get_params()
        step(self._x(x), self._y(y), np.asarray(0, self.problem.dtype))
        for k, v in saved.items():
            self._shared[k].set_value(v)

    def forward(self, x) -> np.ndarray:
        return np.asarray(self._function("forward")(self._x(x)))

    def loss_and_grads(self, x, y):
        loss, *grads = self._function("grads")(self._x(x), self._y(y))
        return float(loss), {k: np.array(g) for k, g in zip(self._names, grads)}

    def sgd_step(self, x, y, lr: float) -> float:
        return float(self._function("step")(self._x(x), self._y(y), np.asarray(lr, self.problem.dtype)))

    def get_params(self) -> dict[str, np.ndarray]:
        return {k: np.array(self._shared[k].get_value()) for k in self._names}

    def close(self) -> None:
        self._fns = {}

    # -- graph ------------------------------------------------------------------------------
    def _x(self, x):
        return np.asarray(x, dtype=np.int64 if self.problem.tokens else self.problem.dtype)

    def _y(self, y):
        return np.asarray(y, dtype=np.int64 if self.problem.model.head == "softmax_xent" else self.problem.dtype)

    def _mode(self):
        """The compilation mode handed to ``function`` (None: the library's default)."""
        return None

    @contextlib.contextmanager
    def blas_ldflags(self, ldflags: str):
        """Compile this instance's functions against another BLAS (``blas__ldflags``); for the BLAS probe."""
        with self._library().config.change_flags(blas__ldflags=ldflags):
            yield

    def _compile_flags(self) -> dict:
        """Library flags while building and compiling the graph."""
        # constants the library makes while building and rewriting (1 - sigmoid, ...) take
        # floatX: in float64 they would promote a float32 graph wherever the linker follows
        # NumPy's rules (JAX)
        return {"floatX": self.problem.dtype}

    def _library_flags(self):
        return self._lib.config.change_flags(**self._compile_flags())

    def _function(self, which: str):
        if which not in self._fns:
            with self._library_flags():
                self._fns[which] = self._compile(which)
        return self._fns[which]

    def _compile(self, which: str):
        g, lib, mode = self._graph, self._lib, self._mode()
        if which == "forward":
            return lib.function([g.x], g.outputs, mode=mode)
        if which == "grads":
            return lib.function([g.x, g.y], [g.loss, *g.grads], mode=mode)
        return lib.function([g.x, g.y, g.lr], g.loss, updates=g.updates, mode=mode)

    def _build(self, lib) -> None:
        pb, spec, p = self.problem, self.problem.model, self._shared
        T, dtype = lib.tensor, pb.dtype
        const = lambda v: np.asarray(v, dtype=dtype)  # noqa: E731  (typed, so float32 stays float32)
        steps = (pb.seq_len, pb.batch)
        x = lib.input("x", "int64", steps) if pb.tokens else lib.input("x", dtype, (*steps, pb.input_size))
        if spec.head == "softmax_xent":
            y = lib.input("y", "int64", steps)
        else:
            y = lib.input("y", dtype, (*steps, pb.output_size))
        lr = T.scalar("lr", dtype=dtype)
        n_steps, n_batch = x.shape[0], x.shape[1]
        n_rows = n_steps * n_batch
        bptt = spec.bptt.effective(pb.seq_len)
        truncate = bptt.k if bptt.mode == "tail" else -1

        # layer 0's gathered rows W_in[x], per direction, when the scans take them precomputed: (W_in, rows)
        self._token_rows: list[tuple] = []
        if truncate > 0:
            top = self._stacked_scan(lib, x, n_batch, truncate, const)
        else:
            top, layers = self._hoisted_scans(lib, x, n_steps, n_batch, const)
        # what the differentiated outputs read: per output, the state its gradient may reach back from
        grad_top = self._windows(lib, layers, bptt.k, n_steps, n_batch, const) if bptt.mode == "truncated" else top

        outputs, per_row = self._head(lib, top, y, n_rows, const)
        if grad_top is not top:  # the same values, with the truncated gradient
            per_row = self._head(lib, grad_top, y, n_rows, const)[1]
        per_step = per_row.reshape((n_steps, n_batch))
        loss = per_step.sum() / T.cast(n_rows, dtype)
        counted = per_step[-truncate:] if truncate > 0 else per_step
        objective = counted.sum() / T.cast(n_batch, dtype)

        params = [p[k] for k in self._names]
        grads = lib.grad(objective, params)
        steps = grads
        if spec.clip is not None:  # clipping shapes the update only; loss_and_grads reports the gradient
            steps = [T.clip(g, const(-spec.clip), const(spec.clip)) for g in grads]
        updates = [(v, v - lr * g) for v, g in zip(params, steps)]
        tables = self._token_rows
        if tables and spec.clip is None:
            # Only the rows of W_in (each direction's) that x names change: the update increments
            # them in place with their row gradients (duplicates accumulate) instead of building a
            # dense (D, G) gradient and rewriting all of W_in every step.
            others = [v for v in params if all(v is not W for W, _ in tables)]
            g_all = lib.grad(objective, others + [rows for _, rows in tables])
            updates = [(v, v - lr * g) for v, g in zip(others, g_all)]
            ids = x.flatten()
            updates += [(W, T.inc_subtensor(W[ids], -lr * g)) for (W, _), g in zip(tables, g_all[len(others):])]
        self._graph = SimpleNamespace(
            x=x, y=y, lr=lr, loss=loss, grads=grads,
            outputs=outputs.reshape((n_steps, n_batch, pb.output_size)), updates=updates)

    def _head(self, lib, top, y, n_rows, const):
        """``(outputs, per-row loss l)`` of the top layer's outputs ``top`` (T, B, directions*H), rows flattened."""
        pb, spec, p, T = self.problem, self.problem.model, self._shared, lib.tensor
        z = T.dot(top.reshape((n_rows, spec.directions * spec.hidden)), p["W_hy"])
        if "b_y" in p:
            z = z + p["b_y"]
        n_out = pb.output_size
        if spec.head == "softmax_xent":
            # the max only shifts for stability; logsumexp does not depend on it
            m = lib.disconnected_grad(z.max(axis=1, keepdims=True))
            lse = T.log(T.exp(z - m).sum(axis=1)) + m.flatten()
            picked = z.flatten()[T.arange(n_rows) * n_out + y.flatten()]
            return T.exp(z - lse.dimshuffle(0, "x")), lse - picked
        outputs = T.tanh(z) if spec.output_act == "tanh" else z
        diff = outputs - y.reshape((n_rows, n_out))
        return outputs, const(0.5) * (diff * diff).sum(axis=1)

    def _layer_weights(self, layer: int, direction: int = 0) -> tuple:
        """``(W_in, bias or None, recurrent)`` of one direction of one layer (ModelSpec's names).

        ``recurrent`` is what the cell's step reads besides its state (``_cell``'s ``rec``):
        elman ``[W_hh]``; lstm ``[W_hh]`` and the peepholes ``p_i, p_f, p_o`` when it has them;
        gru reset after ``[W_hh]`` and ``b_hn`` when it has biases; gru reset before
        ``[W_hh[:, :2H], W_hh[:, 2H:]]``: ``r`` multiplies ``h`` before the candidate's product, so
        the r, z product and the candidate's are two, and slicing once outside the scan keeps
        the slices (and their gradients' scatter into W_hh) out of every step.
        """
        spec, p, H = self.problem.model, self._shared, self.problem.model.hidden
        s = layer_suffix(layer, direction)
        W_in, W_hh, bias = p[spec.input_weight + s], p["W_hh" + s], p.get(spec.bias_name + s)
        if spec.kind == "gru" and not spec.reset_after:
            return W_in, bias, [W_hh[:, : 2 * H], W_hh[:, 2 * H:]]
        extra = ("p_i", "p_f", "p_o") if spec.kind == "lstm" else ("b_hn",) if spec.kind == "gru" else ()
        return W_in, bias, [W_hh] + [p[k + s] for k in extra if k + s in p]

    def _cell(self, lib, a_in, h_prev, c_prev, rec, const):
        """One step of one layer from ``a_in = x_t W_in + b`` and ``rec`` (``_layer_weights``):
        ``(h, c)``, ``c`` None but for the LSTM."""
        spec, T, H = self.problem.model, lib.tensor, self.problem.model.hidden
        if spec.kind == "gru":  # gate order r, z, n
            if spec.reset_after:  # one product for all three gates: n = tanh(a_n + r * (h W_hn + b_hn))
                u = T.dot(h_prev, rec[0])
                rz = lib.sigmoid(a_in[:, : 2 * H] + u[:, : 2 * H])
                un = u[:, 2 * H:] + rec[1] if len(rec) > 1 else u[:, 2 * H:]
                n = T.tanh(a_in[:, 2 * H:] + rz[:, :H] * un)
            else:  # Cho et al.: n = tanh(a_n + (r * h) W_hn), a second product after r
                rz = lib.sigmoid(a_in[:, : 2 * H] + T.dot(h_prev, rec[0]))
                n = T.tanh(a_in[:, 2 * H:] + T.dot(rz[:, :H] * h_prev, rec[1]))
            return n + rz[:, H:] * (h_prev - n), None  # (1 - z) n + z h
        a = a_in + T.dot(h_prev, rec[0])
        if spec.kind == "elman":
            if spec.activation == "tanh":
                return T.tanh(a), None
            if spec.activation == "sigmoid":
                return lib.sigmoid(a), None
            return T.switch(a > 0, a, const(0)), None  # derivative 0 at exactly 0, as in the reference
        peep = rec[1:]
        ai, af, ag, ao = a[:, :H], a[:, H:2 * H], a[:, 2 * H:3 * H], a[:, 3 * H:]  # gate order i, f, g, o
        if peep:
            ai = ai + peep[0] * c_prev
            af = af + peep[1] * c_prev
        i, f, g = lib.sigmoid(ai), lib.sigmoid(af), T.tanh(ag)
        c = f * c_prev + i * g
        if peep:
            ao = ao + peep[2] * c
        return lib.sigmoid(ao) * T.tanh(c), c

    def _step_rows(self, lib, W, ids):
        """``W[ids]`` for one step's token ids inside the scan."""
        return W[ids]

    def _project(self, lib, layer, inp, n_rows, direction=0):
        """``inp W_in + b`` of one direction of one layer over ``n_rows`` rows of ``inp``, as (n_rows, G)."""
        pb, spec, T = self.problem, self.problem.model, lib.tensor
        W_in, bias, _ = self._layer_weights(layer, direction)
        proj = T.dot(inp.reshape((n_rows, pb.input_size if layer == 0 else spec.directions * spec.hidden)), W_in)
        return proj if bias is None else proj + bias

    def _layer_scan(self, lib, layer, projs, starts, const):
        """One layer's recurrence, its directions side by side in one scan (one loop, not two):
        direction ``d`` runs over ``projs[d]`` (S, N, G), in its own time order, from
        ``starts[d] = (h0, c0 or None)``. Returns per direction ``(hs, cs or None)`` in that order."""
        lstm, n_dir = self.problem.model.kind == "lstm", len(projs)
        per = 2 if lstm else 1
        recs = [self._layer_weights(layer, d)[2] for d in range(n_dir)]

        def step(*args):
            a_ts, states, rest = args[:n_dir], args[n_dir:n_dir + per * n_dir], iter(args[n_dir + per * n_dir:])
            new = []
            for d, rec in enumerate(recs):
                c_prev = states[per * d + 1] if lstm else None
                h, c = self._cell(lib, a_ts[d], states[per * d], c_prev, [next(rest) for _ in rec], const)
                new += [h, c] if lstm else [h]
            return new

        outputs_info = [v for h0, c0 in starts for v in ((h0, c0) if lstm else (h0,))]
        outs = lib.scan(step, sequences=list(projs), outputs_info=outputs_info,
                        non_sequences=[w for rec in recs for w in rec])
        return [(outs[per * d], outs[per * d + 1] if lstm else None) for d in range(n_dir)]

    def _hoisted_scans(self, lib, x, n_steps, n_batch, const):
        """bptt full: each layer's input projections are one gather or GEMM per direction, its scan
        only the recurrence; a reverse direction scans its projection time-reversed and its states
        are reversed back, beside the forward ones: ``[h_t, h_t_rev]``.

        Returns the top layer's outputs (T, B, directions*H) and, per layer, its forward
        direction's ``(projection, hs, cs or None)``."""
        pb, spec, T = self.problem, self.problem.model, lib.tensor
        H, G = spec.hidden, spec.gates * spec.hidden
        zeros = T.zeros((n_batch, H), dtype=pb.dtype)
        start = (zeros, zeros if spec.kind == "lstm" else None)
        inp, layers = x, []
        for layer in range(spec.layers):
            projs = []
            for d in range(spec.directions):
                if layer == 0 and pb.tokens:
                    W_in, bias, _ = self._layer_weights(0, d)
                    rows = W_in[x.flatten()]  # a row gather, never a one-hot product
                    self._token_rows.append((W_in, rows))
                    proj = rows if bias is None else rows + bias
                else:
                    proj = self._project(lib, layer, inp, n_steps * n_batch, d)
                proj = proj.reshape((n_steps, n_batch, G))
                projs.append(proj[::-1] if d else proj)
            scanned = self._layer_scan(lib, layer, projs, [start] * len(projs), const)
            hs, cs = scanned[0]
            inp = T.concatenate([hs] + [hs_rev[::-1] for hs_rev, _ in scanned[1:]], axis=2) if spec.bidirectional \
                else hs
            layers.append((projs[0], hs, cs))
        return inp, layers

    def _windows(self, lib, layers, K, n_steps, n_batch, const):
        """bptt truncated K: the top layer's states (T, B, H), each output's reaching back K+1 steps.

        Output t = K+1+n (n < N = T-K-1) is recomputed in window n: steps n+1..t of every layer
        from that layer's forward state after step n, gradient cut there. The N windows run side
        by side as one scan of K+1 steps over N*B rows; outputs t <= K keep the forward's states.
        (One direction only: a bidirectional layer needs bptt full.)
        """
        spec, T, H = self.problem.model, lib.tensor, self.problem.model.hidden
        G = spec.gates * H
        N = n_steps - (K + 1)
        rows = N * n_batch
        # window n reads steps n+1 .. n+1+K: (K+1, N) step indices, k-major as the scan wants them
        steps = (T.arange(K + 1).dimshuffle(0, "x") + T.arange(1, N + 1).dimshuffle("x", 0)).flatten()
        for layer, (proj, hs, cs) in enumerate(layers):
            if layer == 0:
                win = proj[steps].reshape((K + 1, rows, G))
            else:
                win = self._project(lib, layer, win_h, (K + 1) * rows).reshape((K + 1, rows, G))
            h0 = lib.disconnected_grad(hs[:N]).reshape((rows, H))
            c0 = lib.disconnected_grad(cs[:N]).reshape((rows, H)) if cs is not None else None
            win_h = self._layer_scan(lib, layer, [win], [(h0, c0)], const)[0][0]
        top = layers[-1][1]
        return T.concatenate([top[: K + 1], win_h[-1].reshape((N, n_batch, H))])

    def _stacked_scan(self, lib, x, n_batch, truncate, const):
        """bptt tail: one scan over every layer with the projections inside the step, as the tutorial.

        Scan's gradient for a differentiable *sequence* under truncate_gradient has K rows
        instead of T (in Theano and PyTensor alike), so the only sequence here is the data.
        (One direction only: a bidirectional layer needs bptt full.)
        """
        pb, spec, T = self.problem, self.problem.model, lib.tensor
        lstm, n_layers = spec.kind == "lstm", spec.layers
        per_layer = [self._layer_weights(layer) for layer in range(n_layers)]
        weights = [w for W_in, bias, rec in per_layer for w in (W_in, bias, *rec) if w is not None]
        n_state = n_layers * (2 if lstm else 1)

        def step(x_t, *args):
            states, rest = list(args[:n_state]), iter(args[n_state:])
            inp, new = x_t, []
            for layer, (_, bias, rec) in enumerate(per_layer):
                W_in = next(rest)
                b = next(rest) if bias is not None else None
                rec_here = [next(rest) for _ in rec]
                a_in = self._step_rows(lib, W_in, inp) if (layer == 0 and pb.tokens) else T.dot(inp, W_in)
                if b is not None:
                    a_in = a_in + b
                h_prev, c_prev = (states[2 * layer], states[2 * layer + 1]) if lstm else (states[layer], None)
                h, c = self._cell(lib, a_in, h_prev, c_prev, rec_here, const)
                new += [h, c] if lstm else [h]
                inp = h
            return new

        zeros = T.zeros((n_batch, spec.hidden), dtype=pb.dtype)
        outs = lib.scan(step, sequences=[x], outputs_info=[zeros] * n_state, non_sequences=weights,
                        truncate_gradient=truncate)
        return outs[n_state - 2 if lstm else n_state - 1]


# -- Theano ------------------------------------------------------------------------------


def graph_compiler_flags(compiledir, ldflags: str, dtype: str | None) -> str:
    """Theano's and PyTensor's shared flags: compile cache folder, BLAS, floatX, C++ compiler."""
    flags = [f"base_compiledir={compiledir}", f"blas__ldflags={ldflags}"]
    if dtype:
        flags.append(f"floatX={dtype}")
    cxx = shutil.which("g++")
    if cxx:
        flags.append(f"cxx={cxx}")
    return ",".join(flags)


def theano_flags(dtype: str | None = None, threads: int | None = None) -> str:
    """The ``THEANO_FLAGS`` this backend runs with: cache in the environment, BLAS choice, compiler."""
    from backends import blas
    from harness.spec import environments as envs

    folder = envs.env_dir(ENVIRONMENT)
    ldflags = blas.choice_for(blas.read_choice(folder), threads)["ldflags"]
    return graph_compiler_flags(folder / "cache", ldflags, dtype)


def import_theano():
    """Import theano the way this backend needs it: flags set, Cython scan extension off."""
    if "theano" not in sys.modules:
        # Theano-PyMC's Cython scan loop cannot be built against this numpy; without it
        # scan runs its Python loop around the compiled C step
        sys.modules["theano.scan.scan_perform_ext"] = None
        os.environ["THEANO_FLAGS"] = merge_flags(theano_flags(), os.environ.get("THEANO_FLAGS"))
        # expected when blas__ldflags is empty: numpy's BLAS through its C-API is the chosen path
        logging.getLogger("theano.tensor.blas").setLevel(logging.ERROR)
    import theano

    return theano


class TheanoBackend(ScanGraphBackend):
    """Theano-PyMC 1.1.2 in its own environment, C code linked against the faster BLAS."""

    name = "theano"
    variants = ("default",)
    environment = ENVIRONMENT
    recipe = Recipe(
        packages=(
            "numpy==1.23.5",  # Theano-PyMC 1.1.2 uses np.bool, removed in numpy 1.24
            "scipy==1.10.1",
            "theano-pymc==1.1.2",
            "filelock",
            "setuptools<81",  # theano.gpuarray imports pkg_resources, gone from setuptools 81
            "PyYAML",
            "scipy-openblas32==0.3.34.0.0",  # a linkable OpenBLAS for Theano's C code
        ),
        max_python=(3, 11),
        check="from backends.theano_backend import import_theano; import_theano()",
        blas_probe="theano",
        needs_cxx=True,
    )
    compile_heavy = True

    def availability(self) -> tuple[bool, str]:
        from harness.spec import environments as envs

        if envs.current_env() == ENVIRONMENT:
            if importlib.util.find_spec("theano") is None:
                return False, "unavailable: theano is not installed in this environment"
            return True, ""
        return envs.availability_outside(ENVIRONMENT, self.recipe)

    @classmethod
    def environment_variables(cls, variant: str, threads: int, device: str, dtype: str) -> dict[str, str]:
        return {"THEANO_FLAGS": theano_flags(dtype, threads)}

    def versions(self) -> dict[str, str]:
        from backends import blas
        from harness.spec import environments as envs

        choice = blas.read_choice(envs.env_dir(ENVIRONMENT))
        out = {"numpy": np.__version__, "blas": blas.choice_for(choice)["choice"], "blas_probe": blas.describe(choice)}
        if out["blas"] == "openblas":
            out["blas_library"] = choice.get("library", "")
        if "theano" in sys.modules:
            out["theano"] = sys.modules["theano"].__version__
        return out

    def _library(self) -> SimpleNamespace:
        theano = import_theano()
        import theano.tensor as T
        from theano.gradient import disconnected_grad
        from theano.tensor.nnet import sigmoid

        def scan(fn, **kwargs):
            outputs, updates = theano.scan(fn, strict=True, **kwargs)
            assert not updates, "the RNN step has no random state or shared updates"
            return outputs if isinstance(outputs, list) else [outputs]

        def tensor_input(name, dtype, shape):
            return T.TensorType(dtype, (False,) * len(shape))(name)

        return SimpleNamespace(tensor=T, shared=theano.shared, scan=scan, grad=theano.grad, config=theano.config,
                               function=theano.function, sigmoid=sigmoid, disconnected_grad=disconnected_grad,
                               input=tensor_input)

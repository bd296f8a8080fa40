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
from harness.spec.model import Problem

ENVIRONMENT = "theano"


def merge_flags(ours: str, theirs: str | None) -> str:
    """``ours`` then ``theirs`` in one ``THEANO_FLAGS``-style string (the later entry wins)."""
    return ",".join(part for part in (ours, theirs) if part)


class ScanGraphBackend(Backend):
    """The scan-based graph and its three functions; subclasses supply the library."""

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
        if problem.model.kind == "gru":
            return unsupported(f"{self.full_name}: its scan graph implements the elman and lstm cells only, not gru")
        if problem.model.bidirectional:
            return unsupported(f"{self.full_name}: its scan graph runs one direction per layer, not bidirectional layers")
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

        self._token_rows = None  # layer 0's gathered rows W_in[x], when the scan takes them precomputed
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
        rows = self._token_rows
        if rows is not None and spec.clip is None:
            # Only the rows of W_in that x names change: the update increments them in place
            # with their row gradients (duplicates accumulate) instead of building a dense
            # (D, G) gradient and rewriting all of W_in every step.
            W_in = self._layer_weights(0)[0]
            others = [v for v in params if v is not W_in]
            *g_others, g_rows = lib.grad(objective, others + [rows])
            updates = [(v, v - lr * g) for v, g in zip(others, g_others)]
            updates.append((W_in, T.inc_subtensor(W_in[x.flatten()], -lr * g_rows)))
        self._graph = SimpleNamespace(
            x=x, y=y, lr=lr, loss=loss, grads=grads,
            outputs=outputs.reshape((n_steps, n_batch, pb.output_size)), updates=updates)

    def _head(self, lib, top, y, n_rows, const):
        """``(outputs, per-row loss l)`` of the top layer's states ``top`` (T, B, H), rows flattened."""
        pb, spec, p, T = self.problem, self.problem.model, self._shared, lib.tensor
        z = T.dot(top.reshape((n_rows, spec.hidden)), p["W_hy"])
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

    def _layer_weights(self, layer: int) -> tuple:
        """``(W_in, W_hh, bias or None, [p_i, p_f, p_o] or [])`` of one layer."""
        spec, p = self.problem.model, self._shared
        s = "" if layer == 0 else f"_{layer}"
        if spec.kind == "elman":
            return p["W_xh" + s], p["W_hh" + s], p.get("b_h" + s), []
        peep = [p["p_i" + s], p["p_f" + s], p["p_o" + s]] if spec.peephole else []
        return p["W_ih" + s], p["W_hh" + s], p.get("b" + s), peep

    def _cell(self, lib, a_in, h_prev, c_prev, W_hh, peep, const):
        """One step of one layer from ``a_in = x_t W_in + b``: ``(h, c)``, ``c`` None for Elman."""
        spec, T, H = self.problem.model, lib.tensor, self.problem.model.hidden
        a = a_in + T.dot(h_prev, W_hh)
        if spec.kind == "elman":
            if spec.activation == "tanh":
                return T.tanh(a), None
            if spec.activation == "sigmoid":
                return lib.sigmoid(a), None
            return T.switch(a > 0, a, const(0)), None  # derivative 0 at exactly 0, as in the reference
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

    def _project(self, lib, layer, inp, n_rows):
        """``inp W_in + b`` of one layer over ``n_rows`` rows of ``inp``, as (n_rows, G)."""
        pb, H, T = self.problem, self.problem.model.hidden, lib.tensor
        W_in, _, bias, _ = self._layer_weights(layer)
        proj = T.dot(inp.reshape((n_rows, pb.input_size if layer == 0 else H)), W_in)
        return proj if bias is None else proj + bias

    def _layer_scan(self, lib, layer, proj, h0, c0, const):
        """One layer's recurrence over ``proj`` (S, N, G) from ``h0`` (and ``c0``): ``(hs, cs or None)``."""
        _, W_hh, _, peep = self._layer_weights(layer)
        if self.problem.model.kind == "lstm":
            def step(a_t, h_prev, c_prev, W_hh, *peep):
                return list(self._cell(lib, a_t, h_prev, c_prev, W_hh, peep, const))

            hs, cs = lib.scan(step, sequences=[proj], outputs_info=[h0, c0], non_sequences=[W_hh, *peep])
            return hs, cs

        def step(a_t, h_prev, W_hh):
            return self._cell(lib, a_t, h_prev, None, W_hh, (), const)[0]

        return lib.scan(step, sequences=[proj], outputs_info=[h0], non_sequences=[W_hh])[0], None

    def _hoisted_scans(self, lib, x, n_steps, n_batch, const):
        """bptt full: each layer's input projection is one gather or GEMM, its scan only the recurrence.

        Returns the top layer's states (T, B, H) and, per layer, ``(projection, hs, cs or None)``."""
        pb, spec, T = self.problem, self.problem.model, lib.tensor
        H, lstm = spec.hidden, spec.kind == "lstm"
        zeros = T.zeros((n_batch, H), dtype=pb.dtype)
        inp, layers = x, []
        for layer in range(spec.layers):
            if layer == 0 and pb.tokens:
                W_in, _, bias, _ = self._layer_weights(0)
                proj = self._token_rows = W_in[x.flatten()]  # a row gather, never a one-hot product
                if bias is not None:
                    proj = proj + bias
            else:
                proj = self._project(lib, layer, inp, n_steps * n_batch)
            proj = proj.reshape((n_steps, n_batch, 4 * H if lstm else H))
            inp, cs = self._layer_scan(lib, layer, proj, zeros, zeros if lstm else None, const)
            layers.append((proj, inp, cs))
        return inp, layers

    def _windows(self, lib, layers, K, n_steps, n_batch, const):
        """bptt truncated K: the top layer's states (T, B, H), each output's reaching back K+1 steps.

        Output t = K+1+n (n < N = T-K-1) is recomputed in window n: steps n+1..t of every layer
        from that layer's forward state after step n, gradient cut there. The N windows run side
        by side as one scan of K+1 steps over N*B rows; outputs t <= K keep the forward's states.
        """
        spec, T, H = self.problem.model, lib.tensor, self.problem.model.hidden
        G = 4 * H if spec.kind == "lstm" else H
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
            win_h = self._layer_scan(lib, layer, win, h0, c0, const)[0]
        top = layers[-1][1]
        return T.concatenate([top[: K + 1], win_h[-1].reshape((N, n_batch, H))])

    def _stacked_scan(self, lib, x, n_batch, truncate, const):
        """bptt tail: one scan over every layer with the projections inside the step, as the tutorial.

        Scan's gradient for a differentiable *sequence* under truncate_gradient has K rows
        instead of T (in Theano and PyTensor alike), so the only sequence here is the data.
        """
        pb, spec, T = self.problem, self.problem.model, lib.tensor
        lstm, n_layers = spec.kind == "lstm", spec.layers
        per_layer = [self._layer_weights(layer) for layer in range(n_layers)]
        weights = [w for W_in, W_hh, bias, peep in per_layer for w in (W_in, W_hh, bias, *peep) if w is not None]
        n_state = n_layers * (2 if lstm else 1)

        def step(x_t, *args):
            states, rest = list(args[:n_state]), iter(args[n_state:])
            inp, new = x_t, []
            for layer, (_, _, bias, peep) in enumerate(per_layer):
                W_in, W_hh = next(rest), next(rest)
                b = next(rest) if bias is not None else None
                pp = [next(rest) for _ in peep]
                a_in = self._step_rows(lib, W_in, inp) if (layer == 0 and pb.tokens) else T.dot(inp, W_in)
                if b is not None:
                    a_in = a_in + b
                h_prev, c_prev = (states[2 * layer], states[2 * layer + 1]) if lstm else (states[layer], None)
                h, c = self._cell(lib, a_in, h_prev, c_prev, W_hh, pp, const)
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
        if envs.env_python(ENVIRONMENT) is not None:
            return True, ""
        ok, why = envs.can_create(ENVIRONMENT, self.recipe)
        if not ok:
            return False, f"unavailable: {why}"
        return True, "environment will be created on first use"

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

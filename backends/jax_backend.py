"""SPEC.md in JAX: ``lax.scan`` over time, ``jax.value_and_grad`` for BPTT, one jitted SGD step.

Layout of the computation (per layer, then the head)::

    a_x = W_xh[x] or x @ W_xh (+ b)      all T steps at once, outside the recurrence
    h_t = cell(a_x[t] + h_{t-1} W_hh)    lax.scan (or a Python loop) over t
    z   = h @ W_hy + b_y                 all T steps at once

Every cell groups its gates in one GEMM per step: (H, 4H) for the LSTM, (H, 3H) for the GRU
after the reset (gates r, z, n; ``r * (h W_hn + b_hn)``). The GRU before the reset needs ``r``
before its candidate's product, so it takes two per step, ``h W_hh[:, :2H]`` then
``(r * h) W_hh[:, 2H:]``, as every implementation of that form does. A bidirectional layer
runs its reverse direction as a second scan with ``reverse=True`` (outputs stay in time
order) and concatenates the two directions' outputs, (T, B, 2H).

``value_and_grad`` differentiates all of it; the recurrence alone has a custom VJP (a
reverse scan that differentiates each Elman or LSTM step's elementwise part with ``jax.vjp``;
the GRU's step, split around its products, is differentiated by hand), so that
``dW_hh`` is one GEMM over all T*B rows after the loop instead of a thin product
accumulated in every iteration (``benchmarks/measure_jax_unroll.py`` and the runs under
``results/examples/`` say by how much at each shape).

``bptt`` modes:

* ``truncated: K`` carries ``N = K+1`` lanes of the same state side by side, shape (N, B, H).
  Lane ``j`` restarts (a stop-gradient on its incoming state) at every step ``t`` with
  ``t % N == j``, so the lane read by output ``t``, ``(t+1) % N``, last restarted at
  ``t-K``: its gradient reaches back through steps ``t..t-K`` exactly as SPEC.md asks.
  All lanes hold the same values; the lanes only shape the gradient, and cost one
  (N*B, H) x (H, G) product per step instead of a (B, H) x (H, G) one.
* ``tail: K`` runs the first ``T-K`` steps and their outputs on stop-gradiented
  parameters (constants to AD), then the last ``K`` steps from that constant state.

With token input and no ``clip``, the SGD step differentiates with respect to the
gathered rows ``W_xh[x]`` and scatter-adds ``-lr`` times their gradients into ``W_xh``
in place, as a sparse update, rather than subtracting a dense (D, H) gradient.

Variants choose how the recurrence is unrolled: ``unroll=1``, ``unroll=4`` and
``unroll=T`` (full) pass that to ``lax.scan``; ``python`` is a Python for-loop over t
inside the jitted function; ``default`` is described on :class:`JaxBackend`.

Mixed precision (``bfloat16``, ``float16``) follows the spec's roundings: every product is
``lax.dot_general`` of its inputs cast to the low type with ``preferred_element_type=float32``
(:func:`_matmul`; its VJP, written out, casts the cotangent alike), while the parameters,
state, element-wise maths, head and update stay float32. ``float16`` multiplies the
objective by the loss scale and divides the gradients by it; a non-finite gradient makes
the step's loss NaN (the cell is diverged).

float64 needs JAX's x64 mode, a process-wide switch, set by :func:`use_precision` alone: a
worker starts with it as that rule says (``JAX_ENABLE_X64`` from :meth:`JaxBackend.environment_variables`),
and ``prepare`` turns it on for a float64 problem in a process that started without it, never off. Every array here is created with an explicit dtype, so float32 problems
compute in float32 whether or not x64 is on.

Compiled executables go to JAX's persistent compilation cache under the harness folder
(``.harness/cache/jax``) unless JAX already has a cache folder, so a repeated cell or
conformance case loads its executable instead of compiling it again (``compile_s``
then measures the load; ``versions()`` records the folder).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, NamedTuple

import numpy as np

from backends.base import Backend, unsupported
from harness.spec.dtype import DType
from harness.spec.model import Problem
from harness.spec.model import layer_suffix as _sfx

#: the unroll the ``default`` variant passes to ``lax.scan`` (why: JaxBackend's docstring)
DEFAULT_UNROLL = 1

#: XLA's CPU Eigen thread pool off: one thread per matrix product
SINGLE_THREAD_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"

#: On a GPU, XLA's autotuning of every fusion makes a cold compile of even a small step many
#: times slower than at level 0, for the same step time; level 0 is the default and the
#: ``autotune`` variant keeps XLA's own level, its results kept with the compilation cache.
GPU_XLA_FLAGS = "--xla_gpu_autotune_level=0"


def _variant_loop(variant: str, seq_len: int) -> tuple[int, bool]:
    """``(unroll, python_loop)`` for a variant at sequence length ``seq_len``."""
    if variant == "python":
        return 1, True
    if variant in ("default", "autotune"):
        return min(DEFAULT_UNROLL, seq_len), False
    unroll = variant.partition("=")[2]
    return (seq_len if unroll == "T" else min(int(unroll), seq_len)), False


def use_precision(dtype, jax=None, switch_off: bool = False) -> dict[str, str]:
    """JAX's float width for ``dtype``, the one place it is set: x64 on for float64. With ``jax`` (the
    module, imported), the switch is turned on in this process, and off too with ``switch_off`` (PyTensor's
    JAX sums of float32 return float64 with it on); without, the variable a worker starts with."""
    x64 = DType.of(dtype).double
    if jax is not None and (x64 or switch_off) and _x64_enabled(jax) != x64:
        jax.config.update("jax_enable_x64", x64)
    return {"JAX_ENABLE_X64": "1" if x64 else "0"}


def _x64_enabled(jax) -> bool:
    return jax.dtypes.canonicalize_dtype(np.float64) == np.float64


def _use_compilation_cache(jax) -> None:
    """Keep compiled executables under the harness folder, unless JAX already has a cache folder."""
    from harness.spec.environments import cache_dir

    if getattr(jax.config, "jax_compilation_cache_dir", None):
        return
    jax.config.update("jax_compilation_cache_dir", str(cache_dir("jax")))
    # The step graphs here compile in well under JAX's default 1 s threshold, and there are many of them.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    try:  # GPU autotuning results persist beside the executables (jax:autotune's cold compile, once)
        jax.config.update("jax_persistent_cache_enable_xla_caches", "xla_gpu_per_fusion_autotune_cache_dir")
    except AttributeError:  # a JAX without the option: only the executables are cached
        pass


class _Net(NamedTuple):
    """What the pure functions of one problem are built from (static: shapes, modes, the variant's loop)."""

    problem: Problem
    T: int
    B: int
    H: int
    dtype: Any  # jnp.dtype
    lstm: bool
    gru: bool
    mode: str  # the effective bptt mode for T
    K: int | None
    n_lanes: int  # open truncation windows at once
    act: Any  # the Elman activation
    in_name: str  # layer 0's input weights
    unroll: int
    python_loop: bool
    recurrence: Any = None  # per direction, the layer recurrence with its hand-written VJP (see _recurrence)
    mm: Any = None  # every product of the network (_matmul)

    @property
    def tables(self) -> tuple[str, ...]:
        """Token input: each direction's layer-0 input weights, read as row tables (a gather)."""
        return tuple(self.in_name + _sfx(0, d) for d in range(self.spec.directions)) if self.problem.tokens else ()

    @property
    def spec(self):
        return self.problem.model


def _matmul(problem: Problem):
    """``a @ b`` (``a`` (..., K), ``b`` (K, N)) as the problem's products are computed: plain, or under mixed
    precision of the inputs cast to the low type and summed in float32, with a VJP whose two products
    are made the same way (AD of the casts would leave the cotangent in float32 and round the products'
    outputs instead)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    if not problem.reduced:
        return jnp.matmul
    low = jnp.dtype(problem.dtype)

    def product(a, b):
        return lax.dot_general(a.astype(low), b.astype(low), (((a.ndim - 1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)

    @jax.custom_vjp
    def mm(a, b):
        return product(a, b)

    def mm_fwd(a, b):
        return product(a, b), (a, b)

    def mm_bwd(res, g):
        a, b = res
        return product(g, b.T), product(a.reshape(-1, a.shape[-1]).T, g.reshape(-1, g.shape[-1]))

    mm.defvjp(mm_fwd, mm_bwd)
    return mm


def _net(problem: Problem, unroll: int, python_loop: bool) -> _Net:
    import jax
    import jax.numpy as jnp

    spec, T = problem.model, problem.seq_len
    bptt = spec.bptt.effective(T)
    act = {"tanh": jnp.tanh, "relu": jax.nn.relu, "sigmoid": jax.nn.sigmoid}[spec.activation]
    n = _Net(problem, T, problem.batch, spec.hidden, jnp.dtype(problem.master_dtype), spec.kind == "lstm",
             spec.kind == "gru", bptt.mode, bptt.k, bptt.k + 1 if bptt.mode == "truncated" else 1, act,
             spec.input_weight, unroll, python_loop, mm=_matmul(problem))
    return n._replace(recurrence=(_recurrence(n, False), _recurrence(n, True)))


def _layer_params(n: _Net, p, layer, direction=0):
    s, spec = _sfx(layer, direction), n.spec
    lp = {"W_hh": p["W_hh" + s]}
    if not (layer == 0 and n.problem.tokens):  # token rows arrive already gathered (``_embed``)
        lp["W_in"] = p[n.in_name + s]
    if spec.bias:
        lp["b"] = p[spec.bias_name + s]
        if n.gru and spec.reset_after:
            lp["b_hn"] = p["b_hn" + s]
    if spec.peephole:
        lp.update(p_i=p["p_i" + s], p_f=p["p_f" + s], p_o=p["p_o" + s])
    return lp


def _embed(n: _Net, p, x):
    """Layer 0's ``x_t W_in`` rows for token ids, one tuple entry per direction (a gather, never one-hot);
    dense rows as they are."""
    return tuple(p[t][x] for t in n.tables) if n.problem.tokens else x


def _in_proj(n: _Net, lp, inp, layer, direction=0):
    """``x_t W_in (+ b)`` for every step at once: one GEMM, or the embedded token rows."""
    a = inp[direction] if (layer == 0 and n.problem.tokens) else n.mm(inp, lp["W_in"])
    return a + lp["b"] if n.spec.bias else a


def _point(n: _Net, peep, a, state_prev):
    """The elementwise part of an Elman or LSTM step: pre-activation ``a`` -> new state ``(h,)`` or ``(h, c)``."""
    import jax
    import jax.numpy as jnp

    if not n.lstm:
        return (n.act(a),)
    c = state_prev[1]
    ai, af, ag, ao = jnp.split(a, 4, axis=-1)  # gate order i, f, g, o
    if n.spec.peephole:
        ai, af = ai + peep["p_i"] * c, af + peep["p_f"] * c
    i, f, g = jax.nn.sigmoid(ai), jax.nn.sigmoid(af), jnp.tanh(ag)
    c = f * c + i * g
    o = jax.nn.sigmoid(ao + peep["p_o"] * c if n.spec.peephole else ao)
    return (o * jnp.tanh(c), c)


def _step(n: _Net, W, ep, a_t, state):
    """One step from the input pre-activation ``a_t``: ``(new state, what the backward step reads)``.

    ``W`` is ``W_hh``, or for a reset-before GRU its pair ``(W_hh[:, :2H], W_hh[:, 2H:])``: the reset
    gate comes between the two products. ``ep`` holds the elementwise parameters (peepholes, ``b_hn``)."""
    import jax
    import jax.numpy as jnp

    h = state[0]
    if not n.gru:
        a = a_t + n.mm(h, W)
        return _point(n, ep, a, state), (a, state)
    H2 = 2 * n.H
    if n.spec.reset_after:  # gates r, z, n from one product h W_hh
        u = n.mm(h, W)
        rz = jax.nn.sigmoid(a_t[..., :H2] + u[..., :H2])
        un = u[..., H2:] + ep["b_hn"] if "b_hn" in ep else u[..., H2:]
        r, z = rz[..., :n.H], rz[..., n.H:]
        cand = jnp.tanh(a_t[..., H2:] + r * un)
        res = (r, z, cand, h, un)
    else:  # r before the second product: (r * h) W_hh[:, 2H:]
        W_rz, W_n = W
        rz = jax.nn.sigmoid(a_t[..., :H2] + n.mm(h, W_rz))
        r, z = rz[..., :n.H], rz[..., n.H:]
        cand = jnp.tanh(a_t[..., H2:] + n.mm(r * h, W_n))
        res = (r, z, cand, h)
    return (cand + z * (h - cand),), res


def _step_bwd(n: _Net, W, ep, res, d_new):
    """The step backwards: ``(dL/d a_t, dL/d previous state, dL/d ep)`` from ``dL/d new state``."""
    import jax
    import jax.numpy as jnp

    if not n.gru:
        a, state_prev = res
        _, vjp = jax.vjp(lambda a_, s_, p_: _point(n, p_, a_, s_), a, state_prev, ep)
        da, d_prev, dp = vjp(d_new)
        return da, (d_prev[0] + n.mm(da, W.T),) + tuple(d_prev[1:]), dp
    dh = d_new[0]
    r, z, cand, h = res[:4]
    da_n = dh * (1 - z) * (1 - cand * cand)
    da_z = dh * (h - cand) * (z * (1 - z))
    if n.spec.reset_after:
        da_r = da_n * res[4] * (r * (1 - r))
        du = jnp.concatenate([da_r, da_z, da_n * r], axis=-1)
        d_prev = dh * z + n.mm(du, W.T)
    else:
        W_rz, W_n = W
        d_rh = n.mm(da_n, W_n.T)
        da_r = d_rh * h * (r * (1 - r))
        d_prev = dh * z + d_rh * r + n.mm(jnp.concatenate([da_r, da_z], axis=-1), W_rz.T)
    return jnp.concatenate([da_r, da_z, da_n], axis=-1), (d_prev,), {}


def _weight_grads(n: _Net, ep, res, das):
    """``(dL/dW, dL/d ep)`` from every step's residuals and ``dL/d a``: GEMMs over all steps' rows
    (the peepholes' gradients are summed inside the backward loop)."""
    import jax.numpy as jnp

    def gemm(left, right):  # sum over steps (and lanes, rows) of left^T right
        return n.mm(left.reshape(-1, left.shape[-1]).T, right.reshape(-1, right.shape[-1]))

    if not n.gru:
        return gemm(res[1][0], das), None
    H2 = 2 * n.H
    r, h = res[0], res[3]
    if n.spec.reset_after:
        du_n = das[..., H2:] * r
        d_W = gemm(h, jnp.concatenate([das[..., :H2], du_n], axis=-1))
        return d_W, ({"b_hn": du_n.reshape(-1, n.H).sum(axis=0)} if "b_hn" in ep else {})
    return (gemm(h, das[..., :H2]), gemm(r * h, das[..., H2:])), {}  # the pair W_hh was split into


def _loop(n: _Net, body, carry, xs, length, reverse=False):
    """``lax.scan`` with the variant's unroll, or a Python loop over the steps (variant ``python``)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    if not n.python_loop:
        return lax.scan(body, carry, xs, length=length, reverse=reverse, unroll=max(1, min(n.unroll, length)))
    ys = [None] * length
    for t in reversed(range(length)) if reverse else range(length):
        carry, ys[t] = body(carry, jax.tree.map(lambda v: v[t], xs))
    return carry, jax.tree.map(lambda *v: jnp.stack(v), *ys)


def _run_layer(n: _Net, W, ep, a_x, state0, restart, keep: bool, reverse: bool):
    """Forward over the steps of ``a_x`` (from the last one when ``reverse``): ``(final state, hs)``,
    plus the residuals when ``keep``."""

    def body(state, xs):
        a_t, _ = xs
        new, res = _step(n, W, ep, a_t, state)
        return new, ((new[0], res) if keep else new[0])

    final, ys = _loop(n, body, state0, (a_x, restart), a_x.shape[0], reverse)
    return ((final, ys[0]), (W, ep, ys[1], restart, a_x.ndim)) if keep else (final, ys)


def _recurrence(n: _Net, reverse: bool):
    """One layer's recurrence ``(W, ep, a_x, state0, restart) -> (final state, hs)``, run from the last
    step to the first when ``reverse`` (a bidirectional layer's reverse direction; hs stay in time order).

    It gets a hand-written VJP for one reason: the weight gradient dW_hh = sum_t h_{t-1}^T da_t
    becomes one GEMM over all T*B rows after the loop, where AD of the scan would accumulate a
    thin (H, G) product in every iteration. Each Elman or LSTM step's elementwise part is still
    differentiated by jax.vjp; the GRU's step (two products before the reset) is written out."""
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def recurrence(W, ep, a_x, state0, restart):
        return _run_layer(n, W, ep, a_x, state0, restart, False, reverse)

    def recurrence_fwd(W, ep, a_x, state0, restart):
        return _run_layer(n, W, ep, a_x, state0, restart, True, reverse)

    def recurrence_bwd(res, cts):
        W, ep, steps, restart, a_x_ndim = res
        ct_final, ct_hs = cts
        loop_ep = {} if n.gru else ep  # the GRU's b_hn gradient is a sum after the loop

        def body(carry, xs):
            d_state, d_ep = carry
            res_t, ct_h, r_t = xs
            d_new = (d_state[0] + ct_h,) + tuple(d_state[1:])
            da, d_prev, dp = _step_bwd(n, W, ep, res_t, d_new)
            if r_t is not None:  # a lane that restarts here saw its incoming state as a constant
                d_prev = tuple(jnp.where(r_t[:, None, None], jnp.zeros_like(d), d) for d in d_prev)
            return (d_prev, jax.tree.map(jnp.add, d_ep, dp)), da

        (d_state0, d_ep), das = _loop(n, body, (ct_final, jax.tree.map(jnp.zeros_like, loop_ep)),
                                      (steps, ct_hs, restart), ct_hs.shape[0], reverse=not reverse)
        d_W, d_ep_after = _weight_grads(n, ep, steps, das)
        # layer 0's input projection is shared by all truncation lanes
        d_a_x = das.sum(axis=1) if das.ndim > a_x_ndim else das
        return d_W, (d_ep_after if n.gru else d_ep), d_a_x, d_state0, None

    recurrence.defvjp(recurrence_fwd, recurrence_bwd)
    return recurrence


def _recur(n: _Net, lp, state, a_x, restart, reverse=False):
    """Run the layer over the leading axis of ``a_x``; ``restart`` (steps, lanes) marks stop-gradients."""
    ep = {k: lp[k] for k in ("p_i", "p_f", "p_o", "b_hn") if k in lp}
    W = lp["W_hh"]
    if n.gru and not n.spec.reset_after:  # split once, outside the loop
        W = (W[:, :2 * n.H], W[:, 2 * n.H:])
    return n.recurrence[int(reverse)](W, ep, a_x, state, restart)


def _zeros_state(n: _Net, lanes: int):
    import jax.numpy as jnp

    shape = (lanes, n.B, n.H) if lanes > 1 else (n.B, n.H)
    return tuple(jnp.zeros(shape, n.dtype) for _ in range(2 if n.lstm else 1))


def _layer(n: _Net, p, layer, inp, lanes=1, restart=None):
    """One layer over every step from zero states; a bidirectional layer's outputs are ``[h_t, h_t_rev]``."""
    import jax.numpy as jnp

    hs = []
    for d in range(n.spec.directions):
        lp = _layer_params(n, p, layer, d)
        hs.append(_recur(n, lp, _zeros_state(n, lanes), _in_proj(n, lp, inp, layer, d), restart, d == 1)[1])
    return hs[0] if len(hs) == 1 else jnp.concatenate(hs, axis=-1)


def _top_hidden(n: _Net, p, inp, mode):
    """Top layer's h, (T, B, H) (bidirectional: (T, B, 2H)), from the embedded input, with the
    stop-gradients of ``mode`` in place."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    sg, T = lax.stop_gradient, n.T
    if mode == "tail":  # one direction (SPEC.md: bidirectional layers need full BPTT)
        cut = T - n.K
        inp_pre, inp_suf = jax.tree.map(lambda v: sg(v[:cut]), inp), jax.tree.map(lambda v: v[cut:], inp)
        for layer in range(n.spec.layers):
            lp = _layer_params(n, p, layer)
            frozen = jax.tree.map(sg, lp)
            state, hs_pre = _recur(n, frozen, _zeros_state(n, 1), _in_proj(n, frozen, inp_pre, layer), None)
            state = tuple(sg(s) for s in state)
            _, hs_suf = _recur(n, lp, state, _in_proj(n, lp, inp_suf, layer), None)
            inp_pre, inp_suf = sg(hs_pre), hs_suf
        return inp_pre, inp_suf
    lanes = n.n_lanes if mode == "truncated" else 1
    restart = None
    if lanes > 1:
        restart = jnp.asarray(np.arange(T)[:, None] % lanes == np.arange(lanes)[None, :])
    for layer in range(n.spec.layers):
        inp = _layer(n, p, layer, inp, lanes, restart)
    if lanes > 1:  # output t reads the lane that restarted at t-K
        inp = inp[np.arange(T), (np.arange(T) + 1) % lanes]
    return inp


def _logits(n: _Net, p, h):
    z = n.mm(h, p["W_hy"])
    return z + p["b_y"] if n.spec.bias else z


def _head_sum(n: _Net, z, y):
    """``sum_{t,b} l(b,t)`` of SPEC.md's heads."""
    import jax
    import jax.numpy as jnp

    if n.spec.head == "softmax_xent":
        picked = jnp.take_along_axis(z, y[..., None], axis=-1)[..., 0]
        return jnp.sum(jax.nn.logsumexp(z, axis=-1) - picked)
    out = jnp.tanh(z) if n.spec.output_act == "tanh" else z
    diff = out - y
    return 0.5 * jnp.sum(diff * diff)


def _objective(n: _Net, p, inp, y):
    """``L = sum l / B`` from the embedded input; under ``tail`` the first T-K outputs count in the value only."""
    import jax
    from jax import lax

    if n.mode == "tail":
        h_pre, h_suf = _top_hidden(n, p, inp, n.mode)
        cut = n.T - n.K
        const = jax.tree.map(lax.stop_gradient, p)
        return (_head_sum(n, _logits(n, const, h_pre), y[:cut]) + _head_sum(n, _logits(n, p, h_suf), y[cut:])) / n.B
    return _head_sum(n, _logits(n, p, _top_hidden(n, p, inp, n.mode)), y) / n.B


def _build(problem: Problem, unroll: int, python_loop: bool):
    """The pure functions of one problem: ``forward(p, x)``, ``loss_and_grads(p, x, y)`` and ``step(p, x, y, lr)``."""
    import jax
    import jax.numpy as jnp

    n = _net(problem, unroll, python_loop)
    spec, T, tables = n.spec, n.T, n.tables

    def forward(p, x):
        z = _logits(n, p, _top_hidden(n, p, _embed(n, p, x), "full"))
        if spec.head == "softmax_xent":
            return jax.nn.softmax(z, axis=-1)
        return jnp.tanh(z) if spec.output_act == "tanh" else z

    # float16's loss scale multiplies the objective before the backward pass; 1 otherwise
    scale = problem.objective_scale
    value_and_grad = jax.value_and_grad(lambda p, x, y: scale * _objective(n, p, _embed(n, p, x), y))
    # gradients w.r.t. the other parameters and the gathered token rows (one array per direction)
    value_and_row_grads = jax.value_and_grad(lambda p, inp, y: scale * _objective(n, p, inp, y), argnums=(0, 1))

    def unscaled(L, g):
        """The reported loss and the gradients divided by the scale; under mixed precision the loss is
        NaN when a gradient is not finite (the cell is diverged)."""
        loss = L / (scale * T)
        if scale != 1:
            g = jax.tree.map(lambda d: d / scale, g)
        if problem.reduced:
            finite = jnp.all(jnp.stack([jnp.isfinite(d).all() for d in jax.tree.leaves(g)]))
            loss = jnp.where(finite, loss, jnp.nan)
        return loss, g

    def loss_and_grads(p, x, y):
        return unscaled(*value_and_grad(p, x, y))

    def step(p, x, y, lr):
        if problem.tokens and spec.clip is None:
            # Only the rows of W_in that x names change: scatter -lr * their gradients in place
            # instead of building and subtracting a dense (D, G) gradient.
            rest = {k: v for k, v in p.items() if k not in tables}
            loss, (g, g_rows) = unscaled(*value_and_row_grads(rest, tuple(p[t][x] for t in tables), y))
            new = jax.tree.map(lambda v, d: v - lr * d, rest, g)
            for t, d in zip(tables, g_rows):
                new[t] = p[t].at[x].add(-lr * d)
            return new, loss
        loss, g = unscaled(*value_and_grad(p, x, y))
        if spec.clip is not None:
            g = jax.tree.map(lambda v: jnp.clip(v, -spec.clip, spec.clip), g)
        return jax.tree.map(lambda v, d: v - lr * d, p, g), loss

    return forward, loss_and_grads, step


class JaxBackend(Backend):
    """JAX/XLA: jitted ``lax.scan`` recurrence, ``value_and_grad`` BPTT, SGD update in the same executable.

    ``default`` runs ``lax.scan(unroll=1)``, the rolled loop; the ``unroll=4``, ``unroll=T`` and
    ``python`` variants are there to be measured against it (``benchmarks/measure_jax_unroll.py``
    times them interleaved in one process). The loop body holds only the recurrent product (input
    projections and the output layer run outside it as single GEMMs), so unrolling has little
    overhead to remove, and the rolled loop compiles fastest, in time independent of T.
    """
    knows = frozenset({"gru", "bidirectional", "reduced"})  # these spec additions are in its supports()

    name = "jax"
    package = "jax"
    variants = ("default", "unroll=1", "unroll=4", "unroll=T", "python", "autotune")
    devices = ("cpu", "gpu")
    #: every new problem costs seconds of XLA compiles per executable (persistently cached after)
    compile_heavy = True

    def __init__(self, variant: str | None = None):
        super().__init__(variant)
        self._params = None
        self._fns: dict[str, Any] = {}
        self._compiled: dict[tuple, Any] = {}

    # -- cheap questions -------------------------------------------------------------
    def availability(self) -> tuple[bool, str]:
        """JAX importable here (checked without importing it)."""
        if importlib.util.find_spec("jax") is None:
            return False, "unavailable: jax not installed (pip install 'rnn-harness[jax]')"
        return True, ""

    def device_availability(self, device: str) -> tuple[bool, str]:
        """CPU always; GPU when jax sees one."""
        if device not in self.devices:
            return super().device_availability(device)
        if device == "gpu":
            import jax

            try:
                jax.devices("gpu")
            except RuntimeError:
                return False, "unavailable: no GPU device visible to jax"
        return True, ""

    def supports(self, problem: Problem) -> tuple[bool, str]:
        """Every model (elman, lstm, gru, bidirectional layers), head, bptt mode, input kind, dtype (mixed
        precision included) and device of SPEC.md (``autotune``: GPU only)."""
        if self.variant == "autotune" and problem.device != "gpu":
            return unsupported("jax:autotune differs from jax only in XLA's GPU autotuning; on the CPU it is jax")
        return True, ""

    @classmethod
    def environment_variables(cls, variant: str, threads: int, device: str, dtype: str) -> dict[str, str]:
        """x64 for float64, and on CPU XLA's single-threaded Eigen when one thread is asked for."""
        env = use_precision(dtype)
        if device == "cpu":
            env["JAX_PLATFORMS"] = "cpu"
            if threads <= 1:
                env["XLA_FLAGS"] = SINGLE_THREAD_XLA_FLAGS
        else:
            # JAX grabs 75% of GPU memory up front by default; a benchmark worker needs what it uses.
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
            if variant != "autotune":
                env["XLA_FLAGS"] = GPU_XLA_FLAGS
        return env

    def versions(self) -> dict[str, str]:
        """numpy, jax, jaxlib, the XLA flags in force and the x64 switch."""
        import jax
        import jaxlib

        return {
            "numpy": np.__version__,
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
            "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
            "jax_enable_x64": str(_x64_enabled(jax)),
            "jax_compilation_cache_dir": str(getattr(jax.config, "jax_compilation_cache_dir", None) or ""),
            "jax_platform": jax.default_backend(),
            "matmul_precision": "highest",  # every product runs under jax.default_matmul_precision("highest")
        }

    # -- the work -------------------------------------------------------------------
    def prepare(self, problem: Problem, params: dict[str, np.ndarray], device: str = "cpu", threads: int = 1) -> None:
        """Move the parameters to the device and build (not yet compile) the jitted functions."""
        import jax

        use_precision(problem.dtype, jax)
        _use_compilation_cache(jax)
        self.close()
        self.problem = problem
        target = jax.devices(device)[0]
        self._params = {k: jax.device_put(np.asarray(v, problem.master_dtype), target) for k, v in params.items()}
        forward, loss_and_grads, step = _build(problem, *_variant_loop(self.variant, problem.seq_len))
        self._fns = {
            "forward": jax.jit(forward),
            "grads": jax.jit(loss_and_grads),
            # the old parameters' buffers are reused for the new ones
            "step": jax.jit(step, donate_argnums=(0,)),
        }

    def _data(self, x, y=None):
        x = self.problem.cast_inputs(x, np.int32)
        return x, (None if y is None else self.problem.cast_targets(y, np.int32))

    def _executable(self, which: str, data: tuple):
        """The executable of ``which`` for these data shapes, compiled on first use."""
        key = (which,) + tuple((a.shape, a.dtype.str) for a in data)
        exe = self._compiled.get(key)
        if exe is None:
            import jax

            # Precision is fixed when tracing; "highest" keeps float32 products float32 on GPUs (no TF32).
            with jax.default_matmul_precision("highest"):
                exe = self._fns[which].lower(self._params, *data).compile()
            self._compiled[key] = exe
        return exe

    def _run(self, which: str, *data):
        return self._executable(which, data)(self._params, *data)

    def _lr(self, lr: float):
        return np.asarray(lr, self.problem.master_dtype)

    def warm_up(self, batch: tuple[Any, Any]) -> None:
        """Compile the executables this workload times (forward, or the SGD step) for ``batch``'s shapes."""
        x, y = self._data(*batch)
        if self.problem.workload == "forward":
            self._executable("forward", (x,))
        else:
            self._executable("step", (x, y, self._lr(0.0)))

    def forward(self, x) -> np.ndarray:
        """Softmax probabilities or the mse head's outputs, (T, B, O)."""
        x, _ = self._data(x)
        return np.asarray(self._run("forward", x))

    def loss_and_grads(self, x, y) -> tuple[float, dict[str, np.ndarray]]:
        """Reported loss and the gradients of the objective."""
        x, y = self._data(x, y)
        loss, grads = self._run("grads", x, y)
        return float(loss), {k: np.asarray(grads[k]) for k in self.problem.model.param_names()}

    def sgd_step(self, x, y, lr: float):
        """One jitted forward + BPTT + update; the old parameter buffers are donated to the new ones.

        Returns the loss as a 0-d device array (``float()`` of it waits for the step), not a
        Python float: converting would block on every step, where a JAX training loop lets
        Python dispatch the next step while XLA still computes this one. ``sync()`` still
        waits for all of it before the harness reads the clock. At the smallest shapes that
        per-step wait is a large share of the step.
        """
        x, y = self._data(x, y)
        lr = self._lr(lr)
        self._params, loss = self._run("step", x, y, lr)
        return loss

    def sync(self) -> None:
        """Block until the parameters are computed."""
        if self._params is not None:
            for v in self._params.values():
                v.block_until_ready()

    def get_params(self) -> dict[str, np.ndarray]:
        """Current parameters as NumPy arrays (copies)."""
        return {k: np.array(self._params[k]) for k in self.problem.model.param_names()}

    def close(self) -> None:
        """Drop the parameters and every compiled executable."""
        self._params = None
        self._fns = {}
        self._compiled = {}

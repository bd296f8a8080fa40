"""The cuda backend's parameter gradients from a unit's ``da``: weights, biases, peepholes.

Past ``naive`` they are combined GEMMs, one per weight over every step of a segment (full, tail: all
the steps at once; truncated: one per depth, over every window); ``naive`` forms them per stage,
per gate, on the spec's layouts. ``net`` is a :class:`backends.cuda.net.Net`, ``u`` a unit
``(layer, direction)``, ``c`` its :class:`backends.cuda.records.Cache`, ``back`` its
:class:`backends.cuda.records.Back`.
"""

from __future__ import annotations

from harness.spec.model import layer_suffix

from backends.cuda.products import acc_w, accumulate, runs


def segments(net, back, c):
    """``(first step, end step, da rows)`` for the combined GEMMs: all the steps at once (full, tail),
    or one per truncated depth (over all its windows)."""
    if back.da_all is None:
        return back.segments
    T = c.hs.shape[0] - 1
    t0 = T - back.n_stages
    return [(t0, T, back.da_all[t0:].reshape(-1, net.GB))]


def weight_grads(net, u, c, back, grads):
    """Combined weight-gradient GEMMs: one per weight over every step of a segment (full, tail: all
    the steps at once; truncated: one per depth, over every window)."""
    for a, b, da in segments(net, back, c):
        segment_weight_grads(net, u, c, a, b, da, grads)


def segment_weight_grads(net, u, c, a, b, da, grads):
    """Every weight gradient of the steps ``a..b-1`` (cuda:naive: per stage, per gate, spec layouts)."""
    s = layer_suffix(*u)
    H = net.H
    R = da.shape[0]
    acc_w(net, grads, "W_hh" + s, c.hs[a:b].reshape(R, H), da, net.rec_map)
    if net.is_gru and not net.reset_after:  # W_hn meets r * h_prev
        acc_w(net, grads, "W_hh" + s, c.gates[a:b, :, 3 * H:].reshape(R, H), da, [(2, 2)])
    if net.is_table(u):
        table_grad(net, grads, u, c.inp[a:b], da)
    else:
        acc_w(net, grads, net.w_in + s, c.inp[a:b].reshape(R, -1), da, net.in_map)
    small_grads(net, u, c, a, b, da, grads)


def table_grad(net, grads, u, ids, da):
    """``dW[v, weight gate] += da[rows with token v, da gate]`` (an index_add per gate run)."""
    name = net.w_in + layer_suffix(*u)
    if name not in grads:
        grads[name] = net.torch.zeros_like(net.p[name])
    H, flat = net.H, ids.reshape(-1)
    for (k0, k1), (j0, j1) in runs(net.in_map, False):
        grads[name][:, k0 * H:k1 * H].index_add_(0, flat, da[:, j0 * H:j1 * H])


def small_grads(net, u, c, a, b, da, grads):
    """Bias and peephole gradients of one segment (reductions over its rows)."""
    s = layer_suffix(*u)
    H = net.H
    if net.spec.bias:
        name = net.b_in + s
        if net.reset_after:
            if name not in grads:
                grads[name] = net.torch.zeros_like(net.p[name])
            grads[name][:2 * H] += da[:, :2 * H].sum(0)
            grads[name][2 * H:] += da[:, 3 * H:].sum(0)
            accumulate(grads, "b_hn" + s, da[:, 2 * H:3 * H].sum(0))
        else:
            accumulate(grads, name, da.sum(0))
    if net.spec.peephole:
        R = da.shape[0]
        c_prev = c.cs[a:b].reshape(R, H)
        c_t = c.cs[a + 1:b + 1].reshape(R, H)
        accumulate(grads, "p_i" + s, (da[:, :H] * c_prev).sum(0))
        accumulate(grads, "p_f" + s, (da[:, H:2 * H] * c_prev).sum(0))
        accumulate(grads, "p_o" + s, (da[:, 3 * H:] * c_t).sum(0))

"""The cuda backend's products (cuBLAS GEMMs through torch) against a unit's weights, in either layout.

Every variant past ``naive`` stores ``W_hh`` and the input weights pre-transposed (``(G, D)``,
nn.Linear's layout); these functions read a weight in whichever layout it is stored and, under
mixed precision, as its copy rounded for the pass (``net.W``). A gate pair ``(weight gate, da
gate)`` says which columns of a weight meet which columns of ``da``: contiguous runs of them are one
GEMM each (``cuda:naive``: one per gate). ``net`` is a :class:`backends.cuda.net.Net`; ``u`` a unit
``(layer, direction)``.
"""

from __future__ import annotations

from harness.spec.model import layer_suffix


def runs(pairs, split: bool):
    """Gate pairs ``(weight gate, da gate)`` as ``(weight gates, da gates)`` ranges: maximal runs where
    both advance together (one GEMM each), or one per gate when ``split`` (cuda:naive)."""
    out: list[list[int]] = []
    for k, j in pairs:
        if out and not split and out[-1][1] == k and out[-1][3] == j:
            out[-1][1] += 1
            out[-1][3] += 1
        else:
            out.append([k, k + 1, j, j + 1])
    return [((a, b), (c, d)) for a, b, c, d in out]


def gate_cols(net, lo: int, hi: int):
    """Gate blocks ``lo..hi`` as a column slice, or None for all of a product's ``G`` columns."""
    return None if (lo, hi) == (0, net.G // net.H) else slice(lo * net.H, hi * net.H)


def times_w(net, name: str, u, a, cols=None):
    """``a @ W`` (or of W's columns ``cols``), whichever layout W is stored in."""
    full = name + layer_suffix(*u)
    W = net.W(full)
    if full in net.transposed:
        W = W if cols is None else W[cols]
        return net.mm(a, W.t())
    return net.mm(a, W if cols is None else W[:, cols])


def times_wt(net, name: str, u, da, cols=None):
    """``da @ W^T`` (or with W's columns ``cols`` only)."""
    full = name + layer_suffix(*u)
    W = net.W(full)
    if full in net.transposed:
        return net.mm(da, W if cols is None else W[cols])
    return net.mm(da, (W if cols is None else W[:, cols]).t())


def times_wt_map(net, name: str, u, da, pairs):
    """``sum over gate pairs of da[:, da gate] @ W[:, weight gate]^T``: one GEMM per run of gates
    (cuda:naive: one per gate, summed by element-wise kernels)."""
    H, out = net.H, None
    for (k0, k1), (j0, j1) in runs(pairs, net.naive):
        part = times_wt(net, name, u, da[:, j0 * H:j1 * H], gate_cols(net, k0, k1))
        if out is None:
            out = part
        else:
            out = net.E.binary("add", out, part) if net.naive else out.add_(part)
    return out


def dx(net, u, da):
    """The gradient reaching the unit's input: ``da`` through the input weights."""
    return times_wt_map(net, net.w_in, u, da, net.in_map)


def dh_rec(net, u, da):
    """The gradient reaching ``h_prev`` through the recurrent GEMM."""
    return times_wt_map(net, "W_hh", u, da, net.rec_map)


def accumulate(grads, name, value):
    """``grads[name] += value``, or ``value`` itself for a gradient not formed yet."""
    if name in grads:
        grads[name].add_(value)
    else:
        grads[name] = value


def acc_w(net, grads, name: str, left, da, pairs):
    """``dW[:, weight gate] += left^T da[:, da gate]`` over the gate runs (stored layout)."""
    H = net.H
    gate_runs = runs(pairs, net.naive)
    (k0, k1), (j0, j1) = gate_runs[0]
    if len(gate_runs) == 1 and gate_cols(net, k0, k1) is None and (j0, j1) == (0, da.shape[1] // H):
        value = net.mm(da.t(), left) if name in net.transposed else net.mm(left.t(), da)
        accumulate(grads, name, value)
        return
    if name not in grads:
        grads[name] = net.torch.zeros_like(net.p[name])
    for (k0, k1), (j0, j1) in gate_runs:
        part = da[:, j0 * H:j1 * H]
        if name in net.transposed:
            grads[name][k0 * H:k1 * H] += net.mm(part.t(), left)
        else:
            grads[name][:, k0 * H:k1 * H] += net.mm(left.t(), part)


def project(net, u, inp):
    """The hoisted input GEMM over steps: (S, B, D) (token ids (S, B)) -> (S, B, G) with the bias."""
    torch = net.torch
    b = net.P(net.b_in, u)
    if net.is_table(u):
        rows = net.P(net.w_in, u)[inp]
        return rows if b is None else rows + b
    S, B = inp.shape[:2]
    flat = inp.reshape(S * B, -1)
    W = net.W(net.w_in + layer_suffix(*u))
    if net.low is not None:  # the float32 product, the bias added in float32
        out = net.mm(flat, W.t())
        out = out if b is None else out.add_(b)
    else:
        out = torch.mm(flat, W.t()) if b is None else torch.addmm(b, flat, W.t())
    return out.view(S, B, net.G)

"""The cuda backend's forward pass: every layer over all steps, per variant.

``forward`` runs the units (a layer's direction) one after another, or as the (layer, step)
wavefront on the layers' streams; a unit's steps are per-gate GEMMs and op-by-op kernels (naive),
the hoisted input GEMM and one recurrent GEMM a step, op by op (grouped) or in one fused kernel
(fused, streams, graph), or one persistent kernel for all steps (persistent). ``net`` is a
:class:`backends.cuda.net.Net`, ``u`` a unit ``(layer, direction)``.
"""

from __future__ import annotations

from backends.cuda import unfused
from backends.cuda.products import project, times_w
from backends.cuda.records import Cache


def new_cache(net, inp, T: int, B: int, train: bool) -> Cache:
    """A unit's empty forward record for T steps of batch B (the gates kept where backward or the step reads them)."""
    torch = net.torch
    hs = torch.zeros((T + 1, B, net.H), dtype=net.dtype, device=net.device)
    cs = torch.zeros_like(hs) if net.is_lstm else None
    # the reset-before GRU passes z and r * h_prev through its gates between the step's two halves
    keep = (net.is_lstm and train) or (net.is_gru and (train or not net.reset_after))
    gates = torch.empty((T, B, net.GS), dtype=net.dtype, device=net.device) if keep else None
    return Cache(inp, hs, cs, gates)


def forward(net, xt, train: bool):
    """Every layer over all steps; returns the caches (per layer, per direction) and the top
    layer's output (T, B, directions * H)."""
    torch = net.torch
    T, B = xt.shape[:2]
    net.round_weights()
    if net.dirs == 1:
        caches = []
        for layer in range(net.L):
            inp = xt if layer == 0 else caches[-1][0].hs[1:]
            caches.append([new_cache(net, inp, T, B, train)])
        if net.wavefront:
            forward_wavefront(net, [c[0] for c in caches], T)
        else:
            for layer, (c,) in enumerate(caches):
                run_unit(net, (layer, 0), c, T)
        return caches, caches[-1][0].hs[1:]
    caches, inp = [], xt
    for layer in range(net.L):
        dirs = [new_cache(net, inp if d == 0 else torch.flip(inp, (0,)), T, B, train) for d in range(2)]
        for d, c in enumerate(dirs):
            run_unit(net, (layer, d), c, T)
        caches.append(dirs)
        # the layer's output at t: [h_t, h_t of the reverse run, its step T-1-t]
        inp = torch.cat([dirs[0].hs[1:], torch.flip(dirs[1].hs[1:], (0,))], dim=-1)
    return caches, inp


def run_unit(net, u, c: Cache, T: int):
    """Every step of one direction of one layer."""
    if net.naive:
        for t in range(T):
            naive_step(net, u, c, t)
        return
    pre = project(net, u, c.inp)
    if net.persistent:
        w = net.P("W_hh", u)  # float32: the kernel rounds it (and h) to the low type itself when mixed
        low = None if net.low is None else net.problem.dtype
        if net.is_gru:
            bar = net.k_pers.run_gru_layer(pre, w, net.P("b_hn", u), c.hs, c.gates, net.reset_after, low=low)
        else:
            bar = net.k_pers.run_layer(pre, w, c.hs, c.cs, c.gates, net.peep(u), net.is_lstm,
                                       net.spec.activation, low=low)
        net.barriers.append(bar)
        return
    for t in range(T):
        step(net, u, c, t, pre[t])


def forward_wavefront(net, caches, T: int):
    """Layer l step t on layer l's stream after layer l-1 step t: the diagonals of (layer, step)."""
    streams = net.streams
    streams.fork()
    with streams.stream(0):
        pre0 = project(net, (0, 0), caches[0].inp)
    for d in range(T + net.L - 1):
        for layer in range(net.L):
            t = d - layer
            if not 0 <= t < T:
                continue
            with streams.stream(layer):
                if layer > 0:
                    streams.wait(("f", layer - 1, t))
                    pre = project(net, (layer, 0), caches[layer].inp[t: t + 1])[0]
                else:
                    pre = pre0[t]
                step(net, (layer, 0), caches[layer], t, pre)
                streams.record(("f", layer, t))
    streams.join()


def step(net, u, c: Cache, t: int, pre):
    """One step of one unit, combined gates (grouped: element-wise op by op; fused: one kernel)."""
    if net.is_gru:
        gru_step(net, u, c, t, pre)
        return
    rec = times_w(net, "W_hh", u, c.hs[t]) if t > 0 else None
    if net.fused:
        if net.is_lstm:
            net.k_lstm.forward_step(pre, rec, c.cs[t], net.peep(u), c.hs[t + 1], c.cs[t + 1],
                                    c.gates[t] if c.gates is not None else None)
        else:
            net.k_elman.forward_step(pre, rec, c.hs[t + 1], net.spec.activation)
        return
    E = net.E
    a = pre if rec is None else E.binary("add", pre, rec)
    if not net.is_lstm:
        E.unary(unfused.ACT_OP[net.spec.activation], a, out=c.hs[t + 1])
        return
    H = net.H
    cols = [a[:, k * H:(k + 1) * H] for k in range(4)]
    unfused.lstm_cell(net, u, cols, c.cs[t], c.hs[t + 1], c.cs[t + 1], gate_outs(net, c, t))


def gate_outs(net, c: Cache, t: int):
    """Step t's stored gates as four (B, H) column blocks, or four Nones where the gates are not kept."""
    H = net.H
    return [c.gates[t][:, k * H:(k + 1) * H] for k in range(4)] if c.gates is not None else [None] * 4


def gru_step(net, u, c: Cache, t: int, pre):
    """One GRU step: the recurrent GEMM of r, z (and n, reset after) at once; reset before, the GEMM
    of ``r * h_prev`` with ``W_hn`` between the two halves of the step."""
    H = net.H
    hp, g = c.hs[t], (c.gates[t] if c.gates is not None else None)
    rn = slice(2 * H, 3 * H)
    if net.reset_after:
        rec = times_w(net, "W_hh", u, hp) if t > 0 else None
        if net.fused:
            net.k_gru.forward_step(pre, rec, net.P("b_hn", u), hp, c.hs[t + 1], g)
            return
        rec_cols = None if rec is None else [rec[:, k * H:(k + 1) * H] for k in range(3)]
        unfused.gru_cell(net, u, [pre[:, k * H:(k + 1) * H] for k in range(3)], rec_cols, None, hp, c.hs[t + 1],
                         gate_outs(net, c, t))
        return
    rec = times_w(net, "W_hh", u, hp, slice(0, 2 * H)) if t > 0 else None
    if net.fused:
        net.k_gru.reset_gate_step(pre, rec, hp, g)
        rec_n = times_w(net, "W_hh", u, g[:, 3 * H:], rn) if t > 0 else None
        net.k_gru.new_gate_step(pre, rec_n, hp, g, c.hs[t + 1])
        return
    rec_cols = None if rec is None else [rec[:, :H], rec[:, H:]]
    rn_fn = (lambda rh: times_w(net, "W_hh", u, rh, rn)) if t > 0 else None
    unfused.gru_cell(net, u, [pre[:, k * H:(k + 1) * H] for k in range(3)], rec_cols, rn_fn, hp, c.hs[t + 1],
                     gate_outs(net, c, t))


def naive_step(net, u, c: Cache, t: int):
    """Per-gate GEMMs on the spec's layouts, then one kernel per element-wise operation."""
    E, H = net.E, net.H
    b = net.P(net.b_in, u)
    hp = c.hs[t]
    cols = []
    for k in range(net.G // H):
        sl = slice(k * H, (k + 1) * H)
        if net.is_table(u):
            a = net.P(net.w_in, u)[c.inp[t], sl].contiguous()  # the row gather, one gate's columns
        else:
            a = times_w(net, net.w_in, u, c.inp[t], sl)
        if t > 0 and not net.is_gru:
            a = E.binary("add", a, times_w(net, "W_hh", u, hp, sl))
        if b is not None:
            a = E.binary("add", a, b[sl], row=True)
        cols.append(a)
    if net.is_gru:
        rec_gates = 3 if net.reset_after else 2
        rec = [times_w(net, "W_hh", u, hp, slice(k * H, (k + 1) * H)) for k in range(rec_gates)] if t > 0 else None
        rn = slice(2 * H, 3 * H)
        rn_fn = (lambda rh: times_w(net, "W_hh", u, rh, rn)) if t > 0 and not net.reset_after else None
        unfused.gru_cell(net, u, cols, rec, rn_fn, hp, c.hs[t + 1], gate_outs(net, c, t))
        return
    if not net.is_lstm:
        E.unary(unfused.ACT_OP[net.spec.activation], cols[0], out=c.hs[t + 1])
        return
    unfused.lstm_cell(net, u, cols, c.cs[t], c.hs[t + 1], c.cs[t + 1], gate_outs(net, c, t))

"""The cuda backend's training pass: forward, head and BPTT, into gradients in the stored layouts.

Backward runs in stages: one step at a time from the end (full, tail), or, truncated, one depth j
of every output's window at once (K+1 batched steps over (T-j)*B rows). A stage of a unit writes
its ``da`` and carries ``dh_rec`` (and the LSTM's or GRU's ``dc``) to the next; past ``naive`` the
weight gradients are then combined GEMMs over the stages' ``da`` (:mod:`backends.cuda.weight_grads`).
Layers run top first, one after another, or as a wavefront on the layers' streams; bidirectional
layers one direction after the other. ``net`` is a :class:`backends.cuda.net.Net`, ``u`` a unit
``(layer, direction)``.
"""

from __future__ import annotations

from backends.cuda import unfused
from backends.cuda.forward import forward
from backends.cuda.head import head
from backends.cuda.products import dh_rec, dx, times_wt
from backends.cuda.records import Back, Cache
from backends.cuda.weight_grads import segment_weight_grads, segments, weight_grads


def stages(net, T: int) -> list[tuple[int, int]]:
    """The backward stages as (first step, end step) of their rows: one step at a time from the end
    (full, tail), or the truncated windows' depths j = 0..K, each over steps 0..T-1-j (one per window)."""
    bptt = net.spec.bptt
    if bptt.mode == "truncated":
        return [(0, T - j) for j in range(min(bptt.k, T - 1) + 1)]
    t0 = max(0, T - bptt.k) if bptt.mode == "tail" else 0
    return [(t, t + 1) for t in range(T - 1, t0 - 1, -1)]


def grads_dev(net, xt, yt):
    """Loss and gradients (device tensors, in the stored layouts): forward, head, BPTT; under mixed
    precision the gradients divided by the loss scale, and the loss NaN where one is not finite."""
    loss, grads = grads_scaled(net, xt, yt)
    if net.low is None:
        return loss, grads
    torch = net.torch
    found_inf = torch.zeros(1, dtype=torch.float32, device=net.device)
    inv = torch.full((1,), 1.0 / net.scale, dtype=torch.float32, device=net.device)
    torch._amp_foreach_non_finite_check_and_unscale_(list(grads.values()), found_inf, inv)
    return torch.where(found_inf[0] > 0, torch.full_like(loss, float("nan")), loss), grads


def grads_scaled(net, xt, yt):
    """Loss and gradients of the objective times the loss scale (float16's; 1 otherwise)."""
    T, B = xt.shape[:2]
    caches, top = forward(net, xt, train=True)
    loss, dz = head(net, top, yt, T, B)
    width = net.dirs * net.H
    if net.scale != 1:  # float16: the objective times the loss scale (undone in grads_dev)
        dz = dz * net.scale
    grads = {"W_hy": net.mm(top.reshape(-1, width).t(), dz)}
    if "b_y" in net.p:
        grads["b_y"] = dz.sum(0)
    dh_top = net.mm(dz, net.W("W_hy").t()).view(T, B, width)
    steps = stages(net, T)
    if net.dirs == 2:
        backward_bidirectional(net, caches, steps, dh_top, grads)
        return loss, grads
    caches = [c[0] for c in caches]
    truncated = net.spec.bptt.mode == "truncated"
    # the top layer's dh_out per stage: every output at its own step (full/tail), or at depth 0 only
    dh_top_stage = [dh_top if s == 0 else None for s in range(len(steps))] if truncated else \
        [dh_top[a] for a, _ in steps]
    if net.wavefront:
        backward_wavefront(net, caches, steps, dh_top_stage, grads)
    else:
        dh_out = dh_top_stage
        for layer in reversed(range(net.L)):
            u = (layer, 0)
            back = new_back(net, T, B)
            for s in range(len(steps)):
                bwd_stage(net, u, caches[layer], back, steps, s, dh_out[s], grads, want_dx=False)
            if not net.naive:
                weight_grads(net, u, caches[layer], back, grads)
            if layer > 0:
                dh_out = dx_per_stage(net, u, back, caches[layer], steps)
    return loss, grads


def backward_bidirectional(net, caches, steps, dh_top, grads):
    """Full BPTT through bidirectional layers, top layer first: each direction takes its half of
    the gradient reaching the layer's output (the reverse one time-reversed) and gives back the
    gradient reaching the layer's input, which the directions add."""
    torch, H = net.torch, net.H
    T, B = dh_top.shape[:2]
    dh = dh_top
    for layer in reversed(range(net.L)):
        dx_sum = None
        for d, c in enumerate(caches[layer]):
            u = (layer, d)
            dh_d = dh[..., d * H:(d + 1) * H]
            dh_d = torch.flip(dh_d, (0,)) if d else dh_d.contiguous()
            back = new_back(net, T, B)
            for s, (a, _) in enumerate(steps):
                bwd_stage(net, u, c, back, steps, s, dh_d[a], grads, want_dx=False)
            if not net.naive:
                weight_grads(net, u, c, back, grads)
            if layer > 0:
                if back.da_all is not None:
                    g = dx(net, u, back.da_all.reshape(-1, net.GB)).view(T, B, -1)
                else:  # cuda:naive: stage s is step T-1-s
                    g = torch.cat(dx_per_stage(net, u, back, c, steps)[::-1], 0)
                g = torch.flip(g, (0,)) if d else g
                dx_sum = g if dx_sum is None else dx_sum + g
        dh = dx_sum


def new_back(net, T: int, B: int) -> Back:
    """A unit's empty backward carry; full and tail (past naive) write every step's da into one buffer."""
    if net.naive or net.spec.bptt.mode == "truncated":
        return Back()
    return Back(net.torch.empty((T, B, net.GB), dtype=net.dtype, device=net.device))


def backward_wavefront(net, caches, steps, dh_top_stage, grads):
    """Layer l stage s on layer l's stream after layer l+1 stage s (top layer first)."""
    streams = net.streams
    streams.fork()
    T, B = caches[0].hs.shape[0] - 1, caches[0].hs.shape[1]
    backs = [new_back(net, T, B) for _ in range(net.L)]
    n = len(steps)
    for d in range(n + net.L - 1):
        for layer in reversed(range(net.L)):
            s = d - (net.L - 1 - layer)
            if not 0 <= s < n:
                continue
            with streams.stream(layer):
                if layer == net.L - 1:
                    dho = dh_top_stage[s]
                else:
                    streams.wait(("b", layer + 1, s))
                    dho = backs[layer + 1].dx[s]  # kept alive until the join: no cross-stream reuse
                bwd_stage(net, (layer, 0), caches[layer], backs[layer], steps, s, dho, grads, want_dx=layer > 0)
                streams.record(("b", layer, s))
    for layer in range(net.L):
        with streams.stream(layer):
            weight_grads(net, (layer, 0), caches[layer], backs[layer], grads)
    streams.join()


def dx_per_stage(net, u, back: Back, c: Cache, steps):
    """The gradient reaching layer-1's outputs per stage: one GEMM over every step of this layer's da."""
    if net.naive:
        return [back.dx[s] for s in range(len(steps))]
    B = c.hs.shape[1]
    out = []
    for a, b, da in segments(net, back, c):
        out.append(dx(net, u, da).view(b - a, B, -1))
    if back.da_all is not None:  # one segment of single steps: stage s is step steps[s][0]
        return [out[0][s0 - steps[-1][0]] for s0, _ in steps]
    return out


def bwd_stage(net, u, c: Cache, back: Back, steps, s, dh_out, grads, want_dx: bool):
    """One backward stage of one unit: da of its rows, the carries to the next stage."""
    torch = net.torch
    a, b = steps[s]
    B = c.hs.shape[1]
    R = (b - a) * B
    H = net.H
    last = s == len(steps) - 1
    back.n_stages = s + 1
    dho = None if dh_out is None else dh_out.reshape(R, H)
    if back.da_all is not None:
        da = back.da_all[a]  # full / tail: one step's rows, in place for the combined GEMMs
    else:
        da = torch.empty((R, net.GB), dtype=net.dtype, device=net.device)
    if net.naive or not net.fused:
        unfused.backward(net, u, c, back, a, b, dho, da)
    elif net.is_lstm:
        dc = torch.empty((R, H), dtype=net.dtype, device=net.device)
        net.k_lstm.backward_step(dho, back.dh_rec, back.dc, c.gates[a:b].reshape(R, net.GS),
                                 c.cs[a:b].reshape(R, H), c.cs[a + 1:b + 1].reshape(R, H),
                                 net.peep(u), da, dc)
        back.dc = dc
    elif net.is_gru:
        dc = torch.empty((R, H), dtype=net.dtype, device=net.device)
        gates, h_prev = c.gates[a:b].reshape(R, net.GS), c.hs[a:b].reshape(R, H)
        if net.reset_after:
            net.k_gru.backward_step(dho, back.dh_rec, back.dc, gates, h_prev, da, dc)
        else:
            net.k_gru.new_gate_backward(dho, back.dh_rec, back.dc, gates, h_prev, da, dc)
            drh = times_wt(net, "W_hh", u, da[:, 2 * H:], slice(2 * H, 3 * H))
            net.k_gru.reset_gate_backward(drh, gates, h_prev, da, dc)
        back.dc = dc
    else:
        net.k_elman.backward_step(dho, back.dh_rec, c.hs[a + 1:b + 1].reshape(R, H), da, net.spec.activation)
    if net.naive:
        segment_weight_grads(net, u, c, a, b, da, grads)
        if u[0] > 0:
            back.dx[s] = dx(net, u, da).view(b - a, B, -1)
    else:
        if back.da_all is None:
            back.segments.append((a, b, da))
        if want_dx:
            back.dx[s] = dx(net, u, da).view(b - a, B, -1)
    carry = None if last else dh_rec(net, u, da)
    if net.spec.bptt.mode == "truncated" and not last:
        # truncated: the next depth has one window fewer (the earliest one reached step 0)
        back.dh_rec = carry[B:]
        back.dc = back.dc[B:] if back.dc is not None else None
    else:
        back.dh_rec = carry

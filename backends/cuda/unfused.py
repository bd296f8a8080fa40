"""The cells op by op (cuda:naive, cuda:grouped): one Triton element-wise kernel per operation.

The forward cells take the gates' pre-activations; the backward writes a stage's ``da`` (R, GB) and
leaves the carry for the next stage in ``back.dc``. ``net`` is a :class:`backends.cuda.net.Net`,
``u`` a unit ``(layer, direction)``, ``c`` its :class:`backends.cuda.records.Cache`.
"""

from __future__ import annotations

from backends.cuda.products import times_wt_map

ACT_OP = {"tanh": "tanh", "relu": "relu", "sigmoid": "sigmoid"}
ACT_GRAD_OP = {"tanh": "dtanh", "relu": "drelu", "sigmoid": "dsigmoid"}


def lstm_cell(net, u, cols, c_prev, h_out, c_out, outs):
    """The LSTM cell from the gates' pre-activations, one kernel per operation."""
    E = net.E
    ai, af, ag, ao = cols
    peep = net.peep(u)
    if peep is not None:
        ai = E.binary("add", ai, E.binary("mul", c_prev, peep[0], row=True))
        af = E.binary("add", af, E.binary("mul", c_prev, peep[1], row=True))
    i = E.unary("sigmoid", ai, out=outs[0])
    f = E.unary("sigmoid", af, out=outs[1])
    g = E.unary("tanh", ag, out=outs[2])
    E.binary("add", E.binary("mul", f, c_prev), E.binary("mul", i, g), out=c_out)
    if peep is not None:
        ao = E.binary("add", ao, E.binary("mul", c_out, peep[2], row=True))
    o = E.unary("sigmoid", ao, out=outs[3])
    E.binary("mul", o, E.unary("tanh", c_out), out=h_out)


def gru_cell(net, u, cols, rec, rn_fn, h_prev, h_out, outs):
    """The GRU cell, one kernel per operation: ``cols`` the input side's ``a_r, a_z, a_n`` (bias
    included), ``rec`` the recurrent products ``u_r, u_z`` (and ``u_n``, reset after; None at the
    first step), ``rn_fn(rh)`` the product ``rh W_hn`` (reset before; None at the first step);
    ``outs`` the stored gates r, z, n, un | rh (None: scratch)."""
    E = net.E
    ar, az, an = cols
    if rec is not None:
        ar = E.binary("add", ar, rec[0])
        az = E.binary("add", az, rec[1])
    r = E.unary("sigmoid", ar, out=outs[0])
    z = E.unary("sigmoid", az, out=outs[1])
    if net.reset_after:
        un = rec[2] if rec is not None else net.torch.zeros_like(h_prev)
        b_hn = net.P("b_hn", u)
        if b_hn is not None:
            un = E.binary("add", un, b_hn, row=True, out=outs[3])
        elif outs[3] is not None:
            outs[3].copy_(un)
        n_pre = E.binary("add", an, E.binary("mul", r, un))
    else:
        rh = E.binary("mul", r, h_prev, out=outs[3])
        n_pre = an if rn_fn is None else E.binary("add", an, rn_fn(rh))
    n = E.unary("tanh", n_pre, out=outs[2])
    E.binary("add", n, E.binary("mul", z, E.binary("sub", h_prev, n)), out=h_out)  # (1 - z) n + z h_prev


def backward(net, u, c, back, a: int, b: int, dho, da):
    """The cell's backward over steps ``a..b-1``, one kernel per element-wise operation, into da (R, GB)."""
    torch, E = net.torch, net.E
    H = net.H
    R = (b - a) * c.hs.shape[1]
    # the GRU's carried dc is part of dh (the LSTM's is dL/dc, added below)
    parts = [t for t in (dho, back.dh_rec, back.dc if net.is_gru else None) if t is not None]
    if not parts:
        dh = torch.zeros((R, H), dtype=net.dtype, device=net.device)
    else:
        dh = parts[0]
        for p in parts[1:]:
            dh = E.binary("add", dh, p)
    if net.is_gru:
        gru_backward(net, u, c, back, a, b, dh, da)
        return da
    if not net.is_lstm:
        h = c.hs[a + 1:b + 1].reshape(R, H)
        E.binary("mul", dh, E.unary(ACT_GRAD_OP[net.spec.activation], h), out=da)
        return da
    gates = c.gates[a:b].reshape(R, net.GS)
    i, f, g, o = (gates[:, k * H:(k + 1) * H] for k in range(4))
    c_prev = c.cs[a:b].reshape(R, H)
    c_t = c.cs[a + 1:b + 1].reshape(R, H)
    dai, daf, dag, dao = (da[:, k * H:(k + 1) * H] for k in range(4))
    peep = net.peep(u)
    tc = E.unary("tanh", c_t)
    E.binary("mul", E.binary("mul", dh, tc), E.unary("dsigmoid", o), out=dao)
    dc = E.binary("mul", E.binary("mul", dh, o), E.unary("dtanh", tc))
    if back.dc is not None:
        dc = E.binary("add", dc, back.dc)
    if peep is not None:
        dc = E.binary("add", dc, E.binary("mul", dao, peep[2], row=True))
    E.binary("mul", E.binary("mul", dc, g), E.unary("dsigmoid", i), out=dai)
    E.binary("mul", E.binary("mul", dc, c_prev), E.unary("dsigmoid", f), out=daf)
    E.binary("mul", E.binary("mul", dc, i), E.unary("dtanh", g), out=dag)
    carry = E.binary("mul", dc, f)
    if peep is not None:
        carry = E.binary("add", carry, E.binary("mul", dai, peep[0], row=True))
        carry = E.binary("add", carry, E.binary("mul", daf, peep[1], row=True))
    back.dc = carry
    return da


def gru_backward(net, u, c, back, a: int, b: int, dh, da):
    """The GRU's backward from ``dh`` (all of dL/dh_t), one kernel per operation (da as in backends.cuda.gru)."""
    E, H = net.E, net.H
    R = dh.shape[0]
    gates = c.gates[a:b].reshape(R, net.GS)
    r, z, n, x = (gates[:, k * H:(k + 1) * H] for k in range(4))  # x: un (reset after) or r * h_prev
    h_prev = c.hs[a:b].reshape(R, H)
    dar, daz = da[:, :H], da[:, H:2 * H]
    dan = da[:, 3 * H:] if net.reset_after else da[:, 2 * H:]
    dhz = E.binary("mul", dh, z)
    E.binary("mul", E.binary("sub", dh, dhz), E.unary("dtanh", n), out=dan)  # dh (1 - z) (1 - n^2)
    E.binary("mul", E.binary("mul", dh, E.binary("sub", h_prev, n)), E.unary("dsigmoid", z), out=daz)
    if net.reset_after:
        E.binary("mul", dan, r, out=da[:, 2 * H:3 * H])  # dun
        E.binary("mul", E.binary("mul", dan, x), E.unary("dsigmoid", r), out=dar)
        back.dc = dhz
    else:
        drh = times_wt_map(net, "W_hh", u, da, [(2, 2)])  # da_n W_hn^T: the gradient of r * h_prev
        E.binary("mul", E.binary("mul", drh, h_prev), E.unary("dsigmoid", r), out=dar)
        back.dc = E.binary("add", dhz, E.binary("mul", drh, r))

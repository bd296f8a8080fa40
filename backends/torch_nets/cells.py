"""One time step of each cell kind in torch ops (and the products they take under mixed precision),
shared by the autograd and compiled networks; ``torch`` is passed in, never imported here."""

from __future__ import annotations


def addmm_of(torch, mm=None):
    """``c + a @ b``: ``torch.addmm``, or under mixed precision (``mm`` the spec's product) the float32 product
    and ``c`` (a bias, or a step's input projection) added in float32."""
    if mm is None:
        return torch.addmm
    return lambda c, a, b, b_low=None: c + mm(a, b, b_low)


def step_cells(torch, act, reset_after=True, mm=None):
    """One time step of each cell, from a previous state: ``(elman(a_in, h, W_hh, W_low) -> h,
    lstm(a_in, h, c, W_hh, W_low[, p_i, p_f, p_o]) -> (h, c), gru(a_in, h, W_hh, W_low[, b_hn]) -> h)``;
    ``a_in`` is the step's input projection (with the bias ``b``). ``mm``: under mixed precision the spec's
    product (``W_low`` then ``W_hh`` rounded once per sequence), None for float32 and float64 (``W_low`` None)."""

    # Under mixed precision every product returns float32, so the gates, the cell state and h stay float32.
    if mm is None:
        addmm = lambda c, a, b, b_low=None: torch.addmm(c, a, b)  # noqa: E731
        product = lambda a, b, b_low=None: torch.mm(a, b)  # noqa: E731
    else:
        addmm, product = addmm_of(torch, mm), mm

    def cols(W_low, part):
        return None if W_low is None else W_low[:, part]

    def gru(a_in, h, W_hh, W_low, b_hn=None):
        H = h.shape[1]
        if reset_after:  # one GEMM for all three gates: r * (h W_hn + b_hn)
            u = product(h, W_hh, W_low)
            r, z = torch.sigmoid(a_in[:, : 2 * H] + u[:, : 2 * H]).chunk(2, 1)
            un = u[:, 2 * H:] if b_hn is None else u[:, 2 * H:] + b_hn
            n = torch.tanh(torch.addcmul(a_in[:, 2 * H:], r, un))
        else:  # (r * h) W_hn needs r first: a second GEMM
            rz, rn = slice(0, 2 * H), slice(2 * H, 3 * H)
            r, z = torch.sigmoid(addmm(a_in[:, rz], h, W_hh[:, rz], cols(W_low, rz))).chunk(2, 1)
            n = torch.tanh(addmm(a_in[:, rn], r * h, W_hh[:, rn], cols(W_low, rn)))
        return torch.addcmul(n, z, h - n)

    def elman(a_in, h, W_hh, W_low):
        return act(addmm(a_in, h, W_hh, W_low))

    def lstm(a_in, h, c, W_hh, W_low, *peeps):
        a = addmm(a_in, h, W_hh, W_low)
        if peeps:
            pi, pf, po = peeps
            ai, af, ag, ao = a.chunk(4, 1)
            i = torch.sigmoid(torch.addcmul(ai, pi, c))
            f = torch.sigmoid(torch.addcmul(af, pf, c))
            c = torch.addcmul(f * c, i, torch.tanh(ag))
            o = torch.sigmoid(torch.addcmul(ao, po, c))
        else:
            # one sigmoid over all four gates is cheaper than three launches; g's slot is unused
            H = a.shape[1] // 4
            i, f, _, o = torch.sigmoid(a).chunk(4, 1)
            c = torch.addcmul(f * c, i, torch.tanh(a[:, 2 * H: 3 * H]))
        return o * torch.tanh(c), c

    return elman, lstm, gru


def lstm_first(torch, a_in, *peeps):
    """The LSTM's first step from zero state: no recurrent product, ``c = i * g``."""
    ai, _, ag, ao = a_in.chunk(4, 1)
    c = torch.sigmoid(ai) * torch.tanh(ag)
    o = torch.sigmoid(torch.addcmul(ao, peeps[2], c) if peeps else ao)
    return o * torch.tanh(c), c

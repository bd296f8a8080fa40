"""The cuda backend's output layer: logits, the forward pass's outputs, and the loss with dL/dz.

``net`` is a :class:`backends.cuda.net.Net`.
"""

from __future__ import annotations

from backends.cuda.forward import forward


def logits(net, top):
    """``z = top W_hy (+ b_y)`` over every step's rows: (T*B, O)."""
    flat = top.reshape(-1, net.dirs * net.H)
    b = net.p.get("b_y")
    if net.low is not None:
        z = net.mm(flat, net.W("W_hy"))
        return z if b is None else z.add_(b)
    return net.torch.mm(flat, net.p["W_hy"]) if b is None else net.torch.addmm(b, flat, net.p["W_hy"])


def outputs(net, xt):
    """The forward pass's outputs (T, B, O) on the device: softmax probabilities, or the mse head's."""
    _, top = forward(net, xt, train=False)
    z = logits(net, top).view(xt.shape[0], xt.shape[1], -1)
    if net.spec.head == "softmax_xent":
        return net.torch.softmax(z, dim=-1)
    return net.torch.tanh(z) if net.spec.output_act == "tanh" else z


def head(net, top, yt, T: int, B: int):
    """``(loss, dz)``: the reported loss (a device scalar) and dL/dz (T*B, O), tail steps masked."""
    torch = net.torch
    z = logits(net, top)
    if net.spec.head == "softmax_xent":
        y = yt.reshape(-1, 1)
        lse = torch.logsumexp(z, dim=1, keepdim=True)
        l_sum = (lse - z.gather(1, y)).sum()
        dz = torch.exp(z - lse)
        dz.scatter_add_(1, y, torch.full_like(dz[:, :1], -1.0))
        dz /= B
    else:
        out = torch.tanh(z) if net.spec.output_act == "tanh" else z
        diff = out - yt.reshape(z.shape)
        l_sum = 0.5 * (diff * diff).sum()
        dz = diff / B
        if net.spec.output_act == "tanh":
            dz = dz * (1 - out * out)
    if net.spec.bptt.mode == "tail":
        dz[: max(0, T - net.spec.bptt.k) * B] = 0
    return l_sum / (B * T), dz

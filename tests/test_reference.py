"""The oracle checks itself: central finite differences of the objective it claims to differentiate."""

import itertools

import numpy as np
import pytest

from harness.spec import reference as ref
from harness.spec.model import ModelSpec

T, B, D, H, O = 6, 2, 3, 4, 5


def _data(tokens, head, seed=0, T=T):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, D, size=(T, B)) if tokens else rng.normal(size=(T, B, D))
    y = rng.integers(0, O, size=(T, B)) if head == "softmax_xent" else rng.normal(size=(T, B, O))
    return x, y


def _randomise(params, seed=1):
    """Non-zero biases and peepholes, so their gradients are exercised too."""
    rng = np.random.default_rng(seed)
    return {k: v + 0.3 * rng.normal(size=v.shape) for k, v in params.items()}


def _surrogate(spec, params, base, x, y):
    """The function whose exact gradient ``bptt`` asks for, by brute force.

    States before a truncation window are taken from the unperturbed ``base``
    parameters (they are constants); the steps inside are recomputed with ``params``.
    """
    Tn = x.shape[0]
    mode, K = spec.bptt.mode, spec.bptt.k
    _, base_cache = ref.forward(spec, base, x)

    def state_at(t):  # each layer's (h, c) before step t, from the base run
        return [(lay[0]["h"][t], lay[0]["c"][t]) for lay in base_cache["layers"]]

    if mode == "full":
        z, _ = ref.forward(spec, params, x)
        return ref.head(spec, z, y)[0].sum() / B
    if mode == "tail":
        t0 = max(0, Tn - K)
        z, _ = ref.forward(spec, params, x[t0:], state=state_at(t0))
        return ref.head(spec, z, y[t0:])[0].sum() / B
    total = 0.0
    for t in range(Tn):
        t0 = max(0, t - K)
        z, _ = ref.forward(spec, params, x[t0 : t + 1], state=state_at(t0))
        total += ref.head(spec, z[-1:], y[t : t + 1])[0].sum() / B
    return total


def _fd_check(spec, tokens, seed=0):
    x, y = _data(tokens, spec.head, seed)
    params = _randomise(ref.init_params(spec, D, O, seed=seed))
    _, grads = ref.loss_and_grads(spec, params, x, y)
    eps = 1e-6
    for name, value in params.items():
        num = np.zeros_like(value)
        for idx in np.ndindex(value.shape):
            plus = {**params, name: value.copy()}
            minus = {**params, name: value.copy()}
            plus[name][idx] += eps
            minus[name][idx] -= eps
            num[idx] = (_surrogate(spec, plus, params, x, y) - _surrogate(spec, minus, params, x, y)) / (2 * eps)
        np.testing.assert_allclose(grads[name], num, rtol=1e-5, atol=1e-7, err_msg=f"{spec.describe()} {name}")


BPTTS = ["full", {"truncated": 2}, {"tail": 3}]
HEADS = [("softmax_xent", "linear"), ("mse", "linear"), ("mse", "tanh")]

ELMAN_CASES = [
    dict(kind="elman", hidden=H, activation=act, bias=bias, head=hd, output_act=oa, bptt=bp, layers=layers)
    for act, bias, (hd, oa), bp, layers in itertools.product(
        ["tanh", "relu", "sigmoid"], [True, False], HEADS, BPTTS, [1, 2]
    )
]
LSTM_CASES = [
    dict(kind="lstm", hidden=H, bias=bias, head=hd, output_act=oa, bptt=bp, layers=layers, peephole=peep)
    for peep, bias, (hd, oa), bp, layers in itertools.product([False, True], [True, False], HEADS, BPTTS, [1, 2])
]

GRU_CASES = [
    dict(kind="gru", hidden=H, reset_after=after, bias=bias, head=hd, output_act=oa, bptt=bp, layers=layers)
    for after, (bias, layers), (hd, oa), bp in itertools.product([True, False], [(True, 1), (True, 2), (False, 1)],
                                                                 HEADS, BPTTS)
]
# bidirectional layers need full BPTT: every cell and head, two layers with one head, no biases with another
BIDIRECTIONAL_CASES = [
    dict(cell, hidden=H, bias=i != 2, head=hd, output_act=oa, layers=2 if i == 1 else 1, bidirectional=True)
    for cell in (dict(kind="elman", activation="tanh"), dict(kind="elman", activation="relu"), dict(kind="lstm"),
                 dict(kind="lstm", peephole=True), dict(kind="gru"), dict(kind="gru", reset_after=False))
    for i, (hd, oa) in enumerate(HEADS)
]


@pytest.mark.parametrize("tokens", [True, False], ids=["tokens", "dense"])
@pytest.mark.parametrize("model", ELMAN_CASES + LSTM_CASES + GRU_CASES + BIDIRECTIONAL_CASES,
                         ids=lambda m: ModelSpec.from_mapping(m).describe())
def test_finite_differences(model, tokens):
    _fd_check(ModelSpec.from_mapping(model), tokens)


def test_random_lm_starts_at_log_vocab():
    vocab = 8000
    spec = ModelSpec.from_mapping({"kind": "elman", "hidden": 100, "bias": False, "head": "softmax_xent"})
    params = ref.init_params(spec, vocab, vocab, seed=10)
    rng = np.random.default_rng(0)
    x = rng.integers(0, vocab, size=(20, 4))
    y = rng.integers(0, vocab, size=(20, 4))
    loss, _ = ref.loss_and_grads(spec, params, x, y)
    assert abs(loss - np.log(vocab)) < 0.01, loss


def _grads(bptt, x, y, kind="elman"):
    spec = ModelSpec.from_mapping({"kind": kind, "hidden": H, "bptt": bptt})
    params = _randomise(ref.init_params(spec, D, O, seed=3))
    return ref.loss_and_grads(spec, params, x, y)[1]


@pytest.mark.parametrize("kind", ["elman", "lstm", "gru"])
def test_truncated_and_tail_differ_but_equal_full_when_k_covers_sequence(kind):
    x, y = _data(True, "softmax_xent", seed=5, T=10)
    full = _grads("full", x, y, kind)
    trunc4 = _grads({"truncated": 4}, x, y, kind)
    tail4 = _grads({"tail": 4}, x, y, kind)
    diff = max(np.abs(trunc4[k] - tail4[k]).max() for k in full)
    assert diff > 1e-3, "truncated:4 and tail:4 must give different gradients"
    assert max(np.abs(trunc4[k] - full[k]).max() for k in full) > 1e-4
    for mode in ({"truncated": 10}, {"tail": 10}, {"tail": 50}):
        got = _grads(mode, x, y, kind)
        for k in full:
            np.testing.assert_allclose(got[k], full[k], rtol=1e-12, atol=1e-14, err_msg=f"{mode} {k}")


def test_gru_forms_and_directions_are_what_spec_says():
    """One step by hand (h_0 = 0): the forms differ only through b_hn's reset; the reverse direction reads
    the sequence backwards; swapping the gate blocks changes the answer (the order r, z, n is checked)."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(1, B, D))
    after = ModelSpec.from_mapping({"kind": "gru", "hidden": H, "head": "mse"})
    p = _randomise(ref.init_params(after, D, O, seed=4))
    a_r, a_z, a_n = np.split(x[0] @ p["W_ih"] + p["b"], 3, axis=-1)
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    r, z = sig(a_r), sig(a_z)
    h1 = (1 - z) * np.tanh(a_n + r * p["b_hn"])
    np.testing.assert_allclose(ref.forward(after, p, x)[1]["top"][0], h1, rtol=1e-12)
    before = ModelSpec.from_mapping({"kind": "gru", "hidden": H, "head": "mse", "reset_after": False})
    pb = {k: v for k, v in p.items() if k != "b_hn"}
    np.testing.assert_allclose(ref.forward(before, pb, x)[1]["top"][0], (1 - z) * np.tanh(a_n), rtol=1e-12)
    swapped = dict(p, W_ih=np.concatenate(np.split(p["W_ih"], 3, axis=1)[::-1], axis=1))
    assert np.abs(ref.forward(after, swapped, x)[0] - ref.forward(after, p, x)[0]).max() > 1e-3
    bi = ModelSpec.from_mapping({"kind": "gru", "hidden": H, "head": "mse", "bidirectional": True})
    pbi = _randomise(ref.init_params(bi, D, O, seed=5))
    xs = rng.normal(size=(5, B, D))
    top = ref.forward(bi, pbi, xs)[1]["top"]
    assert top.shape == (5, B, 2 * H)
    fwd = {k: pbi[k] for k in after.param_names() if k not in ("W_hy", "b_y")}
    rev = {k: pbi[k + "_rev"] for k in fwd}
    W = np.zeros((H, O))
    np.testing.assert_allclose(top[..., :H], ref.forward(after, {**fwd, "W_hy": W, "b_y": 0 * pbi["b_y"]}, xs)[1]["top"])
    np.testing.assert_allclose(top[..., H:], ref.forward(after, {**rev, "W_hy": W, "b_y": 0 * pbi["b_y"]},
                                                         xs[::-1])[1]["top"][::-1])


def test_sgd_update_clips_each_element():
    params = {"w": np.array([1.0, 2.0, 3.0])}
    grads = {"w": np.array([10.0, -0.5, -10.0])}
    out = ref.sgd_update(params, grads, lr=0.1, clip=1.0)
    np.testing.assert_allclose(out["w"], [0.9, 2.05, 3.1])
    out = ref.sgd_update(params, grads, lr=0.1)
    np.testing.assert_allclose(out["w"], [0.0, 2.05, 4.0])


def test_init_params_are_deterministic_and_shaped():
    spec = ModelSpec.from_mapping({"kind": "lstm", "hidden": 4, "peephole": True, "layers": 2})
    a = ref.init_params(spec, 3, 5, seed=7)
    b = ref.init_params(spec, 3, 5, seed=7, dtype="float32")
    assert list(a) == spec.param_names()
    assert a["W_ih"].shape == (3, 16) and a["W_ih_1"].shape == (4, 16) and a["W_hy"].shape == (4, 5)
    assert b["W_hh"].dtype == np.float32
    np.testing.assert_array_equal(a["W_hh"].astype(np.float32), b["W_hh"])
    assert np.abs(a["W_hh"]).max() <= 0.5 and not a["p_o_1"].any()
    spec_e = ModelSpec.from_mapping({"kind": "elman", "hidden": 4})
    e = ref.init_params(spec_e, 9, 5, seed=7)
    assert np.abs(e["W_xh"]).max() <= 1 / 3 and np.abs(e["W_xh"]).max() > 0.2

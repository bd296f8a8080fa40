"""The native C++ backend against the reference: the conformance matrix, its threaded
code paths, and the asynchronous parameter-server variant."""

import numpy as np
import pytest

from harness.verify import check
from harness.spec import reference as ref
from harness.spec.model import REDUCED_DTYPES, ModelSpec, Problem


def _native(variant=None):
    from backends.native_backend import NativeBackend

    backend = NativeBackend(variant)
    ok, why = backend.availability()
    if not ok:
        pytest.skip(why)
    return backend


class _Threaded:
    """Mixin: every prepare gets `threads` threads, and every phase is split among them."""

    threads = 2

    def prepare(self, problem, params, device="cpu", threads=1):
        self.split_scale = 0.0
        self.adapt_threads = False  # every call on both threads, never the one-thread choice
        super().prepare(problem, params, device, threads=self.threads)


def _failures(results):
    return [f"{r.case} {r.dtype}: {r.status} {r.reason}" for r in results if r.status not in ("pass", "unsupported")]


@pytest.mark.parametrize("variant", ["default", "sync"])
def test_conformance_matrix(variant):
    backend = _native(variant)
    results = [check.run_case(backend, case) for case in check.all_cases()]
    assert not _failures(results)
    # float16 is refused with the reason; bfloat16 runs where the CPU has AVX512-BF16 and is refused
    # elsewhere (tests/test_native_bfloat16.py checks it there on the instruction's emulation)
    mixed = [r for r in results if r.dtype in REDUCED_DTYPES]
    assert mixed and all(r.status == "unsupported" and "float16" in r.reason for r in mixed if r.dtype == "float16")
    has_bf16 = backend.supports(next(c for c in check.all_cases() if c.dtype == "bfloat16").problem())[0]
    assert all(r.status == ("pass" if has_bf16 else "unsupported") for r in mixed if r.dtype == "bfloat16")
    assert has_bf16 or all("AVX512-BF16" in r.reason for r in mixed if r.dtype == "bfloat16")
    results = [r for r in results if r.dtype not in REDUCED_DTYPES]
    n_pass = sum(r.status == "pass" for r in results)
    assert n_pass >= 0.9 * len(results), f"only {n_pass} of {len(results)} cases supported"
    # the GRU (both forms) and bidirectional layers are computed, not refused
    new = [r for r, c in zip(results, check.all_cases()) if check.gru_or_bidirectional(c)]
    assert new and all(r.status == "pass" for r in new)


@pytest.mark.parametrize("variant,recurrence", [("default", "batch"), ("default", "hidden"), ("sync", "auto")])
def test_two_threads_with_every_phase_split(variant, recurrence):
    from backends.native_backend import NativeBackend

    _native(variant)
    backend = type("ThreadedNative", (_Threaded, NativeBackend), {})(variant)
    backend.recurrence = recurrence  # both ways of sharing the per-step recurrence
    # the WildML shapes cost reference time, not threading coverage: split_scale=0 already
    # drives every parallel path on the small cases; the realistic LSTM keeps the real thresholds
    cases = [c for c in check.one_direction_elman_lstm(check.all_cases(quick=True))
             if "wildml" not in c.label and c.dtype not in REDUCED_DTYPES]
    results = [check.run_case(backend, case) for case in cases]
    assert not _failures(results)
    assert all(r.status == "pass" for r in results)


def _problem(model, tokens=True, workload="train_step", D=6, O=6, T=5, B=4, dtype="float64"):
    return Problem(ModelSpec.from_mapping(model), D, O, tokens, dtype, B, T, "cpu", workload)


def test_truncation_window_longer_than_the_sequence_is_full_bptt():
    backend = _native()
    problem = _problem({"kind": "lstm", "hidden": 5, "bptt": {"truncated": 9}, "layers": 2})
    params = ref.init_params(problem.model, 6, 6, seed=3)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 6, size=(5, 4)), rng.integers(0, 6, size=(5, 4))
    backend.prepare(problem, params)
    loss, grads = backend.loss_and_grads(x, y)
    want_loss, want = ref.loss_and_grads(problem.model, params, x, y)
    assert loss == pytest.approx(want_loss, rel=1e-12)
    for k, g in want.items():
        np.testing.assert_allclose(grads[k], g, rtol=1e-9, atol=1e-12 * np.abs(g).max())


_LARGE = {
    "elman": {"kind": "elman", "activation": "sigmoid"},
    "lstm": {"kind": "lstm", "peephole": True},
    "gru": {"kind": "gru"},
    "gru-before": {"kind": "gru", "reset_after": False},
}


@pytest.mark.parametrize("few_row_routes", [True, False])
@pytest.mark.parametrize("kind", list(_LARGE))
def test_large_recurrent_products_match_the_reference(kind, few_row_routes):
    # H = 256 with 16 rows per step: the Elman W_hh (512 KiB) stays in cache and is used in
    # 128-column blocks; the LSTM's (2 MiB) and the GRU's (1.5 MiB) do not, and the forward
    # uses their transpose; with the routes on, every per-step product goes through the
    # transposed-output path
    backend = _native()
    from backends.native_backend import _load

    model = _LARGE[kind] | {"hidden": 256}
    problem = _problem(model, tokens=False, D=8, O=5, T=4, B=16)
    params = ref.init_params(problem.model, 8, 5, seed=4)
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(4, 16, 8)), rng.integers(0, 5, size=(4, 16))
    before = _load().set_few_row_routes(few_row_routes)
    try:
        backend.prepare(problem, params, threads=2)
        loss, grads = backend.loss_and_grads(x, y)
    finally:
        _load().set_few_row_routes(before)
    want_loss, want = ref.loss_and_grads(problem.model, params, x, y)
    assert loss == pytest.approx(want_loss, rel=1e-12)
    for k, g in want.items():
        np.testing.assert_allclose(grads[k], g, rtol=1e-9, atol=1e-12 * np.abs(g).max())


_GRU_AND_BIDIRECTIONAL = [
    {"kind": "gru"},
    {"kind": "gru", "reset_after": False},
    {"kind": "gru", "bptt": {"truncated": 2}},
    {"kind": "gru", "reset_after": False, "bptt": {"truncated": 2}},
    {"kind": "gru", "bptt": {"tail": 3}},
    {"kind": "gru", "reset_after": False, "bptt": {"tail": 3}, "bias": False},
    {"kind": "elman", "bidirectional": True},
    {"kind": "lstm", "peephole": True, "bidirectional": True},
    {"kind": "gru", "bidirectional": True},
    {"kind": "gru", "reset_after": False, "bidirectional": True},
]


@pytest.mark.parametrize("recurrence", ["batch", "hidden"])
@pytest.mark.parametrize("tokens", [True, False])
@pytest.mark.parametrize("model", _GRU_AND_BIDIRECTIONAL, ids=lambda m: ModelSpec.from_mapping(m).describe())
def test_gru_and_bidirectional_layers_on_two_threads(model, tokens, recurrence):
    """Two stacked layers, every phase split over two threads, the recurrence by batch rows or by
    hidden units: the gradients and a clipped SGD step (gradient buffers, sparse token rows of
    each direction's table) against the reference."""
    from backends.native_backend import NativeBackend

    _native()
    backend = type("ThreadedNative", (_Threaded, NativeBackend), {})()
    backend.recurrence = recurrence
    # H = 20: split by hidden units, one thread gets 16 units and the other 4
    problem = _problem(model | {"hidden": 20, "layers": 2, "clip": 0.05}, tokens=tokens, D=7, O=4, T=6, B=4)
    params = ref.init_params(problem.model, 7, 4, seed=11)
    rng = np.random.default_rng(12)
    x = rng.integers(0, 7, size=(6, 4)) if tokens else rng.normal(size=(6, 4, 7))
    y = rng.integers(0, 4, size=(6, 4))
    backend.prepare(problem, {k: v.copy() for k, v in params.items()})
    loss, grads = backend.loss_and_grads(x, y)
    want_loss, want = ref.loss_and_grads(problem.model, params, x, y)
    assert loss == pytest.approx(want_loss, rel=1e-12)
    assert set(grads) == set(want)
    for k, g in want.items():
        np.testing.assert_allclose(grads[k], g, rtol=1e-9, atol=1e-12 * np.abs(g).max(), err_msg=k)
    backend.sgd_step(x, y, 0.5)
    _, after = ref.sgd_step(problem.model, params, x, y, 0.5)
    got = backend.get_params()
    for k, v in after.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-12, atol=1e-14, err_msg=k)


def test_out_of_range_token_is_an_error_not_a_crash():
    backend = _native()
    problem = _problem({"kind": "elman", "hidden": 4})
    backend.prepare(problem, ref.init_params(problem.model, 6, 6, seed=0))
    x = np.full((5, 4), 6)
    with pytest.raises(IndexError):
        backend.sgd_step(x, np.zeros((5, 4), np.int64), 0.1)


def _copy_task(B, T=8, V=5, seed=0):
    """Next token = current token + 1 (mod V): learnable, so the loss must fall."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, V, size=B)
    x = (start[None, :] + np.arange(T)[:, None]) % V
    return x, (x + 1) % V


@pytest.mark.parametrize("model", [{"kind": "elman", "hidden": 16},
                                   {"kind": "gru", "hidden": 16, "bidirectional": True}])
def test_async_is_timed_in_train_only_and_learns(model):
    # the bidirectional token model has two token tables, each pulled and pushed by rows
    backend = _native("async")
    assert not backend.supports(_problem(model, workload="train_step"))[0]
    assert not backend.supports(_problem(model, workload="forward"))[0]
    problem = _problem(model, workload="train", D=5, O=5, T=8, B=8, dtype="float32")
    assert backend.supports(problem) == (True, "")
    params = ref.init_params(problem.model, 5, 5, seed=1, dtype="float32")
    backend.prepare(problem, params, threads=2)
    x, y = _copy_task(8)
    backend.warm_up((x, y))
    # its exact gradient is still the reference's
    loss, grads = backend.loss_and_grads(x, y)
    want_loss, want = ref.loss_and_grads(problem.model, ref.params_like(params, np.float64), x, y)
    assert loss == pytest.approx(want_loss, rel=1e-4)
    for k in want:
        np.testing.assert_allclose(grads[k], want[k], rtol=1e-3, atol=1e-5 * np.abs(want[k]).max(), err_msg=k)
    first = backend.sgd_step(x, y, 0.5)
    for step in range(60):
        last = backend.sgd_step(*_copy_task(8, seed=step + 1), 0.5)
    assert np.isfinite(last) and last < 0.5 * first
    after = backend.get_params()
    assert set(after) == set(params) and not np.allclose(after["W_hh"], params["W_hh"])


def test_single_input_weight_gradient_over_long_sequences_matches():
    """Input size 1 makes dW_xh a one-row product reduced over all T*B rows (the Sobel
    task); that sum must stay within the float32 bound, as the per-cell check demands."""
    from harness.spec.data import make_dataset
    from harness.spec.model import TaskSpec

    spec = ModelSpec.from_mapping({"kind": "elman", "hidden": 32, "head": "mse", "output_act": "tanh"})
    task = TaskSpec.from_mapping({"kind": "sobel", "seq_len": 256, "height": 64, "n_sequences": 64, "n_eval": 8})
    data = make_dataset(task, spec, 3, "float32")
    x, y = data.batch(np.arange(16))
    params = ref.init_params(spec, 1, 1, seed=3, dtype="float32")
    backend = _native()
    backend.prepare(Problem(spec, 1, 1, False, "float32", 16, 256), {k: v.copy() for k, v in params.items()})
    backend.sgd_step(x, y, 0.005)
    before = ref.params_like(params, np.float64)
    _, want = ref.sgd_step(spec, before, x, y, 0.005)
    rtol, atol = check.TOLERANCES["float32"]
    eps = float(np.finfo(np.float32).eps)
    got = backend.get_params()
    for k in want:
        ratio, name = check.compare(f"update of {k}", np.asarray(got[k], np.float64) - before[k], want[k] - before[k],
                                    rtol, atol, floor=4 * eps * np.abs(before[k]))
        assert ratio <= 1, name


@pytest.mark.parametrize("kind", ["elman", "lstm", "gru", "gru-before"])
def test_fused_update_of_deep_products_rounds_once(kind):
    """Fused SGD (no clipping) writes -lr * grad straight into the weights. Over T*B = 4096
    rows BLAS adds its product in K panels, and adding each one into the weights rounds it
    at the size of a weight: the update must instead match the unfused step (gradient
    buffer, then one subtraction, taken here by a clip too large to act) within one ulp."""
    # the GRU's reset before updates W_hh in two column blocks (h for r, z; r * h for n)
    spec = {"kind": "gru", "reset_after": False, "hidden": 48} if kind == "gru-before" else {"kind": kind, "hidden": 48}
    problem = _problem(spec, tokens=False, D=16, O=8, T=64, B=64, dtype="float32")
    unfused = _problem(spec | {"clip": 1e30}, tokens=False, D=16, O=8, T=64, B=64, dtype="float32")
    params = ref.init_params(problem.model, 16, 8, seed=5, dtype="float32")
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(64, 64, 16)).astype(np.float32), rng.integers(0, 8, size=(64, 64))
    got = {}
    for p in (problem, unfused):
        backend = _native()
        backend.prepare(p, {k: v.copy() for k, v in params.items()}, threads=2)
        backend.sgd_step(x, y, 0.01)
        got[p.model.clip] = backend.get_params()
        backend.close()
    fused, plain = got[None], got[1e30]
    for k, v in plain.items():
        ulps = np.abs(fused[k].astype(np.float64) - v) / np.spacing(np.abs(v))
        assert ulps.max() <= 1, f"{k}: {ulps.max():.0f} ulp from the unfused update"


@pytest.mark.parametrize("recurrence,per_step", [("batch", False), ("hidden", True)])
def test_profile_counts_phases_threads_and_barriers(recurrence, per_step):
    backend = _native()
    problem = _problem({"kind": "elman", "hidden": 32}, tokens=False, D=8, O=5, T=12, B=16, dtype="float32")
    params = ref.init_params(problem.model, 8, 5, seed=2, dtype="float32")
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(12, 16, 8)).astype(np.float32), rng.integers(0, 5, size=(12, 16))
    backend.prepare(problem, params, threads=2)
    backend.sgd_step(x, y, 0.1)
    assert backend.profile() is None  # off by default
    backend.split_scale, backend.recurrence, backend.profiling, backend.adapt_threads = 0.0, recurrence, True, False
    backend.prepare(problem, params, threads=2)
    for _ in range(3):
        backend.sgd_step(x, y, 0.1)
    prof = backend.profile(reset=True)
    assert prof["steps"] == 3 and prof["runs"] == [3, 3] and prof["team_sizes"] == {2: 3}
    phases = prof["phases"]
    for name in ("input_projection", "recurrence_forward", "output_gemm", "head", "output_grads",
                 "recurrence_backward", "weight_grads"):
        for t in range(2):
            assert phases[name]["seconds"][t] > 0 and phases[name]["cpu_seconds"][t] >= 0
            assert phases[name]["wait_seconds"][t] <= phases[name]["seconds"][t]
    for t in range(2):
        inside = sum(p["seconds"][t] for p in phases.values())
        assert inside <= prof["wall_seconds"][t] and 0 < prof["cpu_seconds"][t]
    # the recurrence meets once per time step (forward and backward) only when split by hidden units
    barriers = prof["barriers"][0] / 3
    assert (barriers >= 2 * 11) == per_step, barriers
    assert backend.profile()["steps"] == 0  # reset


def test_team_size_is_timed_and_the_faster_kept():
    backend = _native()
    problem = _problem({"kind": "elman", "hidden": 16}, tokens=False, D=4, O=3, T=6, B=8, dtype="float32")
    params = ref.init_params(problem.model, 4, 3, seed=5, dtype="float32")
    rng = np.random.default_rng(6)
    x, y = rng.normal(size=(6, 8, 4)).astype(np.float32), rng.integers(0, 3, size=(6, 8))
    backend.split_scale, backend.profiling = 0.0, True
    backend.prepare(problem, params, threads=2)
    before = backend.get_params()
    backend.warm_up((x, y))  # the probe runs here, on lr = 0 steps: team, team, one, one, team, team, one, one
    assert backend.profile(reset=True)["team_sizes"] == {1: 4, 2: 4}
    assert all(np.array_equal(before[k], v) for k, v in backend.get_params().items())
    for _ in range(5):  # then the tuner's choices (tuner_trace tests below say which)
        backend.sgd_step(x, y, 0.1)
    assert sum(backend.profile()["team_sizes"].values()) == 5
    backend.adapt_threads = False
    backend.prepare(problem, params, threads=2)
    for _ in range(4):
        backend.sgd_step(x, y, 0.1)
    assert backend.profile()["team_sizes"] == {2: 4}


def _trace(team, solo, n):
    """Team sizes the engine's tuner picks over n calls costing team(i) / solo(i) ns on 2 threads."""
    from backends import _native

    return _native.tuner_trace(2, [float(team(i)) for i in range(n)], [float(solo(i)) for i in range(n)])


def test_tuner_keeps_the_team_on_idle_cores_and_rarely_tries_one_thread():
    picks = _trace(lambda i: 1e6, lambda i: 2e6, 500)
    assert picks[:8] == [2, 2, 1, 1, 2, 2, 1, 1]  # the probe
    solo = [i for i, n in enumerate(picks) if n == 1 and i >= 8]
    assert len(solo) == 2 * 3 and all(b - a == 1 for a, b in zip(solo[::2], solo[1::2]))  # tries of 2 calls
    assert min(b - a for a, b in zip(solo[1::2], solo[2::2])) >= 150  # every ~160 calls


def test_tuner_falls_back_to_one_thread_under_load_and_backs_off_its_tries():
    picks = _trace(lambda i: 3e6, lambda i: 2e6, 400)
    team = [i for i, n in enumerate(picks) if n == 2 and i >= 8]
    starts = team[::2]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert starts[0] - 8 <= 10  # the first try 10 calls after the probe
    assert [round(g / 20) for g in gaps[:4]] == [1, 2, 4, 8]  # then 20, 40, 80, 160 calls apart
    assert sum(n == 1 for n in picks[8:]) / len(picks[8:]) > 0.95


def test_tuner_follows_the_load_both_ways():
    # the other core busy for calls 100-299: the team loses there
    picks = _trace(lambda i: 3e6 if 100 <= i < 300 else 1e6, lambda i: 2e6, 600)
    assert sum(n == 1 for n in picks[110:300]) / 190 > 0.9
    back = next(i for i in range(300, 600) if picks[i:i + 20] == [2] * 20)
    assert back <= 300 + 162  # within one gap of the longest (160 calls and a try)
    assert sum(n == 1 for n in picks[back:]) <= 2  # one try of one thread in the 160 calls after

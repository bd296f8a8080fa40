"""The native engine's own float32 kernel of the per-step recurrent products
(backends/native/gemm_f32.hpp: W_hh packed once per pass, AVX-512 or AVX2 + FMA chosen from
CPUID) against float64 products and against the BLAS route, and the engine's FMA peak kernel."""

import numpy as np
import pytest

from harness.spec import reference as ref
from harness.spec.model import ModelSpec, Problem


def _mod():
    from backends.native_backend import NativeBackend, _load

    ok, why = NativeBackend().availability()
    if not ok:
        pytest.skip(why)
    return _load()


def _kernels():
    """The own kernels this CPU runs (AVX-512 needs avx512f; AVX2 needs avx2 and fma)."""
    mod, out = _mod(), []
    before = mod.f32_kernel()
    for k in ("avx512", "avx2"):
        try:
            mod.set_f32_kernel(k)
            out.append(k)
        except ValueError:
            pass
    mod.set_f32_kernel("auto" if before != "blas" else "blas")
    return out


@pytest.fixture(params=["avx512", "avx2"])
def kernel(request):
    mod = _mod()
    if request.param not in _kernels():
        pytest.skip(f"this CPU cannot run the {request.param} kernel")
    before = mod.set_f32_kernel(request.param)
    yield request.param
    mod.set_f32_kernel("auto" if before != "blas" else "blas")


def _expected(a, b, c0, tb, alpha, beta, repeat):
    want = c0.astype(np.float64)
    op_b = (b.T if tb else b).astype(np.float64)
    for _ in range(repeat):
        want = alpha * a.astype(np.float64) @ op_b + beta * want
    return want


# M, N, K: single and odd row tiles, partial column panels, K past one block (128) and K = 1
_SHAPES = [(2, 37, 5), (3, 100, 130), (8, 32, 128), (9, 33, 1), (16, 70, 300), (17, 64, 257), (64, 96, 129)]


@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("M,N,K", _SHAPES)
def test_recurrent_gemm_matches_float64(kernel, M, N, K, tb):
    mod, rng = _mod(), np.random.default_rng(M * 1000 + N + K)
    a = rng.normal(size=(M, K)).astype(np.float32)
    b = rng.normal(size=(N, K) if tb else (K, N)).astype(np.float32)
    c0 = rng.normal(size=(M, N)).astype(np.float32)
    for alpha, beta, repeat in [(1.0, 0.0, 1), (0.5, 1.0, 3), (-2.0, 0.25, 2)]:
        c = c0.copy()
        # repeat > 1: the same op(b) every call, packed once (a recurrence's steps)
        mod.gemm(a, b, c, False, tb, alpha, beta, "float32", 1, True, repeat)
        want = _expected(a, b, c0, tb, alpha, beta, repeat)
        scale = np.abs(a).astype(np.float64) @ np.abs(b.T if tb else b) * abs(alpha) * repeat + np.abs(want)
        assert np.all(np.abs(c - want) <= 1e-5 * scale), (alpha, beta, repeat)


def test_rows_of_a_strided_operand_and_threads(kernel):
    # A and C as row slices of wider arrays (the engine's gate blocks), two threads splitting columns
    mod, rng = _mod(), np.random.default_rng(7)
    big_a = rng.normal(size=(16, 300)).astype(np.float32)
    b = rng.normal(size=(200, 130)).astype(np.float32)
    big_c = np.zeros((16, 400), np.float32)
    a, c = big_a[:, :200], big_c[:, 50:180]
    mod.gemm(a, b, c, False, False, 1.0, 0.0, "float32", 2, True, 1)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)
    assert not big_c[:, :50].any() and not big_c[:, 180:].any()  # nothing written past the block


def test_the_blas_route_remains_selectable():
    mod = _mod()
    before = mod.set_f32_kernel("blas")
    try:
        assert mod.f32_kernel() == "blas"
        a, b = np.ones((4, 8), np.float32), np.ones((8, 5), np.float32)
        c = np.zeros((4, 5), np.float32)
        mod.gemm(a, b, c, False, False, 1.0, 0.0, "float32", 1, True, 2)
        np.testing.assert_array_equal(c, 8.0)
    finally:
        mod.set_f32_kernel("auto" if before != "blas" else "blas")
    with pytest.raises(ValueError):
        mod.set_f32_kernel("sse9")


def test_auto_picks_the_widest_kernel_the_cpu_flags_allow():
    from pathlib import Path

    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), None)
    if flags is None:
        pytest.skip("no /proc/cpuinfo flags here")
    mod = _mod()
    before = mod.set_f32_kernel("auto")
    try:
        want = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= set(flags) else "blas"
        assert mod.f32_kernel() == want
    finally:
        mod.set_f32_kernel("auto" if before != "blas" else "blas")


_MODELS = {
    "elman": {"kind": "elman", "activation": "tanh"},
    "lstm": {"kind": "lstm", "peephole": True},
    "gru": {"kind": "gru"},
    "gru-before": {"kind": "gru", "reset_after": False},
    "bilstm": {"kind": "lstm", "bidirectional": True},
}


def _step(kind, f32_kernel, threads, recurrence, B):
    from backends.native_backend import NativeBackend

    _mod()
    model = _MODELS[kind] | {"hidden": 96}
    problem = Problem(ModelSpec.from_mapping(model), 8, 5, False, "float32", B, 6, "cpu", "train_step")
    params = ref.init_params(problem.model, 8, 5, seed=4, dtype="float32")
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(6, B, 8)).astype(np.float32), rng.integers(0, 5, size=(6, B))
    backend = NativeBackend()
    backend.f32_kernel = f32_kernel
    backend.split_scale = 0.0  # every phase shared by the team, the recurrence included
    backend.adapt_threads = False
    backend.recurrence = recurrence
    backend.prepare(problem, params, threads=threads)
    assert _mod().f32_kernel() == (_kernels()[0] if f32_kernel == "auto" else f32_kernel)
    try:
        loss, grads = backend.loss_and_grads(x, y)
    finally:
        backend.close()
        _mod().set_f32_kernel("auto")
    return problem, params, x, y, loss, grads


@pytest.mark.parametrize("threads,recurrence", [(1, "auto"), (2, "batch"), (2, "hidden")])
@pytest.mark.parametrize("kind", list(_MODELS))
def test_engine_gradients_on_the_own_kernel_match_the_reference(kind, threads, recurrence):
    if not _kernels():
        pytest.skip("no own float32 kernel on this CPU")
    problem, params, x, y, loss, grads = _step(kind, "auto", threads, recurrence, B=16)
    want_loss, want = ref.loss_and_grads(problem.model, {k: v.astype(np.float64) for k, v in params.items()}, x, y)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    _, _, _, _, _, blas = _step(kind, "blas", threads, recurrence, B=16)
    for k, g in want.items():
        scale = np.abs(g).max()
        np.testing.assert_allclose(grads[k], g, rtol=1e-3, atol=1e-4 * scale, err_msg=k)
        # the BLAS route's float32 result differs from the own kernel's by summation order alone
        np.testing.assert_allclose(grads[k], blas[k], rtol=1e-3, atol=1e-5 * scale, err_msg=k)


def test_the_engine_runs_its_products_on_the_own_kernel():
    # 3 rows a step: the own kernel splits each sum over k two ways, the BLAS does not, so the
    # float32 results differ in their last bits where (and only where) the own kernel ran
    if not _kernels():
        pytest.skip("no own float32 kernel on this CPU")
    *_, own = _step("elman", "auto", 1, "auto", B=3)
    *_, blas = _step("elman", "blas", 1, "auto", B=3)
    *_, again = _step("elman", "auto", 1, "auto", B=3)
    assert any(not np.array_equal(own[k], blas[k]) for k in own)
    assert all(np.array_equal(own[k], again[k]) for k in own)


def test_sixteen_rows_on_two_threads_are_shared_by_batch_rows_on_the_own_kernel():
    # 8 rows a thread pay for reading all of W_hh where it is packed once per pass (kMinRowsOwn), not
    # through the BLAS (kMinRows 16); split by hidden units the team meets at every step, by batch rows never
    from backends.native_backend import NativeBackend

    if not _kernels():
        pytest.skip("no own float32 kernel on this CPU")
    problem = Problem(ModelSpec.from_mapping({"kind": "elman", "hidden": 64}), 8, 5, False, "float32", 16, 12, "cpu",
                      "train_step")
    params = ref.init_params(problem.model, 8, 5, seed=4, dtype="float32")
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(12, 16, 8)).astype(np.float32), rng.integers(0, 5, size=(12, 16))
    per_step = {}
    for f32_kernel in ("auto", "blas"):
        backend = NativeBackend()
        backend.f32_kernel, backend.split_scale, backend.adapt_threads, backend.profiling = f32_kernel, 0.0, False, True
        backend.prepare(problem, params, threads=2)
        try:
            for _ in range(3):
                backend.sgd_step(x, y, 0.1)
            prof = backend.profile()
        finally:
            backend.close()
            _mod().set_f32_kernel("auto")
        assert prof["team_sizes"] == {2: 3}
        per_step[f32_kernel] = prof["barriers"][0] / 3
    assert per_step["auto"] < 2 * 11 <= per_step["blas"], per_step


def test_the_rule_is_recorded_in_the_versions():
    from backends.native_backend import NativeBackend

    mod = _mod()
    routes = NativeBackend().versions()["gemm_routes"]
    lo, hi = mod.f32_own_rows
    if mod.f32_kernel() == "blas":
        assert "the BLAS" in routes
    else:
        assert f"{lo}-{hi} rows: own {mod.f32_kernel()} kernel" in routes and "packed once per pass" in routes


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_fma_peak_is_the_kernels_rate(precision):
    mod = _mod()
    one = mod.fma_peak(precision, 1, 0.05)
    if not one["kernel"]:
        assert precision == "bfloat16" and not mod.bf16_cpu() and one["gflops"] == 0.0
        return
    # bfloat16: the best unit this process may run, AMX's tiles where granted
    best = "tdpbf16ps" if precision == "bfloat16" and not mod.amx_why_not() else "vdpbf16ps"
    assert (best if precision == "bfloat16" else "vfmadd231ps") in one["kernel"]
    # a core does at least 8 float32 multiply-adds per cycle at 0.5 GHz: 8 GFLOP/s, a loaded machine included
    assert one["gflops"] > 8.0
    with pytest.raises(ValueError):
        mod.fma_peak("float16", 1, 0.01)
    with pytest.raises(ValueError, match="unit"):
        mod.fma_peak(precision, 1, 0.01, "fp8")


def test_each_bfloat16_unit_has_its_peak():
    """Where AMX is granted, its tile peak beside VDPBF16PS's; a unit this process cannot run has none."""
    mod = _mod()
    if not mod.bf16_cpu():
        pytest.skip("this CPU has no AVX512-BF16")
    vdp = mod.fma_peak("bfloat16", 1, 0.05, "avx512bf16")
    assert vdp["kernel"] == "avx512bf16 vdpbf16ps" and vdp["gflops"] > 8.0
    tiles = mod.fma_peak("bfloat16", 1, 0.05, "amx")
    if mod.amx_why_not():
        assert tiles == {"kernel": "", "gflops": 0.0}
    else:  # 16 x 16 x 32 multiply-adds an instruction: far above VDPBF16PS on any AMX core
        assert tiles["kernel"] == "amx tdpbf16ps" and tiles["gflops"] > 2 * vdp["gflops"]

"""The native engine's bfloat16 path (docs/spec.md, "Reduced precision"): its GEMM
(backends/native/gemm_bf16.hpp) against NumPy with ml_dtypes' rounding, and the engine's
mixed-precision steps against the reference with the spec's roundings.

On a CPU with AVX512-BF16 these run the VDPBF16PS kernel, and where the CPU has AMX-BF16 and
Linux grants the tiles the AMX kernel (backends/native/gemm_amx.hpp), and compare each with the
portable emulation; elsewhere the backend refuses bfloat16, and the tests ask for the emulation
(``NativeBackend.bf16_kernel = "portable"``), which runs the same packing, blocking and
engine code with the instruction emulated lane by lane."""

import numpy as np
import pytest

from harness.spec import reference as ref
from harness.spec.model import ModelSpec, Problem
from harness.verify import check

ml_dtypes = pytest.importorskip("ml_dtypes")


def _mod():
    from backends.native_backend import NativeBackend, _load

    ok, why = NativeBackend().availability()
    if not ok:
        pytest.skip(why)
    return _load()


def _kernels():
    """The kernels this CPU can run: the emulation, VDPBF16PS where the CPU has it, AMX where it is granted."""
    mod = _mod()
    return ["portable"] + (["avx512bf16"] if mod.bf16_cpu() else []) + \
        (["amx"] if mod.bf16_cpu() and mod.amx_why_not() == "" else [])


def _why_not(kernel):
    mod = _mod()
    return mod.amx_why_not() or "this CPU has no AVX512-BF16" if kernel == "amx" else "this CPU has no AVX512-BF16"


@pytest.fixture(params=["portable", "avx512bf16", "amx"])
def kernel(request):
    mod = _mod()
    if request.param not in _kernels():
        pytest.skip(_why_not(request.param))
    before = mod.set_bf16_kernel(request.param)
    yield request.param
    mod.set_bf16_kernel("auto" if before != "portable" else "portable")


def _bf16(a):
    with np.errstate(invalid="ignore", over="ignore"):  # NaNs and infinities among the rounding tests' bits
        return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


# -- the rounding ----------------------------------------------------------------------------------

def test_rounding_is_ml_dtypes_round_to_nearest_even():
    mod = _mod()
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    # ties (low half exactly 0x8000) on odd and even bfloat16 neighbours, and the values around them
    ties = (rng.integers(0, 2**16, size=4000, dtype=np.uint32) << 16) | np.uint32(0x8000)
    special = np.array([0, 0x80000000, 0x00000001, 0x007fffff, 0x00800000, 0x7f7fffff, 0xff7fffff, 0x7f7f8000,
                        0x7f7f7fff, 0x7f800000, 0xff800000, 0x7fc00000, 0x7f800001, 0xffc00001, 0x3f808000,
                        0x3f818000, 0x3f807fff, 0x3f808001], np.uint32)
    x = np.concatenate([bits, ties, ties - 1, ties + 1, special]).view(np.float32)
    got, want = mod.round_bf16(x), _bf16(x)
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    assert (got[~nan].view(np.uint32) == want[~nan].view(np.uint32)).all()  # bit for bit, signed zeros too
    assert mod.round_bf16(np.float32([1 + 2**-8]))[0] == 1.0  # a tie goes to the even neighbour
    assert mod.round_bf16(np.float32([3.4e38]))[0] == np.inf  # past bfloat16's largest finite value


# -- the GEMM --------------------------------------------------------------------------------------

# (M, N, K): edges of the 8-row and 32-column micro-tiles, odd K (a zero partner in the last pair),
# K past one 512-deep pass (a second pass adds into C), M past a 256-row block, single rows and columns
SHAPES = [(1, 1, 1), (3, 5, 7), (8, 32, 2), (9, 33, 3), (7, 31, 513), (17, 70, 1025), (260, 40, 37),
          (64, 96, 64), (2, 200, 11), (33, 1, 9)]


def _operands(rng, M, N, K, ta, tb, exact, pad=0):
    """op(A) (M x K) and op(B) (K x N) stored as ta / tb ask, as slices of wider arrays (row strides
    ``pad`` past the width). ``exact``: numbers a few bits from bfloat16's grid, whose products' sums
    are exact in float32: off the grid by less than half a unit, so only their rounding gets them there."""
    def draw(shape):
        if exact:
            grid = rng.integers(-16, 17, size=shape) / 8.0
            return (grid * (1 + rng.uniform(-1, 1, size=shape) * 2.0**-10)).astype(np.float32), grid
        v = rng.normal(size=shape).astype(np.float32)
        return v, _bf16(v).astype(np.float64)

    def store(shape, t):
        value, rounded = draw(shape)
        stored = value.T if t else value
        wide = np.full((stored.shape[0], stored.shape[1] + pad), np.nan, np.float32)
        wide[:, : stored.shape[1]] = stored
        return wide[:, : stored.shape[1]], rounded

    A, Ar = store((M, K), ta)
    B, Br = store((K, N), tb)
    return A, Ar, B, Br


@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_gemm_is_exact_where_the_sums_are(kernel, ta, tb):
    """Inputs near bfloat16's grid whose rounded products sum exactly: every element must equal the
    float64 product of the rounded inputs, whatever the order of the sums: a misplaced or unrounded
    element, a lost pair, a wrong stride or a C read under beta = 0 shows at once."""
    mod, rng = _mod(), np.random.default_rng(1)
    for M, N, K in SHAPES:
        for alpha, beta in ((1.0, 0.0), (1.0, 1.0), (-0.5, 1.0), (0.25, 0.0), (2.0, -1.0)):
            A, Ar, B, Br = _operands(rng, M, N, K, ta, tb, exact=True, pad=3)
            C0 = rng.integers(-8, 9, size=(M, N)).astype(np.float32)
            C = C0.copy() if beta else np.full((M, N), np.nan, np.float32)  # beta 0: C is never read
            mod.gemm(A, B, C, ta, tb, alpha, beta, "bfloat16")
            want = alpha * (Ar @ Br) + (beta * C0 if beta else 0)
            np.testing.assert_array_equal(C, want.astype(np.float32), err_msg=f"{M}x{N}x{K} {alpha} {beta}")


@pytest.mark.parametrize("ta,tb", [(False, False), (True, True)])
def test_gemm_sums_in_float32_on_random_inputs(kernel, ta, tb):
    """Random normal inputs: within float32's summation error of the float64 product of the rounded
    inputs (so the rounding is there: without it the error would be bfloat16's, 2^-9, not 2^-24 K)."""
    mod, rng = _mod(), np.random.default_rng(2)
    eps = float(np.finfo(np.float32).eps)
    for M, N, K in SHAPES:
        A, Ar, B, Br = _operands(rng, M, N, K, ta, tb, exact=False, pad=1)
        C0 = rng.normal(size=(M, N)).astype(np.float32)
        C = C0.copy()
        mod.gemm(A, B, C, ta, tb, 1.0, 1.0, "bfloat16")
        want = Ar @ Br + C0
        bound = 2 * K * eps * (np.abs(Ar) @ np.abs(Br) + np.abs(C0)) + 1e-30
        assert (np.abs(C - want) <= bound).all(), f"{M}x{N}x{K}: {np.abs(C - want).max()}"
        unrounded = A.T if ta else A
        assert K < 4 or np.abs(C - (unrounded.astype(np.float64) @ (B.T if tb else B) + C0)).max() > bound.max()


@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_each_operand_is_packed_with_the_rounding(kernel, ta, tb):
    """op(A) I and I op(B) with I the identity: every element of the result is one operand's element rounded
    to bfloat16 (times 1, plus exact zeros), so both packings of both kernels must round as ml_dtypes does,
    ties and carries into the exponent included, at every position of a panel (odd K, partial tiles);
    a NaN stays NaN."""
    mod, rng = _mod(), np.random.default_rng(5)
    for M, K in ((9, 33), (8, 64), (17, 7), (1, 70), (40, 3), (33, 97), (16, 5), (25, 4)):
        bits = rng.integers(0, 2**32, size=(M, K), dtype=np.uint64).astype(np.uint32)
        bits[:, ::3] = (bits[:, ::3] & np.uint32(0xFFFF0000)) | np.uint32(0x8000)  # ties
        bits[:, 1::5] |= np.uint32(0x7FFF)  # one below a tie, and carries (0x..7FFF + 1)
        x = bits.view(np.float32)
        finite = np.isfinite(x) & (np.abs(x) < 1e38) & (np.abs(x) > 1e-37)  # products and sums stay exact
        x = np.where(finite, x, np.float32(1.5))  # (an infinity times the identity's zeros would be NaN)
        want = _bf16(x)
        eye = {n: np.eye(n, dtype=np.float32) for n in (K, M)}
        A = np.ascontiguousarray(x.T) if ta else x  # op(A) = x, then op(B) = x
        C = np.zeros((M, K), np.float32)
        mod.gemm(A, eye[K], C, ta, False, 1.0, 0.0, "bfloat16")
        np.testing.assert_array_equal(C, want, err_msg=f"A {M}x{K} ta={ta}")
        B = np.ascontiguousarray(x.T) if tb else x
        C = np.zeros((M, K), np.float32)
        mod.gemm(eye[M], B, C, False, tb, 1.0, 0.0, "bfloat16")
        np.testing.assert_array_equal(C, want, err_msg=f"B {M}x{K} tb={tb}")
    a = np.float32([[np.nan, 1.0]])
    c = np.zeros((1, 1), np.float32)
    mod.gemm(np.ascontiguousarray(a.T) if ta else a, np.float32([[1.0], [1.0]]), c, ta, False, 1.0, 0.0, "bfloat16")
    assert np.isnan(c[0, 0])


def test_gemm_edge_cases(kernel):
    mod = _mod()
    C = np.full((3, 4), 2.0, np.float32)
    mod.gemm(np.zeros((3, 0), np.float32), np.zeros((0, 4), np.float32), C, beta=0.5, precision="bfloat16")
    assert (C == 1.0).all()  # K = 0: C = beta C
    mod.gemm(np.zeros((3, 0), np.float32), np.zeros((0, 4), np.float32), C, beta=0.0, precision="bfloat16")
    assert (C == 0.0).all()
    # VDPBF16PS reads bfloat16 denormals as zero (and the emulation does as the instruction does)
    # (2^-130 2^100 = 2^-30 in exact arithmetic: a difference from the reference far below any tolerance)
    tiny = np.float32(2.0**-130)  # a float32 denormal, and a bfloat16 one after rounding
    a, b = np.float32([[tiny, 0.0]]), np.float32([[2.0**100], [3.0]])
    assert (_bf16(a).astype(np.float64) @ _bf16(b))[0, 0] == 2.0**-30
    c = np.ones((1, 1), np.float32)
    mod.gemm(a, b, c, precision="bfloat16")
    assert c[0, 0] == 0.0
    with pytest.raises(ValueError, match="disagree"):
        mod.gemm(np.zeros((3, 2), np.float32), np.zeros((3, 4), np.float32), C, precision="bfloat16")


@pytest.mark.parametrize("other", ["avx512bf16", "amx"])
def test_both_kernels_agree(other):
    """Where the CPU has VDPBF16PS (and AMX): the emulation gives the instruction's results (exactly on sums
    that are exact, within float32 summation order otherwise)."""
    mod = _mod()
    if other not in _kernels():
        pytest.skip(_why_not(other) + ": the portable kernel alone runs here")
    rng = np.random.default_rng(3)
    eps = float(np.finfo(np.float32).eps)
    try:
        for exact in (True, False):
            for M, N, K in SHAPES:
                A, Ar, B, Br = _operands(rng, M, N, K, False, True, exact=exact)
                got = {}
                for k in ("portable", other):
                    mod.set_bf16_kernel(k)
                    got[k] = np.zeros((M, N), np.float32)
                    mod.gemm(A, B, got[k], False, True, 1.0, 0.0, "bfloat16")
                bound = 0 if exact else 2 * K * eps * (np.abs(Ar) @ np.abs(Br))
                assert (np.abs(got["portable"] - got[other]) <= bound).all(), (M, N, K, exact)
    finally:
        mod.set_bf16_kernel("auto")


def test_few_rows_go_to_the_pair_kernel_on_an_amx_cpu():
    """A product of fewer rows than a tile's sixteenth to eighth use is worth (bf16.hpp, kAmxMinRows) runs on
    VDPBF16PS even where AMX runs the rest: bit for bit the pair kernel's result; four rows are AMX's."""
    mod = _mod()
    if "amx" not in _kernels():
        pytest.skip(_why_not("amx"))
    rng = np.random.default_rng(6)
    try:
        for M, same in ((1, True), (3, True), (4, False), (16, False)):
            A, _, B, _ = _operands(rng, M, 96, 70, False, False, exact=False)
            got = {}
            for k in ("avx512bf16", "amx"):
                mod.set_bf16_kernel(k)
                got[k] = np.zeros((M, 96), np.float32)
                mod.gemm(A, B, got[k], precision="bfloat16")
            if same:
                np.testing.assert_array_equal(got["amx"], got["avx512bf16"])
            else:  # another kernel: another summation order (not bit for bit on these random sums)
                assert not np.array_equal(got["amx"], got["avx512bf16"]), M
    finally:
        mod.set_bf16_kernel("auto")


def test_threaded_gemm_is_the_single_threaded_one(kernel):
    mod, rng = _mod(), np.random.default_rng(4)
    A, _, B, _ = _operands(rng, 20, 150, 33, False, False, exact=False)
    one, two = np.zeros((20, 150), np.float32), np.zeros((20, 150), np.float32)
    mod.gemm(A, B, one, precision="bfloat16")
    mod.gemm(A, B, two, precision="bfloat16", threads=2)
    np.testing.assert_array_equal(one, two)  # column blocks of 32: the same tiles, the same sums


# -- the engine ------------------------------------------------------------------------------------

def _backend(variant=None, cls=None):
    """A native backend that runs bfloat16: the CPU's VDPBF16PS kernel, or the emulation where there is none."""
    from backends.native_backend import NativeBackend

    mod = _mod()
    backend = (cls or NativeBackend)(variant)
    backend.bf16_kernel = "auto" if mod.bf16_cpu() else "portable"
    return backend


BF16 = [c for c in check.all_cases() if c.dtype == "bfloat16"]
# the small shape, one case per cell and bptt mode (the options and input kinds alternate among them)
BF16_SMALL = list({(c.name, c.model.bptt.mode): c for c in reversed(BF16) if c.batch <= 3}.values())


def _failures(results, cases):
    return [f"{c.label}: {r.status} {r.reason} {r.worst_ratio}" for r, c in zip(results, cases) if r.status != "pass"]


def test_support_follows_the_cpu():
    from backends.native_backend import NativeBackend

    mod = _mod()
    backend = NativeBackend()
    problem = Problem(ModelSpec(kind="lstm", hidden=8), 5, 6, False, "bfloat16", 3, 7)
    ok, why = backend.supports(problem)
    if mod.bf16_cpu():  # the fastest unit this process may run
        assert ok and why == "" and mod.bf16_kernel() == ("amx" if "amx" in _kernels() else "avx512bf16")
    else:
        assert not ok and "AVX512-BF16" in why and "would not measure bfloat16" in why
    backend.bf16_kernel = "portable"
    assert backend.supports(problem) == (True, "")
    ok, why = backend.supports(Problem(ModelSpec(kind="lstm", hidden=8), 5, 6, False, "float16", 3, 7))
    assert not ok and "float16" in why
    assert "bf16_gemm" in backend.versions()


def test_each_unit_is_forced_or_refused_with_its_reason():
    """bf16_kernel "amx" / "avx512bf16" force a unit (for A/B runs) where this process can run it, and are
    unsupported, with the reason, elsewhere; the run's gemm_routes names the kernel that runs."""
    from backends.native_backend import NativeBackend

    mod = _mod()
    problem = Problem(ModelSpec(kind="gru", hidden=8), 5, 6, False, "bfloat16", 3, 7)
    for unit in ("amx", "avx512bf16"):
        backend = NativeBackend()
        backend.bf16_kernel = unit
        ok, why = backend.supports(problem)
        if unit in _kernels():
            assert (ok, why) == (True, "")
            backend.prepare(problem, ref.init_params(problem.model, 5, 6, seed=1, dtype="float32"))
            assert mod.bf16_kernel() == unit
            assert f"bfloat16 products: every one on the {unit} kernel" in backend.versions()["gemm_routes"]
            backend.close()
        else:
            assert not ok and why.startswith("unsupported:")
            with pytest.raises(ValueError):
                mod.set_bf16_kernel(unit)
    if "amx" not in _kernels() and mod.bf16_cpu():
        assert mod.amx_why_not() in NativeBackend().versions()["bf16_gemm"]
    mod.set_bf16_kernel("auto")


@pytest.mark.parametrize("variant", ["default", "sync"])
def test_the_bfloat16_matrix_passes(variant):
    """Every bfloat16 case of the conformance matrix (each cell, head and bptt mode, token and dense input,
    two layers, bidirectional, the realistic LSTM and GRU) against the reference with the spec's roundings;
    the sync variant on the small shapes."""
    cases = BF16 if variant == "default" else BF16_SMALL
    backend = _backend(variant)
    results = [check.run_case(backend, c) for c in cases]
    assert not _failures(results, cases)
    # the bound's third clause already asks for results nearer the roundings than float64; a backend that
    # rounds where the spec does lands on the reference up to float32 summation order
    assert max(r.worst_ratio for r in results) < 0.6


@pytest.mark.parametrize("recurrence", ["batch", "hidden"])
def test_the_bfloat16_matrix_passes_on_two_threads(recurrence):
    """Every phase split over two threads (the recurrence by batch rows, or by hidden units: each thread
    keeps its column blocks of W_hh packed across the steps)."""
    from backends.native_backend import NativeBackend
    from test_native_backend import _Threaded

    backend = _backend(cls=type("ThreadedNative", (_Threaded, NativeBackend), {}))
    backend.recurrence = recurrence
    results = [check.run_case(backend, c) for c in BF16_SMALL]
    assert not _failures(results, BF16_SMALL)


def test_bfloat16_differs_from_float32_by_the_roundings():
    """The same engine in float32 and in bfloat16 on float32 data: the bfloat16 gradients are the
    reference's with bfloat16 roundings, not float32's."""
    case = next(c for c in BF16 if c.model.kind == "lstm" and c.batch > 3)
    params, (x, y) = check.initial_params(case), check.make_data(case)
    got = {}
    for dtype in ("float32", "bfloat16"):
        backend = _backend()
        problem = Problem(case.model, case.input_size, case.output_size, case.tokens, dtype, case.batch, case.seq_len)
        backend.prepare(problem, ref.params_like(params, np.float32))
        got[dtype] = backend.loss_and_grads(x, y)[1]
    _, low = ref.loss_and_grads(case.model, ref.params_like(params, np.float32), x, y, ref.Precision.of("bfloat16"))
    for k, g in low.items():
        m = np.abs(g).max()
        assert np.abs(got["bfloat16"][k] - g).max() < 0.1 * np.abs(got["float32"][k] - g).max() + 1e-6 * m, k


def test_async_bfloat16_learns():
    backend = _backend("async")
    model = ModelSpec.from_mapping({"kind": "lstm", "hidden": 16})
    problem = Problem(model, 5, 5, True, "bfloat16", 8, 8, "cpu", "train")
    assert backend.supports(problem) == (True, "")
    backend.prepare(problem, ref.init_params(model, 5, 5, seed=1, dtype="bfloat16"), threads=2)

    def copy_task(seed):
        x = np.random.default_rng(seed).integers(0, 5, size=(8, 8))
        return x, x.copy()

    first = backend.sgd_step(*copy_task(0), 0.5)
    for step in range(60):
        last = backend.sgd_step(*copy_task(step + 1), 0.5)
    assert np.isfinite(last) and last < 0.5 * first, (first, last)


def test_the_float64_engine_refuses_bfloat16():
    mod = _mod()
    from backends.native_backend import _engine_spec

    problem = Problem(ModelSpec(kind="elman", hidden=4), 3, 3, False, "float64", 2, 3)
    spec = _engine_spec(problem) | {"bf16": True}
    params = [np.zeros(s, np.float64) for s in problem.model.param_shapes(3, 3).values()]
    with pytest.raises(ValueError, match="Net32"):
        mod.Net64(spec, "default", 1, 1, params)

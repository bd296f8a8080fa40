"""Mixed precision (docs/spec.md, "Reduced precision"): the reference's roundings, the bound derived from
them, the backends that implement it passing and deliberately wrong ones caught, and the config."""

from dataclasses import replace

import numpy as np
import pytest

import backends
from harness.spec import reference as ref
from harness.spec.errors import HarnessError
from harness.spec.model import REDUCED_DTYPES, ModelSpec, Problem
from harness.spec.tolerance import SPREAD, Tolerance
from harness.verify.check import (FLOAT16_OTHER_SCALE, Case, all_cases, initial_params, make_data, run_case,
                                  with_loss_scale)
from wrong_backends import WrongBackend


def _case(kind: str, dtype: str, batch: int, tokens: bool = False, hidden: int = 64, seq_len: int = 25,
          **model) -> Case:
    """The check's realistic shape (D=32, H=64, T=25) at any batch (or a smaller hidden and sequence)."""
    spec = ModelSpec.from_mapping({"kind": kind, "hidden": hidden, "head": "softmax_xent", **model})
    return Case(f"{spec.describe()} D=32 T={seq_len} B={batch}", spec, tokens, 32, 50, seq_len, batch, dtype, seed=11)


def _by_cell(cases):
    """One case per cell (the first word of the label) and batch: every shape of the check, every cell."""
    picked = {}
    for c in cases:
        picked.setdefault((c.label.split()[0], c.batch, c.input_size), c)
    return list(picked.values())


FULL = all_cases()
BF16_SHAPES = _by_cell([c for c in FULL if c.dtype == "bfloat16"])
FP16_SHAPES = _by_cell([c for c in FULL if c.dtype == "float16"])


# -- the reference's roundings ---------------------------------------------------------------------

def test_round_to_is_round_to_nearest_even():
    one = np.float32(1)
    assert ref.round_to(one + np.float32(2 ** -8), "bfloat16") == one  # a tie goes to the even neighbour
    assert ref.round_to(one + np.float32(3 * 2 ** -9), "bfloat16") == one + np.float32(2 ** -7)
    assert ref.round_to(one + np.float32(2 ** -11), "float16") == one
    assert ref.round_to(np.float32(70000), "float16") == np.inf  # past float16's largest, 65504


def test_precision_rounds_every_product_and_nothing_else():
    case = _case("lstm", "bfloat16", 4, peephole=True)
    params = initial_params(case)
    x, y = make_data(case)
    low, exact = ref.Precision.of("bfloat16"), ref.EXACT
    _, g_low = ref.loss_and_grads(case.model, params, x, y, low)
    _, g_32 = ref.loss_and_grads(case.model, params, x, y, exact)
    assert all(g.dtype == np.float32 for g in g_low.values())  # float32 masters and gradients
    moved = {k: np.abs(g_low[k] - g_32[k]).max() / np.abs(g_32[k]).max() for k in g_32}
    assert all(1e-5 < m < 0.05 for m in moved.values()), moved  # bfloat16's roundings, and no more
    # products of numbers already on bfloat16's grid are exact: one Elman step from rounded weights and
    # data is float64's to float32's accuracy (the rounding touches the products' inputs and nothing else)
    model = ModelSpec.from_mapping({"kind": "elman", "hidden": 8, "head": "mse"})
    p = {k: ref.round_to(v, "bfloat16") for k, v in ref.init_params(model, 32, 6, 0, "float32").items()}
    x1 = ref.round_to(np.random.default_rng(0).normal(size=(1, 4, 32)), "bfloat16")
    h_low = ref.forward(model, p, x1, precision=low)[1]["layers"][0][0]["h"][1]
    h_64 = ref.forward(model, ref.params_like(p, np.float64), x1.astype(np.float64))[1]["layers"][0][0]["h"][1]
    assert h_low.dtype == np.float32 and np.abs(h_low - h_64).max() < 1e-6


def test_loss_scale_is_exact_for_powers_of_two_and_overflow_diverges():
    case = _case("gru", "float16", 4, reset_after=False)
    params = initial_params(case)
    x, y = make_data(case)
    g = {s: ref.loss_and_grads(case.model, params, x, y, ref.Precision.of("float16", s))[1] for s in (128.0, 1024.0)}
    # scaling by a power of two commutes with rounding to float16 but where a value falls below float16's
    # normal range (6.1e-5): the two scales agree to far less than the roundings move the gradients (5e-4)
    assert all(np.abs(g[128.0][k] - g[1024.0][k]).max() <= 1e-5 * np.abs(g[1024.0][k]).max() for k in g[128.0])
    loss, after = ref.sgd_step(case.model, params, x, y, 0.1, ref.Precision.of("float16", 2.0 ** 32))
    assert np.isnan(loss)  # the scaled gradient overflows float16: the cell is diverged
    numpy_backend = backends.create("numpy")
    numpy_backend.prepare(replace(case, loss_scale=2.0 ** 32).problem(), initial_params(case))
    assert np.isnan(numpy_backend.sgd_step(x, y, 0.1))


# -- the bound -------------------------------------------------------------------------------------

def test_the_bound_is_shown_and_comes_from_the_reference_run():
    tol = Tolerance.of("bfloat16")
    assert tol.low_dtype == "bfloat16" and tol.spread == SPREAD and tol.eps == np.finfo(np.float32).eps
    assert "max|ref_bf16 - ref|" in tol.describe() and "ref_fp16" in Tolerance.of("float16").describe()
    want = np.array([1.0, -2.0, 0.5])
    low = want + np.array([0.01, 0.0, -0.01])  # the roundings move the tensor by 0.01 at most
    judge = lambda got: tol.judge({"a": (got, want)}, low=lambda: {"a": low})["a"]  # noqa: E731
    assert judge(low) < 1e-9
    assert judge(low + 0.9 * SPREAD * 0.01) < 1 < judge(low + 1.1 * SPREAD * 0.01)
    with pytest.raises(ValueError):
        tol.judge({"a": (want, want)})


# -- correct backends pass -------------------------------------------------------------------------

CORRECT = ["numpy", "jax", "torch"]  # torch: its autograd step with the spec's product emulated on the CPU


def _available(name):
    b = backends.create(name)
    if not b.availability()[0]:
        pytest.skip(f"{name}: {b.availability()[1]}")
    return b


@pytest.fixture
def emulated(monkeypatch):
    """torch's mixed-precision step on the CPU with the spec's product emulated in float32 (on a GPU it is
    cuBLAS's; on the CPU torch refuses mixed precision, having no such product)."""
    from backends import low_precision

    monkeypatch.setattr(low_precision, "EMULATE_ON_CPU", True)


@pytest.mark.parametrize("name", CORRECT)
@pytest.mark.parametrize("batch", [1, 256])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_correct_backends_pass_at_batch_1_and_256(name, batch, kind, emulated):
    res = run_case(_available(name), _case(kind, "bfloat16", batch, tokens=batch == 1, hidden=16, seq_len=10))
    assert res.status == "pass", (res.reason, res.details)


@pytest.mark.parametrize("name", CORRECT)
def test_correct_backends_pass_the_quick_mixed_precision_cases(name, emulated):
    backend = _available(name)
    for case in (c for c in all_cases(quick=True) if c.dtype in REDUCED_DTYPES):
        res = run_case(backend, case)
        assert res.status == "pass", (case.label, case.dtype, res.reason, res.details)


# float16 and bfloat16 on every cell, dense and token input, one and two layers, both GRU forms, bidirectional
# layers, truncated and tail windows, at batch 1 and 256 (a small hidden and sequence keep it quick)
TORCH_CASES = [
    _case("elman", "float16", 1, tokens=True, hidden=16, seq_len=10, activation="relu", bptt={"truncated": 3}),
    _case("elman", "bfloat16", 256, hidden=16, seq_len=10, layers=2, head="mse", output_act="tanh"),
    _case("lstm", "float16", 256, hidden=16, seq_len=10, peephole=True, bptt={"tail": 4}, clip=0.5),
    _case("lstm", "bfloat16", 1, tokens=True, hidden=16, seq_len=10, bidirectional=True),
    _case("gru", "float16", 1, hidden=16, seq_len=10, reset_after=False, layers=2),
    _case("gru", "bfloat16", 256, tokens=True, hidden=16, seq_len=10, bidirectional=True, head="mse"),
]


@pytest.mark.parametrize("case", TORCH_CASES, ids=lambda c: f"{c.label} {c.dtype}")
def test_torch_rounds_where_the_spec_does(case, emulated):
    """torch's step with the spec's product lands on the reference with the spec's roundings up to float32's
    summation order (far inside the bound), and nearer it than float64 (it rounds)."""
    res = run_case(_available("torch"), case)
    assert res.status == "pass" and res.worst_ratio < 0.6, (res.worst, res.worst_ratio, res.reason)
    from harness.spec.tolerance import ROUNDED

    assert res.details["ratios"][ROUNDED] < 0.05, res.details


@pytest.mark.parametrize("dtype", REDUCED_DTYPES)
def test_torch_passes_the_whole_matrix_of_one_cell(dtype, emulated):
    """Every mixed-precision case of the conformance matrix of one cell (the bidirectional GRU: both
    directions, truncated and full windows, token and dense input)."""
    backend = _available("torch")
    cases = [c for c in FULL if c.dtype == dtype and c.label.startswith(("gru-bi", "realistic gru"))]
    assert cases
    for case in cases:
        res = run_case(backend, case)
        assert res.status == "pass", (case.label, res.reason, res.details)


def test_torch_on_the_cpu_refuses_mixed_precision_and_a_cpu_product_shows_why(monkeypatch):
    """On the CPU torch has no product with low-precision inputs and a float32 result: it says unsupported with
    that reason. Its low-precision ``a @ b`` rounds every result as well, which moves a step's results by
    the roundings' own size, where the spec's product lands on the reference with its roundings."""
    case = next(c for c in all_cases(quick=True) if c.dtype == "bfloat16" and c.model.kind == "gru")
    for name in ("torch", "torch:compile"):
        ok, why = _available(name).supports(case.problem())
        assert not ok and why.startswith(f"unsupported: {name} on the CPU") and "float32 result" in why, why
        assert "aten::mm.dtype" in why and "autocast" in why and "bfloat16" in why
        assert "GFLOP/s" not in why and "AVX" not in why  # the reason holds on every CPU: no rate of one CPU's
    from backends import low_precision

    monkeypatch.setattr(low_precision, "EMULATE_ON_CPU", True)
    exact = run_case(_available("torch"), case)
    import torch

    cpu_product = lambda a, b, low=torch.bfloat16: torch.mm(a.to(low), b.to(low)).float()  # noqa: E731
    assert torch.mm(torch.ones(1, 1, dtype=torch.bfloat16), torch.ones(1, 1, dtype=torch.bfloat16)).dtype == \
        torch.bfloat16  # what the CPU offers: the result in the low type
    monkeypatch.setattr(low_precision, "raw_product", lambda torch, low, device, emulate=False: cpu_product)
    monkeypatch.setattr(low_precision, "check_product", lambda *args: None)
    rounded_out = run_case(_available("torch"), case)
    assert exact.status == "pass" and exact.worst_ratio < 0.1, exact.details
    assert rounded_out.worst_ratio > 3 * exact.worst_ratio, (rounded_out.worst_ratio, exact.worst_ratio)


def test_torch_fused_refuses_mixed_precision_everywhere_and_gpu_needs_the_product(monkeypatch):
    from backends import low_precision

    gpu = Problem(ModelSpec(kind="gru", hidden=8), 5, 6, False, "float16", 1, 7, "gpu")
    for problem in (gpu, replace(gpu, device="cpu")):
        ok, why = _available("torch:fused").supports(problem)
        assert not ok and "cuDNN" in why and "h, c and the gates in float16" in why, why
    import torch

    if "dtype" in torch.ops.aten.mm.overloads():  # this torch has the product: on a GPU the cell runs
        assert _available("torch").supports(gpu) == (True, "")
        assert _available("torch:compile").supports(gpu) == (True, "")
    monkeypatch.setattr(low_precision, "gpu_product_missing", lambda torch: "torch 0.0 has no aten::mm.dtype")
    for name in ("torch", "cuda:fused"):
        ok, why = backends.create(name).supports(gpu)
        assert not ok and why == f"unsupported: {name}: torch 0.0 has no aten::mm.dtype", why


def test_the_product_rounds_its_operands_gradients_included(emulated):
    """The autograd product against its definition: forward ``round(a) @ round(b)``, backward
    ``round(g) @ round(b)^T`` and ``round(a)^T @ round(g)``, every sum and result float32; the probe
    accepts it and rejects a product that does not round its inputs or that rounds its result."""
    import torch

    from backends import low_precision
    from harness.spec.errors import HarnessError

    cpu = torch.device("cpu")
    low = torch.bfloat16
    raw = low_precision.raw_product(torch, low, cpu, emulate=True)
    mm = low_precision.autograd_product(torch, raw)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 7, generator=g, requires_grad=True)
    b = torch.randn(7, 3, generator=g, requires_grad=True)
    up = torch.randn(5, 3, generator=g)
    r = lambda t: torch.from_numpy(ref.round_to(t.detach().numpy(), "bfloat16")).double()  # noqa: E731
    out = mm(a, b)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), r(a) @ r(b), rtol=1e-6, atol=1e-6)
    out.backward(up)
    torch.testing.assert_close(a.grad.double(), r(up) @ r(b).T, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(b.grad.double(), r(a).T @ r(up), rtol=1e-6, atol=1e-6)
    b_low = b.detach().to(low)  # a weight rounded once for many steps: the same product, b still gets its gradient
    a.grad, b.grad = None, None
    mm(a, b, b_low).backward(up)
    torch.testing.assert_close(b.grad.double(), r(a).T @ r(up), rtol=1e-6, atol=1e-6)
    low_precision.check_product(torch, raw, low, cpu)
    for name, wrong in (("unrounded", lambda x, y: x @ y), ("result rounded", lambda x, y: (x.to(low) @ y.to(low)).float())):
        low_precision._checked.clear()
        with pytest.raises(HarnessError, match="unsupported: .*not the exact"):
            low_precision.check_product(torch, wrong, low, cpu)
    low_precision._checked.clear()
    with pytest.raises(HarnessError, match="unsupported: .*failed"):
        low_precision.check_product(torch, lambda x, y: torch.mm(x.to(low), y.to(low), out_dtype=torch.float32), low, cpu)
    low_precision._checked.clear()
    with pytest.raises(HarnessError, match="unsupported: .*float32 result"):
        low_precision.raw_product(torch, low, cpu)  # the CPU, no emulation: no such product


def test_numpy_honours_the_roundings_exactly():
    """numpy's products round the same inputs as the reference's; only float32 summation order differs."""
    for case in BF16_SHAPES[:6]:
        res = run_case(backends.create("numpy"), case)
        assert res.status == "pass" and res.worst_ratio < 0.2, (case.label, res.worst_ratio)


# -- wrong backends are caught ---------------------------------------------------------------------

def _wrong(variant, **attrs):
    backend = WrongBackend(variant)
    for k, v in attrs.items():
        setattr(backend, k, v)
    return backend


@pytest.mark.parametrize("case", BF16_SHAPES + FP16_SHAPES, ids=lambda c: f"{c.label} {c.dtype}")
def test_wrong_backends_are_caught_at_every_shape(case):
    assert run_case(backends.create("numpy"), case).status == "pass"
    wrong = [_wrong("scaled", factor=1.05), _wrong("nobias"), _wrong("nodtype")]
    for backend in wrong:
        res = run_case(backend, case)
        assert res.status == "fail", (backend.variant, res.worst_ratio, res.details)
    if case.dtype == "float16":  # a loss scale other than the default must reach the step
        scaled = case if case.loss_scale else with_loss_scale(case, FLOAT16_OTHER_SCALE)
        assert run_case(backends.create("numpy"), scaled).status == "pass"
        res = run_case(_wrong("lossscale"), scaled)
        assert res.status == "fail", res


# -- who supports it -------------------------------------------------------------------------------

REFUSING = ["numba", "theano", "pytensor", "halide", "numpy:wildml"]


@pytest.mark.parametrize("name", REFUSING)
@pytest.mark.parametrize("dtype", REDUCED_DTYPES)
def test_backends_without_a_mixed_precision_path_refuse_it_with_their_reason(name, dtype):
    import backends as registry

    r = registry.BackendRef.parse(name)
    cls = r.backend_class()
    backend = cls(r.variant)
    problem = Problem(ModelSpec(kind="elman", hidden=8, bias=True), 5, 6, False, dtype, 1, 7, "cpu")
    ok, why = backend.supports(problem)
    assert not ok and why.startswith("unsupported: ") and dtype in why, why
    assert "reduced" in cls.knows


@pytest.mark.parametrize("dtype", REDUCED_DTYPES)
def test_native_refuses_float16_and_bfloat16_without_avx512_bf16(dtype):
    """native runs bfloat16 on the CPU's VDPBF16PS (tests/test_native_bfloat16.py) and refuses it where the
    CPU has none, with the reason; float16 everywhere."""
    backend = _available("native")
    from backends.native_backend import _load

    problem = Problem(ModelSpec(kind="elman", hidden=8, bias=True), 5, 6, False, dtype, 1, 7, "cpu")
    ok, why = backend.supports(problem)
    if dtype == "bfloat16" and _load().bf16_cpu():
        assert ok, why
    else:
        assert not ok and why.startswith("unsupported: ") and dtype in why, why
    assert "reduced" in type(backend).knows


def test_a_backend_that_does_not_know_mixed_precision_is_refused_it():
    from backends.base import Backend, supports

    class Old(Backend):
        name = "old"

    problem = Problem(ModelSpec(), 5, 6, True, "bfloat16")
    ok, why = supports(Old(), problem)
    assert not ok and "mixed precision" in why
    assert supports(Old(), replace(problem, dtype="float32")) == (True, "")


# -- the config ------------------------------------------------------------------------------------

MIXED = """
name: mixed
dtype: [float32, bfloat16, float16]
model: {kind: lstm, hidden: 8}
task: {kind: random, input_size: 5, output_size: 6, seq_len: 7, n_sequences: 16, n_eval: 8}
batch: [4]
backends: [numpy]
train: {loss_scale: 256}
"""


def test_config_takes_the_mixed_precision_dtypes_and_the_loss_scale(write_config):
    from harness.config import estimate_bytes, load_config

    cells = {c.problem.dtype: c for c in load_config(write_config(MIXED)).cells()}
    assert set(cells) == {"float32", "bfloat16", "float16"}
    assert cells["float16"].problem.objective_scale == 256.0 and "train.loss_scale=256.0" in cells["float16"].group_key
    assert cells["bfloat16"].problem.objective_scale == 1.0 and "loss_scale" not in cells["bfloat16"].group_key
    assert cells["float32"].problem.objective_scale == 1.0 and "loss_scale" not in cells["float32"].group_key
    # parameters, gradients and state stay float32: the memory estimate is float32's
    assert estimate_bytes(cells["bfloat16"]) == estimate_bytes(cells["float32"])
    default = load_config(write_config(MIXED.replace("train: {loss_scale: 256}", ""), "d.yaml")).cells()
    assert {c.problem.objective_scale for c in default if c.problem.dtype == "float16"} == {1024.0}


@pytest.mark.parametrize("value, said", [("-1", "greater than 0"), ("0", "greater than 0"), ("'x'", "a number"),
                                         (".inf", "finite"), ("1.0e+10", "less than or equal to")])
def test_a_bad_loss_scale_is_a_config_error_naming_the_key(write_config, value, said):
    from harness.config import load_config
    from harness.spec.errors import HarnessError

    with pytest.raises(HarnessError, match=rf"train\.loss_scale: .*{said}"):
        load_config(write_config(MIXED.replace("loss_scale: 256", f"loss_scale: {value}")))


def test_plots_and_roofs_read_the_mixed_precision_dtypes():
    import pandas as pd

    from harness.results.plots import arithmetic_intensity

    row = {"model": "lstm", "batch": 64, "input_size": 512, "hidden_size": 512, "output_size": 512}
    df = pd.DataFrame([{**row, "dtype": d} for d in ("float32", "bfloat16", "float16")])
    ai = arithmetic_intensity(df)
    assert ai[1] == pytest.approx(2 * ai[0]) and ai[2] == ai[1]  # products read 2-byte numbers


def test_a_low_precision_gemm_rate_is_measured_through_a_library_that_has_the_type():
    from harness.worker.cpu_roofs import gemm_rate

    for library in ("jax", "torch"):
        pytest.importorskip(library)
        assert gemm_rate("bfloat16", library, n=64, seconds=0.01) > 0
    assert gemm_rate("float32", "numpy", n=64, seconds=0.01) > 0
    with pytest.raises(HarnessError, match="NumPy has no bfloat16 product"):
        gemm_rate("bfloat16", "numpy", n=64)
    with pytest.raises(HarnessError, match="no GEMM peak is measured through 'mkl'"):
        gemm_rate("float32", "mkl", n=64)
    from backends import _native

    if _native.bf16_cpu():  # the engine's own bfloat16 GEMM, where the CPU has the instruction
        assert gemm_rate("bfloat16", "native", n=64, seconds=0.01) > 0
    else:
        with pytest.raises(HarnessError, match="unavailable: this CPU has no AVX512-BF16"):
            gemm_rate("bfloat16", "native", n=64)


def test_a_bfloat16_cell_reads_the_fastest_librarys_roof_and_carries_float32s(write_config, monkeypatch):
    """The run measures float32's roof through NumPy and bfloat16's through each library that has the type;
    the fastest is the cells' roof, float32's rides along to be drawn beside it."""
    from harness.results.rows import peak_columns
    from harness.run import roofs
    from harness.config import load_config

    cfg = load_config(write_config("""
name: roofs
dtype: [bfloat16]
model: {kind: lstm, hidden: 8}
task: {kind: random, input_size: 4, output_size: 4, seq_len: 5}
threads: [2]
backends: [numpy, jax]
"""))
    asked = []

    def measure(dtype, threads, library, extra, say, record, clean=False):
        asked.append((dtype, threads, library))
        return {"numpy": 100.0, "jax": 40.0, "torch": 1.5, "native": None, "fma": None}[library]

    monkeypatch.setattr(roofs, "_measure", measure)
    monkeypatch.setattr(roofs, "_UNAVAILABLE", set())
    peaks = roofs.gemm_peaks(cfg.cells(), {})
    # the hardware FMA peak is asked for in both types (here the kernel is unavailable: the libraries' roofs stand)
    assert sorted(asked) == [("bfloat16", 2, "fma"), ("bfloat16", 2, "jax"), ("bfloat16", 2, "native"),
                             ("bfloat16", 2, "torch"), ("float32", 2, "fma"), ("float32", 2, "numpy")]
    assert peaks == {"float32|threads=2|numpy": 100.0, "float32|threads=2": 100.0, "bfloat16|threads=2|jax": 40.0,
                     "bfloat16|threads=2|torch": 1.5, "bfloat16|threads=2": 40.0}
    asked.clear()
    assert roofs.gemm_peaks(cfg.cells(), peaks) == {} and asked == []  # once per run, unavailable ones too
    cell = cfg.cells()[0]
    assert peak_columns(cell, peaks, None) == {"gemm_peak_gflops": 40.0, "gemm_peak_library": "jax",
                                               "master_peak_gflops": 100.0}


def test_the_roofline_draws_the_low_types_roof_beside_float32s(tmp_path, monkeypatch):
    import pandas as pd

    from harness.results import plot_roofline, plots

    drawn = []
    save = plot_roofline._save
    monkeypatch.setattr(plot_roofline, "_save", lambda plt, fig, *a, **k: (drawn.extend(
        t.get_text() for ax in fig.axes for t in ax.texts), save(plt, fig, *a, **k))[1])

    base = {"status": "ok", "device": "cpu", "threads": 2, "model": "lstm", "batch": 64, "input_size": 512,
            "hidden_size": 512, "output_size": 512, "backend": "jax", "variant": None, "workload": "train_step"}
    df = pd.DataFrame([{**base, "dtype": "float32", "gflops": 60.0, "gemm_peak_gflops": 100.0,
                        "gemm_peak_library": "numpy", "master_peak_gflops": None},
                       {**base, "dtype": "bfloat16", "gflops": 30.0, "gemm_peak_gflops": 40.0,
                        "gemm_peak_library": "jax", "master_peak_gflops": 100.0}])
    plots.plot_roofline(df, tmp_path / "roofline.png")
    assert (tmp_path / "roofline.png").stat().st_size > 0
    assert any("bfloat16 GEMM peak 40 GFLOP/s (JAX" in t for t in drawn), drawn
    assert sum("float32 GEMM peak 100 GFLOP/s" in t for t in drawn) == 2, drawn  # its own panel's roof, and beside


# -- a cell's own check before it is timed ---------------------------------------------------------

def test_a_bfloat16_cell_verifies_and_a_wrong_one_does_not(write_config):
    from harness.worker import protocol
    from harness.config import load_config
    from harness.worker.worker import CellState, verify_step

    cell = next(c for c in load_config(write_config(MIXED)).cells() if c.problem.dtype == "bfloat16")
    p = cell.problem
    state = CellState(protocol.Init(cell.backend, p.to_mapping(), cell.task.to_mapping(), cell.seed,
                                    cell.train.lr))
    start = state.backend.get_params()
    result = state.verify()
    assert result["ok"] and "ref_bf16" in result["bound"], result
    for backend in (_wrong("scaled", factor=1.05), _wrong("nobias")):
        backend.prepare(p, {k: v.copy() for k, v in start.items()})
        assert not verify_step(p, backend, state.x, state.y, state.lr)["ok"], backend.variant


def test_harness_check_shows_the_mixed_precision_bound_and_the_worst_case():
    from typer.testing import CliRunner

    from harness.cli import app

    result = CliRunner().invoke(app, ["check", "--backends", "numpy", "--quick", "--match", "B=3"])
    assert result.exit_code == 0, result.output
    lines = " ".join(result.output.split())
    assert "bound numpy [bfloat16] |got - ref_bf16| <=" in lines and "worst case" in lines
    assert "bound numpy [float16] |got - ref_fp16| <=" in lines

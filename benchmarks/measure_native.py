"""Side-by-side sgd_step timings of the native backend against the reference, NumPy and PyTorch.

Every contender runs in ONE process per thread count, in alternating rounds
(``harness.worker.measure.time_interleaved``: the order reverses every round), so machine
noise hits them alike; what is worth quoting is the ratios. Each thread count gets a fresh child process whose environment merges
what every contender asks for (``Backend.environment_variables``) plus the allocator
settings of DESIGN.md, applied identically to all. GFLOP/s is
``Problem.flops("train_step") / median``, set against a float32 NumPy GEMM
(2048^3) timed in the same rounds at the same thread count.

    python benchmarks/measure_native.py                     # all shapes, threads 1 and 2
    python benchmarks/measure_native.py --shapes wildml-t4 --rounds 50
    python benchmarks/measure_native.py --shapes elman512 --contenders native --profile
    python benchmarks/measure_native.py --shapes db-lstm1024-b16 --contenders native --profile --ref-rounds 0 \
        --f32-kernel blas   # the recurrent products through the BLAS, for comparison with the own kernel
    python benchmarks/measure_native.py --shapes split-lstm512-b16,split-lstm512-b32 --threads 2 \
        --contenders native/batch,native/hidden --ref-rounds 0   # a recurrence shared by batch rows or hidden units

``--profile`` switches on the native engine's counters and prints, per native
contender, each phase's CPU milliseconds per step on every thread (robust to a
loaded machine) and the barrier waits, and the step's GFLOP/s per CPU-second against one
core's float32 FMA peak (the engine's own kernel, ``_native.fma_peak``).

``--bf16`` measures the engine's bfloat16 path against its float32 one instead, on a CPU
with a bfloat16 unit (AMX tiles, TDPBF16PS, where Linux grants them; else AVX512-BF16's
VDPBF16PS; elsewhere it stops, since the portable kernel only emulates the instruction;
``--bf16-kernel`` forces one): GFLOP/s of each product of the LSTM H=512, B=64, T=50 step
(input 512, softmax 512: ``lstm512-b64``), the engine's float32 GEMM (SciPy's OpenBLAS
sgemm; the per-step products on the engine's own kernel where it runs them there) against
its bfloat16 GEMM, column blocks split over the threads as the engine splits its panels,
the per-step products (recurrent, carry) T times over with W_hh packed once as in a pass;
then that model's sgd_step and forward, native float32 against native bfloat16, in
alternating rounds. Each GFLOP/s is also a share of that precision's peak at the thread
count (``_native.fma_peak``: float32's FMA; bfloat16's best unit, AMX's tile multiplier where
granted, with the VDPBF16PS peak on a line of its own beside it). The ratio column is
float32 time / bfloat16 time. With ``--profile`` it adds each train step's CPU milliseconds
per phase (the engine's counters, summed over the threads) in float32 and bfloat16: ratios
that a loaded machine leaves standing.

    python benchmarks/measure_native.py --bf16 --threads 1,16
    python benchmarks/measure_native.py --bf16 --threads 1 --shapes lstm512-b64-t24,gru512-b64-t24   # other steps
    python benchmarks/measure_native.py --bf16 --threads 1 --shapes gru512-b64-t24 --profile   # CPU ms by phase
    python benchmarks/measure_native.py --bf16 --portable --rounds 3   # any CPU: the emulation (no speed claim)
    python benchmarks/measure_native.py --bf16 --threads 1 --bf16-kernel avx512bf16   # VDPBF16PS on an AMX CPU
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import re
import subprocess
import sys

import numpy as np

SHAPES = {
    # the WildML tutorial: vocab 8000 token input, H 100, T 20, one sentence, no biases
    "wildml-t4": dict(model={"kind": "elman", "hidden": 100, "bias": False, "bptt": {"truncated": 4}},
                      input_size=8000, output_size=8000, tokens=True, seq_len=20, batch=1),
    "wildml-full": dict(model={"kind": "elman", "hidden": 100, "bias": False, "bptt": "full"},
                        input_size=8000, output_size=8000, tokens=True, seq_len=20, batch=1),
    # a dense throughput shape: H 512, input 512, softmax 512, B 32, T 50
    "dense512": dict(model={"kind": "elman", "hidden": 512}, input_size=512, output_size=512, tokens=False,
                     seq_len=50, batch=32),
    "lstm512": dict(model={"kind": "lstm", "hidden": 512}, input_size=512, output_size=512, tokens=False,
                    seq_len=50, batch=32),
    # configs/threads.yaml and threads_lstm.yaml: the thread-scaling shapes
    "elman100": dict(model={"kind": "elman", "hidden": 100}, input_size=128, output_size=128, tokens=False,
                     seq_len=50, batch=32),
    "elman512": dict(model={"kind": "elman", "hidden": 512}, input_size=128, output_size=128, tokens=False,
                     seq_len=50, batch=32),
    "lstm500": dict(model={"kind": "lstm", "hidden": 500}, input_size=700, output_size=128, tokens=False,
                    seq_len=80, batch=32),
    # the GRU in both forms and a bidirectional LSTM at the dense throughput shape
    "gru512": dict(model={"kind": "gru", "hidden": 512}, input_size=512, output_size=512, tokens=False,
                   seq_len=50, batch=32),
    "gru512-before": dict(model={"kind": "gru", "hidden": 512, "reset_after": False}, input_size=512,
                          output_size=512, tokens=False, seq_len=50, batch=32),
    "bilstm512": dict(model={"kind": "lstm", "hidden": 512, "bidirectional": True}, input_size=512,
                      output_size=512, tokens=False, seq_len=50, batch=32),
    # DeepBench's GRU training shape of configs/deepbench.yaml's default profile (H 1536, B 32, T 187),
    # and the same with 20 steps (a quicker look at the per-step costs)
    "gru1536": dict(model={"kind": "gru", "hidden": 1536}, input_size=1536, output_size=1536, tokens=False,
                    seq_len=187, batch=32),
    "gru1536-t20": dict(model={"kind": "gru", "hidden": 1536}, input_size=1536, output_size=1536, tokens=False,
                        seq_len=20, batch=32),
    # the bfloat16 measurement's model (--bf16), and DeepBench's mixed-precision shapes at T 24 (--bf16 --shapes)
    "lstm512-b64": dict(model={"kind": "lstm", "hidden": 512}, input_size=512, output_size=512, tokens=False,
                        seq_len=50, batch=64),
    "lstm512-b64-t24": dict(model={"kind": "lstm", "hidden": 512}, input_size=512, output_size=512, tokens=False,
                            seq_len=24, batch=64),
    "gru512-b64-t24": dict(model={"kind": "gru", "hidden": 512}, input_size=512, output_size=512, tokens=False,
                           seq_len=24, batch=64),
    # DeepBench-class training shapes (mse head, input size = hidden): configs/deepbench.yaml's defaults,
    # and held-out ones of T 10 whose per-step products are 16-32 rows against a 1024-2048-wide W_hh
    "db-elman1760-b16": dict(model={"kind": "elman", "activation": "relu", "hidden": 1760, "head": "mse"},
                             input_size=1760, output_size=1760, tokens=False, seq_len=25, batch=16),
    "db-elman1760-b64": dict(model={"kind": "elman", "activation": "relu", "hidden": 1760, "head": "mse"},
                             input_size=1760, output_size=1760, tokens=False, seq_len=25, batch=64),
    "db-lstm512-b16": dict(model={"kind": "lstm", "hidden": 512, "head": "mse"}, input_size=512, output_size=512,
                           tokens=False, seq_len=25, batch=16),
    "db-gru512-b32": dict(model={"kind": "gru", "hidden": 512, "head": "mse"}, input_size=512, output_size=512,
                          tokens=False, seq_len=25, batch=32),
    "db-elman2048-b16": dict(model={"kind": "elman", "activation": "relu", "hidden": 2048, "head": "mse"},
                             input_size=2048, output_size=2048, tokens=False, seq_len=10, batch=16),
    "db-gru1024-b32": dict(model={"kind": "gru", "hidden": 1024, "head": "mse"}, input_size=1024, output_size=1024,
                           tokens=False, seq_len=10, batch=32),
    "db-lstm1024-b16": dict(model={"kind": "lstm", "hidden": 1024, "head": "mse"}, input_size=1024,
                            output_size=1024, tokens=False, seq_len=10, batch=16),
    # configs/native_ab.yaml's LSTM at its largest batch (dense input 128, softmax 128, H 256, T 32)
    "ab-lstm256-b64": dict(model={"kind": "lstm", "hidden": 256}, input_size=128, output_size=128, tokens=False,
                           seq_len=32, batch=64),
}
# split-<kind><H>-b<B> (e.g. split-lstm512-b16): a dense mse-head step of that cell, hidden size and batch,
# input size H, T 25; with contenders native/batch and native/hidden it compares the two ways a recurrence is
# shared across threads (the engine's choice between them: kMinRows in backends/native/rnn.hpp)
SPLIT_SHAPE = re.compile(r"split-(elman|lstm|gru)(\d+)-b(\d+)")
BF16_SHAPE = "lstm512-b64"
# --bf16: the products of one lstm512-b64 step (M, N, K, op(A) transposed, op(B) transposed, per-step
# product): a per-step product of the recurrence is timed as the engine runs it, T = 50 times over with
# op(B) (W_hh, W_hh^T) packed once for them all; the others are one call each, packing both operands
BF16_STEPS = 50
BF16_GEMMS = {
    "recurrent h W_hh 64x2048x512 (per step)": (64, 2048, 512, False, False, True),
    "input X W_ih 3200x2048x512": (3200, 2048, 512, False, False, False),
    "output H W_hy 3200x512x512": (3200, 512, 512, False, False, False),
    "carry dA W_hh^T 64x512x2048 (per step)": (64, 512, 2048, False, True, True),
    "carry dA W_hh^T 64x512x2048 (one call)": (64, 512, 2048, False, True, False),
    "weight grad X^T dA 512x2048x3200": (512, 2048, 3200, True, False, False),
}
DEFAULT_SHAPES = "wildml-t4,wildml-full,dense512"
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "1000000000", "MALLOC_TRIM_THRESHOLD_": "1000000000"}
CONTENDERS = ("native", "native:sync", "numpy", "torch", "torch:fused")
GEMM_N = 2048
LR = 1e-3


def _shape(name: str) -> dict:
    """A named shape of SHAPES, or a split-<kind><H>-b<B> one."""
    if name in SHAPES:
        return SHAPES[name]
    m = SPLIT_SHAPE.fullmatch(name)
    if not m:
        raise SystemExit(f"unknown shape {name!r}: one of {', '.join(SHAPES)} or split-<kind><H>-b<B>")
    kind, hidden, batch = m.group(1), int(m.group(2)), int(m.group(3))
    return dict(model={"kind": kind, "hidden": hidden, "head": "mse"}, input_size=hidden, output_size=hidden,
                tokens=False, seq_len=25, batch=batch)


def _contender(name: str) -> tuple[str, str]:
    """A contender's backend name and, for native/batch and native/hidden, how the engine shares a recurrence."""
    base, _, recurrence = name.partition("/")
    if recurrence not in ("", "auto", "batch", "hidden"):
        raise SystemExit(f"{name}: the part after '/' is how native shares a recurrence: auto, batch or hidden")
    return base, recurrence


def _contender_env(names, threads: int) -> dict[str, str]:
    import backends

    env: dict[str, str] = {}
    for full in [_contender(n)[0] for n in names]:
        variant = backends.ref(full).variant
        try:
            cls = backends.ref(full).backend_class()
        except Exception:
            continue
        for key, value in cls.environment_variables(variant or cls.variants[0], threads, "cpu", "float32").items():
            if env.get(key, value) != value:
                raise SystemExit(f"contenders disagree on {key}: {env[key]} vs {value}")
            env[key] = value
    return env


def _numpy_blas_threads(n: int) -> str:
    """Pin NumPy's own OpenBLAS (the GEMM peak's BLAS) to n threads; returns what was done."""
    for line in open("/proc/self/maps"):
        path = line.split()[-1]
        if "openblas" in path and "numpy" in path:
            lib = ctypes.CDLL(path)
            for sym in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads"):
                if hasattr(lib, sym):
                    getattr(lib, sym)(n)
                    return f"{sym}({n})"
    return "not pinned (NumPy's BLAS not found)"


def _make(shape: dict, dtype="float32"):
    from harness.spec import reference as ref
    from harness.spec.model import ModelSpec, Problem

    spec = ModelSpec.from_mapping(shape["model"])
    problem = Problem(spec, shape["input_size"], shape["output_size"], shape["tokens"], dtype, shape["batch"],
                      shape["seq_len"], "cpu", "train_step")
    params = ref.init_params(spec, problem.input_size, problem.output_size, seed=0, dtype=dtype)
    rng = np.random.default_rng(1)
    T, B = problem.seq_len, problem.batch
    x = rng.integers(0, problem.input_size, size=(T, B)) if problem.tokens else \
        rng.normal(size=(T, B, problem.input_size)).astype(problem.master_dtype)
    y = rng.normal(size=(T, B, problem.output_size)).astype(problem.master_dtype) if spec.head == "mse" else \
        rng.integers(0, problem.output_size, size=(T, B))
    return problem, params, x, y


def _steppers(problem, params, x, y, threads: int, names, profile: bool = False, f32_kernel: str = "auto"):
    """name -> zero-argument callable doing one timed unit; notes on skipped contenders; the backends."""
    import backends
    from harness.spec import reference as ref

    steps, notes, made = {}, {}, {}
    state = {"p": {k: v.astype(np.float64) for k, v in params.items()}}

    def reference_step():
        _, state["p"] = ref.sgd_step(problem.model, state["p"], x, y, LR)

    steps["reference"] = reference_step
    for full in names:
        base, recurrence = _contender(full)
        try:
            b = backends.create(base)
        except Exception as exc:
            notes[full] = f"skipped: {exc}"
            continue
        ok, why = b.availability()
        if ok:
            ok, why = b.supports(problem)
        if not ok:
            notes[full] = f"skipped: {why}"
            continue
        if profile and hasattr(b, "profiling"):
            b.profiling = True
        if hasattr(b, "f32_kernel"):
            b.f32_kernel = f32_kernel
        if recurrence:  # and the whole team on every step: the two ways compared, not the team against one thread
            b.recurrence, b.adapt_threads = recurrence, False
        b.prepare(problem, {k: v.copy() for k, v in params.items()}, device="cpu", threads=threads)
        b.warm_up((x, y))
        made[full] = b

        def step(b=b):
            b.sgd_step(x, y, LR)
            b.sync()

        steps[full] = step
    a = np.random.default_rng(2).random((GEMM_N, GEMM_N), dtype=np.float32)
    out = np.empty_like(a)
    steps["gemm-peak"] = lambda: np.matmul(a, a, out=out)
    return steps, notes, made


def _profile_summary(prof: dict) -> dict:
    """Per phase and thread: CPU ms per step and barrier-wait ms per step; per thread totals."""
    n = max(1, prof["steps"])
    per = {name: {"cpu_ms": [v / n * 1e3 for v in d["cpu_seconds"]],
                  "wait_ms": [v / n * 1e3 for v in d["wait_seconds"]]}
           for name, d in prof["phases"].items() if max(d["seconds"]) > 0}
    return {"phases": per, "cpu_ms": [v / n * 1e3 for v in prof["cpu_seconds"]],
            "wall_ms": [v / n * 1e3 for v in prof["wall_seconds"]], "barriers": [b / n for b in prof["barriers"]],
            "team_sizes": {str(k): v for k, v in prof["team_sizes"].items()}}


def child(args) -> None:
    """Runs every contender on every shape at one thread count; prints one JSON line per shape."""
    from harness.worker import measure

    names = [n for n in args.contenders.split(",") if n]
    pinned = _numpy_blas_threads(args.threads)
    for shape_name in args.shapes.split(","):
        problem, params, x, y = _make(_shape(shape_name))
        steps, notes, made = _steppers(problem, params, x, y, args.threads, names, args.profile, args.f32_kernel)
        for f in steps.values():  # one untimed call each: first-touch and lazy set-up
            f()
        for b in made.values():
            if getattr(b, "profiling", False):
                b.profile(reset=True)
        samples = measure.time_interleaved({k: f for k, f in steps.items() if k != "reference"}, args.rounds)
        if args.ref_rounds > 0:  # 0: no reference (its float64 steps take seconds at DeepBench's shapes)
            samples["reference"] = measure.time_rounds(steps["reference"], n_rounds=args.ref_rounds)
        profiles = {k: _profile_summary(b.profile()) for k, b in made.items() if getattr(b, "profiling", False)}
        stats = {}
        for k, v in samples.items():
            v = np.asarray(v)
            flops = 2.0 * GEMM_N**3 if k == "gemm-peak" else problem.flops("train_step")
            med = float(np.median(v))
            stats[k] = {"median_ms": med * 1e3, "iqr_ms": float(np.subtract(*np.percentile(v, [75, 25]))) * 1e3,
                        "n": int(v.size), "gflops": flops / med / 1e9}
        print(json.dumps({"shape": shape_name, "threads": args.threads, "stats": stats, "notes": notes,
                          "numpy_blas": pinned, "loadavg": os.getloadavg(), "profiles": profiles,
                          "flops": problem.flops("train_step"), "fma_peak": _fma_peak() if profiles else None}),
              flush=True)


def _fma_peak() -> float | None:
    """GFLOP/s of one core's float32 FMA peak (the engine's kernel); None where the engine has none."""
    from backends.native_backend import _load

    mod = _load()
    return mod.fma_peak("float32", 1, 0.5)["gflops"] if hasattr(mod, "fma_peak") else None


def bf16_child(args) -> None:
    """--bf16: the engine's float32 against its bfloat16 GEMM on the products of the BF16_SHAPE step, then that
    step (sgd_step and forward) natively in float32 against bfloat16; one JSON line each."""
    from backends.native_backend import NativeBackend, _load
    from harness.worker import measure

    mod = _load()
    if args.portable:
        args.bf16_kernel = "portable"
    if not mod.bf16_cpu() and args.bf16_kernel != "portable":
        raise SystemExit("this CPU has no AVX512-BF16 (vdpbf16ps): the portable kernel emulates it and would not "
                         "measure bfloat16 (--portable runs it anyway, to check this script)")
    try:
        mod.set_bf16_kernel(args.bf16_kernel)
    except ValueError as exc:
        raise SystemExit(f"--bf16-kernel {args.bf16_kernel}: {exc}") from None
    mod.set_blas_threads(1)  # one single-threaded call per thread, as in the engine
    # the roofs: one core's (or the threads') float32 and bfloat16 peaks, the engine's own kernels (bfloat16:
    # the best unit, AMX where granted; the VDPBF16PS peak beside it where that is another unit)
    peaks = {p: mod.fma_peak(p, args.threads, 0.5)["gflops"] or None for p in ("float32", "bfloat16")}
    print(json.dumps({"kind": "peaks", "threads": args.threads, "gflops": peaks,
                      "kernel": mod.fma_peak("bfloat16", args.threads, 0.0)["kernel"]}), flush=True)
    if mod.fma_peak("bfloat16", 1, 0.0)["kernel"].startswith("amx"):
        vdp = mod.fma_peak("bfloat16", args.threads, 0.5, "avx512bf16")["gflops"] or None
        print(json.dumps({"kind": "peaks", "threads": args.threads, "kernel": "avx512bf16 vdpbf16ps",
                          "gflops": {"float32": None, "bfloat16": vdp}}), flush=True)
    rng = np.random.default_rng(0)
    for label, (M, N, K, ta, tb, per_step) in BF16_GEMMS.items():
        a = rng.normal(size=(K, M) if ta else (M, K)).astype(np.float32)
        b = rng.normal(size=(N, K) if tb else (K, N)).astype(np.float32)
        c = np.zeros((M, N), np.float32)
        reps = BF16_STEPS if per_step else 1
        calls = {p: (lambda p=p: mod.gemm(a, b, c, ta, tb, 1.0, 0.0, p, args.threads, per_step, reps))
                 for p in ("float32", "bfloat16")}
        for f in calls.values():
            f()
        samples = measure.time_interleaved(calls, args.rounds)
        med = {p: float(np.median(v)) / reps for p, v in samples.items()}
        print(json.dumps({"kind": "gemm", "what": label, "threads": args.threads, "kernel": mod.bf16_kernel(),
                          "ms": {p: m * 1e3 for p, m in med.items()},
                          "gflops": {p: 2.0 * M * N * K / m / 1e9 for p, m in med.items()}}), flush=True)
    shapes = args.shapes.split(",") if args.shapes != DEFAULT_SHAPES else [BF16_SHAPE]
    for shape, workload in [(s, w) for s in shapes for w in ("train_step", "forward")]:
        steps, made = {}, {}
        profile = args.profile and workload == "train_step"  # the engine's counters count SGD steps
        for dtype in ("float32", "bfloat16"):
            problem, params, x, y = _make(_shape(shape), dtype)
            problem = dataclasses.replace(problem, workload=workload)
            b = NativeBackend()
            b.bf16_kernel = args.bf16_kernel
            b.profiling = profile
            ok, why = b.supports(problem)
            if not ok:
                raise SystemExit(f"native {dtype}: {why}")
            b.prepare(problem, {k: v.copy() for k, v in params.items()}, threads=args.threads)
            b.warm_up((x, y))
            steps[dtype] = (lambda b=b, x=x, y=y: b.sgd_step(x, y, LR)) if workload == "train_step" else \
                (lambda b=b, x=x: b.forward(x))
            steps[dtype]()
            made[dtype] = b
        if profile:
            for b in made.values():
                b.profile(reset=True)
        samples = measure.time_interleaved(steps, args.rounds)
        med = {p: float(np.median(v)) for p, v in samples.items()}
        what = f"{shape} {workload}"
        print(json.dumps({"kind": "step", "what": what, "threads": args.threads,
                          "kernel": mod.bf16_kernel(), "ms": {p: m * 1e3 for p, m in med.items()},
                          "gflops": {p: problem.flops(workload) / m / 1e9 for p, m in med.items()}}), flush=True)
        if profile:  # CPU ms per step by phase, summed over the threads: time off the core is not counted
            prof = {p: _profile_summary(b.profile()) for p, b in made.items()}
            phases = {name: {p: sum(prof[p]["phases"].get(name, {"cpu_ms": [0.0]})["cpu_ms"]) for p in prof}
                      for name in dict.fromkeys(n for p in prof for n in prof[p]["phases"])}
            print(json.dumps({"kind": "phases", "what": what, "threads": args.threads, "phases": phases,
                              "cpu_ms": {p: sum(prof[p]["cpu_ms"]) for p in prof}}), flush=True)


def _bf16_table(results) -> str:
    """The --bf16 rows; GFLOP/s of each precision also as % of that precision's FMA peak at the thread count
    (the "peaks" line of the same child; "-" where the CPU has no kernel for it)."""
    lines = ["| what | threads | kernel | float32 ms | bfloat16 ms | float32 GFLOP/s (% FMA peak) | "
             "bfloat16 GFLOP/s (% FMA peak) | ratio |", "|---|---|---|---|---|---|---|---|"]
    peaks, phases = {}, []
    for r in results:
        if r["kind"] == "phases":
            phases.append(r)
            continue
        if r["kind"] == "peaks":
            peaks.setdefault(r["threads"], r["gflops"])  # the first line: each precision's best unit
            f32, bf16 = (f"{r['gflops'][p]:.1f}" if r["gflops"][p] else "-" for p in ("float32", "bfloat16"))
            lines.append(f"| FMA peak | {r['threads']} | {r.get('kernel', '')} | | | {f32} | {bf16} | |")
            continue
        ms, gf = r["ms"], r["gflops"]

        def rate(p, r=r, gf=gf):
            peak = peaks.get(r["threads"], {}).get(p)
            return f"{gf[p]:.1f} ({100 * gf[p] / peak:.0f}%)" if peak else f"{gf[p]:.1f}"

        lines.append(f"| {r['what']} | {r['threads']} | {r['kernel']} | {ms['float32']:.3f} | {ms['bfloat16']:.3f} | "
                     f"{rate('float32')} | {rate('bfloat16')} | {ms['float32'] / ms['bfloat16']:.2f}x |")
    if phases:  # --profile: the steps' engine counters, robust to a loaded machine
        lines += ["", "| step | threads | phase | float32 CPU ms | bfloat16 CPU ms | ratio |", "|---|---|---|---|---|---|"]
        for r in phases:
            rows = [(name, d["float32"], d["bfloat16"]) for name, d in r["phases"].items()]
            rows.append(("all (per step)", r["cpu_ms"]["float32"], r["cpu_ms"]["bfloat16"]))
            for name, f32, bf16 in rows:
                ratio = f"{f32 / bf16:.2f}x" if bf16 > 0 else "-"
                lines.append(f"| {r['what']} | {r['threads']} | {name} | {f32:.2f} | {bf16:.2f} | {ratio} |")
    return "\n".join(lines)


def _table(results) -> str:
    lines = ["| shape | threads | contender | median ms | IQR ms | GFLOP/s | % GEMM peak | reference / it | numpy / it |",
             "|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        st = res["stats"]
        peak = st["gemm-peak"]["gflops"]
        for k, s in st.items():
            if k == "gemm-peak":
                continue
            vs_ref = st["reference"]["median_ms"] / s["median_ms"] if "reference" in st else float("nan")
            vs_np = st["numpy"]["median_ms"] / s["median_ms"] if "numpy" in st else float("nan")
            lines.append(f"| {res['shape']} | {res['threads']} | {k} | {s['median_ms']:.3f} | {s['iqr_ms']:.3f} | "
                         f"{s['gflops']:.1f} | {100 * s['gflops'] / peak:.0f}% | {vs_ref:.1f}x | {vs_np:.2f}x |")
        lines.append(f"| {res['shape']} | {res['threads']} | numpy GEMM {GEMM_N}^3 (peak) | "
                     f"{st['gemm-peak']['median_ms']:.3f} | {st['gemm-peak']['iqr_ms']:.3f} | {peak:.1f} | 100% | | |")
    return "\n".join(lines)


def _profile_text(shape: str, threads: int, name: str, prof: dict, flops: float | None = None,
                  fma: float | None = None) -> str:
    """The profile of one native contender as comment lines: CPU ms per step per thread, by phase, and the
    step's rate per CPU-second of its threads against one core's FMA peak (robust to a loaded machine:
    time off the core is not counted)."""
    def nums(v):
        return " ".join(f"{x:7.2f}" for x in v)

    lines = [f"# {shape} threads={threads} {name}: per thread, ms per step: CPU {nums(prof['cpu_ms'])}, "
             f"wall {nums(prof['wall_ms'])}, barriers {nums(prof['barriers'])}; "
             f"steps by team size {prof['team_sizes']} (the engine times one thread against the team)"]
    cpu_s = sum(prof["cpu_ms"]) / 1e3
    if flops and cpu_s > 0:
        rate = flops / cpu_s / 1e9
        share = f", {100 * rate / fma:.0f}% of one core's float32 FMA peak ({fma:.1f})" if fma else ""
        lines.append(f"#   {rate:.1f} GFLOP/s per CPU-second{share}")
    for phase, d in prof["phases"].items():
        lines.append(f"#   {phase:20s} CPU {nums(d['cpu_ms'])}   barrier wait {nums(d['wait_ms'])}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"comma list of {', '.join(SHAPES)} (with --bf16: the "
                    f"steps timed, {BF16_SHAPE} by default)")
    ap.add_argument("--threads", default="1,2", help="comma list of thread counts")
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help="backends beside the reference")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--ref-rounds", type=int, default=5, help="rounds that include the (slow) reference (0: none)")
    ap.add_argument("--profile", action="store_true", help="print the native engine's per-phase CPU time per thread")
    ap.add_argument("--bf16", action="store_true",
                    help=f"the engine's bfloat16 GEMM and {BF16_SHAPE} step against its float32 ones (AVX512-BF16 CPUs)")
    ap.add_argument("--portable", action="store_true", help="with --bf16: the portable kernel (checks the script)")
    ap.add_argument("--bf16-kernel", default="auto", choices=("auto", "amx", "avx512bf16", "portable"),
                    help="with --bf16: the bfloat16 kernel (auto: AMX tiles where granted, else VDPBF16PS)")
    ap.add_argument("--f32-kernel", default="auto", choices=("auto", "avx512", "avx2", "blas"),
                    help="the native engine's float32 recurrent-product kernel (blas: every product through the BLAS)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.threads = int(args.threads)
        (bf16_child if args.bf16 else child)(args)
        return 0
    from harness.run.client import worker_cpus

    results = []
    for threads in [int(t) for t in args.threads.split(",")]:
        names = [n for n in args.contenders.split(",") if n]
        env = {**os.environ, **MALLOC_ENV, **_contender_env(names, threads)}
        cmd = [sys.executable, __file__, "--child", "--threads", str(threads), "--shapes", args.shapes,
               "--contenders", args.contenders, "--rounds", str(args.rounds), "--ref-rounds", str(args.ref_rounds)]
        cmd += (["--profile"] if args.profile else []) + ["--f32-kernel", args.f32_kernel]
        cmd += (["--bf16"] if args.bf16 else []) + (["--portable"] if args.portable else [])
        cmd += ["--bf16-kernel", args.bf16_kernel]
        if args.bf16:  # native alone
            env = {**os.environ, **MALLOC_ENV, **_contender_env(["native"], threads)}
        cpus = worker_cpus(threads)  # as the harness confines its workers: the first `threads` cores
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr)
            return proc.returncode
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                res = json.loads(line)
                results.append(res)
                if args.bf16:
                    continue
                for k, note in res["notes"].items():
                    print(f"# {res['shape']} threads={threads}: {k} {note}")
                print(f"# {res['shape']} threads={threads}: load average {res['loadavg']}, "
                      f"NumPy BLAS {res['numpy_blas']}", flush=True)
                for k, prof in res["profiles"].items():
                    print(_profile_text(res["shape"], threads, k, prof, res.get("flops"), res.get("fma_peak")),
                          flush=True)
    print(_bf16_table(results) if args.bf16 else _table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

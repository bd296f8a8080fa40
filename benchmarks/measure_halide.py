"""Interleaved timing of one SGD step: ``halide:naive``, ``halide`` (scheduled) and the ``numpy`` backend.

Within one process the contenders run in alternating rounds (A B C A B C ...), so
load from other processes hits them alike; each sample is the mean of a few
``sgd_step`` calls. The script prints each contender's median wall time, its median
CPU time (``time.process_time``: on a busy machine the wall clock also counts the
time other processes hold the core, and single-threaded contenders should be
compared on both) and the ratios of medians.

Two shapes: the Sobel task's (dense input 1, hidden 32, T 64, batch 16, mse with
tanh output) and a wider softmax one (dense input 128, hidden 256, 128 classes,
T 50, batch 32). ``halide`` and ``halide:naive`` compile with the JIT (their
``compile s`` is the JIT compile); ``halide@aot`` is the scheduled variant built
ahead of time into a fresh, temporary cache (``compile s`` is that build), and
``load s`` is the time a new process takes to load that module and warm up.
``HL_NUM_THREADS`` and the BLAS thread variables are set from ``--threads``.

    python benchmarks/measure_halide.py --rounds 15 --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time  # process_time: CPU seconds beside the wall clock
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.worker import measure  # noqa: E402

SHAPES = {
    "sobel": dict(model={"kind": "elman", "hidden": 32, "head": "mse", "output_act": "tanh"}, D=1, O=1, T=64, B=16),
    "wide-softmax": dict(model={"kind": "elman", "hidden": 256, "head": "softmax_xent"}, D=128, O=128, T=50, B=32),
}
CONTENDERS = ("halide:naive", "halide", "halide@aot", "numpy")
ENV_KEYS = ("HL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
LR = 0.005


def _problem(shape: dict, dtype: str):
    """``(problem, params, x, y)`` for one shape, from fixed seeds."""
    import numpy as np

    from harness.spec import reference as ref
    from harness.spec.model import ModelSpec, Problem

    model = ModelSpec.from_mapping(shape["model"])
    T, B, D, O = shape["T"], shape["B"], shape["D"], shape["O"]
    params = ref.init_params(model, D, O, seed=10, dtype=dtype)
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(T, B, D)).astype(dtype)
    y = rng.integers(0, O, size=(T, B)) if model.head == "softmax_xent" else (0.5 * rng.normal(size=(T, B, O))).astype(dtype)
    return Problem(model, D, O, False, dtype, B, T), params, x, y


def _backend(name: str):
    """``name`` as in CONTENDERS: ``@aot`` selects the ahead-of-time cache, plain halide names the JIT."""
    import backends

    backend = backends.create(name.partition("@")[0])
    if name.startswith("halide"):
        backend.aot = name.endswith("@aot")
    return backend


def _contenders(shape: dict, args):
    """``({name: step()}, {name: compile_s})`` for one shape, every backend prepared and warmed up."""
    problem, params, x, y = _problem(shape, args.dtype)
    steps, compile_s = {}, {}
    for name in args.contenders:
        backend = _backend(name)
        backend.prepare(problem, params, threads=args.threads)
        compile_s[name] = measure.time_once(lambda: backend.warm_up((x, y)))[0]
        steps[name] = lambda b=backend: b.sgd_step(x, y, LR)
    return steps, compile_s


def measure(shape: dict, args) -> tuple[dict, dict, dict]:
    """Interleaved samples (wall ms, CPU ms per sgd_step) for every contender at one shape."""
    steps, compile_s = _contenders(shape, args)
    wall = {name: [] for name in steps}
    cpu = {name: [] for name in steps}
    for step in steps.values():  # one untimed call each after the warm-up
        step()
    for _ in range(args.rounds):
        for name, step in steps.items():
            c = time.process_time()
            wall[name].append(measure.time_rounds(step, inner=args.steps)[0] * 1e3)
            cpu[name].append((time.process_time() - c) / args.steps * 1e3)
    return wall, cpu, compile_s


def _load_child(args) -> None:
    """In a fresh process: prepare and warm up from the ahead-of-time cache; print the time it took."""
    problem, params, x, y = _problem(SHAPES[args.load_only], args.dtype)
    backend = _backend("halide@aot")
    backend.prepare(problem, params, threads=args.threads)
    load_s, _ = measure.time_once(lambda: backend.warm_up((x, y)))
    print(json.dumps({"load_s": load_s, "how": backend._pipes.how}))


def _load_s(shape_name: str, args) -> tuple[float, str]:
    cmd = [sys.executable, __file__, "--load-only", shape_name, "--dtype", args.dtype, "--threads", str(args.threads)]
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    return out["load_s"], ",".join(sorted(set(out["how"].values())))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds per contender")
    ap.add_argument("--steps", type=int, default=3, help="sgd steps timed per round (their mean is one sample)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    ap.add_argument("--load-only", choices=list(SHAPES), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    n = str(args.threads)
    for key in ("HL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[key] = n  # read by each library when it loads, which happens below
    if args.load_only:
        _load_child(args)
        return

    with tempfile.TemporaryDirectory() as cache:
        os.environ["HARNESS_HOME"] = cache  # a fresh ahead-of-time cache, inherited by the load children
        results = {s: measure(SHAPES[s], args) for s in args.shapes}
        loads = {s: _load_s(s, args) for s in args.shapes} if "halide@aot" in args.contenders else {}
    env = ", ".join(f"{k}={os.environ[k]}" for k in ENV_KEYS if k in os.environ)
    print(f"{args.rounds} interleaved rounds x {args.steps} sgd_steps; {args.dtype}; threads {args.threads}; "
          f"load average {os.getloadavg()[0]:.2f}; {env}")
    base = "numpy" if "numpy" in args.contenders else args.contenders[-1]
    for shape_name, (wall, cpu, compile_s) in results.items():
        s = SHAPES[shape_name]
        print(f"\n{shape_name}: {s['model']} dense D={s['D']} O={s['O']} T={s['T']} B={s['B']}")
        print(f"  {'contender':<14}{'wall ms':>10}{'IQR':>8}{'cpu ms':>10}{'wall/' + base:>12}{'cpu/' + base:>11}{'compile s':>11}")
        med = {k: statistics.median(v) for k, v in wall.items()}
        cmed = {k: statistics.median(v) for k, v in cpu.items()}
        for name, v in wall.items():
            q = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3
            print(f"  {name:<14}{med[name]:10.3f}{q[2] - q[0]:8.3f}{cmed[name]:10.3f}{med[name] / med[base]:12.2f}"
                  f"{cmed[name] / cmed[base]:11.2f}{compile_s[name]:11.2f}")
        if "halide:naive" in med and "halide" in med:
            print(f"  naive / scheduled: {med['halide:naive'] / med['halide']:.1f}x wall, "
                  f"{cmed['halide:naive'] / cmed['halide']:.1f}x cpu")
        if shape_name in loads:
            load_s, how = loads[shape_name]
            print(f"  halide@aot in a new process: warm_up {load_s:.3f} s ({how})")


if __name__ == "__main__":
    main()

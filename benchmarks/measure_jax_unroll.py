"""Interleaved timing of the JAX backend's loop variants, and of single- versus multi-threaded XLA.

Within one process the contenders (``jax:unroll=1``, ``jax:unroll=4``, ``jax:unroll=T``,
``jax:python``, the NumPy reference and, when it passes a quick conformance check,
the ``numpy`` backend) run in alternating rounds, so load from other processes hits
them alike; each sample is the mean of a few ``sgd_step`` calls after one untimed call,
and the order rotates every round. XLA's threading is
fixed when JAX starts, so each setting gets its own worker processes, started
alternately (single, multi, single, multi, ...); the script compares every
contender's median between neighbouring processes.

    python benchmarks/measure_jax_unroll.py --reps 3 --rounds 15
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from backends.jax_backend import SINGLE_THREAD_XLA_FLAGS  # noqa: E402  (cheap: no jax import)
from harness.worker import measure  # noqa: E402

JAX_VARIANTS = ("jax:unroll=1", "jax:unroll=4", "jax:unroll=T", "jax:python")
SHAPES = {
    "wildml": dict(model={"kind": "elman", "hidden": 100, "bias": False}, tokens=True, D=8000, O=8000, T=20, B=1),
    "wildml-trunc4": dict(model={"kind": "elman", "hidden": 100, "bias": False, "bptt": {"truncated": 4}},
                          tokens=True, D=8000, O=8000, T=20, B=1),
    "dense512": dict(model={"kind": "elman", "hidden": 512, "head": "mse"}, tokens=False, D=512, O=512, T=50, B=32),
    "lstm256": dict(model={"kind": "lstm", "hidden": 256, "head": "mse"}, tokens=False, D=256, O=256, T=25, B=16),
}
THREAD_SETTINGS = {"single": SINGLE_THREAD_XLA_FLAGS, "multi": ""}
# NumPy's BLAS stays on one thread in every process: the same yardstick under both XLA settings.
YARDSTICK_THREADS = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
LR = 0.005


def _numpy_passes() -> tuple[bool, str]:
    """Whether the numpy backend exists here and passes the quick conformance matrix."""
    import backends
    from harness.verify.check import all_cases, run_case

    try:
        backend = backends.create("numpy")
    except Exception as exc:  # absent or broken: measured without it
        return False, f"{type(exc).__name__}: {exc}"
    bad = [r for r in (run_case(backend, c) for c in all_cases(quick=True)) if r.status in ("fail", "error")]
    return (not bad), (f"{len(bad)} conformance case(s) failed" if bad else "")


def _contenders(shape: dict, with_numpy: bool):
    """``{name: step()}`` for one shape, every backend prepared and compiled."""
    import backends
    from harness.spec import reference as ref
    from harness.spec.model import ModelSpec, Problem

    model = ModelSpec.from_mapping(shape["model"])
    T, B, D, O = shape["T"], shape["B"], shape["D"], shape["O"]
    problem = Problem(model, D, O, shape["tokens"], "float32", B, T)
    params = ref.init_params(model, D, O, seed=10, dtype="float32")
    rng = np.random.default_rng(0)
    x = rng.integers(0, D, size=(T, B)) if shape["tokens"] else rng.normal(size=(T, B, D)).astype("float32")
    y = rng.integers(0, O, size=(T, B)) if model.head == "softmax_xent" else (0.5 * rng.normal(size=(T, B, O))).astype("float32")
    steps, compile_s = {}, {}
    for name in JAX_VARIANTS + (("numpy",) if with_numpy else ()):
        backend = backends.create(name)
        backend.prepare(problem, params)
        compile_s[name] = measure.time_once(lambda: backend.warm_up((x, y)), backend.sync)[0]
        steps[name] = lambda b=backend: b.sgd_step(x, y, LR)
    state = {"p": ref.params_like(params, "float32")}

    def reference_step():
        loss, state["p"] = ref.sgd_step(model, state["p"], x, y, LR)
        return loss

    steps["reference"] = reference_step
    return steps, compile_s


def child(args) -> None:
    """Measure every contender at every shape in this process; print one JSON object."""
    out = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "shapes": {}}
    for shape_name in args.shapes:
        steps, compile_s = _contenders(SHAPES[shape_name], args.with_numpy)
        samples = {name: [] for name in steps}
        for step in steps.values():  # one untimed call each
            step()
        names = list(steps)
        for r in range(args.rounds):
            # Rotating the order, and one untimed step before each timed block, keep the
            # contender that follows a memory-hungry one from always starting on cold caches.
            for name in names[r % len(names):] + names[: r % len(names)]:
                step = steps[name]
                n = args.reference_steps if name == "reference" else args.steps
                if name != "reference":
                    step()
                samples[name].append(measure.time_rounds(step, inner=n)[0] * 1e3)
        out["shapes"][shape_name] = {"samples": samples, "compile_s": compile_s}
    out["load"] = os.getloadavg()[0]
    print(json.dumps(out))


def _run_child(setting: str, args, with_numpy: bool) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        # an empty compilation cache per process, so "compile s" is a real compile
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_ENABLE_X64="0", XLA_FLAGS=THREAD_SETTINGS[setting],
                   JAX_COMPILATION_CACHE_DIR=cache, **YARDSTICK_THREADS)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, __file__, "--child", "--rounds", str(args.rounds), "--steps", str(args.steps),
               "--reference-steps", str(args.reference_steps),
               "--shapes", *args.shapes] + (["--with-numpy"] if with_numpy else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="processes per thread setting (run alternately)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds per contender and process")
    ap.add_argument("--steps", type=int, default=3, help="sgd steps timed per round (their mean is one sample)")
    ap.add_argument("--reference-steps", type=int, default=1, help="reference steps per round (it is slow)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--with-numpy", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return

    with_numpy, why = _numpy_passes()
    runs = {s: [] for s in THREAD_SETTINGS}
    for _ in range(args.reps):
        for setting in THREAD_SETTINGS:
            runs[setting].append(_run_child(setting, args, with_numpy))

    print(f"{args.reps} process(es) per XLA setting, {args.rounds} interleaved rounds x {args.steps} sgd_steps each; "
          f"float32; load average now {os.getloadavg()[0]:.2f} (per process: "
          + ", ".join(f"{r['load']:.1f}" for s in THREAD_SETTINGS for r in runs[s]) + ")")
    print(f"numpy backend: {'included' if with_numpy else 'left out (' + why + ')'}")
    print(f"XLA settings: single = {THREAD_SETTINGS['single']!r}, multi = XLA's default thread pool; "
          f"NumPy: {YARDSTICK_THREADS}")
    print("single/multi: median over neighbouring process pairs of the ratio of medians; "
          "'/ref' divides each by the reference's median in its own process first")
    for shape_name in args.shapes:
        s = SHAPES[shape_name]
        print(f"\n{shape_name}: {s['model']} {'tokens' if s['tokens'] else 'dense'} D={s['D']} O={s['O']} T={s['T']} B={s['B']}")
        names = list(runs["single"][0]["shapes"][shape_name]["samples"])
        print(f"  {'contender':<14}" + "".join(f"{'med ms ' + st:>16}" for st in THREAD_SETTINGS)
              + f"{'/unroll=1':>11}{'/reference':>12}{'single/multi':>14}{'(/ref)':>8}{'compile s':>11}")
        for name in names:
            cols = []
            for st in THREAD_SETTINGS:
                cols.append(statistics.median(statistics.median(r["shapes"][shape_name]["samples"][name]) for r in runs[st]))
            # Ratios are taken inside each process (interleaved), then the median over processes.
            def ratio(other, st="single"):
                return statistics.median(
                    statistics.median(r["shapes"][shape_name]["samples"][name])
                    / statistics.median(r["shapes"][shape_name]["samples"][other]) for r in runs[st])
            def med(run, who):
                return statistics.median(run["shapes"][shape_name]["samples"][who])

            pairs = list(zip(runs["single"], runs["multi"]))
            pair = statistics.median(med(a, name) / med(b, name) for a, b in pairs)
            pair_ref = statistics.median((med(a, name) / med(a, "reference")) / (med(b, name) / med(b, "reference"))
                                         for a, b in pairs)
            comp = runs["single"][0]["shapes"][shape_name]["compile_s"].get(name)
            print(f"  {name:<14}" + "".join(f"{c:16.3f}" for c in cols) + f"{ratio('jax:unroll=1'):11.2f}"
                  f"{ratio('reference'):12.3f}{pair:14.2f}{pair_ref:8.2f}" + (f"{comp:11.2f}" if comp is not None else f"{'-':>11}"))


if __name__ == "__main__":
    main()

"""Interleaved timing of one SGD step at the WildML shape: numpy, numpy:wildml and the reference.

Runs the contenders in alternating rounds in one process (A B C A B C ...), so
load from other processes hits all of them alike, and prints each one's median
and the ratios of medians. Allocator settings such as
``MALLOC_MMAP_THRESHOLD_=1000000000 MALLOC_TRIM_THRESHOLD_=1000000000`` must be
set in the environment before Python starts; the script reports what it saw.

    python benchmarks/measure_wildml.py --rounds 30
"""

from __future__ import annotations

import argparse
import os
import statistics

import numpy as np

import backends
from harness.worker import measure
from harness.spec import reference as ref
from harness.spec.model import ModelSpec, Problem

ENV_KEYS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def _setup(args):
    model = ModelSpec.from_mapping({"kind": "elman", "hidden": args.hidden, "bias": False,
                                    "bptt": {"truncated": args.truncate}})
    problem = Problem(model, args.vocab, args.vocab, True, args.dtype, 1, args.seq_len)
    params = ref.init_params(model, args.vocab, args.vocab, seed=10, dtype=args.dtype)
    rng = np.random.default_rng(0)
    x = rng.integers(0, args.vocab, size=(args.seq_len, 1))
    y = rng.integers(0, args.vocab, size=(args.seq_len, 1))
    return model, problem, params, x, y


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30, help="interleaved rounds per contender")
    ap.add_argument("--steps", type=int, default=3, help="sgd steps timed per round (their mean is one sample)")
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--hidden", type=int, default=100)
    ap.add_argument("--seq-len", type=int, default=20)
    ap.add_argument("--truncate", type=int, default=4)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-reference", action="store_true", help="leave the reference out")
    args = ap.parse_args(argv)
    model, problem, params, x, y = _setup(args)
    lr = 0.005

    steps = {}
    for name in ("numpy", "numpy:wildml"):
        backend = backends.create(name)
        backend.prepare(problem, params)
        backend.warm_up((x, y))
        steps[name] = lambda b=backend: b.sgd_step(x, y, lr)
    if not args.no_reference:
        state = {"p": ref.params_like(params, args.dtype)}

        def reference_step():
            loss, state["p"] = ref.sgd_step(model, state["p"], x, y, lr)
            return loss

        steps["reference"] = reference_step

    samples = {name: [] for name in steps}
    for step in steps.values():  # one untimed round each
        step()
    for _ in range(args.rounds):
        for name, step in steps.items():
            samples[name].append(measure.time_rounds(step, inner=args.steps)[0] * 1e3)

    env = {k: os.environ[k] for k in ENV_KEYS if k in os.environ}
    print(f"shape: vocab {args.vocab}, hidden {args.hidden}, T {args.seq_len}, batch 1, {args.dtype}, "
          f"truncated {args.truncate}; {args.rounds} interleaved rounds x {args.steps} steps")
    print(f"environment: {env or 'defaults'}; load average {os.getloadavg()[0]:.2f}")
    med = {name: statistics.median(v) for name, v in samples.items()}
    for name, v in samples.items():
        q = statistics.quantiles(v, n=4)
        print(f"  {name:<13} median {med[name]:8.3f} ms/step   IQR {q[0]:.3f}-{q[2]:.3f}   min {min(v):.3f}")
    print(f"  numpy:wildml / numpy = {med['numpy:wildml'] / med['numpy']:.2f}x")
    if "reference" in med:
        print(f"  reference / numpy    = {med['reference'] / med['numpy']:.2f}x")


if __name__ == "__main__":
    main()

"""Which BLAS makes a backend's training step faster.

``python -m harness.worker.blas_probe --backend theano --ldflags "openblas=-L... -l..."`` compiles
the sgd_step at the WildML shape once per ``blas__ldflags`` value given, times the
variants in alternating steps and prints one JSON line with the medians. harness/run/envs.py
runs it with one value per process, alternating processes, at each thread count
(``OPENBLAS_NUM_THREADS`` of the process). Benchmarks proper go through the runner.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from harness.worker import lifeline

lifeline.die_with_parent()  # a probe outlives no harness that is building its environment

import numpy as np  # noqa: E402


def probe(full_name: str, ldflags: dict[str, str], n_steps: int = 40) -> dict:
    """Median sgd_step time (ms) per ``blas__ldflags`` value at vocab 8000, hidden 100, T 20, batch 1, float32."""
    import backends
    from harness.worker import measure
    from harness.spec import reference
    from harness.spec.model import ModelSpec, Problem

    model = ModelSpec(kind="elman", hidden=100, bias=False)
    problem = Problem(model, 8000, 8000, True, "float32", 1, 20)
    params = reference.init_params(model, 8000, 8000, seed=0, dtype="float32")
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 8000, size=(20, 1)), rng.integers(0, 8000, size=(20, 1))
    instances, compile_s = {}, {}
    for key, flags in ldflags.items():
        backend = backends.create(full_name)
        backend.prepare(problem, params)
        with backend.blas_ldflags(flags):
            compile_s[key] = measure.time_once(lambda: backend.warm_up((x, y)), backend.sync)[0]
        instances[key] = backend
    samples = measure.time_interleaved({k: (lambda b=b: b.sgd_step(x, y, 0.005)) for k, b in instances.items()},
                                       n_steps, syncs={k: b.sync for k, b in instances.items()})
    for backend in instances.values():
        backend.close()
    return {"backend": full_name, "threads": os.environ.get("OPENBLAS_NUM_THREADS", ""),
            "median_ms": {k: statistics.median(v) * 1e3 for k, v in samples.items()}, "compile_s": compile_s}


def main(argv=None) -> int:
    """Entry point: print the probe's result as one JSON line."""
    ap = argparse.ArgumentParser(prog="python -m harness.worker.blas_probe")
    ap.add_argument("--backend", required=True)
    ap.add_argument("--ldflags", action="append", required=True, help="NAME=FLAGS, repeated")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args(argv)
    ldflags = dict(item.split("=", 1) for item in args.ldflags)
    print(json.dumps(probe(args.backend, ldflags, args.steps)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How far correct float32 SGD steps land from the float64 reference, as a fraction of the bound.

For each backend and shape, what the check before timing compares: after the cell's warm-up
steps (``timing.warmup``), one more SGD step on the cell's own batch, per parameter update:

- ``spec``: |got - ref64| over SPEC's float32 bound alone (``1e-3 |ref| + 1e-5 max|ref|`` plus
  the ``4 eps |p|`` rounding of the update), the rule before :mod:`harness.spec.tolerance`;
- ``rule``: the same over :mod:`harness.spec.tolerance`'s bound (what the check uses now);
- ``ref32``: the reference's own float32 run over SPEC's bound, on the same inputs.

With ``--wrong``, the deliberately wrong backends of tests/wrong_backends.py (numpy with one
gradient 1.01x, a missing bias gradient, a truncation window one step short, and one of K = 4)
take the same step, and their ``rule`` fraction shows by how much the check catches them;
``exact(window)`` is the float64 step with the window one step short, over the same bounds:
below 1, no float32 computation could tell that window from the right one.

Shapes: ``bigbatch`` (Elman hidden 8, vocab 20, T 5, token input, batch 64/256/1000) and
``deepbench`` (the ReLU RNN of configs/deepbench.yaml, input = hidden = 1760, T 25, batch 16).
Run: ``python benchmarks/measure_verify_error.py [--shapes bigbatch deepbench] [--backends ...]``.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BIGBATCH = {
    "name": "bigbatch", "seed": 10, "dtype": "float32",
    "model": {"kind": "elman", "hidden": 8, "bias": False, "bptt": "full"},
    "task": {"kind": "lm_markov", "vocab": 20, "seq_len": 5, "n_sequences": 32, "n_eval": 8},
    "workloads": ["train_step"], "batch": [64, 256, 1000], "threads": [1], "backends": ["numpy"],
}


def cells(shape: str, names: list[str]):
    """The float32 train_step cells of a shape, grouped by batch."""
    import yaml

    from harness.config import load_config

    if shape == "bigbatch":
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "bigbatch.yaml"
            path.write_text(yaml.safe_dump(BIGBATCH))
            cfg = load_config(path, backends_override=names)
    else:
        cfg = load_config(ROOT / "configs" / "deepbench.yaml", backends_override=names)
    by_batch: dict[int, list] = {}
    for cell in cfg.cells():
        p = cell.problem
        if p.dtype != "float32" or p.workload != "train_step" or p.model.kind != "elman":
            continue
        if shape == "deepbench" and p.batch != 16:
            continue
        by_batch.setdefault(p.batch, []).append(cell)
    return by_batch


def fractions(got: dict, want: dict, low: dict, before: dict, problem, x) -> tuple[dict, dict, dict]:
    """Per tensor: got over SPEC's bound, got over the rule's bound, ref32 over SPEC's bound."""
    from harness.spec.tolerance import SPEC_TOLERANCES, Tolerance, compare, update_floor

    rtol, atol = SPEC_TOLERANCES["float32"]
    tol = Tolerance.of("float32")
    eps = tol.eps
    floors = update_floor(tol, problem, before, x)
    spec, rule, own = {}, {}, {}
    for k in want:
        old_floor = 4 * eps * np.abs(before[k])
        spec[k] = compare(k, got[k], want[k], rtol, atol, old_floor)[0]
        rule[k] = compare(k, got[k], want[k], rtol, atol, floors[k], low[k], tol.sensitivity)[0]
        own[k] = compare(k, low[k], want[k], rtol, atol, old_floor)[0]
    return spec, rule, own


def _backend(name: str):
    """A registered backend, or ``wrong:<variant>`` from tests/wrong_backends.py."""
    import backends

    if not name.startswith("wrong:"):
        return backends.create(name)
    sys.path.insert(0, str(ROOT / "tests"))
    from wrong_backends import WrongBackend

    return WrongBackend(name.split(":", 1)[1])


def measure(shape: str, names: list[str], wrong: bool = False) -> list[dict]:
    """One row per backend and batch of a shape."""
    from harness.worker import protocol
    from harness.spec import reference
    from harness.worker.worker import CellState

    rows = []
    for batch, group in cells(shape, names).items():
        for cell in group:
            p = cell.problem
            state = CellState(protocol.Init(cell.backend, p.to_mapping(), cell.task.to_mapping(), cell.seed,
                                            cell.threads, cell.train.lr))
            state.warmup(cell.timing.warmup)  # as the runner does before it verifies
            b = state.backend
            start = reference.params_like(b.get_params(), "float32")
            before = reference.params_like(start, np.float64)
            b.sgd_step(state.x, state.y, state.lr)
            b.sync()
            after = b.get_params()
            b.close()
            want = reference.sgd_step(p.model, before, state.x, state.y, state.lr)[1]
            low = reference.sgd_step(p.model, copy.deepcopy(start), state.x, state.y, state.lr)[1]
            change = lambda params: {k: np.asarray(v, np.float64) - before[k] for k, v in params.items()}  # noqa: E731
            results = [(cell.backend, after)]
            if wrong and cell is group[0]:  # the wrong backends step from this backend's parameters
                for variant, k in (("scaled", None), ("nobias", None), ("window", None), ("window", 4)):
                    w = _backend(f"wrong:{variant}")
                    w.window_k = k
                    w.prepare(p, {k: v.copy() for k, v in start.items()}, threads=cell.threads)
                    w.sgd_step(state.x, state.y, state.lr)
                    results.append((f"wrong:{variant}" + (f"={k}" if k else ""), w.get_params()))
                    if variant == "window" and k is None:  # how far the wrong window's exact step is from the right one
                        exact = reference.sgd_step(w._impl.problem.model, before, state.x, state.y, state.lr)[1]
                        results.append(("exact(window)", exact))
            for name, params in results:
                spec, rule, own = fractions(change(params), change(want), change(low), before, p, state.x)
                worst = max(spec, key=spec.get)
                rows.append({"shape": shape, "batch": batch, "backend": name, "worst": worst,
                             "spec": spec[worst], "rule": max(rule.values()), "ref32": own[worst],
                             "per_tensor": {k: (spec[k], rule[k], own[k]) for k in spec}})
                print(f"{shape:9s} B={batch:<5d} {name:12s} worst {worst:5s}  got/SPEC {spec[worst]:9.3g}  "
                      f"got/rule {max(rule.values()):6.3g}  ref32/SPEC {own[worst]:9.3g}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["bigbatch", "deepbench"], choices=["bigbatch", "deepbench"])
    ap.add_argument("--backends", nargs="+", default=["numpy", "torch", "torch:fused", "jax", "native"])
    ap.add_argument("--per-tensor", action="store_true", help="also print every tensor's three fractions")
    ap.add_argument("--wrong", action="store_true", help="also the deliberately wrong backends (tests/wrong_backends.py)")
    args = ap.parse_args(argv)
    for shape in args.shapes:
        for row in measure(shape, args.backends, args.wrong):
            if args.per_tensor:
                for k, (s, r, o) in row["per_tensor"].items():
                    print(f"    {k:6s} got/SPEC {s:9.3g}  got/rule {r:6.3g}  ref32/SPEC {o:9.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where correct and deliberately wrong mixed-precision backends land against the bound's allowance.

The mixed-precision bound (:mod:`harness.spec.tolerance`) allows ``SPREAD`` times ``max|ref_low - ref|``
per tensor: how far the spec's own roundings move that tensor from float64. This runs the conformance
check's bfloat16 and float16 cases (the whole matrix, or ``--quick``) with ``SPREAD = 1``, so each
case's worst ratio is in units of that spread (plus float32's small terms), for every backend named and
for the wrong backends of tests/wrong_backends.py (one gradient 5% off, a missing bias gradient, and
for float16 a loss scale other than the configured one divided out). A factor between the correct
backends' largest ratio and the wrong ones' smallest separates them; the report prints both.

Run: ``python benchmarks/measure_mixed_precision.py [--quick] [--backends numpy torch ...]``; torch runs mixed
precision on a GPU (``--device gpu``), or on the CPU with its product emulated (``--emulate``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="*", default=["numpy", "torch", "jax"])
    parser.add_argument("--quick", action="store_true", help="the quick matrix's mixed-precision cases only")
    parser.add_argument("--no-wrong", action="store_true", help="skip the wrong backends")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bound", action="store_true", help="ratios to the bound itself (SPREAD as set), not to the spread")
    parser.add_argument("--force", action="store_true", help="run backends on cases their supports() refuses")
    parser.add_argument("--emulate", action="store_true",
                        help="torch on the CPU with the spec's product emulated in float32 (backends.low_precision; "
                             "the maths checked, not a speed): on the CPU torch refuses mixed precision otherwise")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))

    import backends
    from harness.spec import tolerance
    from harness.spec.model import REDUCED_DTYPES
    from harness.verify import check

    if args.emulate:
        from backends import low_precision

        low_precision.EMULATE_ON_CPU = True
    if not args.bound:
        tolerance.SPREAD = 1.0  # ratios in units of the roundings' own spread
    cases = [c for c in check.all_cases(args.quick) if c.dtype in REDUCED_DTYPES]
    what = f"the bound ({tolerance.Tolerance.of('bfloat16').describe()})" if args.bound else \
        "(float32 terms + max|ref_low - ref|)"
    print(f"{len(cases)} mixed-precision cases; ratio = worst |got - ref_low| / {what}")
    for name in args.backends:
        backend = backends.create(name)
        if args.force:  # what the backend would give, were it not refused
            type(backend).supports = lambda self, problem: (True, "")
        by_dtype: dict[str, list] = {}
        for case in cases:
            res = check.run_case(backend, case, args.device)
            if res.status in ("pass", "fail"):
                by_dtype.setdefault(case.dtype, []).append((res.worst_ratio, case.label, res.worst))
            elif res.status == "error":
                print(f"  {name} {case.label} [{case.dtype}]: error {res.reason}")
        for dtype, found in by_dtype.items():
            worst = max(found)
            print(f"{name:14s} {dtype:9s} {len(found):3d} cases  largest {worst[0]:.3g} ({worst[1]}: {worst[2]})")
    if args.no_wrong:
        return 0
    from wrong_backends import WrongBackend

    def wrong(variant, **attrs):
        b = WrongBackend(variant)
        for k, v in attrs.items():
            setattr(b, k, v)
        return b

    for label, make in (("5% gradient (W_hh)", lambda: wrong("scaled", factor=1.05)),
                        ("5% gradient (W_hy)", lambda: wrong("scaled", factor=1.05, scaled_tensor="W_hy")),
                        ("missing bias", lambda: wrong("nobias")),
                        ("wrong loss scale", lambda: wrong("lossscale"))):
        found = []
        for case in cases:
            if label == "wrong loss scale":
                if case.dtype != "float16":
                    continue
                if not case.loss_scale:
                    case = check.with_loss_scale(case, check.FLOAT16_OTHER_SCALE)
            res = check.run_case(make(), case, args.device)
            if res.status in ("pass", "fail"):
                found.append((res.worst_ratio, case.label, case.dtype))
        if found:
            least = min(found)
            print(f"wrong: {label:20s} {len(found):3d} cases  smallest {least[0]:.3g} ({least[1]} [{least[2]}])")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Interleaved median ms per sgd_step: torch variants vs numpy (fast) vs the reference, one process."""
import argparse, os, statistics, sys
import numpy as np
import backends
from harness.worker import measure
from harness.spec import reference as ref
from harness.verify.check import run_case, all_cases
from harness.spec.model import ModelSpec, Problem

def shapes(which):
    out = []
    if "wildml" in which:
        for bptt in ("full", {"truncated": 4}):
            m = ModelSpec.from_mapping({"kind": "elman", "hidden": 100, "bias": False, "bptt": bptt})
            out.append((f"wildml V=8000 H=100 T=20 B=1 f32 {m.bptt}", Problem(m, 8000, 8000, True, "float32", 1, 20)))
    if "big" in which:
        for kind in ("elman", "lstm"):
            m = ModelSpec.from_mapping({"kind": kind, "hidden": 512, "head": "mse", "bias": True})
            out.append((f"{kind} D=512 H=512 O=512 T=50 B=32 f32 full", Problem(m, 512, 512, False, "float32", 32, 50)))
    return out

def data(p, step):
    rng = np.random.default_rng(step)
    T, B = p.seq_len, p.batch
    x = rng.integers(0, p.input_size, size=(T, B)) if p.tokens else rng.normal(size=(T, B, p.input_size)).astype(p.dtype)
    y = rng.integers(0, p.output_size, size=(T, B)) if p.model.head == "softmax_xent" else (0.5 * rng.normal(size=(T, B, p.output_size))).astype(p.dtype)
    return x, y

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="wildml,big")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--names", default="torch:autograd,torch:fused,torch:compile,numpy,reference")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    print("env:", {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}, "loadavg", os.getloadavg(), flush=True)
    names = a.names.split(",")
    if "numpy" in names:  # measure against the fast numpy backend only if it passes its own check
        bad = [r for r in (run_case(backends.create("numpy"), c) for c in all_cases(quick=True)) if r.status in ("fail", "error")]
        if bad:
            print("numpy backend fails its check; dropping it:", bad[0].case, bad[0].reason)
            names.remove("numpy")
    lr = 0.005
    for label, p in shapes(a.shapes):
        params = ref.init_params(p.model, p.input_size, p.output_size, seed=10, dtype=p.dtype)
        batches = [data(p, s) for s in range(4)]
        steps, compile_s = {}, {}
        for n in names:
            if n == "reference":
                st = {"p": ref.params_like(params, p.dtype)}
                def run(x, y, st=st, m=p.model):
                    loss, st["p"] = ref.sgd_step(m, st["p"], x, y, lr)
                    return loss
                steps[n] = run
                continue
            b = backends.create(n)
            ok, why = b.supports(p)
            if not ok:
                print(f"  {n}: {why}")
                continue
            b.prepare(p, params, threads=a.threads)
            compile_s[n] = measure.time_once(lambda: b.warm_up(batches[0]), b.sync)[0]
            steps[n] = lambda x, y, b=b: (b.sgd_step(x, y, lr), b.sync())
        for f in steps.values():  # one untimed step each
            f(*batches[0])
        times = {n: [] for n in steps}
        for r in range(a.rounds):
            for n, f in steps.items():
                x, y = batches[r % len(batches)]
                times[n].append(measure.time_once(lambda: f(x, y))[0] * 1e3)
        med = {n: statistics.median(v) for n, v in times.items()}
        base = med.get("numpy", med.get("reference"))
        print(f"{label}  (rounds={a.rounds}, threads={a.threads}, loadavg={os.getloadavg()[0]:.1f})")
        for n in steps:
            q = np.percentile(times[n], [25, 75])
            extra = f"  warm_up {compile_s[n]:.1f}s" if n in compile_s else ""
            print(f"  {n:15s} median {med[n]:9.2f} ms  IQR {q[0]:.2f}-{q[1]:.2f}  numpy/this {base/med[n]:6.2f}x{extra}", flush=True)

main()

"""Each kernel of the ``cuda`` backend timed alone, for tuning its block sizes and launch choices.

Per kernel and batch size, two figures through :mod:`harness.worker.measure` (the one clock, synced with
``torch.cuda.synchronize`` before every read):

    launch   ``inner`` eager launches per round: what a step pays with launch overhead
    graph    the same ``inner`` launches captured once as a CUDA graph, replayed per round: the
             kernel's own time, launch overhead gone (what ``cuda:graph`` pays)

The kernels: the recurrent and the hoisted input GEMMs (cuBLAS, for scale), the per-operation
kernels of ``cuda:naive``, the fused LSTM and Elman steps forward and backward, the SGD update,
and one LSTM layer over ``T`` steps as ``T`` x (GEMM + fused step) against the persistent kernel.
Rows carry the median, IQR and minimum seconds per call (harness.run.stats.Stats), GB/s of the bytes
each kernel must move, and GFLOP/s for the GEMMs. They are written as the harness writes its
tables (``harness.results.store.write_table`` / ``write_json``): ``kernels.parquet`` and ``kernels.json``
(the device, versions, arguments and load) in ``--out``.

    python benchmarks/measure_cuda.py                                  # H 512, B 1..256, T 100, float32
    python benchmarks/measure_cuda.py --batch 64 --rounds 30 --out results/kernels-h100
    TRITON_INTERPRET=1 python benchmarks/measure_cuda.py --smoke       # no GPU: the plumbing only

With ``--smoke`` (tiny shapes, CPU tensors, Triton's interpreter) the figures time the interpreter
and say so in the ``device`` column; they are never GPU figures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.worker import measure  # noqa: E402
from harness.run.stats import Stats  # noqa: E402


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--batch", default="1,8,64,256", help="comma-separated batch sizes")
    ap.add_argument("--seq-len", type=int, default=100)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--inner", type=int, default=20, help="launches per round (and per captured graph)")
    ap.add_argument("--out", default=None, help="folder for kernels.parquet / kernels.json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the interpreter (TRITON_INTERPRET=1)")
    return ap.parse_args(argv)


def _kernels(torch, K, B: int, H: int, T: int, dtype, device):
    """``name -> (launch once, bytes moved, flops)`` for one batch size."""
    E, L, M, P = K["elementwise"], K["lstm"], K["elman"], K["persistent"]
    g = torch.Generator(device="cpu").manual_seed(B)
    rnd = lambda *s: (0.1 * torch.randn(*s, generator=g, dtype=dtype)).to(device)  # noqa: E731
    size = torch.empty((), dtype=dtype).element_size()
    G = 4 * H
    h, c, c_prev = rnd(B, H), rnd(B, H), rnd(B, H)
    pre, rec, gates, da = rnd(B, G), rnd(B, G), rnd(B, G), rnd(B, G)
    w_t, w_in_t = rnd(G, H), rnd(G, H)
    x_all = rnd(T * B, H)
    pre_all = rnd(T, B, G)
    peep = (rnd(H), rnd(H), rnd(H))
    dh, dc = rnd(B, H), rnd(B, H)
    lr = torch.full((1,), 1e-9, dtype=dtype, device=device)
    clip = torch.full((1,), 1.0, dtype=dtype, device=device)
    w_copy, grad_w = w_t.clone(), rnd(G, H)
    hs, cs = torch.zeros(T + 1, B, H, dtype=dtype, device=device), torch.zeros(T + 1, B, H, dtype=dtype, device=device)
    gates_all = torch.empty(T, B, G, dtype=dtype, device=device)
    out_g, out_gb = torch.empty(B, G, dtype=dtype, device=device), torch.empty(T * B, G, dtype=dtype, device=device)
    out_h = torch.empty(B, H, dtype=dtype, device=device)

    def layer_by_steps():
        for t in range(T):
            r = torch.mm(hs[t], w_t.t()) if t > 0 else None
            L.forward_step(pre_all[t], r, cs[t], peep, hs[t + 1], cs[t + 1], gates_all[t])

    def layer_persistent():
        P.run_layer(pre_all, w_t, hs, cs, gates_all, peep, True)

    bh, bg = B * H * size, B * G * size
    return {
        "gemm recurrent (B,H)x(H,4H)": (lambda: torch.mm(h, w_t.t(), out=out_g), bh + G * H * size + bg, 2 * B * H * G),
        "gemm input hoisted (T*B,H)x(H,4H)": (lambda: torch.mm(x_all, w_in_t.t(), out=out_gb),
                                              T * bh + G * H * size + T * bg, 2 * T * B * H * G),
        "naive op: sigmoid (B,H)": (lambda: E.unary("sigmoid", h, out=out_h), 2 * bh, 0),
        "naive op: add one gate of (B,4H)": (lambda: E.binary("add", pre[:, :H], rec[:, :H], out=out_h), 3 * bh, 0),
        "lstm fused forward step": (lambda: L.forward_step(pre, rec, c_prev, peep, out_h, c, gates),
                                    2 * bg + bh + 2 * bh + bg, 0),
        "lstm fused backward step": (lambda: L.backward_step(dh, dh, dc, gates, c_prev, c, peep, da, out_h),
                                     3 * bh + bg + 2 * bh + bg + bh, 0),
        "elman fused forward step": (lambda: M.forward_step(h, dh, out_h, "tanh"), 3 * bh, 0),
        "elman fused backward step": (lambda: M.backward_step(dh, dc, h, out_h, "tanh"), 4 * bh, 0),
        "sgd update (4H,H) with clip": (lambda: E.sgd_(w_copy, grad_w, lr, clip), 3 * G * H * size, 0),
        "lstm layer: T x (gemm + fused step)": (layer_by_steps, T * (bh + G * H * size + 3 * bg + 3 * bh),
                                                2 * T * B * H * G),
        "lstm layer: persistent kernel": (layer_persistent, T * (bh + 3 * bg + 3 * bh) + G * H * size, 2 * T * B * H * G),
    }


def _time(torch, fn, rounds: int, inner: int, on_gpu: bool, mode: str) -> list[float]:
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    if mode == "launch":
        fn()  # compiles this specialisation
        return measure.time_rounds(fn, sync, rounds, inner)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    return [s / inner for s in measure.time_rounds(graph.replay, sync, rounds, 1)]


def check_args(args, stamp: str) -> Path:
    """Refuse, before any import or kernel, what the CLI would refuse: a size that is not a positive integer, an
    ``--out`` the write rule forbids (a file, a folder inside a run, one among the project's own files, a link
    or a device where kernels.parquet or kernels.json go). Returns the output folder."""
    from harness.spec import writes
    from harness.spec.errors import HarnessError

    for option, value in (("--hidden", args.hidden), ("--seq-len", args.seq_len), ("--rounds", args.rounds),
                          ("--inner", args.inner)):
        if value < 1:
            raise HarnessError(f"{option}: expected a positive integer, got {value}")
    try:
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        raise HarnessError(f"--batch: expected comma-separated positive integers, got {args.batch!r}")
    out = Path(args.out) if args.out else ROOT / "results" / f"measure-cuda-{stamp}"
    writes.check_folder(out, "--out")
    writes.check_outside_project(out, ROOT, "--out")
    for name in ("kernels.parquet", "kernels.json"):
        writes.check_file(out / name, "--out", probe=False)
    return out


def main(argv=None) -> int:
    from harness.spec.errors import HarnessError

    args = _args(argv)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    try:
        out = check_args(args, stamp)
    except HarnessError as exc:  # one line, as the harness's CLI says it
        print(f"error: {exc}", file=sys.stderr)
        return 2
    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if args.smoke and not interpreted:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported
        interpreted = True
    import importlib

    import torch

    on_gpu = torch.cuda.is_available() and not interpreted
    if not on_gpu and not interpreted:
        print("error: no CUDA device: run on a GPU machine, or with --smoke for the interpreter", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    K = {m: importlib.import_module(f"backends.cuda.{m}") for m in ("elementwise", "lstm", "elman", "persistent")}
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = getattr(torch, args.dtype)
    H, T = (8, 4) if args.smoke else (args.hidden, args.seq_len)
    batches = [2] if args.smoke else [int(b) for b in args.batch.split(",")]
    rounds, inner = (2, 2) if args.smoke else (args.rounds, args.inner)
    device_name = torch.cuda.get_device_name() if on_gpu else "cpu (Triton interpreter: not GPU figures)"
    modes = ("launch", "graph") if on_gpu else ("launch",)
    rows = []
    for B in batches:
        for name, (fn, nbytes, flops) in _kernels(torch, K, B, H, T, dtype, device).items():
            for mode in modes:
                row = {"kernel": name, "mode": mode, "batch": B, "hidden": H, "seq_len": T, "dtype": args.dtype,
                       "device": device_name}
                try:
                    st = Stats.of(_time(torch, fn, rounds, inner, on_gpu, mode))
                except Exception as exc:  # one kernel failing to capture is a result, not the end of the run
                    row.update(status="error", reason=f"{type(exc).__name__}: {exc}")
                    rows.append(row)
                    print(f"B={B:4d} {name:40s} {mode:6s} error: {row['reason']}", flush=True)
                    continue
                row.update(status="ok", **st.as_dict(), gbs=nbytes / st.median_s / 1e9,
                           gflops=flops / st.median_s / 1e9 if flops else None)
                rows.append(row)
                extra = f"  {row['gflops']:8.1f} GFLOP/s" if flops else ""
                print(f"B={B:4d} {name:40s} {mode:6s} {st.median_s * 1e6:10.2f} us  IQR {st.iqr_s * 1e6:8.2f}"
                      f"  {row['gbs']:7.1f} GB/s{extra}", flush=True)
    from harness.results.store import write_json, write_table

    write_table(out / "kernels.parquet", rows)
    import triton

    write_json(out / "kernels.json", {"device": device_name, "interpreter": interpreted, "torch": torch.__version__,
                                      "triton": triton.__version__, "args": vars(args), "loadavg": os.getloadavg(),
                                      "tf32": "off", "created_utc": stamp})
    print(f"wrote {out}/kernels.parquet and kernels.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())

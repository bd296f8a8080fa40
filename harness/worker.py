"""One benchmark cell in its own process: ``python -m harness.worker``.

Talks to the runner with one JSON object per line: requests on stdin, replies on
the process's original stdout. Anything a library prints goes to stderr, which the
runner keeps the tail of. Imports nothing but numpy, this package's numpy-only
modules and the backend, so it runs in isolated environments on numpy 1.23 too.

Requests (``cmd``): ``init``, ``warmup``, ``calibrate``, ``rounds``, ``train``,
``gemm_peak``, ``quit``. Every reply carries ``peak_rss_mb``; a failure replies
``{"error": ..., "traceback": ...}`` and the worker stays alive.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
import traceback

# A cell with `threads: N` runs on N cores: the runner names them, and they are set before
# any library starts a thread pool (XLA's, for one, sizes its pool from the cores it may
# use and ignores the thread variables).
if os.environ.get("HARNESS_CPUS"):
    os.sched_setaffinity(0, {int(c) for c in os.environ["HARNESS_CPUS"].split(",")})

import numpy as np  # noqa: E402


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


class DivergedError(Exception):
    """The loss became NaN or infinite."""


class Cell:
    """The state of one cell: its backend, data and parameters."""

    def __init__(self, req: dict):
        import backends
        from harness import reference
        from harness.data import make_dataset
        from harness.spec import Problem, TaskSpec

        self.problem = Problem.from_mapping(req["problem"])
        self.task = TaskSpec.from_mapping(req["task"])
        self.lr = float(req.get("lr", 0.005))
        self.threads = int(req.get("threads", 1))
        self.backend = backends.create(req["backend"])
        ok, why = self.backend.availability()
        if not ok:
            raise RuntimeError(why)
        self.data = make_dataset(self.task, self.problem.model, int(req["seed"]), self.problem.dtype)
        p = self.problem
        params = reference.init_params(p.model, p.input_size, p.output_size, int(req["seed"]), p.dtype)
        self.x, self.y = self.data.batch(np.arange(p.batch) % self.data.n_sequences)
        self.backend.prepare(p, params, device=p.device, threads=self.threads)
        self.last_loss = None

    def call(self) -> None:
        """One unit of the workload: an SGD step, or a forward pass."""
        if self.problem.workload == "forward":
            self.backend.forward(self.x)
        else:
            self.last_loss = self.backend.sgd_step(self.x, self.y, self.lr)

    def check_finite(self) -> None:
        if self.problem.workload != "forward" and self.last_loss is not None:
            loss = float(self.last_loss)
            if not math.isfinite(loss):
                raise DivergedError(f"loss became {loss}")

    def warmup(self, n: int) -> dict:
        t0 = time.perf_counter_ns()
        self.backend.warm_up((self.x, self.y))
        self.backend.sync()
        compile_s = (time.perf_counter_ns() - t0) / 1e9
        t0 = time.perf_counter_ns()
        for _ in range(n):
            self.call()
        self.backend.sync()
        self.check_finite()
        return {"compile_s": compile_s, "warm_s": (time.perf_counter_ns() - t0) / 1e9}

    def verify(self) -> dict:
        """This cell's own next step (or forward pass) against the reference, on its own data.

        For a step, the parameter *change* is compared with the reference's change from the
        same starting parameters, so a wrong gradient cannot hide behind a small learning rate.
        """
        from harness import reference
        from harness.check import TOLERANCES, compare

        p, b = self.problem, self.backend
        rtol, atol = TOLERANCES[p.dtype]
        custom = b.tolerance(p)
        if custom is not None:
            rtol, atol = custom[0], custom[1]
        before = reference.params_like(b.get_params(), np.float64)
        ratios = {}
        if p.workload == "forward":
            got = b.forward(self.x)
            b.sync()
            r, name = compare("outputs", got, reference.outputs(p.model, before, self.x), rtol, atol)
            ratios[name] = r
        else:
            loss = b.sgd_step(self.x, self.y, self.lr)
            b.sync()
            after = b.get_params()
            want_loss, want = reference.sgd_step(p.model, before, self.x, self.y, self.lr)
            ratios["loss"] = compare("loss", loss, want_loss, rtol, atol)[0]
            eps = float(np.finfo(p.dtype).eps)
            for k, v in want.items():  # the subtraction itself loses ~eps * |p| in the run's dtype
                r, name = compare(f"update of {k}", np.asarray(after[k], np.float64) - before[k], v - before[k],
                                  rtol, atol, floor=4 * eps * np.abs(before[k]))
                ratios[name] = r
        worst = max(ratios, key=ratios.get)
        return {"ok": bool(ratios[worst] <= 1.0), "worst": worst, "ratio": float(ratios[worst]),
                "bound": f"{rtol:g}*|ref| + {atol:g}*max|ref|"}

    def rounds(self, n: int, inner: int) -> list[float]:
        """``n`` rounds of ``inner`` calls each, ``sync()`` before every clock read; seconds per call."""
        out = []
        for _ in range(n):
            self.backend.sync()
            t0 = time.perf_counter_ns()
            for _ in range(inner):
                self.call()
            self.backend.sync()
            out.append((time.perf_counter_ns() - t0) / 1e9 / inner)
            self.check_finite()
        return out

    def evaluate(self) -> float:
        """Loss on the fixed evaluation set, in minibatches of the training batch size."""
        from harness.data import eval_loss

        B, n_eval = self.problem.batch, self.data.x_eval.shape[1]
        total, count = 0.0, 0
        for j in range(0, n_eval - B + 1, B):
            x = np.ascontiguousarray(self.data.x_eval[:, j : j + B])
            y = np.ascontiguousarray(self.data.y_eval[:, j : j + B])
            out = np.asarray(self.backend.forward(x))
            total += eval_loss(self.problem.model, out, y) * B
            count += B
        return total / count

    def train(self, cfg: dict) -> dict:
        """SGD epochs from the shared initial parameters; the clock counts training steps only."""
        B = self.problem.batch
        N = self.data.n_sequences
        rng = np.random.default_rng(int(cfg.get("seed", 0)))
        lr = float(cfg["lr"])
        eval_every = int(cfg["eval_every"])
        target = cfg.get("target_loss")
        patience = int(cfg.get("patience", 1))
        budget = cfg.get("time_budget_s")
        halve = bool(cfg.get("halve_lr_on_rise", False))
        curve, steps = [], []
        clock = eval_clock = 0.0
        examples, next_eval, streak, time_to_target = 0, eval_every, 0, None
        running: list[float] = []
        status, stop = "ok", None

        def do_eval(epoch):
            nonlocal eval_clock, streak, time_to_target, lr, stop
            t0 = time.perf_counter_ns()
            loss = self.evaluate()
            eval_clock += (time.perf_counter_ns() - t0) / 1e9
            if running:
                curve.append({"epoch": epoch, "examples": examples, "wall_s": clock,
                              "loss": float(np.mean(running)), "split": "train", "lr": lr})
                running.clear()
            previous = next((c["loss"] for c in reversed(curve) if c["split"] == "eval"), None)
            curve.append({"epoch": epoch, "examples": examples, "wall_s": clock, "loss": loss, "split": "eval", "lr": lr})
            if not math.isfinite(loss):
                raise DivergedError(f"evaluation loss became {loss}")
            if halve and previous is not None and loss > previous:
                lr *= 0.5
            if target is not None:
                streak = streak + 1 if loss <= target else 0
                if streak >= patience and time_to_target is None:
                    time_to_target = clock
                    stop = "target"

        try:
            do_eval(0)
            for epoch in range(int(cfg["epochs"])):
                order = rng.permutation(N)
                for i in range(0, N - B + 1, B):
                    x, y = self.data.batch(order[i : i + B])
                    self.backend.sync()
                    t0 = time.perf_counter_ns()
                    loss = self.backend.sgd_step(x, y, lr)
                    self.backend.sync()
                    dt = (time.perf_counter_ns() - t0) / 1e9
                    clock += dt
                    steps.append(dt)
                    loss = float(loss)
                    if not math.isfinite(loss):
                        raise DivergedError(f"training loss became {loss}")
                    running.append(loss)
                    examples += B
                    if examples >= next_eval:
                        next_eval += eval_every
                        do_eval(epoch)
                    if stop is None and budget is not None and clock >= budget:
                        stop = "time_budget"
                    if stop:
                        break
                if stop:
                    break
            else:
                stop = "epochs"
            if curve[-1]["examples"] != examples:
                do_eval(int(cfg["epochs"]) - 1 if stop == "epochs" else epoch)
        except DivergedError as exc:
            status, stop = "diverged", str(exc)
        return {"curve": curve, "step_samples": steps, "train_s": clock, "eval_s": eval_clock,
                "time_to_target_s": time_to_target, "stop": stop, "status": status,
                "examples": examples, "final_lr": lr}


def gemm_peak(dtype: str, n: int = 1024, seconds: float = 0.5) -> float:
    """Best GFLOP/s of an n x n x n NumPy GEMM in this process (thread settings inherited)."""
    rng = np.random.default_rng(0)
    a = rng.random((n, n)).astype(dtype)
    b = rng.random((n, n)).astype(dtype)
    c = np.empty((n, n), dtype)
    np.matmul(a, b, out=c)
    best = float("inf")
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or best == float("inf"):
        t0 = time.perf_counter_ns()
        np.matmul(a, b, out=c)
        best = min(best, (time.perf_counter_ns() - t0) / 1e9)
    return 2.0 * n ** 3 / best / 1e9


def serve(inp, out) -> None:
    """Answer requests until ``quit`` or end of input."""
    cell: Cell | None = None
    for line in inp:
        if not line.strip():
            continue
        req = json.loads(line)
        cmd = req.get("cmd")
        try:
            if cmd == "quit":
                reply = {"ok": True}
            elif cmd == "init":
                cell = Cell(req)
                reply = {"ok": True, "versions": cell.backend.versions(), "python": sys.version.split()[0],
                         "data_meta": cell.data.meta}
            elif cmd == "warmup":
                reply = cell.warmup(int(req.get("n", 1)))
            elif cmd == "verify":
                reply = cell.verify()
            elif cmd == "calibrate":
                one = cell.rounds(1, 1)[0]
                target = float(req["target_s"])
                reply = {"inner": max(1, min(10_000, int(round(target / max(one, 1e-9))))), "one_s": one}
            elif cmd == "rounds":
                samples = cell.rounds(int(req["n"]), int(req["inner"]))
                reply = {"samples": samples, "loss": None if cell.last_loss is None else float(cell.last_loss)}
            elif cmd == "train":
                reply = cell.train(req["train"])
            elif cmd == "gemm_peak":
                reply = {"gflops": gemm_peak(req.get("dtype", "float32"), int(req.get("n", 1024)))}
            else:
                reply = {"error": f"unknown command {cmd!r}"}
        except DivergedError as exc:
            reply = {"diverged": str(exc)}
        except Exception as exc:  # reported to the runner, which records the cell as an error
            reply = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
        reply["peak_rss_mb"] = peak_rss_mb()
        out.write(json.dumps(reply) + "\n")
        out.flush()
        if cmd == "quit":
            break


def main() -> None:
    # Keep the protocol channel clean: the original stdout carries replies only, and
    # file descriptor 1 (where libraries print) is pointed at stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    serve(sys.stdin, proto)


if __name__ == "__main__":
    main()

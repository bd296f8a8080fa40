"""Hand-written GPU RNN: cuBLAS GEMMs through torch, Triton kernels for everything element-wise.

The static optimisations of NVIDIA's cuDNN 5 LSTM write-up (its public sample's ``PERFOPTS``), each
variant switching one more on, so the harness can measure what each buys::

    naive       per-gate GEMMs (8 per LSTM step, 6 per GRU step), weights in the spec's layout, one
                Triton kernel per element-wise operation; backward likewise, weight gradients per
                gate and per step
    grouped     + the gates' GEMMs combined (4H wide, GRU 3H), the input GEMM hoisted out of the recurrence
                (one GEMM over all steps of a layer), weights pre-transposed once (stored (4H, H), the
                layout nn.Linear hands cuBLAS); backward: combined weight-gradient GEMMs over all steps
    fused       + all element-wise maths of a step in one kernel (backward: one kernel per step too)
    streams     + layers as a wavefront on CUDA streams (layer l step t overlaps layer l+1 step t-1);
                upper layers' input GEMMs then run per step, inside the wavefront
    graph       + the whole forward pass, or the whole training step, captured as one CUDA graph and
                replayed (launch overhead gone); the default: the fastest full variant expected
    persistent  fused, with each layer's forward recurrence as one persistent kernel keeping its W_hh
                columns on chip for all steps (Diamos et al. 2016); training runs that forward (it
                stores the gates) and the fused backward; the reset-before GRU's kernel passes a
                second grid barrier inside each step (every unit's r before any unit's n)

Every variant implements the whole spec (Elman with each activation, LSTM with peepholes, GRU with
the reset applied after or before the recurrent product, bidirectional layers of each, every head,
bptt full / truncated:K / tail:K, SGD with clipping). The GRU groups its GEMMs as the LSTM does (one
input GEMM over all steps for the three gates, one recurrent GEMM per step); reset before (Cho et
al.) needs ``(r * h_prev) W_hn`` after ``r`` is known, so its step is two kernels around that GEMM
(backward likewise, around ``da_n W_hn^T``). A bidirectional layer runs its reverse direction over
the time-reversed input with the same machinery; the two directions and the layers then run one
after another (no wavefront exists: a reverse direction reads the layer below's last step first).
Truncated K runs its per-output windows side by side: at backward depth j every output's window is
at step t-j, so the K+1 depths are K+1 batched steps over (T-j)*B rows, with the same kernels and
GEMMs. Token input is a row gather of the layer-0 input weights, their gradient an index_add.

Mixed precision (``bfloat16``, ``float16``), as the spec has it, on every variant: parameters, gradients,
the update, the recurrent state and every Triton element-wise kernel stay float32; every product (the
hoisted input GEMM, the recurrent GEMMs, the head, and the backward pass's products of the gradients)
is cuBLAS's ``torch.mm(a_low, b_low, out_dtype=float32)`` (``backends.low_precision``: operands rounded,
float32 sums and result; the weights rounded once per pass, not per step), which ``prepare`` probes once
on the device and ``supports`` refuses with the reason where this torch lacks it. The persistent
kernel rounds ``h`` and its resident ``W_hh`` to the low type itself before its float32 multiply-add.
float16 multiplies ``dL/dz`` by the static loss scale and divides the gradients by it with
``torch._amp_foreach_non_finite_check_and_unscale_``, whose flag makes the step's loss NaN on the
device (no host sync, so the graph variant captures it). Under the interpreter the product is its
float32 emulation, numerically the same.

Without a GPU, ``TRITON_INTERPRET=1`` runs the same kernels on CPU tensors through Triton's
interpreter, on device ``cpu``, for conformance checks only (``harness check``). There the streams
variant issues the same wavefront in the same order on no streams, and the graph variant runs the
same static-buffer step eagerly instead of replaying it: the maths checked is the maths replayed.
Timed cells never run the interpreter: their workers get ``TRITON_INTERPRET=0``, and device ``cpu``
is then unavailable.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

import numpy as np

from backends.base import Backend, unsupported
from harness.spec.errors import HarnessError
from harness.spec.model import Problem, layer_suffix

_NOT_INSTALLED = "unavailable: the cuda backend needs torch and triton (pip install 'rnn-harness[cuda]')"
_NO_GPU = ("unavailable: no NVIDIA GPU here (the cuda backend's kernels need one; TRITON_INTERPRET=1 runs them "
           "on the CPU through Triton's interpreter, for `harness check --device cpu` only)")
_CPU_NEEDS_INTERPRETER = ("unavailable: cuda on device cpu is Triton's interpreter, for conformance checks only: "
                          "set TRITON_INTERPRET=1 for `harness check`; timed cells never run it")
_GPU_NOT_INTERPRETED = "unavailable: TRITON_INTERPRET=1 is set, so the kernels run on the CPU interpreter (device cpu)"
#: the persistent kernel keeps a program's W_hh columns in registers: (H, 4 * ceil(H / SMs)) values
PERSISTENT_MAX_HIDDEN = 1024


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def _gpu_present() -> bool:
    """An NVIDIA device node or driver entry, without importing torch (cheap, for ``harness list``)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    try:
        if os.listdir("/proc/driver/nvidia/gpus"):
            return True
    except OSError:
        pass
    return os.path.exists("/dev/nvidia0")


class CudaBackend(Backend):
    """The hand-optimised GPU RNN (see the module docstring)."""
    knows = frozenset({"gru", "bidirectional", "reduced"})  # these spec additions are in its supports()

    name = "cuda"
    variants = ("graph", "naive", "grouped", "fused", "streams", "persistent")
    devices = ("gpu", "cpu")
    #: every kernel specialisation compiles on a GPU, and under the interpreter each case takes seconds
    compile_heavy = True

    def __init__(self, variant: str | None = None):
        super().__init__(variant)
        self._net: _Net | None = None

    # -- cheap questions -------------------------------------------------------------
    def availability(self) -> tuple[bool, str]:
        """torch and triton installed, and a GPU (or Triton's interpreter switched on)."""
        if importlib.util.find_spec("torch") is None or importlib.util.find_spec("triton") is None:
            return False, _NOT_INSTALLED
        if not (_interpreting() or _gpu_present()):
            return False, _NO_GPU
        return True, ""

    def device_availability(self, device: str) -> tuple[bool, str]:
        """gpu: torch sees a CUDA device and the interpreter is off; cpu: only under the interpreter."""
        ok, why = super().device_availability(device)
        if not ok:
            return ok, why
        if device == "cpu":
            return (True, "") if _interpreting() else (False, _CPU_NEEDS_INTERPRETER)
        if _interpreting():
            return False, _GPU_NOT_INTERPRETED
        import torch

        if not torch.cuda.is_available():
            return False, "unavailable: no CUDA device (torch.cuda.is_available() is False)"
        return True, ""

    def supports(self, problem: Problem) -> tuple[bool, str]:
        ok, why = self.supports_device(problem.device)
        if not ok:
            return ok, why
        if problem.reduced and problem.device == "gpu":  # on the CPU (the interpreter) the product is emulated
            from backends import low_precision

            if importlib.util.find_spec("torch") is None:
                return False, _NOT_INSTALLED
            import torch

            missing = low_precision.gpu_product_missing(torch)
            if missing:
                return unsupported(f"{self.full_name}: {missing}")
        if self.variant == "persistent" and problem.model.hidden > PERSISTENT_MAX_HIDDEN:
            return unsupported(f"cuda:persistent keeps each program's W_hh columns in registers across steps; "
                               f"hidden {problem.model.hidden} > {PERSISTENT_MAX_HIDDEN} would spill them")
        return True, ""

    @classmethod
    def environment_variables(cls, variant: str, threads: int, device: str, dtype: str) -> dict[str, str]:
        """Timed workers compile the kernels (never the interpreter), with Triton's current default of
        fused multiply-adds said explicitly (its default changes in 3.10); OpenMP threads for torch."""
        return {"TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1", "OMP_NUM_THREADS": str(threads)}

    def versions(self) -> dict[str, str]:
        out = super().versions()
        if not self.availability()[0]:
            return out
        import torch
        import triton

        out["torch"] = torch.__version__
        out["triton"] = triton.__version__
        out["triton_mode"] = "interpreter (TRITON_INTERPRET=1, CPU)" if _interpreting() else "compiled"
        out["torch_cuda"] = str(torch.version.cuda)
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name()
        out["tf32"] = "off (prepare() switches it off)"
        return out

    # -- the work -------------------------------------------------------------------
    def prepare(self, problem: Problem, params: dict[str, np.ndarray], device: str = "cpu", threads: int = 1) -> None:
        import torch

        ok, why = self.device_availability(device)
        if not ok:
            raise HarnessError(why)
        self.close()
        torch.set_num_threads(threads)
        torch.backends.cuda.matmul.allow_tf32 = False  # the spec's float32 tolerances assume IEEE products
        torch.backends.cudnn.allow_tf32 = False
        # Mixed precision: cuBLAS's low-precision products sum in float32 all the way (no split-K partial sums
        # kept in bfloat16 / float16), as the spec's product does.
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        self.problem = problem
        dev = torch.device("cuda" if device == "gpu" else "cpu")
        cls = _GraphedNet if self.variant == "graph" else _Net
        self._net = cls(problem, params, dev, self.variant)

    def warm_up(self, batch) -> None:
        """Compiles every kernel specialisation (and, for graph, captures the graphs); no update."""
        x, y = batch
        if self.problem.workload == "forward":
            self._net.outputs(x)
        else:
            self._net.warm_up_training(x, y)
        self.sync()

    def forward(self, x) -> np.ndarray:
        return self._net.outputs(x)

    def loss_and_grads(self, x, y):
        return self._net.loss_and_grads(x, y)

    def sgd_step(self, x, y, lr: float):
        return self._net.sgd_step(x, y, lr)

    def sync(self) -> None:
        if self._net is not None:
            self._net.sync()

    def get_params(self) -> dict[str, np.ndarray]:
        return self._net.get_params()

    def close(self) -> None:
        self._net = None


class _Cache:
    """One direction of one layer's forward record: ``inp`` the input it reads (time-reversed for a
    reverse direction), ``hs``/``cs`` (T+1, B, H) with the zero start at 0, ``gates`` (T, B, 4H): the
    LSTM's i, f, g, o, or the GRU's r, z, n and ``un`` (reset after) or ``r * h_prev`` (reset before)."""

    def __init__(self, inp, hs, cs, gates):
        self.inp, self.hs, self.cs, self.gates = inp, hs, cs, gates


class _Back:
    """One layer's backward carry between stages and what it leaves for the combined GEMMs."""

    def __init__(self, da_all=None):
        self.da_all = da_all  # full / tail: every step's da in one (T, B, GB) buffer
        self.n_stages = 0
        self.dh_rec = None
        self.dc = None  # LSTM: dL/dc; GRU: the part of dL/dh_prev outside the dh_rec GEMM
        self.segments: list[tuple[int, int, object]] = []  # (first step, end step, da rows)
        self.dx: dict[int, object] = {}  # stage -> gradient w.r.t. the layer's input rows (wavefront)


def _runs(pairs, split: bool):
    """Gate pairs ``(weight gate, da gate)`` as ``(weight gates, da gates)`` ranges: maximal runs where
    both advance together (one GEMM each), or one per gate when ``split`` (cuda:naive)."""
    runs: list[list[int]] = []
    for k, j in pairs:
        if runs and not split and runs[-1][1] == k and runs[-1][3] == j:
            runs[-1][1] += 1
            runs[-1][3] += 1
        else:
            runs.append([k, k + 1, j, j + 1])
    return [((a, b), (c, d)) for a, b, c, d in runs]


class _Net:
    """Parameters on the device and the step, forward and backward, for one variant.

    A layer's direction is a unit ``u = (layer, direction)``: its parameters are the names with
    ``layer_suffix(layer, direction)``; every per-unit function takes ``u``."""

    def __init__(self, problem: Problem, params: dict[str, np.ndarray], device, variant: str):
        import torch

        from backends.cuda import elementwise, elman, gru, lstm, persistent

        self.torch, self.E, self.k_lstm, self.k_elman, self.k_gru, self.k_pers = \
            torch, elementwise, lstm, elman, gru, persistent
        self.problem, self.spec, self.device, self.variant = problem, problem.model, device, variant
        spec = self.spec
        self.dtype = getattr(torch, problem.master_dtype)  # parameters, state, gradients (float32 when mixed)
        # mixed precision: the products' operand type, float16's loss scale, and the weights rounded once per pass
        self.low = getattr(torch, problem.dtype) if problem.reduced else None
        self.scale = problem.objective_scale
        self._low_w: dict[str, object] = {}
        if self.low is None:
            self._mm = torch.mm
        else:  # cuBLAS's low-precision product with a float32 result; under the interpreter its emulation
            from backends import low_precision

            self._mm = low_precision.raw_product(torch, self.low, device, emulate=device.type == "cpu")
            low_precision.check_product(torch, self._mm, self.low, device)
        self.H, self.L = spec.hidden, spec.layers
        H = self.H
        self.is_lstm = spec.kind == "lstm"
        self.is_gru = spec.kind == "gru"
        self.reset_after = self.is_gru and spec.reset_after
        self.dirs = spec.directions
        self.G = spec.gates * H  # the input and recurrent products' width
        # the width of da (the backward's pre-activation gradients): the GRU's reset after keeps dun too
        self.GB = 4 * H if self.reset_after else self.G
        self.GS = 4 * H  # stored gates (LSTM, GRU)
        # which weight gate each da gate multiplies: input weights, and W_hh against h_prev
        ident = [(k, k) for k in range(spec.gates)]
        if self.reset_after:
            self.in_map, self.rec_map = [(0, 0), (1, 1), (2, 3)], [(0, 0), (1, 1), (2, 2)]
        elif self.is_gru:
            self.in_map, self.rec_map = ident, [(0, 0), (1, 1)]  # W_hn meets r * h_prev, not h_prev
        else:
            self.in_map = self.rec_map = ident
        self.tokens = problem.tokens
        self.naive = variant == "naive"
        self.fused = variant in ("fused", "streams", "graph", "persistent")
        # a (layer, step) wavefront needs layer l step t to read layer l-1 at step t only; a reverse
        # direction reads layer l-1's last step first, so bidirectional layers run one after another
        self.wavefront = variant in ("streams", "graph") and self.L > 1 and self.dirs == 1
        self.persistent = variant == "persistent"
        self.on_gpu = device.type == "cuda"
        self.w_in = spec.input_weight
        self.b_in = spec.bias_name
        self.names = spec.param_names()
        # Pre-transposed (stored (G, D) / (G, H), nn.Linear's layout) for every variant past naive;
        # the token tables stay (V, G) (their rows are gathered).
        self.transposed = set()
        if not self.naive:
            for layer in range(self.L):
                for d in range(self.dirs):
                    s = layer_suffix(layer, d)
                    self.transposed.add("W_hh" + s)
                    if not (layer == 0 and self.tokens):
                        self.transposed.add(self.w_in + s)
        self.p = {}
        for k in self.names:
            a = np.asarray(params[k])
            a = a.T if k in self.transposed else a
            self.p[k] = torch.tensor(np.ascontiguousarray(a), dtype=self.dtype, device=device)
        self.lr = torch.zeros(1, dtype=self.dtype, device=device)  # read by the SGD kernel on the device
        self.clip = None if spec.clip is None else torch.full((1,), spec.clip, dtype=self.dtype, device=device)
        self._streams = None
        self._events: dict[tuple, object] = {}
        self._barriers: list = []

    # -- small helpers ---------------------------------------------------------------
    @staticmethod
    def _sfx(u) -> str:
        return layer_suffix(*u)

    def P(self, name: str, u):
        return self.p.get(name + self._sfx(u))

    def W(self, full: str):
        """Weight ``full`` as the products read it: itself, or under mixed precision its copy rounded to the
        low type at the start of the pass (:meth:`_round_weights`)."""
        return self.p[full] if self.low is None else self._low_w[full]

    def _round_weights(self):
        """Mixed precision: every weight matrix a product reads, rounded once per pass (the token tables are
        gathered, not multiplied: they stay float32)."""
        if self.low is None:
            return
        tables = {self.w_in + layer_suffix(0, d) for d in range(self.dirs)} if self.tokens else set()
        self._low_w = {k: v.to(self.low) for k, v in self.p.items() if v.dim() == 2 and k not in tables}

    def _is_table(self, u) -> bool:
        """Whether unit ``u``'s input weights are a token table (rows gathered, not multiplied)."""
        return u[0] == 0 and self.tokens

    def _peep(self, u):
        if not self.spec.peephole:
            return None
        return tuple(self.P(k, u) for k in ("p_i", "p_f", "p_o"))

    def _x(self, x):
        return self.torch.as_tensor(self.problem.cast_inputs(x, np.int64), device=self.device)

    def _y(self, y):
        return self.torch.as_tensor(self.problem.cast_targets(y, np.int64), device=self.device)

    def _gates(self, lo: int, hi: int):
        """Gate blocks ``lo..hi`` as a column slice, or None for all of a product's ``G`` columns."""
        return None if (lo, hi) == (0, self.G // self.H) else slice(lo * self.H, hi * self.H)

    def _times_w(self, name: str, u, a, cols=None):
        """``a @ W`` (or of W's columns ``cols``), whichever layout W is stored in."""
        W = self.W(name + self._sfx(u))
        if name + self._sfx(u) in self.transposed:
            W = W if cols is None else W[cols]
            return self._mm(a, W.t())
        return self._mm(a, W if cols is None else W[:, cols])

    def _times_wt(self, name: str, u, da, cols=None):
        """``da @ W^T`` (or with W's columns ``cols`` only)."""
        W = self.W(name + self._sfx(u))
        if name + self._sfx(u) in self.transposed:
            return self._mm(da, W if cols is None else W[cols])
        return self._mm(da, (W if cols is None else W[:, cols]).t())

    def _times_wt_map(self, name: str, u, da, pairs):
        """``sum over gate pairs of da[:, da gate] @ W[:, weight gate]^T``: one GEMM per run of gates
        (cuda:naive: one per gate, summed by element-wise kernels)."""
        H, out = self.H, None
        for (k0, k1), (j0, j1) in _runs(pairs, self.naive):
            part = self._times_wt(name, u, da[:, j0 * H:j1 * H], self._gates(k0, k1))
            if out is None:
                out = part
            else:
                out = self.E.binary("add", out, part) if self.naive else out.add_(part)
        return out

    def _dx(self, u, da):
        """The gradient reaching the unit's input: ``da`` through the input weights."""
        return self._times_wt_map(self.w_in, u, da, self.in_map)

    def _dh_rec(self, u, da):
        """The gradient reaching ``h_prev`` through the recurrent GEMM."""
        return self._times_wt_map("W_hh", u, da, self.rec_map)

    def _acc_w(self, grads, name: str, left, da, pairs):
        """``dW[:, weight gate] += left^T da[:, da gate]`` over the gate runs (stored layout)."""
        H = self.H
        runs = _runs(pairs, self.naive)
        (k0, k1), (j0, j1) = runs[0]
        if len(runs) == 1 and self._gates(k0, k1) is None and (j0, j1) == (0, da.shape[1] // H):
            value = self._mm(da.t(), left) if name in self.transposed else self._mm(left.t(), da)
            self._accumulate(grads, name, value)
            return
        if name not in grads:
            grads[name] = self.torch.zeros_like(self.p[name])
        for (k0, k1), (j0, j1) in runs:
            part = da[:, j0 * H:j1 * H]
            if name in self.transposed:
                grads[name][k0 * H:k1 * H] += self._mm(part.t(), left)
            else:
                grads[name][:, k0 * H:k1 * H] += self._mm(left.t(), part)

    def _project(self, u, inp):
        """The hoisted input GEMM over steps: (S, B, D) (token ids (S, B)) -> (S, B, G) with the bias."""
        torch = self.torch
        b = self.P(self.b_in, u)
        if self._is_table(u):
            rows = self.P(self.w_in, u)[inp]
            return rows if b is None else rows + b
        S, B = inp.shape[:2]
        flat = inp.reshape(S * B, -1)
        W = self.W(self.w_in + self._sfx(u))
        if self.low is not None:  # the float32 product, the bias added in float32
            out = self._mm(flat, W.t())
            out = out if b is None else out.add_(b)
        else:
            out = torch.mm(flat, W.t()) if b is None else torch.addmm(b, flat, W.t())
        return out.view(S, B, self.G)

    def _stream(self, layer: int):
        """Layer ``layer``'s stream context (a no-op off the GPU: the same order, one queue)."""
        if not (self.wavefront and self.on_gpu):
            return contextlib.nullcontext()
        if self._streams is None:
            self._streams = [self.torch.cuda.Stream(self.device) for _ in range(self.L)]
        return self.torch.cuda.stream(self._streams[layer])

    def _event(self, key):
        """A reusable CUDA event per (pass, layer, stage), or None off the GPU."""
        if not (self.wavefront and self.on_gpu):
            return None
        if key not in self._events:
            self._events[key] = self.torch.cuda.Event()
        return self._events[key]

    def _fork(self):
        if self.wavefront and self.on_gpu:
            self._stream(0)  # create the streams
            main = self.torch.cuda.current_stream(self.device)
            for s in self._streams:
                s.wait_stream(main)

    def _join(self):
        if self.wavefront and self.on_gpu:
            main = self.torch.cuda.current_stream(self.device)
            for s in self._streams:
                main.wait_stream(s)

    # -- forward ---------------------------------------------------------------------
    def _new_cache(self, inp, T: int, B: int, train: bool) -> _Cache:
        torch = self.torch
        hs = torch.zeros((T + 1, B, self.H), dtype=self.dtype, device=self.device)
        cs = torch.zeros_like(hs) if self.is_lstm else None
        # the reset-before GRU passes z and r * h_prev through its gates between the step's two halves
        keep = (self.is_lstm and train) or (self.is_gru and (train or not self.reset_after))
        gates = torch.empty((T, B, self.GS), dtype=self.dtype, device=self.device) if keep else None
        return _Cache(inp, hs, cs, gates)

    def _forward(self, xt, train: bool):
        """Every layer over all steps; returns the caches (per layer, per direction) and the top
        layer's output (T, B, directions * H)."""
        torch = self.torch
        T, B = xt.shape[:2]
        self._round_weights()
        if self.dirs == 1:
            caches = []
            for layer in range(self.L):
                inp = xt if layer == 0 else caches[-1][0].hs[1:]
                caches.append([self._new_cache(inp, T, B, train)])
            if self.wavefront:
                self._forward_wavefront([c[0] for c in caches], T)
            else:
                for layer, (c,) in enumerate(caches):
                    self._run_unit((layer, 0), c, T)
            return caches, caches[-1][0].hs[1:]
        caches, inp = [], xt
        for layer in range(self.L):
            dirs = [self._new_cache(inp if d == 0 else torch.flip(inp, (0,)), T, B, train) for d in range(2)]
            for d, c in enumerate(dirs):
                self._run_unit((layer, d), c, T)
            caches.append(dirs)
            # the layer's output at t: [h_t, h_t of the reverse run, its step T-1-t]
            inp = torch.cat([dirs[0].hs[1:], torch.flip(dirs[1].hs[1:], (0,))], dim=-1)
        return caches, inp

    def _run_unit(self, u, c: _Cache, T: int):
        """Every step of one direction of one layer."""
        if self.naive:
            for t in range(T):
                self._naive_step(u, c, t)
            return
        pre = self._project(u, c.inp)
        if self.persistent:
            w = self.P("W_hh", u)  # float32: the kernel rounds it (and h) to the low type itself when mixed
            low = None if self.low is None else self.problem.dtype
            if self.is_gru:
                bar = self.k_pers.run_gru_layer(pre, w, self.P("b_hn", u), c.hs, c.gates, self.reset_after, low=low)
            else:
                bar = self.k_pers.run_layer(pre, w, c.hs, c.cs, c.gates, self._peep(u), self.is_lstm,
                                            self.spec.activation, low=low)
            self._barriers.append(bar)
            return
        for t in range(T):
            self._step(u, c, t, pre[t])

    def _forward_wavefront(self, caches, T: int):
        """Layer l step t on layer l's stream after layer l-1 step t: the diagonals of (layer, step)."""
        self._fork()
        with self._stream(0):
            pre0 = self._project((0, 0), caches[0].inp)
        for d in range(T + self.L - 1):
            for layer in range(self.L):
                t = d - layer
                if not 0 <= t < T:
                    continue
                with self._stream(layer):
                    if layer > 0:
                        ev = self._event(("f", layer - 1, t))
                        if ev is not None:
                            self.torch.cuda.current_stream(self.device).wait_event(ev)
                        pre = self._project((layer, 0), caches[layer].inp[t: t + 1])[0]
                    else:
                        pre = pre0[t]
                    self._step((layer, 0), caches[layer], t, pre)
                    ev = self._event(("f", layer, t))
                    if ev is not None:
                        ev.record()
        self._join()

    def _step(self, u, c: _Cache, t: int, pre):
        """One step of one unit, combined gates (grouped: element-wise op by op; fused: one kernel)."""
        if self.is_gru:
            self._gru_step(u, c, t, pre)
            return
        rec = self._times_w("W_hh", u, c.hs[t]) if t > 0 else None
        if self.fused:
            if self.is_lstm:
                self.k_lstm.forward_step(pre, rec, c.cs[t], self._peep(u), c.hs[t + 1], c.cs[t + 1],
                                         c.gates[t] if c.gates is not None else None)
            else:
                self.k_elman.forward_step(pre, rec, c.hs[t + 1], self.spec.activation)
            return
        E = self.E
        a = pre if rec is None else E.binary("add", pre, rec)
        if not self.is_lstm:
            E.unary(_ACT_OP[self.spec.activation], a, out=c.hs[t + 1])
            return
        H = self.H
        cols = [a[:, k * H:(k + 1) * H] for k in range(4)]
        self._unfused_lstm(u, cols, c.cs[t], c.hs[t + 1], c.cs[t + 1], self._gate_outs(c, t))

    def _gate_outs(self, c: _Cache, t: int):
        H = self.H
        return [c.gates[t][:, k * H:(k + 1) * H] for k in range(4)] if c.gates is not None else [None] * 4

    def _gru_step(self, u, c: _Cache, t: int, pre):
        """One GRU step: the recurrent GEMM of r, z (and n, reset after) at once; reset before, the GEMM
        of ``r * h_prev`` with ``W_hn`` between the two halves of the step."""
        H = self.H
        hp, g = c.hs[t], (c.gates[t] if c.gates is not None else None)
        rn = slice(2 * H, 3 * H)
        if self.reset_after:
            rec = self._times_w("W_hh", u, hp) if t > 0 else None
            if self.fused:
                self.k_gru.forward_step(pre, rec, self.P("b_hn", u), hp, c.hs[t + 1], g)
                return
            rec_cols = None if rec is None else [rec[:, k * H:(k + 1) * H] for k in range(3)]
            self._unfused_gru(u, [pre[:, k * H:(k + 1) * H] for k in range(3)], rec_cols, None, hp, c.hs[t + 1],
                              self._gate_outs(c, t))
            return
        rec = self._times_w("W_hh", u, hp, slice(0, 2 * H)) if t > 0 else None
        if self.fused:
            self.k_gru.reset_gate_step(pre, rec, hp, g)
            rec_n = self._times_w("W_hh", u, g[:, 3 * H:], rn) if t > 0 else None
            self.k_gru.new_gate_step(pre, rec_n, hp, g, c.hs[t + 1])
            return
        rec_cols = None if rec is None else [rec[:, :H], rec[:, H:]]
        rn_fn = (lambda rh: self._times_w("W_hh", u, rh, rn)) if t > 0 else None
        self._unfused_gru(u, [pre[:, k * H:(k + 1) * H] for k in range(3)], rec_cols, rn_fn, hp, c.hs[t + 1],
                          self._gate_outs(c, t))

    def _naive_step(self, u, c: _Cache, t: int):
        """Per-gate GEMMs on the spec's layouts, then one kernel per element-wise operation."""
        E, H = self.E, self.H
        b = self.P(self.b_in, u)
        hp = c.hs[t]
        cols = []
        for k in range(self.G // H):
            sl = slice(k * H, (k + 1) * H)
            if self._is_table(u):
                a = self.P(self.w_in, u)[c.inp[t], sl].contiguous()  # the row gather, one gate's columns
            else:
                a = self._times_w(self.w_in, u, c.inp[t], sl)
            if t > 0 and not self.is_gru:
                a = E.binary("add", a, self._times_w("W_hh", u, hp, sl))
            if b is not None:
                a = E.binary("add", a, b[sl], row=True)
            cols.append(a)
        if self.is_gru:
            rec_gates = 3 if self.reset_after else 2
            rec = [self._times_w("W_hh", u, hp, slice(k * H, (k + 1) * H)) for k in range(rec_gates)] if t > 0 else None
            rn = slice(2 * H, 3 * H)
            rn_fn = (lambda rh: self._times_w("W_hh", u, rh, rn)) if t > 0 and not self.reset_after else None
            self._unfused_gru(u, cols, rec, rn_fn, hp, c.hs[t + 1], self._gate_outs(c, t))
            return
        if not self.is_lstm:
            E.unary(_ACT_OP[self.spec.activation], cols[0], out=c.hs[t + 1])
            return
        self._unfused_lstm(u, cols, c.cs[t], c.hs[t + 1], c.cs[t + 1], self._gate_outs(c, t))

    def _unfused_lstm(self, u, cols, c_prev, h_out, c_out, outs):
        """The LSTM cell from the gates' pre-activations, one kernel per operation."""
        E = self.E
        ai, af, ag, ao = cols
        peep = self._peep(u)
        if peep is not None:
            ai = E.binary("add", ai, E.binary("mul", c_prev, peep[0], row=True))
            af = E.binary("add", af, E.binary("mul", c_prev, peep[1], row=True))
        i = E.unary("sigmoid", ai, out=outs[0])
        f = E.unary("sigmoid", af, out=outs[1])
        g = E.unary("tanh", ag, out=outs[2])
        E.binary("add", E.binary("mul", f, c_prev), E.binary("mul", i, g), out=c_out)
        if peep is not None:
            ao = E.binary("add", ao, E.binary("mul", c_out, peep[2], row=True))
        o = E.unary("sigmoid", ao, out=outs[3])
        E.binary("mul", o, E.unary("tanh", c_out), out=h_out)

    def _unfused_gru(self, u, cols, rec, rn_fn, h_prev, h_out, outs):
        """The GRU cell, one kernel per operation: ``cols`` the input side's ``a_r, a_z, a_n`` (bias
        included), ``rec`` the recurrent products ``u_r, u_z`` (and ``u_n``, reset after; None at the
        first step), ``rn_fn(rh)`` the product ``rh W_hn`` (reset before; None at the first step);
        ``outs`` the stored gates r, z, n, un | rh (None: scratch)."""
        E = self.E
        ar, az, an = cols
        if rec is not None:
            ar = E.binary("add", ar, rec[0])
            az = E.binary("add", az, rec[1])
        r = E.unary("sigmoid", ar, out=outs[0])
        z = E.unary("sigmoid", az, out=outs[1])
        if self.reset_after:
            un = rec[2] if rec is not None else self.torch.zeros_like(h_prev)
            b_hn = self.P("b_hn", u)
            if b_hn is not None:
                un = E.binary("add", un, b_hn, row=True, out=outs[3])
            elif outs[3] is not None:
                outs[3].copy_(un)
            n_pre = E.binary("add", an, E.binary("mul", r, un))
        else:
            rh = E.binary("mul", r, h_prev, out=outs[3])
            n_pre = an if rn_fn is None else E.binary("add", an, rn_fn(rh))
        n = E.unary("tanh", n_pre, out=outs[2])
        E.binary("add", n, E.binary("mul", z, E.binary("sub", h_prev, n)), out=h_out)  # (1 - z) n + z h_prev

    # -- the head --------------------------------------------------------------------
    def _logits(self, top):
        flat = top.reshape(-1, self.dirs * self.H)
        b = self.p.get("b_y")
        if self.low is not None:
            z = self._mm(flat, self.W("W_hy"))
            return z if b is None else z.add_(b)
        return self.torch.mm(flat, self.p["W_hy"]) if b is None else self.torch.addmm(b, flat, self.p["W_hy"])

    def _outputs_dev(self, xt):
        _, top = self._forward(xt, train=False)
        z = self._logits(top).view(xt.shape[0], xt.shape[1], -1)
        if self.spec.head == "softmax_xent":
            return self.torch.softmax(z, dim=-1)
        return self.torch.tanh(z) if self.spec.output_act == "tanh" else z

    def _head(self, top, yt, T: int, B: int):
        """``(loss, dz)``: the reported loss (a device scalar) and dL/dz (T*B, O), tail steps masked."""
        torch = self.torch
        z = self._logits(top)
        if self.spec.head == "softmax_xent":
            y = yt.reshape(-1, 1)
            lse = torch.logsumexp(z, dim=1, keepdim=True)
            l_sum = (lse - z.gather(1, y)).sum()
            dz = torch.exp(z - lse)
            dz.scatter_add_(1, y, torch.full_like(dz[:, :1], -1.0))
            dz /= B
        else:
            out = torch.tanh(z) if self.spec.output_act == "tanh" else z
            diff = out - yt.reshape(z.shape)
            l_sum = 0.5 * (diff * diff).sum()
            dz = diff / B
            if self.spec.output_act == "tanh":
                dz = dz * (1 - out * out)
        if self.spec.bptt.mode == "tail":
            dz[: max(0, T - self.spec.bptt.k) * B] = 0
        return l_sum / (B * T), dz

    # -- backward --------------------------------------------------------------------
    def _stages(self, T: int) -> list[tuple[int, int]]:
        """The backward stages as (first step, end step) of their rows: one step at a time from the end
        (full, tail), or the truncated windows' depths j = 0..K, each over steps 0..T-1-j (one per window)."""
        bptt = self.spec.bptt
        if bptt.mode == "truncated":
            return [(0, T - j) for j in range(min(bptt.k, T - 1) + 1)]
        t0 = max(0, T - bptt.k) if bptt.mode == "tail" else 0
        return [(t, t + 1) for t in range(T - 1, t0 - 1, -1)]

    def _grads_dev(self, xt, yt):
        """Loss and gradients (device tensors, in the stored layouts): forward, head, BPTT; under mixed
        precision the gradients divided by the loss scale, and the loss NaN where one is not finite."""
        loss, grads = self._grads_scaled(xt, yt)
        if self.low is None:
            return loss, grads
        torch = self.torch
        found_inf = torch.zeros(1, dtype=torch.float32, device=self.device)
        inv = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=self.device)
        torch._amp_foreach_non_finite_check_and_unscale_(list(grads.values()), found_inf, inv)
        return torch.where(found_inf[0] > 0, torch.full_like(loss, float("nan")), loss), grads

    def _grads_scaled(self, xt, yt):
        """Loss and gradients of the objective times the loss scale (float16's; 1 otherwise)."""
        torch = self.torch
        T, B = xt.shape[:2]
        caches, top = self._forward(xt, train=True)
        loss, dz = self._head(top, yt, T, B)
        width = self.dirs * self.H
        if self.scale != 1:  # float16: the objective times the loss scale (undone in _grads_dev)
            dz = dz * self.scale
        grads = {"W_hy": self._mm(top.reshape(-1, width).t(), dz)}
        if "b_y" in self.p:
            grads["b_y"] = dz.sum(0)
        dh_top = self._mm(dz, self.W("W_hy").t()).view(T, B, width)
        stages = self._stages(T)
        if self.dirs == 2:
            self._backward_bidirectional(caches, stages, dh_top, grads)
            return loss, grads
        caches = [c[0] for c in caches]
        truncated = self.spec.bptt.mode == "truncated"
        # the top layer's dh_out per stage: every output at its own step (full/tail), or at depth 0 only
        dh_top_stage = [dh_top if u == 0 else None for u in range(len(stages))] if truncated else \
            [dh_top[a] for a, _ in stages]
        if self.wavefront:
            self._backward_wavefront(caches, stages, dh_top_stage, grads)
        else:
            dh_out = dh_top_stage
            for layer in reversed(range(self.L)):
                u = (layer, 0)
                back = self._new_back(T, B)
                for s in range(len(stages)):
                    self._bwd_stage(u, caches[layer], back, stages, s, dh_out[s], grads, want_dx=False)
                if not self.naive:
                    self._weight_grads(u, caches[layer], back, grads)
                if layer > 0:
                    dh_out = self._dx_per_stage(u, back, caches[layer], stages)
        return loss, grads

    def _backward_bidirectional(self, caches, stages, dh_top, grads):
        """Full BPTT through bidirectional layers, top layer first: each direction takes its half of
        the gradient reaching the layer's output (the reverse one time-reversed) and gives back the
        gradient reaching the layer's input, which the directions add."""
        torch, H = self.torch, self.H
        T, B = dh_top.shape[:2]
        dh = dh_top
        for layer in reversed(range(self.L)):
            dx = None
            for d, c in enumerate(caches[layer]):
                u = (layer, d)
                dh_d = dh[..., d * H:(d + 1) * H]
                dh_d = torch.flip(dh_d, (0,)) if d else dh_d.contiguous()
                back = self._new_back(T, B)
                for s, (a, _) in enumerate(stages):
                    self._bwd_stage(u, c, back, stages, s, dh_d[a], grads, want_dx=False)
                if not self.naive:
                    self._weight_grads(u, c, back, grads)
                if layer > 0:
                    if back.da_all is not None:
                        g = self._dx(u, back.da_all.reshape(-1, self.GB)).view(T, B, -1)
                    else:  # cuda:naive: stage s is step T-1-s
                        g = torch.cat(self._dx_per_stage(u, back, c, stages)[::-1], 0)
                    g = torch.flip(g, (0,)) if d else g
                    dx = g if dx is None else dx + g
            dh = dx

    def _new_back(self, T: int, B: int) -> _Back:
        if self.naive or self.spec.bptt.mode == "truncated":
            return _Back()
        return _Back(self.torch.empty((T, B, self.GB), dtype=self.dtype, device=self.device))

    def _backward_wavefront(self, caches, stages, dh_top_stage, grads):
        """Layer l stage u on layer l's stream after layer l+1 stage u (top layer first)."""
        torch = self.torch
        self._fork()
        T, B = caches[0].hs.shape[0] - 1, caches[0].hs.shape[1]
        backs = [self._new_back(T, B) for _ in range(self.L)]
        n = len(stages)
        for d in range(n + self.L - 1):
            for layer in reversed(range(self.L)):
                s = d - (self.L - 1 - layer)
                if not 0 <= s < n:
                    continue
                with self._stream(layer):
                    if layer == self.L - 1:
                        dho = dh_top_stage[s]
                    else:
                        ev = self._event(("b", layer + 1, s))
                        if ev is not None:
                            torch.cuda.current_stream(self.device).wait_event(ev)
                        dho = backs[layer + 1].dx[s]  # kept alive until the join: no cross-stream reuse
                    self._bwd_stage((layer, 0), caches[layer], backs[layer], stages, s, dho, grads,
                                    want_dx=layer > 0)
                    ev = self._event(("b", layer, s))
                    if ev is not None:
                        ev.record()
        for layer in range(self.L):
            with self._stream(layer):
                self._weight_grads((layer, 0), caches[layer], backs[layer], grads)
        self._join()

    def _segments(self, back: _Back, c: _Cache):
        """``(first step, end step, da rows)`` for the combined GEMMs: all the steps at once (full, tail),
        or one per truncated depth (over all its windows)."""
        if back.da_all is None:
            return back.segments
        T = c.hs.shape[0] - 1
        t0 = T - back.n_stages
        return [(t0, T, back.da_all[t0:].reshape(-1, self.GB))]

    def _dx_per_stage(self, u, back: _Back, c: _Cache, stages):
        """The gradient reaching layer-1's outputs per stage: one GEMM over every step of this layer's da."""
        if self.naive:
            return [back.dx[s] for s in range(len(stages))]
        B = c.hs.shape[1]
        out = []
        for a, b, da in self._segments(back, c):
            out.append(self._dx(u, da).view(b - a, B, -1))
        if back.da_all is not None:  # one segment of single steps: stage s is step stages[s][0]
            return [out[0][s0 - stages[-1][0]] for s0, _ in stages]
        return out

    def _bwd_stage(self, u, c: _Cache, back: _Back, stages, s, dh_out, grads, want_dx: bool):
        """One backward stage of one unit: da of its rows, the carries to the next stage."""
        torch = self.torch
        a, b = stages[s]
        B = c.hs.shape[1]
        R = (b - a) * B
        H = self.H
        last = s == len(stages) - 1
        back.n_stages = s + 1
        dho = None if dh_out is None else dh_out.reshape(R, H)
        if back.da_all is not None:
            da = back.da_all[a]  # full / tail: one step's rows, in place for the combined GEMMs
        else:
            da = torch.empty((R, self.GB), dtype=self.dtype, device=self.device)
        if self.naive or not self.fused:
            self._unfused_bwd(u, c, back, a, b, dho, da)
        elif self.is_lstm:
            dc = torch.empty((R, H), dtype=self.dtype, device=self.device)
            self.k_lstm.backward_step(dho, back.dh_rec, back.dc, c.gates[a:b].reshape(R, self.GS),
                                      c.cs[a:b].reshape(R, H), c.cs[a + 1:b + 1].reshape(R, H),
                                      self._peep(u), da, dc)
            back.dc = dc
        elif self.is_gru:
            dc = torch.empty((R, H), dtype=self.dtype, device=self.device)
            gates, h_prev = c.gates[a:b].reshape(R, self.GS), c.hs[a:b].reshape(R, H)
            if self.reset_after:
                self.k_gru.backward_step(dho, back.dh_rec, back.dc, gates, h_prev, da, dc)
            else:
                self.k_gru.new_gate_backward(dho, back.dh_rec, back.dc, gates, h_prev, da, dc)
                drh = self._times_wt("W_hh", u, da[:, 2 * H:], slice(2 * H, 3 * H))
                self.k_gru.reset_gate_backward(drh, gates, h_prev, da, dc)
            back.dc = dc
        else:
            self.k_elman.backward_step(dho, back.dh_rec, c.hs[a + 1:b + 1].reshape(R, H), da, self.spec.activation)
        if self.naive:
            self._segment_weight_grads(u, c, a, b, da, grads)
            if u[0] > 0:
                back.dx[s] = self._dx(u, da).view(b - a, B, -1)
        else:
            if back.da_all is None:
                back.segments.append((a, b, da))
            if want_dx:
                back.dx[s] = self._dx(u, da).view(b - a, B, -1)
        dh_rec = None if last else self._dh_rec(u, da)
        if self.spec.bptt.mode == "truncated" and not last:
            # truncated: the next depth has one window fewer (the earliest one reached step 0)
            back.dh_rec = dh_rec[B:]
            back.dc = back.dc[B:] if back.dc is not None else None
        else:
            back.dh_rec = dh_rec

    def _unfused_bwd(self, u, c: _Cache, back: _Back, a: int, b: int, dho, da):
        """The cell's backward, one kernel per element-wise operation, into da (R, GB)."""
        torch, E = self.torch, self.E
        H = self.H
        R = (b - a) * c.hs.shape[1]
        # the GRU's carried dc is part of dh (the LSTM's is dL/dc, added below)
        parts = [t for t in (dho, back.dh_rec, back.dc if self.is_gru else None) if t is not None]
        if not parts:
            dh = torch.zeros((R, H), dtype=self.dtype, device=self.device)
        else:
            dh = parts[0]
            for p in parts[1:]:
                dh = E.binary("add", dh, p)
        if self.is_gru:
            self._unfused_gru_bwd(u, c, back, a, b, dh, da)
            return da
        if not self.is_lstm:
            h = c.hs[a + 1:b + 1].reshape(R, H)
            E.binary("mul", dh, E.unary(_ACT_GRAD_OP[self.spec.activation], h), out=da)
            return da
        gates = c.gates[a:b].reshape(R, self.GS)
        i, f, g, o = (gates[:, k * H:(k + 1) * H] for k in range(4))
        c_prev = c.cs[a:b].reshape(R, H)
        c_t = c.cs[a + 1:b + 1].reshape(R, H)
        dai, daf, dag, dao = (da[:, k * H:(k + 1) * H] for k in range(4))
        peep = self._peep(u)
        tc = E.unary("tanh", c_t)
        E.binary("mul", E.binary("mul", dh, tc), E.unary("dsigmoid", o), out=dao)
        dc = E.binary("mul", E.binary("mul", dh, o), E.unary("dtanh", tc))
        if back.dc is not None:
            dc = E.binary("add", dc, back.dc)
        if peep is not None:
            dc = E.binary("add", dc, E.binary("mul", dao, peep[2], row=True))
        E.binary("mul", E.binary("mul", dc, g), E.unary("dsigmoid", i), out=dai)
        E.binary("mul", E.binary("mul", dc, c_prev), E.unary("dsigmoid", f), out=daf)
        E.binary("mul", E.binary("mul", dc, i), E.unary("dtanh", g), out=dag)
        carry = E.binary("mul", dc, f)
        if peep is not None:
            carry = E.binary("add", carry, E.binary("mul", dai, peep[0], row=True))
            carry = E.binary("add", carry, E.binary("mul", daf, peep[1], row=True))
        back.dc = carry
        return da

    def _unfused_gru_bwd(self, u, c: _Cache, back: _Back, a: int, b: int, dh, da):
        """The GRU's backward from ``dh`` (all of dL/dh_t), one kernel per operation (da as in backends.cuda.gru)."""
        E, H = self.E, self.H
        R = dh.shape[0]
        gates = c.gates[a:b].reshape(R, self.GS)
        r, z, n, x = (gates[:, k * H:(k + 1) * H] for k in range(4))  # x: un (reset after) or r * h_prev
        h_prev = c.hs[a:b].reshape(R, H)
        dar, daz = da[:, :H], da[:, H:2 * H]
        dan = da[:, 3 * H:] if self.reset_after else da[:, 2 * H:]
        dhz = E.binary("mul", dh, z)
        E.binary("mul", E.binary("sub", dh, dhz), E.unary("dtanh", n), out=dan)  # dh (1 - z) (1 - n^2)
        E.binary("mul", E.binary("mul", dh, E.binary("sub", h_prev, n)), E.unary("dsigmoid", z), out=daz)
        if self.reset_after:
            E.binary("mul", dan, r, out=da[:, 2 * H:3 * H])  # dun
            E.binary("mul", E.binary("mul", dan, x), E.unary("dsigmoid", r), out=dar)
            back.dc = dhz
        else:
            drh = self._times_wt_map("W_hh", u, da, [(2, 2)])  # da_n W_hn^T: the gradient of r * h_prev
            E.binary("mul", E.binary("mul", drh, h_prev), E.unary("dsigmoid", r), out=dar)
            back.dc = E.binary("add", dhz, E.binary("mul", drh, r))

    def _accumulate(self, grads, name, value):
        if name in grads:
            grads[name].add_(value)
        else:
            grads[name] = value

    def _table_grad(self, grads, u, ids, da):
        """``dW[v, weight gate] += da[rows with token v, da gate]`` (an index_add per gate run)."""
        name = self.w_in + self._sfx(u)
        if name not in grads:
            grads[name] = self.torch.zeros_like(self.p[name])
        H, flat = self.H, ids.reshape(-1)
        for (k0, k1), (j0, j1) in _runs(self.in_map, False):
            grads[name][:, k0 * H:k1 * H].index_add_(0, flat, da[:, j0 * H:j1 * H])

    def _small_grads(self, u, c: _Cache, a, b, da, grads):
        """Bias and peephole gradients of one segment (reductions over its rows)."""
        s = self._sfx(u)
        H = self.H
        if self.spec.bias:
            name = self.b_in + s
            if self.reset_after:
                if name not in grads:
                    grads[name] = self.torch.zeros_like(self.p[name])
                grads[name][:2 * H] += da[:, :2 * H].sum(0)
                grads[name][2 * H:] += da[:, 3 * H:].sum(0)
                self._accumulate(grads, "b_hn" + s, da[:, 2 * H:3 * H].sum(0))
            else:
                self._accumulate(grads, name, da.sum(0))
        if self.spec.peephole:
            R = da.shape[0]
            c_prev = c.cs[a:b].reshape(R, H)
            c_t = c.cs[a + 1:b + 1].reshape(R, H)
            self._accumulate(grads, "p_i" + s, (da[:, :H] * c_prev).sum(0))
            self._accumulate(grads, "p_f" + s, (da[:, H:2 * H] * c_prev).sum(0))
            self._accumulate(grads, "p_o" + s, (da[:, 3 * H:] * c_t).sum(0))

    def _weight_grads(self, u, c: _Cache, back: _Back, grads):
        """Combined weight-gradient GEMMs: one per weight over every step of a segment (full, tail: all
        the steps at once; truncated: one per depth, over every window)."""
        for a, b, da in self._segments(back, c):
            self._segment_weight_grads(u, c, a, b, da, grads)

    def _segment_weight_grads(self, u, c: _Cache, a, b, da, grads):
        """Every weight gradient of the steps ``a..b-1`` (cuda:naive: per stage, per gate, spec layouts)."""
        s = self._sfx(u)
        H = self.H
        R = da.shape[0]
        self._acc_w(grads, "W_hh" + s, c.hs[a:b].reshape(R, H), da, self.rec_map)
        if self.is_gru and not self.reset_after:  # W_hn meets r * h_prev
            self._acc_w(grads, "W_hh" + s, c.gates[a:b, :, 3 * H:].reshape(R, H), da, [(2, 2)])
        if self._is_table(u):
            self._table_grad(grads, u, c.inp[a:b], da)
        else:
            self._acc_w(grads, self.w_in + s, c.inp[a:b].reshape(R, -1), da, self.in_map)
        self._small_grads(u, c, a, b, da, grads)

    def _sgd(self, grads):
        """``p -= lr * clip(g)`` for every parameter (a gradient never formed is zero: no change)."""
        for k in self.names:
            if k in grads:
                self.E.sgd_(self.p[k], grads[k].contiguous(), self.lr, self.clip)

    # -- what the backend calls -----------------------------------------------------
    def outputs(self, x) -> np.ndarray:
        with self.torch.inference_mode():
            out = self._outputs_dev(self._x(x)).cpu().numpy()
        self._check_barriers()
        return out

    def warm_up_training(self, x, y) -> None:
        with self.torch.no_grad():
            self._grads_dev(self._x(x), self._y(y))

    def loss_and_grads(self, x, y):
        with self.torch.no_grad():
            loss, grads = self._grads_dev(self._x(x), self._y(y))
        self._check_barriers()
        return float(loss), self._to_numpy(grads)

    def sgd_step(self, x, y, lr: float):
        with self.torch.no_grad():
            self.lr.fill_(lr)
            loss, grads = self._grads_dev(self._x(x), self._y(y))
            self._sgd(grads)
        return loss

    def _to_numpy(self, grads) -> dict[str, np.ndarray]:
        out = {}
        for k in self.names:
            g = grads.get(k)
            g = self.torch.zeros_like(self.p[k]) if g is None else g
            out[k] = (g.t() if k in self.transposed else g).cpu().numpy()
        return out

    def get_params(self) -> dict[str, np.ndarray]:
        return {k: (v.t() if k in self.transposed else v).cpu().numpy().copy() for k, v in self.p.items()}

    def _check_barriers(self):
        bars, self._barriers = self._barriers, []
        for bar in bars:
            self.k_pers.raise_on_barrier_timeout(bar)

    def sync(self) -> None:
        if self.on_gpu:
            self.torch.cuda.synchronize(self.device)
        self._check_barriers()


class _GraphedNet(_Net):
    """The forward pass and the training step each replayed from one CUDA graph over static buffers.

    The graph is captured once per input shape, after one eager warm-up (which compiles every
    Triton specialisation; for training it runs with a learning rate of 0 and so leaves the
    parameters as they were). Off the GPU the same static-buffer function runs eagerly each call."""

    def __init__(self, problem, params, device, variant):
        super().__init__(problem, params, device, variant)
        self._graphs: dict[tuple, tuple] = {}

    def _static(self, key, fn, *inputs):
        """``(run, outputs)``: ``run(*new_inputs)`` copies into the static inputs and replays the graph."""
        torch = self.torch
        if key not in self._graphs:
            static_in = [t.clone() for t in inputs]
            if not self.on_gpu:
                self._graphs[key] = (static_in, None, fn)
            else:
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    fn(*static_in)  # compiles every kernel specialisation before capture
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_out = fn(*static_in)
                self._graphs[key] = (static_in, (graph, static_out), fn)
        static_in, captured, fn = self._graphs[key]
        for dst, src in zip(static_in, inputs):
            dst.copy_(src)
        if captured is None:
            return fn(*static_in)
        graph, static_out = captured
        graph.replay()
        return static_out

    def _train_fn(self, xt, yt):
        loss, grads = self._grads_dev(xt, yt)
        self._sgd(grads)
        return loss

    def outputs(self, x) -> np.ndarray:
        with self.torch.inference_mode():
            xt = self._x(x)
            out = self._static(("fwd", tuple(xt.shape)), self._outputs_dev, xt)
            return out.cpu().numpy()

    def sgd_step(self, x, y, lr: float):
        with self.torch.no_grad():
            xt, yt = self._x(x), self._y(y)
            key = ("train", tuple(xt.shape), tuple(yt.shape))
            if key not in self._graphs and self.on_gpu:
                self.lr.fill_(0.0)  # the eager warm-up before capture must not move the parameters
                self._static(key, self._train_fn, xt, yt)
            self.lr.fill_(lr)
            return self._static(key, self._train_fn, xt, yt).clone()

    def warm_up_training(self, x, y) -> None:
        """Capture the training graph (at lr 0: no update) so that compile time is not step time."""
        if not self.on_gpu:
            return super().warm_up_training(x, y)
        with self.torch.no_grad():
            xt, yt = self._x(x), self._y(y)
            key = ("train", tuple(xt.shape), tuple(yt.shape))
            if key not in self._graphs:
                self.lr.fill_(0.0)
                self._static(key, self._train_fn, xt, yt)


_ACT_OP = {"tanh": "tanh", "relu": "relu", "sigmoid": "sigmoid"}
_ACT_GRAD_OP = {"tanh": "dtanh", "relu": "drelu", "sigmoid": "dsigmoid"}

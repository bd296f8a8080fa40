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

import importlib.util
import os

import numpy as np

from backends.base import Backend, unsupported
from backends.cuda import interpreting
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
    #: every kernel specialisation compiles on a GPU, and under the interpreter each case is slow
    compile_heavy = True

    def __init__(self, variant: str | None = None):
        super().__init__(variant)
        self._net = None  # a backends.cuda.net.Net once prepared

    # -- cheap questions -------------------------------------------------------------
    def availability(self) -> tuple[bool, str]:
        """torch and triton installed, and a GPU (or Triton's interpreter switched on)."""
        if importlib.util.find_spec("torch") is None or importlib.util.find_spec("triton") is None:
            return False, _NOT_INSTALLED
        if not (interpreting() or _gpu_present()):
            return False, _NO_GPU
        return True, ""

    def device_availability(self, device: str) -> tuple[bool, str]:
        """gpu: torch sees a CUDA device and the interpreter is off; cpu: only under the interpreter."""
        ok, why = super().device_availability(device)
        if not ok:
            return ok, why
        if device == "cpu":
            return (True, "") if interpreting() else (False, _CPU_NEEDS_INTERPRETER)
        if interpreting():
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
        out["triton_mode"] = "interpreter (TRITON_INTERPRET=1, CPU)" if interpreting() else "compiled"
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
        self._net = _engine(self.variant)(problem, params, dev, self.variant)

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


def _engine(variant: str):
    """The engine class for ``variant`` (imported here: it imports torch and triton when built)."""
    if variant == "graph":
        from backends.cuda.graphed import GraphedNet

        return GraphedNet
    from backends.cuda.net import Net

    return Net

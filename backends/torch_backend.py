"""PyTorch: an explicit autograd cell, the fused nn.RNN / nn.LSTM / nn.GRU modules, and torch.compile.

Variants::

    autograd  the SPEC.md cell written step by step in torch ops; autograd does BPTT
    fused     torch.nn.RNN / nn.LSTM / nn.GRU over the whole sequence (oneDNN on CPU, cuDNN on GPU)
    compile   the autograd variant with each time step's cell compiled by torch.compile (inductor)

Shapes follow SPEC.md (time-major, row vectors). Token input is a row gather of
the layer-0 input weight (each direction's, in a bidirectional network); its gradient
comes back as one row per token and is applied with ``index_add_``, as a sparse
embedding update would be, never through one-hot matrices or a dense (vocab, H)
gradient in the training step. The GRU's gates are grouped as the LSTM's: one input
GEMM over all steps and one recurrent GEMM per step (two before the reset).

Mixed precision (``bfloat16``, ``float16``) is the spec's: float32 parameters, gradients, update,
element-wise maths and state; every matrix product (the input projection over all steps, the
recurrent product of each step, the head, and in the backward pass the products of the gradients)
goes through ``backends.low_precision``'s autograd product, which rounds its operands, the gradients
included, to the low type and returns the float32 sum, ``torch.mm(a_low, b_low, out_dtype=float32)``
on a GPU (a recurrent weight is rounded once per sequence, not once per step). float16 multiplies
the objective by the static loss scale and unscales with
``torch._amp_foreach_non_finite_check_and_unscale_``, whose non-finite flag makes the step's loss
NaN. There is no autocast: it rounds every product's result to the low type as well, forward and
backward, which landed up to 1.5x past the bound that catches a 5% gradient error (the realistic
LSTM's dW_hh 1.01x, a GRU case 1.16x, nn.GRU 1.53x; ``benchmarks/measure_mixed_precision.py``).

Where that runs: torch:autograd and torch:compile on a GPU whose torch has ``aten::mm.dtype``
(checked when the cell is screened, and the product probed once on the device in ``prepare``).
On the CPU mixed precision is refused: PyTorch has no CPU matrix product with low-precision inputs
and a float32 result (``aten::mm.dtype`` has a CUDA kernel only), and its low-precision ``a @ b``
returns the low type (autocast's extra rounding), whatever its speed on the CPU at hand. Tests run the same step on the
CPU with the product emulated (``low_precision.EMULATE_ON_CPU``), which checks the maths, never a
speed. torch:fused refuses it everywhere: cuDNN's (and oneDNN's) half-precision RNNs run in the
module's dtype, keeping ``h``, ``c`` and the gates in the low type and rounding every product's
result, and the one measurement of such a module (nn.GRU under autocast) landed 1.53x past the bound.
"""

from __future__ import annotations

import importlib.util

import numpy as np

from backends.base import Backend, unsupported
from backends.torch_nets.autograd import Net
from backends.torch_nets.compiled import CompiledNet
from backends.torch_nets.fused import FusedNet
from harness.spec.model import Problem

_NOT_INSTALLED = "unavailable: torch not installed (pip install 'rnn-harness[torch]')"
_NO_CUDA = "unavailable: no CUDA device (torch.cuda.is_available() is False)"


class TorchBackend(Backend):
    """PyTorch, as its users would write the SPEC.md network (see the module docstring)."""
    knows = frozenset({"gru", "bidirectional", "reduced"})  # these spec additions are in its supports()

    name = "torch"
    package = "torch"
    variants = ("autograd", "fused", "compile")
    devices = ("cpu", "gpu")

    def __init__(self, variant: str | None = None):
        super().__init__(variant)
        # Only torch.compile pays seconds per graph; the eager variants run the whole matrix.
        self.compile_heavy = self.variant == "compile"
        self._net: Net | None = None

    # -- cheap questions -------------------------------------------------------------
    def availability(self) -> tuple[bool, str]:
        """Torch importable here (found without importing it)."""
        if importlib.util.find_spec("torch") is None:
            return False, _NOT_INSTALLED
        return True, ""

    def device_availability(self, device: str) -> tuple[bool, str]:
        """CPU always; GPU when torch sees a CUDA device."""
        ok, why = super().device_availability(device)
        if not ok or device == "cpu":
            return ok, why
        ok, why = self.availability()
        if not ok:
            return ok, why
        import torch

        if not torch.cuda.is_available():
            return False, _NO_CUDA
        return True, ""

    def supports(self, problem: Problem) -> tuple[bool, str]:
        """Everything for autograd and compile in float32 and float64, and in bfloat16 and float16 on a GPU
        with the spec's product; what nn.RNN / nn.LSTM / nn.GRU can express for fused, in float32 and float64
        (see the module docstring for mixed precision)."""
        m = problem.model
        if problem.reduced:
            return self._supports_reduced(problem)
        if self.variant != "fused":
            return True, ""
        if m.kind == "gru" and not m.reset_after:
            return unsupported("torch:fused: nn.GRU implements the reset-after form only (cuDNN's, "
                               "r * (h W_hn + b_hn)), not reset_after: false")
        if m.kind == "elman" and m.activation == "sigmoid":
            return unsupported("torch:fused: nn.RNN offers only the tanh and relu nonlinearities")
        if m.peephole:
            return unsupported("torch:fused: nn.LSTM has no peephole connections")
        return True, ""

    def _supports_reduced(self, problem: Problem) -> tuple[bool, str]:
        """Mixed precision: the spec's product on a GPU (torch:autograd, torch:compile), nowhere else."""
        from backends import low_precision

        if self.variant == "fused":
            return unsupported(f"torch:fused: cuDNN's and oneDNN's {problem.dtype} RNN modules keep h, c and the gates "
                               f"in {problem.dtype} and round every product's result (nn.GRU under autocast: 1.53x "
                               f"past the bound that must catch a 5% gradient error)")
        if problem.device == "cpu":
            if low_precision.EMULATE_ON_CPU:  # tests: the spec's product emulated, the maths checked, never timed
                return True, ""
            return unsupported(f"{self.full_name} on the CPU: " + low_precision.CPU_REASON.format(dtype=problem.dtype))
        if not self.availability()[0]:
            return self.availability()
        import torch

        missing = low_precision.gpu_product_missing(torch)
        if missing:
            return unsupported(f"{self.full_name}: {missing}")
        return True, ""

    def versions(self) -> dict[str, str]:
        """numpy, torch, and the CUDA / cuDNN / oneDNN builds torch carries."""
        out = super().versions()
        if not self.availability()[0]:
            return out
        import torch

        cuda = torch.cuda.is_available()
        out["torch"] = torch.__version__
        out["torch_cuda"] = f"{torch.version.cuda} (device present: {cuda})" if torch.version.cuda else "none"
        cudnn = cuda and torch.backends.cudnn.is_available()
        out["torch_cudnn"] = str(torch.backends.cudnn.version()) if cudnn else "none"
        out["torch_mkldnn"] = str(torch.backends.mkldnn.is_available())
        out["tf32"] = "off (matmul and cuDNN; prepare() switches it off)"
        return out

    # -- the work -------------------------------------------------------------------
    def prepare(self, problem: Problem, params: dict[str, np.ndarray], device: str = "cpu", threads: int = 1) -> None:
        """Copy the shared parameters into torch tensors (module weights for fused)."""
        import torch

        self.close()
        torch.set_num_threads(threads)
        # The spec's tolerances assume IEEE float32 products; TF32 would miss them on GPUs.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        # Mixed precision: cuBLAS's low-precision products sum in float32 all the way (no split-K partial sums
        # kept in bfloat16 / float16), as the spec's product does.
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        self.problem = problem
        dev = torch.device("cuda" if device == "gpu" else "cpu")
        if self.variant == "fused":
            self._net = FusedNet(problem, params, dev)
        elif self.variant == "compile":
            self._net = CompiledNet(problem, params, dev)
        else:
            self._net = Net(problem, params, dev)

    def warm_up(self, batch) -> None:
        """One untimed pass (for compile: tracing and inductor code generation); no update."""
        x, y = batch
        if self.problem.workload == "forward":
            self._net.outputs(x)
        else:
            self._net.loss_and_grads(x, y, as_numpy=False)
        self.sync()

    def forward(self, x) -> np.ndarray:
        """Softmax probabilities or the mse head's output, (T, B, O)."""
        return self._net.outputs(x)

    def loss_and_grads(self, x, y):
        """Reported loss and the objective's gradients, keyed like the parameters."""
        return self._net.loss_and_grads(x, y, as_numpy=True)

    def sgd_step(self, x, y, lr: float) -> float:
        """Forward, BPTT and the in-place SGD update; the loss before the update."""
        return self._net.sgd_step(x, y, lr)

    def sync(self) -> None:
        """Wait for queued CUDA work."""
        if self._net is not None and self._net.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self._net.device)

    def get_params(self) -> dict[str, np.ndarray]:
        """Parameters in SPEC.md names and layouts."""
        return self._net.get_params()

    def close(self) -> None:
        """Drop the tensors (and modules)."""
        self._net = None

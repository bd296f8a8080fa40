"""The model, bptt and task settings of SPEC.md as validated dataclasses.

Everything here is plain Python (no pydantic, no pandas): worker processes,
including the ones in isolated environments on numpy 1.23, import this module.
Each ``from_mapping`` takes the same mapping a YAML config holds and raises
:class:`HarnessError` naming the key path and the offending value.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
from dataclasses import dataclass, field
from typing import Any, Mapping

from harness.spec.dtype import NAMES, REDUCED, DType
from harness.spec.errors import HarnessError

MODEL_KINDS = ("elman", "lstm", "gru")
#: gate blocks per cell: the width of its input and recurrent weights is GATES[kind] * H
GATES = {"elman": 1, "lstm": 4, "gru": 3}
ACTIVATIONS = ("tanh", "relu", "sigmoid")
HEADS = ("softmax_xent", "mse")
OUTPUT_ACTS = ("linear", "tanh")
TASK_KINDS = ("lm_markov", "lm_text", "sobel", "frame_diff", "random")
DTYPES = NAMES
#: the reduced-precision types (SPEC.md "Reduced precision"; harness.spec.dtype.DType.reduced)
REDUCED_DTYPES = REDUCED
#: bytes per number of each dtype (NumPy itself knows bfloat16 only through ml_dtypes)
DTYPE_BYTES = {d.value: d.n_bytes for d in DType}
#: the static loss scale of float16 steps (``train.loss_scale``)
DEFAULT_LOSS_SCALE = 1024.0
DEVICES = ("cpu", "gpu")
WORKLOADS = ("forward", "train_step", "train")


# Integers a config may hold: what every consumer (NumPy, Parquet, C++) can represent.
MAX_INT = 2**63 - 1

_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxlevel = 40, 40, 4, 4, 2
_SHORT.maxlong = 24


def master_dtype(dtype: str) -> str:
    """The dtype parameters, gradients, data and the element-wise maths are held in: float32 for the
    reduced-precision types (their master copy), else ``dtype`` itself."""
    return DType.of(dtype).master if isinstance(dtype, str) and dtype in NAMES else dtype


def objective_scale(dtype, loss_scale: float | None = None) -> float:
    """What a step multiplies its objective by before the backward pass and divides the gradients by
    after it: the static loss scale (``train.loss_scale``, default 1024) for float16, 1 otherwise."""
    if not DType.of(dtype).loss_scaled:
        return 1.0
    return DEFAULT_LOSS_SCALE if loss_scale is None else float(loss_scale)


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to a short prefix, so an error message never quotes a huge (or recursive) value whole."""
    text = _SHORT.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fail(where: str, expected: str, got: Any) -> HarnessError:
    return HarnessError(f"{where}: expected {expected}, got {short_repr(got)}")


def _check_keys(mapping: Mapping, allowed, where: str) -> None:
    if not isinstance(mapping, Mapping):
        raise _fail(where, "a mapping", mapping)
    unknown = sorted(set(mapping) - set(allowed))
    if unknown:
        key = unknown[0]
        path = f"{where}.{key}" if where else str(key)
        raise HarnessError(f"{path}: unknown key; valid keys are {', '.join(sorted(allowed))}")


def _pos_int(value: Any, where: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or value > MAX_INT:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise _fail(where, what, value)
    return value


def _choice(value: Any, choices, where: str) -> str:
    if value not in choices:
        raise _fail(where, "one of " + ", ".join(choices), value)
    return value


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(where, "true or false", value)
    return value


def _pos_float(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise _fail(where, "a finite positive number", value)
    return float(value)


def _key(default: Any, description: str, allowed: Any = None, minimum: int | None = None, factory=None):
    """A config key of ``model:`` or ``task:``: its default, and what the config reference
    (``docs/configs.md``, ``harness docs``) says of it."""
    meta = {"description": description, "allowed": allowed, "minimum": minimum, "default": default}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _minimum(cls, name: str) -> int:
    """The least value of an integer key of ``cls`` (its ``_key``'s ``minimum``)."""
    return cls.__dataclass_fields__[name].metadata["minimum"]


@dataclass(frozen=True)
class Bptt:
    """How far gradients flow back in time: ``full``, ``truncated`` K or ``tail`` K (SPEC.md)."""

    mode: str = "full"
    k: int | None = None

    @classmethod
    def from_value(cls, value: Any, where: str = "model.bptt") -> "Bptt":
        if isinstance(value, Bptt):
            return value
        if value is None or value == "full":
            return cls("full", None)
        if isinstance(value, Mapping) and len(value) == 1:
            (mode, k), = value.items()
            if mode in ("truncated", "tail"):
                return cls(mode, _pos_int(k, f"{where}.{mode}"))
        raise _fail(where, "'full', {truncated: K} or {tail: K}", value)

    def to_value(self):
        return "full" if self.mode == "full" else {self.mode: self.k}

    def __str__(self) -> str:
        return "full" if self.mode == "full" else f"{self.mode}:{self.k}"

    def effective(self, seq_len: int) -> "Bptt":
        """The same gradient for sequences of ``seq_len`` steps, as plainly as it can be said: a window as
        long as the sequence (truncated K >= T - 1, tail K >= T) is full BPTT."""
        if (self.mode == "truncated" and self.k >= seq_len - 1) or (self.mode == "tail" and self.k >= seq_len):
            return Bptt("full", None)
        return self


def layer_suffix(layer: int, direction: int = 0) -> str:
    """The suffix of layer ``layer``'s parameter names (SPEC.md): none for the first, ``_<layer>`` above it;
    the reverse direction (``direction`` 1) of a bidirectional layer adds ``_rev`` after it."""
    return ("" if layer == 0 else f"_{layer}") + ("_rev" if direction else "")


@dataclass(frozen=True)
class ModelSpec:
    """One recurrent network of SPEC.md: cell, size, head, gradient mode and update options."""

    kind: str = _key("elman", "the recurrent cell", MODEL_KINDS)
    hidden: int = _key(100, "hidden units per layer and direction", minimum=1)
    activation: str = _key("tanh", "elman's activation (lstm and gru have fixed ones)", ACTIVATIONS)
    bias: bool = _key(True, "biases in every layer and the head")
    head: str = _key("softmax_xent", "softmax cross-entropy over tokens, or mean squared error", HEADS)
    output_act: str = _key("linear", "mse only: the output activation (softmax_xent needs linear)", OUTPUT_ACTS)
    bptt: Bptt = _key("full", "how far gradients flow back: WildML's per-output truncation, or Theano's "
                      "truncate_gradient (tail)", ("full", "{truncated: K}", "{tail: K}"), factory=Bptt)
    layers: int = _key(1, "stacked layers", minimum=1)
    peephole: bool = _key(False, "lstm only: peephole connections")
    clip: float | None = _key(None, "clip every gradient element to [-clip, clip] before the update (unset: no clipping)",
                              "a positive number")
    # gru only: r multiplies (h W_hh_n + b_hn), else h before the product
    reset_after: bool = _key(True, "gru only: true is cuDNN's and PyTorch's form, with the recurrent bias b_hn; "
                                   "false Cho et al.'s, as the WildML tutorial built it")
    bidirectional: bool = _key(False, "a reverse direction per layer (bptt full only)")

    @classmethod
    def from_mapping(cls, mapping: Any, where: str = "model") -> "ModelSpec":
        if isinstance(mapping, ModelSpec):
            return mapping
        names = [f.name for f in dataclasses.fields(cls)]
        _check_keys(mapping, names, where)
        m = dict(mapping)
        kind = _choice(m.get("kind", "elman"), MODEL_KINDS, f"{where}.kind")
        spec = cls(
            kind=kind,
            hidden=_pos_int(m.get("hidden", 100), f"{where}.hidden"),
            activation=_choice(m.get("activation", "tanh"), ACTIVATIONS, f"{where}.activation"),
            bias=_bool(m.get("bias", True), f"{where}.bias"),
            head=_choice(m.get("head", "softmax_xent"), HEADS, f"{where}.head"),
            output_act=_choice(m.get("output_act", "linear"), OUTPUT_ACTS, f"{where}.output_act"),
            bptt=Bptt.from_value(m.get("bptt", "full"), f"{where}.bptt"),
            layers=_pos_int(m.get("layers", 1), f"{where}.layers"),
            peephole=_bool(m.get("peephole", False), f"{where}.peephole"),
            clip=None if m.get("clip") is None else _pos_float(m["clip"], f"{where}.clip"),
            reset_after=_bool(m.get("reset_after", True), f"{where}.reset_after"),
            bidirectional=_bool(m.get("bidirectional", False), f"{where}.bidirectional"),
        )
        if kind != "elman" and "activation" in m and m["activation"] != "tanh":
            raise HarnessError(f"{where}.activation: the {kind} cell has fixed activations; drop the key")
        if kind != "gru" and not spec.reset_after:
            raise HarnessError(f"{where}.reset_after: reset_after exists only for kind gru")
        if spec.bidirectional and spec.bptt.mode != "full":
            raise HarnessError(f"{where}.bptt: bidirectional layers need bptt full (truncated and tail gradients "
                               f"run along one direction of time), got {spec.bptt}")
        if kind != "lstm" and spec.peephole:
            raise HarnessError(f"{where}.peephole: peepholes exist only for kind lstm")
        if spec.head == "softmax_xent" and spec.output_act != "linear":
            raise HarnessError(f"{where}.output_act: the softmax_xent head needs output_act linear")
        return spec

    def to_mapping(self) -> dict:
        d = dataclasses.asdict(self)
        d["bptt"] = self.bptt.to_value()
        return d

    @property
    def gates(self) -> int:
        """Gate blocks of the cell (1, 4 or 3): its input and recurrent weights have ``gates * H`` columns."""
        return GATES[self.kind]

    @property
    def directions(self) -> int:
        """Directions per layer: 2 when bidirectional (the reverse one's names end in ``_rev``), else 1."""
        return 2 if self.bidirectional else 1

    @property
    def input_weight(self) -> str:
        """The input weights' name stem: ``W_xh`` (elman) or ``W_ih`` (lstm, gru)."""
        return "W_xh" if self.kind == "elman" else "W_ih"

    @property
    def bias_name(self) -> str:
        """The gate bias's name stem: ``b_h`` (elman) or ``b`` (lstm, gru)."""
        return "b_h" if self.kind == "elman" else "b"

    def layer_shapes(self, layer: int, input_size: int) -> dict[str, tuple[int, ...]]:
        """Names and shapes of layer ``layer``'s parameters, both directions, in canonical order (SPEC.md):
        per direction the input weights, ``W_hh``, the bias, then ``b_hn`` (gru, reset after) or the
        peepholes (lstm). Layer 0 reads ``input_size`` features, a layer above reads ``directions * H``."""
        H, G = self.hidden, self.gates * self.hidden
        din = input_size if layer == 0 else self.directions * H
        shapes: dict[str, tuple[int, ...]] = {}
        for direction in range(self.directions):
            s = layer_suffix(layer, direction)
            shapes[self.input_weight + s], shapes["W_hh" + s] = (din, G), (H, G)
            if self.bias:
                shapes[self.bias_name + s] = (G,)
                if self.kind == "gru" and self.reset_after:
                    shapes["b_hn" + s] = (H,)
            if self.peephole:
                shapes.update({p + s: (H,) for p in ("p_i", "p_f", "p_o")})
        return shapes

    def head_shapes(self, output_size: int) -> dict[str, tuple[int, ...]]:
        """The output layer's parameters: ``W_hy`` reads the top layer's ``directions * H`` outputs."""
        return {"W_hy": (self.directions * self.hidden, output_size), **({"b_y": (output_size,)} if self.bias else {})}

    def param_shapes(self, input_size: int, output_size: int) -> dict[str, tuple[int, ...]]:
        """Every parameter's name and shape in the canonical order (also the order of initialisation)."""
        shapes: dict[str, tuple[int, ...]] = {}
        for layer in range(self.layers):
            shapes.update(self.layer_shapes(layer, input_size))
        shapes.update(self.head_shapes(output_size))
        return shapes

    def param_names(self) -> list[str]:
        """Parameter names in the canonical order (also the order of initialisation)."""
        return list(self.param_shapes(1, 1))

    def param_count(self, input_size: int, output_size: int, tokens: bool = False, matrices_only: bool = False) -> int:
        """How many numbers the parameters hold (a closed form: layers above the second are like it);
        ``matrices_only`` counts the weight matrices alone, ``tokens`` leaves out the first layer's input
        weights (a row gather, no product): what the FLOP count needs."""

        def size(layer: int) -> int:
            shapes = self.layer_shapes(layer, input_size).items()
            return sum(math.prod(shape) for name, shape in shapes if len(shape) == 2 or not matrices_only
                       if not (tokens and layer == 0 and name.startswith(self.input_weight)))

        head = sum(math.prod(shape) for shape in self.head_shapes(output_size).values()
                   if len(shape) == 2 or not matrices_only)
        return size(0) + (self.layers - 1) * (size(1) if self.layers > 1 else 0) + head

    def describe(self) -> str:
        parts = [self.kind, f"H={self.hidden}"]
        if self.layers > 1:
            parts.append(f"L={self.layers}")
        if self.bidirectional:
            parts.append("bidirectional")
        if self.kind == "elman":
            parts.append(self.activation)
        if self.kind == "gru" and not self.reset_after:
            parts.append("reset_before")
        if self.peephole:
            parts.append("peephole")
        parts += [self.head if self.output_act == "linear" else f"{self.head}/{self.output_act}", str(self.bptt)]
        if not self.bias:
            parts.append("nobias")
        return " ".join(parts)


@dataclass(frozen=True)
class TaskSpec:
    """Where the data comes from (SPEC.md "Tasks"); sizes not used by a kind are ignored."""

    kind: str = _key("random", "lm_markov: a random sparse Markov chain with a known loss floor; lm_text: a text "
                               "file; sobel, frame_diff: images, video; random: random inputs", TASK_KINDS)
    seq_len: int = _key(20, "time steps per sequence (T)", minimum=1)
    n_sequences: int = _key(256, "training sequences", minimum=1)
    vocab: int | None = _key(None, "lm_markov, lm_text (required), random: tokens in the vocabulary", minimum=3)
    input_size: int | None = _key(None, "random: dense input features (unset: token inputs of size vocab)", minimum=1)
    output_size: int | None = _key(None, "random: outputs (unset: input_size, or vocab)", minimum=1)
    path: str | None = _key(None, "lm_text: the text file, relative to the config's folder, read up to 1 GB; sample: "
                                  "the small text in harness/spec/texts/", "a file path")
    width: int = _key(32, "sobel: pixels per row (the sequence); frame_diff: frame side", minimum=3)
    height: int = _key(32, "sobel: rows per image; frame_diff: frame side", minimum=1)
    n_eval: int = _key(64, "sequences held out for the evaluation loss", minimum=1)
    branching: int = _key(8, "lm_markov: successors per token", minimum=1)

    @classmethod
    def from_mapping(cls, mapping: Any, where: str = "task") -> "TaskSpec":
        if isinstance(mapping, TaskSpec):
            return mapping
        names = [f.name for f in dataclasses.fields(cls)]
        _check_keys(mapping, names, where)
        m = dict(mapping)
        kind = _choice(m.get("kind", "random"), TASK_KINDS, f"{where}.kind")
        opt_int = lambda key, minimum=1: None if m.get(key) is None else _pos_int(m[key], f"{where}.{key}", minimum)  # noqa: E731
        spec = cls(
            kind=kind,
            seq_len=_pos_int(m.get("seq_len", 20), f"{where}.seq_len"),
            n_sequences=_pos_int(m.get("n_sequences", 256), f"{where}.n_sequences"),
            vocab=opt_int("vocab", _minimum(cls, "vocab")),
            input_size=opt_int("input_size"),
            output_size=opt_int("output_size"),
            path=m.get("path"),
            width=_pos_int(m.get("width", 32), f"{where}.width", _minimum(cls, "width")),
            height=_pos_int(m.get("height", 32), f"{where}.height"),
            n_eval=_pos_int(m.get("n_eval", 64), f"{where}.n_eval"),
            branching=_pos_int(m.get("branching", 8), f"{where}.branching"),
        )
        if kind in ("lm_markov", "lm_text") and spec.vocab is None:
            raise HarnessError(f"{where}.vocab: expected a positive integer for task {kind}, got None")
        if kind == "lm_text" and not spec.path:
            raise HarnessError(f"{where}.path: task lm_text needs the path of a text file")
        if kind == "random" and spec.input_size is None and spec.vocab is None:
            raise HarnessError(f"{where}.input_size: task random needs input_size (dense) or vocab (tokens)")
        if spec.path is not None and (not isinstance(spec.path, str) or not spec.path or "\0" in spec.path):
            raise _fail(f"{where}.path", "a file path", spec.path)
        return spec

    def to_mapping(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def tokens(self) -> bool:
        """True when the inputs are token ids (row gathers), False for dense float inputs."""
        if self.kind in ("lm_markov", "lm_text"):
            return True
        if self.kind == "random":
            return self.input_size is None
        return False

    def sizes(self) -> tuple[int, int]:
        """``(input_size, output_size)`` of the data this task makes."""
        if self.kind in ("lm_markov", "lm_text"):
            return self.vocab, self.vocab
        if self.kind == "sobel":
            return 1, 1
        if self.kind == "frame_diff":
            return self.width * self.height, self.width * self.height
        if self.input_size is None:  # random tokens
            return self.vocab, self.output_size or self.vocab
        return self.input_size, self.output_size or self.input_size


@dataclass(frozen=True)
class Problem:
    """Everything a backend needs to know to decide support and build its step."""

    model: ModelSpec
    input_size: int
    output_size: int
    tokens: bool
    dtype: DType = DType.FLOAT64  # a name is taken too, and held as its member
    batch: int = 1
    seq_len: int = 20
    device: str = "cpu"
    workload: str = "train_step"
    loss_scale: float | None = None  # float16 only (None: DEFAULT_LOSS_SCALE); see objective_scale

    def __post_init__(self):
        _choice(self.dtype, DTYPES, "dtype")
        object.__setattr__(self, "dtype", DType.of(self.dtype))
        _choice(self.device, DEVICES, "device")
        _choice(self.workload, WORKLOADS, "workload")
        if self.loss_scale is not None:
            _pos_float(self.loss_scale, "train.loss_scale")

    @property
    def reduced(self) -> bool:
        """True for bfloat16 and float16: mixed precision (SPEC.md "Reduced precision")."""
        return self.dtype.reduced

    @property
    def master_dtype(self) -> DType:
        """The dtype of the parameters, gradients, data and state (float32 under mixed precision)."""
        return self.dtype.master

    @property
    def objective_scale(self) -> float:
        """What the objective is multiplied by before the backward pass (and the gradients divided by
        after it): ``loss_scale`` for float16, 1 for every other dtype."""
        return objective_scale(self.dtype, self.loss_scale)

    def to_mapping(self) -> dict:
        d = dataclasses.asdict(self)
        d["model"] = self.model.to_mapping()
        return d

    @classmethod
    def from_mapping(cls, mapping: Mapping) -> "Problem":
        d = dict(mapping)
        d["model"] = ModelSpec.from_mapping(d["model"])
        return cls(**d)

    def cast_inputs(self, x, ids=None):
        """``x`` (T, B[, D]) as a step reads it, C-contiguous: token ids (as ``ids``, or their own integer
        dtype when None), or dense rows in the problem's master dtype."""
        import numpy as np

        return np.ascontiguousarray(x, ids if self.tokens else self.master_dtype)

    def cast_targets(self, y, ids=None):
        """``y`` as a head reads it, C-contiguous: class ids for softmax_xent (as ``ids``, or their own
        integer dtype when None), target rows in the problem's master dtype for mse."""
        import numpy as np

        return np.ascontiguousarray(y, ids if self.model.head == "softmax_xent" else self.master_dtype)

    def flops_forward(self) -> float:
        """GEMM FLOPs of one forward pass over the whole batch and sequence (SPEC.md)."""
        # 2 FLOPs per multiply-add of every weight matrix, once per step and row (a token input's
        # first-layer product is a row gather): elman 2(DH + H^2 + HO), lstm 8(DH + H^2) + 2HO,
        # gru 6(DH + H^2) + 2HO; a reverse direction doubles the recurrent part and W_hy's rows
        per_step = 2 * self.model.param_count(self.input_size, self.output_size, self.tokens, matrices_only=True)
        return float(per_step) * self.batch * self.seq_len

    def flops(self, workload: str | None = None) -> float:
        w = workload or self.workload
        return self.flops_forward() * (1 if w == "forward" else 3)

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

from harness.spec.errors import HarnessError

MODEL_KINDS = ("elman", "lstm")
ACTIVATIONS = ("tanh", "relu", "sigmoid")
HEADS = ("softmax_xent", "mse")
OUTPUT_ACTS = ("linear", "tanh")
BPTT_MODES = ("full", "truncated", "tail")
TASK_KINDS = ("lm_markov", "lm_text", "sobel", "frame_diff", "random")
DTYPES = ("float32", "float64")
DEVICES = ("cpu", "gpu")
WORKLOADS = ("forward", "train_step", "train")


# Integers a config may hold: what every consumer (NumPy, Parquet, C++) can represent.
MAX_INT = 2**63 - 1

_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxlevel = 40, 40, 4, 4, 2
_SHORT.maxlong = 24


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


def layer_suffix(layer: int) -> str:
    """The suffix of layer ``layer``'s parameter names (SPEC.md): none for the first, ``_<layer>`` above it."""
    return "" if layer == 0 else f"_{layer}"


@dataclass(frozen=True)
class ModelSpec:
    """One recurrent network of SPEC.md: cell, size, head, gradient mode and update options."""

    kind: str = "elman"
    hidden: int = 100
    activation: str = "tanh"
    bias: bool = True
    head: str = "softmax_xent"
    output_act: str = "linear"
    bptt: Bptt = field(default_factory=Bptt)
    layers: int = 1
    peephole: bool = False
    clip: float | None = None

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
        )
        if kind == "lstm" and "activation" in m and m["activation"] != "tanh":
            raise HarnessError(f"{where}.activation: the lstm cell has fixed activations; drop the key")
        if kind == "elman" and spec.peephole:
            raise HarnessError(f"{where}.peephole: peepholes exist only for kind lstm")
        if spec.head == "softmax_xent" and spec.output_act != "linear":
            raise HarnessError(f"{where}.output_act: the softmax_xent head needs output_act linear")
        return spec

    def to_mapping(self) -> dict:
        d = dataclasses.asdict(self)
        d["bptt"] = self.bptt.to_value()
        return d

    def param_names(self) -> list[str]:
        """Parameter names in the canonical order (also the order of initialisation)."""
        names: list[str] = []
        for layer in range(self.layers):
            sfx = layer_suffix(layer)
            if self.kind == "elman":
                names += [f"W_xh{sfx}", f"W_hh{sfx}"] + ([f"b_h{sfx}"] if self.bias else [])
            else:
                names += [f"W_ih{sfx}", f"W_hh{sfx}"] + ([f"b{sfx}"] if self.bias else [])
                if self.peephole:
                    names += [f"p_i{sfx}", f"p_f{sfx}", f"p_o{sfx}"]
        names += ["W_hy"] + (["b_y"] if self.bias else [])
        return names

    def describe(self) -> str:
        parts = [self.kind, f"H={self.hidden}"]
        if self.layers > 1:
            parts.append(f"L={self.layers}")
        if self.kind == "elman":
            parts.append(self.activation)
        if self.peephole:
            parts.append("peephole")
        parts += [self.head if self.output_act == "linear" else f"{self.head}/{self.output_act}", str(self.bptt)]
        if not self.bias:
            parts.append("nobias")
        return " ".join(parts)


@dataclass(frozen=True)
class TaskSpec:
    """Where the data comes from (SPEC.md "Tasks"); sizes not used by a kind are ignored."""

    kind: str = "random"
    seq_len: int = 20
    n_sequences: int = 256
    vocab: int | None = None  # lm_markov, lm_text
    input_size: int | None = None  # random (None = token input of size vocab)
    output_size: int | None = None  # random
    path: str | None = None  # lm_text
    width: int = 32  # sobel: pixels per row (the sequence); frame_diff: frame side
    height: int = 32  # sobel: rows per image; frame_diff: frame side
    n_eval: int = 64  # sequences held out for the evaluation loss
    branching: int = 8  # lm_markov: successors per token

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
            vocab=opt_int("vocab", 3),
            input_size=opt_int("input_size"),
            output_size=opt_int("output_size"),
            path=m.get("path"),
            width=_pos_int(m.get("width", 32), f"{where}.width", 3),
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
    dtype: str = "float64"
    batch: int = 1
    seq_len: int = 20
    device: str = "cpu"
    workload: str = "train_step"

    def __post_init__(self):
        _choice(self.dtype, DTYPES, "dtype")
        _choice(self.device, DEVICES, "device")
        _choice(self.workload, WORKLOADS, "workload")

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
        dtype when None), or dense rows in the problem's dtype."""
        import numpy as np

        return np.ascontiguousarray(x, ids if self.tokens else self.dtype)

    def cast_targets(self, y, ids=None):
        """``y`` as a head reads it, C-contiguous: class ids for softmax_xent (as ``ids``, or their own
        integer dtype when None), target rows in the problem's dtype for mse."""
        import numpy as np

        return np.ascontiguousarray(y, ids if self.model.head == "softmax_xent" else self.dtype)

    def flops_forward(self) -> float:
        """GEMM FLOPs of one forward pass over the whole batch and sequence (SPEC.md)."""
        m, d, h, o = self.model, self.input_size, self.model.hidden, self.output_size
        per_layer = []
        for layer in range(m.layers):
            din = 0 if (layer == 0 and self.tokens) else (d if layer == 0 else h)
            per_layer.append((8 if m.kind == "lstm" else 2) * (din * h + h * h))
        per_step = sum(per_layer) + 2 * h * o
        return float(per_step) * self.batch * self.seq_len

    def flops(self, workload: str | None = None) -> float:
        w = workload or self.workload
        return self.flops_forward() * (1 if w == "forward" else 3)

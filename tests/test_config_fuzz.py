"""Malformed configs, generated: every one ends in exit 2 with one `error: FILE: ...` line, never a traceback.

Each example starts from a valid config and injects one to three faults, each of which alone makes the
config invalid: wrong types, missing and unknown keys, absurd sizes and infinities, unknown backends and
variants, bad sweeps, deep nesting, alias bombs and self-references, duplicate keys, undecodable bytes.
"""

import math
import os

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import harness.results.store
from harness.cli import app

BASE = {
    "name": "fuzz",
    "seed": 1,
    "model": {"kind": "elman", "hidden": 8},
    "task": {"kind": "random", "vocab": 20, "seq_len": 5, "n_sequences": 16, "n_eval": 8},
    "backends": ["ref"],
    "batch": [1, 2],
    "timing": {"warmup": 1, "min_rounds": 3, "min_time_s": 0.01, "max_time_s": 0.1, "timeout_s": 5},
    "train": {"lr": 0.01, "epochs": 1},
}
INF, NAN = math.inf, math.nan
HUGE = [2**63, 2**64, -(2**63) - 1, 10**30]
NOT_POS_INT = ["2", "yes", "", [True], True, False, None, 0, -1, 2.5, INF, NAN, {"a": 1}, [], [[1]]] + HUGE
NOT_NONNEG_INT = ["2", True, -1, 2.5, INF, NAN, None, [1], "0"] + HUGE
NOT_POS_FLOAT = ["1", "yes", True, 0, -1.0, INF, -INF, NAN, None, [1.0], {}]
NOT_BOOL = ["yes", "true", 1, 0, None, [True], "no"]
TYPED = {
    ("batch",): NOT_POS_INT, ("threads",): NOT_POS_INT + [5000], ("seed",): NOT_NONNEG_INT,
    ("timing", "warmup"): NOT_NONNEG_INT, ("timing", "min_rounds"): NOT_POS_INT + [2],
    ("timing", "timeout_s"): NOT_POS_FLOAT, ("timing", "max_time_s"): NOT_POS_FLOAT,
    ("timing", "min_time_s"): [x for x in NOT_POS_FLOAT if x != 0], ("timing", "verify"): NOT_BOOL,
    ("train", "lr"): NOT_POS_FLOAT, ("train", "epochs"): NOT_POS_INT, ("train", "halve_lr_on_rise"): NOT_BOOL,
    ("model", "hidden"): NOT_POS_INT, ("model", "layers"): NOT_POS_INT, ("model", "bias"): NOT_BOOL,
    ("model", "clip"): [x for x in NOT_POS_FLOAT if x is not None], ("model", "kind"): ["gru", "", 1, None, ["elman"]],
    ("task", "seq_len"): NOT_POS_INT, ("task", "n_sequences"): NOT_POS_INT, ("task", "kind"): ["image", None, 3],
    ("name",): ["../x", "/abs/x", "", "a/b", ".", "..", " x", "x" * 200, 5, None, [1], "a\0b", "a b"],
    ("description",): [5, None, ["x"], {"a": "b"}],
    ("env",): [{"A=B": "1"}, {"": "1"}, {"A": None}, {"A": 1}, {"A": [1]}, {"HARNESS_BACKENDS": "x"},
               {"PYTHONPATH": "/tmp"}, ["A"], "A=1", {"A\0": "x"}, {1: "x"}, {"A": "x\0y"}],
    ("dtype",): ["float16", 32, None, [], ["float32", "int8"]],
    ("device",): ["tpu", "", None, [], ["cpu", "tpu"], 1],
    ("workloads",): [[], ["backprop"], "train_step", [None], None],
}
ABSURD = {("model", "hidden"): 10**7, ("model", "layers"): 10**9, ("task", "seq_len"): 10**11,
          ("batch",): 10**11, ("task", "n_sequences"): 10**13, ("task", "vocab"): 10**12}
BAD_BACKENDS = [["nosuch"], ["ref:nosuch"], [""], [1], ["ref", "ref"], [], "ref,", None, [["ref"]]]
BAD_SWEEPS = [{"model.width": [1]}, {"model.hidden": []}, {" model.hidden": [4]}, {"model.hidden ": [4]},
              {"model.hidden,task.seq_len": [4, 8]}, {"model.hidden": [-1]}, {"model.hidden": "4"},
              {"optimizer.lr": [1]}, {"model.hidden": [4, "x"]}, {"train.lr": [INF]}, {"timing.timeout_s": [NAN]},
              {"model": [1]}, {"": [1]}, {"model.hidden": [2**63]}, [1, 2], "model.hidden"]
BOMB = "\n".join(["a: &a [x, x, x, x, x, x, x, x, x, x]"] +
                 [f"{c}: &{c} [{', '.join(['*' + p] * 10)}]" for p, c in zip("abcdefgh", "bcdefghi")]) + "\n"

counts = {"configs": 0, "faults": 0}


def _set(cfg: dict, path: tuple, value) -> None:
    node = cfg
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


@st.composite
def dict_fault(draw, cfg):
    kind = draw(st.sampled_from(["type", "missing", "unknown", "absurd", "backends", "sweep", "times"]))
    if kind == "type":
        path = draw(st.sampled_from(sorted(TYPED)))
        _set(cfg, path, draw(st.sampled_from(TYPED[path])))
    elif kind == "missing":
        cfg.pop(draw(st.sampled_from(["name", "backends"])), None)
    elif kind == "unknown":
        section = draw(st.sampled_from([(), ("model",), ("task",), ("timing",), ("train",)]))
        node = cfg
        for key in section:
            node = node.setdefault(key, {})
        key = draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in _valid_keys(section)))
        node[key] = draw(st.sampled_from([1, "x", None, [1]]))
    elif kind == "absurd":
        path = draw(st.sampled_from(sorted(ABSURD)))
        _set(cfg, path, ABSURD[path] * draw(st.integers(1, 1000)))
    elif kind == "backends":
        cfg["backends"] = draw(st.sampled_from(BAD_BACKENDS))
    elif kind == "sweep":
        cfg["sweep"] = draw(st.sampled_from(BAD_SWEEPS))
    else:  # a time limit below the minimum
        cfg.setdefault("timing", {}).update(min_time_s=2.0, max_time_s=1.0)
    return kind


def _valid_keys(section: tuple) -> set:
    from harness.run.config import SWEEPABLE, RawConfig

    return set(RawConfig.model_fields) | {"profiles"} if not section else SWEEPABLE[section[0]]


@st.composite
def text_fault(draw, text: str):
    kind = draw(st.sampled_from(["bomb", "self-alias", "nesting", "duplicate", "bytes", "control", "not-a-mapping",
                                 "bad-yaml"]))
    if kind == "bomb":
        key = draw(st.sampled_from(["batch", "name", "env: {X: ", "description", "profiles: {p: {batch: "]))
        tail = {"env: {X: ": "}", "profiles: {p: {batch: ": "}}"}.get(key, "")
        text = BOMB + text + (key if key.endswith(" ") else f"{key}: ") + "*i" + tail + "\n"
        if draw(st.booleans()):  # in a second document
            text = text.replace(BOMB, "") + "---\n" + BOMB + ("profiles: {big: {batch: *i}}\n")
    elif kind == "self-alias":
        text += draw(st.sampled_from(["description: &d [1, *d]\n", "sweep: &s {model.hidden: *s}\n"]))
    elif kind == "nesting":
        depth = draw(st.integers(41, 3000))
        text += draw(st.sampled_from(["description: ", "sweep: ", "env: "])) + "[" * depth + "]" * depth + "\n"
    elif kind == "duplicate":
        line = draw(st.sampled_from([ln for ln in text.splitlines() if ln and not ln[0].isspace()]))
        text += line + "\n"
    elif kind == "bytes":
        data = text.encode()
        at = draw(st.integers(0, len(data)))
        return kind, data[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xe9", b"\x80\x80"])) + data[at:]
    elif kind == "control":
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from(["\0", "\x07", "\x1b", "\ufffe"])) + text[at:]
    elif kind == "not-a-mapping":
        text = draw(st.sampled_from(["- a\n- b\n", "42\n", "just text\n", text + "---\n- 1\n", ""]))
    else:
        text += draw(st.sampled_from(["key: [unclosed\n", "a: b: c\n", "\t- tab\n", "{\n", "x: 'open\n"]))
    return kind, text.encode("utf-8", "surrogatepass")


# HARNESS_FUZZ_EXAMPLES=5000 for a longer search than the suite's
@settings(max_examples=int(os.environ.get("HARNESS_FUZZ_EXAMPLES", "250")), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_malformed_configs_exit_2_with_one_error_line(fake_backends, tmp_path, monkeypatch, data):
    import copy

    def accepted(*args, **kwargs):
        raise AssertionError("a malformed config was accepted")

    monkeypatch.setattr(harness.results.store.RunStore, "create", accepted)
    cfg = copy.deepcopy(BASE)
    n_dict = data.draw(st.integers(0, 3))
    n_text = data.draw(st.integers(0 if n_dict else 1, 1))
    kinds = [data.draw(dict_fault(cfg)) for _ in range(n_dict)]
    raw = yaml.safe_dump(cfg, allow_unicode=True).encode()
    if n_text:
        kind, raw = data.draw(text_fault(raw.decode("utf-8", "replace")))
        kinds.append(kind)
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(raw)
    result = CliRunner().invoke(app, ["run", str(path), "--out", str(tmp_path / "out"), "--no-plots"])
    counts["configs"] += 1
    counts["faults"] += len(kinds)
    output = " ".join(result.output.split())
    assert result.exit_code == 2, (kinds, raw[:300], output[:500], result.exception)
    assert output.startswith(f"error: {path}: "), (kinds, output[:500])
    assert "Traceback" not in result.output
    assert len(output) < 600, (kinds, output[:700])  # a short prefix of an offending value, never all of it


def test_zz_report_fuzz_figures():
    """Runs after the property test (file order) and prints what it tried."""
    if counts["configs"]:
        print(f"\nmalformed configs tried: {counts['configs']}, faults injected: {counts['faults']}")
        assert counts["faults"] >= counts["configs"]
    else:
        pytest.skip("the property test did not run in this session")

"""Malformed configs, generated: every one ends in exit 2 with one `error: FILE: ...` line, never a traceback.

Each example starts from a valid config and injects one to three faults, each of which alone makes the
config invalid: wrong types, missing and unknown keys, absurd sizes and infinities, unknown backends and
variants, bad sweeps, deep nesting, alias bombs and self-references, duplicate keys, undecodable bytes,
Rich markup in every string field and in the file's name, relative and special task paths, special and
oversized config files, values past the process limits.
"""

import math
import os
from pathlib import Path

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
    ("train", "lr"): NOT_POS_FLOAT, ("train", "loss_scale"): NOT_POS_FLOAT, ("train", "epochs"): NOT_POS_INT, ("train", "halve_lr_on_rise"): NOT_BOOL,
    ("model", "hidden"): NOT_POS_INT, ("model", "layers"): NOT_POS_INT, ("model", "bias"): NOT_BOOL,
    ("model", "clip"): [x for x in NOT_POS_FLOAT if x is not None], ("model", "kind"): ["gru", "", 1, None, ["elman"]],
    ("task", "seq_len"): NOT_POS_INT, ("task", "n_sequences"): NOT_POS_INT, ("task", "kind"): ["image", None, 3],
    ("name",): ["../x", "/abs/x", "", "a/b", ".", "..", " x", "x" * 200, 5, None, [1], "a\0b", "a b"],
    ("description",): [5, None, ["x"], {"a": "b"}],
    ("env",): [{"A=B": "1"}, {"": "1"}, {"A": None}, {"A": 1}, {"A": [1]}, {"HARNESS_BACKENDS": "x"},
               {"PYTHONPATH": "/tmp"}, ["A"], "A=1", {"A\0": "x"}, {1: "x"}, {"A": "x\0y"}],
    ("dtype",): ["float8", 32, None, [], ["float32", "int8"]],
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

# text the console would read as markup ([/] closes nothing: an error; [red] vanishes from the message)
MARKUP = ["[/]", "[red]", "[bold]x[/bold]", "[", "]", "[link=x]", "a[/]b", "\\[x]"]
# string fields, each with a way to make a markup value invalid there
MARKUP_FIELDS = {("name",): "{m}/x", ("backends",): ["{m}"], ("baseline",): "{m}", ("dtype",): "{m}",
                 ("device",): "{m}", ("workloads",): ["{m}"], ("model", "kind"): "{m}", ("task", "kind"): "{m}",
                 ("model", "activation"): "{m}", ("env",): {"{m}=": "1"}, ("sweep",): {"model.{m}": [1]},
                 ("task", "path"): "{m}/nowhere.txt", ("description",): ["{m}"], ("profiles",): "{m}"}
RELATIVE = ["corpus.txt", "../corpus.txt", "sub/corpus.txt", ".", "..", "~/no/such/corpus.txt", "./"]
SPECIAL = ["/dev/zero", "/dev/null", "/dev/urandom", "/", "/proc/self/mem", "fifo"]
CONFIG_NAMES = ["fuzz.yaml", "c[red]d.yaml", "a[/]b.yaml", "e[bold]f[/bold].yaml", "g]h[.yaml"]

counts = {"configs": 0, "faults": 0, "refused": 0, "tracebacks": 0}


def _markup(value, m: str):
    if isinstance(value, str):
        return value.replace("{m}", m)
    if isinstance(value, list):
        return [_markup(v, m) for v in value]
    if isinstance(value, dict):
        return {_markup(k, m): _markup(v, m) for k, v in value.items()}
    return value


def _set(cfg: dict, path: tuple, value) -> None:
    node = cfg
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


@st.composite
def dict_fault(draw, cfg):
    kind = draw(st.sampled_from(["type", "missing", "unknown", "absurd", "backends", "sweep", "times", "markup",
                                 "relative", "special", "huge"]))
    if kind == "markup":
        path = draw(st.sampled_from(sorted(MARKUP_FIELDS)))
        _set(cfg, path, _markup(MARKUP_FIELDS[path], draw(st.sampled_from(MARKUP))))
        if path == ("task", "path"):
            cfg["task"].update(kind="lm_text", vocab=20)
            cfg["model"]["head"] = "softmax_xent"
    elif kind in ("relative", "special"):  # a text file that is not there beside the config, or not a file
        cfg["task"].update(kind="lm_text", vocab=20, path=draw(st.sampled_from(RELATIVE if kind == "relative" else SPECIAL)))
        cfg["model"]["head"] = "softmax_xent"
    elif kind == "huge":
        what = draw(st.sampled_from(["env", "precision", "env-total", "loader", "threads-env", "zip-twice"]))
        if what == "env":
            cfg["env"] = {"BIG": "x" * draw(st.integers(128 * 1024, 300 * 1024))}
        elif what == "env-total":
            cfg["env"] = {f"V{i}": "x" * 100_000 for i in range(draw(st.integers(6, 9)))}
        elif what == "precision":
            cfg.setdefault("timing", {})["speedup_precision"] = draw(st.sampled_from([1e-300, 5e-324, 1e-12, 1e-100]))
        elif what == "loader":
            cfg["env"] = {draw(st.sampled_from(["LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "DYLD_INSERT_LIBRARIES",
                                                "GCONV_PATH"])): "/tmp/x.so"}
        elif what == "threads-env":
            cfg["env"] = {draw(st.sampled_from(["OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES"])): "2"}
        else:  # a key zipped with itself
            cfg["sweep"] = {"model.hidden,model.hidden": [[4, 8]]}
    elif kind == "type":
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
    from harness.config import SWEEPABLE, RawConfig

    return set(RawConfig.model_fields) | {"profiles"} if not section else SWEEPABLE[section[0]]


@st.composite
def text_fault(draw, text: str):
    kind = draw(st.sampled_from(["bomb", "self-alias", "nesting", "duplicate", "bytes", "control", "not-a-mapping",
                                 "bad-yaml", "yaml11", "oversized"]))
    if kind == "yaml11":  # octal and base-60 spellings YAML 1.1 reads as other numbers
        text += draw(st.sampled_from(["batch: 010\n", "threads: 0777\n", "batch: 1:30\n", "seed: -010\n",
                                      "timing: {max_time_s: 1:30.5}\n", "threads: 00\n"]))
    elif kind == "oversized":  # a file past the reader's cap (valid YAML all through)
        text += "description: '" + "x" * draw(st.integers(1 << 20, (1 << 20) + 5000)) + "'\n"
    elif kind == "bomb":
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
    fifo = tmp_path / "fifo"  # a task.path that would block its reader
    if not fifo.exists():
        os.mkfifo(fifo)
    (tmp_path / "corpus.txt").write_text("Some text. More text.\n" * 50)  # beside the cwd, not the config
    monkeypatch.chdir(tmp_path)  # where a relative path must not be looked up (the config's folder is fuzz/)
    path = tmp_path / "fuzz" / data.draw(st.sampled_from(CONFIG_NAMES))
    path.parent.mkdir(parents=True, exist_ok=True)
    special = data.draw(st.sampled_from([None] * 8 + ["/dev/zero", "/dev/urandom", "fifo", "folder"]))
    if special is None:
        path.write_bytes(raw)
    else:  # the config itself is no regular file: refused before anything is read from it
        kinds.append(f"config {special}")
        path = Path(special) if special.startswith("/") else tmp_path / f"cfg-{special}"
        if special == "fifo" and not path.exists():
            os.mkfifo(path)
        elif special == "folder":
            path.mkdir(exist_ok=True)
    result = CliRunner().invoke(app, ["run", str(path), "--out", str(tmp_path / "out"), "--no-plots"])
    counts["configs"] += 1
    counts["faults"] += len(kinds)
    output = " ".join(result.output.split())
    if "Traceback" in result.output or (result.exception is not None and not isinstance(result.exception, SystemExit)):
        counts["tracebacks"] += 1
    assert result.exit_code == 2, (kinds, raw[:300], output[:500], result.exception)
    assert output.startswith(f"error: {path}: "), (kinds, output[:500])
    assert "Traceback" not in result.output
    assert len(output) < 600, (kinds, output[:700])  # a short prefix of an offending value, never all of it
    counts["refused"] += 1


def test_zz_report_fuzz_figures():
    """Runs after the property test (file order) and prints what it tried."""
    if counts["configs"]:
        print(f"\nmalformed configs tried: {counts['configs']}, faults injected: {counts['faults']}, "
              f"refused with one line: {counts['refused']}, tracebacks: {counts['tracebacks']}")
        assert counts["tracebacks"] == 0
        assert counts["faults"] >= counts["configs"]
    else:
        pytest.skip("the property test did not run in this session")

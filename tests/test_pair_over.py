"""pair_over: the cells of one problem at several settings (dtype, threads) timed in one comparison
group, each with its ratio to the same backend at the first listed setting, from rounds in turn."""

import numpy as np
import pytest

import harness
from harness.config import load_config

PAIRED = """
name: paired
seed: 1
model: {kind: elman, hidden: 8}
task: {kind: random, input_size: 5, output_size: 3, seq_len: 6, n_sequences: 16, n_eval: 8}
workloads: [train_step]
batch: [2, 3]
dtype: [float64, float32]
threads: [1, 2]
pair_over: [dtype]
backends: [ref, 'ref:slow']
timing: {warmup: 1, min_rounds: 4, min_time_s: 0.05, max_time_s: 1, timeout_s: 30}
"""


def test_paired_settings_share_a_group_and_cell_ids_stay_those_of_one_problem(fake_backends, write_config):
    cfg = load_config(write_config(PAIRED))
    groups = cfg.groups()
    # batch x threads problems, each group holding both dtypes of both backends, the first dtype first
    assert len(groups) == 4 and all(len(g) == 4 for g in groups)
    for g in groups:
        assert [c.problem.dtype for c in g] == ["float64", "float64", "float32", "float32"]
        assert g[0].backend == "ref" and len({c.cell_id for c in g}) == 4 and len({c.group_key for c in g}) == 2
        assert {c.setting_baseline for c in g} == {"dtype=float64"}
    unpaired = load_config(write_config(PAIRED.replace("pair_over: [dtype]\n", ""), "plain.yaml"))
    assert len(unpaired.groups()) == 8
    assert {c.cell_id for c in unpaired.cells()} == {c.cell_id for c in cfg.cells()}
    both = load_config(write_config(PAIRED.replace("[dtype]", "[dtype, threads]"), "both.yaml"))
    assert len(both.groups()) == 2 and {c.setting_baseline for c in both.cells()} == {"dtype=float64,threads=1"}


def test_a_cell_key_is_fields_and_a_group_leaves_the_paired_ones_out(fake_backends, write_config):
    cfg = load_config(write_config(PAIRED.replace("[dtype]", "[dtype, threads]")))
    for g in cfg.groups():
        keys = {c.key for c in g}
        assert len(keys) == 4  # two dtypes x two thread counts, one problem
        assert {k.without("dtype", "threads") for k in keys} == {g[0].timing_key}
        assert {(k.dtype, k.threads) for k in keys} == {("float64", 1), ("float64", 2), ("float32", 1), ("float32", 2)}
        for c in g:  # the text is the key's, field by field, and the cell id adds the backend
            k = c.key
            assert c.group_key == k.text and c.cell_id == f"{k.text}|{c.backend}"
            assert k.text.startswith(f"train_step|cpu|{k.dtype}|") and f"|B={k.batch}|threads={k.threads}|" in k.text
        assert "|dtype=*|" in g[0].timing_key.text and "|threads=*|" in g[0].timing_key.text
    with pytest.raises(harness.HarnessError, match="no field"):
        cfg.cells()[0].key.without("colour")


@pytest.mark.parametrize("bad", ["[dtype, dtype]", "[batch]"])
def test_pair_over_takes_dtype_and_threads_once_each(fake_backends, write_config, bad):
    with pytest.raises(harness.HarnessError, match="pair_over"):
        load_config(write_config(PAIRED.replace("[dtype]", bad)))


def test_each_cell_gets_its_ratio_to_the_same_backend_at_the_first_setting(fake_backends, write_config, run_config):
    text = PAIRED.replace("batch: [2, 3]", "batch: [2]").replace("threads: [1, 2]", "threads: [1]")
    t = run_config(write_config(text)).timings
    t = t.set_index(t["backend"] + ":" + t["variant"] + ":" + t["dtype"])
    assert (t["status"] == "ok").all() and (t["setting_baseline"] == "dtype=float64").all()
    for name in ("ref:plain", "ref:slow"):
        first = t.loc[f"{name}:float64"]
        assert first["setting_speedup"] == first["setting_speedup_lo"] == first["setting_speedup_hi"] == 1.0
        other = t.loc[f"{name}:float32"]
        assert np.isfinite(other["setting_speedup"]) and other["setting_speedup_lo"] <= other["setting_speedup"] <= other["setting_speedup_hi"]
    # the baseline-backend speedups stay per dtype: ref at 1 in each, the slow variant below it
    for dtype in ("float64", "float32"):
        assert t.loc[f"ref:plain:{dtype}", "speedup"] == pytest.approx(1.0)
        assert t.loc[f"ref:slow:{dtype}", "speedup"] < 1
    # one group: the four cells took their rounds in turn
    assert len(set(t["n_samples"])) <= 2 and t["n_samples"].min() >= 4


def test_a_widely_disagreeing_interval_stays_above_zero():
    from harness.run.stats import paired_speedup

    rng = np.random.default_rng(0)
    base = np.concatenate([np.full(8, 0.1), np.full(8, 3.0)]) * (1 + 0.01 * rng.random(16))  # one block 30x slower
    other = np.concatenate([np.full(8, 0.1), np.full(8, 0.1)]) * (1 + 0.01 * rng.random(16))
    point, lo, hi = paired_speedup(base, other, blocks=[0] * 8 + [1] * 8)
    assert 0 < lo <= point <= hi


def test_tables_and_report_show_each_setting_with_its_paired_ratio(fake_backends, write_config, tmp_path, run_config):
    """The page's tables and the report split a paired group by setting (each backend once per dtype, not
    one cell written over the other) and give each later setting's ratio with its interval."""
    from harness import docs
    from harness.results.report import build_report, to_html, to_markdown

    text = PAIRED.replace("batch: [2, 3]", "batch: [2]").replace("threads: [1, 2]", "threads: [1]")
    run_config(write_config(text), tmp_path / "ex" / "paired")
    table = docs.render_table(docs.TableSpec.parse("speedups paired", 1, "page"), tmp_path / "ex")
    rows = [line for line in table[2:]]
    assert len(rows) == 2 and "float64" in rows[0] and "float32" in rows[1]  # one row per dtype
    assert all(line.count("|") == 4 for line in rows)  # problem, ref, ref:slow
    settings = docs.render_table(docs.TableSpec.parse("settings paired", 1, "page"), tmp_path / "ex")
    assert settings[0] == "| problem | backend | float64 ms | float32 ms | float32 speedup over float64 |"
    assert len(settings) == 4 and all(line.split("|")[5].strip().endswith("]") for line in settings[2:])

    title, blocks = build_report(tmp_path / "ex" / "paired")
    md = to_markdown(title, blocks, tmp_path)
    assert md.index("## Answer") < md.index("## Run")
    assert "over its dtype=float64 [95% CI]" in md
    assert md.count("### train_step") == 2  # the group's two dtypes, each its own block


def test_a_speedup_that_missed_its_target_is_marked_with_the_figures_on_hover(tmp_path):
    from harness.results.report import Hover, Image, MISSED_MARK, Table, fmt_speedup, to_html

    row = {"speedup": 1.5, "speedup_lo": 1.3, "speedup_hi": 1.71, "speedup_half_width": 0.14,
           "precision_met": False, "speedup_precision": 0.02}
    cell = fmt_speedup(row, mark=True)
    assert isinstance(cell, Hover) and cell.endswith(MISSED_MARK) and "wider than its ±2% target" in cell.title
    html = to_html("t", [Table(["speedup"], [[cell]])])
    assert 'title="interval ±14.0%, wider than its ±2% target"' in html
    assert fmt_speedup({**row, "precision_met": True}, mark=True) == "1.5x [1.3, 1.71]"
    from PIL import Image as PilImage

    PilImage.new("RGB", (1440, 720)).save(tmp_path / "p.png")
    page = to_html("t", [Image(tmp_path / "p.png", "a plot")])
    # shown at the size it was drawn (1440 px at 144 dpi: 10 inches, 960 CSS pixels), never scaled to the column;
    # a contents line at the top links to it
    assert 'width="960"' in page and 'href="#plot-p"' in page and 'id="plot-p"' in page

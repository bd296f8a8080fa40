"""The experiments page's generated tables, the report over several runs, one colour per backend."""

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from harness.cli import app
from harness import docs

ROOT = Path(__file__).resolve().parents[1]
PAGE, EXAMPLES = ROOT / "docs" / "experiments.md", ROOT / "results" / "examples"


def test_page_agrees_with_the_committed_runs():
    result = CliRunner().invoke(app, ["docs", "--check", "--page", str(PAGE), "--examples", str(EXAMPLES)])
    assert result.exit_code == 0, result.output


def test_a_hand_edited_number_fails_the_check_and_docs_restores_it(tmp_path):
    page = tmp_path / "experiments.md"
    text = PAGE.read_text()
    row = "| elman D=1 H=32 T=64 B=1 float32 | 1 (314 µs) | 0.23x [0.23, 0.23] |"
    assert row in text
    page.write_text(text.replace(row, row.replace("0.23x [0.23", "0.25x [0.23")))
    examples = tmp_path / "examples"  # docs writes: never into the checkout's committed runs
    shutil.copytree(EXAMPLES, examples)
    result = CliRunner().invoke(app, ["docs", "--check", "--page", str(page), "--examples", str(examples)])
    assert result.exit_code == 1
    assert "table 'speedups sobel' differs from its runs" in result.output
    result = CliRunner().invoke(app, ["docs", "--page", str(page), "--examples", str(examples)])
    assert result.exit_code == 0 and page.read_text() == text


def test_a_table_without_its_run_says_how_to_make_it(tmp_path):
    page = tmp_path / "p.md"
    shutil.copytree(EXAMPLES / "quick", tmp_path / "quick", ignore=shutil.ignore_patterns("plots", "report.*"))
    page.write_text("<!-- table: host quick -->\n<!-- /table -->\n"
                    "intro\n<!-- table: speedups lstm_gpu -->\n| old |\n<!-- /table -->\nafter\n")
    assert [s.text for s in docs.write_page(page, tmp_path)] == ["host quick", "speedups lstm_gpu"]
    assert "harness reproduce --only lstm_gpu" in page.read_text() and page.read_text().endswith("after\n")
    assert docs.check_page(page, tmp_path) == []
    page.write_text("<!-- table: speedups x -->\nno end\n")
    with pytest.raises(docs.HarnessError, match="no closing"):
        docs.check_page(page, tmp_path)


def _gpu_copy(tmp_path) -> Path:
    """The committed CPU run of lstm_cpu_gpu as if a GPU machine had run its GPU cells (3x faster than its CPU)."""
    gpu = tmp_path / "gpu-run"
    shutil.copytree(EXAMPLES / "lstm_cpu_gpu", gpu, ignore=shutil.ignore_patterns("plots", "report.*"))
    t = pd.read_parquet(gpu / "timings.parquet")
    cpu = t[t["device"] == "cpu"].set_index(["backend", "variant", "batch", "peephole"])["median_s"]
    g = (t["device"] == "gpu") & t["backend"].isin(["torch", "jax"])
    t.loc[g, "status"] = "ok"
    t.loc[g, "median_s"] = [cpu[(r.backend, r.variant, r.batch, r.peephole)] / 3 for r in t[g].itertuples()]
    t = t[(t["device"] == "gpu")]
    t.to_parquet(gpu / "timings.parquet")
    meta = json.loads((gpu / "run.json").read_text())
    meta["machine"] = {**meta["machine"], "hostname": "gpu-box", "cores": 16, "gpus": ["NVIDIA H100, 580, 80 GB"]}
    meta["run_id"] = "lstm-cpu-gpu-gpu"
    meta["cells"] = dict(zip(t["cell_id"], t["status"]))  # the cells this run holds, as a run's run.json records
    (gpu / "run.json").write_text(json.dumps(meta))
    return gpu


def test_report_over_runs_of_two_machines_draws_the_crossover_from_both(tmp_path):
    gpu = _gpu_copy(tmp_path)
    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["report", str(EXAMPLES / "lstm_cpu_gpu"), str(gpu), "--out", str(out)])
    assert result.exit_code == 0, result.output
    md = (out / "report.md").read_text()
    assert "| problem | run | machine | device | backend |" in md  # each side-by-side row names its run
    # the machine as a reader tells hosts apart, by stable facts (CPU, cores, the vector flags, the GPU; not
    # the GEMM peak a run measured), described once under a short key
    described = "gpu-box (Intel(R) Xeon(R) Processor, 16 cores, AVX-512 + AVX512-BF16 + AMX, NVIDIA H100)"
    assert f"| m2 | {described} |" in md and md.count(described) == 2  # its key's row, and the crossover's caption
    assert md.index("## Answer") < md.index("## Runs")
    assert (out / "plots" / "crossover.png").exists()
    assert "CPU cells from lstm-cpu-gpu-20261122-161700 (vm (" in md and "GPU cells from lstm-cpu-gpu-gpu (gpu-box" in md
    result = CliRunner().invoke(app, ["report", str(EXAMPLES / "lstm_cpu_gpu"), str(gpu)])
    assert result.exit_code == 2 and "needs --out" in result.output


def test_two_runs_of_one_machine_share_its_key_and_b_against_a_carries_its_interval(tmp_path):
    again = tmp_path / "again"
    shutil.copytree(EXAMPLES / "quick", again)
    meta = json.loads((again / "run.json").read_text())
    meta["run_id"] = "quick-again"
    meta["gemm_peak_gflops"] = {k: v * 1.6 for k, v in meta["gemm_peak_gflops"].items()}  # the same VM, a busier day
    (again / "run.json").write_text(json.dumps(meta))
    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["report", str(EXAMPLES / "quick"), str(again), "--out", str(out)])
    assert result.exit_code == 0, result.output
    md = (out / "report.md").read_text()
    runs = md.split("## Runs", 1)[1].split("## Cells by run", 1)[0]
    assert runs.count("| m1 |") == 3 and "m2" not in runs  # both runs on m1, described once
    assert runs.count("vm (AMD EPYC, 2 cores, AVX-512 + AVX512-BF16, no GPU)") == 1
    answer = md.split("## Answer", 1)[1].split("## Runs", 1)[0]
    # the 2 cells whose worker processes disagreed (unsteady) are counted apart, neither faster nor slower
    assert "| B against A | same machine | 19 | 1x | 0 | 0 | 17 | 2 |" in answer.replace("  ", " ")
    assert "Disturbed runs: A: 2 of 19 timed cells unsteady; B: 2 of 19 timed cells unsteady." in answer
    cells = md.split("## Cells by run", 1)[1]
    assert "B against A [95% CI]" in cells and "| 1x [" in cells  # the same rounds: 1x, with an interval around it
    assert (out / "plots" / "runs.png").exists()


def test_a_backend_has_one_colour_whatever_else_a_plot_shows():
    from harness.results.plots import _palette, backend_colour

    quick = ["numpy", "numpy:wildml", "torch", "torch:fused", "jax", "numba", "native"]
    assert _palette(None, quick)["torch"] == _palette(None, ["torch", "native"])["torch"] == backend_colour("torch")
    assert backend_colour("torch:autograd") == backend_colour("torch")  # its default variant
    assert len({backend_colour(l) for l in quick}) == len(quick)


def test_dask_local_says_before_the_run_which_workers_would_hold_its_threads(monkeypatch):
    from types import SimpleNamespace

    from harness.run import distributed

    monkeypatch.setattr(distributed, "_usable_cpus", lambda: 16)
    monkeypatch.setattr(distributed, "cpu_slices", lambda n: [[0]] * n)
    cells = [SimpleNamespace(threads=t) for t in (1, 2, 8)]
    distributed.DaskExecutor(n_workers=2).check_cells(cells)  # 8 cores each: fits
    with pytest.raises(distributed.HarnessError, match=r"--workers 4: each worker holds 4 of this machine's 16 cores, "
                                                       r"and cells of this run need 8 threads; --workers 2 would"):
        distributed.DaskExecutor(n_workers=4).check_cells(cells)
    with pytest.raises(distributed.HarnessError, match="no --workers would"):
        distributed.DaskExecutor(n_workers=1).check_cells([SimpleNamespace(threads=32)])


def test_an_ms_table_filters_on_results_columns_and_shows_milliseconds(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("<!-- table: ms sobel batch=1 -->\n<!-- /table -->\n")
    docs.write_page(page, EXAMPLES)
    timings = pd.read_parquet(EXAMPLES / "sobel" / "timings.parquet")
    kept = timings[(timings["batch"] == 1) & timings["workload"].isin(["forward", "train_step"])]
    table = [line for line in page.read_text().splitlines() if line.startswith("| ")]
    assert table[0].startswith("| problem |") and table[0].endswith(" ms |")
    assert len(table) - 1 == kept["group"].nunique() > 0  # a row per comparison group of batch 1 alone
    ok = kept[kept["status"] == "ok"].iloc[0]
    assert f"| {ok['median_s'] * 1e3:.3g} |" in page.read_text()
    page.write_text("<!-- table: ms sobel colour=red -->\n<!-- /table -->\n")
    with pytest.raises(docs.HarnessError, match="no results column 'colour'"):
        docs.write_page(page, EXAMPLES)


def test_a_group_label_tells_a_bidirectional_layer_and_the_reset_before_gru_apart():
    from harness.results.labels import group_label

    row = {"model": "lstm", "hidden_size": 512, "seq_len": 25, "batch": 32, "dtype": "float32", "input_size": 512,
           "threads": 2, "bidirectional": False, "reset_after": None}
    assert group_label(row) == "lstm D=512 H=512 T=25 B=32 float32 2 thr"
    assert group_label({**row, "bidirectional": True}).startswith("bilstm D=512")
    gru = {**row, "model": "gru", "reset_after": True}
    assert group_label(gru).startswith("gru D=512")
    assert group_label({**gru, "reset_after": False, "bidirectional": True}).startswith("bigru-before D=512")


def test_a_dtypes_table_sets_each_problem_and_backend_across_dtypes(tmp_path):
    """Timed steps: ms per dtype and the low type's time over float32's; training: final losses, their
    relative difference; a refused cell shows its status, a backend without float32 no ratio."""
    run = tmp_path / "mp"
    run.mkdir()
    base = {"group": "g", "variant": None, "model": "lstm", "hidden_size": 512, "input_size": 512, "seq_len": 25,
            "batch": 64, "threads": 2, "device": "cpu", "tokens": False, "bptt": "full", "layers": 1}
    rows = []
    for backend, f32, bf16 in (("numpy", 0.200, 0.300), ("jax", 0.100, 0.125), ("native", 0.080, None)):
        for dtype, median in (("float32", f32), ("bfloat16", bf16)):
            rows.append({**base, "cell_id": f"{backend}-{dtype}", "backend": backend, "dtype": dtype,
                         "workload": "train_step", "status": "ok" if median else "unsupported", "median_s": median,
                         "final_loss": None, "train_s": None})
    for backend, f32, bf16 in (("numpy", 4.000, 4.040), ("jax", 4.000, 3.980)):
        for dtype, loss in (("float32", f32), ("bfloat16", bf16)):
            rows.append({**base, "cell_id": f"t-{backend}-{dtype}", "backend": backend, "dtype": dtype,
                         "workload": "train", "status": "ok", "median_s": None, "final_loss": loss, "train_s": 2.0})
    pd.DataFrame(rows).to_parquet(run / "timings.parquet")
    pd.DataFrame({"cell_id": []}).to_parquet(run / "curves.parquet")
    (run / "run.json").write_text(json.dumps({"cells": {r["cell_id"]: r["status"] for r in rows}}))
    page = tmp_path / "p.md"
    page.write_text("<!-- table: dtypes mp workload=train_step -->\n<!-- /table -->\n"
                    "<!-- table: dtypes mp workload=train -->\n<!-- /table -->\n")
    docs.write_page(page, tmp_path)
    lines = [line for line in page.read_text().splitlines() if line.startswith("| ")]
    # bfloat16's speedup over float32, the one convention of the harness: float32's time over bfloat16's
    assert lines[0] == "| problem | backend | float32 ms | bfloat16 ms | bfloat16 speedup over float32 |"
    assert "| lstm D=512 H=512 T=25 B=64 2 thr | numpy | 200 | 300 | 0.67x |" in lines
    assert "| lstm D=512 H=512 T=25 B=64 2 thr | jax | 100 | 125 | 0.80x |" in lines
    assert "| lstm D=512 H=512 T=25 B=64 2 thr | native | 80 | unsupported | - |" in lines  # no cell left blank
    assert "| problem | backend | float32 final loss (train s) | bfloat16 final loss (train s) | bfloat16 loss vs float32 |" in lines
    assert "| lstm D=512 H=512 T=25 B=64 2 thr | numpy | 4.0000 (2.0 s) | 4.0400 (2.0 s) | +1.00% |" in lines
    assert "| lstm D=512 H=512 T=25 B=64 2 thr | jax | 4.0000 (2.0 s) | 3.9800 (2.0 s) | -0.50% |" in lines


def test_every_section_s_measured_text_names_only_what_its_runs_ran(tmp_path):
    """Each section's **Measured** text: every batch, thread count, size and backend it names is in the cells
    of the runs its tables read; a promise the run did not keep is found."""
    assert docs.promise_problems(PAGE, EXAMPLES) == []
    sections = docs._measured_texts(PAGE.read_text(encoding="utf-8").splitlines())
    assert len(sections) >= 14  # every section with a measured run, not only the GPU LSTM's
    # a batch sweep the run never made, a thread count it never used, a backend it never had: each is found
    text = PAGE.read_text(encoding="utf-8")
    broken = text.replace("**Measured** (`results/examples/inference`; input 128, T 32, one thread):",
                          "**Measured** (`results/examples/inference`; input 128, T 32, batches 1 to 256, four "
                          "threads, with `halide`):")
    assert broken != text
    page = tmp_path / "experiments.md"
    page.write_text(broken, encoding="utf-8")
    problems = docs.promise_problems(page, EXAMPLES)
    assert len(problems) == 3 and all("'Inference" in p for p in problems)
    assert any("batch 256" in p for p in problems) and any("threads 4" in p for p in problems)
    assert any("backend halide" in p for p in problems)
    # `harness docs --check` (what CI runs) fails on them, naming each
    result = CliRunner().invoke(app, ["docs", "--check", "--page", str(page), "--examples", str(EXAMPLES)],
                                terminal_width=200)
    assert result.exit_code == 2 and "names batch 256" in result.output and "names backend halide" in result.output
    # a figure the page shows that its run does not have
    page.write_text(text.replace("plots/speedup.png)", "plots/speedups.png)", 1), encoding="utf-8")
    assert [p.split(": ", 1)[1] for p in docs.promise_problems(page, EXAMPLES)] == [
        "the figure ../results/examples/quick/plots/speedups.png is not there"]


def test_a_page_with_one_long_line_is_checked_in_linear_time(tmp_path):
    """The figure pattern scans a line once: 200 KB of unclosed figure openings take milliseconds."""
    import time

    from harness.docs import promise_problems

    page = tmp_path / "page.md"
    page.write_text("# t\n\n" + "![" * 50_000 + "![x](" * 20_000 + "\n")
    began = time.perf_counter()
    promise_problems(page, tmp_path / "none")
    assert time.perf_counter() - began < 1.0


def test_a_machine_is_named_by_its_vector_units_amx_included():
    from harness.results.labels import machine_label

    def meta(flags):
        return {"machine": {"hostname": "vm", "cpu_model": "Xeon", "cores": 2, "cpu_flags": flags, "gpus": []}}

    assert machine_label(meta(["avx2", "avx512f", "avx512_bf16", "amx_tile"])) == \
        "vm (Xeon, 2 cores, AVX-512 + AVX512-BF16 + AMX, no GPU)"
    assert machine_label(meta(["avx2", "avx512f", "avx512_bf16"])) == "vm (Xeon, 2 cores, AVX-512 + AVX512-BF16, no GPU)"
    assert machine_label(meta(["avx2", "fma"])) == "vm (Xeon, 2 cores, AVX2, no GPU)"

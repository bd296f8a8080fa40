"""The README's run command, end to end, on the shipped default config (NumPy backends only)."""

import subprocess
import sys
from pathlib import Path

import pytest

import harness

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.heavy  # a whole shipped config, every pass (the runner end to end on tiny configs: test_runner.py)
def test_quick_config_produces_results_and_plots(tmp_path):
    out = tmp_path / "quick"
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "run", str(ROOT / "configs" / "quick.yaml"),
                           "--backends", "numpy,numpy:wildml", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = harness.load_run(out)
    for name in ("run.json", "timings.parquet", "curves.parquet", "plots/speedup.png",
                 "plots/loss_vs_time.png", "plots/scaling.png"):
        assert (out / name).exists(), name
    t = run.timings
    assert set(t["status"]) == {"ok", "unsupported"}  # wildml refuses batch 16 and the LSTM, with reasons
    wild = t[(t["variant"] == "wildml") & (t["status"] == "ok")]
    assert len(wild) == 1 and wild["speedup"].iloc[0] < 1  # the tutorial loop is slower than the vectorised step
    assert run.meta["conformance"]["numpy"]["mismatches"] == 0
    evals = run.curves[run.curves["split"] == "eval"]
    assert evals["loss"].iloc[-1] < evals["loss"].iloc[0] - 1
    assert "speedup over numpy" in proc.stdout

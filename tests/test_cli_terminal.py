"""The terminal: `harness list` (one line per backend, a reason shared by several backends printed once, the
devices of this machine only) and a typo in a command-line option blamed on the option, with a suggestion."""

from typer.testing import CliRunner

from harness.cli import app


def test_a_shared_reason_is_printed_once_and_absent_devices_are_not_listed(monkeypatch):
    import backends
    import harness.run.machine as machine

    why = "unavailable: no NVIDIA GPU here (a long explanation that would otherwise be repeated)"
    rows = [backends.Listing("cuda", v, "cuda", False, why, ("gpu", "cpu"), None) for v in ("graph", "naive", "fused")]
    rows.append(backends.Listing("numpy", "default", "numpy", True, "", ("cpu",), None))
    monkeypatch.setattr(backends, "list_backends", lambda: rows)
    monkeypatch.setattr(machine, "gpu_info", lambda: [])
    out = CliRunner().invoke(app, ["list"], terminal_width=200).output
    assert out.count("a long explanation") == 1 and out.count("as cuda") == 2
    assert "gpu" not in out.replace("no GPU here", "") and "no GPU here" in out
    monkeypatch.setattr(machine, "gpu_info", lambda: ["NVIDIA H100, 580.1, 81559 MiB"])
    out = CliRunner().invoke(app, ["list"], terminal_width=200).output
    assert "gpu,cpu" in out


def test_a_backend_typo_on_the_command_line_is_the_option_s_with_a_suggestion(tmp_path):
    result = CliRunner().invoke(app, ["run", "configs/quick.yaml", "--backends", "numpy,jaxx", "--out", str(tmp_path / "r")])
    assert result.exit_code == 2
    assert "--backends: unknown backend 'jaxx' (did you mean jax?)" in result.output
    assert "quick.yaml" not in result.output and not (tmp_path / "r").exists()


def test_help_shows_flags_as_flags():
    for command in (["run"], ["check"], ["reproduce"], ["docs"], ["env", "create"]):
        out = CliRunner().invoke(app, command + ["--help"], terminal_width=120).output
        flags = [line for line in out.splitlines() if "<bool>" in line and "--help" not in line]  # typer's own
        assert not flags, (command, flags)

"""Writes land only where they belong (harness.spec.writes): no command writes onto a device, FIFO or
folder, through a symbolic link, or into a run folder it was not given; archives carry no links and come
back through `harness unpack`; `harness docs` refuses an --examples folder without the page's runs; the
native@rev: build cache reads its marker as data."""

import io
import json
import os
import shutil
import sys
import tarfile
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from harness import reproduce as R
from harness.cli import app
from harness.spec.errors import HarnessError

EXAMPLES = Path(__file__).resolve().parents[1] / "results" / "examples"


def _error(result, code: int = 2) -> str:
    """The one ``error:`` line of a refusal (exit ``code``, no traceback)."""
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert not isinstance(result.exception, (AttributeError, OSError, UnicodeDecodeError))
    return lines[0]


@pytest.fixture
def run(tmp_path) -> Path:
    """A copy of the committed quick run, without its drawings."""
    folder = tmp_path / "quick"
    shutil.copytree(EXAMPLES / "quick", folder, ignore=shutil.ignore_patterns("plots", "report.*", ".lock"))
    return folder


def _snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# -- a write onto a device-like or foreign target ---------------------------------------------------
def test_a_fifo_or_a_folder_is_never_written_over(tmp_path):
    from harness.spec import writes

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(HarnessError, match="a FIFO, not a regular file"):
        writes.write_file(fifo, "x")
    assert fifo.is_fifo()  # os.replace would have put a regular file in its place
    (tmp_path / "folder").mkdir()
    with pytest.raises(HarnessError, match="expected a file, got a folder"):
        writes.write_file(tmp_path / "folder", "x")
    writes.write_file(tmp_path / "new.txt", "mine")
    assert (tmp_path / "new.txt").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "folder", "new.txt"]


def test_export_and_archive_refuse_a_fifo_a_run_s_file_and_an_unwritable_place(run, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    before = _snapshot(run)
    said = _error(CliRunner().invoke(app, ["export", str(run), "--out", str(fifo)]))
    assert "a FIFO, not a regular file" in said and fifo.is_fifo()
    said = _error(CliRunner().invoke(app, ["export", str(run), "--out", str(run / "run.json")]))
    assert f"inside the run folder {run}" in said
    # --archive: refused before any experiment is planned or run
    for target, says in ((fifo, "a FIFO"), (run / "run.json", "inside the run folder"),
                         (run / "timings.parquet", "inside the run folder"), (Path("/proc/a.tgz"), "cannot write in /proc")):
        said = _error(CliRunner().invoke(app, ["reproduce", "--only", "quick", "--out", str(tmp_path / "rr"),
                                               "--archive", str(target), "--dry-run"]))
        assert says in said, said
    assert _snapshot(run) == before and fifo.is_fifo() and not (tmp_path / "rr").exists()


def test_a_multi_run_report_inside_one_of_its_runs_is_refused(run, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(run, other)
    meta = json.loads((other / "run.json").read_text())
    (other / "run.json").write_text(json.dumps({**meta, "run_id": "other", "started": "2026-01-02T00:00:00"}))
    before = _snapshot(run)
    for out in (run, run / "sub"):
        said = _error(CliRunner().invoke(app, ["report", str(run), str(other), "--out", str(out)]))
        assert f"inside the run folder {run}" in said
    assert _snapshot(run) == before and not (run / "plots").exists()


def test_a_multi_run_report_marks_an_interrupted_run(run, tmp_path):
    from harness.results.multi import build_multi_report
    from harness.results.report import Para, Table

    other = tmp_path / "other"
    shutil.copytree(run, other)
    meta = json.loads((other / "run.json").read_text())
    (other / "run.json").write_text(json.dumps({**meta, "run_id": "other", "finished": None, "interrupted": True}))
    _, blocks, _ = build_multi_report([run, other])
    runs = next(b for b in blocks if isinstance(b, Table) and b.headers[-1] == "state")  # the runs table
    assert [row[-1] for row in runs.rows] == ["finished", "interrupted"]
    assert any(isinstance(b, Para) and "B (interrupted)" in b.text for b in blocks)


# -- a link in a run folder --------------------------------------------------------------------------
@pytest.mark.parametrize("link, command", [("report.md", "report"), ("plots/speedup.svg", "plot"),
                                           ("plots/speedup.png", "report"), (".lock", "report")])
def test_a_link_in_a_run_folder_is_refused_and_its_target_kept(run, tmp_path, link, command):
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("not the run's")
    (run / link).parent.mkdir(exist_ok=True)
    (run / link).symlink_to(elsewhere)
    if link == ".lock":  # the folder's lock is opened by a run, not by report: open it as a resume would
        from harness.results.store import FolderLock

        with pytest.raises(HarnessError, match="symbolic link"):
            FolderLock(run)
    else:
        said = _error(CliRunner().invoke(app, [command, str(run)]))
        assert "symbolic link" in said and str(elsewhere) in said
    assert elsewhere.read_text() == "not the run's" and (run / link).is_symlink()


def test_a_plots_folder_that_is_a_link_is_refused(run, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "plots").symlink_to(elsewhere)
    said = _error(CliRunner().invoke(app, ["plot", str(run)]))
    assert "symbolic link" in said and list(elsewhere.iterdir()) == []


# -- an archive with a link ---------------------------------------------------------------------------
def test_an_archive_holds_no_link_and_names_what_it_left_out(run, tmp_path):
    out = tmp_path / "rr"
    out.mkdir()
    shutil.move(str(run), out / "quick")
    (out / "quick" / "evil_link").symlink_to("/etc/passwd")
    shutil.copytree(out / "quick", tmp_path / "real-sobel", symlinks=True)
    (out / "sobel").symlink_to(tmp_path / "real-sobel")  # a run folder that is a link
    exps = [R.Experiment(Path("configs/quick.yaml")), R.Experiment(Path("configs/sobel.yaml"))]
    said = []
    assert R.archive(out, tmp_path / "runs.tgz", exps, note=said.append) == ["quick"]
    with tarfile.open(tmp_path / "runs.tgz") as tar:
        members = tar.getmembers()
    assert all(m.isfile() or m.isdir() for m in members)
    assert {m.name.split("/")[0] for m in members} == {"quick"}
    assert any("quick/evil_link: a symbolic link" in s for s in said)
    assert any(s.startswith("left out sobel: a symbolic link") for s in said)
    # and back through harness unpack: the run is checked, then replaces its folder whole
    into = tmp_path / "examples"
    shutil.copytree(out / "quick", into / "quick", symlinks=True, ignore=shutil.ignore_patterns("evil_link"))
    (into / "quick" / "plots").mkdir()
    (into / "quick" / "plots" / "stale.png").write_text("old")
    result = CliRunner().invoke(app, ["unpack", str(tmp_path / "runs.tgz"), "--into", str(into)])
    assert result.exit_code == 0, result.output
    assert (into / "quick" / "run.json").is_file() and not (into / "quick" / "plots").exists()
    assert not (into / "quick" / "evil_link").exists()


def _tgz(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return path


def _info(name: str, kind=tarfile.REGTYPE, target: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


@pytest.mark.parametrize("bad, says", [(_info("quick/evil", tarfile.SYMTYPE, "/etc/passwd"), "is a symbolic link"),
                                       (_info("quick/hard", tarfile.LNKTYPE, "quick/run.json"), "is a hard link"),
                                       (_info("/abs/run.json"), "an absolute path"),
                                       (_info("quick/../../escape"), "'..'"),
                                       (_info("quick/fifo", tarfile.FIFOTYPE), "not a regular file")])
def test_unpack_refuses_links_absolute_paths_and_dot_dot_and_writes_nothing(run, tmp_path, bad, says):
    archive = _tgz(tmp_path / "bad.tgz", [(_info("quick/run.json"), (run / "run.json").read_bytes()), (bad, b"")])
    into = tmp_path / "examples"
    into.mkdir()
    said = _error(CliRunner().invoke(app, ["unpack", str(archive), "--into", str(into)]))
    assert says in said
    assert list(into.iterdir()) == [] and not (tmp_path / "escape").exists()


# -- harness docs --examples at a missing folder; a page that is not UTF-8 ------------------------------
@pytest.mark.parametrize("examples", ["missing", "empty", "fifo", "other"])
def test_docs_refuses_examples_without_the_page_s_runs_and_leaves_the_page(tmp_path, examples):
    page = tmp_path / "experiments.md"
    shutil.copy(EXAMPLES.parents[1] / "docs" / "experiments.md", page)
    before = page.read_bytes()
    folder = tmp_path / examples
    if examples == "empty":
        folder.mkdir()
    elif examples == "fifo":
        os.mkfifo(folder)
    elif examples == "other":
        (folder / "not-a-page-run").mkdir(parents=True)
        (folder / "not-a-page-run" / "run.json").write_text("{}")
    for check in ([], ["--check"]):
        said = _error(CliRunner().invoke(app, ["docs", "--page", str(page), "--examples", str(folder)] + check))
        assert f"--examples {folder}" in said
    assert page.read_bytes() == before


def test_a_page_that_is_not_utf8_is_one_error_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_bytes(b"<!-- table: host quick -->\n\xff\xfe\n<!-- /table -->\n")
    said = _error(CliRunner().invoke(app, ["docs", "--page", str(page), "--examples", str(EXAMPLES), "--check"]))
    assert "not UTF-8" in said


# -- the native@rev: build cache ------------------------------------------------------------------------
COMMIT = "a" * 40


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """native_build with HARNESS_HOME in tmp_path and a fixed build key; the build folder of COMMIT."""
    from backends import native_build as nb

    monkeypatch.setenv("HARNESS_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(nb, "build_key", lambda: "k")
    return nb, nb.build_dir(COMMIT)


def test_a_malformed_marker_or_one_naming_a_module_elsewhere_is_no_build(cache, tmp_path):
    nb, folder = cache
    folder.mkdir(parents=True)
    (folder / "m.so").write_bytes(b"")
    elsewhere = tmp_path / "elsewhere.so"
    elsewhere.write_bytes(b"")
    for marker in ([], "text", {"commit": COMMIT, "module": str(elsewhere), "facts": {}},
                   {"commit": COMMIT, "module": str(folder / ".." / ".." / ".." / "elsewhere.so"), "facts": {}},
                   {"commit": COMMIT, "module": 5, "facts": {}}):
        (folder / nb.MARKER).write_text(json.dumps(marker))
        assert nb.built(COMMIT) is None, marker
    (folder / nb.MARKER).write_text(json.dumps({"commit": COMMIT, "module": str(folder / "m.so"), "facts": {}}))
    assert nb.built(COMMIT)["module"] == str(folder.resolve() / "m.so")


def _fake_build(nb, monkeypatch, probe_rc: int):
    """ensure() with its tools faked: cmake makes an empty module, the probe exits ``probe_rc``."""
    calls = []
    monkeypatch.setattr(nb, "can_build", lambda: (True, ""))
    monkeypatch.setitem(sys.modules, "nanobind", types.SimpleNamespace(cmake_dir=lambda: "/nowhere"))
    monkeypatch.setattr(nb, "extract", lambda commit, dest, root=None: calls.append("extract") or [])

    def run(cmd, stage, log):
        calls.append(stage)
        if stage == "cmake build":
            Path(cmd[2]).mkdir(parents=True, exist_ok=True)
            (Path(cmd[2]) / "_native.so").write_bytes(b"")

    monkeypatch.setattr(nb, "_run", run)
    err = "Traceback (most recent call last):\n  File x\nImportError: undefined symbol: foo\n"
    out = json.dumps({"kinds": ["elman"], "bidirectional": False, "bf16_gemm": False, "bf16_cpu": False, "build_info": {}})
    monkeypatch.setattr(nb.subprocess, "run", lambda *a, **k: types.SimpleNamespace(returncode=probe_rc, stderr=err, stdout=out))
    return calls


def test_a_malformed_marker_is_rebuilt(cache, monkeypatch):
    nb, folder = cache
    folder.mkdir(parents=True)
    (folder / nb.MARKER).write_text("[]")
    calls = _fake_build(nb, monkeypatch, probe_rc=0)
    record = nb.ensure(COMMIT)
    assert "cmake build" in calls and record["facts"]["kinds"] == ["elman"]
    assert nb.built(COMMIT)["commit"] == COMMIT


def test_an_engine_that_cannot_load_is_remembered_not_rebuilt(cache, monkeypatch):
    nb, folder = cache
    calls = _fake_build(nb, monkeypatch, probe_rc=1)
    with pytest.raises(HarnessError) as first:
        nb.ensure(COMMIT)
    assert "ImportError: undefined symbol: foo" in str(first.value) and "\n" not in str(first.value)
    assert "Traceback" not in str(first.value)
    n = len(calls)
    with pytest.raises(HarnessError, match="undefined symbol: foo"):
        nb.ensure(COMMIT)
    assert len(calls) == n  # not built again
    monkeypatch.setattr(nb, "harness_digest", lambda: "newer")  # a newer harness tries again
    with pytest.raises(HarnessError):
        nb.ensure(COMMIT)
    assert len(calls) > n


def test_a_build_folder_that_is_a_link_is_refused(cache, monkeypatch, tmp_path):
    nb, folder = cache
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    folder.parent.mkdir(parents=True)
    folder.symlink_to(elsewhere)
    _fake_build(nb, monkeypatch, probe_rc=0)
    with pytest.raises(HarnessError, match="symbolic link"):
        nb.ensure(COMMIT)
    assert list(elsewhere.iterdir()) == []


def test_a_revision_past_git_s_limits_is_refused_before_any_subprocess(monkeypatch):
    from backends import native_build as nb

    monkeypatch.setattr(nb.subprocess, "run", lambda *a, **k: pytest.fail("no subprocess for this revision"))
    for text in ("a" * 200_000, "a" * 5_000, "x/" + "b" * 300):
        with pytest.raises(HarnessError) as refused:
            nb.resolve(text)
        assert len(str(refused.value)) < 300 and "characters" in str(refused.value)


# -- pair_over over a setting with one value -------------------------------------------------------------
@pytest.mark.parametrize("setting", ["dtype: float32\npair_over: [dtype]", "threads: [1]\npair_over: [threads]"])
def test_pair_over_a_single_value_is_refused(write_config, setting):
    from harness.config import load_config

    path = write_config("name: t\nmodel: {kind: elman, hidden: 4}\ntask: {kind: random, input_size: 4, seq_len: 3}\n"
                        f"backends: [numpy]\n{setting}\n")
    with pytest.raises(HarnessError, match="pair_over: .* has the one value"):
        load_config(path)


# -- harness run --out at another run, or at a link into one ----------------------------------------------
def _names(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


def test_run_out_a_link_into_another_run_is_refused_before_any_lock(run, tmp_path):
    (run / "sub").mkdir()
    link = tmp_path / "link"
    link.symlink_to(run / "sub")
    before = _names(run)
    said = _error(CliRunner().invoke(app, ["run", "quick", "--out", str(link)]))
    assert f"inside the run folder {run}" in said
    assert _names(run) == before and not (run / "sub" / ".lock").exists()


def test_run_out_at_an_existing_run_is_refused_and_leaves_no_lock(run):
    before = _names(run)
    said = _error(CliRunner().invoke(app, ["run", "quick", "--out", str(run)]))
    assert "a run already exists there" in said
    assert _names(run) == before and not (run / ".lock").exists()


# -- a folder swapped for a link while a file is written -----------------------------------------------------
@pytest.fixture
def two_runs(run, tmp_path):
    """RUN (being written) and OTHER, another run whose plots must never change."""
    other = tmp_path / "other"
    shutil.copytree(run, other)
    for folder in (run, other):
        (folder / "plots").mkdir()
        (folder / "plots" / "speedup.png").write_bytes(b"drawn by " + folder.name.encode())
    return run, other


def _swap_plots(run: Path, other: Path, n: int) -> None:
    """RUN/plots renamed away and a link RUN/plots -> OTHER/plots put in its place."""
    os.rename(run / "plots", run / f"plots.away-{n}")
    (run / "plots").symlink_to(other / "plots")


def _restore_plots(run: Path) -> None:
    if (run / "plots").is_symlink():
        (run / "plots").unlink()
    for away in sorted(run.glob("plots.away-*")):
        if not (run / "plots").exists():
            os.rename(away, run / "plots")
        else:
            shutil.rmtree(away)


@pytest.mark.parametrize("how", ["bytes", "writer"])
def test_a_folder_swapped_while_its_file_is_written_sends_nothing_elsewhere(two_runs, how):
    from harness.spec import writes

    run, other = two_runs
    before = _snapshot(other)

    def writer(tmp):
        _swap_plots(run, other, 0)  # the worst moment: the temporary file exists, nothing is written yet
        Path(tmp).write_bytes(b"new")

    with pytest.raises(HarnessError, match="was moved or replaced while the file was written"):
        if how == "writer":
            writes.write_file(run / "plots" / "speedup.png", writer, run=run)
        else:
            real = writes._new_temp

            def new_temp(dfd, target):  # swapped as the temporary file appears
                made = real(dfd, target)
                _swap_plots(run, other, 0)
                return made

            writes._new_temp, saved = new_temp, real
            try:
                writes.write_file(run / "plots" / "speedup.png", b"new", run=run)
            finally:
                writes._new_temp = saved
    assert _snapshot(other) == before and sorted(os.listdir(other / "plots")) == ["speedup.png"]
    # the link in place before the write starts: refused (a link, into another run)
    with pytest.raises(HarnessError, match="symbolic link|inside the run folder"):
        writes.write_file(run / "plots" / "speedup.png", b"new", run=run)
    assert _snapshot(other) == before


def test_a_watcher_swapping_plots_for_a_link_200_times_never_writes_into_the_other_run(two_runs):
    import threading
    import time

    from harness.spec import writes

    run, other = two_runs
    before = _snapshot(other)
    stop, swapped = threading.Event(), []

    def watch():
        n = 0
        while not stop.is_set():
            try:
                if not (run / "plots").is_symlink() and any(e.endswith(".tmp") for e in os.listdir(run / "plots")):
                    n += 1
                    _swap_plots(run, other, n)
                    swapped.append(n)
            except OSError:
                pass

    def writer(tmp):
        time.sleep(0.002)
        Path(tmp).write_bytes(b"new")

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        for k in range(200):
            try:
                writes.write_file(run / "plots" / "speedup.png", writer if k % 2 else b"new", run=run)
            except HarnessError:
                pass
            stop.set() if k == 199 else None
            while (run / "plots").is_symlink() is False and not (run / "plots").exists():
                time.sleep(0.001)
            _restore_plots(run)
    finally:
        stop.set()
        watcher.join(5)
    _restore_plots(run)
    assert swapped, "the watcher never saw a temporary file"
    assert _snapshot(other) == before and sorted(os.listdir(other / "plots")) == ["speedup.png"]


def test_temporary_files_a_killed_write_left_are_removed_by_the_next_write_there(run):
    import fcntl

    from harness.spec import writes

    plots = run / "plots"
    plots.mkdir()
    stale, fresh, held = (plots / f".speedup.png.{k}.tmp" for k in ("abcd1234", "efgh5678", "ijkl9012"))
    for f in (stale, fresh, held):
        f.write_bytes(b"half a png")
    for f in (stale, held):
        os.utime(f, (1_000_000_000, 1_000_000_000))
    os.mkfifo(plots / ".scaling.png.mnop3456.tmp")
    with open(held, "rb") as holder:  # a write still under way holds its temporary file
        fcntl.flock(holder, fcntl.LOCK_EX)
        writes.write_file(plots / "plots.json", "{}", run=run)
    assert sorted(os.listdir(plots)) == sorted([fresh.name, held.name, ".scaling.png.mnop3456.tmp", "plots.json"])

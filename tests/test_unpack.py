"""`harness unpack` puts a run only where nothing is or over a run folder: a user's folder or file of a run's
name is refused and kept; the archive is a regular file read in chunks with a size cap; duplicate members are
refused; no staging folder outlives a refusal; --into is checked as an output folder."""

import io
import json
import os
import shutil
import stat
import tarfile
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from harness import reproduce as R
from harness.cli import app

EXAMPLES = Path(__file__).resolve().parents[1] / "results" / "examples"


def _error(result, code: int = 2) -> str:
    """The one ``error:`` line of a refusal (exit ``code``, no traceback)."""
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


def _unpack(archive, into):
    return CliRunner().invoke(app, ["unpack", str(archive), "--into", str(into)])


@pytest.fixture
def run(tmp_path) -> Path:
    """A copy of the committed quick run, without its drawings."""
    folder = tmp_path / "src" / "quick"
    shutil.copytree(EXAMPLES / "quick", folder, ignore=shutil.ignore_patterns("plots", "report.*", ".lock"))
    return folder


def _archive(path: Path, folders: dict[str, Path], extra: list[tuple[str, bytes]] = ()) -> Path:
    """A .tgz holding each folder under its name, then ``extra`` members (name, data)."""
    with tarfile.open(path, "w:gz") as tar:
        for name, folder in folders.items():
            tar.add(folder, arcname=name)
        for name, data in extra:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def good(run, tmp_path) -> Path:
    return _archive(tmp_path / "good.tgz", {"quick": run})


@pytest.fixture
def into(tmp_path) -> Path:
    folder = tmp_path / "into"
    folder.mkdir()
    return folder


def _left(into: Path) -> list[str]:
    return sorted(os.listdir(into))


# -- where a run may go -------------------------------------------------------------------------------------
def test_a_user_s_folder_of_a_run_s_name_survives_and_is_named(good, into):
    (into / "quick").mkdir()
    (into / "quick" / "mynotes.txt").write_text("mine")
    said = _error(_unpack(good, into))
    assert f"{into / 'quick'} is a folder that is not a run" in said
    assert (into / "quick" / "mynotes.txt").read_text() == "mine" and _left(into) == ["quick"]


def test_a_folder_holding_a_fifo_or_a_file_of_a_run_s_name_is_refused(good, into):
    (into / "quick").mkdir()
    os.mkfifo(into / "quick" / "pipe")
    assert "is a folder that is not a run" in _error(_unpack(good, into))
    assert (into / "quick" / "pipe").is_fifo()
    shutil.rmtree(into / "quick")
    (into / "quick").write_text("a user's file")
    assert f"{into / 'quick'} is a file, not a run folder" in _error(_unpack(good, into))
    assert (into / "quick").read_text() == "a user's file" and _left(into) == ["quick"]


def test_a_run_folder_holding_a_user_s_file_or_a_fifo_is_not_replaced(good, run, into):
    shutil.copytree(run, into / "quick")
    (into / "quick" / "notes.txt").write_text("mine")
    said = _error(_unpack(good, into))
    assert "holds notes.txt, which no run writes" in said and (into / "quick" / "notes.txt").read_text() == "mine"
    (into / "quick" / "notes.txt").unlink()
    (into / "quick" / "plots").mkdir()
    os.mkfifo(into / "quick" / "plots" / "pipe")
    assert "plots/pipe (a FIFO)" in _error(_unpack(good, into))
    assert (into / "quick" / "plots" / "pipe").is_fifo() and _left(into) == ["quick"]


def test_a_run_folder_is_replaced_whole_and_nothing_else_is_left(good, run, into):
    shutil.copytree(run, into / "quick")
    (into / "quick" / "plots").mkdir()
    (into / "quick" / "plots" / "stale.png").write_bytes(b"old")
    result = _unpack(good, into)
    assert result.exit_code == 0, result.output
    assert (into / "quick" / "run.json").is_file() and not (into / "quick" / "plots").exists()
    assert _left(into) == ["quick"]
    result = _unpack(good, into)  # and again, over the run it put there
    assert result.exit_code == 0, result.output and _left(into) == ["quick"]


def test_a_run_folder_a_run_is_writing_to_is_refused(good, run, into):
    from harness.results.store import FolderLock

    shutil.copytree(run, into / "quick")
    lock = FolderLock(into / "quick")
    try:
        assert "a run is writing to" in _error(_unpack(good, into))
    finally:
        lock.release()


# -- the archive --------------------------------------------------------------------------------------------
def test_a_fifo_as_the_archive_is_refused_without_a_read(tmp_path, into):
    fifo = tmp_path / "runs.tgz"
    os.mkfifo(fifo)
    box = {}
    worker = threading.Thread(target=lambda: box.setdefault("result", _unpack(fifo, into)), daemon=True)
    worker.start()
    worker.join(20)
    if worker.is_alive():  # let the blocked open go, then fail
        with open(fifo, "wb"):
            pass
        worker.join(5)
        pytest.fail("harness unpack waited on a FIFO")
    assert "a FIFO, not a regular file" in _error(box["result"]) and _left(into) == []


def test_a_character_device_as_the_archive_is_refused(tmp_path, into):
    node = tmp_path / "runs.tgz"  # a stand-in made under the test's own folder: the null device's numbers
    try:
        os.mknod(node, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    except (PermissionError, OSError) as exc:
        pytest.skip(f"cannot make a device node here ({exc})")
    assert "a character device, not a regular file" in _error(_unpack(node, into)) and _left(into) == []


def test_duplicate_members_are_refused(run, tmp_path, into):
    archive = _archive(tmp_path / "dup.tgz", {"quick": run}, [("quick/run.json", b"{}")])
    assert "'quick/run.json' appears twice" in _error(_unpack(archive, into))
    assert _left(into) == []


def test_a_member_past_the_cap_is_refused_before_it_is_written(run, tmp_path, into, monkeypatch):
    monkeypatch.setattr(R, "UNPACK_MEMBER_BYTES", 1 << 20)
    archive = _archive(tmp_path / "big.tgz", {"quick": run}, [("quick/zeros.bin", bytes(2 << 20))])
    said = _error(_unpack(archive, into))
    assert f"'quick/zeros.bin' holds {2 << 20} bytes, past the {1 << 20} bytes a member" in said and _left(into) == []


def test_members_are_streamed_in_chunks(good, into, monkeypatch):
    sizes = []
    real = tarfile.ExFileObject.read

    def read(self, size=-1):
        sizes.append(size)
        return real(self, size)

    monkeypatch.setattr(tarfile.ExFileObject, "read", read)
    result = _unpack(good, into)
    assert result.exit_code == 0, result.output
    assert sizes and all(0 < s <= 1 << 20 for s in sizes)


def test_no_staging_folder_outlives_a_refused_run(run, tmp_path, into):
    bad = tmp_path / "src" / "zzz"
    shutil.copytree(run, bad)
    (bad / "timings.parquet").write_bytes(b"not a table")
    archive = _archive(tmp_path / "two.tgz", {"aaa": run, "zzz": bad})
    _error(_unpack(archive, into))
    assert _left(into) == []


def test_into_missing_or_a_link_into_another_run_is_refused_naming_into(good, run, tmp_path):
    missing = tmp_path / "nowhere"
    said = _error(_unpack(good, missing))
    assert said.startswith(f"error: --into {missing}: no such folder") and not missing.exists()
    other = tmp_path / "other"
    shutil.copytree(run, other)
    (other / "sub").mkdir()
    link = tmp_path / "link"
    link.symlink_to(other / "sub")
    before = sorted(p.relative_to(other).as_posix() for p in other.rglob("*"))
    assert f"inside the run folder {other}" in _error(_unpack(good, link))
    assert sorted(p.relative_to(other).as_posix() for p in other.rglob("*")) == before


def test_a_run_without_run_json_is_no_run(run, tmp_path, into):
    archive = _archive(tmp_path / "x.tgz", {}, [("quick/timings.parquet", (run / "timings.parquet").read_bytes())])
    assert "no quick/run.json" in _error(_unpack(archive, into)) and _left(into) == []
    json.loads((run / "run.json").read_text())

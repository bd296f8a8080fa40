"""The one rule for every file the harness writes: run folders, plots, reports, archives, exports,
pages and build caches.

* A file is written beside its target (a temporary name in the same folder) and renamed into place,
  so a reader sees the old file or the new one, never half of one.
* Only onto an absent path or a regular file: never onto a device, a FIFO, a socket or a folder.
* Never through a symbolic link. A target that is a link is refused, with where it points: the link
  and the file it names are left as they are. (Replacing the link quietly would hide that the user
  put it there for a reason; following it would overwrite a file the command does not own.) A folder
  a command is given (``RUN_DIR``, ``--out DIR``, ``--examples DIR``) is taken as named, a link
  included; below it the harness follows no link: one found between that folder and a target is refused.
* Never into a run folder (a folder holding ``run.json`` and ``timings.parquet``) other than the one the command was given
  for that purpose: an export, archive, page or multi-run report whose path falls inside a run is refused.
* Output paths are checked (:func:`check_file`, :func:`check_folder`) before any work starts; each
  write checks its target again just before the rename.
* A write opens its target's folder once (walked from the folder it was given, no link followed) and
  makes the temporary file, the last check and the rename relative to that descriptor, checking that
  the path still leads to the same folder (device and inode) before the rename: a parent renamed or
  swapped for a link meanwhile cannot send the file elsewhere. Temporary files a killed write left
  are removed by the next write into that folder.

Only the standard library: the worker side and the backends write through this too.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import Callable, Union

from harness.spec.errors import HarnessError

#: what makes a folder a run folder: a run writes both with its first save (a lone run.json may be an export)
RUN_FILES = ("run.json", "timings.parquet")
#: what a refused target is told it may be instead
ALLOWED = "the harness writes only onto an absent path or a regular file"

Data = Union[str, bytes, Callable[[Path], None]]


def _cut(text, limit: int = 160) -> str:
    """``text`` as a message quotes it: its start and end, with its length, where it is long."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit // 2]}...{text[-limit // 4:]} ({len(text)} characters)"


def _name(path: Path, option: str | None) -> str:
    return f"{option} {_cut(path)}" if option else _cut(path)


def kind_of(mode: int) -> str:
    """What a file of ``mode`` (an lstat's) is, in words."""
    for test, words in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a file")):
        if test(mode):
            return words
    return "not a regular file"


def _lstat(path: Path, name: str):
    """``os.lstat(path)``, None where nothing is there; HarnessError for a path that cannot be one."""
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        through = next((p for p in reversed(path.parents) if os.path.lexists(p) and not os.path.isdir(p)), path.parent)
        raise HarnessError(f"{name}: {_cut(through)} is a file, not a folder") from None
    except (OSError, ValueError) as exc:  # a name too long, a NUL in it
        raise HarnessError(f"{name}: not a usable path ({type(exc).__name__}: {_cut(exc, 100)})") from None


def _refuse_link(path: Path, name: str, what: str = "") -> None:
    try:
        where = os.readlink(path)
    except OSError:
        where = "?"
    raise HarnessError(f"{name}: {what or str(path)} is a symbolic link (to {_cut(where, 100)}); the harness never "
                       f"writes through a link: remove it, or name the file it points to")


def check_target(path, option: str | None = None) -> Path:
    """``path`` if the file there may be replaced: nothing is there or a regular file; HarnessError otherwise."""
    path = Path(path)
    name = _name(path, option)
    st = _lstat(path, name)
    if st is None or stat.S_ISREG(st.st_mode):
        return path
    if stat.S_ISLNK(st.st_mode):
        _refuse_link(path, name, "it")
    if stat.S_ISDIR(st.st_mode):
        raise HarnessError(f"{name}: expected a file, got a folder")
    raise HarnessError(f"{name}: {kind_of(st.st_mode)}, not a regular file; {ALLOWED}")


def check_no_links(below, path, option: str | None = None) -> None:
    """No component of ``path`` under the folder ``below`` is a symbolic link (``below`` itself is taken as
    named); each one there is a folder, the last one anything. HarnessError otherwise."""
    below, path = Path(below), Path(path)
    try:
        rel = path.relative_to(below)
    except ValueError:
        raise HarnessError(f"{_name(path, option)}: not inside {_cut(below)}") from None
    if ".." in rel.parts:
        raise HarnessError(f"{_name(path, option)}: '..' leaves {_cut(below)}")
    step = below
    for k, part in enumerate(rel.parts):
        step = step / part
        st = _lstat(step, _name(path, option))
        if st is None:
            return
        if stat.S_ISLNK(st.st_mode):
            _refuse_link(step, _name(path, option), "it" if step == path else "")
        if k < len(rel.parts) - 1 and not stat.S_ISDIR(st.st_mode):
            raise HarnessError(f"{_name(path, option)}: {step} is {kind_of(st.st_mode)}, not a folder")


def is_run_folder(folder) -> bool:
    """Whether ``folder`` holds :data:`RUN_FILES` (as files: a link to one, followed, counts, as a reader takes it)."""
    try:
        return all((Path(folder) / name).is_file() for name in RUN_FILES)
    except (OSError, ValueError):
        return False


def _runs_holding(path: Path) -> list[Path]:
    """The run folders, resolved, that ``path`` is or lies in: as named (a link at its end taken as a name)
    and as it resolves (a folder named by a link into another run lies in that run)."""
    try:
        starts = dict.fromkeys((Path(os.path.realpath(path.parent)) / path.name, Path(os.path.realpath(path))))
    except (OSError, ValueError):
        return []
    found = []
    for start in starts:
        folder = next((f for f in (start, *start.parents) if is_run_folder(f)), None)
        if folder is not None:
            found.append(Path(os.path.realpath(folder)))
    return list(dict.fromkeys(found))


def run_folder_of(path) -> Path | None:
    """The run folder (one holding :data:`RUN_FILES`) that ``path`` is or lies in, resolved; None where there is
    none. A folder named by a link into another run lies in that run."""
    found = _runs_holding(Path(path))
    return found[0] if found else None


def check_run(path, option: str | None = None, run=None) -> None:
    """``path`` lies in no run folder, or in the run folder ``run`` (the one the command writes for)."""
    mine = Path(os.path.realpath(run)) if run is not None else None
    for found in _runs_holding(Path(path)):
        if found != mine:
            raise HarnessError(f"{_name(Path(path), option)}: inside the run folder {_cut(found)}, which this command "
                               f"does not write; choose a path outside every run folder")


def _nearest(path: Path) -> Path:
    probe = path
    while _lstat(probe, _cut(path)) is None and probe.parent != probe:
        probe = probe.parent
    return probe


def _probe_folder(folder: Path, name: str) -> None:
    """Whether a file can be made in ``folder`` (or, where it is missing, the folders leading to it): made
    and removed at once, so an unwritable place is found before any work, root or not."""
    existing = _nearest(folder)
    if not existing.is_dir():
        raise HarnessError(f"{name}: {_cut(existing)} is {kind_of(os.stat(existing).st_mode)}, not a folder")
    try:
        if existing == folder:
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".harness-probe-")
            os.close(fd)
            os.unlink(tmp)
        else:
            os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".harness-probe-"))
    except OSError as exc:
        raise HarnessError(f"{name}: cannot write in {_cut(existing)} ({exc.strerror or exc})") from None


def check_file(path, option: str | None = None, *, run=None, below=None, probe: bool = True) -> Path:
    """Refuse, before any work, an output file the rule forbids (the module docstring): a target that is not
    absent or a regular file, a link on the way from ``below``, a path inside a run folder other than
    ``run``, a folder that cannot hold it. Returns ``path``."""
    path = Path(path)
    name = _name(path, option)
    if not path.name or path.name in (".", ".."):
        raise HarnessError(f"{name}: expected a file name")
    check_target(path, option)
    if below is not None:
        check_no_links(below, path, option)
    check_run(path, option, run)
    if probe:
        _probe_folder(path.parent, name)
    return path


def check_folder(path, option: str | None = None, *, may_be_run: bool = False, below=None, probe: bool = True) -> Path:
    """The same for an output folder: absent or a folder (a link to one is taken as named), inside no run
    folder (with ``may_be_run``, it may be one itself: a run's own folder), one this process can write into."""
    path = Path(path)
    name = _name(path, option)
    st = _lstat(path, name)
    if st is not None and not path.is_dir():
        raise HarnessError(f"{name}: expected a folder, got {kind_of(st.st_mode)}")
    if below is not None:
        check_no_links(below, path, option)
    check_run(path, option, path if may_be_run else None)
    if probe:
        _probe_folder(path, name)
    return path


def check_outside_project(path, root, option: str | None = None, under: tuple[str, ...] = ("results",)) -> Path:
    """An output of one of the project's own programs (its benchmarks): inside the project folder ``root`` it
    goes only under ``under`` (``results/``), never onto or among the project's own files (a config, the
    docs, the code), which a write there would replace or litter. HarnessError otherwise; returns ``path``."""
    path = Path(path)
    try:
        real, home = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    except (OSError, ValueError) as exc:
        raise HarnessError(f"{_name(path, option)}: not a usable path ({type(exc).__name__})") from None
    if real != home and home not in real.parents:
        return path
    rel = real.relative_to(home).parts
    if not rel or rel[0] not in under:
        places = " or ".join(f"{u}/" for u in under)
        raise HarnessError(f"{_name(path, option)}: among the project's own files ({_cut(home)}); inside the project "
                           f"an output goes under {places} only: choose a folder there or outside the project")
    return path


def make_folder(path, below=None) -> Path:
    """``mkdir -p path``; with ``below``, no link may stand between it and ``path`` (checked after making)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise HarnessError(f"{_cut(path)}: expected a folder, got {kind_of(os.lstat(path).st_mode)}") from None
    except OSError as exc:
        raise disk_error(path, exc) from None
    if below is not None:
        check_no_links(below, path)
    return path


def disk_error(path, exc: OSError, noun: str | None = None) -> HarnessError:
    """A write that failed (a full or read-only disk, no permission), said plainly: what was on disk stays."""
    why = exc.strerror or type(exc).__name__
    hint = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exhausted",
            errno.EROFS: "the file system is read-only", errno.EACCES: "no permission to write there",
            errno.EPERM: "no permission to write there"}.get(exc.errno, why)
    head, kept = ((f"cannot write {noun}", f"the {noun} saved before are kept") if noun
                  else ("cannot write it", "what was there before is kept"))
    return HarnessError(f"{_cut(path)}: {head}: {hint} ({why}); {kept}")


#: the name of a temporary file :func:`write_file` writes beside its target (``.NAME.<random>.tmp``)
TEMP_PATTERN = r"\..+\.[0-9a-z_]{8}\.tmp"


def held_lock(path) -> bool:
    """Whether the lock file ``path`` (a run folder's ``.lock``) is held by a process now; False where there is none."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


#: a temporary file of :data:`TEMP_PATTERN` this old, that no write holds, was left by a killed write
STALE_TEMP_S = 60.0
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_TEMP_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789_"


def _inside(path: Path, folder) -> bool:
    try:
        path.relative_to(folder)
        return True
    except ValueError:
        return False


def _open_walk(base: Path, parts, name: str, make: bool) -> int:
    """A descriptor of the folder ``base/parts...``: ``base`` taken as named, each part below it opened
    relative to the one before without following a link (made where missing, with ``make``), so no
    rename or link swapped in on the way can send a write elsewhere. HarnessError for a link or a file."""
    fd = os.open(base, _DIR_FLAGS)
    step = Path(base)
    try:
        for part in parts:
            step = step / part
            try:
                nxt = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                if not make:
                    raise
                try:
                    os.mkdir(part, 0o777, dir_fd=fd)
                except FileExistsError:
                    pass
                nxt = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except (NotADirectoryError, OSError) as exc:
                if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                    raise
                st = os.lstat(part, dir_fd=fd)
                if stat.S_ISLNK(st.st_mode):
                    _refuse_link(step, name)
                raise HarnessError(f"{name}: {_cut(step)} is {kind_of(st.st_mode)}, not a folder") from None
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_parent(path: Path, name: str, base, make: bool) -> int:
    """A descriptor of ``path``'s folder: walked from ``base`` (:func:`_open_walk`) where ``path`` lies in it,
    else the folder as named."""
    if base is not None and _inside(path.parent, base):
        if make and not os.path.lexists(base):
            make_folder(base)
        return _open_walk(Path(base), path.parent.relative_to(base).parts, name, make)
    if make:
        make_folder(path.parent)
    return os.open(path.parent, _DIR_FLAGS)


def _same_folder(fd: int, path: Path, name: str, base) -> bool:
    """Whether ``path``'s folder, walked again, is still the folder of descriptor ``fd`` (device and inode)."""
    try:
        again = _open_parent(path, name, base, make=False)
    except (OSError, HarnessError):
        return False
    try:
        a, b = os.fstat(fd), os.fstat(again)
    finally:
        os.close(again)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _new_temp(dfd: int, target: str) -> tuple[int, str]:
    """A new temporary file beside ``target`` in folder ``dfd``, opened for writing and locked (a lock held
    while it is written: :func:`_clear_stale` leaves it alone)."""
    import fcntl
    import secrets

    for _ in range(100):
        tmp = f".{target[:200]}.{''.join(secrets.choice(_TEMP_CHARS) for _ in range(8))}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                         0o666, dir_fd=dfd)  # the umask applies: results are shared files like any other
        except FileExistsError:
            continue
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd, tmp
    raise FileExistsError(errno.EEXIST, "no free temporary name")


def _clear_stale(dfd: int) -> None:
    """Remove from folder ``dfd`` the temporary files (:data:`TEMP_PATTERN`) an earlier write left (killed, or
    refused after a race): older than :data:`STALE_TEMP_S` and held by no write."""
    import fcntl
    import re
    import time

    try:
        names = [n for n in os.listdir(dfd) if re.fullmatch(TEMP_PATTERN, n)]
    except OSError:
        return
    for tmp in names:
        try:
            st = os.lstat(tmp, dir_fd=dfd)
            if not stat.S_ISREG(st.st_mode) or time.time() - st.st_mtime < STALE_TEMP_S:
                continue
            fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0), dir_fd=dfd)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = os.fstat(fd)
            now = os.lstat(tmp, dir_fd=dfd)
            if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
                os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        finally:
            os.close(fd)


def write_file(path, data: Data, option: str | None = None, *, run=None, below=None, noun: str | None = None) -> Path:
    """Write ``data`` (text as UTF-8, bytes, or a function that writes the file it is given) to ``path`` by
    the rule: checked as :func:`check_file` does, written beside it, renamed into place. HarnessError when
    the rule refuses the target or the disk refuses the write (``noun`` names what was being written).

    The target's folder is opened once (from ``below``, else from ``run`` where the path lies in it, one
    part at a time without following a link) and the temporary file, the last check and the rename are all
    made relative to it; the folder is checked to be the same one (device and inode) before the rename. A
    folder renamed or swapped for a link meanwhile cannot send the file, or its temporary, anywhere else."""
    path = Path(path)
    name = _name(path, option)
    check_file(path, option, run=run, below=below, probe=False)
    base = below if below is not None else run
    try:
        dfd = _open_parent(path, name, base, make=True)
    except OSError as exc:
        raise disk_error(path, exc, noun) from None
    tmp = None
    try:
        _clear_stale(dfd)
        tfd, tmp = _new_temp(dfd, path.name)
        try:
            if callable(data):
                # the file by its folder's descriptor: where the folder is now, whatever was renamed meanwhile
                via = Path(f"/proc/self/fd/{dfd}")
                data((via if via.is_dir() else path.parent) / tmp)
            else:
                with os.fdopen(os.dup(tfd), "wb") as sink:
                    sink.write(data.encode("utf-8") if isinstance(data, str) else data)
        finally:
            os.close(tfd)
        st = _lstat_at(path.name, dfd, name)
        if st is not None and not stat.S_ISREG(st.st_mode):  # again, just before the rename: what appeared meanwhile
            check_target(path, option)
            raise HarnessError(f"{name}: {kind_of(st.st_mode)}, not a regular file; {ALLOWED}")
        if not _same_folder(dfd, path, name, base):
            raise HarnessError(f"{name}: its folder {_cut(path.parent)} was moved or replaced while the file was "
                               f"written; nothing was written there")
        os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        tmp = None
    except OSError as exc:
        raise disk_error(path, exc, noun) from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
        os.close(dfd)
    return path


def _lstat_at(entry: str, dfd: int, name: str):
    try:
        return os.lstat(entry, dir_fd=dfd)
    except FileNotFoundError:
        return None


def remove_file(path, *, run=None, below=None) -> None:
    """Remove the regular file ``path`` (a drawing no longer drawn), found as :func:`write_file` finds its
    target: relative to its folder opened once, never through a link; nothing there is nothing to do."""
    path = Path(path)
    name = _cut(path)
    base = below if below is not None else run
    try:
        dfd = _open_parent(path, name, base, make=False)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise disk_error(path, exc) from None
    try:
        st = _lstat_at(path.name, dfd, name)
        if st is None:
            return
        if not stat.S_ISREG(st.st_mode):
            raise HarnessError(f"{name}: {kind_of(st.st_mode)}, not a file the harness wrote; left as it is")
        os.unlink(path.name, dir_fd=dfd)
    except OSError as exc:
        raise disk_error(path, exc) from None
    finally:
        os.close(dfd)


def open_private(path, mode: str = "a+"):
    """Open a file the harness keeps for itself (a lock, a log) without following a link: refused when
    ``path`` is a link or not a regular file. ``mode``: ``a+``, ``a`` or ``w``."""
    path = Path(path)
    flags = {"a+": os.O_RDWR | os.O_APPEND, "a": os.O_WRONLY | os.O_APPEND, "w": os.O_WRONLY | os.O_TRUNC}[mode]
    check_target(path)
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0), 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            _refuse_link(path, _cut(path), "it")
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # it changed between the check and the open
        os.close(fd)
        raise HarnessError(f"{_cut(path)}: not a regular file; {ALLOWED}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, mode, encoding="utf-8")


def foreign_entries(folder) -> list[str]:
    """What under ``folder`` is not a regular file or a folder (links, devices, FIFOs, sockets), as
    ``relative/path (what it is)``: what an archive or a redraw must not carry or write through."""
    folder = Path(folder)
    found = []
    for root, dirs, files in os.walk(folder):
        for entry in sorted(dirs + files):
            full = Path(root) / entry
            mode = os.lstat(full).st_mode
            if stat.S_ISLNK(mode):
                found.append(f"{full.relative_to(folder).as_posix()} (a symbolic link to {_cut(os.readlink(full), 100)})")
            elif not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                found.append(f"{full.relative_to(folder).as_posix()} ({kind_of(mode)})")
        dirs[:] = [d for d in dirs if not os.path.islink(Path(root) / d)]
    return found


def check_only_files(folder, option: str | None = None) -> None:
    """Refuse a folder the harness is about to write into wholesale (a run's ``plots/``, a run being packed or
    redrawn) when it holds anything but regular files and folders (:func:`foreign_entries`)."""
    found = foreign_entries(folder)
    if found:
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        raise HarnessError(f"{_name(Path(folder), option)}: holds {', '.join(_cut(f, 300) for f in found[:3])}{more}; "
                           f"{ALLOWED}, and never through a link: remove them")


def prepare_folder(path, below=None) -> Path:
    """A folder a command writes into wholesale, made where missing (:func:`make_folder`) and holding only
    regular files and folders (:func:`check_only_files`): checked before its first file is written."""
    folder = make_folder(path, below)
    check_only_files(folder)
    return folder

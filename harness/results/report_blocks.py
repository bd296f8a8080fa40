"""The blocks a report is built of (headings, paragraphs, tables, images, preformatted text) and the
plain formatting of their cells, shared by the one-run and the several-run reports."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


# -- the block model -----------------------------------------------------------------------
@dataclass
class Heading:
    level: int
    text: str


@dataclass
class Para:
    text: str  # may hold `code` spans


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]
    right: set[int] = field(default_factory=set)  # right-aligned (numeric) columns
    status_col: int | None = None  # a column whose value colours the row in HTML


class Hover(str):
    """A table cell's text with more behind it, shown on hover in HTML: a reason cut to fit its column
    (Markdown prints it whole instead) or the half-width and target of a marked speedup."""

    title: str = ""

    def __new__(cls, text: str, title: str = ""):
        obj = super().__new__(cls, text)
        obj.title = title
        return obj


@dataclass
class Bullets:
    items: list[str]


@dataclass
class Image:
    path: Path
    caption: str


@dataclass
class Pre:
    text: str
    summary: str = ""  # in HTML, a collapsible block with this summary


@dataclass
class Fold:
    """Blocks shown folded under a one-line summary (``<details>``, in report.html and in report.md, which
    GitHub renders the same): what a reader looks up rather than reads."""

    summary: str
    blocks: list


#: a block longer than this many lines is folded (:func:`folded`): below the results, it is looked up, not read
FOLD_LINES = 15


def _n_lines(block) -> int:
    """About how many lines a block takes on the page."""
    if isinstance(block, Table):
        return len(block.rows) + 2
    if isinstance(block, Bullets):
        return len(block.items)
    if isinstance(block, Pre):
        return block.text.count("\n") + 1
    if isinstance(block, Fold):
        return 1
    return 1


def folded(blocks: list, summary: str, always: bool = False) -> list:
    """``blocks`` in a :class:`Fold` under ``summary`` where they run over :data:`FOLD_LINES` lines (or
    ``always``: library versions, worker environments); as they are where they are short."""
    if not blocks or not (always or sum(_n_lines(b) for b in blocks) > FOLD_LINES):
        return blocks
    return [Fold(summary, blocks)]


#: an absolute path: a slash-led run of path characters not inside a word, or a compiler's ``-L``/``-I`` folder
_PATH = re.compile(r"(?:(?<=-[LI])|(?<![\w.~]))/(?:[\w.@+=-]+/)+[\w.@+=-]+")
#: the end of an environment's prefix before its packages: ``lib/python3.11/site-packages``
_PACKAGES = re.compile(r"/lib(?:64)?/python[\d.]*/(?:site|dist)-packages/")


def short_path(path: str) -> str:
    """A local path as what identifies it: inside a Python environment, from that environment's name on
    with the ``lib/python*/site-packages`` between elided (``.venv/…/scipy.libs/libscipy_openblas.so``,
    ``theano/…/scipy_openblas32/lib/libscipy_openblas.so``); inside the harness's folder (its cache, its
    isolated environments), from ``.harness/`` on; any other path as it is."""
    found = _PACKAGES.search(path)
    if found:
        env = path[: found.start()].rstrip("/").rsplit("/", 1)[-1]
        return f"{env}/…/{path[found.end():]}" if env else path[found.end():]
    at = path.find("/.harness/")
    return path[at + 1:] if at >= 0 else path


def short_paths(text: str) -> str:
    """``text`` with every absolute path in it shortened by :func:`short_path`."""
    return _PATH.sub(lambda m: short_path(m.group(0)), str(text))



def _num(v) -> bool:
    try:
        return v is not None and bool(np.isfinite(float(v)))
    except (TypeError, ValueError):
        return False


def fmt_time(v) -> str:
    """Seconds with a readable unit, ``-`` when missing."""
    from harness.results.labels import fmt_seconds

    return fmt_seconds(float(v)) if _num(v) else "-"



def _f(v, spec: str = ".3g", unit: str = "") -> str:
    return f"{v:{spec}}{unit}" if _num(v) else "-"


def _first_line(text, width: int = 160) -> str:
    """The first line of ``text``, cut to ``width`` (the whole text on hover)."""
    lines = [l.strip() for l in str(text or "").splitlines() if l.strip()]
    if not lines:
        return ""
    line = lines[0]
    return line if len(line) <= width else Hover(line[: width - 3] + "...", line)

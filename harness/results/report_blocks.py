"""The blocks a report is built of (headings, paragraphs, tables, images, preformatted text) and the
plain formatting of their cells, shared by the one-run and the several-run reports."""

from __future__ import annotations

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

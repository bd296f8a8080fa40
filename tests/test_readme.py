"""The README reads at a glance, its config runs as printed, and every link of the README and docs/ leads
somewhere (a file that is there, a heading of that file)."""

import re
from pathlib import Path

import pytest

from harness.config import load_config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "rnn-harness-plugin-example" / "README.md"]


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def test_the_readme_is_short():
    assert len(README.read_text().splitlines()) <= 200


def test_the_readmes_config_is_ten_lines_and_loads(tmp_path):
    text = README.read_text()
    block = re.search(r"^## A config and what it prints$.*?^```yaml\n(.*?)^```", text, re.S | re.M).group(1)
    assert len(block.splitlines()) == 10
    config = tmp_path / "first.yaml"
    config.write_text(block)
    cells = list(load_config(config).cells())
    assert sorted({c.backend for c in cells}) == ["jax", "native", "numpy", "torch"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_leads_somewhere(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: {target}: no such file"
        if anchor:
            assert anchor in _anchors(linked), f"{page.name}: {target}: no such heading in {linked.name}"

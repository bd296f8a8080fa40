"""Every shipped config validates, names only registered backends, and says what it reproduces."""

from pathlib import Path

import pytest

from harness.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_validates_and_has_a_header(path):
    cfg = load_config(path)
    assert cfg.cells(), path
    assert path.read_text().startswith("#"), f"{path.name} needs a header comment saying what it reproduces"


def test_profiles_of_shipped_configs():
    root = CONFIGS[0].parent
    assert len(load_config(root / "deepbench.yaml", profile="full").cells()) > 4 * len(load_config(root / "deepbench.yaml").cells())
    assert {c.threads for c in load_config(root / "parallel_minibatch.yaml", profile="many-cores").cells()} >= {1, 16}

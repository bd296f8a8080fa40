"""The config reference of docs/configs.md: made from the schema's own descriptions, and current."""

from dataclasses import dataclass, field
from pathlib import Path

import pytest
from pydantic.fields import FieldInfo
from typer.testing import CliRunner

from harness import docs
from harness.cli import app
from harness.config import schema
from harness.spec.errors import HarnessError

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configs.md"


def test_the_committed_reference_is_the_schemas():
    assert not docs.check_config_page(PAGE), "docs/configs.md: its config reference is stale; run `harness docs`"


def test_every_key_has_its_row_with_type_default_and_meaning():
    text = PAGE.read_text()
    keys = {k.path: k for k in docs.config_keys()}
    for path in ("name", "backends", "profiles", "model.kind", "task.vocab", "timing.min_rounds", "train.lr"):
        assert path in keys
    for key in keys.values():
        assert f"| `{key.path}` | {key.type} |" in text
    assert keys["timing.min_rounds"].default == "10" and keys["timing.min_rounds"].allowed == "≥ 3; ≤ 10^9"
    assert keys["dtype"].allowed == "float32, float64, bfloat16, float16"
    assert keys["model.kind"].allowed == "elman, lstm, gru" and keys["task.vocab"].allowed == "≥ 3"
    assert keys["workloads"].allowed == "forward, train_step, train" and keys["name"].default == "required"


def test_a_schema_key_without_a_description_fails_the_check(monkeypatch):
    monkeypatch.setitem(schema.TrainConfig.model_fields, "warm_restarts", FieldInfo(annotation=int, default=0))
    with pytest.raises(HarnessError, match=r"without a description: train\.warm_restarts;.*Field\(description=\.\.\.\)"):
        docs.config_keys()
    result = CliRunner().invoke(app, ["docs", "--check", "--page", str(ROOT / "docs" / "experiments.md"),
                                      "--examples", str(ROOT / "results" / "examples")])
    assert result.exit_code == 2 and "train.warm_restarts" in result.output, result.output


def test_a_model_key_without_a_description_fails_the_check(monkeypatch):
    @dataclass(frozen=True)
    class Model:
        kind: str = field(default="elman", metadata={"description": "the recurrent cell"})
        depth: int = 2

    monkeypatch.setattr(docs, "_sections", lambda: {"model": Model})
    with pytest.raises(HarnessError, match=r"without a description: model\.depth;"):
        docs.config_keys()


def test_docs_rewrites_a_stale_reference_and_leaves_the_prose(tmp_path):
    page = tmp_path / "configs.md"
    page.write_text("# Configs\n\nprose\n\n<!-- config-reference -->\n| old |\n<!-- /config-reference -->\n\nafter\n")
    assert docs.check_config_page(page)
    assert docs.write_config_page(page) and not docs.check_config_page(page)
    text = page.read_text()
    assert text.startswith("# Configs\n\nprose\n") and text.endswith("<!-- /config-reference -->\n\nafter\n")
    assert "| `timing.speedup_precision` |" in text and "| old |" not in text


def test_a_page_without_its_markers_is_one_error(tmp_path):
    page = tmp_path / "configs.md"
    page.write_text("# Configs\n")
    with pytest.raises(HarnessError, match="expected one config reference between"):
        docs.check_config_page(page)

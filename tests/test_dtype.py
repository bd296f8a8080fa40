"""The dtype type: its names, master type, sizes and SPEC bounds in one place, and no dtype name compared
as a string literal elsewhere in the harness or the backends."""

import ast
from pathlib import Path

import numpy as np
import pytest

from harness.spec.dtype import NAMES, DType
from harness.spec.errors import HarnessError
from harness.spec.model import ModelSpec, Problem
from harness.spec.tolerance import SPEC_TOLERANCES, Tolerance

ROOT = Path(__file__).resolve().parents[1]


def test_names_master_sizes_and_bounds():
    assert NAMES == ("float32", "float64", "bfloat16", "float16")
    assert [d.master for d in DType] == [DType.FLOAT32, DType.FLOAT64, DType.FLOAT32, DType.FLOAT32]
    assert [d.n_bytes for d in DType] == [4, 8, 2, 2]
    assert [d for d in DType if d.loss_scaled] == [DType.FLOAT16] and [d for d in DType if d.double] == [DType.FLOAT64]
    assert SPEC_TOLERANCES == {"float64": (1e-9, 1e-12), "float32": (1e-3, 1e-5), "bfloat16": (1e-3, 1e-5),
                               "float16": (1e-3, 1e-5)}
    assert DType.of(np.float32) is DType.of(np.dtype("float32")) is DType.of("float32") is DType.FLOAT32
    assert Tolerance.of("bfloat16").low_dtype is DType.BFLOAT16 and Tolerance.of(np.float32).low_dtype is DType.FLOAT32
    with pytest.raises(HarnessError, match="expected one of float32, float64, bfloat16, float16"):
        DType.of("int8")


def test_a_problem_holds_its_dtype_as_the_type_and_tables_get_the_name():
    p = Problem(ModelSpec.from_mapping({"kind": "elman", "hidden": 4}), 5, 6, False, "bfloat16")
    assert p.dtype is DType.BFLOAT16 and p.master_dtype is DType.FLOAT32 and p.reduced
    assert p.dtype == "bfloat16" and f"{p.dtype}" == str(p.dtype) == "bfloat16"
    assert Problem.from_mapping(p.to_mapping()) == p


def _literal_comparisons(path: Path) -> list[str]:
    """``x == "float32"``, ``x not in ("float32", "float64")`` and the like in one file."""
    def is_name(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in NAMES
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(is_name(e) for e in node.elts)
        return False

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare) and any(is_name(n) for n in [node.left, *node.comparators]):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_dtype_names_are_compared_in_the_type_alone():
    own = ROOT / "harness" / "spec" / "dtype.py"
    found = [hit for folder in ("harness", "backends") for path in sorted((ROOT / folder).rglob("*.py"))
             if path != own for hit in _literal_comparisons(path)]
    assert len(found) <= 2, found

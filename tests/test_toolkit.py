"""The shared rules backends lean on: parameter names per layer, the effective BPTT window."""

from harness.spec.model import Bptt, ModelSpec, layer_suffix


def test_layer_suffix_spells_the_parameter_names():
    assert [layer_suffix(i) for i in range(3)] == ["", "_1", "_2"]
    names = ModelSpec(kind="lstm", hidden=3, layers=2, peephole=True).param_names()
    assert "W_ih" in names and "W_hh_1" in names and "p_o_1" in names


def test_a_window_as_long_as_the_sequence_is_full_bptt():
    T = 10
    assert Bptt("truncated", 9).effective(T) == Bptt("full", None)
    assert Bptt("truncated", 8).effective(T) == Bptt("truncated", 8)
    assert Bptt("tail", 10).effective(T) == Bptt("full", None)
    assert Bptt("tail", 9).effective(T) == Bptt("tail", 9)
    assert Bptt("full", None).effective(T) == Bptt("full", None)


def test_inputs_and_targets_are_cast_as_the_problem_reads_them():
    import numpy as np

    from harness.spec.model import Problem

    tok = Problem(ModelSpec(kind="elman", hidden=3), 5, 5, True, "float32")
    x = np.arange(6).reshape(3, 2)
    assert tok.cast_inputs(x) is x and tok.cast_inputs(x, np.int32).dtype == np.int32
    assert tok.cast_targets(x, np.int32).dtype == np.int32
    dense = Problem(ModelSpec(kind="elman", hidden=3, head="mse"), 4, 2, False, "float32")
    xs = np.ones((3, 2, 4))[:, ::-1]  # not contiguous, float64
    got = dense.cast_inputs(xs, np.int32)
    assert got.dtype == np.float32 and got.flags.c_contiguous
    assert dense.cast_targets(np.ones((3, 2, 2)), np.int32).dtype == np.float32

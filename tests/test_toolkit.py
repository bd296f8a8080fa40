"""The shared rules backends lean on: parameter names per layer, the effective BPTT window."""

from harness.spec.model import Bptt, ModelSpec, layer_suffix


def test_layer_suffix_spells_the_parameter_names():
    assert [layer_suffix(i) for i in range(3)] == ["", "_1", "_2"]
    names = ModelSpec(kind="lstm", hidden=3, layers=2, peephole=True).param_names()
    assert "W_ih" in names and "W_hh_1" in names and "p_o_1" in names


def test_one_layout_gives_names_shapes_counts_and_flops():
    from math import prod

    from harness.spec.model import Problem

    D, H, O = 5, 4, 6
    gru = ModelSpec(kind="gru", hidden=H, layers=2, bidirectional=True)
    shapes = gru.param_shapes(D, O)
    assert list(shapes) == ["W_ih", "W_hh", "b", "b_hn", "W_ih_rev", "W_hh_rev", "b_rev", "b_hn_rev",
                            "W_ih_1", "W_hh_1", "b_1", "b_hn_1", "W_ih_1_rev", "W_hh_1_rev", "b_1_rev",
                            "b_hn_1_rev", "W_hy", "b_y"]
    assert shapes["W_ih"] == (D, 3 * H) and shapes["W_ih_1_rev"] == (2 * H, 3 * H) and shapes["W_hy"] == (2 * H, O)
    assert gru.param_names() == list(shapes) and gru.param_count(D, O) == sum(map(prod, shapes.values()))
    before = ModelSpec(kind="gru", hidden=H, reset_after=False, bias=False)
    assert before.param_names() == ["W_ih", "W_hh", "W_hy"]
    assert ModelSpec(kind="gru", hidden=H, reset_after=False).param_names() == ["W_ih", "W_hh", "b", "W_hy", "b_y"]
    # SPEC's FLOP counts per step and row: gru 6(DH + H^2) + 2HO; a reverse direction doubles the
    # recurrent part, and the layer above and W_hy read 2H features
    one = Problem(ModelSpec(kind="gru", hidden=H), D, O, False, batch=3, seq_len=7)
    assert one.flops_forward() == (6 * (D * H + H * H) + 2 * H * O) * 3 * 7
    assert Problem(ModelSpec(kind="gru", hidden=H), D, O, True).flops_forward() == (6 * H * H + 2 * H * O) * 20
    bi = Problem(gru, D, O, False, seq_len=1)
    assert bi.flops_forward() == 2 * 6 * (D * H + H * H) + 2 * 6 * (2 * H * H + H * H) + 2 * 2 * H * O
    lstm = Problem(ModelSpec(kind="lstm", hidden=H, layers=3), D, O, False, seq_len=1)
    assert lstm.flops_forward() == 8 * (D * H + H * H) + 2 * 8 * (H * H + H * H) + 2 * H * O
    huge = ModelSpec(kind="elman", hidden=H, layers=10**15)  # a closed form: no loop over layers
    assert huge.param_count(D, O) > 10**15


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

"""The worker side's statistics without SciPy: Student's t quantile from its closed form."""

import pytest


@pytest.mark.parametrize("df", [1, 2, 3, 4, 5, 9, 10, 29, 30, 120])
def test_t_quantile_matches_scipy(df):
    from scipy.stats import t

    from harness.worker.stats import t_quantile

    for p in (0.9, 0.975, 0.995):
        assert t_quantile(p, df) == pytest.approx(float(t.ppf(p, df)), rel=1e-12)


def test_paired_interval_over_blocks_uses_the_t_quantile():
    import numpy as np

    from harness.worker.stats import paired_speedup

    rng = np.random.default_rng(1)
    base = 1.0 + 0.01 * rng.standard_normal(40)
    other = np.concatenate([0.5 + 0.005 * rng.standard_normal(20), 0.55 + 0.005 * rng.standard_normal(20)])
    blocks = [0] * 20 + [1] * 20
    point, lo, hi = paired_speedup(base, other, blocks=blocks)
    per_block = [np.median(base[s]) / np.median(other[s]) for s in (slice(0, 20), slice(20, 40))]
    standard_error = abs(per_block[0] - per_block[1]) / 2
    # two blocks that disagree widen the interval by t(0.975, 1 degree of freedom) = 12.7 standard errors
    # each way, as a ratio (point times e^(-+w/point): never to zero or below); a normal quantile, 1.96,
    # would give less than a sixth of that
    w = 12.7 * standard_error * 0.999
    assert lo <= point * np.exp(-w / point) and hi >= point * np.exp(w / point)
    assert 0 < lo < point * np.exp(-1.96 * 6 * standard_error / point)

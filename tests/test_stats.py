"""The statistics the runner and the results share (:mod:`harness.run.stats`)."""

def test_paired_interval_over_blocks_uses_the_t_quantile():
    import numpy as np

    from harness.run.stats import paired_speedup

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

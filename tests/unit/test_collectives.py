

def test_alpha_beta_fit_recovers_a_link_and_predicts_ring_all_reduce() -> None:
    import pytest

    from stoker.roofline.collectives import alpha_beta_time, fit_alpha_beta

    alpha, beta = 30e-6, 5e9
    samples = [(s, alpha_beta_time("all_reduce", s, 4, alpha, beta)) for s in (4096, 65536, 1 << 20)]
    got_alpha, got_beta = fit_alpha_beta(samples, "all_reduce", 4)
    assert got_alpha == pytest.approx(alpha, rel=1e-6) and got_beta == pytest.approx(beta, rel=1e-6)
    # facts.md's ring formula: 2(n-1) alpha + 2(n-1)/n S / beta
    assert alpha_beta_time("all_reduce", 1e6, 4, alpha, beta) == pytest.approx(6 * alpha + 1.5 * 1e6 / beta)
    assert alpha_beta_time("all_reduce", 1e6, 1, alpha, beta) == 0.0
    with pytest.raises(ValueError, match="two message sizes"):
        fit_alpha_beta([(4096, 1e-4), (4096, 2e-4)], "all_reduce", 2)

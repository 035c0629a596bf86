"""sd.lora.lowrank: the truncated SVD a LoRA is extracted and resized with, and kohya's dynamic rank rules."""

import pytest
import torch

from sd.lora.lowrank import RankRule, factor, refactor


def spectrum_matrix(singular_values, out=12, inp=10, seed=0):
    """A matrix with exactly these singular values (random orthonormal sides)."""
    generator = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(out, out, generator=generator, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(inp, inp, generator=generator, dtype=torch.float64))
    s = torch.tensor(singular_values, dtype=torch.float64)
    return (u[:, :len(s)] * s) @ v[:, :len(s)].T


def test_at_full_rank_the_factors_are_the_difference_to_float_rounding():
    delta = torch.randn(64, 48, generator=torch.Generator().manual_seed(1))
    up, down, report = factor(delta, RankRule(48))
    assert report == {"rank": 48, "full_rank": 48, "fro_kept": pytest.approx(1.0)}
    torch.testing.assert_close(up @ down, delta, rtol=0, atol=2e-5)


@pytest.mark.parametrize("rank", [1, 4, 16])
def test_at_rank_r_the_error_is_the_best_rank_r_error(rank):
    """Eckart-Young: no rank-r matrix is closer in the Frobenius norm than the truncated SVD, whose error is the
    norm of the singular values left out."""
    delta = torch.randn(40, 32, generator=torch.Generator().manual_seed(2)).double()
    up, down, report = factor(delta, RankRule(rank))
    s = torch.linalg.svdvals(delta)
    error = torch.linalg.matrix_norm(delta - (up @ down).double())
    assert float(error) == pytest.approx(float(s[rank:].square().sum().sqrt()), rel=1e-4)
    assert report["fro_kept"] == pytest.approx(float((s[:rank].square().sum() / s.square().sum()).sqrt()), rel=1e-5)
    other = torch.randn(40, rank, dtype=torch.float64) @ torch.randn(rank, 32, dtype=torch.float64)
    assert float(torch.linalg.matrix_norm(delta - other)) > float(error)  # any other rank-r matrix is farther


def test_a_convolutions_factors_have_its_kernel_and_a_1x1_up():
    delta = torch.randn(16, 8, 3, 3, generator=torch.Generator().manual_seed(3))
    up, down, _ = factor(delta, RankRule(72))
    assert up.shape == (16, 16, 1, 1) and down.shape == (16, 8, 3, 3)  # the rank stops at the layer's full rank
    torch.testing.assert_close((up.flatten(1) @ down.flatten(1)).reshape(delta.shape), delta, rtol=0, atol=2e-5)


def test_refactoring_a_product_gives_the_factors_of_the_product():
    generator = torch.Generator().manual_seed(4)
    up, down = torch.randn(64, 16, generator=generator), torch.randn(16, 48, generator=generator)
    small_up, small_down, report = refactor(up, down, RankRule(6))
    direct_up, direct_down, direct = factor(up @ down, RankRule(6))
    torch.testing.assert_close(small_up @ small_down, direct_up @ direct_down, rtol=1e-4, atol=1e-3)
    assert report["rank"] == 6 and report["full_rank"] == 16
    assert report["fro_kept"] == pytest.approx(direct["fro_kept"], rel=1e-5)
    conv_up, conv_down = torch.randn(8, 4, 1, 1, generator=generator), torch.randn(4, 6, 3, 3, generator=generator)
    a, b, _ = refactor(conv_up, conv_down, RankRule(4))
    assert a.shape == (8, 4, 1, 1) and b.shape == (4, 6, 3, 3)
    torch.testing.assert_close(a.flatten(1) @ b.flatten(1), conv_up.flatten(1) @ conv_down.flatten(1), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("method, param, expected", [
    ("sv_ratio", 3.0, 2),  # above 8 / 3: 8 and 4
    ("sv_cumulative", 0.9, 3),  # sums 8, 12, 14 of 15: 14 / 15 is the first at 0.9
    ("sv_fro", 0.9, 2),  # squares 64, 80 of 85: 80 / 85 >= 0.81
    ("sv_fro", 1.0, 4),
    ("fixed", 0.0, 3),
])
def test_the_dynamic_rank_rules_choose_as_their_names_say(method, param, expected):
    delta = spectrum_matrix([8.0, 4.0, 2.0, 1.0])
    assert factor(delta, RankRule(3 if method == "fixed" else 10, method, param))[2]["rank"] == expected


def test_a_rule_caps_at_its_max_rank_and_bad_rules_are_named():
    assert factor(spectrum_matrix([8.0, 4.0, 2.0, 1.0]), RankRule(1, "sv_fro", 1.0))[2]["rank"] == 1
    for rule, message in ((RankRule(0), "a whole number >= 1"), (RankRule(4, "svd"), "one of sv_ratio"),
                          (RankRule(4, "sv_ratio", 1.0), "a ratio > 1"), (RankRule(4, "sv_fro", 1.5), r"in \(0, 1\]")):
        with pytest.raises(ValueError, match=message):
            rule.check()


def test_the_clamp_quantile_bounds_the_factors_entries():
    delta = torch.randn(32, 32, generator=torch.Generator().manual_seed(5))
    delta[0, 0] = 100.0  # an outlier
    up, down, _ = factor(delta, RankRule(8), clamp_quantile=0.9)
    entries = torch.cat([up.flatten(), down.flatten()]).abs()
    free_up, free_down, _ = factor(delta, RankRule(8))
    assert float(entries.max()) < float(torch.cat([free_up.flatten(), free_down.flatten()]).abs().max())
    assert float((entries >= entries.max() - 1e-6).float().mean()) >= 0.05  # the clamped ones sit at the limit


def test_the_clamp_is_kohyas_signed_quantile_of_both_factors():
    """kohya's extract_lora_from_models.py: U @ diag(S) and Vh truncated, then both clamped to +-(the quantile of
    their signed entries, together); written out here as it computes it."""
    delta = torch.randn(48, 40, generator=torch.Generator().manual_seed(6))
    up, down, _ = factor(delta, RankRule(8), clamp_quantile=0.99)
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    u, vh = u[:, :8] @ torch.diag(s[:8]), vh[:8]
    high = torch.quantile(torch.cat([u.flatten(), vh.flatten()]), 0.99)
    torch.testing.assert_close(up, u.clamp(-high, high), rtol=0, atol=1e-5)
    torch.testing.assert_close(down, vh.clamp(-high, high), rtol=0, atol=1e-5)

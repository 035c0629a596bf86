"""Post-hoc EMA (``sd.train.posthoc_ema`` keeps it, ``sd.posthoc_ema`` rebuilds it): the power-function profiles, their closed-form inner products,
and an EMA of another length rebuilt from snapshots of the two kept ones."""

import numpy as np
import pytest
import torch

import sd.posthoc_ema as posthoc
import sd.train.posthoc_ema as kept_ema


@pytest.mark.parametrize("sigma_rel", [0.01, 0.05, 0.10, 0.2])
def test_gamma_gives_the_profile_of_that_relative_width(sigma_rel):
    gamma = posthoc.gamma_of(sigma_rel)
    t = np.linspace(0, 1, 2_000_001)  # the profile on [0, 1]: (gamma + 1) t^gamma
    p = (gamma + 1) * t ** gamma
    mean = np.trapezoid(t * p, t)
    width = np.sqrt(np.trapezoid((t - mean) ** 2 * p, t))
    assert width == pytest.approx(sigma_rel, rel=1e-3)
    with pytest.raises(ValueError):
        posthoc.gamma_of(0.3)


def test_the_inner_product_is_the_integral_of_the_two_profiles():
    for t_a, g_a, t_b, g_b in [(100.0, 6.94, 400.0, 16.97), (400.0, 6.94, 100.0, 16.97), (50.0, 3.0, 50.0, 3.0)]:
        t = np.linspace(0, min(t_a, t_b), 1_000_001)
        integral = np.trapezoid((g_a + 1) * t ** g_a / t_a ** (g_a + 1) * (g_b + 1) * t ** g_b / t_b ** (g_b + 1), t)
        assert posthoc.profile_dot(t_a, g_a, t_b, g_b) == pytest.approx(integral, rel=1e-5)


class Scalars(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n))


def test_an_ema_of_another_length_is_rebuilt_from_the_snapshots_of_the_two_kept_ones(tmp_path):
    """A random walk of 64 weights over 2000 steps; both kept EMAs snapshotted every 100: the rebuilt
    sigma_rel 0.075 (between them) and 0.15 (longer than both) at step 2000 are within 3% of the gap
    between that EMA and the nearer kept one, and a kept length comes back as itself."""
    generator = torch.Generator().manual_seed(0)
    model = Scalars(64)
    kept = [kept_ema.PowerEMA(model, s) for s in posthoc.PROFILES]
    wanted = {s: kept_ema.PowerEMA(model, s) for s in (0.075, 0.15)}
    drift = torch.randn(64, generator=generator) * 0.01
    for step in range(2000):
        with torch.no_grad():
            model.w.add_(drift + 0.05 * torch.randn(64, generator=generator))
        for ema in [*kept, *wanted.values()]:
            ema.update(model, step)
        if (step + 1) % 100 == 0:
            kept_ema.write_snapshot(tmp_path, step + 1, kept)
    assert [s for s, _ in posthoc.snapshots(tmp_path)] == list(range(100, 2001, 100))
    for sigma_rel, truth in wanted.items():
        rebuilt, step = posthoc.reconstruct(tmp_path, sigma_rel)
        nearest = min(kept, key=lambda e: abs(e.sigma_rel - sigma_rel)).shadow[0]
        error = (rebuilt["w"] - truth.shadow[0]).norm() / (nearest - truth.shadow[0]).norm()
        assert step == 2000 and error < 0.03, (sigma_rel, float(error))  # 0.006 and 0.002 when written
    again, _ = posthoc.reconstruct(tmp_path, 0.05)
    torch.testing.assert_close(again["w"], kept[0].shadow[0], atol=2e-3, rtol=1e-3)  # fp16 snapshots
    earlier, step = posthoc.reconstruct(tmp_path, 0.05, step=1000)
    assert step == 1000 and not torch.allclose(earlier["w"], again["w"])
    with pytest.raises(FileNotFoundError, match="no snapshot of step 1050"):
        posthoc.reconstruct(tmp_path, 0.05, step=1050)
    assert [p.name for p in kept_ema.remove_after(tmp_path, 1900)] == ["step_00002000.safetensors"]

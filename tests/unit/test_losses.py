"""loss_type (l2, l1, huber, smooth_l1), huber_schedule and debiased_estimation, each against its formula written
out in float64 (tests/compat/kohya_losses.py compares them with kohya's sd-scripts' own functions, by hand)."""

import pytest
import torch

import sd.model
from sd.train.config import TrainConfig

ALPHAS = sd.model.ddpm_alphas_cumprod()
T = torch.tensor([0, 1, 10, 250, 500, 750, 999])


def test_each_loss_type_is_its_formula():
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(7, 4, 8, 8, generator=g), torch.randn(7, 4, 8, 8, generator=g) * 3
    c = torch.linspace(0.05, 1.0, 7)
    e = pred.double() - target.double()
    c64 = c.double().view(-1, 1, 1, 1)
    expected = {"l2": e**2, "l1": e.abs(), "huber": 2 * c64 * ((e**2 + c64**2).sqrt() - c64),
                "smooth_l1": 2 * ((e**2 + c64**2).sqrt() - c64)}
    for loss_type, want in expected.items():
        got = sd.model.elementwise_loss(pred, target, loss_type, c)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="loss_type must be one of l2, l1, huber, smooth_l1"):
        sd.model.elementwise_loss(pred, target, "l3")


def test_huber_is_about_l2_for_small_errors_and_linear_for_large_ones():
    c = torch.tensor([0.5])
    small, large = torch.full((1, 1), 1e-2), torch.full((1, 1), 100.0)
    zero = torch.zeros(1, 1)
    assert sd.model.elementwise_loss(small, zero, "huber", c).item() == pytest.approx(1e-4, rel=1e-2)
    assert sd.model.elementwise_loss(large, zero, "huber", c).item() == pytest.approx(2 * 0.5 * 100, rel=1e-2)


def test_huber_schedules_are_their_formulas():
    abar = ALPHAS.double()[T]
    sigma = ((1 - abar) / abar).sqrt()
    for c, scale in ((0.1, 1.0), (0.3, 2.0)):
        expected = {"constant": torch.full(T.shape, c * scale, dtype=torch.float64),
                    "exponential": scale * torch.exp(T.double() / 1000 * torch.log(torch.tensor(c, dtype=torch.float64))),
                    "snr": (1 - c) / (1 + sigma) ** 2 + c}  # no scale: as sd-scripts
        for schedule, want in expected.items():
            got = sd.model.huber_thresholds(T, ALPHAS, schedule, c, scale)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)
    exponential = sd.model.huber_thresholds(torch.tensor([0, 1000 - 1]), ALPHAS, "exponential", 0.1, 2.0)
    assert exponential[0] == 2.0 and exponential[1] == pytest.approx(0.2, rel=0.01)  # scale down to c x scale
    with pytest.raises(ValueError, match="huber_schedule must be one of snr, exponential, constant"):
        sd.model.huber_thresholds(T, ALPHAS, "linear")


def test_debiased_weights_are_one_over_root_snr_capped_and_one_over_snr_plus_one_for_v():
    snr = (ALPHAS.double() / (1 - ALPHAS.double()))[T].clamp(max=1000)
    torch.testing.assert_close(sd.model.debiased_weights(T, ALPHAS, "epsilon").double(), snr.rsqrt(), rtol=1e-5, atol=0)
    torch.testing.assert_close(sd.model.debiased_weights(T, ALPHAS, "v_prediction").double(), 1 / (snr + 1),
                               rtol=1e-5, atol=0)


def test_the_default_loss_is_the_min_snr_mse_and_the_options_change_it():
    g = torch.Generator().manual_seed(1)
    pred, target = torch.randn(7, 4, 8, 8, generator=g), torch.randn(7, 4, 8, 8, generator=g)
    mse = ((pred - target) ** 2).mean(dim=(1, 2, 3))
    default = sd.model.diffusion_loss(pred, target, T, ALPHAS)
    torch.testing.assert_close(default, mse * sd.model.min_snr_weights(T, ALPHAS, "epsilon", 5.0))
    debiased = sd.model.diffusion_loss(pred, target, T, ALPHAS, debiased=True)
    torch.testing.assert_close(debiased, default * sd.model.debiased_weights(T, ALPHAS, "epsilon"))
    c = sd.model.huber_thresholds(T, ALPHAS)
    huber = sd.model.diffusion_loss(pred, target, T, ALPHAS, loss_type="huber", huber_c=c)
    assert huber.shape == (7,) and (huber < default).all()  # c < 1 everywhere: below the squared error


@pytest.mark.parametrize("fields, message", [
    (dict(loss_type="mse"), "loss.type: one of l2, l1, huber, smooth_l1"),
    (dict(loss_type="huber", huber_schedule="cosine"), "loss.huber_schedule: one of snr, exponential, constant"),
    (dict(distill="lcm", loss_type="huber"), "loss.type and loss.debiased_estimation are the diffusion loss's"),
])
def test_loss_settings_are_checked(fields, message):
    config = TrainConfig(unet="tiny", text_encoder="tiny", vae="tiny", datasets=[], **fields)
    with pytest.raises(Exception, match=message):
        config.validate(check_paths=False)

"""Zero terminal SNR (Lin et al. 2023, arXiv:2305.08891): the rescaled schedule, trailing sampling, training,
and the flag through exports and loaders, with diffusers as the reference."""

import pytest
import torch

import SD_Model


# ------------------------------------------------------------------------------ the schedule


def test_rescaled_schedule_is_diffusers_and_ends_in_pure_noise():
    from diffusers import DDPMScheduler
    from diffusers.schedulers.scheduling_ddpm import rescale_zero_terminal_snr

    ours = SD_Model.ddpm_alphas_cumprod(zero_terminal_snr=True)
    plain = SD_Model.ddpm_alphas_cumprod()
    theirs = SD_Model.build_noise_scheduler("v_prediction", DDPMScheduler, zero_terminal_snr=True).alphas_cumprod
    assert theirs[-1] == 0 and ours[-1] == 0  # stored as exactly 0, as diffusers' DDPM stores it
    torch.testing.assert_close(ours.float(), theirs, rtol=0, atol=1e-6)  # diffusers computes in float32
    betas = torch.linspace(SD_Model.BETA_START**0.5, SD_Model.BETA_END**0.5, 1000, dtype=torch.float64) ** 2
    exact = torch.cumprod(1 - rescale_zero_terminal_snr(betas), dim=0)  # their algorithm in float64
    torch.testing.assert_close(ours, exact, rtol=0, atol=1e-15)
    # sqrt(alpha-bar) is shifted and scaled: the first value stays, and the map is affine.
    assert ours[0] == pytest.approx(plain[0].item(), abs=1e-15)
    line = (plain.sqrt() - plain[-1].sqrt()) / (plain[0].sqrt() - plain[-1].sqrt())
    torch.testing.assert_close(ours.sqrt() / ours[0].sqrt(), line, rtol=0, atol=1e-15)
    assert plain[-1] > 0.004 and torch.equal(plain, SD_Model.ddpm_alphas_cumprod(zero_terminal_snr=False))


def test_schedule_config_asks_diffusers_for_the_rescaled_schedule_and_trailing_spacing():
    from diffusers import DDIMScheduler, DPMSolverMultistepScheduler, EulerDiscreteScheduler

    plain = SD_Model.noise_schedule_config("v_prediction")
    config = SD_Model.noise_schedule_config("v_prediction", zero_terminal_snr=True)
    assert "rescale_betas_zero_snr" not in plain and plain["timestep_spacing"] == "leading"
    assert config == {**plain, "rescale_betas_zero_snr": True, "timestep_spacing": "trailing"}
    for cls in (DDIMScheduler, DPMSolverMultistepScheduler, EulerDiscreteScheduler):
        scheduler = SD_Model.build_noise_scheduler("v_prediction", cls, zero_terminal_snr=True)
        assert scheduler.config.rescale_betas_zero_snr and scheduler.config.timestep_spacing == "trailing"
        scheduler.set_timesteps(10)
        assert int(scheduler.timesteps[0]) == 999, cls  # sampling starts from pure noise


def test_training_math_is_finite_at_the_last_timestep():
    alphas = SD_Model.ddpm_alphas_cumprod(zero_terminal_snr=True)
    t = torch.tensor([0, 500, 998, 999])
    snr = SD_Model.snr(t, alphas)
    assert snr[-1] == 0
    v = SD_Model.min_snr_weights(t, alphas, "v_prediction", 5.0)
    torch.testing.assert_close(v, (snr.clamp(max=5.0) / (snr + 1)).float())
    assert v[-1] == 0  # min(0, gamma) / (0 + 1)
    eps = SD_Model.min_snr_weights(t, alphas, "epsilon", 5.0)
    assert torch.isfinite(eps).all() and eps[-1] == 1  # the limit of min(snr, gamma) / snr, not 0 / 0
    x0 = torch.randn(4, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    noise = torch.randn(4, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    noisy = SD_Model.add_noise(x0, noise, t, alphas)
    target = SD_Model.prediction_target(x0, noise, t, alphas, "v_prediction")
    assert torch.equal(noisy[-1], noise[-1]) and torch.equal(target[-1], -x0[-1])  # pure noise; v = -x0
    loss = SD_Model.diffusion_loss(torch.zeros_like(target), target, t, alphas, "v_prediction", 5.0)
    assert torch.isfinite(loss).all() and loss[-1] == 0

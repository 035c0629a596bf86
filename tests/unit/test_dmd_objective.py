"""Distribution matching distillation (sd.train.objectives.dmd): each loss term against the authors' formulas
(DMD2, ``main/sd_guidance.py``: the distribution-matching gradient and loss, the fake score's loss, the two GAN
terms, the SD 1.5 critic head, the generator's timesteps) on the same tiny tensors, the guided real score, the
path of a flow teacher, the one-step sampler against diffusers' LCMScheduler, and the settings it refuses."""

import math

import pytest
import torch
import torch.nn.functional as F

import sd.model
import sd.sampling
import sd.train.objectives.dmd as dmd
from sd.train.config import ConfigError, TrainConfig

FIELDS = dict(unet="tiny", text_encoder="tiny", vae="tiny", precision="fp32", grad_checkpointing=False,
              ema_decay=0.0, datasets=[], distill="dmd", init_from="base", min_snr_gamma=0.0,
              validation_sampler="onestep", validation_steps=1, validation_cfg=1.0)


# The authors' formulas, written out as their code computes them (x0 in float64 from the noise prediction).


def authors_x0(sample, noise_prediction, alphas_cumprod, timesteps):
    alpha = alphas_cumprod[timesteps].reshape(-1, 1, 1, 1)
    return (sample - (1 - alpha) ** 0.5 * noise_prediction) / alpha**0.5


def authors_matching_loss(latents, noisy, fake_noise, real_noise, alphas_cumprod, timesteps):
    fake_image = authors_x0(noisy.double(), fake_noise.double(), alphas_cumprod.double(), timesteps)
    real_image = authors_x0(noisy.double(), real_noise.double(), alphas_cumprod.double(), timesteps)
    p_real, p_fake = latents - real_image, latents - fake_image
    grad = torch.nan_to_num((p_real - p_fake) / torch.abs(p_real).mean(dim=[1, 2, 3], keepdim=True))
    return 0.5 * F.mse_loss(latents.float(), (latents - grad).detach().float(), reduction="mean")


def tensors(seed: int = 0, batch: int = 3):
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, 4, 8, 8)
    return [torch.randn(shape, generator=generator) for _ in range(4)], torch.tensor([20, 500, 980][:batch])


def test_the_distribution_matching_loss_and_its_gradient_equal_the_authors():
    (latents, noisy, fake_noise, real_noise), t = tensors()
    alphas = sd.model.ddpm_alphas_cumprod()
    ours_in = latents.clone().requires_grad_(True)
    path = dmd.Path(alphas, "epsilon")
    gradient = dmd.matching_gradient(ours_in.detach(), path.clean(real_noise, noisy, t), path.clean(fake_noise, noisy, t))
    ours = dmd.matching_loss(ours_in, gradient).mean()
    theirs_in = latents.clone().requires_grad_(True)
    theirs = authors_matching_loss(theirs_in, noisy, fake_noise, real_noise, alphas, t)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=1e-4, atol=1e-9)
    # the gradient of the loss is the matching gradient over the elements: DMD's update direction
    torch.testing.assert_close(ours_in.grad, gradient / gradient.numel(), rtol=1e-5, atol=1e-9)


def test_a_vanishing_real_score_distance_is_no_nan():
    x0 = torch.zeros(1, 4, 2, 2)
    assert torch.isfinite(dmd.matching_gradient(x0, x0, torch.ones_like(x0))).all()


def test_the_fake_score_loss_and_the_gan_terms_equal_the_authors():
    (prediction, noise, fake_logits, real_logits), _ = tensors(seed=1)
    assert dmd.fake_score_loss(prediction, noise).item() == pytest.approx(
        torch.mean((prediction.float() - noise.float()) ** 2).item(), rel=1e-6)
    fake_logits, real_logits = fake_logits[:, :1, 0, 0], real_logits[:, :1, 0, 0]  # (B, 1) as the critic's
    assert dmd.generator_gan_loss(fake_logits).mean().item() == pytest.approx(
        F.softplus(-fake_logits).mean().item(), rel=1e-6)
    assert dmd.critic_loss(fake_logits, real_logits).item() == pytest.approx(
        (F.softplus(fake_logits).mean() + F.softplus(-real_logits).mean()).item(), rel=1e-6)


def test_the_critic_head_is_the_authors_sd15_branch():
    """DMD2's ``cls_pred_branch`` for SD v1.5 on the 1280-channel 8x8 middle-block features, layer for layer."""
    theirs = torch.nn.Sequential(
        torch.nn.Conv2d(kernel_size=4, in_channels=1280, out_channels=1280, stride=2, padding=1),
        torch.nn.GroupNorm(num_groups=32, num_channels=1280), torch.nn.SiLU(),
        torch.nn.Conv2d(kernel_size=4, in_channels=1280, out_channels=1280, stride=4, padding=0),
        torch.nn.GroupNorm(num_groups=32, num_channels=1280), torch.nn.SiLU(),
        torch.nn.Conv2d(kernel_size=1, in_channels=1280, out_channels=1, stride=1, padding=0))
    ours = dmd.Critic(1280)
    ours.head.load_state_dict(theirs.state_dict())
    features = torch.randn(2, 1280, 8, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(features), theirs(features).squeeze(dim=3).squeeze(dim=2))
        assert dmd.Critic(64)(torch.randn(2, 64, 2, 2)).shape == (2, 1)  # another size: resized to 8x8 first


@pytest.mark.parametrize("steps", [1, 2, 3, 4])
def test_the_generators_timesteps_are_the_authors_denoising_step_list(steps):
    theirs = list(range(1000 - 1, 0, -(1000 // steps)))
    assert sd.sampling.onestep_timesteps(steps) == theirs
    with pytest.raises(ValueError):
        sd.sampling.onestep_timesteps(5)


class Stub(torch.nn.Module):
    """A UNet stand-in: its output is the input times the mean of the prompt's embedding, plus t / 1000."""

    def forward(self, x, t, encoder_hidden_states):
        out = x * encoder_hidden_states.float().mean(dim=(1, 2)).reshape(-1, 1, 1, 1) + t.float().reshape(-1, 1, 1, 1) / 1000

        class Output:
            sample = out

        return Output()


def test_the_real_score_folds_the_guidance_in_as_the_authors_predict_noise():
    objective = dmd.DistributionMatching.__new__(dmd.DistributionMatching)
    objective.settings, objective.teacher = dmd.DMDSettings(guidance=1.75), Stub()
    x, t = torch.randn(2, 4, 4, 4), torch.tensor([10, 900])
    hidden, uncond = torch.full((2, 3, 5), 2.0), torch.full((2, 3, 5), 0.5)
    cond_out, uncond_out = Stub()(x, t, hidden).sample, Stub()(x, t, uncond).sample
    torch.testing.assert_close(objective.teacher_output(None, x, t, hidden, uncond),
                               uncond_out + 1.75 * (cond_out - uncond_out))
    objective.settings = dmd.DMDSettings(guidance=1.0)  # at 1 the conditional branch alone
    torch.testing.assert_close(objective.teacher_output(None, x, t, hidden, uncond), cond_out)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "flow"])
def test_the_path_recovers_the_clean_latents_from_the_exact_prediction(prediction_type):
    alphas = sd.model.ddpm_alphas_cumprod()
    path = dmd.Path(alphas, prediction_type)
    generator = torch.Generator().manual_seed(3)
    x0, noise = torch.randn(3, 4, 4, 4, generator=generator), torch.randn(3, 4, 4, 4, generator=generator)
    t = torch.tensor([0, 499, 999])
    noisy = path.noised(x0, noise, t)
    torch.testing.assert_close(path.clean(path.target(x0, noise, t), noisy, t), x0, rtol=1e-4, atol=1e-4)
    if prediction_type == "flow":  # pure noise at the generator's first timestep, sigma * 1000 to the UNet
        torch.testing.assert_close(noisy[2], noise[2])
        assert path.model_time(t).tolist() == pytest.approx([1.0, 500.0, 1000.0])


def test_one_step_is_diffusers_lcm_scheduler_at_one_step():
    """ComfyUI's and diffusers' LCM sampling at one step (timestep 999) draws what --sampler onestep draws: the
    boundary condition's c_skip there is below 1e-8."""
    from diffusers import LCMScheduler

    alphas = sd.model.ddpm_alphas_cumprod()
    latents, prediction = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    ours = sd.sampling.OneStep(1, alphas, "epsilon")
    assert ours.timesteps == [999]
    scheduler = LCMScheduler.from_config(sd.model.noise_schedule_config("epsilon"))
    scheduler.set_timesteps(1)
    assert scheduler.timesteps.tolist() == [999]
    theirs = scheduler.step(prediction, 999, latents).denoised
    torch.testing.assert_close(ours.step(prediction, 999, latents), theirs, rtol=1e-5, atol=1e-5)


def test_more_steps_noise_the_image_again_to_each_next_timestep():
    alphas = sd.model.ddpm_alphas_cumprod()
    generators = [torch.Generator().manual_seed(i) for i in range(2)]
    sampler = sd.sampling.OneStep(4, alphas, "epsilon", generators)
    assert sampler.timesteps == [999, 749, 499, 249]
    latents, prediction = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    x0 = sd.model.predicted_x0(latents, prediction, torch.full((2,), 999), alphas, "epsilon")
    noise = torch.stack([torch.randn(4, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)])
    torch.testing.assert_close(sampler.step(prediction, 999, latents),
                               sd.model.add_noise(x0, noise, torch.full((2,), 749), alphas))


@pytest.mark.parametrize("fields, says", [
    (dict(init_from=""), "set init_from"),
    (dict(precision="fp16"), "precision: fp16"),
    (dict(sharding="zero1"), "sharding: zero1"),
    (dict(dmd={"min_step": 500, "max_step": 400}), "dmd.max_step (400) must be above dmd.min_step (500)"),
    (dict(flow={"matching": True}), "flow.matching"),
    (dict(min_snr_gamma=5.0), "min_snr_gamma"),
    (dict(dmd={"steps": 5}), "dmd.steps"),
    (dict(validation_steps=30), "a DMD generator draws in 1 to 4 steps"),
])
def test_settings_a_dmd_run_cannot_train_with_are_refused_by_name(fields, says):
    with pytest.raises((ConfigError, ValueError)) as refused:  # a field out of its range: when it is made
        config = TrainConfig(**{**FIELDS, **fields})
        if fields.get("init_from") == "":
            dmd.DistributionMatching.check(config)
        config.validate(check_paths=False)
    assert says in str(refused.value)


def test_a_dmd_run_samples_its_validation_grid_with_the_generators_sampler():
    config = TrainConfig(**{**FIELDS, "validation_sampler": "auto"})
    assert config.sampler == "onestep"
    assert math.isclose(dmd.DMDSettings.from_config(config).fake_lr, config.lr)  # fake_lr 0: the run's lr

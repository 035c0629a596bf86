"""The LCM sampler (sd.sampling.LCM) against diffusers' LCMScheduler, on a tiny random UNet."""

import math

import numpy as np
import pytest
import torch

import sd.model
import sd.sampling
import SD_Eval
import SD_ImageGen

SEEDS = [3, 4]


@pytest.fixture(scope="module")
def unet():
    return sd.model.build_unet("tiny", seed=0, from_scratch=False).eval()  # non-zero outputs


def embeddings(unet, seed: int, batch: int = len(SEEDS)) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 77, unet.config.cross_attention_dim, generator=generator)


def lcm_scheduler(prediction_type: str, zero_terminal_snr: bool, steps: int):
    from diffusers import LCMScheduler

    scheduler = LCMScheduler.from_config(sd.model.noise_schedule_config(prediction_type, zero_terminal_snr))
    scheduler.set_timesteps(steps)  # original_inference_steps: its default, 50
    return scheduler


@pytest.mark.parametrize("prediction_type, zero_terminal_snr", [("epsilon", False), ("v_prediction", True)])
def test_timesteps_are_lcm_schedulers(prediction_type, zero_terminal_snr):
    for steps in range(1, 51):
        ours = sd.sampling.make_scheduler("lcm", steps, prediction_type, zero_terminal_snr=zero_terminal_snr)
        assert ours.timesteps == lcm_scheduler(prediction_type, zero_terminal_snr, steps).timesteps.tolist(), steps
    # The schedule ignores the spacing: it starts at the last timestep with or without zero terminal SNR.
    assert sd.sampling.lcm_timesteps(1) == [999]
    assert sd.sampling.lcm_timesteps(4) == [999, 759, 499, 259]
    assert sd.sampling.lcm_timesteps(8) == [999, 879, 759, 639, 499, 379, 259, 139]


@pytest.mark.parametrize("steps", [0, 51])
def test_steps_outside_the_distillation_schedule_are_refused(steps):
    with pytest.raises(ValueError, match=r"lcm steps must be in 1\.\.50 .* got " + str(steps)):
        sd.sampling.make_scheduler("lcm", steps, "epsilon")


def test_boundary_scalings_by_hand():
    c_skip, c_out = sd.sampling.lcm_boundary_scalings(torch.tensor([0, 19, 999]))
    # 10 t = 0, 190, 9990: c_skip = 0.25 / ((10 t)^2 + 0.25), c_out = 10 t / sqrt((10 t)^2 + 0.25).
    torch.testing.assert_close(c_skip, torch.tensor([1.0, 6.92515979806e-06, 2.50500750374e-09]), rtol=1e-6, atol=0)
    torch.testing.assert_close(c_out, torch.tensor([0.0, 0.999996537414, 0.999999998747]), rtol=1e-6, atol=0)
    assert c_skip[0] == 1 and c_out[0] == 0  # the boundary condition f(x, 0) = x exactly
    # Any shape of timesteps (a training batch's (B, 1, 1, 1)), and other constants.
    c_skip, c_out = sd.sampling.lcm_boundary_scalings(torch.tensor([19]).view(-1, 1, 1, 1), timestep_scaling=1.0,
                                                      sigma_data=1.0)
    assert c_skip.shape == (1, 1, 1, 1)
    assert math.isclose(c_skip.item(), 1 / 362, rel_tol=1e-6) and math.isclose(c_out.item(), 19 / 362**0.5,
                                                                               rel_tol=1e-6)


def test_predicted_x0_inverts_the_training_target():
    x0, noise = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)).chunk(2)
    timesteps = torch.tensor([19])
    alphas = sd.model.ddpm_alphas_cumprod()
    x_t = sd.model.add_noise(x0, noise, timesteps, alphas)
    for prediction_type in ("epsilon", "v_prediction"):
        target = sd.model.prediction_target(x0, noise, timesteps, alphas, prediction_type)
        recovered = sd.model.predicted_x0(x_t, target, timesteps, alphas, prediction_type)
        torch.testing.assert_close(recovered, x0, rtol=0, atol=1e-5)


def run_diffusers(unet, scheduler, noise_seeds, cond, uncond, cfg):
    """diffusers' LCMScheduler in our loop, its noise from one CPU generator per image, as its pipelines draw
    with ``generator=[torch.Generator().manual_seed(s) for s in seeds]``."""
    generators = [torch.Generator().manual_seed(s) for s in noise_seeds]
    latents = torch.stack([torch.randn((4, 8, 8), generator=g) for g in generators])
    with torch.no_grad():
        for t in scheduler.timesteps:
            prediction = sd.sampling.guided_prediction(unet, latents, int(t), cond, uncond, cfg)
            latents = scheduler.step(prediction, t, latents, generator=generators).prev_sample
    return latents


def run_ours(unet, cond, uncond, cfg, prediction_type, zero_terminal_snr, step_seeds=None):
    """Our 4 steps; ``step_seeds``: generators other than those of the initial noise for the later noise."""
    generators = sd.sampling.seed_generators(SEEDS)
    noise = sd.sampling.image_noise(generators, (4, 8, 8), len(SEEDS))
    if step_seeds is not None:
        generators = sd.sampling.seed_generators(step_seeds)
    return sd.sampling.sample_latents(unet, noise, cond, uncond, sampler="lcm", steps=4, cfg=cfg,
                                      prediction_type=prediction_type, zero_terminal_snr=zero_terminal_snr,
                                      generators=generators)


@pytest.mark.parametrize("prediction_type, zero_terminal_snr, cfg", [
    ("epsilon", False, 1.0), ("epsilon", False, 1.5), ("v_prediction", False, 1.0), ("v_prediction", False, 1.5),
    ("v_prediction", True, 1.5)])
def test_four_steps_equal_diffusers_lcm_scheduler(unet, prediction_type, zero_terminal_snr, cfg):
    cond, uncond = embeddings(unet, 9), embeddings(unet, 10)
    ours = run_ours(unet, cond, uncond, cfg, prediction_type, zero_terminal_snr)
    scheduler = lcm_scheduler(prediction_type, zero_terminal_snr, 4)
    theirs = run_diffusers(unet, scheduler, SEEDS, cond, uncond, cfg)
    # Measured max abs difference: epsilon 2.3e-5 (cfg 1) and 3.1e-5 (cfg 1.5) on latents reaching 54 (a random
    # UNet's noise over sqrt(alpha-bar_999) = 0.068), v_prediction 1.3e-6 and 2.3e-6 on latents near 2.5: only
    # the alpha-bars differ, ours from float64 and diffusers' cumulated in float32 (by up to 4.7e-7).
    assert (ours - theirs).abs().max() <= 2e-6 * ours.abs().max()
    # Given our alpha-bars, diffusers draws the same noise and makes the same arithmetic: bit for bit.
    scheduler = lcm_scheduler(prediction_type, zero_terminal_snr, 4)
    scheduler.alphas_cumprod = sd.model.ddpm_alphas_cumprod(zero_terminal_snr=zero_terminal_snr).float()
    assert torch.equal(ours, run_diffusers(unet, scheduler, SEEDS, cond, uncond, cfg))
    # The fresh noise matters: the same start with other noise at the later steps ends elsewhere.
    other = run_ours(unet, cond, uncond, cfg, prediction_type, zero_terminal_snr, step_seeds=[13, 14])
    assert (ours - other).abs().max() > 0.1


def test_one_step_is_the_consistency_function_and_draws_no_noise(unet):
    cond, uncond = embeddings(unet, 9), embeddings(unet, 10)
    generators = sd.sampling.seed_generators(SEEDS)
    noise = sd.sampling.image_noise(generators, (4, 8, 8), len(SEEDS))
    states = [g.get_state() for g in generators]
    ours = sd.sampling.sample_latents(unet, noise, cond, uncond, sampler="lcm", steps=1, cfg=1.0,
                                      prediction_type="v_prediction", generators=generators)
    assert all(torch.equal(state, g.get_state()) for state, g in zip(states, generators))
    with torch.no_grad():
        v = unet(noise, torch.tensor([999, 999]), encoder_hidden_states=cond).sample
    a = sd.model.ddpm_alphas_cumprod()[999].float()
    c_skip, c_out = sd.sampling.lcm_boundary_scalings(torch.tensor(999))
    torch.testing.assert_close(ours, c_out * (a.sqrt() * noise - (1 - a).sqrt() * v) + c_skip * noise, rtol=0,
                               atol=1e-6)


def test_initial_noise_is_unchanged():
    # Every sampler's starting noise: image i's first draw from a CPU generator seeded with seeds[i].
    expected = torch.stack([torch.randn((4, 8, 8), generator=torch.Generator().manual_seed(s)) for s in (0, 7)])
    assert torch.equal(sd.sampling.initial_noise([0, 7], (4, 8, 8)), expected)
    with pytest.raises(ValueError, match="2 generators for a batch of 3 images"):
        sd.sampling.image_noise(sd.sampling.seed_generators([0, 7]), (4, 8, 8), 3)


@pytest.fixture(scope="module")
def pipeline(unet):
    return sd.sampling.Pipeline(unet, sd.model.load_vae("tiny"), sd.model.load_text_encoder("tiny"),
                                sd.model.load_tokenizer("tiny"), "epsilon")


def test_a_seeds_image_is_the_same_in_a_batch_of_one_and_of_three(pipeline):
    def generate(seeds, batch_size):
        return sd.sampling.generate(pipeline, "a red circle", "", seeds, steps=4, cfg=1.5, sampler="lcm", height=64,
                                    width=64, batch_size=batch_size, device=torch.device("cpu"))

    three = generate([5, 6, 7], 3)
    alone = generate([6], 1)[0]
    # Batched convolutions round differently, by a level at most; noise drawn for the whole batch would
    # give seed 6 another picture.
    assert np.abs(alone.astype(int) - three[1].astype(int)).max() <= 1
    assert np.abs(three[0].astype(int) - three[1].astype(int)).mean() > 5


def test_command_lines_default_to_four_steps_at_guidance_one_for_lcm(tmp_path):
    base = ["--ckpt", "x", "--prompt", "p", "--out", str(tmp_path)]
    args = SD_ImageGen.parse_args(base + ["--sampler", "lcm"]).sampling
    assert (args.steps, args.cfg) == (4, 1.0)
    args = SD_ImageGen.parse_args(base + ["--sampler", "lcm", "--steps", "8", "--cfg", "1.5"]).sampling
    assert (args.steps, args.cfg) == (8, 1.5)
    args = SD_ImageGen.parse_args(base).sampling
    assert (args.steps, args.cfg) == (100, 7.5)
    with pytest.raises(SystemExit):
        SD_ImageGen.parse_args(base + ["--sampler", "lcm", "--steps", "51"])
    base = ["--reference", "ref.npz", "--images", str(tmp_path)]
    args = SD_Eval.parse_args(base + ["--sampler", "lcm"])
    assert (args.steps, args.cfg) == (4, 1.0)
    args = SD_Eval.parse_args(base + ["--sampler", "euler"])
    assert (args.steps, args.cfg) == (50, 7.5)

"""Zero terminal SNR (Lin et al. 2023, arXiv:2305.08891): the rescaled schedule, trailing sampling, training,
and the flag through exports and loaders, with diffusers as the reference."""

import json
import math

import numpy as np
import pytest
import torch
import yaml
from safetensors import safe_open

import sd.formats
import sd.model
import sd.sampling
import SD_ImageGen
import SD_Train
from sd.distributed import Dist
from sd.train.config import TrainConfig

from data_factory import train_tiny_run

STEPS = 4  # divides 1000: diffusers' trailing DDIM and ours visit and step to the same timesteps
PROMPT = "a red circle"


# ------------------------------------------------------------------------------ the schedule


def test_rescaled_schedule_is_diffusers_and_ends_in_pure_noise():
    from diffusers import DDPMScheduler
    from diffusers.schedulers.scheduling_ddpm import rescale_zero_terminal_snr

    ours = sd.model.ddpm_alphas_cumprod(zero_terminal_snr=True)
    plain = sd.model.ddpm_alphas_cumprod()
    theirs = sd.model.build_noise_scheduler("v_prediction", DDPMScheduler, zero_terminal_snr=True).alphas_cumprod
    assert theirs[-1] == 0 and ours[-1] == 0  # stored as exactly 0, as diffusers' DDPM stores it
    torch.testing.assert_close(ours.float(), theirs, rtol=0, atol=1e-6)  # diffusers computes in float32
    betas = torch.linspace(sd.model.BETA_START**0.5, sd.model.BETA_END**0.5, 1000, dtype=torch.float64) ** 2
    exact = torch.cumprod(1 - rescale_zero_terminal_snr(betas), dim=0)  # their algorithm in float64
    torch.testing.assert_close(ours, exact, rtol=0, atol=1e-15)
    # sqrt(alpha-bar) is shifted and scaled: the first value stays, and the map is affine.
    assert ours[0] == pytest.approx(plain[0].item(), abs=1e-15)
    line = (plain.sqrt() - plain[-1].sqrt()) / (plain[0].sqrt() - plain[-1].sqrt())
    torch.testing.assert_close(ours.sqrt() / ours[0].sqrt(), line, rtol=0, atol=1e-15)
    assert plain[-1] > 0.004 and torch.equal(plain, sd.model.ddpm_alphas_cumprod(zero_terminal_snr=False))


def test_schedule_config_asks_diffusers_for_the_rescaled_schedule_and_trailing_spacing():
    from diffusers import DDIMScheduler, DPMSolverMultistepScheduler, EulerDiscreteScheduler

    plain = sd.model.noise_schedule_config("v_prediction")
    config = sd.model.noise_schedule_config("v_prediction", zero_terminal_snr=True)
    assert "rescale_betas_zero_snr" not in plain and plain["timestep_spacing"] == "leading"
    assert config == {**plain, "rescale_betas_zero_snr": True, "timestep_spacing": "trailing"}
    for cls in (DDIMScheduler, DPMSolverMultistepScheduler, EulerDiscreteScheduler):
        scheduler = sd.model.build_noise_scheduler("v_prediction", cls, zero_terminal_snr=True)
        assert scheduler.config.rescale_betas_zero_snr and scheduler.config.timestep_spacing == "trailing"
        scheduler.set_timesteps(10)
        assert int(scheduler.timesteps[0]) == 999, cls  # sampling starts from pure noise


def test_training_math_is_finite_at_the_last_timestep():
    alphas = sd.model.ddpm_alphas_cumprod(zero_terminal_snr=True)
    t = torch.tensor([0, 500, 998, 999])
    snr = sd.model.snr(t, alphas)
    assert snr[-1] == 0
    v = sd.model.min_snr_weights(t, alphas, "v_prediction", 5.0)
    torch.testing.assert_close(v, (snr.clamp(max=5.0) / (snr + 1)).float())
    assert v[-1] == 0  # min(0, gamma) / (0 + 1)
    eps = sd.model.min_snr_weights(t, alphas, "epsilon", 5.0)
    assert torch.isfinite(eps).all() and eps[-1] == 1  # the limit of min(snr, gamma) / snr, not 0 / 0
    x0 = torch.randn(4, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    noise = torch.randn(4, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    noisy = sd.model.add_noise(x0, noise, t, alphas)
    target = sd.model.prediction_target(x0, noise, t, alphas, "v_prediction")
    assert torch.equal(noisy[-1], noise[-1]) and torch.equal(target[-1], -x0[-1])  # pure noise; v = -x0
    loss = sd.model.diffusion_loss(torch.zeros_like(target), target, t, alphas, "v_prediction", 5.0)
    assert torch.isfinite(loss).all() and loss[-1] == 0


# ------------------------------------------------------------------------------ sampling


def test_trailing_timesteps_are_diffusers():
    from diffusers import DDIMScheduler

    scheduler = DDIMScheduler.from_config(sd.model.noise_schedule_config("v_prediction", True))
    assert sd.sampling.ddim_timesteps(50, spacing="trailing") == list(range(999, 0, -20))
    for n in (1, 3, 7, 30, 48, 50, 61, 100, 999, 1000):
        scheduler.set_timesteps(n)
        # For some n (61 here) diffusers appends an (n+1)-th timestep, -1: ours stops at n.
        assert sd.sampling.ddim_timesteps(n, spacing="trailing") == scheduler.timesteps.tolist()[:n], n
    assert sd.sampling.ddim_timesteps(50) == list(range(981, 0, -20))  # the default stays SD's leading
    with pytest.raises(ValueError, match="spacing"):
        sd.sampling.ddim_timesteps(50, spacing="linspace")


def test_our_trailing_ddim_steps_equal_diffusers_on_random_tensors():
    from diffusers import DDIMScheduler

    ours = sd.sampling.make_scheduler("ddim", 50, "v_prediction", zero_terminal_snr=True)
    theirs = DDIMScheduler.from_config(sd.model.noise_schedule_config("v_prediction", True))
    theirs.set_timesteps(50)
    assert ours.timesteps == theirs.timesteps.tolist()
    generator = torch.Generator().manual_seed(0)
    for t in ours.timesteps[:3] + ours.timesteps[-2:]:  # from pure noise (alpha-bar 0) to the final step
        sample, output = torch.randn(2, 4, 8, 8, generator=generator), torch.randn(2, 4, 8, 8, generator=generator)
        expected = theirs.step(output, t, sample).prev_sample
        torch.testing.assert_close(ours.step(output, t, sample), expected, rtol=1e-5, atol=2e-6)  # fp32 op order
    assert ours.previous[999] == 979 and ours.previous[19] == -1


@pytest.mark.parametrize("sampler", ["ddim", "dpm++", "euler"])
def test_every_sampler_denoises_from_pure_noise_to_the_data(sampler):
    # An oracle v-model for a fixed x0 of +-4: each sampler, started at the last timestep, ends on x0.
    scheduler = sd.sampling.make_scheduler(sampler, 20, "v_prediction", zero_terminal_snr=True)
    alphas = scheduler.alphas_cumprod  # Euler and DPM++ put 2**-24 at the end, finite sigma
    assert int(scheduler.timesteps[0]) == 999 and math.isfinite(float(scheduler.init_noise_sigma))
    x0 = torch.full((1, 4, 8, 8), 4.0)
    x0[..., ::2] = -4.0
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0)) * scheduler.init_noise_sigma
    for t in scheduler.timesteps:
        a = alphas[int(t)].float()
        x_in = scheduler.scale_model_input(latents, t)
        eps = (x_in - a.sqrt() * x0) / (1 - a).sqrt()
        latents = scheduler.step(a.sqrt() * eps - (1 - a).sqrt() * x0, t, latents)
    # DDIM ends at alpha-bar_0 (SD's set_alpha_to_one=False): x0 plus 0.03 of the noise.
    torch.testing.assert_close(latents, x0, rtol=0, atol=0.15 if sampler == "ddim" else 0.02)


def test_epsilon_on_the_rescaled_schedule_is_refused():
    with pytest.raises(ValueError, match="^zero_terminal_snr: .* v_prediction"):
        sd.sampling.make_scheduler("ddim", 10, "epsilon", zero_terminal_snr=True)


# ------------------------------------------------------------------------------ training, validation, files


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One tiny optimizer step on the rescaled schedule, its validation grid and a checkpoint."""
    return train_tiny_run(tmp_path_factory.mktemp("ztsnr"), 8, max_steps=1, warmup_steps=0, ema_decay=0.0,
                          validate_every=1, validation_prompts=[PROMPT], validation_steps=STEPS,
                          prediction_type="v_prediction", zero_terminal_snr=True)


def test_training_step_on_the_rescaled_schedule_is_finite(run_dir):
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert record["step"] == 1 and math.isfinite(record["loss"]) and record["loss"] > 0
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["zero_terminal_snr"] is True


def test_build_uses_the_rescaled_schedule_for_the_loss_and_the_validation_grid(run_dir, tmp_path):
    config = TrainConfig(**{**yaml.safe_load((run_dir / "config.yaml").read_text()), "out_dir": str(tmp_path / "r")})
    run = SD_Train.build(config, Dist.single())
    assert torch.equal(run.step.alphas_cumprod, sd.model.ddpm_alphas_cumprod(zero_terminal_snr=True))
    assert run.sampler.zero_terminal_snr


def sample(ckpt_path, out, *flags):
    from PIL import Image

    assert SD_ImageGen.main(["--ckpt", str(ckpt_path), "--prompt", PROMPT, "--seed", "5", "--n", "1",
                             "--steps", str(STEPS), "--cfg", "4.0", "--height", "64", "--width", "64",
                             "--device", "cpu", "--precision", "fp32", "--out", str(out), *flags]) == 0
    return np.asarray(Image.open(out / "000_000005.png").convert("RGB"))


def test_validation_grid_equals_sd_imagegen_on_the_recorded_schedule(run_dir, tmp_path):
    from PIL import Image

    # SD_ImageGen samples the checkpoint on the schedule it records (test_diffusers_samples_... shows the
    # two schedules give different images), so the grid was drawn on it too.
    grid = np.asarray(Image.open(run_dir / "samples" / "step_00000001.png").convert("RGB"))
    image = sample(run_dir, tmp_path / "auto")
    assert image.std() > 0 and np.array_equal(sd.sampling.grid_cell(grid, 0, 0, 64, 64, [PROMPT]), image)


@pytest.fixture(scope="module")
def exported(run_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ztsnr_export")
    assert SD_ImageGen.main(["--ckpt", str(run_dir), "--export_diffusers", str(out / "pipe"),
                             "--export_single_file", str(out / "model.safetensors")]) == 0
    return out


@pytest.mark.slow  # over 4 s: the full suite's (make check stays near 3 minutes)
def test_exports_record_the_schedule_and_every_loader_restores_it(run_dir, exported):
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(str(exported / "pipe"), local_files_only=True)
    assert isinstance(pipe.scheduler, DDIMScheduler)
    assert pipe.scheduler.config.rescale_betas_zero_snr and pipe.scheduler.config.timestep_spacing == "trailing"
    assert pipe.scheduler.config.prediction_type == "v_prediction"
    with safe_open(str(exported / "model.safetensors"), framework="pt") as handle:
        header = handle.metadata()
    assert header["zero_terminal_snr"] == "true"
    assert {k: header[k] for k in ("modelspec.architecture", "modelspec.implementation", "modelspec.title",
                                   "modelspec.prediction_type", "modelspec.predict_key")} == {
        "modelspec.architecture": "stable-diffusion-v1", "modelspec.title": "model",
        "modelspec.implementation": "https://github.com/Stability-AI/generative-models",
        "modelspec.prediction_type": "v", "modelspec.predict_key": "v"}  # as sd-scripts and ComfyUI write them
    for source, kwargs in ((run_dir, {}), (exported / "pipe", {}), (exported / "model.safetensors", {"arch": "tiny"})):
        assert sd.formats.load_pipeline(str(source), **kwargs).zero_terminal_snr, source
    pipe_folder = str(exported / "pipe")
    assert not sd.formats.load_pipeline(pipe_folder, zero_terminal_snr=False).zero_terminal_snr
    with pytest.raises(ValueError, match=rf"^{pipe_folder}: .* say --prediction_type v_prediction or "
                                         "--zero_terminal_snr false$"):
        sd.formats.load_pipeline(pipe_folder, prediction_type="epsilon")


def test_a_record_that_is_no_boolean_is_an_error_naming_the_file(exported, tmp_path):
    import shutil

    folder = tmp_path / "pipe"
    shutil.copytree(exported / "pipe", folder)
    scheduler = folder / "scheduler" / "scheduler_config.json"
    scheduler.write_text(json.dumps({**json.loads(scheduler.read_text()), "rescale_betas_zero_snr": "maybe"}))
    with pytest.raises(ValueError, match=rf"^{scheduler}: rescale_betas_zero_snr 'maybe' is neither true nor false$"):
        sd.formats.load_pipeline(str(folder))


def test_diffusers_samples_the_exported_folder_as_we_do(run_dir, exported):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(str(exported / "pipe"), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    model = sd.formats.load_pipeline(str(run_dir))
    ours = sd.sampling.generate(model, PROMPT, "", [3], steps=STEPS, cfg=4.0, height=64, width=64, batch_size=1)[0]
    theirs = pipe(PROMPT, num_inference_steps=STEPS, guidance_scale=4.0, height=64, width=64,
                  latents=sd.sampling.initial_noise([3], (4, 8, 8)), output_type="np").images[0]
    theirs = (theirs * 255).round().astype(np.uint8)
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 2  # float rounding only
    leading = sd.formats.load_pipeline(str(run_dir), zero_terminal_snr=False)
    other = sd.sampling.generate(leading, PROMPT, "", [3], steps=STEPS, cfg=4.0, height=64, width=64, batch_size=1)[0]
    assert np.abs(other.astype(int) - theirs.astype(int)).max() > 2  # the comparison can tell the schedules apart


def test_the_flag_reads_auto_true_and_false():
    base = ["--ckpt", "x", "--export_diffusers", "y"]
    assert SD_ImageGen.parse_args(base).model.zero_terminal_snr is None
    assert SD_ImageGen.parse_args(base + ["--zero_terminal_snr", "auto"]).model.zero_terminal_snr is None
    assert SD_ImageGen.parse_args(base + ["--zero_terminal_snr", "true"]).model.zero_terminal_snr is True
    assert SD_ImageGen.parse_args(base + ["--zero_terminal_snr", "no"]).model.zero_terminal_snr is False
    with pytest.raises(SystemExit):
        SD_ImageGen.parse_args(base + ["--zero_terminal_snr", "maybe"])

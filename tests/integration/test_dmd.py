"""Distribution matching distillation runs (``distill.method: dmd``) on the tiny presets: exact resume of a DMD
LoRA (the generator's adapter, the fake score's adapter and its optimizer) and of a whole-UNet generator with the
GAN term and backward simulation, its exports recording the generator's timesteps, ``--sampler onestep`` drawn
by default from both, the fake score never in a file users load, and a generator that moves toward the teacher's
samples."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors import safe_open
from PIL import Image
from safetensors.torch import load_file

import sd.formats
import sd.model
import sd.sampling
import sd.run_folder
import sd.train.memory
import SD_ImageGen
import SD_Train
from sd.train.config import TrainConfig

from data_factory import (BASE, WORDS, assert_bitwise_equal, checkpoint_state, make_base_pipeline, make_captions,
                          make_latents, train_tiny_run)
from margins import at_most

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
DMD = dict(BASE, distill="dmd", dmd={"fake_updates": 2, "guidance": 2.0}, lr=1e-3, warmup_steps=0, batch_size=2,
           grad_accum=2, min_snr_gamma=0.0, cfg_dropout=0.0, ema_decay=0.0, validation_sampler="onestep",
           validation_steps=1, validation_cfg=1.0)
WEIGHTS = ("unet", "adapter", "ema", "lora_base", "dmd_fake", "dmd_fake_optimizer")


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    return make_base_pipeline(tmp_path_factory.mktemp("base") / "pipeline")


def train(tmp_path: Path, name: str, *flags: str, **fields) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**DMD, "out_dir": str(tmp_path / name), **fields}))
    assert SD_Train.main(["--config", str(path), *flags]) == 0
    return tmp_path / name


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_dmd_lora_resumes_bit_for_bit_with_its_fake_score_and_exports_no_fake_weights(base_model, dataset_16,
                                                                                        tmp_path):
    common = dict(datasets=[dataset_16], init_from=str(base_model), max_steps=4, lora_rank=4)
    straight = train(tmp_path, "a", **common)
    train(tmp_path, "b", "--stop_at_step", "2", **common)
    resumed = train(tmp_path, "b", **common)
    a, b = checkpoint_state(straight, 4, WEIGHTS), checkpoint_state(resumed, 4, WEIGHTS)
    assert_bitwise_equal(a, b)
    fake = {k for k in a if k.startswith("dmd_fake.fake.")}
    generator = {k.removeprefix("adapter.unet.") for k in a if k.startswith("adapter.unet.")}
    assert fake and {k.removeprefix("dmd_fake.fake.") for k in fake} == generator  # a second adapter, same layers
    assert any(k.startswith("dmd_fake_optimizer.") and k.endswith("exp_avg") for k in a)
    assert not any(k.startswith("unet.") for k in a)  # one UNet: the teacher is init_from, never saved
    steps = records(straight)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["dm_loss"]) and np.isfinite(r["fake_loss"]) for r in steps)
    out = tmp_path / "dmd_lora.safetensors"
    assert SD_ImageGen.main(["--ckpt", str(straight), "--export_lora", str(out)]) == 0
    exported = load_file(out)
    assert exported and not any("fake" in k for k in exported)
    with safe_open(str(out), "pt") as file:
        header = file.metadata()
    assert json.loads(header["sd_distilled"])["timesteps"] == [999] and "lcm sampler" in header["ss_training_comment"]
    assert "Steps: 1, Sampler: onestep, CFG scale: 1.0" in sampled(straight, tmp_path / "samples")


def sampled(source: Path, out: Path) -> str:
    """The generation parameters of one image drawn from ``source`` with SD_ImageGen.py's defaults."""
    assert SD_ImageGen.main(["--ckpt", str(source), "--prompt", "a red circle", "--n", "1", "--out", str(out)]) == 0
    return Image.open(sorted(out.glob("0*.png"))[0]).text["parameters"]


def test_a_whole_unet_generator_with_the_gan_term_and_two_steps_resumes_bit_for_bit_and_exports_its_steps(
        base_model, dataset_16, tmp_path):
    """The fake score is a whole float32 copy beside the frozen teacher; the critic trains on the data's latents."""
    common = dict(datasets=[dataset_16], init_from=str(base_model), max_steps=4, grad_accum=1,
                  dmd={"steps": 2, "fake_updates": 2, "gan_weight": 0.01, "guidance": 2.0},
                  validation_steps=2)
    straight = train(tmp_path, "a", **common)
    train(tmp_path, "b", "--stop_at_step", "2", **common)
    resumed = train(tmp_path, "b", **common)
    a, b = checkpoint_state(straight, 4, WEIGHTS), checkpoint_state(resumed, 4, WEIGHTS)
    assert_bitwise_equal(a, b)
    assert any(k.startswith("dmd_fake.critic.") for k in a) and any(k.startswith("unet.") for k in a)
    unet = {k.removeprefix("unet.") for k in a if k.startswith("unet.")}
    assert {k.removeprefix("dmd_fake.fake.") for k in a if k.startswith("dmd_fake.fake.")} == unet
    assert all(np.isfinite(r["gan_loss"]) and r["gan_loss"] > 0 and np.isfinite(r["critic_loss"])
               for r in records(straight))
    single = tmp_path / "dmd.safetensors"
    assert SD_ImageGen.main(["--ckpt", str(straight), "--export_single_file", str(single)]) == 0
    with safe_open(str(single), "pt") as file:
        header = file.metadata()
    assert header["distilled"] == "dmd" and header["generator_timesteps"] == "999,499"
    assert sd.formats.recorded_default_sampler(str(single)) == "onestep"
    assert "Steps: 2, Sampler: onestep, CFG scale: 1.0" in sampled(single, tmp_path / "from_file")
    # a diffusers folder names LCMScheduler; diffusers draws at 999 what one step of ours draws
    from diffusers import StableDiffusionPipeline

    folder = tmp_path / "dmd_diffusers"
    assert SD_ImageGen.main(["--ckpt", str(straight), "--export_diffusers", str(folder)]) == 0
    assert json.loads((folder / "scheduler" / "scheduler_config.json").read_text())["_class_name"] == "LCMScheduler"
    out = tmp_path / "one_step"
    assert SD_ImageGen.main(["--ckpt", str(straight), "--prompt", "a red circle", "--steps", "1", "--seed", "3",
                             "--n", "1", "--height", "64", "--width", "64", "--device", "cpu", "--out", str(out)]) == 0
    ours = np.asarray(Image.open(out / "000_000003.png").convert("RGB")).astype(int)
    pipe = StableDiffusionPipeline.from_pretrained(str(folder), safety_checker=None, requires_safety_checker=False,
                                                   local_files_only=True)
    theirs = pipe(["a red circle"], num_inference_steps=1, guidance_scale=1.0, height=64, width=64,
                  generator=[torch.Generator().manual_seed(3)], output_type="np").images[0]
    assert np.abs(ours - np.round(theirs * 255)).max() <= 1


def test_the_memory_estimate_holds_one_unet_and_two_adapters_or_a_teacher_and_a_fake_copy():
    def estimate(**fields):
        config = TrainConfig(**{**DMD, "datasets": [], "init_from": "x", "unet": "tiny", "batch_size": 2,
                                "grad_accum": 1, "precision": "bf16", **fields})
        return sd.train.memory.estimate(config, resolution=64, device="cuda")

    lora, whole = estimate(lora_rank=4), estimate()
    lcm = estimate(lora_rank=4, distill="lcm", validation_sampler="lcm")
    # the fake adapter and its two AdamW moments: one and a half times the generator's moments, no UNet copy
    assert lora.parts["distillation"] == pytest.approx(1.5 * lora.parts["optimizer_state"], rel=0.1)
    assert lora.allocated == pytest.approx(lcm.allocated, rel=0.05)
    # a whole UNet: the teacher in bf16 (half the fp32 weights), the fake score's fp32 copy and its two moments
    assert whole.parts["distillation"] == pytest.approx(3.5 * whole.parts["weights"], rel=0.05)
    assert whole.allocated > lora.allocated + whole.parts["distillation"]


def test_two_ranks_distill_a_dmd_lora_to_the_same_generator(base_model, dataset_16, tmp_path):
    """DDP wraps the generator; the fake score's updates run on each rank outside it, their gradients averaged."""
    config = tmp_path / "two.yaml"
    config.write_text(yaml.safe_dump({**DMD, "out_dir": str(tmp_path / "run"), "datasets": [dataset_16],
                                      "init_from": str(base_model), "max_steps": 2, "lora_rank": 4,
                                      "dmd": {"fake_updates": 1}, "batch_size": 2, "grad_accum": 1}))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(ROOT / "SD_Train.py"), "--config", str(config)], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    folder = tmp_path / "run" / "checkpoints" / sd.run_folder.step_dir_name(2)
    rank0, rank1 = (torch.load(folder / f"rng_rank{r}.pt", weights_only=True) for r in (0, 1))
    assert torch.equal(rank0["fingerprint"], rank1["fingerprint"])  # the ranks' generators agree
    assert not torch.equal(rank0["rng"]["noise"], rank1["rng"]["noise"])  # and they drew different images
    assert (folder / "dmd_fake.safetensors").exists() and (folder / "dmd_fake_optimizer.safetensors").exists()
    assert all(np.isfinite(r["fake_loss"]) for r in records(tmp_path / "run"))


def two_mode_data(root: Path) -> dict:
    """A toy set whose every caption has two latent patterns (half its images each): a teacher drawing it in
    many steps lands near one pattern, its one-step prediction from noise lands far from both."""
    rng = np.random.default_rng(0)
    modes = rng.normal(0, 3, size=(len(WORDS), 2, 4, 8, 8))
    n = 64
    classes, which = np.arange(n) % len(WORDS), (np.arange(n) // len(WORDS)) % 2
    keys = [f"s{i:05d}" for i in range(n)]
    make_latents(root / "latents", keys, modes[classes, which] + rng.normal(0, 0.1, size=(n, 4, 8, 8)))
    make_captions(root / "captions", list(zip(keys, [f"a {WORDS[c]}" for c in classes])), [])
    return {"dataset": str(root / "captions"), "latents": str(root / "latents"), "modes": modes}


def distance_to_modes(source: Path, modes: np.ndarray) -> float:
    """The RMS distance of one-step samples (16 per caption, fixed seeds) to the nearer of their caption's
    patterns, averaged."""
    pipe = sd.formats.load_pipeline(str(source))
    ids = sd.model.tokenize(pipe.tokenizer, [f"a {word}" for word in WORDS] + [""])
    embeddings = sd.model.encode_prompt_ids(pipe.text_encoder, ids).float()
    distances = []
    for c in range(len(WORDS)):
        generators = sd.sampling.seed_generators(list(range(16)))
        noise = sd.sampling.image_noise(generators, (4, 8, 8), 16)
        latents = sd.sampling.sample_latents(pipe.unet, noise, embeddings[c:c + 1].expand(16, -1, -1),
                                             embeddings[-1:].expand(16, -1, -1), sampler="onestep", steps=1, cfg=1.0,
                                             prediction_type=pipe.prediction_type, generators=generators)
        x = sd.model.unscale_latents(latents, float(pipe.vae.config.scaling_factor)).double().numpy()
        distances.append(np.sqrt(((x[:, None] - modes[c][None]) ** 2).mean(axis=(2, 3, 4))).min(1))
    return float(np.mean(distances))


@pytest.mark.learned
def test_the_one_step_generator_draws_nearer_the_data_than_its_teachers_one_step(tmp_path):
    """A teacher trained on the two-pattern set draws, in one step from noise, images far from both patterns of a
    caption (its prediction of the clean latents, amplified by the noisiest timestep); 60 DMD steps of the whole
    UNet bring its generator's single step nearer them, and the fake score learns the generator's images."""
    data = two_mode_data(tmp_path / "data")
    sets = [{"dataset": data["dataset"], "latents": data["latents"]}]
    teacher = tmp_path / "teacher.yaml"
    teacher.write_text(yaml.safe_dump({**BASE, "datasets": sets, "max_steps": 150, "lr": 3e-3, "batch_size": 8,
                                       "grad_accum": 1, "warmup_steps": 0, "ema_decay": 0.0,
                                       "out_dir": str(tmp_path / "teacher")}))
    assert SD_Train.main(["--config", str(teacher)]) == 0
    run = train(tmp_path, "dmd", datasets=sets, init_from=str(tmp_path / "teacher"), max_steps=60, batch_size=8,
                grad_accum=1, dmd={"fake_updates": 2, "guidance": 2.0})
    before, after = distance_to_modes(tmp_path / "teacher", data["modes"]), distance_to_modes(run, data["modes"])
    at_most("DMD generator's one-step distance to the data / the teacher's one step", after / before, 0.9)
    fake = [r["fake_loss"] for r in records(run)]
    at_most("the fake score's loss, last 10 steps / first 5", np.mean(fake[-10:]) / np.mean(fake[:5]), 0.8)


def test_a_flow_teacher_distils_to_a_generator_sampled_in_one_step_on_its_straight_path(dataset_16, tmp_path):
    """A flow model (prediction_type: flow) as the teacher: the generator reads its velocity at sigma 1 (pure
    noise, time 1000) as the clean image ``x - v``; --sampler auto draws it in one step there."""
    teacher = train_tiny_run(tmp_path / "flow", 8, max_steps=2, warmup_steps=0, ema_decay=0.0,
                             prediction_type="flow", min_snr_gamma=0)
    run = train(tmp_path, "dmd", datasets=[dataset_16], init_from=str(teacher), max_steps=2, grad_accum=1,
                prediction_type="flow", dmd={"fake_updates": 1})
    assert all(np.isfinite(r["dm_loss"]) and np.isfinite(r["fake_loss"]) for r in records(run))
    assert "Steps: 1, Sampler: onestep, CFG scale: 1.0" in sampled(run, tmp_path / "samples")

"""Latent consistency distillation runs (``distill: lcm``) on the tiny presets: exact resume of an LCM-LoRA and
of a whole-UNet student, the teacher checked on resume, a loss that falls, and an exported LCM-LoRA sampled
by diffusers' LCMScheduler giving our images."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file

import sd.data.training_data
import sd.formats
import sd.model
import sd.run_folder
import sd.sampling
import sd.train.config
import sd.train.objectives.lcm
import sd.train.step
import SD_ImageGen
import SD_Train

from sd.distributed import Dist

from data_factory import BASE, assert_bitwise_equal, checkpoint_state, make_base_pipeline
from margins import at_most

ROOT = Path(__file__).resolve().parents[2]
DISTILL = dict(BASE, distill="lcm", lr=5e-3, warmup_steps=0, lcm_guidance_min=1.5, lcm_guidance_max=4.0,
               batch_size=2, grad_accum=2, validation_sampler="lcm", validation_steps=2, validation_cfg=1.0)
pytestmark = pytest.mark.slow
WEIGHTS = ("unet", "adapter", "ema", "lcm_target", "lora_base")  # the weight files a checkpoint may hold


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    return make_base_pipeline(tmp_path_factory.mktemp("base") / "pipeline")


def train(tmp_path: Path, name: str, *flags: str, **fields) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**DISTILL, "out_dir": str(tmp_path / name), **fields}))
    assert SD_Train.main(["--config", str(path), *flags]) == 0
    return tmp_path / name


@pytest.fixture(scope="module")
def whole_unet_runs(base_model, dataset_16, tmp_path_factory):
    """A whole-UNet distillation of 6 steps run straight (``a``) and stopped at step 3, then resumed (``b``)."""
    root = tmp_path_factory.mktemp("whole_unet")
    common = dict(datasets=[dataset_16], init_from=str(base_model), max_steps=6)
    straight = train(root, "a", **common)
    train(root, "b", "--stop_at_step", "3", **common)  # mid-epoch (4 steps an epoch)
    return straight, train(root, "b", **common)


def check_resumed(straight: Path, resumed: Path, lora: bool) -> None:
    a, b = checkpoint_state(straight, 6, WEIGHTS), checkpoint_state(resumed, 6, WEIGHTS)
    assert_bitwise_equal(a, b)
    target = {k for k in a if k.startswith("lcm_target.")}
    assert target and ("adapter.unet." if lora else "unet.") in "".join(a)
    if lora:  # an LCM-LoRA's target network averages its adapter alone; the base is init_from's, never saved
        assert all(".lora_" in k for k in target) and not any(k.startswith("unet.") for k in a)
    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6] and all(np.isfinite(r["loss"]) for r in records)


def test_a_whole_unet_distillation_stopped_and_resumed_equals_the_straight_run_bit_for_bit(whole_unet_runs):
    check_resumed(*whole_unet_runs, lora=False)


def test_an_lcm_lora_stopped_and_resumed_equals_the_straight_run_bit_for_bit(base_model, dataset_16, tmp_path):
    common = dict(datasets=[dataset_16], init_from=str(base_model), max_steps=6, lora_rank=4,
                  lora_targets=["attention", "resnet"])
    straight = train(tmp_path, "a", **common)
    train(tmp_path, "b", "--stop_at_step", "3", **common)
    check_resumed(straight, train(tmp_path, "b", **common), lora=True)


def test_a_distillation_resumed_on_another_teacher_is_refused(whole_unet_runs, dataset_16, tmp_path, capsys):
    other = tmp_path / "other"  # the same architecture, other weights
    sd.formats.export_diffusers(other, sd.model.build_unet("tiny", seed=9, from_scratch=False),
                                sd.model.load_vae("tiny"), sd.model.load_text_encoder("tiny"),
                                sd.model.load_tokenizer("tiny"))
    _, run = whole_unet_runs
    path = tmp_path / "again.yaml"
    path.write_text(yaml.safe_dump({**DISTILL, "out_dir": str(run), "datasets": [dataset_16],
                                    "init_from": str(other), "max_steps": 6}))
    capsys.readouterr()
    assert SD_Train.main(["--config", str(path)]) == 2
    assert f"init_from {other} is not the base model the distilled model in" in capsys.readouterr().err


def test_two_ranks_distill_an_lcm_lora_to_the_same_adapter(base_model, dataset_16, tmp_path):
    """DDP wraps the student; the teacher (adapters off) and the target network run outside it, on each rank."""
    config = tmp_path / "two.yaml"
    config.write_text(yaml.safe_dump({**DISTILL, "out_dir": str(tmp_path / "run"), "datasets": [dataset_16],
                                      "init_from": str(base_model), "max_steps": 4, "lora_rank": 4,
                                      "batch_size": 2, "grad_accum": 1, "validate_every": 4}))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(ROOT / "SD_Train.py"), "--config", str(config)], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    folder = tmp_path / "run" / "checkpoints" / sd.run_folder.step_dir_name(4)
    rank0, rank1 = (torch.load(folder / f"rng_rank{r}.pt", weights_only=True) for r in (0, 1))
    assert torch.equal(rank0["fingerprint"], rank1["fingerprint"])  # the ranks' weights agree
    assert not torch.equal(rank0["rng"]["noise"], rank1["rng"]["noise"])  # and they drew different samples
    assert (tmp_path / "run" / "samples" / "step_00000004.png").exists()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4] and "val_loss" in records[-1]


def fixed_draw_loss(config_fields: dict, student: dict | None, target: dict | None, base_model, latents, ids) -> float:
    """The mean consistency loss of ``latents`` under fixed noise, solver steps and guidance scales (the same
    generator seed every call) with the student's and the target network's weights given (None: the teacher's)."""
    config = sd.train.config.TrainConfig(**{**DISTILL, **config_fields, "datasets": [], "init_from": str(base_model)})
    unet = sd.model.build_unet("tiny", from_scratch=False)
    sd.formats.load_unet_weights(str(base_model), unet)
    step = sd.train.step.build_step(config, Dist.single(), unet, sd.model.load_text_encoder("tiny"),
                                    sd.model.tokenize(sd.model.load_tokenizer("tiny"), [""]), 1.0)
    if student is not None:
        unet.load_state_dict(student)
    if target is not None:
        step.objective.load_state_dict(target)
    with torch.no_grad():
        loss, _ = sd.train.objectives.lcm.lcm_loss(step.objective, sd.train.step.loss_context(step), unet, latents, ids,
                                                torch.Generator().manual_seed(0))
    return loss.mean().item()


@pytest.mark.learned
def test_the_consistency_loss_falls_and_the_teacher_is_left_as_it_was(base_model, dataset_16, tmp_path):
    fields = dict(lcm_loss="l2", lr=1e-3, batch_size=4, grad_accum=1, ema_decay=0.0)
    run = train(tmp_path, "run", datasets=[dataset_16], init_from=str(base_model), max_steps=16, validate_every=16,
                **fields)
    assert (run / "samples" / "step_00000016.png").exists()  # the validation grid, sampled with lcm
    folder = run / "checkpoints" / sd.run_folder.step_dir_name(16)
    data = sd.data.training_data.MixedData([sd.data.training_data.join_split(
        dataset_16["dataset"], "train", sd.data.training_data.LatentStore(dataset_16["latents"]))], [1.0])
    latents, ids = data.batch(np.arange(16))[:2]
    student, target = load_file(str(folder / "unet.safetensors")), load_file(str(folder / "lcm_target.safetensors"))
    # The objective with the target network as it ended: the trained student is far closer to it than the
    # student it started as (the teacher). Measured: 0.50 -> 0.12.
    start, trained = (fixed_draw_loss(fields, s, target, base_model, latents, ids) for s in (None, student))
    at_most("consistency loss against the target, trained / start", trained / start, 0.5, (start, trained))
    # Self-consistency, each model its own target (what makes few steps work): measured 0.045 -> 0.020.
    start, trained = (fixed_draw_loss(fields, s, s, base_model, latents, ids) for s in (None, student))
    at_most("self-consistency loss, trained / start", trained / start, 0.75, (start, trained))
    teacher = sd.model.build_unet("tiny", from_scratch=False)
    sd.formats.load_unet_weights(str(base_model), teacher)
    saved_base = load_file(str(folder / "lora_base.safetensors"))["fingerprint"]
    assert torch.equal(saved_base, sd.run_folder.weights_fingerprint(list(teacher.parameters())))


def test_an_exported_lcm_lora_sampled_by_diffusers_lcm_scheduler_gives_our_images(base_model, dataset_16, tmp_path):
    from diffusers import LCMScheduler, StableDiffusionPipeline

    run = train(tmp_path, "run", datasets=[dataset_16], init_from=str(base_model), max_steps=4, lora_rank=4,
                lora_alpha=8.0, lora_targets=["transformer", "resnet"])
    folder = tmp_path / "lcm_lora"
    assert SD_ImageGen.main(["--ckpt", str(run), "--export_lora", str(folder), "--lora_format", "diffusers"]) == 0
    assert SD_ImageGen.main(["--ckpt", str(run), "--export_lora", str(tmp_path / "lcm_kohya.safetensors")]) == 0
    assert any(k.startswith("lora_unet_") for k in load_file(str(tmp_path / "lcm_kohya.safetensors")))
    out = tmp_path / "ours"
    assert SD_ImageGen.main(["--ckpt", str(run), "--prompt", "a red circle", "--sampler", "lcm", "--steps", "4",
                             "--seed", "3", "--n", "2", "--height", "64", "--width", "64", "--device", "cpu",
                             "--out", str(out)]) == 0
    ours = [np.asarray(Image.open(out / f"000_00000{seed}.png").convert("RGB")).astype(int) for seed in (3, 4)]
    # Without --sampler and --steps, the run's distill: lcm chooses LCM's 4 steps: the same pictures.
    assert SD_ImageGen.main(["--ckpt", str(run), "--prompt", "a red circle", "--seed", "3", "--n", "2", "--height",
                             "64", "--width", "64", "--device", "cpu", "--out", str(tmp_path / "auto")]) == 0
    assert "\nSteps: 4, Sampler: lcm, CFG scale: 1.0, Seed: 3," in sd.sampling.read_parameters(tmp_path / "auto" / "000_000003.png")
    for seed, image in zip((3, 4), ours):
        assert np.array_equal(np.asarray(Image.open(tmp_path / "auto" / f"000_00000{seed}.png").convert("RGB")), image)

    pipe = StableDiffusionPipeline.from_pretrained(str(base_model), safety_checker=None, requires_safety_checker=False,
                                                   local_files_only=True)
    pipe.scheduler = LCMScheduler.from_config(sd.model.noise_schedule_config("epsilon"))
    pipe.load_lora_weights(str(folder))
    generators = [torch.Generator().manual_seed(seed) for seed in (3, 4)]
    theirs = pipe(["a red circle"] * 2, num_inference_steps=4, guidance_scale=1.0, generator=generators, height=64,
                  width=64, output_type="np").images
    theirs = [np.round(image * 255).astype(int) for image in theirs]
    base_only = StableDiffusionPipeline.from_pretrained(str(base_model), safety_checker=None,
                                                        requires_safety_checker=False, local_files_only=True)
    base_only.scheduler = pipe.scheduler
    plain = base_only(["a red circle"] * 2, num_inference_steps=4, guidance_scale=1.0, height=64, width=64,
                      generator=[torch.Generator().manual_seed(seed) for seed in (3, 4)], output_type="np").images
    for mine, other, without in zip(ours, theirs, plain):
        assert np.abs(mine - other).max() <= 1  # the rounding of the last step to 8 bits
        assert np.abs(mine - np.round(without * 255)).max() > 8  # the adapter is in both: the check could fail

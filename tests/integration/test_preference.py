"""Diffusion-DPO runs (``preference.method: dpo``) on the tiny presets: exact resume of a DPO LoRA and of a whole
UNet against its frozen copy, refused changes on resume, the implicit reward logged and rising, a loss that
falls, the rejected latents read beside the preferred ones, and the memory estimate's reference."""

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.torch import load_file

import torch

import sd.data.training_data
import sd.model
import sd.run_folder
import sd.train.memory
import sd.train.modes
import sd.train.recovery
import sd.train.step
import SD_ImageGen
import SD_Train
from sd.train.config import TrainConfig

from data_factory import BASE, assert_bitwise_equal, checkpoint_state, make_captions, make_latents, make_pairs
from sd.distributed import Dist
from margins import at_least

pytestmark = pytest.mark.slow
DPO = dict(BASE, preference={"method": "dpo", "beta": 500.0}, min_snr_gamma=0.0, cfg_dropout=0.0, lr=1e-3,
           warmup_steps=0, batch_size=2, grad_accum=2, ema_decay=0.0)
WEIGHTS = ("unet", "adapter", "ema", "lora_base")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict:
    return make_pairs(tmp_path_factory.mktemp("pairs"))


@pytest.fixture(scope="module")
def base_model(pairs, tmp_path_factory) -> Path:
    """The reference: a tiny model trained on both images of every pair under its caption, so it draws either
    (as a released model draws good and bad images of a prompt), which DPO then tells apart."""
    root = tmp_path_factory.mktemp("base")
    store = sd.data.training_data.LatentStore(pairs["latents"], rejected=True)
    keys = [f"w{k}" for k in store.keys] + [f"l{k}" for k in store.keys]
    latents = np.concatenate([np.concatenate(store.arrays), np.concatenate(store.rejected)])
    make_latents(root / "latents", keys, latents)
    train_rows = caption_rows(pairs["dataset"])
    make_captions(root / "captions", [(f"{side}{k}", c) for side in "wl" for k, c in train_rows], [])
    config = root / "sft.yaml"
    config.write_text(yaml.safe_dump({**BASE, "datasets": [{"dataset": str(root / "captions"),
                                                            "latents": str(root / "latents")}],
                                      "max_steps": 150, "lr": 3e-3, "batch_size": 8, "grad_accum": 1,
                                      "warmup_steps": 0, "ema_decay": 0.0, "out_dir": str(root / "run")}))
    assert SD_Train.main(["--config", str(config)]) == 0
    return root / "run"


def caption_rows(dataset: str) -> list[tuple[str, str]]:
    from datasets import load_from_disk

    split = load_from_disk(dataset)["train"]
    return list(zip(split["key"], split["caption"]))


def train(tmp_path: Path, name: str, *flags: str, **fields) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**DPO, "out_dir": str(tmp_path / name), **fields}))
    assert SD_Train.main(["--config", str(path), *flags]) == 0
    return tmp_path / name


def records_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_dpo_lora_stopped_and_resumed_equals_the_straight_run_bit_for_bit(base_model, pairs, tmp_path):
    common = dict(datasets=[pairs], init_from=str(base_model), max_steps=6, lora_rank=4)
    straight = train(tmp_path, "a", **common)
    train(tmp_path, "b", "--stop_at_step", "3", **common)  # mid-epoch (4 steps an epoch)
    resumed = train(tmp_path, "b", **common)
    a, b = checkpoint_state(straight, 6, WEIGHTS), checkpoint_state(resumed, 6, WEIGHTS)
    assert_bitwise_equal(a, b)
    assert any(".lora_" in k for k in a) and not any(k.startswith("unet.") for k in a)
    records = records_of(straight)
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    for record in records:
        assert 0.0 <= record["reward_accuracy"] <= 1.0 and np.isfinite(record["reward_margin"])
        assert record["model_mse"] > 0 and record["reference_mse"] > 0
    # At the first step the model is its reference: every implicit reward is 0, the loss log 2.
    assert records[0]["reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert records[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)


def test_a_whole_unet_dpo_resumes_bit_for_bit_and_refuses_a_changed_beta(base_model, pairs, tmp_path, capsys):
    common = dict(datasets=[pairs], init_from=str(base_model), max_steps=4)
    straight = train(tmp_path, "a", **common)
    train(tmp_path, "b", "--stop_at_step", "2", **common)
    resumed = train(tmp_path, "b", **common)
    assert_bitwise_equal(checkpoint_state(straight, 4, WEIGHTS), checkpoint_state(resumed, 4, WEIGHTS))
    out = tmp_path / "dpo.safetensors"  # a model tuned on pairs says so in its single file's header
    assert SD_ImageGen.main(["--ckpt", str(straight), "--export_single_file", str(out)]) == 0
    from safetensors import safe_open

    with safe_open(str(out), "pt") as file:
        assert json.loads(file.metadata()["sd_preference"])["method"] == "dpo"
    path = tmp_path / "changed.yaml"
    path.write_text(yaml.safe_dump({**DPO, **common, "out_dir": str(tmp_path / "b"), "max_steps": 6,
                                    "preference": {"method": "dpo", "beta": 1000.0}}))
    capsys.readouterr()
    assert SD_Train.main(["--config", str(path)]) == 2
    assert "preference.beta" in capsys.readouterr().err


def fixed_draw_losses(fields: dict, pairs: dict, weights: dict | None) -> np.ndarray:
    """Each training pair's DPO loss under 8 fixed draws of noise and timesteps, the model's trained weights
    ``weights`` (None: as it starts, its reference) loaded."""
    config = TrainConfig(**fields)
    mode = sd.train.modes.mode_of(config)
    text_encoder = sd.model.load_text_encoder("tiny")
    unet = sd.model.build_unet("tiny", from_scratch=False)
    sd.train.recovery.load_base(config.init_from, unet)
    unet = mode.attach(unet, text_encoder)
    step = sd.train.step.build_step(config, Dist.single(), unet, text_encoder,
                                    sd.model.tokenize(sd.model.load_tokenizer("tiny"), [""]),
                                    sd.model.SD1_SCALING_FACTOR, mode)
    if weights is not None:
        mode.trained_weights(step)["adapter"].load_state_dict(weights)
    store = sd.data.training_data.LatentStore(pairs["latents"], rejected=True)
    data = sd.data.training_data.MixedData([sd.data.training_data.join_split(pairs["dataset"], "train", store)], [1.0])
    latents, ids, rejected = data.batch(np.arange(len(data)))
    with torch.no_grad():
        return np.concatenate([sd.train.step.compute_loss(step, unet, latents, ids, torch.Generator().manual_seed(seed),
                                                          rejected=rejected)[0].numpy() for seed in range(8)])


@pytest.mark.learned
def test_dpo_prefers_the_preferred_images_under_draws_it_never_trained_on(base_model, pairs, tmp_path):
    fields = dict(DPO, datasets=[pairs], init_from=str(base_model), max_steps=200, lora_rank=8, lora_targets=["attention", "resnet"], grad_accum=1,
                  batch_size=4, save_steps=200, out_dir=str(tmp_path / "run"))
    run = train(tmp_path, "run", **fields)
    before = fixed_draw_losses(fields, pairs, None)
    assert np.allclose(before, np.log(2), atol=1e-6)  # the model starts as its reference: every reward 0
    folder = run / "checkpoints" / sd.run_folder.step_dir_name(200)
    after = fixed_draw_losses(fields, pairs, load_file(str(folder / "adapter.safetensors")))
    # The implicit reward prefers the preferred image of most pairs, on noise and timesteps drawn afresh.
    # Measured: loss 0.693 -> 0.42, accuracy 0.5 -> 0.77 (16 pairs x 8 draws).
    at_least("implicit reward accuracy, 128 fixed draws", float((after < np.log(2)).mean()), 0.65)
    assert after.mean() < 0.6, after.mean()
    records = records_of(run)
    assert np.mean([r["reward_accuracy"] for r in records[-50:]]) > np.mean([r["reward_accuracy"] for r in records[:50]])
    # The exported LoRA says in its header what trained it.
    out = tmp_path / "dpo.safetensors"
    assert SD_ImageGen.main(["--ckpt", str(run), "--export_lora", str(out)]) == 0
    from safetensors import safe_open

    with safe_open(str(out), "pt") as file:
        header = file.metadata()
    assert "Diffusion-DPO" in header["ss_training_comment"]
    assert json.loads(header["sd_preference"]) == {"method": "dpo", "beta": 500.0, "loss": "sigmoid",
                                                   "reference": "run"}


def test_a_latent_folder_without_rejected_latents_is_refused_naming_it(base_model, pairs, tmp_path, capsys):
    from data_factory import make_dataset

    plain = make_dataset(tmp_path / "plain", n_train=8, n_val=0)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**DPO, "datasets": [plain], "init_from": str(base_model), "max_steps": 2,
                                    "lora_rank": 4, "out_dir": str(tmp_path / "run")}))
    capsys.readouterr()
    assert SD_Train.main(["--config", str(path)]) != 0
    err = capsys.readouterr().err
    assert "preference.method: dpo: 1 latent shards in" in err and "encode_latents.py --pairs" in err


@pytest.mark.parametrize("fields, message", [
    (dict(min_snr_gamma=5.0), "set min_snr_gamma: 0"),
    (dict(flip=True), "data.flip"),
    (dict(distill="lcm"), "distill.method"),
    (dict(preference={"method": "dpo", "loss": "kto"}), "preference.loss: one of sigmoid, hinge, ipo"),
    (dict(init_from=""), "set init_from"),
])
def test_settings_dpo_cannot_train_with_are_refused_before_any_work(fields, message, base_model, pairs, tmp_path):
    from sd.cli import ConfigError

    values = {**DPO, "datasets": [pairs], "init_from": str(base_model), "out_dir": str(tmp_path / "run"), **fields}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        TrainConfig(**values).validate()
    assert not (tmp_path / "run").exists()


def test_the_memory_estimate_counts_the_reference_and_the_doubled_batch(tmp_path):
    def estimate(**fields):
        config = TrainConfig(**{**DPO, "datasets": [], "unet": "tiny", "batch_size": 2, "grad_accum": 1,
                                 "precision": "bf16", **fields})
        return sd.train.memory.estimate(config, resolution=64, device="cuda")

    whole_dpo = estimate(init_from="x")
    whole_plain = estimate(preference={"method": ""}, min_snr_gamma=5.0)
    lora_dpo = estimate(init_from="x", lora_rank=4)
    lora_plain = estimate(preference={"method": ""}, lora_rank=4)
    assert whole_dpo.parts.get("reference", 0) > 0 and "reference" not in lora_dpo.parts
    # a frozen copy in the autocast type (bf16 here): half the fp32 weights
    assert whole_dpo.parts["reference"] == pytest.approx(whole_dpo.parts["weights"] / 2, rel=0.05)
    # two images a pair with gradients, and the reference's pass: activations at least twice the plain step's
    at_least("DPO / plain activations (LoRA)", lora_dpo.parts["activations_and_temporaries"]
             / lora_plain.parts["activations_and_temporaries"], 1.8)
    assert whole_dpo.allocated > whole_plain.allocated + whole_dpo.parts["reference"]


def test_exported_lora_loads_in_samplers_and_its_rejected_latents_stay_out_of_validation(base_model, pairs, tmp_path):
    run = train(tmp_path, "run", datasets=[pairs], init_from=str(base_model), max_steps=2, lora_rank=4,
                validate_every=2, lora_type="loha")
    assert (run / "samples" / "step_00000002.png").exists()
    records = records_of(run)
    assert "val_loss" in records[-1] and np.isfinite(records[-1]["val_loss"])
    folder = run / "checkpoints" / sd.run_folder.step_dir_name(2)
    assert any(".hada_" in k for k in load_file(str(folder / "adapter.safetensors")))

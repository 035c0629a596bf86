"""LoRA and DreamBooth training on the tiny presets: what trains, what the checkpoints hold, exact resume,
the prior-preservation loss, noise offset, 8-bit AdamW and cached text embeddings."""

import datetime
import json
import logging
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

import sd.data.dreambooth
import sd.data.training_data
import sd.formats
import sd.lora.adapters
import sd.lora.dora
import sd.lora.formats
import sd.model
import sd.original_layout
import sd.run_folder
import sd.sampling
import sd.train.checkpoint as ckpt
import sd.train.recovery
import sd.train.config
import sd.train.config_loading
import sd.train.ema
import sd.train.objectives
import sd.train.step
import SD_Train
from sd.distributed import Dist

from data_factory import BASE, assert_bitwise_equal, make_base_pipeline

LORA = dict(BASE, lora_rank=4, lora_alpha=8.0, lora_dropout=0.25, lr=1e-2, warmup_steps=0, ema_decay=0.9,
            cfg_dropout=0.1, batch_size=2, grad_accum=2)


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    return make_base_pipeline(tmp_path_factory.mktemp("base") / "pipeline")


@pytest.fixture(scope="module")
def data(dataset_16):
    return dataset_16


def write_config(path: Path, **fields) -> Path:
    path.write_text(yaml.safe_dump({**LORA, **fields}))
    return path


def base_unet(folder: Path):
    unet = sd.model.build_unet("tiny", from_scratch=False)
    sd.formats.load_unet_weights(str(folder), unet)
    return unet


def run_state(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint holds: adapter, EMA, optimizer moments, every RNG."""
    folder = run_dir / "checkpoints" / sd.run_folder.step_dir_name(step)
    tensors = {f"adapter.{k}": v for k, v in load_file(folder / "adapter.safetensors").items()}
    tensors.update({f"ema.{k}": v for k, v in load_file(folder / "ema.safetensors").items()})
    for index, state in torch.load(folder / "optimizer.pt", weights_only=True)["state"].items():
        for name, value in state.items():  # bitsandbytes nests its quantisation state one level down
            for inner, tensor in (value.items() if isinstance(value, dict) else [("", value)]):
                tensors[f"opt.{index}.{name}.{inner}"] = torch.as_tensor(tensor)
    rng = torch.load(folder / "rng_rank0.pt", weights_only=True)["rng"]
    tensors.update({"rng.torch": rng["torch"], "rng.noise": rng["noise"]})
    return tensors


@pytest.mark.slow  # 7 s: the full suite's
def test_lora_trains_the_adapter_only_and_resumes_bitwise_with_adapter_dropout(tmp_path, base_model, data):
    # bitsandbytes' 8-bit moments, the noise offset's extra draws and the blocks' parameter groups are part of
    # the resumed state too
    fields = dict(datasets=[data], init_from=str(base_model), max_steps=6, optimizer="adamw8bit", noise_offset=0.1,
                  down_lr_scale=0.5, up_lr_scale=2.0)
    straight = write_config(tmp_path / "a.yaml", out_dir=str(tmp_path / "a"), **fields)
    assert SD_Train.main(["--config", str(straight)]) == 0
    stopped = write_config(tmp_path / "b.yaml", out_dir=str(tmp_path / "b"), **fields)
    assert SD_Train.main(["--config", str(stopped), "--stop_at_step", "3"]) == 0  # mid-epoch (4 steps an epoch)
    assert SD_Train.main(["--config", str(stopped)]) == 0
    assert_bitwise_equal(run_state(tmp_path / "a", 6), run_state(tmp_path / "b", 6))

    folder = tmp_path / "a" / "checkpoints" / sd.run_folder.step_dir_name(6)
    assert not (folder / "unet.safetensors").exists()
    adapter = load_file(folder / "adapter.safetensors")
    assert adapter and all(sd.lora.adapters.is_adapter_name(k) and k.startswith("unet.") for k in adapter)
    assert all(sd.lora.adapters.is_adapter_name(k) for k in load_file(folder / "ema.safetensors"))
    assert sum(v.numel() for v in adapter.values()) < 0.1 * sum(v.numel() for v in base_unet(base_model).parameters())
    assert any(k.endswith("lora_B.default.weight") and v.abs().max() > 0 for k, v in adapter.items())  # it trained
    optimizer = torch.load(folder / "optimizer.pt", weights_only=True)
    assert "__bnb_optimizer_quant_state__" in optimizer["state"][0]
    assert [g["name"] for g in optimizer["param_groups"]] == ["unet_down", "unet_mid", "unet_up"]  # adapters only

    # The base weights of the trained model are the base model's, bit for bit.
    unet = base_unet(base_model)
    before = {k: v.clone() for k, v in unet.state_dict().items()}
    config = sd.train.config_loading.load_config(["--config", str(straight)])
    run = SD_Train.build(config, Dist.single())
    after = {k.replace(".base_layer", ""): v for k, v in run.step.unet.state_dict().items()
             if not sd.lora.adapters.is_adapter_name(k)}
    assert_bitwise_equal(before, after)
    assert run.state.step == 6  # resumed: the adapter of step 6 is loaded
    assert torch.equal(sd.lora.adapters.adapter_state(run.step.unet)["down_blocks.0.attentions.0.transformer_blocks.0.attn1"
                                                              ".to_q.lora_B.default.weight"],
                       adapter["unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_B.default.weight"])


def test_a_resume_on_another_base_model_is_refused(tmp_path, base_model, data, capsys):
    config = write_config(tmp_path / "a.yaml", datasets=[data], init_from=str(base_model), max_steps=2,
                          out_dir=str(tmp_path / "run"), ema_decay=0.0)
    assert SD_Train.main(["--config", str(config), "--stop_at_step", "1"]) == 0
    other = tmp_path / "other"
    sd.formats.export_diffusers(other, sd.model.build_unet("tiny", seed=4, from_scratch=False),
                                sd.model.load_vae("tiny"), sd.model.load_text_encoder("tiny"),
                                sd.model.load_tokenizer("tiny"))
    assert SD_Train.main(["--config", str(config), "--init_from", str(other)]) == 2
    assert "is not the base model the adapter" in capsys.readouterr().err
    assert (tmp_path / "run" / "checkpoints" / sd.run_folder.step_dir_name(1)).is_dir()  # not set aside as damaged


def test_lora_needs_base_weights(tmp_path, data, capsys):
    config = write_config(tmp_path / "a.yaml", datasets=[data], max_steps=2, out_dir=str(tmp_path / "run"))
    assert SD_Train.main(["--config", str(config)]) == 2
    assert "lora.rank > 0 trains an adapter on existing weights: set init_from" in capsys.readouterr().err


def test_prior_preservation_loss_is_instance_mean_plus_weighted_class_mean():
    settings = sd.train.objectives.LossSettings(prior_preservation=True, prior_loss_weight=0.3)
    objective = sd.train.objectives.Diffusion()
    loss = torch.tensor([1.0, 2.0, 3.0, 10.0, 20.0, 30.0])
    assert objective.reduce(loss, settings).item() == pytest.approx(2.0 + 0.3 * 20.0)
    assert objective.reduce(loss, sd.train.objectives.LossSettings()).item() == pytest.approx(11.0)


def write_images(folder: Path, count: int, colour, size: int = 72) -> Path:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(count)
    for i in range(count):
        image = np.full((size, size - 8, 3), colour, np.uint8)
        top, left = rng.integers(0, size // 2, 2)
        image[top : top + size // 3, left : left + size // 3] = 255
        Image.fromarray(image).save(folder / f"img_{i}.png")
    return folder


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_dreambooth_generates_missing_class_images_and_trains_on_both_halves(tmp_path, base_model, monkeypatch,
                                                                            lora_rank, caplog):
    instance = write_images(tmp_path / "instance", 3, (0, 200, 200))
    (instance / "broken.png").write_bytes(b"not an image")  # skipped and named
    class_dir = write_images(tmp_path / "class", 2, (200, 100, 0))  # two exist already; four more to make
    fields = dict(instance_dir=str(instance), instance_prompt="a sks square", class_dir=str(class_dir),
                  class_prompt="a square", num_class_images=6, prior_loss_weight=0.5, image_size=64,
                  init_from=str(base_model), max_steps=3, lora_rank=lora_rank, cfg_dropout=0.0,
                  out_dir=str(tmp_path / "run"), validate_every=100, validation_prompts=[], validation_data_captions=4,
                  lora_text_encoder=lora_rank > 0)  # a run shorter than validate_every, with no prompts of its own
    config = write_config(tmp_path / "db.yaml", **fields)
    seen = []
    real = sd.train.step.train_step
    monkeypatch.setattr(sd.train.step, "train_step", lambda step, micro, *a, **k: seen.append(micro) or real(
        step, micro, *a, **k))
    caplog.set_level(logging.INFO)
    assert SD_Train.main(["--config", str(config)]) == 0
    made = sorted(p.name for p in class_dir.glob("class_*.png"))
    assert made == [f"class_{i:05d}.png" for i in range(4)]
    assert len(seen) == 3 and all(len(micro) == 2 for micro in seen)
    tokenizer = sd.model.load_tokenizer("tiny")
    instance_ids, class_ids = sd.model.tokenize(tokenizer, ["a sks square", "a square"])
    for latents, ids in (pair for micro in seen for pair in micro):
        assert latents.shape == (4, 4, 8, 8)  # batch 2 of instances, then their 2 class images
        assert all(torch.equal(row, instance_ids) for row in ids[:2])
        assert all(torch.equal(row, class_ids) for row in ids[2:])
    # its last step's grid (once none: the run was shorter than validate_every), of the instance prompt
    assert sorted(p.name for p in (tmp_path / "run" / "samples").iterdir()) == ["step_00000003.png"]
    from PIL import Image

    grid = Image.open(tmp_path / "run" / "samples" / "step_00000003.png")
    assert grid.size == sd.sampling.GridLayout.of(["a sks square"], 1, 64, 64).size
    assert "instance image skipped: " in caplog.text and "broken.png" in caplog.text
    assert f"training samples in instance_dir {fields['instance_dir']}," in caplog.text  # not "0 dataset(s)"
    # the subject folder's latents and log line are named for what they are, whichever mode trains on them
    assert f"subject folder {instance}: 3 images of 'a sks square' at 64 px" in caplog.text
    assert (tmp_path / "run" / "subject_latents" / "instance.safetensors").exists()
    assert not (tmp_path / "run" / "dreambooth").exists() and "DreamBooth:" not in caplog.text
    saved = tmp_path / "run" / "checkpoints" / sd.run_folder.step_dir_name(3)
    if lora_rank:  # the text encoder's adapter trained and is saved beside the UNet's
        adapter = load_file(saved / "adapter.safetensors")
        assert any(k.startswith("text_encoder.") and "lora_B" in k and v.abs().max() > 0 for k, v in adapter.items())
    else:
        assert (saved / "unet.safetensors").exists()
    # The epoch is the 6 class images, each paired with instance i mod 3: all of them in 6 samples.
    data = SD_Train.build(sd.train.config_loading.load_config(["--config", str(config)]), Dist.single()).train_data
    assert len(data) == 6 and data.instance.shape[0] == 3 and data.prior.shape[0] == 6


def test_ctrl_c_during_class_images_keeps_the_finished_ones_and_ends_with_one_line(tmp_path, base_model, monkeypatch,
                                                                                 caplog, capsys):
    instance = write_images(tmp_path / "instance", 2, (0, 200, 200))
    config = write_config(tmp_path / "db.yaml", instance_dir=str(instance), instance_prompt="a sks square",
                          class_dir=str(tmp_path / "class"), class_prompt="a square", num_class_images=20,
                          image_size=64, init_from=str(base_model), max_steps=2, validation_steps=2,
                          out_dir=str(tmp_path / "run"))
    calls = []
    real = sd.sampling.generate

    def generate(*args, **kwargs):  # the second batch is interrupted, as a Ctrl-C would
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(sd.sampling, "generate", generate)
    with caplog.at_level(logging.INFO):
        assert SD_Train.main(["--config", str(config)]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "interrupted (Ctrl-C)" in err and "re-run the same command" in err
    batch = sd.data.dreambooth.GENERATE_BATCH
    assert len(list((tmp_path / "class").glob("class_*.png"))) == batch  # the first batch is kept
    assert "generating 20 class images" in caplog.text and f"stopped after {batch} new ones" in caplog.text
    assert "for the 12 left" in caplog.text  # the time it will take, from the first batch
    parsed = sd.train.config_loading.load_config(["--config", str(config)])
    assert len(sd.data.dreambooth.missing_class_images(sd.data.dreambooth.DreamBoothSettings.from_config(parsed))) \
        == 20 - batch  # a re-run makes only the rest


@pytest.fixture(scope="module")
def make_class_images(base_model):
    """``make(folder, count, **fields)``: ``ensure_class_images`` with the base model, as a DreamBooth run calls it."""
    pipeline = sd.sampling.Pipeline(base_unet(base_model), sd.model.load_vae("tiny"),
                                    sd.model.load_text_encoder("tiny"), sd.model.load_tokenizer("tiny"), "epsilon")

    def make(folder: Path, count: int, **fields) -> int:
        config = sd.train.config.TrainConfig(**{**BASE, "datasets": [], "class_dir": str(folder),
                                               "class_prompt": "a square", "num_class_images": count,
                                               "image_size": 64, "init_from": str(base_model), **fields})
        settings = sd.data.dreambooth.DreamBoothSettings.from_config(config)
        return sd.data.dreambooth.ensure_class_images(settings, Dist.single(), pipeline)

    return make


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_class_images_made_in_two_runs_are_the_files_of_one_run(tmp_path, make_class_images):
    """A class-image run stopped after 3 images and resumed (or asked for fewer first) writes the very
    files of one run that makes all 10: each image depends on its index alone, not on its batch."""
    assert make_class_images(tmp_path / "once", 10) == 10
    assert make_class_images(tmp_path / "twice", 3) == 3
    assert make_class_images(tmp_path / "twice", 10) == 7
    once, twice = folder_bytes(tmp_path / "once"), folder_bytes(tmp_path / "twice")
    assert sorted(twice) == sorted(once) and [name for name in once if twice[name] != once[name]] == []


def test_class_images_of_other_settings_are_made_again_unless_the_folder_holds_the_users(tmp_path, make_class_images,
                                                                                       caplog):
    folder = tmp_path / "class"
    make_class_images(folder, 3, class_prompt="a photo of dog")
    dogs = folder_bytes(folder)
    assert json.loads(dogs.pop("class_images.json"))["class_prompt"] == "a photo of dog"
    assert make_class_images(folder, 3, class_prompt="a photo of dog") == 0  # the same settings: kept
    # Another class_prompt: the folder holds only generated images, which are made again for it.
    assert make_class_images(folder, 3, class_prompt="a photo of cat") == 3
    cats = folder_bytes(folder)
    assert json.loads(cats.pop("class_images.json"))["class_prompt"] == "a photo of cat"
    assert sorted(cats) == sorted(dogs) and cats != dogs
    assert ("class images were generated with class_prompt 'a photo of dog', not 'a photo of cat': generating them "
            "again") in caplog.text
    # With an image of the user's beside them, a change is refused in one line and nothing is deleted.
    write_images(folder, 1, (0, 200, 200))
    before = folder_bytes(folder)
    with pytest.raises(sd.data.training_data.DataError) as refused:
        make_class_images(folder, 3, class_prompt="a photo of dog", validation_steps=4)
    assert str(refused.value) == (
        f"subject.class_dir {folder}: its 3 generated class images (class_*.png) were made with class_prompt 'a photo of cat', "
        "not 'a photo of dog' (class_images.json), and it holds 1 other images (e.g. img_0.png), which are never "
        "deleted: use another subject.class_dir, or delete the class_*.png files to have them made again")
    assert folder_bytes(folder) == before


def test_prior_preservation_step_loss_equals_the_hand_computed_composition(tmp_path, base_model):
    """One step's reported loss: mean MSE of the instance half + w x mean MSE of the class half,
    recomputed here from the same noise and timesteps with a plain UNet call."""
    config = sd.train.config.TrainConfig(**{**LORA, "lora_rank": 0, "instance_dir": str(tmp_path), "instance_prompt": "x",
                                           "class_dir": str(tmp_path), "class_prompt": "y", "prior_loss_weight": 0.3,
                                           "min_snr_gamma": 0.0, "cfg_dropout": 0.0, "ema_decay": 0.0})
    d = Dist.single()
    unet = base_unet(base_model)
    tokenizer, encoder = sd.model.load_tokenizer("tiny"), sd.model.load_text_encoder("tiny")
    rng = np.random.default_rng(0)
    data = sd.data.dreambooth.DreamBoothData(rng.normal(size=(2, 4, 8, 8)).astype(np.float16),
                                        sd.model.tokenize(tokenizer, ["a sks dog"]),
                                        rng.normal(size=(3, 4, 8, 8)).astype(np.float16),
                                        sd.model.tokenize(tokenizer, ["a dog"]))
    step = sd.train.step.build_step(config, d, unet, encoder, sd.model.tokenize(tokenizer, [""]), 1.0)
    latents, ids = data.batch(np.array([0, 1]))
    generator = torch.Generator().manual_seed(5)
    replay = torch.Generator().set_state(generator.get_state())
    step.noise_generator = generator
    result = sd.train.step.train_step(step, [(latents, ids)], 0)

    unet_before = base_unet(base_model)
    x0 = latents.float()
    noise = torch.randn(x0.shape, generator=replay)
    t = sd.model.sample_timesteps(4, replay)
    abar = sd.model.ddpm_alphas_cumprod()[t].float()[:, None, None, None]
    noisy = abar.sqrt() * x0 + (1 - abar).sqrt() * noise
    with torch.no_grad():
        pred = unet_before(noisy, t, encoder_hidden_states=sd.model.encode_prompt_ids(encoder, ids)).sample
    per_sample = ((pred - noise) ** 2).mean(dim=(1, 2, 3))
    expected = per_sample[:2].mean() + 0.3 * per_sample[2:].mean()
    assert result["loss"] == pytest.approx(expected.item(), rel=1e-5)


def test_cached_prompt_embeddings_give_the_same_step_with_the_text_encoder_off_the_device(base_model):
    config = sd.train.config.TrainConfig(**{**LORA, "lora_rank": 0, "cfg_dropout": 0.5, "ema_decay": 0.0})
    tokenizer = sd.model.load_tokenizer("tiny")
    ids = sd.model.tokenize(tokenizer, ["a red circle", "a blue square", "a red circle", "a green star"])
    latents = torch.randn(4, 4, 8, 8, generator=torch.Generator().manual_seed(0)).half()
    results = []
    for cached in (False, True):
        step = sd.train.step.build_step(config, Dist.single(), base_unet(base_model), sd.model.load_text_encoder("tiny"),
                                       sd.model.tokenize(tokenizer, [""]), 1.0)
        if cached:
            step.text_cache = sd.train.step.TextCache.build(step.text_encoder, ids, "fp32", torch.device("cpu"))
            assert len(step.text_cache.embeddings) == 3  # distinct prompts
            step.text_encoder = None  # never called
        results.append(sd.train.step.train_step(step, [(latents, ids)], 0)["loss"])
    assert results[0] == results[1]
    with pytest.raises(KeyError, match="not in the text-embedding cache"):
        step.text_cache.lookup(sd.model.tokenize(tokenizer, ["a yellow star"]))


def test_adamw8bit_keeps_one_byte_moments_for_large_tensors():
    config = sd.train.config.TrainConfig(**{**LORA, "optimizer": "adamw8bit"})
    big, small = torch.nn.Parameter(torch.randn(128, 64)), torch.nn.Parameter(torch.randn(4, 32))
    optimizer = sd.train.step.build_optimizer([big, small], config)
    (big.square().sum() + small.square().sum()).backward()
    optimizer.step()
    assert optimizer.state[big]["state1"].dtype == torch.uint8 and optimizer.state[big]["state2"].dtype == torch.uint8
    assert optimizer.state[small]["state1"].dtype == torch.float32  # bitsandbytes keeps small tensors in fp32


def test_adamw_without_its_fused_kernel_says_so_once_on_the_foreach_version(monkeypatch, caplog):
    original = torch.optim.AdamW

    def adamw(params, fused=None, **kwargs):
        if fused:
            raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of supported devices")
        return original(params, fused=fused, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", adamw)
    monkeypatch.setattr(sd.train.step, "FUSED_FALLBACK_LOGGED", False)
    config = sd.train.config.TrainConfig(**LORA)
    with caplog.at_level(logging.INFO, logger="sd_train"):
        optimizers = [sd.train.step.build_optimizer([torch.nn.Parameter(torch.randn(4, 4))], config) for _ in range(2)]
    assert [o.defaults["foreach"] for o in optimizers] == [True, True] and not optimizers[0].defaults["fused"]
    said = [r.getMessage() for r in caplog.records if "fused" in r.getMessage()]
    assert len(said) == 1 and "cpu float32: `fused=True` requires" in said[0] and "host waits" in said[0], said


def test_an_optimizer_state_of_one_group_loads_into_the_unet_and_text_encoder_groups():
    """A LoRA run with a text adapter checkpointed before each model had its own group: its one group is split
    in order, and the moments land on the same parameters."""
    import sd.train.optimizers

    config = sd.train.config.TrainConfig(**LORA)
    unet_params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    text_params = [torch.nn.Parameter(torch.randn(5))]
    old = sd.train.step.build_optimizer(unet_params + text_params, config)
    sum(p.square().sum() for p in unet_params + text_params).backward()
    old.step()
    new = sd.train.step.build_optimizer([{"name": "unet", "lr": 1e-2, "params": unet_params},
                                         {"name": "text_encoder", "lr": 1e-3, "params": text_params}], config)
    sd.train.optimizers.OptimizerState(new).load_state_dict(old.state_dict())
    assert [g["name"] for g in new.param_groups] == ["unet", "text_encoder"]
    assert [len(g["params"]) for g in new.param_groups] == [2, 1]
    assert all(torch.equal(new.state[p]["exp_avg"], old.state[p]["exp_avg"]) for p in unet_params + text_params)


def test_a_text_cache_too_large_is_refused_before_encoding():
    encoder = sd.model.load_text_encoder("tiny")
    ids = np.arange(10 * 77).reshape(10, 77) % 1000
    with pytest.raises(MemoryError, match="10 distinct prompts need"):
        sd.train.step.TextCache.build(encoder, ids, "fp32", torch.device("cpu"), max_bytes=10 * 77 * 4)


@pytest.mark.parametrize("name", ["lora", "dreambooth_lora", "textual_inversion", "pivotal_tuning"])
def test_fine_tuning_recipes_load(name):
    path = Path(__file__).resolve().parents[2] / "configs" / "finetune" / f"{name}.yaml"
    config = sd.train.config_loading.load_config(["--config", str(path)], check_paths=False)
    assert config.init_from and config.precision == "bf16" and config.grad_checkpointing
    assert bool(config.subject.instance_dir) == (name != "lora")
    if name == "textual_inversion":
        assert config.embedding.token in config.subject.instance_prompt and not config.lora.rank
    elif name == "pivotal_tuning":
        assert config.embedding.token in config.subject.instance_prompt and config.lora.rank == 16
        assert sd.train.step.token_steps(config, config.max_steps) == 500 and not config.cache_text_embeddings
    else:
        assert config.lora.rank == 16 and config.cache_text_embeddings


def test_a_lora_target_that_selects_nothing_stops_before_training(tmp_path, base_model, data, capsys):
    config = write_config(tmp_path / "a.yaml", datasets=[data], init_from=str(base_model), max_steps=2,
                          out_dir=str(tmp_path / "run"), lora_targets=["attention", "to_nowhere"])
    assert SD_Train.main(["--config", str(config)]) == 2
    assert "lora.targets: 'to_nowhere' selects no Linear or Conv2d layer" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow  # over 5 s: the full suite's (make check stays near 3 minutes)
def test_a_trained_lora_run_exports_and_samples_through_sd_imagegen(tmp_path, base_model, data):
    """The trainer's checkpoint layout as SD_ImageGen reads it: the exported kohya file holds the run's
    EMA adapters (UNet and text encoder, both from ema.safetensors), and sampling the run equals sampling
    its merged export."""
    import SD_ImageGen

    config = write_config(tmp_path / "a.yaml", datasets=[data], init_from=str(base_model), max_steps=2,
                          out_dir=str(tmp_path / "run"), lora_text_encoder=True, lora_dropout=0.0)
    assert SD_Train.main(["--config", str(config)]) == 0
    run = str(tmp_path / "run")
    assert SD_ImageGen.main(["--ckpt", run, "--export_lora", str(tmp_path / "k.safetensors"),
                             "--lora_format", "kohya"]) == 0
    unet, encoder = base_unet(base_model), sd.model.load_text_encoder("tiny")
    lora = sd.lora.formats.read_lora(tmp_path / "k.safetensors", unet, encoder)
    saved = tmp_path / "run" / "checkpoints" / sd.run_folder.step_dir_name(2)
    ema, adapter = load_file(saved / "ema.safetensors"), load_file(saved / "adapter.safetensors")
    module = "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k"
    assert torch.equal(lora["unet"][module].up, ema[f"{module}.lora_B.default.weight"])
    assert lora["unet"][module].alpha == 8.0 and lora["unet"][module].rank == 4
    text = [k for k in adapter if k.startswith("text_encoder.") and k.endswith("layers.0.self_attn.q_proj.lora_B.default.weight")]
    assert len(text) == 1 and not torch.equal(ema[text[0]], adapter[text[0]])  # the text adapter's EMA is its own
    assert any(torch.equal(m.up, ema[text[0]]) for name, m in lora["text_encoder"].items()
               if name.endswith("layers.0.self_attn.q_proj"))
    flags = ["--prompt", "a red circle", "--n", "1", "--steps", "2", "--height", "64", "--width", "64"]
    assert SD_ImageGen.main(["--ckpt", run, "--export_diffusers", str(tmp_path / "merged"), *flags,
                             "--out", str(tmp_path / "s1")]) == 0
    assert SD_ImageGen.main(["--ckpt", str(tmp_path / "merged"), *flags, "--out", str(tmp_path / "s2")]) == 0
    from PIL import Image

    first, second = (np.asarray(Image.open(tmp_path / s / "000_000000.png")) for s in ("s1", "s2"))
    assert np.abs(first.astype(int) - second.astype(int)).max() <= 1


def test_cached_dreambooth_latents_are_the_encoded_ones(tmp_path):
    """The VAE's output is channels-last in memory; the cache must hold the same values in the same order
    (a resumed DreamBooth run reads the cache, the first run the fresh encoding)."""
    files = sd.data.dreambooth.image_files(write_images(tmp_path / "images", 3, (200, 40, 40)))
    vae = sd.model.load_vae("tiny")
    fresh = sd.data.dreambooth.latents_of(files, 32, vae, torch.device("cpu"), tmp_path / "c.safetensors", "instance")
    cached = sd.data.dreambooth.latents_of(files, 32, vae, torch.device("cpu"), tmp_path / "c.safetensors", "instance")
    assert fresh.flags["C_CONTIGUOUS"] and np.array_equal(fresh, cached)


def test_full_dreambooth_trains_from_the_weights_that_drew_its_class_images(tmp_path, dataset_16, monkeypatch):
    """A full fine-tune DreamBooth from a run of ours: the class images come from its EMA weights, and the
    run starts training from those same weights (not its live ones); a zero-terminal-SNR base draws its
    class images on its own schedule."""
    from data_factory import train_tiny_run

    source = train_tiny_run(tmp_path / "src", 16, max_steps=2, ema_decay=0.5, prediction_type="v_prediction",
                            zero_terminal_snr=True, save_steps=2, validate_every=0, lr=1e-2)
    folder = source / "checkpoints" / sd.run_folder.step_dir_name(2)
    ema, live = load_file(folder / "ema.safetensors"), load_file(folder / "unet.safetensors")
    assert any(not torch.equal(ema[k], live[k]) for k in ema)
    drawn = {}
    monkeypatch.setattr(sd.data.dreambooth, "ensure_class_images", lambda config, d, pipeline: drawn.update(
        ztsnr=pipeline.zero_terminal_snr, weights={k: v.clone() for k, v in pipeline.unet.state_dict().items()}))
    class_dir = write_images(tmp_path / "class", 2, (200, 100, 0))
    instance_dir = write_images(tmp_path / "i", 2, (0, 200, 200))
    config = write_config(tmp_path / "db.yaml", lora_rank=0, datasets=[], instance_dir=str(instance_dir),
                          instance_prompt="a sks square", class_dir=str(class_dir), class_prompt="a square",
                          num_class_images=2, image_size=64, init_from=str(source), max_steps=1, cfg_dropout=0.0,
                          out_dir=str(tmp_path / "run"), prediction_type="v_prediction", zero_terminal_snr=True,
                          batch_size=1, grad_accum=1)
    run = SD_Train.build(sd.train.config_loading.load_config(["--config", str(config)]), Dist.single())
    assert drawn["ztsnr"] is True
    assert_bitwise_equal(drawn["weights"], ema)
    assert_bitwise_equal(run.step.unet.state_dict(), ema)  # the weights training starts from
    assert_bitwise_equal(dict(zip(run.step.ema.names, run.step.ema.shadow)), ema)


# ------------------------------------------------------------------------------ the text encoder's own schedule, its EMA

TEXT = dict(lora_text_encoder=True, lora_dropout=0.0)


def adapter_tensors(run) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in
            sd.lora.adapters.AdapterWeights(unet=run.step.unet, text_encoder=run.step.text_encoder).state_dict().items()}


def test_the_text_encoder_adapter_steps_with_its_own_learning_rate_and_warm_up(tmp_path, base_model, data):
    """UNet group: lr 1e-2, one warm-up step; text group: 1e-30 (as good as frozen), three. Each group's LR
    follows its own schedule in metrics.jsonl and in the optimizer; the text adapter stays where it started
    while the UNet's moves."""
    config = write_config(tmp_path / "a.yaml", datasets=[data], init_from=str(base_model), max_steps=4, ema_decay=0.0,
                          out_dir=str(tmp_path / "run"), warmup_steps=1, text_encoder_lr=1e-30,
                          text_encoder_warmup_steps=3, **TEXT)
    loaded = sd.train.config_loading.load_config(["--config", str(config)])
    start = adapter_tensors(SD_Train.build(loaded, Dist.single()))
    assert SD_Train.main(["--config", str(config)]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for step, record in enumerate(records):
        assert record["lr"] == pytest.approx(sd.train.step.lr_at(step, 1e-2, 1, 4), rel=1e-12)
        assert record["lr_text_encoder"] == pytest.approx(sd.train.step.lr_at(step, 1e-30, 3, 4), rel=1e-12)
    assert records[0]["lr_text_encoder"] == pytest.approx(1e-32) and records[3]["lr"] < records[1]["lr"]

    resumed = SD_Train.build(sd.train.config_loading.load_config(["--config", str(config)]), Dist.single())
    groups = {g["name"]: g for g in resumed.step.optimizer.param_groups}
    assert list(groups) == ["unet", "text_encoder"] and resumed.state.step == 4
    assert {name: g["lr"] for name, g in groups.items()} == sd.train.step.lrs_at(resumed.config, 3, 4)  # the last set
    assert sum(p.numel() for p in groups["text_encoder"]["params"]) == sum(
        p.numel() for p in resumed.step.text_encoder.parameters() if p.requires_grad)
    end = adapter_tensors(resumed)
    moved = {k: (end[k] - start[k]).abs().max().item() for k in start}
    assert max(v for k, v in moved.items() if k.startswith("text_encoder.")) < 1e-25
    assert max(v for k, v in moved.items() if k.startswith("unet.")) > 1e-3


def test_the_text_adapters_ema_is_the_hand_computed_lerp_and_what_a_lora_export_holds(tmp_path, base_model, data):
    import SD_ImageGen

    config = sd.train.config.TrainConfig(**{**LORA, **TEXT, "datasets": [data], "init_from": str(base_model),
                                            "max_steps": 3, "ema_decay": 0.5, "out_dir": str(tmp_path / "run")})
    run = SD_Train.build(config, Dist.single())
    ema = run.step.text_ema
    assert ema is not None and ema.names == list(sd.lora.adapters.adapter_state(run.step.text_encoder))
    params = dict(run.step.text_encoder.named_parameters())
    shadow = [params[n].detach().double().clone() for n in ema.names]
    for i in range(3):
        sd.train.step.train_step(run.step, [run.train_data.batch(np.arange(2 * i, 2 * i + 2))], i)
        weight = 1 - sd.train.ema.ema_decay_at(i, 0.5)
        shadow = [s + weight * (params[n].detach().double() - s) for s, n in zip(shadow, ema.names)]
    assert max((s.double() - e).abs().max().item() for s, e in zip(ema.shadow, shadow)) < 1e-6
    assert max((s - params[n]).abs().max().item() for s, n in zip(ema.shadow, ema.names)) > 1e-4  # not the live ones

    run.state.step = 3
    sd.train.recovery.save(run)
    folder = tmp_path / "run" / "checkpoints" / sd.run_folder.step_dir_name(3)
    saved = load_file(folder / "ema.safetensors")
    assert all(torch.equal(saved[f"text_encoder.{n}"], s) for n, s in zip(ema.names, ema.shadow))
    assert SD_ImageGen.main(["--ckpt", str(folder), "--export_lora", str(tmp_path / "k.safetensors")]) == 0
    lora = sd.lora.formats.read_lora(tmp_path / "k.safetensors", base_unet(base_model), sd.model.load_text_encoder("tiny"))
    text_ema = dict(zip(ema.names, ema.shadow))
    assert len(lora["text_encoder"]) == len(ema.names) // 2
    for name, module in lora["text_encoder"].items():
        own = name.removeprefix("text_model.")
        assert torch.equal(module.up, text_ema[f"{own}.lora_B.default.weight"])
        assert torch.equal(module.down, text_ema[f"{own}.lora_A.default.weight"])
    # --no_ema: the live text adapter
    live = sd.formats.load_pipeline(str(folder), use_ema=False)
    assert all(torch.equal(v, params[k]) for k, v in sd.lora.adapters.adapter_state(live.text_encoder).items())


def test_a_checkpoint_whose_ema_predates_the_text_adapters_starts_that_ema_from_the_resumed_adapter(
        tmp_path, base_model, data, caplog):
    config = write_config(tmp_path / "a.yaml", datasets=[data], init_from=str(base_model), max_steps=4,
                          out_dir=str(tmp_path / "run"), **TEXT)
    assert SD_Train.main(["--config", str(config), "--stop_at_step", "2"]) == 0
    folder = tmp_path / "run" / "checkpoints" / sd.run_folder.step_dir_name(2)
    ema = load_file(folder / "ema.safetensors")
    ckpt.save_weights({k: v for k, v in ema.items() if not k.startswith("text_encoder.")}, folder / "ema.safetensors")
    (folder / sd.run_folder.MANIFEST).unlink()  # as an older version wrote it
    with caplog.at_level(logging.INFO, logger="sd_train"):
        run = SD_Train.build(sd.train.config_loading.load_config(["--config", str(config)]), Dist.single())
    assert run.state.step == 2
    assert any("EMA of the text encoder's adapter starts from the weights of" in r.getMessage() for r in caplog.records)
    live = dict(run.step.text_encoder.named_parameters())
    assert all(torch.equal(s, live[n]) for n, s in zip(run.step.text_ema.names, run.step.text_ema.shadow))
    assert all(torch.equal(s, ema[n]) for n, s in zip(run.step.ema.names, run.step.ema.shadow))


def checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every value a checkpoint holds, by a flat name (plain numbers through their repr)."""
    tensors = {}

    def flatten(value, name):
        if isinstance(value, torch.Tensor):
            tensors[name] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                flatten(item, f"{name}.{key}")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                flatten(item, f"{name}.{i}")
        else:
            tensors[name] = torch.tensor([hash(repr(value))])

    for path in sorted(folder.iterdir()):
        if path.suffix == ".safetensors":
            tensors.update({f"{path.stem}.{k}": v for k, v in load_file(path).items()})
        elif path.suffix == ".pt":
            flatten(torch.load(path, weights_only=True), path.stem)
    return tensors


@pytest.mark.slow
@pytest.mark.parametrize("optimizer, lr", [("prodigy", 1.0), ("adamw_schedulefree", 1e-2)])
def test_prodigy_and_schedule_free_lora_runs_resume_bitwise_with_the_text_adapter_and_its_ema(
        tmp_path, base_model, data, optimizer, lr):
    """Validation every 2 steps swaps Schedule-Free's evaluation weights in and out: the straight run and the
    one stopped at step 3 still end equal in every saved value (adapters, both EMAs, the optimizer's state and
    groups, RNGs)."""
    fields = dict(datasets=[data], init_from=str(base_model), max_steps=6, optimizer=optimizer, lr=lr, warmup_steps=2,
                  text_encoder_lr=lr if optimizer == "prodigy" else 3e-3, validate_every=2, **TEXT)
    straight = write_config(tmp_path / "a.yaml", out_dir=str(tmp_path / "a"), **fields)
    assert SD_Train.main(["--config", str(straight)]) == 0
    stopped = write_config(tmp_path / "b.yaml", out_dir=str(tmp_path / "b"), **fields)
    assert SD_Train.main(["--config", str(stopped), "--stop_at_step", "3"]) == 0
    assert SD_Train.main(["--config", str(stopped)]) == 0
    a = checkpoint_tensors(tmp_path / "a" / "checkpoints" / sd.run_folder.step_dir_name(6))
    assert_bitwise_equal(a, checkpoint_tensors(tmp_path / "b" / "checkpoints" / sd.run_folder.step_dir_name(6)))
    assert any(k.startswith("ema.text_encoder.") for k in a)
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4, 6]
    if optimizer == "adamw_schedulefree":
        # The adapter file holds x = lerp(y, z, 1 - 1/beta1); optimizer.pt holds y and z; a resume trains on at y.
        resumed = SD_Train.build(sd.train.config_loading.load_config(["--config", str(straight)]), Dist.single())
        live = adapter_tensors(resumed)  # in the optimizer's parameter order
        saved = torch.load(tmp_path / "a" / "checkpoints" / sd.run_folder.step_dir_name(6) / "optimizer.pt", weights_only=True)
        assert len(saved["train_weights"]) == len(live)
        for i, (name, y) in enumerate(zip(live, saved["train_weights"])):
            assert torch.equal(live[name], y), name
            assert torch.equal(a[f"adapter.{name}"], torch.lerp(y, saved["state"][i]["z"], 1 - 1 / 0.9)), name
            assert not torch.equal(a[f"adapter.{name}"], y), name
        assert records[0]["lr"] == pytest.approx(1e-2 / 2) and records[1]["lr"] == records[5]["lr"] == 1e-2
        assert records[0]["lr_text_encoder"] == pytest.approx(3e-3 / 2) and records[5]["lr_text_encoder"] == 3e-3


@pytest.mark.slow
def test_an_exported_lora_says_what_trained_it_as_sd_scripts_and_the_model_spec_do(tmp_path, base_model, data,
                                                                                    caplog):
    """A run stopped at step 2 and resumed to 4, exported: the modelspec keys (a LoRA of SD 1.x, titled by its
    file, the training resolution, the checkpoint's date), sd-scripts' training keys with their values (steps,
    images, tags counted from the captions, folders by their last name: no path of this machine anywhere in
    the header), the content hash AUTOMATIC1111's additional networks index by, and the same modelspec in the
    checkpoint's own weight files; the run's start time survives the resume. The export's log says how
    sd-scripts loads the file (networks.lora, with the network's dim and alpha)."""
    import datasets
    import hashlib

    from safetensors import safe_open

    import SD_ImageGen

    config = write_config(tmp_path / "a.yaml", datasets=[data], init_from=str(base_model), max_steps=4, save_steps=2,
                          out_dir=str(tmp_path / "run"))
    assert SD_Train.main(["--config", str(config), "--stop_at_step", "2"]) == 0
    assert SD_Train.main(["--config", str(config)]) == 0
    first, last = (tmp_path / "run" / "checkpoints" / sd.run_folder.step_dir_name(s) for s in (2, 4))
    times = [sd.run_folder.read_manifest_times(f) for f in (first, last)]
    assert times[0]["started_at"] == times[1]["started_at"] <= times[0]["saved_at"] <= times[1]["saved_at"]
    with safe_open(str(last / "adapter.safetensors"), framework="pt") as handle:
        own = handle.metadata()
    assert (own["modelspec.architecture"], own["modelspec.title"]) == ("stable-diffusion-v1/lora", "run step 4")
    latents = json.loads((Path(data["latents"]) / "latents.json").read_text())
    side = sd.data.training_data.resolution_of_latents(latents)
    assert own["modelspec.resolution"] == f"{side}x{side}" and "modelspec.date" in own

    out = tmp_path / "exports" / "my_style.safetensors"
    caplog.set_level(logging.INFO)
    assert SD_ImageGen.main(["--ckpt", str(tmp_path / "run"), "--export_lora", str(out)]) == 0
    assert (f"sd-scripts loads it with --network_module networks.lora --network_weights {out} --network_dim 4 "
            "--network_alpha 8.0") in caplog.text
    with safe_open(str(out), framework="pt") as handle:
        header = handle.metadata()
    assert {k: header[k] for k in ("modelspec.architecture", "modelspec.implementation", "modelspec.title",
                                   "modelspec.resolution", "modelspec.prediction_type", "modelspec.sai_model_spec")} == {
        "modelspec.architecture": "stable-diffusion-v1/lora", "modelspec.implementation": "diffusers",
        "modelspec.title": "my_style", "modelspec.resolution": f"{side}x{side}", "modelspec.prediction_type": "epsilon",
        "modelspec.sai_model_spec": "1.0.1"}
    assert header["modelspec.date"] == datetime.datetime.fromtimestamp(
        times[1]["saved_at"], datetime.timezone.utc).isoformat(timespec="seconds")
    captions = datasets.load_from_disk(data["dataset"])["train"]["caption"]
    tags = Counter(t.strip() for c in captions for t in c.split(",") if t.strip())
    folder = Path(data["dataset"]).name
    assert {k: header[k] for k in ("ss_output_name", "ss_steps", "ss_epoch", "ss_num_epochs", "ss_num_train_images",
                                   "ss_network_module",
                                   "ss_network_dim", "ss_network_alpha", "ss_base_model_version", "ss_v2",
                                   "ss_learning_rate", "ss_max_train_steps", "ss_resolution", "ss_sd_model_name",
                                   "ss_gradient_accumulation_steps", "ss_batch_size_per_device", "ss_seed")} == {
        "ss_output_name": "my_style", "ss_steps": "4", "ss_epoch": "1", "ss_num_epochs": "1",  # 4 steps an epoch
        "ss_num_train_images": str(len(captions)),
        "ss_network_module": "networks.lora", "ss_network_dim": "4", "ss_network_alpha": "8.0",
        "ss_base_model_version": "sd_v1", "ss_v2": "False", "ss_learning_rate": "0.01", "ss_max_train_steps": "4",
        "ss_resolution": f"({side}, {side})", "ss_sd_model_name": base_model.name,
        "ss_gradient_accumulation_steps": "2", "ss_batch_size_per_device": "2", "ss_seed": str(LORA["seed"])}
    assert json.loads(header["ss_dataset_dirs"]) == {folder: {"n_repeats": 1, "img_count": len(captions)}}
    assert json.loads(header["ss_tag_frequency"]) == {folder: dict(tags)}
    midway = tmp_path / "exports" / "step_2.safetensors"  # half the first epoch: sd-scripts counts it epoch 1
    assert SD_ImageGen.main(["--ckpt", str(first), "--export_lora", str(midway)]) == 0
    with safe_open(str(midway), framework="pt") as handle:
        assert {k: v for k, v in handle.metadata().items() if k in ("ss_steps", "ss_epoch", "ss_num_epochs")} == {
            "ss_steps": "2", "ss_epoch": "1", "ss_num_epochs": "1"}
    assert float(header["ss_training_started_at"]) == times[0]["started_at"]
    assert float(header["ss_training_finished_at"]) == times[1]["saved_at"]
    assert not [k for k, v in header.items() if str(tmp_path) in v or str(Path.home()) in v]
    data_start = 8 + int.from_bytes(out.read_bytes()[:8], "little")
    assert header["sshs_model_hash"] == hashlib.sha256(out.read_bytes()[data_start:]).hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize("kind,dora", [("loha", False), ("lokr", False), ("lora", True)])
def test_a_loha_lokr_or_dora_run_resumes_bitwise_and_its_file_merges_to_what_the_run_samples_with(kind, dora, tmp_path,
                                                                                                  base_model, data):
    """lora_type loha / lokr, and a LoRA with DoRA (on the attention and the ResNet convolutions, the text
    encoder too): 6 steps straight against 3 + 3 resumed, bit for bit; the exported kohya-layout file
    (LyCORIS' key names, dora_scale) read back and merged into the base gives the weights the run itself
    samples with (its layers' merge), and the header names the algorithm."""
    import SD_ImageGen
    from safetensors import safe_open

    fields = dict(datasets=[data], init_from=str(base_model), max_steps=6, lora_type=kind, lora_dropout=0.0,
                  lora_targets=["attention", "resnet"], lora_text_encoder=True, lora_alpha=3.0, dora=dora)
    straight = write_config(tmp_path / "a.yaml", out_dir=str(tmp_path / "a"), **fields)
    assert SD_Train.main(["--config", str(straight)]) == 0
    stopped = write_config(tmp_path / "b.yaml", out_dir=str(tmp_path / "b"), **fields)
    assert SD_Train.main(["--config", str(stopped), "--stop_at_step", "3"]) == 0
    assert SD_Train.main(["--config", str(stopped)]) == 0
    assert_bitwise_equal(run_state(tmp_path / "a", 6), run_state(tmp_path / "b", 6))
    adapter = load_file(tmp_path / "a" / "checkpoints" / sd.run_folder.step_dir_name(6) / "adapter.safetensors")
    prefix = {"loha": "hada_", "lokr": "lokr_", "lora": "lora_"}[kind]
    assert any(f".{prefix}" in k for k in adapter) and (kind == "lora" or not any(".lora_A." in k for k in adapter))
    magnitudes = [k for k in adapter if ".dora_scale." in k]
    assert bool(magnitudes) == dora and all(k.startswith(("unet.", "text_encoder.")) for k in magnitudes)
    if dora:  # the magnitudes trained: they moved from their start, the norms of the base's input channels
        start = sd.formats.load_pipeline(str(base_model)).unet.get_submodule("down_blocks.0.resnets.0.conv1").weight
        trained = adapter["unet.down_blocks.0.resnets.0.conv1.dora_scale.default"]
        assert (trained - sd.lora.dora.input_norm(start.float())).abs().max() > 1e-5

    out = tmp_path / f"{kind}.safetensors"
    assert SD_ImageGen.main(["--ckpt", str(tmp_path / "a"), "--export_lora", str(out)]) == 0
    with safe_open(str(out), framework="pt") as handle:
        header, keys = handle.metadata(), list(handle.keys())
    network_args = {"algo": "locon" if dora else kind, "conv_dim": "4", "conv_alpha": "3.0",
                    **({"factor": "-1"} if kind == "lokr" else {}),
                    **({"dora_wd": "True", "wd_on_output": "False"} if dora else {})}
    assert header["ss_network_module"] == "lycoris.kohya" and json.loads(header["ss_network_args"]) == network_args
    assert any(k.startswith("lora_unet_down_blocks_0_resnets_0_conv1." + prefix) for k in keys)
    assert ("lora_te_text_model_encoder_layers_0_self_attn_q_proj.dora_scale" in keys) == dora
    assert any(k.startswith("lora_te_text_model_encoder_layers_0_self_attn_q_proj.") for k in keys)
    run = sd.formats.load_pipeline(str(tmp_path / "a"))
    sd.lora.formats.merge_adapters(run, [])  # the run's own adapter, merged by PEFT
    plain = sd.formats.load_pipeline(str(base_model))
    sd.lora.formats.merge_adapters(plain, [(str(out), 1.0)])  # the file, merged by our reader
    for part in ("unet", "text_encoder"):
        ours, theirs = getattr(plain, part).state_dict(), getattr(run, part).state_dict()
        assert ours.keys() == theirs.keys()
        worst = max((ours[k].float() - theirs[k].float()).abs().max().item() for k in ours)
        changed = max((ours[k].float() - v.float()).abs().max().item()
                      for k, v in getattr(sd.formats.load_pipeline(str(base_model)), part).state_dict().items())
        assert worst < 1e-5 and changed > 1e-4, (part, worst, changed)
    assert SD_ImageGen.main(["--ckpt", str(tmp_path / "a"), "--export_lora", str(tmp_path / "d"),
                             "--lora_format", "diffusers"]) == 2


def test_a_lokr_run_of_the_earlier_layout_resumes_with_the_scales_it_trained_with(tmp_path, base_model, data, caplog):
    """A LoKr checkpoint that records no layout (written before LyCORIS' layout: PEFT's, which trains a layer of two
    whole factors at alpha / r; every layer of the tiny UNet at rank 4 is one) resumes as it trained: the run
    builds its layers at alpha / r before the optimizer holds them, says so, keeps its checkpoints (none set aside
    as damaged), and records layout 1 in its next; loaded for sampling, its layers are at alpha / r."""
    from safetensors.torch import save_file

    config = write_config(tmp_path / "a.yaml", out_dir=str(tmp_path / "a"), datasets=[data], init_from=str(base_model),
                          max_steps=4, lora_type="lokr", lora_dropout=0.0, lora_alpha=3.0)
    assert SD_Train.main(["--config", str(config), "--stop_at_step", "2"]) == 0
    folder = tmp_path / "a" / "checkpoints" / sd.run_folder.step_dir_name(2)
    adapter = load_file(folder / "adapter.safetensors")
    assert int(adapter.pop(sd.lora.adapters.LAYOUT_KEY)) == sd.lora.adapters.LOKR_LAYOUT == 2
    save_file(adapter, str(folder / "adapter.safetensors"))  # as an earlier version wrote it
    (folder / sd.run_folder.MANIFEST).unlink()
    with caplog.at_level(logging.WARNING):
        assert SD_Train.main(["--config", str(config)]) == 0
    assert "trained with PEFT's layout of its factors (layout 1" in caplog.text
    assert not list((tmp_path / "a" / "checkpoints").glob(f"*{sd.run_folder.DAMAGED_SUFFIX}*"))
    last = load_file(tmp_path / "a" / "checkpoints" / sd.run_folder.step_dir_name(4) / "adapter.safetensors")
    assert int(last[sd.lora.adapters.LAYOUT_KEY]) == 1
    unet = sd.formats.load_pipeline(str(tmp_path / "a")).unet
    layers = sd.lora.adapters.lokr_layers(unet)
    assert layers and all("default" in layer.lokr_w2 and layer.scaling["default"] == 3.0 / 4 for _, layer in layers)


@pytest.mark.slow  # a training run: the full suite's
def test_block_lr_weights_give_each_unet_block_its_group_and_a_zero_block_stays_as_it_started(tmp_path, base_model,
                                                                                             data):
    """optim.block_lr_weights (kohya's down/mid/up_lr_weight in one list of 25): the input blocks at 0, the middle
    block at 1, the output blocks at 2; each block with adapters is a group at lr x its weight."""
    weights = [0.0] * 12 + [1.0] + [2.0] * 12
    config = write_config(tmp_path / "a.yaml", datasets=[data], init_from=str(base_model), max_steps=3, ema_decay=0.0,
                          out_dir=str(tmp_path / "run"), warmup_steps=0, optim={"block_lr_weights": weights})
    loaded = sd.train.config_loading.load_config(["--config", str(config)])
    start = adapter_tensors(SD_Train.build(loaded, Dist.single()))
    assert SD_Train.main(["--config", str(config)]) == 0
    resumed = SD_Train.build(sd.train.config_loading.load_config(["--config", str(config)]), Dist.single())
    groups = {g["name"]: g for g in resumed.step.optimizer.param_groups}
    block_of = sd.original_layout.unet_blocks(resumed.step.unet.config)
    assert set(groups) == {f"unet_{block_of(n)}" for n, p in resumed.step.unet.named_parameters() if p.requires_grad}
    assert set(groups) == {"unet_IN01", "unet_M00", "unet_OUT02", "unet_OUT03"}  # the tiny UNet's attending blocks
    peaks = sd.train.step.group_schedules(resumed.config)
    assert peaks["unet_IN01"][0] == 0.0 and peaks["unet_M00"][0] == 1e-2 and peaks["unet_OUT03"][0] == 2e-2
    end = adapter_tensors(resumed)
    moved = {k: (end[k] - start[k]).abs().max().item() for k in start}
    assert max(v for k, v in moved.items() if k.startswith("unet.down_blocks.")) == 0.0
    assert min(max(v for k, v in moved.items() if k.startswith(f"unet.{part}")) for part in ("mid_block",
                                                                                            "up_blocks")) > 1e-4
    with pytest.raises(sd.train.config.ConfigError, match="both set the UNet blocks' learning rates"):
        sd.train.config_loading.load_config(["--config", str(config), "--optim.up_lr_scale", "2"])
    with pytest.raises(sd.train.config.ConfigError, match="25 numbers >= 0"):
        sd.train.config_loading.load_config(["--config", str(config), "--optim.block_lr_weights", "[1, 2]"])


@pytest.mark.slow  # a training run: the full suite's
def test_block_dims_give_each_block_its_rank_and_leave_a_zero_block_out(tmp_path, base_model, data):
    """lora.block_dims (kohya's): the input blocks 0 (no adapters there), the middle block rank 8 at alpha 4, the
    output blocks rank 2; the run's samples and its exported file rebuild the same layers."""
    import SD_ImageGen

    dims, alphas = [0] * 12 + [8] + [2] * 12, [1.0] * 12 + [4.0] + [2.0] * 12
    config = write_config(tmp_path / "a.yaml", datasets=[data], init_from=str(base_model), max_steps=2, ema_decay=0.0,
                          out_dir=str(tmp_path / "run"), lora_block_dims=dims, lora_block_alphas=alphas)
    assert SD_Train.main(["--config", str(config)]) == 0
    ranks = {}
    for name, tensor in load_file(tmp_path / "run" / "checkpoints" / sd.run_folder.step_dir_name(2)
                                  / "adapter.safetensors").items():
        if name.endswith("lora_A.default.weight"):
            ranks.setdefault(name.split(".")[1], set()).add(tensor.shape[0])
    assert ranks == {"mid_block": {8}, "up_blocks": {2}}  # no down_blocks layer has an adapter
    pipeline = sd.formats.load_pipeline(str(tmp_path / "run"))  # the run's adapters rebuilt from its config
    layers = dict(sd.lora.adapters.lora_layers(pipeline.unet))
    assert {layer.r["default"] for name, layer in layers.items() if name.startswith("mid_block")} == {8}
    assert {layer.lora_alpha["default"] for name, layer in layers.items() if name.startswith("mid_block")} == {4.0}
    out = tmp_path / "blocks.safetensors"
    assert SD_ImageGen.main(["--ckpt", str(tmp_path / "run"), "--export_lora", str(out)]) == 0
    exported = sd.lora.formats.read_lora(out, sd.model.build_unet("tiny", from_scratch=False))
    assert {m.rank for name, m in exported["unet"].items() if name.startswith("up_blocks")} == {2}
    with pytest.raises(sd.train.config.ConfigError, match="lora.block_dims: 25 whole numbers"):
        sd.train.config_loading.load_config(["--config", str(config), "--lora.block_dims", "[1, 2]"])

"""Single files as other tools write them (sd.original_layout): the whole model wherever a model is read, each
model of the architecture its tensors have; a .ckpt's EMA, fp16, text keys without ``text_model.``, position
ids, VAE-only and UNet-only files; training on such a file with its own text encoder and VAE, its parts'
fingerprints checked on resume and sampling, and latents of another VAE refused."""

import json
import logging
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

import sd.data.training_data
import sd.formats
import sd.model
import sd.original_layout
import sd.run_folder
import sd.sampling
import SD_ImageGen
import SD_Train
import sd.train.config_loading

from data_factory import BASE, assert_bitwise_equal

LORA = {**{k: v for k, v in BASE.items() if k not in ("unet", "vae", "text_encoder")},
        "lora": {"rank": 4, "alpha": 8.0}, "lr": 1e-2, "warmup_steps": 0, "max_steps": 2}


def tiny_models(seed: int):
    """A tiny UNet, VAE and text encoder, each with its own random weights (a fine-tuned model's stand-in)."""
    unet = sd.model.build_unet("tiny", seed=seed, from_scratch=False)
    vae = sd.model.load_vae("tiny", seed=seed + 1)
    text_encoder = sd.model.load_text_encoder("tiny", seed=seed + 2)
    return unet, vae, text_encoder


def state_of(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def community(tmp_path_factory):
    """A community checkpoint: one original-layout file whose text encoder and VAE differ from ``tiny``'s."""
    folder = tmp_path_factory.mktemp("community")
    models = tiny_models(seed=11)
    sd.formats.save_single_file(folder / "my_model.safetensors", *models)
    return folder / "my_model.safetensors", models


def test_every_model_of_a_single_file_loads_bit_for_bit_as_its_architecture(community, tmp_path):
    path, (unet, vae, text_encoder) = community
    pipeline = sd.formats.load_pipeline(str(path))  # --arch auto: tiny, by the tensors' shapes
    for ours, theirs in ((pipeline.unet, unet), (pipeline.vae, vae), (pipeline.text_encoder, text_encoder)):
        assert_bitwise_equal(state_of(ours), state_of(theirs))
    assert "single file" in sd.model.loaded_from(pipeline.vae)
    # The same weights as a diffusers folder: every model equal to the single file's.
    sd.formats.export_diffusers(tmp_path / "pipe", unet, vae, text_encoder, sd.model.load_tokenizer("tiny"))
    folder = sd.formats.load_pipeline(str(tmp_path / "pipe"))
    for a, b in ((pipeline.unet, folder.unet), (pipeline.vae, folder.vae), (pipeline.text_encoder, folder.text_encoder)):
        assert_bitwise_equal(state_of(a), state_of(b))
    assert pipeline.tokenizer("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]


def test_fp16_files_load_as_their_fp16_values(community, tmp_path):
    _, (unet, vae, text_encoder) = community
    sd.formats.save_single_file(tmp_path / "half.safetensors", unet, vae, text_encoder, half=True)
    loaded = sd.model.load_text_encoder(str(tmp_path / "half.safetensors"))
    assert "fp16 weights" in sd.model.loaded_from(loaded)
    expected = {k: v.half().float() for k, v in text_encoder.state_dict().items()}
    assert_bitwise_equal(state_of(loaded), expected)
    assert {t.dtype for t in loaded.state_dict().values()} == {torch.float32}


def test_a_ckpt_with_its_ema_gives_the_ema_unless_asked_for_the_live_weights(community, tmp_path, caplog):
    path, (unet, vae, text_encoder) = community
    state = sd.formats.single_file_state_dict(unet, vae, text_encoder)
    ema = {k: v + 1.0 for k, v in unet.state_dict().items()}
    mapping = sd.original_layout.unet_key_map(unet)
    state.update({sd.original_layout.ema_name(mapping[k]): v for k, v in ema.items()})
    state["model_ema.num_updates"] = torch.tensor(100)
    torch.save({"state_dict": state, "global_step": 100}, tmp_path / "full.ckpt")
    assert sd.original_layout.ema_name("model.diffusion_model.input_blocks.0.0.weight") == \
        "model_ema.diffusion_modelinput_blocks00weight"  # the original trainer's naming

    with caplog.at_level(logging.INFO):
        pipeline = sd.formats.load_pipeline(str(tmp_path / "full.ckpt"))
    assert_bitwise_equal(state_of(pipeline.unet), ema)
    assert "its EMA weights, model_ema.*" in caplog.text
    live = sd.formats.load_pipeline(str(tmp_path / "full.ckpt"), use_ema=False)
    assert_bitwise_equal(state_of(live.unet), state_of(unet))
    # init_from such a file: the UNet starts as its live weights, the run's EMA as its EMA
    target = sd.model.build_unet("tiny", from_scratch=False)
    assert "live weights" in sd.formats.load_unet_weights(str(tmp_path / "full.ckpt"), target, use_ema=False)
    assert_bitwise_equal(sd.formats.run_ema_weights(str(tmp_path / "full.ckpt"), target), ema)


def test_text_keys_without_text_model_and_position_ids_load(community, tmp_path):
    _, (unet, vae, text_encoder) = community
    state = sd.formats.single_file_state_dict(unet, vae, text_encoder)
    old = {k.replace("cond_stage_model.transformer.text_model.", "cond_stage_model.transformer."): v
           for k, v in state.items()}
    old["cond_stage_model.transformer.embeddings.position_ids"] = torch.arange(77)[None]  # transformers 4.2x's buffer
    save_file(old, tmp_path / "old.safetensors")
    loaded = sd.model.load_text_encoder(str(tmp_path / "old.safetensors"))
    assert_bitwise_equal(state_of(loaded), state_of(text_encoder))
    assert "text encoder keys without text_model." in sd.model.loaded_from(loaded)
    ids = sd.model.tokenize(sd.model.load_tokenizer("tiny"), ["a red circle"])
    assert torch.equal(loaded(ids).last_hidden_state, text_encoder(ids).last_hidden_state)


@pytest.mark.parametrize("prefix", ["", "first_stage_model."])
def test_a_vae_only_file_is_a_vae(community, tmp_path, prefix):
    _, (_, vae, _) = community
    state = sd.original_layout.to_original(vae, sd.original_layout.vae_key_map(vae))
    vae_only = {prefix + k.removeprefix("first_stage_model."): v for k, v in state.items()}
    torch.save({"state_dict": vae_only}, tmp_path / "vae.ckpt")  # vae-ft-mse-840000-ema-pruned.ckpt's layout
    loaded = sd.model.load_vae(str(tmp_path / "vae.ckpt"))
    assert_bitwise_equal(state_of(loaded), state_of(vae))
    assert ("a VAE-only file" in sd.model.loaded_from(loaded)) == (prefix == "")
    with pytest.raises(sd.model.LoadError, match="holds VAE, no text encoder"):
        sd.model.load_text_encoder(str(tmp_path / "vae.ckpt"))


def test_a_non_finite_weight_is_one_line_naming_the_tensor_and_the_file(community, tmp_path):
    _, (unet, vae, text_encoder) = community
    state = sd.formats.single_file_state_dict(unet, vae, text_encoder, half=True)
    name = "first_stage_model.decoder.conv_in.weight"
    state[name] = state[name].clone()
    state[name].view(-1)[7] = float("inf")  # fp16 overflow of a corrupted fine-tune
    save_file(state, tmp_path / "broken.safetensors")
    with pytest.raises(sd.model.LoadError, match=f"broken.safetensors: {name} holds non-finite values"):
        sd.model.load_vae(str(tmp_path / "broken.safetensors"))
    assert sd.model.load_text_encoder(str(tmp_path / "broken.safetensors"))  # its other models are sound
    # the check's fast sum, and its value-by-value answer where a sum of finite values overflows
    assert sd.original_layout.all_finite(torch.tensor([3e38, 3e38]))
    assert not any(sd.original_layout.all_finite(torch.tensor(v)) for v in ([1.0, float("nan")], [float("inf"), -1e38],
                                                                             [float("inf"), float("-inf")]))


def test_a_real_size_vae_only_file_is_an_sd1_vae(tmp_path):
    from diffusers import AutoencoderKL

    with sd.model._seeded(0):
        vae = AutoencoderKL(**sd.model.SD1_VAE)
    state = {k.removeprefix("first_stage_model."): v
             for k, v in sd.original_layout.to_original(vae, sd.original_layout.vae_key_map(vae), half=True).items()}
    save_file(state, tmp_path / "vae-ft-mse.safetensors")
    loaded = sd.model.load_vae(str(tmp_path / "vae-ft-mse.safetensors"))
    assert tuple(loaded.config.block_out_channels) == (128, 256, 512, 512)
    assert_bitwise_equal(state_of(loaded), {k: v.half().float() for k, v in vae.state_dict().items()})


def test_a_unet_only_file_takes_the_named_parts_and_says_what_it_lacks(community, tmp_path):
    path, (unet, _, _) = community
    save_file(sd.original_layout.to_original(unet, sd.original_layout.unet_key_map(unet)), tmp_path / "unet.safetensors")
    with pytest.raises(sd.model.LoadError, match="holds UNet, no VAE; name the VAE to use"):
        sd.model.load_vae(str(tmp_path / "unet.safetensors"))
    values = sd.train.config_loading.inherit_model({"init_from": str(tmp_path / "unet.safetensors")})
    assert values == {"init_from": str(tmp_path / "unet.safetensors"), "unet": "tiny"}  # vae, text encoder: defaults
    values = sd.train.config_loading.inherit_model({"init_from": str(path), "vae": "tiny"})
    assert values == {"init_from": str(path), "vae": "tiny", "text_encoder": str(path), "unet": "tiny"}


def lora_config(tmp_path: Path, data: dict, init_from: Path, name: str = "run", **fields) -> Path:
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump({**LORA, "datasets": [data], "init_from": str(init_from),
                                      "out_dir": str(tmp_path / name), **fields}))
    return config


@pytest.mark.slow  # training runs: the full suite's
def test_a_lora_on_a_community_file_trains_with_its_text_encoder_and_vae(community, dataset_16, tmp_path, caplog,
                                                                          capsys):
    path, (unet, vae, text_encoder) = community
    base = tmp_path / "my_model.safetensors"
    base.write_bytes(path.read_bytes())
    config = lora_config(tmp_path, dataset_16, base, clip_skip=2)  # an anime model's: trained at CLIP skip 2
    with caplog.at_level(logging.INFO, logger="sd_train"):
        assert SD_Train.main(["--config", str(config), "--stop_at_step", "1"]) == 0
    assert f"text encoder from single file {base}" in caplog.text and f"VAE from single file {base}" in caplog.text
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert (saved["unet"], saved["text_encoder"], saved["vae"], saved["clip_skip"]) == ("tiny", str(base), str(base), 2)
    assert SD_Train.main(["--config", str(config), "--clip_skip", "1"]) == 2
    assert "clip_skip: 2 -> 1" in capsys.readouterr().err
    assert SD_ImageGen.main(["--ckpt", str(tmp_path / "run"), "--prompt", "a red circle", "--steps", "2",
                             "--out", str(tmp_path / "drawn")]) == 0
    parameters = sd.sampling.read_parameters(next((tmp_path / "drawn").glob("*.png")))
    assert parameters.splitlines()[-1].endswith(", Clip skip: 2")  # AUTOMATIC1111's spelling, last on its line
    step_1 = tmp_path / "run" / "checkpoints" / sd.run_folder.step_dir_name(1)
    assert set(load_file(step_1 / "frozen_parts.safetensors")) == {"text_encoder", "vae"}
    trained = sd.formats.load_pipeline(str(tmp_path / "run"))
    assert sd.model.clip_skip_of(trained.text_encoder) == 2
    assert_bitwise_equal(state_of(trained.vae), state_of(vae))
    assert_bitwise_equal(state_of(trained.text_encoder), state_of(text_encoder))  # no text adapter: the file's

    # The file's text encoder changes (another fine-tune saved over it): neither resume nor sampling goes on.
    changed = tiny_models(seed=11)
    with torch.no_grad():
        list(changed[2].parameters())[-1].add_(0.5)  # the final layer norm
    sd.formats.save_single_file(base, *changed)
    assert SD_Train.main(["--config", str(config)]) == 2
    assert "is not the one this run was trained with" in capsys.readouterr().err
    with pytest.raises(sd.formats.BaseMismatch, match="is not the text encoder the run"):
        sd.formats.load_pipeline(str(tmp_path / "run"))
    assert SD_ImageGen.main(["--ckpt", str(tmp_path / "run"), "--prompt", "a red circle", "--steps", "2",
                             "--out", str(tmp_path / "img")]) == 2
    assert f"{base} is not the text encoder the run" in capsys.readouterr().err
    assert not (tmp_path / "img").exists()


@pytest.mark.slow  # training runs: the full suite's
def test_latents_of_another_vae_encoder_are_refused_with_the_fix(community, dataset_16, tmp_path, capsys):
    path, _ = community
    latents = tmp_path / "latents"
    latents.mkdir()
    for item in Path(dataset_16["latents"]).iterdir():
        (latents / item.name).symlink_to(item)
    meta = sd.data.training_data.read_latents_meta(Path(dataset_16["latents"]))
    (latents / "latents.json").unlink(missing_ok=True)
    digest = sd.model.encoder_digest(sd.model.load_vae("tiny"))
    (latents / "latents.json").write_text(json.dumps({**meta, "vae": "tiny", "vae_encoder": digest}))
    config = lora_config(tmp_path, {**dataset_16, "latents": str(latents)}, path)
    assert SD_Train.main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "were encoded with another VAE encoder (tiny)" in err and "vae: tiny" in err
    assert SD_Train.main(["--config", str(config), "--vae", "tiny", "--max_steps", "1"]) == 0


@pytest.mark.slow  # training runs: the full suite's
def test_the_readmes_community_checkpoint_line_trains_a_lora_on_the_files_own_models(community, tmp_path,
                                                                                     monkeypatch, caplog):
    """The README's line, as a user types it, on a tiny file (on the CPU: 64 px, fp32, two steps)."""
    from readme_commands import ROOT, readme_block, run_command

    from data_factory import draw_subject

    (line,) = readme_block("On a community checkpoint")
    path, _ = community
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_model.safetensors").write_bytes(path.read_bytes())
    draw_subject(tmp_path / "my_subject")
    smaller = ["--subject.image_size", "64", "--precision", "fp32", "--grad_checkpointing", "false", "--max_steps",
               "2", "--validate_every", "0"]
    with caplog.at_level(logging.INFO, logger="sd_train"):
        run_command(line.replace("configs/", f"{ROOT}/configs/"), {"SD_Train.py": smaller})
    assert "text encoder from single file my_model.safetensors" in caplog.text
    saved = yaml.safe_load((tmp_path / "runs" / "my_lora" / "config.yaml").read_text())
    assert (saved["text_encoder"], saved["vae"], saved["clip_skip"]) == ("my_model.safetensors",) * 2 + (2,)

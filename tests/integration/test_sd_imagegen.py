"""SD_ImageGen.py and sd/formats.py on the tiny presets, with diffusers as the outside client."""

import json

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

import sd.formats
import sd.imagegen
import sd.model
import sd.original_layout
import sd.run_folder
import sd.sampling
import SD_ImageGen
import SD_Train
from sd.distributed import Dist
from sd.train.config import TrainConfig

from data_factory import train_tiny_run

STEPS = 4
GRID_PROMPTS = ["a red circle", "a blue square on a white background"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A short tiny training run whose EMA differs from its live weights."""
    return train_tiny_run(tmp_path_factory.mktemp("gen"), 32, max_steps=6, warmup_steps=1, ema_decay=0.5,
                          validate_every=6, validation_prompts=GRID_PROMPTS, validation_steps=STEPS)


def gen(model, prompt="a red circle", negative="", seeds=(0, 1), cfg=3.0, sampler="ddim", batch_size=2):
    return sd.sampling.generate(model, prompt, negative, list(seeds), steps=STEPS, cfg=cfg, sampler=sampler,
                                height=64, width=64, batch_size=batch_size, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def model(run_dir):
    return sd.formats.load_pipeline(str(run_dir))


def test_loads_ema_by_default_and_live_weights_with_no_ema(run_dir, model):
    folder = sd.run_folder.resolve_checkpoint(run_dir)
    ema, live = load_file(folder / "ema.safetensors"), load_file(folder / "unet.safetensors")
    assert all(torch.equal(v, ema[k]) for k, v in model.unet.state_dict().items())
    assert any(not torch.equal(ema[k], live[k]) for k in ema)
    no_ema = sd.formats.load_pipeline(str(run_dir), use_ema=False)
    assert all(torch.equal(v, live[k]) for k, v in no_ema.unet.state_dict().items())


def test_validation_grid_image_equals_sd_imagegen_with_that_checkpoint_bit_for_bit(run_dir, tmp_path):
    from PIL import Image

    grid = np.asarray(Image.open(run_dir / "samples" / "step_00000006.png").convert("RGB"))
    checkpoint = run_dir / "checkpoints" / sd.run_folder.step_dir_name(6)
    for row, prompt in enumerate(GRID_PROMPTS):
        out = tmp_path / f"p{row}"
        assert SD_ImageGen.main(["--ckpt", str(checkpoint), "--prompt", prompt, "--seed", "5", "--n", "1",
                                 "--steps", str(STEPS), "--cfg", "4.0", "--height", "64", "--width", "64",
                                 "--device", "cpu", "--precision", "fp32", "--out", str(out)]) == 0
        image = np.asarray(Image.open(out / "000_000005.png").convert("RGB"))
        cell = sd.sampling.grid_cell(grid, row, 0, 64, 64, GRID_PROMPTS)
        assert image.std() > 0 and np.array_equal(cell, image), prompt
    # A different seed gives a different picture: the equality above is not of two blank images.
    assert SD_ImageGen.main(["--ckpt", str(checkpoint), "--prompt", GRID_PROMPTS[0], "--seed", "6", "--n", "1",
                             "--steps", str(STEPS), "--cfg", "4.0", "--height", "64", "--width", "64",
                             "--device", "cpu", "--out", str(tmp_path / "other")]) == 0
    other = np.asarray(Image.open(tmp_path / "other" / "000_000006.png").convert("RGB"))
    assert not np.array_equal(sd.sampling.grid_cell(grid, 0, 0, 64, 64, GRID_PROMPTS), other)


def test_same_seed_same_image_bit_for_bit_and_seeds_differ(model):
    a, b = gen(model), gen(model)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], a[1])
    alone = gen(model, seeds=(1,), batch_size=1)[0]
    assert np.abs(alone.astype(int) - a[1].astype(int)).max() <= 1  # seed i is image i whatever the batching


def test_negative_prompt_is_the_unconditional_branch(model):
    plain = gen(model)
    empty = gen(model, negative="")
    negative = gen(model, negative="a blue square")
    assert all(np.array_equal(x, y) for x, y in zip(plain, empty))
    assert any(not np.array_equal(x, y) for x, y in zip(plain, negative))


def test_cfg_one_is_the_conditional_branch_alone(model):
    ids = sd.model.tokenize(model.tokenizer, ["a red circle"])
    cond = sd.model.encode_prompt_ids(model.text_encoder, ids)
    noise = sd.sampling.initial_noise([0], (4, 8, 8))
    latents = noise.clone()
    stride = 1000 // STEPS
    alphas = sd.model.ddpm_alphas_cumprod()
    with torch.no_grad():
        for t in sd.sampling.ddim_timesteps(STEPS):
            eps = model.unet(latents, torch.tensor([t]), encoder_hidden_states=cond).sample
            latents = sd.sampling.ddim_step(latents, eps, t, t - stride, alphas, "epsilon")
    empty = sd.model.encode_prompt_ids(model.text_encoder, sd.model.tokenize(model.tokenizer, [""]))
    ours = sd.sampling.sample_latents(model.unet, noise, cond, empty, sampler="ddim", steps=STEPS, cfg=1.0)
    assert torch.equal(ours, latents)


@pytest.mark.parametrize("sampler", ["dpm++", "euler"])
def test_diffusers_samplers_keep_large_latents(sampler, model):
    # A step of each scheduler towards x0 ~ +-4 with the true noise as the prediction: nothing is clipped.
    from diffusers import DPMSolverMultistepScheduler, EulerDiscreteScheduler

    cls = DPMSolverMultistepScheduler if sampler == "dpm++" else EulerDiscreteScheduler
    scheduler = sd.model.build_noise_scheduler("epsilon", cls)
    assert not scheduler.config.get("thresholding", False) and not scheduler.config.get("clip_sample", False)
    scheduler.set_timesteps(10)
    x0 = torch.full((1, 4, 8, 8), 4.0)
    x0[..., ::2] = -4.0
    noise = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    latents = noise * scheduler.init_noise_sigma
    for t in scheduler.timesteps:
        a = sd.model.ddpm_alphas_cumprod()[int(t)].float()
        x_in = scheduler.scale_model_input(latents, t)  # what the UNet sees: sqrt(a) x0 + sqrt(1 - a) eps
        eps = (x_in - a.sqrt() * x0) / (1 - a).sqrt()  # an oracle UNet
        latents = scheduler.step(eps, t, latents).prev_sample
    assert latents.abs().max() > 3.9
    torch.testing.assert_close(latents, x0, rtol=0, atol=0.05)


def test_samplers_produce_images(model):
    by_sampler = {}
    for sampler in ("ddim", "dpm++", "euler"):
        images = gen(model, sampler=sampler, seeds=(0, 1), batch_size=1)
        assert images[0].shape == (64, 64, 3) and images[0].std() > 0
        assert np.array_equal(gen(model, sampler=sampler, seeds=(0,), batch_size=1)[0], images[0])  # seeded
        assert not np.array_equal(images[0], images[1])  # another seed, another image
        by_sampler[sampler] = images[0].astype(np.int16)
    # Each sampler walks its own path from the same noise: the images differ, but not by everything.
    for a, b in (("ddim", "dpm++"), ("ddim", "euler"), ("dpm++", "euler")):
        assert 0 < np.abs(by_sampler[a] - by_sampler[b]).mean() < 128, (a, b)


def test_cli_writes_pngs_with_parameters_and_a_grid(run_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n\na blue square\n")
    out = tmp_path / "out"
    code = SD_ImageGen.main(["--ckpt", str(run_dir), "--prompts_file", str(prompts), "--negative", "blurry",
                             "--steps", str(STEPS), "--cfg", "4", "--seed", "7", "--n", "2", "--batch_size", "2",
                             "--height", "64", "--width", "64", "--device", "cpu", "--out", str(out)])
    assert code == 0
    files = sorted(p.name for p in out.glob("0*.png"))
    assert files == ["000_000007.png", "000_000008.png", "001_000007.png", "001_000008.png"]
    text = sd.sampling.read_parameters(out / "001_000008.png")
    assert text.startswith("a blue square\nNegative prompt: blurry\nSteps: 4, Sampler: ddim, CFG scale: 4.0, Seed: 8,")
    from PIL import Image

    assert Image.open(out / "grid.png").size == (2 * 128, 2 * (128 + 16))  # 64 px shown at 128, a line of text
    assert len(json.loads((out / "images.json").read_text())) == 4


def test_without_a_size_it_samples_at_the_training_size_with_a_progress_bar(run_dir, tmp_path, caplog, capsys):
    import logging

    from PIL import Image

    out = tmp_path / "out"
    with caplog.at_level(logging.INFO):
        assert SD_ImageGen.main(["--ckpt", str(run_dir), "--prompt", "a red circle", "--steps", "2", "--n", "2",
                                 "--device", "cpu", "--out", str(out)]) == 0
    assert Image.open(out / "000_000000.png").size == (64, 64)  # the run's latents are 8x8
    assert "sampling at 64x64 (the latents in" in caplog.text
    err = capsys.readouterr().err
    assert "sample (2 steps, 64x64, 2 images): 100%" in err and "| 2/2 [" in err  # one batch of two images, 2 steps


@pytest.fixture(scope="module")
def exported(run_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("export")
    code = SD_ImageGen.main(["--ckpt", str(run_dir), "--export_diffusers", str(out / "pipe"),
                             "--export_single_file", str(out / "model.safetensors")])
    assert code == 0
    return out


def test_diffusers_loads_the_exported_folder_with_our_weights(exported, model):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(str(exported / "pipe"), local_files_only=True)
    for ours, theirs in ((model.unet, pipe.unet), (model.vae, pipe.vae), (model.text_encoder, pipe.text_encoder)):
        a, b = ours.state_dict(), theirs.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(p.name for p in (exported / "pipe").iterdir()) == [
        "model_index.json", "scheduler", "text_encoder", "tokenizer", "unet", "vae"]
    assert not list((exported / "pipe").rglob("*.bin"))  # safetensors only


def test_exported_files_and_checkpoints_get_the_umasks_mode_not_0600(exported, run_dir):
    import os
    import stat

    import sd.files

    umask = os.umask(0)
    os.umask(umask)
    expected = 0o666 & ~umask
    assert sd.files.file_mode() == expected
    files = [exported / "model.safetensors", *[p for p in (exported / "pipe").rglob("*") if p.is_file()],
             *[p for p in (run_dir / "checkpoints").rglob("*") if p.is_file()]]
    modes = {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    assert set(modes.values()) == {oct(expected)}, modes  # safetensors alone would write them 0600


def transformers4_clip_text_keys(num_layers: int) -> set[str]:
    """The state-dict keys of transformers 4's ``CLIPTextModel``: ``text_model`` = ``CLIPTextTransformer``
    (embeddings, ``encoder.layers[i]`` of attention + two layer norms + MLP, ``final_layer_norm``);
    ``position_ids`` is a non-persistent buffer since 4.31, so it is not among them."""
    keys = {"text_model.embeddings.token_embedding.weight", "text_model.embeddings.position_embedding.weight",
            "text_model.final_layer_norm.weight", "text_model.final_layer_norm.bias"}
    for i in range(num_layers):
        for module in ("self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj", "self_attn.out_proj",
                       "layer_norm1", "mlp.fc1", "mlp.fc2", "layer_norm2"):
            keys |= {f"text_model.encoder.layers.{i}.{module}.{p}" for p in ("weight", "bias")}
    return keys


def test_exported_text_encoder_has_the_layout_transformers_4_and_comfyui_read(exported, model):
    from transformers import CLIPTextModel

    state = load_file(exported / "pipe" / "text_encoder" / "model.safetensors")
    layers = json.loads((exported / "pipe" / "text_encoder" / "config.json").read_text())["num_hidden_layers"]
    assert set(state) == transformers4_clip_text_keys(layers)
    ours = model.text_encoder.state_dict()
    assert all(torch.equal(state[f"text_model.{k.removeprefix('text_model.')}"], v) for k, v in ours.items())
    loaded = CLIPTextModel.from_pretrained(str(exported / "pipe" / "text_encoder")).state_dict()  # transformers 5
    assert loaded.keys() == ours.keys() and all(torch.equal(loaded[k], ours[k]) for k in ours)


def test_exported_tokenizer_has_the_files_transformers_4_reads(exported):
    """transformers 4's CLIPTokenizer (what diffusers' model_index.json names) opens vocab.json and
    merges.txt by path: the folder holds them, as the SD 1.x repositories ship them, and the tokenizer
    built from their contents alone is the CLIP one (the tiny run's tokenizer is the real vocabulary)."""
    from transformers import CLIPTokenizer

    folder = exported / "pipe" / "tokenizer"
    assert {"vocab.json", "merges.txt", "special_tokens_map.json", "tokenizer_config.json"} <= {
        p.name for p in folder.iterdir()}
    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    assert len(vocab) == 49408 and vocab["<|startoftext|>"] == 49406 and vocab["<|endoftext|>"] == 49407
    header, *lines = (folder / "merges.txt").read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split()) for line in lines]
    assert header.startswith("#version") and len(merges) == 48894 and all(len(m) == 2 for m in merges)
    special = json.loads((folder / "special_tokens_map.json").read_text())
    assert special == {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
                       "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    from_files = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)  # transformers 5's spelling
    from_folder = CLIPTokenizer.from_pretrained(str(folder))
    for tokenizer in (from_files, from_folder):
        assert tokenizer("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]


def test_diffusers_loads_the_single_file_with_our_weights(exported, model):
    from diffusers import StableDiffusionPipeline

    state = load_file(exported / "model.safetensors")
    assert not any(k.startswith(("optimizer", "state")) for k in state)
    prefixes = {k.split(".")[0] for k in state}
    assert prefixes == {"model", "first_stage_model", "cond_stage_model"}
    assert any(k.startswith("cond_stage_model.transformer.text_model.") for k in state)
    pipe = StableDiffusionPipeline.from_single_file(str(exported / "model.safetensors"),
                                                    config=str(exported / "pipe"), local_files_only=True)
    for ours, theirs in ((model.unet, pipe.unet), (model.vae, pipe.vae), (model.text_encoder, pipe.text_encoder)):
        a, b = ours.state_dict(), theirs.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_diffusers_pipeline_image_equals_ours(exported, model):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(str(exported / "pipe"), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    ours = gen(model, prompt="a red circle", negative="a blue square", seeds=(3,), cfg=5.0, batch_size=1)[0]
    theirs = pipe("a red circle", negative_prompt="a blue square", num_inference_steps=STEPS, guidance_scale=5.0,
                  height=64, width=64, latents=sd.sampling.initial_noise([3], (4, 8, 8)), output_type="np").images[0]
    theirs = (theirs * 255).round().astype(np.uint8)
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 2  # float rounding only


def test_single_file_and_diffusers_folder_sample_like_our_checkpoint(exported, model, tmp_path):
    reference = gen(model, seeds=(0,), batch_size=1)[0]
    for source, kwargs in ((exported / "model.safetensors", {"arch": "tiny"}), (exported / "pipe", {})):
        loaded = sd.formats.load_pipeline(str(source), **kwargs)
        assert np.array_equal(gen(loaded, seeds=(0,), batch_size=1)[0], reference), source


def test_half_export_is_fp16(run_dir, tmp_path):
    assert SD_ImageGen.main(["--ckpt", str(run_dir), "--export_single_file", str(tmp_path / "h.safetensors"),
                             "--half"]) == 0
    state = load_file(tmp_path / "h.safetensors")
    assert {t.dtype for t in state.values() if t.is_floating_point()} == {torch.float16}


@pytest.mark.parametrize("kind", ["single_file", "diffusers", "run"])
def test_init_from_each_format_starts_from_exactly_those_weights(kind, exported, run_dir, model, tmp_path):
    source = {"single_file": exported / "model.safetensors", "diffusers": exported / "pipe", "run": run_dir}[kind]
    data = yaml.safe_load((sd.run_folder.resolve_checkpoint(run_dir) / "config.yaml").read_text())["datasets"]
    config = TrainConfig(datasets=data, unet="tiny", vae="tiny", text_encoder="tiny", precision="fp32",
                         device="cpu", grad_checkpointing=False, batch_size=8, grad_accum=1, max_steps=2,
                         validate_every=0, out_dir=str(tmp_path / "ft"), init_from=str(source))
    config.validate()
    run = SD_Train.build(config, Dist.single())
    folder = sd.run_folder.resolve_checkpoint(run_dir)
    # Exports carry the EMA weights; a run folder gives its live weights to the UNet and its EMA to the EMA.
    expected_unet = load_file(folder / ("unet.safetensors" if kind == "run" else "ema.safetensors"))
    expected_ema = load_file(folder / "ema.safetensors")
    assert all(torch.equal(v, expected_unet[k]) for k, v in run.step.unet.state_dict().items())
    assert all(torch.equal(v, expected_ema[k]) for k, v in run.step.ema.state_dict().items())
    assert run.state.step == 0 and not run.step.optimizer.state_dict()["state"]


def test_sd1_key_map_matches_the_original_layout():
    from diffusers import AutoencoderKL

    with torch.device("meta"):
        unet = sd.model.build_unet("sd1")
        vae = AutoencoderKL(**sd.model.SD1_VAE)
    unet_keys, vae_keys = set(sd.formats.unet_key_map(unet).values()), set(sd.formats.vae_key_map(vae).values())
    assert len(unet_keys) == 686 and len(vae_keys) == 248  # the counts of an original SD 1.x checkpoint
    for key in ("input_blocks.3.0.op.weight", "input_blocks.4.0.skip_connection.weight",
                "middle_block.1.transformer_blocks.0.attn2.to_k.weight", "output_blocks.2.1.conv.weight",
                "output_blocks.5.2.conv.bias", "output_blocks.11.1.proj_out.weight", "time_embed.2.bias", "out.2.weight",
                "input_blocks.11.0.out_layers.3.weight"):
        assert f"model.diffusion_model.{key}" in unet_keys, key
    for key in ("decoder.up.3.upsample.conv.weight", "encoder.mid.attn_1.q.weight", "decoder.up.0.block.0.nin_shortcut.weight",
                "encoder.norm_out.weight", "quant_conv.weight"):
        assert f"first_stage_model.{key}" in vae_keys, key


class TrainerCallback:  # stands for the objects old .ckpt pickles carry (code that would run on load)
    pass


def test_pickle_checkpoints_with_objects_are_refused(tmp_path):
    torch.save({"state_dict": {"x": torch.zeros(1)}, "callbacks": TrainerCallback()}, tmp_path / "m.ckpt")
    with pytest.raises(ValueError, match="without unpickling"):
        sd.original_layout.read_single_file(tmp_path / "m.ckpt")
    torch.save({"state_dict": {"x": torch.ones(1)}}, tmp_path / "ok.ckpt")
    assert torch.equal(sd.original_layout.read_single_file(tmp_path / "ok.ckpt")["x"], torch.ones(1))


def test_compile_unet_wraps_the_same_weights_and_rejects_unknown_modes():
    unet = sd.model.build_unet("tiny", seed=0)
    assert sd.sampling.compile_unet(unet, "off") is unet
    compiled = sd.sampling.compile_unet(unet, "reduce-overhead")  # compiles lazily, at its first call
    assert compiled is not unet and compiled._orig_mod is unet
    assert [p.data_ptr() for p in compiled.parameters()] == [p.data_ptr() for p in unet.parameters()]
    with pytest.raises(ValueError, match="compile mode must be one of"):
        sd.sampling.compile_unet(unet, "fast")


def test_a_damaged_single_file_is_a_one_line_error_naming_it(tmp_path, capsys):
    path = tmp_path / "damaged.safetensors"
    path.write_bytes(b"\xff" * 100)  # a header length far past the file
    assert SD_ImageGen.main(["--ckpt", str(path), "--prompt", "x", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"SD_ImageGen.py: cannot load {path}: ")
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------ prediction type


@pytest.fixture(scope="module")
def v_checkpoint(run_dir, tmp_path_factory):
    """The run's checkpoint as a v-prediction model: its config.yaml says so (sampling reads only that)."""
    import shutil

    folder = tmp_path_factory.mktemp("v") / sd.run_folder.step_dir_name(6)
    shutil.copytree(sd.run_folder.resolve_checkpoint(run_dir), folder)
    config = yaml.safe_load((folder / "config.yaml").read_text())
    (folder / "config.yaml").write_text(yaml.safe_dump({**config, "prediction_type": "v_prediction"}))
    manifest = json.loads((folder / sd.run_folder.MANIFEST).read_text())  # an edit the manifest vouches for
    manifest["files"].update(sd.run_folder.describe_files([folder / "config.yaml"]))
    (folder / sd.run_folder.MANIFEST).write_text(json.dumps(manifest))
    return folder


def sample_png(ckpt_path, out, *flags):
    from PIL import Image

    assert SD_ImageGen.main(["--ckpt", str(ckpt_path), "--prompt", "a red circle", "--seed", "3", "--n", "1",
                             "--steps", str(STEPS), "--cfg", "4.0", "--height", "64", "--width", "64",
                             "--device", "cpu", "--precision", "fp32", "--out", str(out), *flags]) == 0
    return np.asarray(Image.open(out / "000_000003.png").convert("RGB"))


@pytest.mark.slow  # over 5 s: the full suite's (make check stays near 3 minutes)
def test_v_prediction_survives_export_to_a_single_file_and_a_diffusers_folder(v_checkpoint, tmp_path):
    single, folder = tmp_path / "v.safetensors", tmp_path / "v_pipe"
    assert SD_ImageGen.main(["--ckpt", str(v_checkpoint), "--export_single_file", str(single),
                             "--export_diffusers", str(folder)]) == 0
    assert sd.formats.load_pipeline(str(single), arch="tiny").prediction_type == "v_prediction"
    assert sd.formats.load_pipeline(str(folder)).prediction_type == "v_prediction"
    # SD_ImageGen samples the single file as the checkpoint it came from, and as epsilon only when told.
    reference = sample_png(v_checkpoint, tmp_path / "ref")
    assert np.array_equal(sample_png(single, tmp_path / "single", "--arch", "tiny"), reference)
    assert np.array_equal(sample_png(folder, tmp_path / "folder"), reference)
    as_epsilon = sample_png(single, tmp_path / "eps", "--arch", "tiny", "--prediction_type", "epsilon")
    assert not np.array_equal(as_epsilon, reference)


def test_a_single_file_without_a_recorded_prediction_type_is_epsilon_unless_told(exported, tmp_path):
    from safetensors.torch import save_file

    bare = tmp_path / "bare.safetensors"  # as other tools write them: tensors only
    save_file(load_file(exported / "model.safetensors"), str(bare))
    assert sd.formats.load_pipeline(str(bare), arch="tiny").prediction_type == "epsilon"
    told = sd.formats.load_pipeline(str(bare), arch="tiny", prediction_type="v_prediction")
    assert told.prediction_type == "v_prediction"
    odd = tmp_path / "odd.safetensors"
    save_file(load_file(exported / "model.safetensors"), str(odd), metadata={"prediction_type": "sample"})
    with pytest.raises(ValueError, match=rf"^{odd}: prediction_type 'sample' is not one of epsilon, v_prediction, flow$"):
        sd.formats.load_pipeline(str(odd), arch="tiny")


def test_a_diffusers_folder_takes_the_prediction_type_of_its_scheduler_config(exported, tmp_path):
    import shutil

    folder = tmp_path / "pipe"
    shutil.copytree(exported / "pipe", folder)
    scheduler = folder / "scheduler" / "scheduler_config.json"
    assert json.loads(scheduler.read_text())["prediction_type"] == "epsilon"
    assert sd.formats.load_pipeline(str(folder)).prediction_type == "epsilon"
    scheduler.write_text(json.dumps({**json.loads(scheduler.read_text()), "prediction_type": "v_prediction"}))
    assert sd.formats.load_pipeline(str(folder)).prediction_type == "v_prediction"
    assert sd.formats.load_pipeline(str(folder), prediction_type="epsilon").prediction_type == "epsilon"


# ------------------------------------------------------------------------------ damaged inputs


def truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def flip_header_byte(path):
    data = bytearray(path.read_bytes())
    data[20] ^= 0xFF  # inside the JSON header that follows the 8-byte length
    path.write_bytes(bytes(data))


def overwrite_data(path):
    """4 KiB of tensor data overwritten: header and size intact, only the manifest's hash can tell."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = b"\x7f" * 4096
    path.write_bytes(bytes(data))


def damaged_source(kind, tmp_path, run_dir, exported):
    """A copy of a good checkpoint with one file damaged: ``(source, the damaged file, extra flags)``."""
    import shutil

    if kind.startswith("single_file"):
        source = tmp_path / "model.safetensors"
        shutil.copy(exported / "model.safetensors", source)
        damage = kind.removeprefix("single_file_")
        if damage == "truncated":
            truncate(source)
        elif damage == "bit_flipped":
            flip_header_byte(source)
        elif damage == "garbage":
            source.write_bytes(np.random.default_rng(0).bytes(4096))
        elif damage == "empty":
            source.write_bytes(b"")
        return source, source, ["--arch", "tiny"]
    if kind == "ckpt_file_truncated":
        source = tmp_path / "model.ckpt"
        torch.save({"state_dict": load_file(exported / "model.safetensors")}, source)
        truncate(source)
        return source, source, ["--arch", "tiny"]
    if kind.startswith("checkpoint"):
        source = tmp_path / sd.run_folder.step_dir_name(6)
        shutil.copytree(sd.run_folder.resolve_checkpoint(run_dir), source)
        name, damage = {"checkpoint_unet_missing": ("unet.safetensors", "missing"),
                        "checkpoint_unet_truncated": ("unet.safetensors", "truncated"),
                        "checkpoint_unet_bit_flipped": ("unet.safetensors", "bit_flipped"),
                        "checkpoint_ema_truncated": ("ema.safetensors", "truncated"),
                        "checkpoint_ema_data_overwritten": ("ema.safetensors", "overwritten"),
                        "checkpoint_config_broken": ("config.yaml", "broken")}[kind]
        bad = source / name
        {"missing": bad.unlink, "truncated": lambda: truncate(bad), "bit_flipped": lambda: flip_header_byte(bad),
         "overwritten": lambda: overwrite_data(bad),
         "broken": lambda: bad.write_text("unet: [tiny\n")}[damage]()
        return source, bad, (["--no_ema"] if name == "unet.safetensors" else [])
    source = tmp_path / "pipe"
    shutil.copytree(exported / "pipe", source)
    part = kind.removeprefix("diffusers_")
    if part == "unet_weights_truncated":
        bad = source / "unet" / "diffusion_pytorch_model.safetensors"
        truncate(bad)
    else:
        bad = source / part / ("scheduler_config.json" if part == "scheduler" else "config.json")
        bad.write_text('{"_class_name": "UNet2DCondition')
    return source, bad, []


def error_lines(err: str, prefix: str) -> list[str]:
    """The lines a script printed itself. (In process, a traceback would be an exception out of main(),
    not text; libraries may add warnings of their own to stderr.)"""
    return [line for line in err.splitlines() if line.startswith(prefix)]


@pytest.mark.parametrize("kind", [
    "single_file_truncated", "single_file_bit_flipped", "single_file_garbage", "single_file_empty",
    "ckpt_file_truncated", "checkpoint_unet_missing", "checkpoint_unet_truncated", "checkpoint_unet_bit_flipped",
    "checkpoint_ema_truncated", "checkpoint_ema_data_overwritten", "checkpoint_config_broken", "diffusers_unet",
    "diffusers_vae", "diffusers_text_encoder",
    "diffusers_scheduler", "diffusers_unet_weights_truncated"])
def test_a_damaged_ckpt_is_a_one_line_error_naming_the_bad_file(kind, run_dir, exported, tmp_path, capsys):
    source, bad, flags = damaged_source(kind, tmp_path, run_dir, exported)
    capsys.readouterr()
    assert SD_ImageGen.main(["--ckpt", str(source), "--prompt", "x", "--out", str(tmp_path / "o"), *flags]) == 2
    [line] = error_lines(capsys.readouterr().err, "SD_ImageGen.py")
    assert line.startswith(f"SD_ImageGen.py: cannot load {source}: ") and str(bad) in line, line
    assert not (tmp_path / "o").exists()


def test_a_checkpoint_without_unet_safetensors_still_samples_its_ema(run_dir, exported, tmp_path):
    source, _, _ = damaged_source("checkpoint_unet_missing", tmp_path, run_dir, exported)
    model = sd.formats.load_pipeline(str(source))
    ema = load_file(source / "ema.safetensors")
    assert all(torch.equal(v, ema[k]) for k, v in model.unet.state_dict().items())


def test_weights_of_another_architecture_are_a_one_line_error_naming_the_file(run_dir, tmp_path, capsys):
    import shutil

    source = tmp_path / sd.run_folder.step_dir_name(6)
    shutil.copytree(sd.run_folder.resolve_checkpoint(run_dir), source)
    from safetensors.torch import save_file

    save_file({"conv_in.weight": torch.zeros(3, 3)}, str(source / "ema.safetensors"))
    manifest = json.loads((source / sd.run_folder.MANIFEST).read_text())  # a file the manifest vouches for
    manifest["files"].update(sd.run_folder.describe_files([source / "ema.safetensors"]))
    (source / sd.run_folder.MANIFEST).write_text(json.dumps(manifest))
    assert SD_ImageGen.main(["--ckpt", str(source), "--prompt", "x", "--out", str(tmp_path / "o")]) == 2
    [line] = error_lines(capsys.readouterr().err, "SD_ImageGen.py")
    assert f"{source / 'ema.safetensors'}: its weights do not fit this UNet2DConditionModel (" in line
    assert "1 of another shape" in line


@pytest.mark.parametrize("kind", [
    "single_file_truncated", "single_file_bit_flipped", "single_file_garbage", "ckpt_file_truncated",
    "checkpoint_unet_missing", "checkpoint_unet_truncated", "checkpoint_ema_truncated",
    "checkpoint_ema_data_overwritten", "checkpoint_config_broken", "diffusers_unet", "diffusers_unet_weights_truncated"])
def test_init_from_a_damaged_source_is_a_one_line_error_naming_the_bad_file(kind, run_dir, exported, tmp_path,
                                                                           capsys):
    source, bad, _ = damaged_source(kind, tmp_path, run_dir, exported)
    data = yaml.safe_load((sd.run_folder.resolve_checkpoint(run_dir) / "config.yaml").read_text())["datasets"]
    config = tmp_path / "ft.yaml"
    config.write_text(yaml.safe_dump(dict(datasets=data, unet="tiny", vae="tiny", text_encoder="tiny",
                                          precision="fp32", device="cpu", grad_checkpointing=False, batch_size=8,
                                          grad_accum=1, max_steps=2, validate_every=0, out_dir=str(tmp_path / "ft"),
                                          init_from=str(source))))
    capsys.readouterr()
    assert SD_Train.main(["--config", str(config)]) == 2
    [line] = error_lines(capsys.readouterr().err, "SD_Train.py")
    assert line.startswith(f"SD_Train.py: error (rank 0): init_from: cannot load {source}: ") and str(bad) in line
    assert not (tmp_path / "ft" / "checkpoints").exists()


def test_cli_lcm_samples_four_steps_at_guidance_one_by_default(run_dir, model, tmp_path):
    out = tmp_path / "lcm"
    assert SD_ImageGen.main(["--ckpt", str(run_dir), "--prompt", "a red circle", "--sampler", "lcm", "--seed", "3",
                             "--n", "2", "--height", "64", "--width", "64", "--device", "cpu", "--out", str(out)]) == 0
    text = sd.sampling.read_parameters(out / "000_000004.png")
    assert "\nSteps: 4, Sampler: lcm, CFG scale: 1.0, Seed: 4, Size: 64x64," in text
    from PIL import Image

    expected = gen(model, seeds=(3, 4), cfg=1.0, sampler="lcm")
    for seed, image in zip((3, 4), expected):
        assert np.array_equal(np.asarray(Image.open(out / f"000_00000{seed}.png").convert("RGB")), image), seed
    assert not np.array_equal(expected[1], gen(model, seeds=(3, 4), cfg=1.0)[1])  # not DDIM's picture


@pytest.mark.parametrize("flags, sampler, steps", [
    ([], "ddim", 100), (["--sampler", "dpm++"], "dpm++", 25), (["--sampler", "euler"], "euler", 100),
    (["--sampler", "lcm"], "lcm", 4), (["--sampler", "dpm++", "--steps", "7"], "dpm++", 7)])
def test_the_default_steps_suit_the_sampler_and_a_plain_run_samples_with_ddim(flags, sampler, steps, run_dir):
    request = SD_ImageGen.parse_args(["--ckpt", str(run_dir), "--prompt", "a", "--out", "unused", *flags])
    assert (request.sampling.sampler, request.sampling.steps) == (sampler, steps)


@pytest.mark.parametrize("ckpt, out", [("runs/flow", "samples/flow"), ("runs/flow/", "samples/flow"),
                                       ("runs/x/checkpoints/step_00000500", "samples/x_step_00000500"),
                                       ("sd-v1-5.safetensors", "samples/sd-v1-5"), ("org/model", "samples/model")])
def test_samples_go_to_a_folder_named_after_the_checkpoint_without_out(ckpt, out):
    """The recipes' and docs' sampling lines give no --out (once: "give --prompt ... and --out")."""
    assert SD_ImageGen.parse_args(["--ckpt", ckpt, "--prompt", "a", "--sampler", "ddim"]).sampling.out == out
    assert SD_ImageGen.parse_args(["--ckpt", ckpt, "--prompt", "a", "--sampler", "ddim", "--out", "o"]).sampling.out == "o"


def test_a_run_folder_not_made_yet_is_named_in_seconds_offline(tmp_path, capsys, monkeypatch):
    """``runs/mine`` before its run started reads as a hub id (owner/name): offline it once took a minute of the
    hub's retries and ended in "does not appear to have a file named config.json"."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert SD_ImageGen.main(["--ckpt", "runs/mine", "--prompt", "a red circle", "--out", "samples/mine"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == ("SD_ImageGen.py: cannot load runs/mine: runs/mine: no such folder here, and as a hub id it cannot "
                   "be loaded (the hub cannot be reached and the local cache lacks it); check the path (a run folder "
                   "exists once its run has started), or fetch the model where there is internet")


def test_a_checkpoint_that_does_not_exist_is_named_without_asking_the_hub(tmp_path, capsys):
    missing = tmp_path / "no_such_run"
    assert SD_ImageGen.main(["--ckpt", str(missing), "--prompt", "a red circle", "--out", str(tmp_path / "out")]) == 2
    assert f"{missing}: no such file or folder" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, message", [
    (["--cfg", "nan"], "the guidance scale must be a finite number of at least 0, got nan"),
    (["--cfg", "inf"], "the guidance scale must be a finite number of at least 0, got inf"),
    (["--cfg", "-1"], "the guidance scale must be a finite number of at least 0"),
    (["--steps", "0"], "steps must be a whole number of at least 1"),
    (["--steps", "1001"], "ddim takes at most 1000 steps"),
    (["--sampler", "lcm", "--steps", "51"], "lcm takes at most 50 steps"),
    (["--seed", "-1"], "--seed must be a whole number in"),
    (["--control_scale", "nan"], "--control_scale must be a number >= 0"),
    (["--n", "0"], "--n must be >= 1"),
    (["--flow_shift", "1e9"], "--flow_shift: flow shift 1000000000.0 is outside [0.1, 10]"),
    (["--flow_shift", "0.05"], "--flow_shift: flow shift 0.05 is outside [0.1, 10]"),
])
def test_numbers_no_sampler_can_use_are_refused_before_loading_anything(flags, message, tmp_path, capsys):
    """``--cfg nan`` once wrote black images and exited 0, and so did ``--flow_shift 1e9`` (training's bounds hold
    for sampling too)."""
    with pytest.raises(SystemExit) as stop:
        SD_ImageGen.main(["--ckpt", str(tmp_path / "none"), "--prompt", "a", "--out", str(tmp_path / "out"), *flags])
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_ctrl_c_while_sampling_ends_in_one_line(tmp_path, monkeypatch, capsys):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(sd.imagegen, "run", interrupted)
    assert SD_ImageGen.main(["--ckpt", "x", "--prompt", "p", "--out", str(tmp_path / "o"), "--sampler", "ddim"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["SD_ImageGen.py: interrupted (Ctrl-C); no image was written"]


def test_ctrl_c_keeps_the_batches_already_drawn_and_says_how_many(run_dir, tmp_path, monkeypatch, capsys):
    """--n 4 --batch_size 2, Ctrl-C in the second batch: the first batch's two images are on disk with their
    images.json (once, every image waited for the last batch and Ctrl-C lost them while saying they were
    written), and the line says 2; the images are those an uninterrupted run draws."""
    flags = ["--ckpt", str(run_dir), "--prompt", "a red circle", "--n", "4", "--batch_size", "2", "--steps", "2",
             "--sampler", "ddim"]
    assert SD_ImageGen.main([*flags, "--out", str(tmp_path / "whole")]) == 0
    real, calls = sd.sampling.generate, []

    def interrupted_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(sd.sampling, "generate", interrupted_second)
    out = tmp_path / "cut"
    capsys.readouterr()
    assert SD_ImageGen.main([*flags, "--out", str(out)]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        f"SD_ImageGen.py: interrupted (Ctrl-C); 2 images written to {out}"
    assert sorted(p.name for p in out.glob("*.png")) == ["000_000000.png", "000_000001.png"]
    assert [r["file"] for r in json.loads((out / "images.json").read_text())] == ["000_000000.png", "000_000001.png"]
    for name in ("000_000000.png", "000_000001.png"):
        assert (out / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()

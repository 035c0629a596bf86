"""Textual inversion on the tiny presets: only the new token trains, resume is exact, and its files load in
diffusers' ``load_textual_inversion`` and have the single-tensor layout AUTOMATIC1111 and ComfyUI read."""

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import sd.data.dreambooth
import sd.embedding.formats
import sd.embedding.tokens
import sd.formats
import sd.model
import sd.run_folder
import sd.train.config
import SD_ImageGen
import SD_Train

from data_factory import BASE, assert_bitwise_equal, draw_subject, make_base_pipeline
from margins import at_most

TOKEN = "<cyan-sks>"
PROMPT = f"a {TOKEN} circle"
FIELDS = dict(BASE, lr=5e-2, warmup_steps=0, ema_decay=0.9, cfg_dropout=0.1, batch_size=2, grad_accum=2, datasets=[],
              instance_prompt=PROMPT, image_size=32, embedding_token=TOKEN, embedding_init="blue",
              embedding_vectors=2, validate_every=0, save_steps=3, max_steps=6)


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    return make_base_pipeline(tmp_path_factory.mktemp("base") / "pipeline")


@pytest.fixture(scope="module")
def instance_images(tmp_path_factory) -> Path:
    return draw_subject(tmp_path_factory.mktemp("instance"))


def train(tmp_path: Path, name: str, base_model: Path, images: Path, *flags, **fields) -> int:
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump({**FIELDS, "init_from": str(base_model), "instance_dir": str(images),
                                      "out_dir": str(tmp_path / name), **fields}))
    return SD_Train.main(["--config", str(config), *flags])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, base_model, instance_images) -> Path:
    root = tmp_path_factory.mktemp("ti")
    assert train(root, "run", base_model, instance_images) == 0
    return root / "run"


def checkpoint_tensors(run: Path, step: int) -> dict[str, torch.Tensor]:
    folder = run / "checkpoints" / sd.run_folder.step_dir_name(step)
    tensors = {f"embedding.{k}": v for k, v in load_file(folder / "embedding.safetensors").items()}
    tensors.update({f"ema.{k}": v for k, v in load_file(folder / "ema.safetensors").items()})
    for index, state in torch.load(folder / "optimizer.pt", weights_only=True)["state"].items():
        tensors.update({f"opt.{index}.{name}": torch.as_tensor(value) for name, value in state.items()})
    rng = torch.load(folder / "rng_rank0.pt", weights_only=True)["rng"]
    tensors.update({"rng.torch": rng["torch"], "rng.noise": rng["noise"]})
    return tensors


def test_only_the_new_rows_train_and_the_base_stays_bitwise(trained, base_model):
    pipe = sd.formats.load_pipeline(str(trained))
    layer = sd.embedding.tokens.added_embeddings(pipe.text_encoder)[0]
    assert layer.tokens == [TOKEN, f"{TOKEN}_1"] and layer.vectors.shape == (2, 64)
    fresh_encoder, tokenizer = sd.model.load_text_encoder("tiny"), sd.model.load_tokenizer("tiny")
    start = sd.embedding.tokens.initial_vectors(tokenizer, fresh_encoder, "blue", 2)
    assert (layer.vectors - start).abs().max() > 1e-3  # the token moved from "blue"
    with sd.embedding.tokens.without_added(pipe.text_encoder):  # every other weight: bit for bit the base's
        assert_bitwise_equal(fresh_encoder.state_dict(), pipe.text_encoder.state_dict())
    base = sd.model.build_unet("tiny", from_scratch=False)
    sd.formats.load_unet_weights(str(base_model), base)
    assert_bitwise_equal(base.state_dict(), pipe.unet.state_dict())
    # the checkpoint holds the token, never the UNet; its optimizer state is the token's alone
    folder = trained / "checkpoints" / sd.run_folder.step_dir_name(6)
    assert not (folder / "unet.safetensors").exists()
    optimizer = torch.load(folder / "optimizer.pt", weights_only=True)
    assert [len(g["params"]) for g in optimizer["param_groups"]] == [1]
    assert optimizer["state"][0]["exp_avg"].shape == (2, 64)
    assert (trained / "metrics.jsonl").read_text().count('"loss"') == 6


def test_a_resumed_run_is_bitwise_the_uninterrupted_one(tmp_path, trained, base_model, instance_images):
    assert train(tmp_path, "b", base_model, instance_images, "--stop_at_step", "3") == 0
    assert train(tmp_path, "b", base_model, instance_images) == 0
    assert_bitwise_equal(checkpoint_tensors(trained, 6), checkpoint_tensors(tmp_path / "b", 6))


@torch.no_grad()
def instance_loss(pipe, images: Path, vectors: torch.Tensor) -> float:
    """The prediction error of the instance images under PROMPT with the token's rows set to ``vectors``, at
    fixed draws: each image noised at 32 timesteps spread over the schedule, with the same noise every call."""
    sd.embedding.tokens.added_embeddings(pipe.text_encoder)[0].vectors.copy_(vectors)
    pictures, _ = sd.data.dreambooth.read_images(sd.data.dreambooth.image_files(images), 32)
    latents = torch.from_numpy(sd.data.dreambooth.encode_images(pipe.vae, pictures, "cpu")).float()
    latents = (latents * pipe.vae.config.scaling_factor).repeat_interleave(32, 0)
    timesteps = torch.linspace(0, 999, 32).long().repeat(len(pictures))
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(0))
    alphas = sd.model.ddpm_alphas_cumprod()
    context = sd.model.encode_prompt_ids(pipe.text_encoder, sd.model.tokenize(pipe.tokenizer, [PROMPT]))
    prediction = pipe.unet(sd.model.add_noise(latents, noise, timesteps, alphas), timesteps,
                           encoder_hidden_states=context.expand(len(latents), -1, -1)).sample
    target = sd.model.prediction_target(latents, noise, timesteps, alphas, pipe.prediction_type)
    return torch.nn.functional.mse_loss(prediction, target).item()


@pytest.mark.slow  # over 7 s on a 2-core CPU: out of make check
@pytest.mark.learned
def test_the_token_lowers_the_loss_of_its_images(tmp_path, base_model, instance_images):
    """60 steps: the instance images' loss at fixed draws falls (measured 0.975 of the start's on the tiny
    random base, whose prediction the prompt moves little: 0.972-0.975 over two seeds and 60-300 steps, so the
    bound sits five spreads away). The training log's losses are no measure: each step draws its own
    timesteps and noise, and they vary by 20% from step to step."""
    assert train(tmp_path, "long", base_model, instance_images, "--max_steps", "60", "--lr", "0.05",
                 "--cfg_dropout", "0", "--save_steps", "60") == 0
    pipe = sd.formats.load_pipeline(str(tmp_path / "long"), use_ema=False)
    trained = sd.embedding.tokens.added_embeddings(pipe.text_encoder)[0].vectors.clone()
    start = sd.embedding.tokens.initial_vectors(pipe.tokenizer, sd.model.load_text_encoder("tiny"), "blue", 2)
    before, after = (instance_loss(pipe, instance_images, vectors) for vectors in (start, trained))
    at_most("instance images' loss at fixed draws, trained token / its start", after / before, 0.99, (before, after))


@pytest.mark.slow  # over 4 s: the full suite's (make check stays near 3 minutes)
def test_exported_files_load_in_diffusers_with_the_layout_a1111_and_comfyui_read(tmp_path, trained, base_model):
    from diffusers import StableDiffusionPipeline

    a1111, folder = tmp_path / "a1111", tmp_path / "diffusers"
    assert SD_ImageGen.main(["--ckpt", str(trained), "--export_embedding", str(a1111)]) == 0
    assert SD_ImageGen.main(["--ckpt", str(trained), "--export_embedding", str(folder),
                             "--embedding_format", "diffusers"]) == 0
    ema = load_file(trained / "checkpoints" / sd.run_folder.step_dir_name(6) / "ema.safetensors")
    (vectors,) = ema.values()
    # AUTOMATIC1111 takes a file of one tensor and names the token after the file; ComfyUI its first tensor
    with safe_open(str(a1111 / "cyan-sks.safetensors"), "pt") as handle:
        assert list(handle.keys()) == ["emb_params"]
        assert torch.equal(handle.get_tensor("emb_params"), vectors)
        header = handle.metadata()
    assert (header["modelspec.architecture"], header["modelspec.title"]) == ("stable-diffusion-v1/textual-inversion",
                                                                             "cyan-sks")
    assert list(load_file(folder / "learned_embeds.safetensors")) == [TOKEN]
    ours = sd.formats.load_pipeline(str(trained))
    expected = sd.model.encode_prompt_ids(ours.text_encoder, sd.model.tokenize(ours.tokenizer, [PROMPT]))
    for path, token in ((a1111 / "cyan-sks.safetensors", TOKEN), (folder / "learned_embeds.safetensors", None)):
        pipe = StableDiffusionPipeline.from_pretrained(str(base_model), local_files_only=True, safety_checker=None)
        pipe.load_textual_inversion(str(path), token=token)
        ids = pipe.tokenizer.convert_tokens_to_ids([TOKEN, f"{TOKEN}_1"])
        assert torch.equal(pipe.text_encoder.get_input_embeddings().weight[ids], vectors)
        with torch.no_grad():
            theirs, _ = pipe.encode_prompt(PROMPT, "cpu", 1, False)  # expands the token to both vectors
        assert torch.allclose(theirs, expected, atol=1e-5), (theirs - expected).abs().max()


def test_sampling_the_base_with_the_file_equals_sampling_the_run(tmp_path, trained, base_model):
    from PIL import Image

    file = tmp_path / "e.safetensors"
    assert SD_ImageGen.main(["--ckpt", str(trained), "--export_embedding", str(file)]) == 0
    flags = ["--prompt", PROMPT, "--n", "1", "--steps", "2", "--height", "32", "--width", "32"]
    assert SD_ImageGen.main(["--ckpt", str(trained), *flags, "--out", str(tmp_path / "run")]) == 0
    assert SD_ImageGen.main(["--ckpt", str(base_model), "--embedding", str(file), *flags,
                             "--out", str(tmp_path / "file")]) == 0
    assert SD_ImageGen.main(["--ckpt", str(base_model), *flags, "--out", str(tmp_path / "plain")]) == 0
    run, with_file, plain = (np.asarray(Image.open(tmp_path / s / "000_000000.png")).astype(int)
                             for s in ("run", "file", "plain"))
    assert np.array_equal(run, with_file)
    assert np.abs(run - plain).max() > 0  # the token changes the image


def test_an_a1111_pt_embedding_is_read_without_unpickling_code(tmp_path):
    vectors = torch.randn(3, 64)
    torch.save({"string_to_token": {"*": 265}, "string_to_param": {"*": vectors}, "name": "cat-style", "step": 100},
               tmp_path / "cat-style.pt")
    token, read = sd.embedding.formats.read_embedding(tmp_path / "cat-style.pt")
    assert token == "cat-style" and torch.equal(read, vectors)
    save_file({"a": vectors, "b": vectors.clone()}, str(tmp_path / "two.safetensors"))
    with pytest.raises(sd.embedding.tokens.EmbeddingError, match="two.safetensors: holds 2 tensors"):
        sd.embedding.formats.read_embedding(tmp_path / "two.safetensors")


def test_a_multi_vector_token_is_written_out_in_prompts_and_a_known_word_is_refused():
    tokenizer, encoder = sd.model.load_tokenizer("tiny"), sd.model.load_text_encoder("tiny")
    sd.embedding.tokens.add_token(tokenizer, encoder, "<t>", torch.zeros(3, 64))
    ids = sd.model.tokenize(tokenizer, ["a <t> dog"])[0].tolist()
    assert ids[:6] == [49406, 320, 49408, 49409, 49410, 1929]
    # Written out already (as a prompt once expanded is), it stays three vectors, not five.
    assert sd.embedding.tokens.expand(tokenizer, ["a <t> <t>_1 <t>_2 dog", "<t>, <t>"]) == [
        "a <t> <t>_1 <t>_2 dog", "<t> <t>_1 <t>_2, <t> <t>_1 <t>_2"]
    assert sd.model.tokenize(tokenizer, ["a <t> <t>_1 <t>_2 dog"])[0].tolist()[:6] == ids[:6]
    with pytest.raises(sd.embedding.tokens.EmbeddingError, match="'dog' is already in the tokenizer"):
        sd.embedding.tokens.add_token(tokenizer, encoder, "dog", torch.zeros(1, 64))
    with pytest.raises(sd.embedding.tokens.EmbeddingError, match="do not fit a text encoder"):
        sd.embedding.tokens.add_token(tokenizer, encoder, "<u>", torch.zeros(1, 768))


@pytest.mark.parametrize("fields, message", [
    (dict(embedding_init=""), "embedding.token needs embedding.init"),
    (dict(instance_prompt="a circle"), "does not use embedding.token"),
    (dict(embedding_token="<Cyan>"), "lower case"),
    (dict(init_from=""), "set init_from"),
])
def test_textual_inversion_settings_are_checked_before_any_work(tmp_path, instance_images, fields, message):
    values = {**FIELDS, "init_from": "owner/model", "instance_dir": str(instance_images), **fields}
    with pytest.raises(sd.train.config.ConfigError, match=message):
        sd.train.config.TrainConfig(**values).validate()


def test_a_token_learned_from_a_caption_dataset_reaches_the_step_as_its_own_id(tmp_path, base_model, monkeypatch):
    """Captions are tokenised before the token exists (stage 04): the loader tokenises their text again with
    the tokenizer that knows it, for training and validation."""
    from data_factory import make_captions, make_latents

    import sd.train.step

    rng = np.random.default_rng(0)
    keys = [f"k{i:03d}" for i in range(10)]
    make_latents(tmp_path / "latents", keys, rng.normal(size=(10, 4, 8, 8)))
    rows = [(k, f"a {TOKEN} circle" if i % 2 else "a red square") for i, k in enumerate(keys)]
    dataset = make_captions(tmp_path / "captions", rows[:8], rows[8:])
    seen, real = [], sd.train.step.train_step
    monkeypatch.setattr(sd.train.step, "train_step", lambda step, micro, *a, **k: seen.append(micro) or real(
        step, micro, *a, **k))
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**FIELDS, "instance_prompt": "", "datasets": [
        {"dataset": str(dataset), "latents": str(tmp_path / "latents")}], "init_from": str(base_model),
        "out_dir": str(tmp_path / "run"), "max_steps": 2, "validate_every": 2, "validation_prompts": []}))
    assert SD_Train.main(["--config", str(config)]) == 0
    ids = torch.cat([batch[1] for micro in seen for batch in micro])
    assert ((ids == 49408).any(1) == (ids == 49409).any(1)).all()  # both vectors of the token, together
    assert 0 < int((ids == 49408).any(1).sum()) < len(ids)
    assert "val_loss" in (tmp_path / "run" / "metrics.jsonl").read_text()
    assert not torch.equal(load_file(tmp_path / "run" / "checkpoints" / sd.run_folder.step_dir_name(2) / "embedding.safetensors")
                           ["emb_params"], sd.embedding.tokens.initial_vectors(
                               sd.model.load_tokenizer("tiny"), sd.model.load_text_encoder("tiny"), "blue", 2))


def caption_dataset(root: Path, captions: list[str]) -> dict:
    from data_factory import make_captions, make_latents

    keys = [f"k{i:03d}" for i in range(len(captions))]
    make_latents(root / "latents", keys, np.random.default_rng(0).normal(size=(len(keys), 4, 8, 8)))
    return {"dataset": str(make_captions(root / "captions", list(zip(keys, captions)), [])),
            "latents": str(root / "latents")}


def test_a_caption_dataset_without_the_token_is_refused_and_one_with_few_is_warned(tmp_path, base_model, capsys,
                                                                                    caplog):
    """Without the token in any caption the run once trained nothing, silently, and exited 0."""
    fields = {**FIELDS, "instance_prompt": "", "init_from": str(base_model), "max_steps": 1, "validate_every": 0}
    none = tmp_path / "none.yaml"
    none.write_text(yaml.safe_dump({**fields, "out_dir": str(tmp_path / "none"), "datasets": [
        caption_dataset(tmp_path / "d1", ["a red square", f"a {TOKEN}x circle", "asks"] * 3)]}))
    assert SD_Train.main(["--config", str(none)]) == 2
    err = capsys.readouterr().err
    assert f"embedding.token {TOKEN!r} is in none of the 9 training captions" in err and "Traceback" not in err
    assert not list((tmp_path / "none").glob("checkpoints/step_*"))
    few = tmp_path / "few.yaml"
    few.write_text(yaml.safe_dump({**fields, "out_dir": str(tmp_path / "few"), "datasets": [
        caption_dataset(tmp_path / "d2", [f"A {TOKEN.upper()}, circle"] + ["a red square"] * 4)]}))
    with caplog.at_level("WARNING"):
        assert SD_Train.main(["--config", str(few)]) == 0
    assert f"embedding.token {TOKEN} is in only 1 of the 5 training captions (20%)" in caplog.text


def test_an_embedding_that_cannot_be_added_is_named_by_its_file(tmp_path, base_model, capsys):
    """A wrong width or a word the vocabulary holds: the one-line error names the file given, not the token alone."""
    wide, known = tmp_path / "wide.safetensors", tmp_path / "dog.safetensors"
    sd.embedding.formats.write_embedding(wide, "<wide>", torch.zeros(1, 768), "a1111")
    sd.embedding.formats.write_embedding(known, "dog", torch.zeros(1, 64), "a1111")
    for path, reason in ((wide, "do not fit a text encoder"), (known, "already in the tokenizer's vocabulary")):
        code = SD_ImageGen.main(["--ckpt", str(base_model), "--embedding", str(path), "--prompt", "a", "--n", "1",
                                 "--steps", "1", "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert code == 2 and f"--embedding {path}: " in err and reason in err, err
        assert not (tmp_path / "out").exists()

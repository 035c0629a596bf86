"""Pivotal tuning on the tiny presets: a learned token and a LoRA in one run, each at its own learning rate, the
token frozen after a fraction of the steps; exact resume; the LoRA file bundles the token as AUTOMATIC1111
reads it and the embedding file beside it is the one ComfyUI and diffusers load."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import sd.embedding.formats
import sd.embedding.tokens
import sd.formats
import sd.lora.formats
import sd.model
import sd.run_folder
import sd.train.config
import sd.train.step
import SD_ImageGen

import test_textual_inversion as textual_inversion
from data_factory import assert_bitwise_equal
from test_textual_inversion import PROMPT, TOKEN

STEPS, TOKEN_STEPS = 6, 3  # embedding_train_fraction 0.5 of 6
PIVOTAL = dict(lr=1e-2, embedding_lr=5e-2, embedding_train_fraction=0.5, grad_accum=1, lora_rank=4, lora_alpha=4.0,
               lora_text_encoder=True, save_steps=1, keep_checkpoints=STEPS, max_steps=STEPS, log_every=1,
               posthoc_ema_every=2)
FIELDS = {**textual_inversion.FIELDS, **PIVOTAL}
base_model, instance_images = textual_inversion.base_model, textual_inversion.instance_images  # the same fixtures


def train(tmp_path: Path, name: str, base_model: Path, images: Path, *flags, **fields) -> int:
    """textual inversion's run of the same token and images, with a LoRA beside the token."""
    return textual_inversion.train(tmp_path, name, base_model, images, *flags, **{**PIVOTAL, **fields})


@pytest.fixture(scope="module")
def trained(tmp_path_factory, base_model, instance_images) -> Path:
    root = tmp_path_factory.mktemp("pivotal")
    assert train(root, "run", base_model, instance_images) == 0
    return root / "run"


def folder(run: Path, step: int) -> Path:
    return run / "checkpoints" / sd.run_folder.step_dir_name(step)


@pytest.mark.slow  # a training run: the full suite's, not make check's
def test_the_token_and_the_lora_train_at_their_own_rates_and_the_token_stops_after_its_fraction(trained):
    """Checkpoint entries side by side (adapter, embedding); three named optimizer groups; the token moves in
    its 3 steps at embedding_lr and not after, while the adapters move in all 6; metrics.jsonl logs both rates."""
    tokens = {step: load_file(folder(trained, step) / "embedding.safetensors")["emb_params"] for step in range(1, 7)}
    adapters = {step: load_file(folder(trained, step) / "adapter.safetensors") for step in (3, 6)}
    assert all(not torch.equal(tokens[s], tokens[s + 1]) for s in range(1, TOKEN_STEPS))
    assert all(torch.equal(tokens[TOKEN_STEPS], tokens[s]) for s in range(TOKEN_STEPS + 1, STEPS + 1))
    assert any(k.startswith("text_encoder.") for k in adapters[6]) and not any("vectors" in k for k in adapters[6])
    assert all(not torch.equal(adapters[3][k], adapters[6][k]) for k in adapters[6] if ".lora_B." in k)
    optimizer = torch.load(folder(trained, 6) / "optimizer.pt", weights_only=True)
    assert [g["name"] for g in optimizer["param_groups"]] == ["unet", "text_encoder", "embedding"]
    token_state = optimizer["state"][optimizer["param_groups"][2]["params"][0]]
    assert token_state["exp_avg"].shape == (2, 64) and int(token_state["step"]) == TOKEN_STEPS
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "loss" in r]
    config = sd.train.config.TrainConfig(**FIELDS)
    for record in records:
        step = record["step"] - 1
        want = sd.train.step.lr_at(step, 5e-2, 0, STEPS) if step < TOKEN_STEPS else 0.0
        assert record["lr_embedding"] == pytest.approx(want, rel=1e-12) and record["lr"] == pytest.approx(
            sd.train.step.lr_at(step, 1e-2, 0, STEPS), rel=1e-12)
        assert sd.train.step.lrs_at(config, step, STEPS)["embedding"] == pytest.approx(want, rel=1e-12)
    assert len(records) == STEPS


@pytest.mark.slow  # a training run: the full suite's, not make check's
def test_a_run_resumed_after_the_token_froze_is_bitwise_the_uninterrupted_one(tmp_path, trained, base_model,
                                                                               instance_images):
    assert train(tmp_path, "b", base_model, instance_images, "--stop_at_step", "4") == 0
    assert train(tmp_path, "b", base_model, instance_images) == 0
    for name in ("adapter.safetensors", "embedding.safetensors", "ema.safetensors", "posthoc_ema.safetensors"):
        assert_bitwise_equal(load_file(folder(trained, 6) / name), load_file(folder(tmp_path / "b", 6) / name))
    straight = torch.load(folder(trained, 6) / "optimizer.pt", weights_only=True)["state"]
    resumed = torch.load(folder(tmp_path / "b", 6) / "optimizer.pt", weights_only=True)["state"]
    assert_bitwise_equal({f"{i}.{k}": torch.as_tensor(v) for i, s in straight.items() for k, v in s.items()},
                         {f"{i}.{k}": torch.as_tensor(v) for i, s in resumed.items() for k, v in s.items()})


def prompt_output(pipe) -> torch.Tensor:
    with torch.no_grad():
        ids = sd.model.tokenize(pipe.tokenizer, sd.embedding.tokens.expand(pipe.tokenizer, [PROMPT]))
        return pipe.text_encoder(ids).last_hidden_state


@pytest.mark.slow  # a training run: the full suite's, not make check's
def test_the_lora_file_bundles_the_token_and_loads_back_to_what_the_run_samples_with(tmp_path, trained, base_model,
                                                                                     caplog):
    """--export_lora writes bundle_emb.<token>.string_to_param.* (AUTOMATIC1111's bundled embeddings) and the
    token's own file beside it; the base with --lora FILE (its token added from the bundle) computes what the run
    computes: the same text encoding of a prompt with the token and the same UNet weights. The log names the
    export diffusers loads (it refuses bundle_emb keys)."""
    out = tmp_path / "style.safetensors"
    with caplog.at_level("INFO"):
        assert SD_ImageGen.main(["--ckpt", str(trained), "--export_lora", str(out)]) == 0
    assert "for diffusers: the same export with --lora_format diffusers" in caplog.text
    run = sd.formats.load_pipeline(str(trained))
    vectors = sd.embedding.tokens.added_embeddings(run.text_encoder)[0].vectors
    with safe_open(str(out), framework="pt") as handle:
        bundled = {k: handle.get_tensor(k) for k in handle.keys() if k.startswith("bundle_emb.")}
    assert list(bundled) == [f"bundle_emb.{TOKEN}.string_to_param.*"]
    _, name, rest = next(iter(bundled)).split(".", 2)  # AUTOMATIC1111's split of a bundled key
    assert (name, rest) == (TOKEN, "string_to_param.*") and torch.equal(next(iter(bundled.values())), vectors)
    beside = tmp_path / f"{sd.embedding.formats.file_stem(TOKEN)}.safetensors"
    assert torch.equal(load_file(beside)["emb_params"], vectors)

    plain = sd.formats.load_pipeline(str(base_model))
    sd.lora.formats.merge_adapters(plain, [(str(out), 1.0)])
    sd.lora.formats.merge_adapters(run, [])
    torch.testing.assert_close(prompt_output(plain), prompt_output(run), atol=1e-5, rtol=1e-5)
    ours, theirs = plain.unet.state_dict(), run.unet.state_dict()
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-5


@pytest.mark.slow  # a training run: the full suite's, not make check's
def test_an_ema_length_rebuilds_the_text_adapter_and_the_token_with_the_unet(tmp_path, trained):
    """posthoc_ema_every keeps the two power-function EMAs of the text adapter and the token beside the UNet's;
    --ema_length 0.05 puts the rebuilt ones in the exported LoRA (its text layers and bundled token), which
    differ from the classic EMA's."""
    import sd.posthoc_ema

    snapshot = load_file(trained / "posthoc_ema" / "step_00000006.safetensors")
    rebuilt, step = sd.posthoc_ema.reconstruct(trained, 0.05)
    # the text encoder's own names (transformers 5's CLIPTextModel has no text_model.)
    (token_key,) = [k for k in rebuilt if k.startswith("text_encoder.") and k.endswith("token_embedding.vectors")]
    (ours,) = [k for k in rebuilt
               if k.startswith("text_encoder.") and k.endswith("layers.0.self_attn.q_proj.lora_A.default.weight")]
    assert {f"sigma_rel_{s:g}/{token_key}" for s in sd.posthoc_ema.PROFILES} <= set(snapshot)
    assert step == STEPS
    out = {}
    for name, flags in (("classic", []), ("rebuilt", ["--ema_length", "0.05"])):
        path = tmp_path / f"{name}.safetensors"
        assert SD_ImageGen.main(["--ckpt", str(trained), *flags, "--export_lora", str(path)]) == 0
        out[name] = load_file(path)
    bundled = f"bundle_emb.{TOKEN}.string_to_param.*"
    down = "lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight"
    torch.testing.assert_close(out["rebuilt"][bundled], rebuilt[token_key])
    torch.testing.assert_close(out["rebuilt"][down], rebuilt[ours])
    assert not torch.allclose(out["rebuilt"][bundled], out["classic"][bundled], atol=1e-6)
    assert not torch.allclose(out["rebuilt"][down], out["classic"][down], atol=1e-6)


@pytest.mark.parametrize("fields, message", [
    (dict(lora_rank=0, lora_text_encoder=False), "embedding.lr and embedding.train_fraction set the learned token's "
     "schedule beside a LoRA"),
    (dict(embedding_token="", embedding_init="", embedding_lr=0.0), "embedding.train_fraction set the learned token's"),
    (dict(embedding_train_fraction=0.0), r"embedding\.train_fraction must be in \(0, 1\]"),
    (dict(optimizer="prodigy", lr=1.0), "leave embedding.lr at 0"),
])
def test_pivotal_settings_are_checked_before_any_work(instance_images, fields, message):
    values = {**FIELDS, "init_from": "owner/model", "instance_dir": str(instance_images), **fields}
    with pytest.raises(sd.train.config.ConfigError, match=message):
        sd.train.config.TrainConfig(**values).validate()

"""LoRA files (diffusers and kohya layouts), LoRA runs' checkpoints, and SD_ImageGen.py's --lora /
--export_lora, on the tiny presets with diffusers as the outside reader."""

import copy
import json
import re
import shutil
import stat

import numpy as np
import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import sd.formats
import sd.imagegen.lora
import sd.lora.adapters
import sd.lora.formats
import sd.model
import sd.run_folder
import sd.sampling
import sd.train.checkpoint as ckpt
import sd.train.recovery
import SD_ImageGen

import global_rngs
from lora_readers import comfyui_loaded_keys, sd_scripts_loaded_keys

RANK, ALPHA = 4, 8.0  # alpha != rank: every reader must apply alpha / rank = 2
STEPS = 2


@pytest.fixture(scope="module")
def base():
    """The tiny base parts: UNet, text encoder, VAE, tokenizer."""
    return (sd.model.build_unet("tiny", seed=0, from_scratch=False).eval(), sd.model.load_text_encoder("tiny"),
            sd.model.load_vae("tiny"), sd.model.load_tokenizer("tiny"))


def adapted(base, targets, rank=RANK, alpha=ALPHA, seed=1, text=True):
    """Copies of the base UNet (and text encoder) with random non-zero adapters."""
    unet, encoder = copy.deepcopy(base[0]), copy.deepcopy(base[1])
    sd.lora.adapters.add_lora(unet, sd.lora.adapters.resolve_targets(unet, targets), rank, alpha)
    if text:
        sd.lora.adapters.add_lora(encoder, sd.lora.adapters.resolve_targets(encoder, sd.lora.adapters.TEXT_TARGETS), rank, alpha)
    randomize(unet, seed)
    randomize(encoder, seed + 100)
    return unet.eval(), encoder.eval()


def test_an_adapter_is_drawn_from_its_seed_and_leaves_the_global_rngs_alone(base):
    modules = sd.lora.adapters.resolve_targets(base[0], ["attention"])

    def down_weights(seed):
        with global_rngs.left_alone():
            unet = sd.lora.adapters.add_lora(copy.deepcopy(base[0]), modules, RANK, ALPHA, seed=seed)
        return [v for k, v in sd.lora.adapters.adapter_state(unet).items() if "lora_A" in k]

    first, again, other = down_weights(1), down_weights(1), down_weights(2)
    assert first and all(torch.equal(a, b) for a, b in zip(first, again))
    assert not any(torch.equal(a, b) for a, b in zip(first, other))


@torch.no_grad()
def randomize(model, seed):
    generator = torch.Generator().manual_seed(seed)
    for param in sd.lora.adapters.adapter_state(model).values():
        param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def write(fmt, tmp_path, unet, encoder, name="lora"):
    out = tmp_path / (f"{name}.safetensors" if fmt == "kohya" else name)
    return sd.lora.formats.save_model_lora(out, unet, encoder, fmt)


def stored_up(fmt, m: sd.lora.formats.LoraModule) -> torch.Tensor:
    """The up weight a file of ``fmt`` holds for ``m``: a diffusers file's has alpha / rank in it."""
    return m.up * (m.alpha / m.rank) if fmt == "diffusers" else m.up


def unet_output(unet):
    generator = torch.Generator().manual_seed(0)
    sample, context = torch.randn(2, 4, 8, 8, generator=generator), torch.randn(2, 77, 64, generator=generator)
    with torch.no_grad():
        return unet(sample, 10, context).sample


def text_output(encoder, tokenizer):
    with torch.no_grad():
        return encoder(sd.model.tokenize(tokenizer, ["a red circle", "a blue square"])).last_hidden_state


# ------------------------------------------------------------------------------ diffusers as the reader


@pytest.mark.parametrize("fmt,targets", [("diffusers", ["transformer"]), ("kohya", ["attention", "resnet"])])
def test_diffusers_loads_our_files_whole_and_computes_what_we_do(fmt, targets, base, tmp_path):
    from diffusers import DDIMScheduler, StableDiffusionPipeline
    from peft.utils import get_peft_model_state_dict

    unet, encoder = adapted(base, targets)
    path = write(fmt, tmp_path, unet, encoder)
    pipe = StableDiffusionPipeline(unet=copy.deepcopy(base[0]), text_encoder=copy.deepcopy(base[1]), vae=base[2],
                                   tokenizer=base[3], scheduler=sd.model.build_noise_scheduler("epsilon", DDIMScheduler),
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.load_lora_weights(str(path.parent if fmt == "diffusers" else path))
    # Every layer of ours got its adapter in diffusers' model, with our very tensors (up times alpha / rank
    # from a diffusers file); none more.
    for theirs, ours in ((pipe.unet, unet), (pipe.text_encoder, encoder)):
        loaded = get_peft_model_state_dict(theirs, adapter_name="default_0")
        own = {k.replace(f".{sd.lora.adapters.ADAPTER}.", "."): v for k, v in sd.lora.adapters.adapter_state(ours).items()}
        own = {k: v * ALPHA / RANK if fmt == "diffusers" and ".lora_B." in k else v for k, v in own.items()}
        assert set(loaded) == set(own) and all(torch.equal(loaded[k], own[k]) for k in own)
    assert any(m.down.ndim == 4 and m.down.shape[2:] == (3, 3) for m in sd.lora.formats.adapter_lora_modules(unet).values()) \
        == ("resnet" in targets)
    expected, plain = unet_output(unet), unet_output(base[0])
    assert (expected - plain).abs().max() > 1e-2  # the adapter changes the output: the comparison below can fail
    torch.testing.assert_close(unet_output(pipe.unet), expected, atol=1e-5, rtol=0)
    expected = text_output(encoder, base[3])
    assert (expected - text_output(base[1], base[3])).abs().max() > 1e-2
    torch.testing.assert_close(text_output(pipe.text_encoder, base[3]), expected, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------ ComfyUI and sd-scripts as readers

def test_the_default_lora_file_loads_whole_in_comfyui_and_sd_scripts(base, tmp_path):
    unet, encoder = adapted(base, ["transformer", "resnet"])  # LoCon: 3x3 conv adapters too
    path = sd.lora.formats.save_model_lora(tmp_path / "style", unet, encoder)
    assert path == tmp_path / "style.safetensors"
    keys = set(load_file(str(path)))
    layers = len(sd.lora.formats.adapter_lora_modules(unet)) + len(sd.lora.formats.adapter_lora_modules(encoder))
    assert len(keys) == 3 * layers  # down, up and alpha of every layer
    assert comfyui_loaded_keys(keys, base[0], base[1]) == keys
    assert sd_scripts_loaded_keys(keys, base[0], base[1]) == keys
    # The diffusers layout (on request) is the one both skip: what the default must not be.
    theirs = set(load_file(str(write("diffusers", tmp_path, unet, encoder))))
    assert not comfyui_loaded_keys(theirs, base[0], base[1]) and not sd_scripts_loaded_keys(theirs, base[0], base[1])


def test_a_diffusers_file_gives_the_trained_weights_whether_or_not_its_reader_applies_alpha(base, tmp_path):
    """diffusers 0.32 and older read PEFT keys with alpha = rank (scale 1) whatever the header says; newer
    versions take alpha / rank from its lora_adapter_metadata; ours from read_lora. With alpha / rank =
    0.75 all three give the trained adapter's delta."""
    unet, encoder = adapted(base, ["attention", "resnet"], rank=4, alpha=3.0)
    path = write("diffusers", tmp_path, unet, encoder)
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as handle:
        config = json.loads(handle.metadata()["lora_adapter_metadata"])
    ours = sd.lora.formats.read_lora(path.parent, base[0], base[1])
    for part, model in (("unet", unet), ("text_encoder", encoder)):
        assert not config[f"{part}.alpha_pattern"] and not config[f"{part}.rank_pattern"]
        header_scale = config[f"{part}.lora_alpha"] / config[f"{part}.r"]
        modules = sd.lora.formats.adapter_lora_modules(model)
        assert modules and set(ours[part]) == set(modules)
        for name, m in modules.items():
            trained = 0.75 * (m.up.flatten(1) @ m.down.flatten(1))
            key = f"{part}.{sd.lora.formats.lora_file_name(part, name)}"
            up, down = tensors[f"{key}.lora_B.weight"].flatten(1), tensors[f"{key}.lora_A.weight"].flatten(1)
            read = ours[part][name]
            for reader, delta in (("alpha = rank", up @ down), ("header alpha", header_scale * (up @ down)),
                                  ("read_lora", read.alpha / read.rank * read.delta(trained.shape))):
                torch.testing.assert_close(delta, trained, atol=1e-6, rtol=1e-5, msg=f"{reader}: {part} {name}")


# ------------------------------------------------------------------------------ our reader


@pytest.mark.parametrize("fmt", sd.lora.formats.LORA_FORMATS)
def test_written_files_read_back_to_the_same_tensors(fmt, base, tmp_path):
    unet, encoder = adapted(base, ["transformer", "resnet"])
    path = write(fmt, tmp_path, unet, encoder)
    back = sd.lora.formats.read_lora(path.parent if fmt == "diffusers" else path, base[0], base[1])
    for part, model in (("unet", unet), ("text_encoder", encoder)):
        own = sd.lora.formats.adapter_lora_modules(model)
        assert set(back[part]) == set(own)
        for name, m in own.items():
            assert torch.equal(back[part][name].down, m.down) and torch.equal(back[part][name].up, stored_up(fmt, m))
            assert back[part][name].alpha == (RANK if fmt == "diffusers" else ALPHA)
    with safe_open(str(path), framework="pt") as handle:
        header = handle.metadata()
    assert (header["lora_rank"], header["lora_alpha"]) == (str(RANK), str(ALPHA))  # as trained, whatever is folded
    assert ("lora_B weight" in header.get(sd.lora.formats.FOLDED, "")) == (fmt == "diffusers")
    assert json.loads(header["lora_targets"]) == sorted(sd.lora.formats.adapter_lora_modules(unet))
    keys = set(load_file(str(path)))
    if fmt == "kohya":
        assert "lora_te_text_model_encoder_layers_0_self_attn_q_proj.alpha" in keys
        assert "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_out_0.lora_down.weight" in keys
        assert "lora_unet_down_blocks_0_downsamplers_0_conv.lora_up.weight" in keys
    else:
        assert "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight" in keys
        assert "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0.lora_B.weight" in keys


def test_peft_keys_without_a_prefix_read_as_the_unet_and_without_metadata_alpha_is_the_rank(base, tmp_path):
    unet, _ = adapted(base, ["attention"], text=False)
    state = {k.replace(f".{sd.lora.adapters.ADAPTER}.", "."): v for k, v in sd.lora.adapters.adapter_state(unet).items()}
    save_file(state, str(tmp_path / "peft.safetensors"))
    back = sd.lora.formats.read_lora(tmp_path / "peft.safetensors", base[0], base[1])
    assert set(back) == {"unet"} and len(back["unet"]) == len(state) // 2
    assert {m.alpha for m in back["unet"].values()} == {float(RANK)}


def test_unknown_keys_shape_mismatches_and_missing_files_are_errors_naming_the_file(base, tmp_path):
    unet, encoder = adapted(base, ["attention"])
    path = write("kohya", tmp_path, unet, encoder)
    tensors = load_file(str(path))
    odd = tmp_path / "odd.safetensors"
    save_file({**tensors, "lora_unet_no_such_layer.lora_down.weight": torch.zeros(4, 8)}, str(odd))
    with pytest.raises(ValueError, match=r"odd\.safetensors: 1 of its .*lora_unet_no_such_layer"):
        sd.lora.formats.read_lora(odd, base[0], base[1])
    key = "lora_unet_mid_block_attentions_0_transformer_blocks_0_attn2_to_k.lora_up.weight"
    save_file({**tensors, key: torch.zeros(3, RANK)}, str(tmp_path / "shape.safetensors"))
    with pytest.raises(ValueError, match=r"shape\.safetensors: unet layer mid_block.*attn2\.to_k: .*do not fit"):
        sd.lora.formats.read_lora(tmp_path / "shape.safetensors", base[0], base[1])
    save_file({k: v for k, v in tensors.items() if not k.endswith("lora_up.weight")}, str(tmp_path / "half.safetensors"))
    with pytest.raises(ValueError, match=r"half\.safetensors: .* has no up weight"):
        sd.lora.formats.read_lora(tmp_path / "half.safetensors", base[0], base[1])
    with pytest.raises(FileNotFoundError, match="pytorch_lora_weights.safetensors is missing"):
        sd.lora.formats.read_lora(tmp_path, base[0], base[1])


# ------------------------------------------------------------------------------ a LoRA run of ours


@pytest.fixture(scope="module")
def base_dir(base, tmp_path_factory):
    folder = tmp_path_factory.mktemp("base") / "pipe"
    sd.formats.export_diffusers(folder, base[0], base[2], base[1], base[3])
    return folder


@pytest.fixture(scope="module")
def lora_run(base, base_dir, tmp_path_factory):
    """A LoRA run's checkpoint folder as the trainer writes it: adapter (UNet and text encoder), the UNet
    adapter's EMA, the base's fingerprint, config.yaml, COMPLETE; no unet.safetensors. Returns (run
    folder, live models, EMA UNet)."""
    run = tmp_path_factory.mktemp("lora_run") / "run"
    folder = run / "checkpoints" / sd.run_folder.step_dir_name(12)
    folder.mkdir(parents=True)
    unet, encoder = adapted(base, ["attention"], seed=3)
    ema = copy.deepcopy(unet)
    randomize(ema, 5)
    ckpt.save_weights(sd.lora.adapters.AdapterWeights(unet=unet, text_encoder=encoder).state_dict(), folder / "adapter.safetensors")
    ckpt.save_weights(sd.lora.adapters.adapter_state(ema), folder / "ema.safetensors")
    ckpt.save_weights({"fingerprint": sd.run_folder.weights_fingerprint(base[0].parameters())}, folder / "lora_base.safetensors")
    config = dict(init_from=str(base_dir), lora_rank=RANK, lora_alpha=ALPHA, lora_dropout=0.0, lora_targets=["attention"],
                  lora_text_encoder=True, unet="tiny", vae=str(base_dir), text_encoder=str(base_dir),
                  tokenizer=str(base_dir), prediction_type="epsilon")
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / sd.run_folder.COMPLETE).write_text("ok\n")
    return run, unet, encoder, ema


def adapters_equal(model, reference) -> bool:
    mine, theirs = sd.lora.adapters.adapter_state(model), sd.lora.adapters.adapter_state(reference)
    return set(mine) == set(theirs) and all(torch.equal(v, theirs[k]) for k, v in mine.items())


def test_a_lora_run_loads_its_base_and_keeps_the_ema_adapter_unmerged(lora_run, base):
    run, unet, encoder, ema = lora_run
    model = sd.formats.load_pipeline(str(run))
    assert adapters_equal(model.unet, ema) and adapters_equal(model.text_encoder, encoder)
    torch.testing.assert_close(unet_output(model.unet), unet_output(ema), atol=0, rtol=0)
    live = sd.formats.load_pipeline(str(run), use_ema=False)
    assert adapters_equal(live.unet, unet)
    # As init_from of a new phase (sd.train.recovery.init_weights): plain weights, base + adapter merged.
    plain = sd.model.build_unet("tiny", from_scratch=False)
    sd.formats.load_unet_weights(str(run), plain, use_ema=False)
    assert not sd.lora.adapters.has_lora(plain) and plain.training and all(p.requires_grad for p in plain.parameters())
    torch.testing.assert_close(unet_output(plain), unet_output(unet), atol=1e-5, rtol=0)
    ema_state = sd.formats.run_ema_weights(str(run), plain)
    plain.load_state_dict(ema_state)
    torch.testing.assert_close(unet_output(plain), unet_output(ema), atol=1e-5, rtol=0)


@pytest.mark.parametrize("fmt,out,written", [("kohya", "style.safetensors", "style.safetensors"),
                                              ("diffusers", "style", "style/pytorch_lora_weights.safetensors"),
                                              (None, "style", "style.safetensors")])  # None: the default, kohya
def test_export_lora_writes_the_runs_ema_adapter(fmt, out, written, lora_run, base, tmp_path):
    run, unet, encoder, ema = lora_run
    argv = ["--ckpt", str(run), "--export_lora", str(tmp_path / out)] + (["--lora_format", fmt] if fmt else [])
    assert SD_ImageGen.main(argv) == 0
    assert [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()] == [written]
    back = sd.lora.formats.read_lora(tmp_path / written, base[0], base[1])
    for part, model in (("unet", ema), ("text_encoder", encoder)):
        own = sd.lora.formats.adapter_lora_modules(model)
        assert set(back[part]) == set(own)
        assert all(torch.equal(back[part][n].down, m.down) and torch.equal(back[part][n].up, stored_up(fmt, m))
                   and back[part][n].alpha == (RANK if fmt == "diffusers" else ALPHA) for n, m in own.items())
    keys = load_file(tmp_path / written)
    assert any(k.startswith("lora_unet_") for k in keys) == (fmt != "diffusers")
    with safe_open(str(tmp_path / written), framework="pt") as handle:
        header = handle.metadata()
    assert json.loads(header["lora_targets"]) == ["attention"] and header["lora_text_encoder"] == "True"
    assert stat.S_IMODE((tmp_path / written).stat().st_mode) == sd.files.file_mode()  # not 0600


def test_export_lora_of_a_model_without_an_adapter_is_a_clear_error(base_dir, tmp_path, capsys):
    assert SD_ImageGen.main(["--ckpt", str(base_dir), "--export_lora", str(tmp_path / "x")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("SD_ImageGen.py:")]
    assert len(err) == 1 and f"{base_dir} carries no LoRA adapter" in err[0]
    assert not (tmp_path / "x").exists()


def lora_run_copy(lora_run, tmp_path, **config_fields):
    """A copy of the LoRA run (its checkpoint folder returned too), ``config_fields`` changed in its config."""
    run = tmp_path / "run"
    shutil.copytree(lora_run[0], run)
    folder = sd.run_folder.resolve_checkpoint(run)
    config = yaml.safe_load((folder / "config.yaml").read_text())
    (folder / "config.yaml").write_text(yaml.safe_dump({**config, **config_fields}))
    return run, folder


def imagegen_errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("SD_ImageGen.py:")]


@pytest.mark.slow  # over 4 s: the full suite's (make check stays near 3 minutes)
def test_a_lora_run_on_a_base_it_was_not_trained_on_is_refused_unless_allowed(lora_run, base, tmp_path, capsys):
    """The run's init_from now holds other weights: sampling stops with one line naming the base and the
    checkpoint; --allow_other_base samples anyway; exporting the adapter alone does not use the base."""
    other = tmp_path / "other_base"
    sd.formats.export_diffusers(other, sd.model.build_unet("tiny", seed=9, from_scratch=False), base[2], base[1], base[3])
    run, folder = lora_run_copy(lora_run, tmp_path, init_from=str(other))
    assert SD_ImageGen.main(sample_args(run, tmp_path / "refused")) == 2
    err = imagegen_errors(capsys)
    assert len(err) == 1 and f"{other} is not the base model the adapter in {folder} was trained on" in err[0]
    assert "--allow_other_base" in err[0] and not (tmp_path / "refused").exists()
    assert SD_ImageGen.main([*sample_args(run, tmp_path / "allowed"), "--allow_other_base"]) == 0
    assert (tmp_path / "allowed" / "000_000003.png").is_file()
    assert SD_ImageGen.main(["--ckpt", str(run), "--export_lora", str(tmp_path / "style")]) == 0
    # As init_from of a new phase the run's merged weights would be as wrong: refused too.
    with pytest.raises(sd.formats.BaseMismatch, match="is not the base model"):
        sd.formats.load_unet_weights(str(run), sd.model.build_unet("tiny", from_scratch=False))


@pytest.mark.slow  # over 4 s: the full suite's (make check stays near 3 minutes)
def test_non_finite_lora_weights_are_refused_naming_the_tensor_and_the_file(lora_run, base, tmp_path, capsys):
    unet, encoder = adapted(base, ["attention"])
    tensors = load_file(str(write("kohya", tmp_path, unet, encoder)))
    key = "lora_unet_mid_block_attentions_0_transformer_blocks_0_attn2_to_k.lora_up.weight"
    tensors[key][1, 0] = float("nan")
    save_file(tensors, str(tmp_path / "nan.safetensors"))
    with pytest.raises(ValueError, match=rf"nan\.safetensors: {key} holds non-finite values"):
        sd.lora.formats.read_lora(tmp_path / "nan.safetensors", base[0], base[1])
    assert SD_ImageGen.main([*sample_args(lora_run[0], tmp_path / "x"), "--lora", str(tmp_path / "nan.safetensors")]) == 2
    err = imagegen_errors(capsys)
    assert len(err) == 1 and "nan.safetensors" in err[0] and key in err[0]
    # A LoRA run's own adapter and its EMA.
    for name in ("adapter.safetensors", "ema.safetensors"):
        run, folder = lora_run_copy(lora_run, tmp_path / name)
        state = load_file(str(folder / name))
        bad = sorted(k for k in state if k.endswith("lora_A.default.weight"))[0]
        state[bad][0, 0] = float("inf")
        save_file(state, str(folder / name))
        assert SD_ImageGen.main(sample_args(run, tmp_path / name / "out")) == 2
        err = imagegen_errors(capsys)
        assert len(err) == 1 and str(folder / name) in err[0] and f"{bad} holds non-finite values" in err[0], err
        assert not (tmp_path / name / "out").exists()


# ------------------------------------------------------------------------------ merging: --lora


def sample_args(ckpt_path, out):
    return ["--ckpt", str(ckpt_path), "--prompt", "a red circle", "--seed", "3", "--n", "1", "--steps", str(STEPS),
            "--cfg", "4.0", "--height", "64", "--width", "64", "--device", "cpu", "--precision", "fp32",
            "--out", str(out)]


@pytest.fixture(scope="module")
def merged(lora_run, base, tmp_path_factory):
    """The LoRA run sampled and exported with a LoCon kohya file merged at 0.5 on top of its own adapter."""
    root = tmp_path_factory.mktemp("merged")
    file_unet, file_encoder = adapted(base, ["attention", "resnet"], rank=2, alpha=3.0, seed=7)
    path = write("kohya", root, file_unet, file_encoder, "locon")
    assert SD_ImageGen.main([*sample_args(lora_run[0], root / "lora_images"), "--lora", f"{path}:0.5",
                             "--export_diffusers", str(root / "merged")]) == 0
    return root, file_unet, file_encoder


def expected_weights(plain, adapters: list[tuple[torch.nn.Module, float]]) -> dict[str, torch.Tensor]:
    """``plain``'s weights + scale x (alpha / rank) x up @ down of every adapter, computed here."""
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    for model, scale in adapters:
        for name, layer in sd.lora.adapters.lora_layers(model):
            down, up = layer.lora_A[sd.lora.adapters.ADAPTER].weight, layer.lora_B[sd.lora.adapters.ADAPTER].weight
            alpha, rank = layer.lora_alpha[sd.lora.adapters.ADAPTER], down.shape[0]
            weight = state[f"{name}.weight"]
            state[f"{name}.weight"] = weight + scale * (alpha / rank) * (up.flatten(1) @ down.flatten(1)).reshape(weight.shape)
    return state


def test_merged_export_is_the_base_plus_each_scaled_adapter(merged, lora_run, base):
    from diffusers import UNet2DConditionModel

    root, file_unet, file_encoder = merged
    _, _, encoder, ema = lora_run
    exported = {"unet": UNet2DConditionModel.from_pretrained(root / "merged", subfolder="unet").state_dict(),
                "text_encoder": sd.model.load_text_encoder(str(root / "merged")).state_dict()}
    for part, plain, adapters in (("unet", base[0], [(ema, 1.0), (file_unet, 0.5)]),
                                  ("text_encoder", base[1], [(encoder, 1.0), (file_encoder, 0.5)])):
        expected = expected_weights(plain, adapters)
        assert set(exported[part]) == set(expected)
        changed = [k for k in expected if not torch.equal(expected[k], plain.state_dict()[k])]
        assert len(changed) == len({n for m, _ in adapters for n, _ in sd.lora.adapters.lora_layers(m)}) > 0
        for key, value in expected.items():
            torch.testing.assert_close(exported[part][key], value, atol=1e-6, rtol=0, msg=f"{part} {key}")


def test_sampling_with_lora_equals_sampling_the_merged_export(merged, tmp_path):
    from PIL import Image

    root = merged[0]
    assert SD_ImageGen.main(sample_args(root / "merged", tmp_path / "plain")) == 0
    with_lora = np.asarray(Image.open(root / "lora_images" / "000_000003.png").convert("RGB")).astype(int)
    plain = np.asarray(Image.open(tmp_path / "plain" / "000_000003.png").convert("RGB")).astype(int)
    assert with_lora.std() > 0 and np.abs(with_lora - plain).max() <= 1
    assert "+ LoRA" in sd.sampling.read_parameters(root / "lora_images" / "000_000003.png")


def test_lora_specs_split_on_the_last_colon_only_before_a_number(tmp_path):
    assert sd.imagegen.lora.parse_lora_spec("style.safetensors") == ("style.safetensors", 1.0)
    assert sd.imagegen.lora.parse_lora_spec("style.safetensors:0.5") == ("style.safetensors", 0.5)
    assert sd.imagegen.lora.parse_lora_spec("C:\\loras\\style.safetensors:-1e-1") == ("C:\\loras\\style.safetensors", -0.1)
    assert sd.imagegen.lora.parse_lora_spec("C:\\loras\\style.safetensors") == ("C:\\loras\\style.safetensors", 1.0)
    odd = tmp_path / "a:2"
    odd.mkdir()
    assert sd.imagegen.lora.parse_lora_spec(str(odd)) == (str(odd), 1.0)
    with pytest.raises(ValueError, match="finite"):
        sd.imagegen.lora.parse_lora_spec("style.safetensors:nan")


def test_lora_flags_that_could_do_nothing_are_refused(capsys):
    for argv in (["--export_lora", "out", "--lora", "style.safetensors"],  # --lora: nothing sampled or exported whole
                 ["--export_lora", "out.safetensors", "--lora_format", "diffusers"]):  # a diffusers LoRA is a folder
        with pytest.raises(SystemExit):
            SD_ImageGen.parse_args(["--ckpt", "run", *argv])
    assert "--lora merges into the weights" in capsys.readouterr().err


# ------------------------------------------------------------------------------ LoCon: the convolutions' own rank and alpha

CONV_RANK, CONV_ALPHA = 2, 1.0


def test_locon_convolutions_keep_their_own_rank_in_the_kohya_layout_with_alpha_folded(base, tmp_path):
    """3x3 convolutions at rank 2 / alpha 1, Linear and 1x1 layers at rank 4 / alpha 8: the file's keys say
    so and its header records them as trained (kohya's network_dim / network_alpha, conv_dim / conv_alpha) with
    a note of the folding. Layers of two ranks are written with alpha / rank folded into up and alpha = rank:
    diffusers up to 0.32.1 (sd-scripts' pinned version) reads such a file at alpha = rank whatever it holds
    (``_maybe_adjust_config``), the other readers (ours, newer diffusers' conversion of kohya files) read each
    alpha; both get the trained weights."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    unet = copy.deepcopy(base[0])
    modules = sd.lora.adapters.resolve_targets(unet, ["attention", "resnet"])
    sd.lora.adapters.add_lora(unet, modules, RANK, ALPHA, conv_rank=CONV_RANK, conv_alpha=CONV_ALPHA)
    randomize(unet, 7)
    path = sd.lora.formats.save_model_lora(tmp_path / "locon.safetensors", unet.eval())
    tensors = load_file(path)
    convs = [n for n in modules if sd.lora.adapters.is_spatial_conv(base[0].get_submodule(n))]
    assert 0 < len(convs) < len(modules) and any(getattr(base[0].get_submodule(n), "kernel_size", ()) == (1, 1)
                                                 for n in modules)  # a 1x1 conv_shortcut takes the Linear rank
    assert len(tensors) == 3 * len(modules)
    own = sd.lora.formats.adapter_lora_modules(unet)
    back = sd.lora.formats.read_lora(path, base[0])["unet"]
    assert set(back) == set(own) == set(modules)
    for name, m in own.items():
        layer, key = base[0].get_submodule(name), "lora_unet_" + name.replace(".", "_")
        down, up, alpha = (tensors[f"{key}.{s}"] for s in ("lora_down.weight", "lora_up.weight", "alpha"))
        if name in convs:
            assert down.shape == (CONV_RANK, layer.in_channels, 3, 3) and up.shape == (layer.out_channels, CONV_RANK, 1, 1)
            assert (m.rank, m.alpha, alpha.item()) == (CONV_RANK, CONV_ALPHA, CONV_RANK), name
        else:
            assert (down.shape[0], up.shape[1], m.alpha, alpha.item()) == (RANK, RANK, ALPHA, RANK), name
        trained = (m.alpha / m.rank) * (m.up.flatten(1) @ m.down.flatten(1))
        for reader, delta in (("alpha = rank", up.flatten(1) @ down.flatten(1)),
                              ("read_lora", back[name].alpha / back[name].rank * back[name].delta(trained.shape))):
            torch.testing.assert_close(delta, trained, atol=1e-6, rtol=1e-5, msg=f"{reader}: {name}")
    with safe_open(str(path), framework="pt") as handle:
        header = handle.metadata()
    assert (header["ss_network_dim"], header["ss_network_alpha"]) == (str(RANK), str(ALPHA))  # as trained
    assert json.loads(header["ss_network_args"]) == {"conv_dim": str(CONV_RANK), "conv_alpha": str(CONV_ALPHA)}
    assert (header["lora_rank"], header["lora_alpha"]) == (str(RANK), str(ALPHA))
    assert "lora_up weight and its alpha written as its rank" in header[sd.lora.formats.FOLDED]

    pipe = StableDiffusionPipeline(unet=copy.deepcopy(base[0]), text_encoder=copy.deepcopy(base[1]), vae=base[2],
                                   tokenizer=base[3], scheduler=sd.model.build_noise_scheduler("epsilon", DDIMScheduler),
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.load_lora_weights(str(path))
    expected = unet_output(unet)
    assert (expected - unet_output(base[0])).abs().max() > 1e-2
    torch.testing.assert_close(unet_output(pipe.unet), expected, atol=1e-5, rtol=0)


def test_a_locon_run_records_its_conv_rank_and_loads_back_with_it(lora_run, base, tmp_path):
    """lora_conv_rank / lora_conv_alpha in a run's config.yaml rebuild adapters of those shapes: the run's
    adapter file loads into them, and an export records them."""
    run, *_ = lora_run
    unet = copy.deepcopy(base[0])
    sd.lora.adapters.add_lora(unet, sd.lora.adapters.resolve_targets(unet, ["attention", "resnet"]), RANK, ALPHA,
                              conv_rank=CONV_RANK, conv_alpha=CONV_ALPHA)
    randomize(unet, 9)
    copy_run = tmp_path / "locon_run"
    shutil.copytree(run, copy_run)
    folder = sd.run_folder.resolve_checkpoint(copy_run)
    ckpt.save_weights(sd.lora.adapters.AdapterWeights(unet=unet).state_dict(), folder / "adapter.safetensors")
    (folder / "ema.safetensors").unlink()
    (folder / sd.run_folder.MANIFEST).unlink(missing_ok=True)
    config = yaml.safe_load((folder / "config.yaml").read_text())
    config.update(lora_targets=["attention", "resnet"], lora_conv_rank=CONV_RANK, lora_conv_alpha=CONV_ALPHA,
                  lora_text_encoder=False)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    settings = sd.formats.lora_run_settings(str(folder))
    assert (settings["conv_rank"], settings["conv_alpha"], settings["rank"], settings["alpha"]) == (
        CONV_RANK, CONV_ALPHA, RANK, ALPHA)
    model = sd.formats.load_pipeline(str(copy_run))
    assert adapters_equal(model.unet, unet)
    assert SD_ImageGen.main(["--ckpt", str(copy_run), "--export_lora", str(tmp_path / "k.safetensors")]) == 0
    with safe_open(str(tmp_path / "k.safetensors"), framework="pt") as handle:
        assert json.loads(handle.metadata()["ss_network_args"]) == {"conv_dim": "2", "conv_alpha": "1.0"}  # trained


HEADER_ARGS = {"lora": None, "locon": {"conv_dim": "2", "conv_alpha": "1.0"},
               "loha": {"algo": "loha", "conv_dim": "2", "conv_alpha": "1.0"},
               "lokr": {"algo": "lokr", "conv_dim": "2", "conv_alpha": "1.0", "factor": "-1"},
               "dora": {"algo": "locon", "conv_dim": "2", "conv_alpha": "1.0", "dora_wd": "True",
                        "wd_on_output": "False"}}


@pytest.mark.parametrize("kind", list(HEADER_ARGS))
def test_the_kohya_header_records_the_network_as_it_trained(kind, base, tmp_path):
    """Rank 4 / alpha 2, the 3x3 convolutions (LoCon, LoHa, LoKr, DoRA) at 2 / 1: ss_network_dim / ss_network_alpha
    are the Linear layers' rank and alpha as asked, ss_network_args holds the convolutions' conv_dim / conv_alpha
    and LyCORIS' algo (lokr: its factor; DoRA: dora_wd) where LyCORIS' network trains the kind (plain LoRA and
    LoCon: sd-scripts' networks.lora, which records no algo), and a note says where alpha is folded into the
    weights (layers of two ranks). The header is metadata: the .alpha tensors stay those of the weights, so
    the file read back and merged gives the adapted model's weights."""
    unet = copy.deepcopy(base[0])
    targets = ["attention"] if kind == "lora" else ["attention", "resnet"]
    sd.lora.adapters.add_lora(unet, sd.lora.adapters.resolve_targets(unet, targets), 4, 2.0, conv_rank=2,
                              conv_alpha=1.0, kind=kind if kind in ("loha", "lokr") else "lora", dora=kind == "dora")
    (randomize_dora if kind == "dora" else randomize)(unet, 3)
    path = sd.lora.formats.save_model_lora(tmp_path / f"{kind}.safetensors", unet.eval())
    with safe_open(str(path), framework="pt") as handle:
        header = handle.metadata()
    lycoris = kind in ("loha", "lokr", "dora")
    assert header["ss_network_module"] == ("lycoris.kohya" if lycoris else "networks.lora")
    assert (header["ss_network_dim"], header["ss_network_alpha"], header["lora_rank"], header["lora_alpha"]) == (
        "4", "2.0", "4", "2.0")
    assert (json.loads(header["ss_network_args"]) if "ss_network_args" in header else None) == HEADER_ARGS[kind]
    assert (sd.lora.formats.FOLDED in header) == (kind in ("locon", "dora"))
    args = "".join(f' "{key}={value}"' for key, value in (HEADER_ARGS[kind] or {}).items())
    assert sd.lora.formats.sd_scripts_usage(path) == (  # the export's log line: train_network.py's arguments
        f"sd-scripts loads it with --network_module {'lycoris.kohya' if lycoris else 'networks.lora'} "
        f"--network_weights {path} --network_dim 4 --network_alpha 2.0" + (f" --network_args{args}" if args else ""))
    if kind == "lora":  # diffusers' layout, which sd-scripts does not read
        folder = sd.lora.formats.save_model_lora(tmp_path / "diffusers", unet, lora_format="diffusers")
        assert sd.lora.formats.sd_scripts_usage(folder).startswith("sd-scripts reads the kohya layout only")
    merged = sd.lora.adapters.merge(copy.deepcopy(unet))
    plain = copy.deepcopy(base[0])
    sd.lora.formats.merge_lora({"unet": plain}, sd.lora.formats.read_lora(path, base[0]))
    changed = 0.0
    for (name, ours), theirs in zip(plain.state_dict().items(), merged.state_dict().values()):
        torch.testing.assert_close(ours, theirs, atol=2e-6, rtol=1e-5, msg=name)
        changed = max(changed, (ours - base[0].state_dict()[name]).abs().max().item())
    assert changed > 1e-3


# ------------------------------------------------------------------------------ LyCORIS files (LoHa, LoKr)

LINEAR, CONV = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q", "down_blocks.0.resnets.0.conv1"


def peft_adapted(unet, config, seed):
    """A copy of ``unet`` with PEFT's LoHa or LoKr (``config``) on LINEAR and CONV, its tensors random;
    returns ``({module: {name: tensor}}, {module: weight after PEFT's own merge})``: PEFT as the reference."""
    from peft import inject_adapter_in_model

    adapted_unet = copy.deepcopy(unet)
    inject_adapter_in_model(config, adapted_unet, adapter_name="default")
    generator = torch.Generator().manual_seed(seed)
    tensors, merged = {}, {}
    for module in (LINEAR, CONV):
        layer = adapted_unet.get_submodule(module)
        own = {}
        for name in (*sd.lora.formats.LYCORIS_KEYS["loha"], *sd.lora.formats.LYCORIS_KEYS["lokr"]):
            holder = getattr(layer, name, None)
            if holder is not None and "default" in holder:
                with torch.no_grad():
                    holder["default"].copy_(torch.randn(holder["default"].shape, generator=generator) * 0.3)
                own[name] = holder["default"].detach().clone()
        tensors[module] = own
        layer.merge(adapter_names=["default"])
        merged[module] = layer.get_base_layer().weight.detach().clone()
    return tensors, merged


def lycoris_file(path, tensors: dict, alpha: float):
    """The kohya / LyCORIS layout: lora_unet_<module with _>.<tensor name>, and .alpha."""
    out = {}
    for module, own in tensors.items():
        key = "lora_unet_" + module.replace(".", "_")
        out.update({f"{key}.{name}": t.contiguous() for name, t in own.items()})
        out[f"{key}.alpha"] = torch.tensor(alpha)
    save_file(out, str(path))
    return path


@pytest.mark.parametrize("kind", ["loha", "loha_tucker", "lokr", "lokr_tucker"])
def test_loha_and_lokr_files_merge_to_the_weights_peft_merges(kind, base, tmp_path):
    """LyCORIS' LoHa and LoKr layouts (a Linear and a 3x3 conv; with Tucker cores for the conv) with alpha
    != r: read and merged here, each weight equals PEFT's merge of the same tensors (its own LoHa / LoKr
    layers), to float rounding."""
    from peft import LoHaConfig, LoKrConfig

    cls = LoHaConfig if kind.startswith("loha") else LoKrConfig
    config = cls(r=2, alpha=3, target_modules=[LINEAR, CONV], use_effective_conv2d=kind.endswith("tucker"))
    tensors, merged = peft_adapted(base[0], config, seed=11)
    if kind.endswith("tucker"):
        assert {"hada_t1", "lokr_t2"} & set(tensors[CONV])
    path = lycoris_file(tmp_path / f"{kind}.safetensors", tensors, alpha=3.0)
    lora = sd.lora.formats.read_lora(path, base[0], base[1])
    unet = copy.deepcopy(base[0])
    sd.lora.formats.merge_lora({"unet": unet}, lora)
    for module in (LINEAR, CONV):
        ours = unet.get_submodule(module).weight
        assert not torch.equal(ours, base[0].get_submodule(module).weight)
        torch.testing.assert_close(ours, merged[module], atol=1e-5, rtol=1e-5, msg=module)


def test_a_lokr_of_two_whole_factors_is_merged_at_scale_one_as_comfyui_and_a1111_read_it(base, tmp_path):
    """Both factors whole: LyCORIS writes alpha = r and ComfyUI and AUTOMATIC1111 apply kron(w1, w2) whatever
    alpha says (no rank to divide by); with a low-rank factor a stored alpha of 0 adds nothing, as in both."""
    weight = base[0].get_submodule(LINEAR).weight
    generator = torch.Generator().manual_seed(3)
    w1, w2 = torch.randn(4, 4, generator=generator), torch.randn(8, 8, generator=generator)
    w2_a, w2_b = torch.randn(8, 2, generator=generator), torch.randn(2, 8, generator=generator)
    expected = weight + torch.kron(w1, w2)
    for name, tensors, alpha, want in (("full_16", {"lokr_w1": w1, "lokr_w2": w2}, 16.0, expected),
                                       ("full_0", {"lokr_w1": w1, "lokr_w2": w2}, 0.0, expected),
                                       ("low_0", {"lokr_w1": w1, "lokr_w2_a": w2_a, "lokr_w2_b": w2_b}, 0.0, weight)):
        path = lycoris_file(tmp_path / f"{name}.safetensors", {LINEAR: tensors}, alpha)
        unet = copy.deepcopy(base[0])
        sd.lora.formats.merge_lora({"unet": unet}, sd.lora.formats.read_lora(path, base[0], base[1]))
        torch.testing.assert_close(unet.get_submodule(LINEAR).weight, want, atol=1e-6, rtol=1e-6)


def test_broken_lycoris_layers_are_refused_naming_the_file_and_layer(base, tmp_path):
    key = "lora_unet_" + LINEAR.replace(".", "_")
    cases = {"half": {f"{key}.hada_w1_a": torch.ones(32, 2), f"{key}.hada_w1_b": torch.ones(2, 32)},
             "shape": {f"{key}.lokr_w1": torch.ones(4, 4), f"{key}.lokr_w2": torch.ones(8, 7)},
             "dora": {f"{key}.lora_down.weight": torch.ones(2, 32), f"{key}.lora_up.weight": torch.ones(32, 2),
                      f"{key}.dora_scale": torch.ones(7, 1)}}
    messages = {"half": "a loha layer without hada_w2_a, hada_w2_b", "shape": "do not make its weight's shape",
                "dora": "its dora_scale (7, 1) fits neither the inputs nor the outputs of its weight (32, 32)"}
    for name, tensors in cases.items():
        save_file(tensors, str(tmp_path / f"{name}.safetensors"))
        with pytest.raises(ValueError, match=re.escape(messages[name])) as error:
            sd.lora.formats.read_lora(tmp_path / f"{name}.safetensors", base[0], base[1])
        assert f"{name}.safetensors" in str(error.value) and LINEAR in str(error.value)


# ------------------------------------------------------------------------------ DoRA


def a1111_dora(weight, delta, magnitude, strength):
    """AUTOMATIC1111's DoRA merge (network.py's apply_weight_decompose, and ComfyUI's for a magnitude of shape
    (1, in)), written out in float64: V = W0 + delta, each input channel's norm over the outputs and the
    kernel, W0 + strength * (V * m / norm - W0)."""
    weight, patched = weight.double(), weight.double() + delta.double()
    shape = (1, patched.shape[1]) + (1,) * (patched.ndim - 2)
    norm = patched.transpose(0, 1).reshape(patched.shape[1], -1).norm(dim=1).reshape(shape)
    return weight + strength * (patched * magnitude.double().reshape(shape) / norm - weight)


@torch.no_grad()
def randomize_dora(model, seed):
    """Random adapters, and magnitudes 0.8-1.2 times their starting values."""
    magnitudes = {name: p.clone() for name, p in sd.lora.adapters.adapter_state(model).items() if ".dora_scale." in name}
    randomize(model, seed)
    generator = torch.Generator().manual_seed(seed)
    for name, param in sd.lora.adapters.adapter_state(model).items():
        if name in magnitudes:
            param.copy_(magnitudes[name] * (0.8 + 0.4 * torch.rand(param.shape, generator=generator)))


@pytest.mark.parametrize("kind", ["lora", "loha", "lokr"])
def test_a_dora_adapter_starts_at_its_base_and_its_file_merges_as_a1111_and_comfyui_merge_it(kind, base, tmp_path):
    """dora: true on a LoRA, LoHa or LoKr (a Linear and a 3x3 conv): the adapted model computes its base's output
    bit for bit at the start; trained (random adapters and magnitudes), its forward equals its merged weights';
    the kohya-layout file holds dora_scale per input channel ((1, in), (1, in, 1, 1)) and names LyCORIS'
    network with dora_wd; read back and merged at strengths 1 and 0.5 it gives AUTOMATIC1111's merge of the
    layers' own (PEFT's) deltas."""
    unet = copy.deepcopy(base[0])
    sd.lora.adapters.add_lora(unet, [LINEAR, CONV], 2, 3.0, kind=kind, dora=True)
    assert torch.equal(unet_output(unet), unet_output(base[0]))
    randomize_dora(unet, seed=5)
    deltas = {name: unet.get_submodule(name).get_delta_weight("default").detach().clone() for name in (LINEAR, CONV)}
    merged = sd.lora.adapters.merge(copy.deepcopy(unet))
    torch.testing.assert_close(unet_output(merged), unet_output(unet), atol=1e-5, rtol=1e-4)

    path = sd.lora.formats.save_model_lora(tmp_path / "dora", unet)
    with safe_open(str(path), framework="pt") as handle:
        header, tensors = handle.metadata(), {k: handle.get_tensor(k) for k in handle.keys()}
    for name, shape in ((LINEAR, (1, 32)), (CONV, (1, 32, 1, 1))):
        magnitude = tensors["lora_unet_" + name.replace(".", "_") + ".dora_scale"]
        assert magnitude.shape == shape and torch.equal(magnitude, unet.get_submodule(name).dora_scale["default"])
    args = json.loads(header["ss_network_args"])
    assert header["ss_network_module"] == "lycoris.kohya" and args["dora_wd"] == "True" and args["wd_on_output"] == "False"
    assert args["algo"] == {"lora": "locon", "loha": "loha", "lokr": "lokr"}[kind]
    lora = sd.lora.formats.read_lora(path, base[0])
    for strength in (1.0, 0.5):
        plain = copy.deepcopy(base[0])
        sd.lora.formats.merge_lora({"unet": plain}, lora, strength)
        for name in (LINEAR, CONV):
            magnitude = unet.get_submodule(name).dora_scale["default"].detach()
            want = a1111_dora(base[0].get_submodule(name).weight, deltas[name], magnitude, strength)
            assert not torch.allclose(want, base[0].get_submodule(name).weight.double(), atol=1e-3)
            torch.testing.assert_close(plain.get_submodule(name).weight.double(), want, atol=2e-6, rtol=1e-5,
                                       msg=f"{name} at {strength}")
            if strength == 1.0:
                torch.testing.assert_close(plain.get_submodule(name).weight, merged.get_submodule(name).weight,
                                           atol=2e-6, rtol=1e-5)


def test_an_output_axis_dora_file_merges_to_the_weights_peft_merges(base, tmp_path):
    """dora_scale per output channel ((out, 1), (out, 1, 1, 1): LyCORIS' default since 3.2, PEFT's DoRA renamed)
    is merged as PEFT and LyCORIS compute it, the norm of each output channel of W0 + delta."""
    from peft import LoraConfig, inject_adapter_in_model

    unet = copy.deepcopy(base[0])
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=3, use_dora=True, target_modules=[LINEAR, CONV]), unet)
    generator = torch.Generator().manual_seed(9)
    out = {}
    for name in (LINEAR, CONV):
        layer = unet.get_submodule(name)
        with torch.no_grad():
            for weight in (layer.lora_A["default"].weight, layer.lora_B["default"].weight):
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.3)
            magnitude = layer.lora_magnitude_vector["default"].weight
            magnitude.mul_(0.8 + 0.4 * torch.rand(magnitude.shape, generator=generator))
        key = "lora_unet_" + name.replace(".", "_")
        out.update({f"{key}.lora_down.weight": layer.lora_A["default"].weight.detach().clone(),
                    f"{key}.lora_up.weight": layer.lora_B["default"].weight.detach().clone(),
                    f"{key}.alpha": torch.tensor(3.0),
                    f"{key}.dora_scale": magnitude.detach().reshape(-1, *[1] * (layer.weight.ndim - 1)).clone()})
        layer.merge(adapter_names=["default"])
    save_file(out, str(tmp_path / "out_axis.safetensors"))
    plain = copy.deepcopy(base[0])
    sd.lora.formats.merge_lora({"unet": plain}, sd.lora.formats.read_lora(tmp_path / "out_axis.safetensors", base[0]))
    for name in (LINEAR, CONV):
        want = unet.get_submodule(name).get_base_layer().weight
        assert not torch.allclose(want, base[0].get_submodule(name).weight, atol=1e-3)
        torch.testing.assert_close(plain.get_submodule(name).weight, want, atol=2e-6, rtol=1e-5, msg=name)


def test_a_dora_adapter_is_not_written_in_diffusers_layout(base, tmp_path):
    unet = sd.lora.adapters.add_lora(copy.deepcopy(base[0]), [LINEAR], 2, 3.0, dora=True)
    with pytest.raises(ValueError, match="--lora_format kohya"):
        sd.lora.formats.save_model_lora(tmp_path / "d", unet, lora_format="diffusers")
    assert not (tmp_path / "d").exists()

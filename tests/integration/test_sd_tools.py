"""SD_Tools.py extract and resize on tiny models: the extracted LoRA is the difference of the two models (exact
at a rank that holds it, the best rank-r error below), read back key for key; a resized LoRA keeps its scale,
its DoRA magnitude and the Frobenius share its report says; mismatched inputs are one line."""

import csv
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import SD_Tools
import sd.checkpoint_merge
import sd.formats
import sd.lora.formats
import sd.lora.tools
import sd.model
import sd.original_layout

from lora_readers import comfyui_loaded_keys, sd_scripts_loaded_keys

TEXT_LAYERS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")


def low_rank_change(model, suffixes, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Add a rank-``rank`` change to every layer of ``model`` whose name ends with one of ``suffixes``;
    returns the changes by weight name."""
    generator = torch.Generator().manual_seed(seed)
    changes = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)) and name.endswith(suffixes):
                weight = module.weight
                up = torch.randn(weight.shape[0], rank, generator=generator) * 0.1
                down = torch.randn(rank, weight[0].numel(), generator=generator) * 0.1
                change = (up @ down).reshape(weight.shape)
                weight.add_(change)
                changes[f"{name}.weight"] = change
    return changes


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A base as a diffusers folder and a fine-tune of it as a single file: rank-2 changes in the UNet's
    attention and the text encoder's attention and MLP, nothing elsewhere."""
    folder = tmp_path_factory.mktemp("pair")
    unet = sd.model.build_unet("tiny", seed=3, from_scratch=False)
    vae, text_encoder = sd.model.load_vae("tiny"), sd.model.load_text_encoder("tiny")
    sd.formats.export_diffusers(folder / "base", unet, vae, text_encoder, sd.model.load_tokenizer("tiny"))
    base = {"unet": {k: v.clone() for k, v in unet.state_dict().items()},
            "text_encoder": {k: v.clone() for k, v in text_encoder.state_dict().items()}}
    changes = {"unet": low_rank_change(unet, ("to_q", "to_k", "to_v", "to_out.0"), 2, seed=1),
               "text_encoder": low_rank_change(text_encoder, TEXT_LAYERS, 2, seed=2)}
    sd.formats.save_single_file(folder / "tuned.safetensors", unet, vae, text_encoder)
    return folder, base, changes


@pytest.fixture(scope="module")
def full_lora(pair, tmp_path_factory) -> Path:
    """The pair's difference extracted at rank 4 (the changes' rank is 2: exact), fp32, unclamped."""
    folder, _, _ = pair
    out = tmp_path_factory.mktemp("lora") / "full.safetensors"
    assert SD_Tools.main(["extract", "--tuned", str(folder / "tuned.safetensors"), "--base", str(folder / "base"),
                          "--out", str(out), "--rank", "4", "--clamp_quantile", "1", "--save_precision", "fp32"]) == 0
    return out


def demo_file(path: Path) -> Path:
    """A single file of another architecture than the tiny models' (the demo UNet)."""
    demo = sd.model.build_unet("demo", seed=0, from_scratch=False)
    sd.formats.save_single_file(path, demo, sd.model.load_vae("tiny"), sd.model.load_text_encoder("tiny"))
    return path


def merged(lora_path: Path, base: dict) -> dict[str, dict[str, torch.Tensor]]:
    """The base's UNet and text encoder with the LoRA file merged at strength 1, read as ``--lora`` reads it."""
    unet = sd.model.build_unet("tiny", from_scratch=False)
    text_encoder = sd.model.load_text_encoder("tiny")
    unet.load_state_dict(base["unet"])
    text_encoder.load_state_dict(base["text_encoder"])
    lora = sd.lora.formats.read_lora(lora_path, unet, text_encoder)  # strict: a key of no layer is an error
    sd.lora.formats.merge_lora({"unet": unet, "text_encoder": text_encoder}, lora)
    return {"unet": unet.state_dict(), "text_encoder": text_encoder.state_dict()}


def test_an_extracted_lora_is_the_difference_of_the_two_models(pair, tmp_path, capsys):
    folder, base, changes = pair
    out = tmp_path / "tuned_lora.safetensors"
    assert SD_Tools.main(["extract", "--tuned", str(folder / "tuned.safetensors"), "--base", str(folder / "base"),
                          "--out", str(out), "--rank", "4", "--clamp_quantile", "1", "--save_precision", "fp32"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    result = merged(out, base)
    for part in ("unet", "text_encoder"):
        for name, value in result[part].items():
            expected = base[part][name] + changes[part].get(name, 0)
            torch.testing.assert_close(value, expected, rtol=0, atol=2e-5, msg=f"{part} {name}")
    keys = set(load_file(out))
    unet, text_encoder = sd.model.build_unet("tiny", from_scratch=False), sd.model.load_text_encoder("tiny")
    assert comfyui_loaded_keys(keys, unet, text_encoder) == keys  # ComfyUI and sd-scripts apply every key
    assert sd_scripts_loaded_keys(keys, unet, text_encoder) == keys
    assert "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight" in keys
    assert "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight" in keys  # kohya's text encoder names
    with safe_open(str(out), framework="pt") as handle:
        header = handle.metadata()
    assert header["ss_network_module"] == "networks.lora" and header["modelspec.architecture"].endswith("/lora")
    rows = list(csv.DictReader((tmp_path / "tuned_lora.report.csv").open()))
    assert {row["part"] for row in rows} == {"unet", "text_encoder"}
    assert all(float(row["fro_kept"]) == pytest.approx(1.0, abs=1e-5) for row in rows if float(row["fro_kept"]) > 0)


def test_at_a_lower_rank_each_layer_keeps_its_best_approximation(pair, tmp_path):
    folder, base, changes = pair
    out = tmp_path / "r1.safetensors"
    assert SD_Tools.main(["extract", "--tuned", str(folder / "tuned.safetensors"), "--base", str(folder / "base"),
                          "--out", str(out), "--rank", "1", "--clamp_quantile", "1", "--save_precision", "fp32",
                          "--text_encoder", "false"]) == 0
    result = merged(out, base)
    for name, change in changes["unet"].items():
        s = torch.linalg.svdvals(change.flatten(1).double())
        error = torch.linalg.matrix_norm((result["unet"][name] - base["unet"][name] - change).flatten(1).double())
        assert float(error) == pytest.approx(float(s[1:].square().sum().sqrt()), rel=1e-3, abs=1e-6), name
    assert not any(k.startswith("lora_te_") for k in load_file(out))


def test_identical_text_encoders_are_left_out_and_other_architectures_refused(pair, tmp_path, capsys):
    folder, _, _ = pair
    unet = sd.model.build_unet("tiny", seed=9, from_scratch=False)
    sd.formats.save_single_file(tmp_path / "same_text.safetensors", unet, sd.model.load_vae("tiny"),
                                sd.model.load_text_encoder("tiny"))
    out = tmp_path / "unet_only.safetensors"
    assert SD_Tools.main(["extract", "--tuned", str(tmp_path / "same_text.safetensors"), "--base",
                          str(folder / "base"), "--out", str(out)]) == 0
    assert not any(k.startswith("lora_te_") for k in load_file(out))
    demo_file(tmp_path / "demo.safetensors")
    capsys.readouterr()
    assert SD_Tools.main(["extract", "--tuned", str(tmp_path / "demo.safetensors"), "--base", str(folder / "base"),
                          "--out", str(tmp_path / "x.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "their unets are of other architectures" in err and err.count("\n") == 1
    assert not (tmp_path / "x.safetensors").exists()


def test_a_resized_lora_keeps_its_scale_and_reports_the_share_kept(pair, full_lora, tmp_path):
    _, base, _ = pair
    full = full_lora
    small = tmp_path / "small.safetensors"
    assert SD_Tools.main(["resize", "--lora", str(full), "--out", str(small), "--rank", "2",
                          "--save_precision", "fp32"]) == 0
    before, after = merged(full, base), merged(small, base)  # the changes are rank 2: nothing is lost
    for part in before:
        for name in before[part]:
            torch.testing.assert_close(after[part][name], before[part][name], rtol=0, atol=5e-5)
    tensors = load_file(small)
    assert {v.shape[0] for k, v in tensors.items() if k.endswith("lora_down.weight")} == {2}
    one = tmp_path / "one.safetensors"
    assert SD_Tools.main(["resize", "--lora", str(full), "--out", str(one), "--rank", "1",
                          "--save_precision", "fp32"]) == 0
    rows = list(csv.DictReader((tmp_path / "one.report.csv").open()))
    changed = [row for row in rows if row["module"].endswith(("to_q", "to_k", "to_v", "to_out.0", *TEXT_LAYERS))]
    assert len(changed) == 32 + 12 and all(row["rank"] == "1" for row in rows)  # 4 transformers x 8; 2 x 6
    assert all(0.5 < float(row["fro_kept"]) < 1 for row in changed)  # rank 2 changes: the larger half or more kept
    assert all(float(row["fro_kept"]) == 1.0 for row in rows if row not in changed)  # no change: nothing to lose
    with safe_open(str(one), framework="pt") as handle:
        assert '"tool": "resize"' in handle.metadata()["sd_tools"]


def test_a_dora_file_is_resized_with_its_magnitude_and_a_loha_refused(tmp_path, capsys):
    unet = sd.model.build_unet("tiny", seed=0, from_scratch=False)
    generator = torch.Generator().manual_seed(0)
    layers = {}
    for name, module in unet.named_modules():
        if name.endswith(("attn1.to_q", "attn1.to_v")):
            w = module.weight
            layers[name] = sd.lora.formats.LoraModule(torch.randn(4, w.shape[1], generator=generator),
                                                      torch.randn(w.shape[0], 4, generator=generator), 2.0,
                                                      torch.rand(1, w.shape[1], generator=generator) + 0.5)
    sd.lora.formats.save_lora(tmp_path / "dora.safetensors", {"unet": layers})
    assert SD_Tools.main(["resize", "--lora", str(tmp_path / "dora.safetensors"), "--out",
                          str(tmp_path / "dora4.safetensors"), "--rank", "4", "--save_precision", "fp32"]) == 0
    lora, _, _ = sd.lora.tools.read_lora_file(tmp_path / "dora4.safetensors")
    for name, layer in lora["unet"].items():
        assert torch.equal(layer.dora_scale, layers[name].dora_scale) and layer.scale == pytest.approx(0.5)
        torch.testing.assert_close(layer.scale * layer.up @ layer.down, 0.5 * layers[name].up @ layers[name].down,
                                   rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """Three tiny models of one architecture as single files, each with its own UNet, VAE and text encoder."""
    folder = tmp_path_factory.mktemp("three")
    models = {}
    for side, seed in (("a", 20), ("b", 30), ("c", 40)):
        parts = (sd.model.build_unet("tiny", seed=seed, from_scratch=False), sd.model.load_vae("tiny", seed=seed + 1),
                 sd.model.load_text_encoder("tiny", seed=seed + 2))
        sd.formats.save_single_file(folder / f"{side}.safetensors", *parts)
        models[side] = load_file(folder / f"{side}.safetensors")
    return folder, models


def test_a_weighted_sum_per_block_takes_each_blocks_ratio(three, tmp_path):
    folder, models = three
    a, b = models["a"], models["b"]
    out = tmp_path / "sum.safetensors"
    assert SD_Tools.main(["merge", "--a", str(folder / "a.safetensors"), "--b", str(folder / "b.safetensors"),
                          "--out", str(out), "--alpha", "0.3", "--save_precision", "fp32"]) == 0
    merged = load_file(out)
    assert merged.keys() == a.keys()
    for name in a:
        expected = a[name] if name.startswith("first_stage_model.") else torch.lerp(a[name], b[name], 0.3)
        torch.testing.assert_close(merged[name], expected, rtol=0, atol=0, msg=name)  # the VAE: A's by default
    blocks = ["0"] * 25
    blocks[13] = "1"  # OUT00
    out = tmp_path / "out00.safetensors"
    assert SD_Tools.main(["merge", "--a", str(folder / "a.safetensors"), "--b", str(folder / "b.safetensors"),
                          "--out", str(out), "--alpha", "0", "--block_alphas", ",".join(blocks), "--text_encoder", "b",
                          "--save_precision", "fp32"]) == 0
    merged = load_file(out)
    for name in a:
        from_b = name.startswith(("model.diffusion_model.output_blocks.0.", "cond_stage_model."))
        assert torch.equal(merged[name], (b if from_b else a)[name]), name
    assert sd.original_layout.block_of("model.diffusion_model.output_blocks.11.1.proj_in.weight") == "OUT11"
    assert sd.original_layout.block_of("model.diffusion_model.middle_block.0.in_layers.0.weight") == "M00"
    assert sd.original_layout.block_of("model.diffusion_model.time_embed.0.weight") is None
    pipeline = sd.formats.load_pipeline(str(out))  # our own loader reads it as a whole model
    assert sd.model.loaded_from(pipeline.vae).startswith("single file")


def test_add_difference_puts_what_b_learned_from_c_on_a(three, tmp_path, capsys):
    folder, models = three
    out = tmp_path / "diff.safetensors"
    assert SD_Tools.main(["merge", "--a", str(folder / "c.safetensors"), "--b", str(folder / "b.safetensors"),
                          "--c", str(folder / "c.safetensors"), "--out", str(out), "--alpha", "1", "--vae", "b",
                          "--save_precision", "fp32"]) == 0
    merged = load_file(out)  # C + (B - C) = B, to float rounding
    for name, value in models["b"].items():
        torch.testing.assert_close(merged[name], value, rtol=0, atol=1e-6, msg=name)
    with safe_open(str(out), framework="pt") as handle:
        header = handle.metadata()
    assert '"method": "add_difference"' in header["sd_tools"] and header["modelspec.architecture"] == \
        "stable-diffusion-v1"
    demo_file(tmp_path / "demo.safetensors")
    capsys.readouterr()
    assert SD_Tools.main(["merge", "--a", str(folder / "a.safetensors"), "--b", str(tmp_path / "demo.safetensors"),
                          "--out", str(tmp_path / "no.safetensors")]) == 2
    assert "models of other layouts" in capsys.readouterr().err
    assert not (tmp_path / "no.safetensors").exists()


def test_loras_joined_add_what_each_adds_at_its_ratio_and_merge_into_a_model(pair, full_lora, tmp_path):
    folder, base, changes = pair
    first, second = full_lora, tmp_path / "second.safetensors"
    assert SD_Tools.main(["resize", "--lora", str(first), "--out", str(second), "--rank", "1", "--save_precision",
                          "fp32"]) == 0
    joined = tmp_path / "joined.safetensors"
    assert SD_Tools.main(["merge-lora", "--lora", f"{first}:0.5", "--lora", f"{second}:-0.25", "--out", str(joined),
                          "--save_precision", "fp32"]) == 0
    result, one, two = merged(joined, base), merged(first, base), merged(second, base)
    for part in result:
        for name in result[part]:
            expected = base[part][name] + 0.5 * (one[part][name] - base[part][name]) - 0.25 * (
                two[part][name] - base[part][name])
            torch.testing.assert_close(result[part][name], expected, rtol=0, atol=2e-5, msg=name)
    ranks = {v.shape[0] for k, v in load_file(joined).items() if k.endswith("lora_down.weight")}
    assert ranks == {5}  # 4 + 1, concatenated
    # into the base model itself, as one single file: the LoRA's layers changed, the rest as they were
    model = tmp_path / "model.safetensors"
    assert SD_Tools.main(["merge-lora", "--lora", str(first), "--into", str(folder / "base"), "--out", str(model),
                          "--save_precision", "fp32"]) == 0
    pipeline = sd.formats.load_pipeline(str(model))
    for name, value in pipeline.unet.state_dict().items():
        torch.testing.assert_close(value, base["unet"][name] + changes["unet"].get(name, 0), rtol=0, atol=2e-5)
    assert SD_Tools.main(["merge-lora", "--lora", str(first), "--into", str(tmp_path / "none"), "--out",
                          str(tmp_path / "x.safetensors")]) == 2
    # into a diffusers folder: the same weights
    assert SD_Tools.main(["merge-lora", "--lora", str(first), "--into", str(folder / "base"), "--out",
                          str(tmp_path / "folder"), "--save_precision", "fp32"]) == 0
    assert (tmp_path / "folder" / "model_index.json").is_file() and not list(tmp_path.glob(".folder*"))
    from_folder = sd.formats.load_pipeline(str(tmp_path / "folder")).unet.state_dict()
    assert all(torch.equal(value, from_folder[name]) for name, value in pipeline.unet.state_dict().items())


def test_dora_and_loha_files_merge_into_a_model_as_the_samplers_merge_them_and_refuse_to_join(pair, tmp_path, capsys):
    folder, base, _ = pair
    unet = sd.model.build_unet("tiny", from_scratch=False)
    unet.load_state_dict(base["unet"])
    generator = torch.Generator().manual_seed(7)
    layers = {name: sd.lora.formats.LoraModule(torch.randn(2, m.weight.shape[1], generator=generator) * 0.1,
                                               torch.randn(m.weight.shape[0], 2, generator=generator) * 0.1, 2.0,
                                               torch.rand(1, m.weight.shape[1], generator=generator) + 0.5)
              for name, m in unet.named_modules() if name.endswith("attn2.to_k")}
    sd.lora.formats.save_lora(tmp_path / "dora.safetensors", {"unet": layers})
    assert SD_Tools.main(["merge-lora", "--lora", f"{tmp_path / 'dora.safetensors'}:0.8", "--into",
                          str(folder / "base"), "--out", str(tmp_path / "m.safetensors"), "--save_precision",
                          "fp32"]) == 0
    sd.lora.formats.merge_lora({"unet": unet}, {"unet": layers}, 0.8)  # SD_ImageGen.py --lora FILE:0.8's merge
    baked = sd.formats.load_pipeline(str(tmp_path / "m.safetensors")).unet.state_dict()
    for name, value in unet.state_dict().items():
        torch.testing.assert_close(baked[name], value, rtol=0, atol=1e-6, msg=name)
    hada = {name: sd.lora.formats.HadamardModule(
        {"hada_w1_a": torch.randn(m.weight.shape[0], 2, generator=generator) * 0.1,
         "hada_w1_b": torch.randn(2, m.weight.shape[1], generator=generator) * 0.1,
         "hada_w2_a": torch.randn(m.weight.shape[0], 2, generator=generator) * 0.1,
         "hada_w2_b": torch.randn(2, m.weight.shape[1], generator=generator) * 0.1}, 1.0)
        for name, m in unet.named_modules() if name.endswith("attn1.to_v")}
    sd.lora.formats.save_lora(tmp_path / "loha.safetensors", {"unet": hada})  # a LoHa: merged into a model too
    assert SD_Tools.main(["merge-lora", "--lora", f"{tmp_path / 'loha.safetensors'}:0.8", "--into",
                          str(tmp_path / "m.safetensors"), "--out", str(tmp_path / "m2.safetensors"),
                          "--save_precision", "fp32"]) == 0
    sd.lora.formats.merge_lora({"unet": unet}, {"unet": hada}, 0.8)
    baked = sd.formats.load_pipeline(str(tmp_path / "m2.safetensors")).unet.state_dict()
    for name, value in unet.state_dict().items():
        torch.testing.assert_close(baked[name], value, rtol=0, atol=1e-6, msg=name)
    capsys.readouterr()
    assert SD_Tools.main(["merge-lora", "--lora", str(tmp_path / "dora.safetensors"), "--lora",
                          str(tmp_path / "dora.safetensors"), "--out", str(tmp_path / "j.safetensors")]) == 2
    assert "a DoRA layer is no low-rank product to join" in capsys.readouterr().err


def test_block_weights_scale_each_blocks_layers_in_a_merge_and_in_sampling(pair, full_lora, tmp_path):
    """AUTOMATIC1111's LoRA Block Weight vector: BASE (the text encoder) 0, the middle block 1, the output blocks
    0.5, the input blocks 0; the same through SD_Tools.py merge-lora --into and SD_ImageGen.py --lora."""
    import sd.imagegen.lora

    folder, base, changes = pair
    lora = full_lora
    vector = ["0"] + ["0"] * 12 + ["1"] + ["0.5"] * 12
    out = tmp_path / "m.safetensors"
    assert SD_Tools.main(["merge-lora", "--lora", f"{lora}:1:{','.join(vector)}", "--into", str(folder / "base"),
                          "--out", str(out), "--save_precision", "fp32"]) == 0
    baked = sd.formats.load_pipeline(str(out))
    factor = {"down_blocks": 0.0, "mid_block": 1.0, "up_blocks": 0.5}
    for name, value in baked.unet.state_dict().items():
        expected = base["unet"][name] + factor[name.split(".")[0]] * changes["unet"].get(name, 0) \
            if name.split(".")[0] in factor else base["unet"][name]
        torch.testing.assert_close(value, expected, rtol=0, atol=2e-5, msg=name)
    for name, value in baked.text_encoder.state_dict().items():
        assert torch.equal(value, base["text_encoder"][name]), name
    path, scale, blocks = sd.imagegen.lora.parse_lora_blocks(f"{lora}:1:{','.join(vector)}")
    pipeline = sd.formats.load_pipeline(str(folder / "base"))
    sd.lora.formats.merge_adapters(pipeline, [(path, scale, blocks)])  # SD_ImageGen.py --lora FILE:1:BLOCKS
    for name, value in pipeline.unet.state_dict().items():
        torch.testing.assert_close(value, baked.unet.state_dict()[name], rtol=0, atol=1e-6, msg=name)
    seventeen = sd.original_layout.block_weights(["0.1"] * 7 + ["0.2"] + ["0.3"] * 9)
    assert seventeen["BASE"] == 0.1 and seventeen["IN01"] == 0.1 and seventeen["IN03"] == 1.0
    assert seventeen["M00"] == 0.2 and seventeen["OUT02"] == 1.0 and seventeen["OUT03"] == 0.3
    with pytest.raises(ValueError, match="17 or 26 values"):
        sd.imagegen.lora.parse_lora_blocks(f"{lora}:1:1,0,1")


def test_a_damaged_lora_file_is_one_line_naming_it(tmp_path, capsys):
    (tmp_path / "x.safetensors").write_bytes(b"\xff" * 7 + b"\x7f{}")  # a header size far past the file
    assert SD_Tools.main(["resize", "--lora", str(tmp_path / "x.safetensors"), "--out",
                          str(tmp_path / "o.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path / 'x.safetensors'}: not a readable safetensors file" in err
    assert not (tmp_path / "o.safetensors").exists()

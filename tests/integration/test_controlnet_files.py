"""ControlNet files (sd.controlnet.formats) against the readers other tools have: diffusers' from_pretrained
and from_single_file, ComfyUI's ControlNetLoader and AUTOMATIC1111's sd-webui-controlnet.

The tiny preset's ControlNet round-trips through every file; the SD 1.5-size ControlNet is built on the
meta device (no weights) to compare its key layout with what ComfyUI and the extension expect of SD 1.5.
Neither ComfyUI nor the extension can be imported here (they need their host programs), so their rules
are written out below in this test's own code, each citing the file and function it follows; where a
checkout is named by ``COMFYUI_DIR`` or ``SD_WEBUI_CONTROLNET_DIR`` (a work tree or a bare git dir), the
tests marked so run the tools' own code as well.
"""

import ast
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import sd.controlnet.formats as cnf
import sd.model

ZERO_CONV_PREFIXES = ("controlnet_down_blocks.", "controlnet_mid_block.", "controlnet_cond_embedding.conv_out.")


@pytest.fixture(scope="module")
def unet():
    return sd.model.build_unet("tiny", seed=0, from_scratch=False).eval()


@pytest.fixture(scope="module")
def controlnet(unet):
    """The tiny ControlNet of ``ControlNetModel.from_unet``, its zero convolutions drawn at random so that
    every output depends on every part of it."""
    from diffusers import ControlNetModel

    model = ControlNetModel.from_unet(unet)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith(ZERO_CONV_PREFIXES):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def sd15():
    """The SD 1.5 ControlNet, as from_unet builds it from the SD 1.x UNet, on the meta device."""
    from diffusers import ControlNetModel, UNet2DConditionModel

    with torch.device("meta"):
        return ControlNetModel.from_unet(UNet2DConditionModel(**sd.model.UNET_PRESETS["sd1"]), load_weights_from_unet=False)


def outputs(model) -> list[torch.Tensor]:
    """The ControlNet's residuals (each down block's, then the middle block's) for fixed inputs."""
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(2, 4, 8, 8, generator=generator)
    context = torch.randn(2, 8, 64, generator=generator)
    hint = torch.rand(2, 3, 64, 64, generator=generator)  # the hint encoder downsamples by 8
    with torch.no_grad():
        down, mid = model(sample, torch.tensor([10, 700]), context, hint, return_dict=False)
    return [*down, mid]


def assert_bitwise(model, reference):
    ours, theirs = outputs(model), outputs(reference)
    assert len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs))


def same_weights(model, reference) -> bool:
    mine, theirs = model.state_dict(), reference.state_dict()
    return mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def file_shapes(path) -> dict[str, tuple]:
    with safe_open(str(path), framework="pt") as handle:
        return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}


def original_shapes(model) -> dict[str, tuple]:
    """{original key without control_model.: shape} of what save_single_file writes for ``model``."""
    mapping = cnf.original_key_map(model)
    return {mapping[k]: tuple(v.shape) for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------ our own files


def test_diffusers_folder_loads_in_diffusers_bitwise(controlnet, tmp_path):
    from diffusers import ControlNetModel

    folder = cnf.save_diffusers(controlnet, tmp_path / "cn")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]
    assert not list(tmp_path.glob(".*"))  # no staging folder left behind
    assert all(o.abs().sum() > 0 for o in outputs(controlnet))  # the zero convolutions were drawn: outputs say something
    assert_bitwise(ControlNetModel.from_pretrained(str(folder)).eval(), controlnet)
    assert_bitwise(cnf.load_controlnet(folder), controlnet)
    assert_bitwise(cnf.load_controlnet(folder / "diffusion_pytorch_model.safetensors", unet_config=controlnet.config),
                   controlnet)


def test_single_file_round_trip_bitwise_in_fp32_and_within_fp16_rounding(controlnet, unet, tmp_path):
    path32 = cnf.save_single_file(controlnet, tmp_path / "cn32.safetensors", dtype=torch.float32)
    for loaded in (cnf.load_controlnet(path32), cnf.load_controlnet(path32, unet_config=unet.config)):
        assert same_weights(loaded, controlnet)
        assert_bitwise(loaded, controlnet)

    path16 = cnf.save_single_file(controlnet, tmp_path / "cn16.safetensors")
    tensors = load_file(str(path16))
    assert all(k.startswith("control_model.") and v.dtype == torch.float16 for k, v in tensors.items())
    loaded = cnf.load_controlnet(path16)
    # the weights are the fp16 roundings of ours, exactly; the outputs move by about that much
    assert all(torch.equal(v, controlnet.state_dict()[k].half().float()) for k, v in loaded.state_dict().items())
    for ours, reference in zip(outputs(loaded), outputs(controlnet)):
        assert not torch.equal(ours, reference)
        assert (ours - reference).abs().max() <= 2e-3 * reference.abs().max()


def test_original_layout_without_prefix_or_recorded_config(controlnet, unet, tmp_path):
    """What another tool writes: no control_model. prefix, no config in the header. With unet_config the
    ControlNet comes back whole; without, the shapes give all of the config but the head count and norm
    groups, which are SD 1.x's."""
    path = cnf.save_single_file(controlnet, tmp_path / "ours.safetensors", dtype=torch.float32)
    bare = tmp_path / "bare.safetensors"
    save_file({k.removeprefix("control_model."): v for k, v in load_file(str(path)).items()}, str(bare))
    loaded = cnf.load_controlnet(bare, unet_config=unet.config)
    assert same_weights(loaded, controlnet)
    assert_bitwise(loaded, controlnet)

    inferred = cnf.load_controlnet(bare)
    assert same_weights(inferred, controlnet)
    mine, theirs = cnf.public_config(inferred.config), cnf.public_config(controlnet.config)
    differ = {k for k in theirs if json.dumps(mine[k]) != json.dumps(theirs[k])}  # tuples and lists alike
    assert differ == {"attention_head_dim", "norm_num_groups"}
    assert (mine["attention_head_dim"], mine["norm_num_groups"]) == (8, 32)


def test_label_embedding_goes_to_label_emb(tmp_path):
    from diffusers import ControlNetModel

    model = ControlNetModel(**{**cnf.public_config(ControlNetModel.from_unet(
        sd.model.build_unet("tiny", seed=0)).config), "class_embed_type": "projection",
        "projection_class_embeddings_input_dim": 8})
    path = cnf.save_single_file(model, tmp_path / "label.safetensors", dtype=torch.float32)
    keys = set(file_shapes(path))
    assert {"control_model.label_emb.0.0.weight", "control_model.label_emb.0.2.bias"} <= keys
    assert same_weights(cnf.load_controlnet(path), model)
    bare = tmp_path / "bare.safetensors"
    save_file(load_file(str(path)), str(bare))  # the header's config gone: where label_emb goes is unknown
    with pytest.raises(ValueError, match="label_emb.0.0.*pass unet_config"):
        cnf.load_controlnet(bare)
    assert same_weights(cnf.load_controlnet(bare, unet_config=model.config), model)


def test_refusals_name_the_file_and_the_key(controlnet, unet, tmp_path):
    pickle = tmp_path / "control_sd15_canny.pth"
    torch.save(controlnet.state_dict(), pickle)
    with pytest.raises(ValueError, match=r"control_sd15_canny\.pth: .*\.safetensors only") as error:
        cnf.load_controlnet(pickle)
    assert "\n" not in str(error.value)

    path = cnf.save_single_file(controlnet, tmp_path / "cn.safetensors", dtype=torch.float32)
    tensors = load_file(str(path))
    del tensors["control_model.zero_convs.1.0.weight"]
    cut = tmp_path / "cut.safetensors"
    save_file(tensors, str(cut), metadata={cnf.CONFIG_METADATA: json.dumps(cnf.public_config(controlnet.config))})
    for config in (None, unet.config):
        with pytest.raises(ValueError, match=r"cut\.safetensors: lacks control_model\.zero_convs\.1\.0\.weight"):
            cnf.load_controlnet(cut, unet_config=config)

    folder = cnf.save_diffusers(controlnet, tmp_path / "folder")
    weights = load_file(str(folder / cnf.WEIGHTS_FILE))
    del weights["mid_block.resnets.1.conv2.bias"]
    save_file(weights, str(folder / cnf.WEIGHTS_FILE))
    with pytest.raises(ValueError, match=r"folder/diffusion_pytorch_model\.safetensors: lacks mid_block\.resnets\.1\.conv2"):
        cnf.load_controlnet(folder)

    with pytest.raises(ValueError, match="not a ControlNet"):
        save_file({"something.weight": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
        cnf.load_controlnet(tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="NAME.safetensors"):
        cnf.save_single_file(controlnet, tmp_path / "cn.ckpt")
    assert not (tmp_path / "cn.ckpt").exists()


def test_parts_the_original_layout_cannot_hold_are_refused(controlnet, tmp_path):
    """A text projection (encoder_hid_proj) has no original key; a hint encoder of other widths does not
    fit the original readers, which build 16-32-96-256. Both stay diffusers folders."""
    from diffusers import ControlNetModel

    config = cnf.public_config(controlnet.config)
    projected = ControlNetModel(**{**config, "encoder_hid_dim": 16, "encoder_hid_dim_type": "text_proj"})
    with pytest.raises(ValueError, match=r"no place for this ControlNet's encoder_hid_proj\.weight \(and 1 more\); save it with save_diffusers"):
        cnf.save_single_file(projected, tmp_path / "projected.safetensors")
    narrow = ControlNetModel(**{**config, "conditioning_embedding_out_channels": (8, 16)})
    with pytest.raises(ValueError, match=r"\(8, 16\).*save_diffusers"):
        cnf.save_single_file(narrow, tmp_path / "narrow.safetensors")
    assert not list(tmp_path.iterdir())
    assert same_weights(cnf.load_controlnet(cnf.save_diffusers(narrow, tmp_path / "narrow")), narrow)


def test_diffusers_from_single_file_loads_the_original_layout(controlnet, tmp_path, monkeypatch):
    """diffusers' own reader of the original layout (loaders/single_file_utils.py,
    convert_controlnet_checkpoint), offline: config= a local diffusers folder."""
    from diffusers import ControlNetModel

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = cnf.save_diffusers(controlnet, tmp_path / "config")
    path = cnf.save_single_file(controlnet, tmp_path / "cn.safetensors", dtype=torch.float32)
    loaded = ControlNetModel.from_single_file(str(path), config=str(folder), local_files_only=True).eval()
    assert same_weights(loaded, controlnet)
    assert_bitwise(loaded, controlnet)


# ------------------------------------------------------------------------------ the original ControlNet's keys


def heads_width(config: dict, channels: int) -> int:
    """The attention width of a cldm SpatialTransformer at ``channels``: ``num_heads`` heads of
    channels // num_heads, or channels // num_head_channels heads of num_head_channels."""
    if config.get("num_head_channels", -1) == -1:
        return config["num_heads"] * (channels // config["num_heads"])
    return (channels // config["num_head_channels"]) * config["num_head_channels"]


def cldm_shapes(config: dict) -> dict[str, tuple]:
    """{key: shape} of the original ControlNet built with ``config`` (ComfyUI's names for its arguments).

    The rules of ``ControlNet.__init__`` in lllyasviel/ControlNet cldm/cldm.py, as ComfyUI carries them
    (comfyanonymous/ComfyUI comfy/cldm/cldm.py ``ControlNet.__init__``, with ``ResBlock`` and ``Downsample``
    of comfy/ldm/modules/diffusionmodules/openaimodel.py and ``SpatialTransformer`` /
    ``BasicTransformerBlock`` of comfy/ldm/modules/attention.py) and AUTOMATIC1111's extension
    (Mikubill/sd-webui-controlnet scripts/cldm.py ``ControlNet.__init__``): ``transformer_depth`` per input
    res block, ``transformer_depth_middle`` -1 for a middle block of one ResBlock.
    """
    width, emb = config["model_channels"], 4 * config["model_channels"]
    out = {}

    def linear(name, fan_in, fan_out, bias=True):
        out[f"{name}.weight"] = (fan_out, fan_in)
        if bias:
            out[f"{name}.bias"] = (fan_out,)

    def conv(name, fan_in, fan_out, kernel):
        out[f"{name}.weight"], out[f"{name}.bias"] = (fan_out, fan_in, kernel, kernel), (fan_out,)

    def norm(name, channels):
        out[f"{name}.weight"] = out[f"{name}.bias"] = (channels,)

    def resblock(name, fan_in, fan_out):
        norm(f"{name}.in_layers.0", fan_in)
        conv(f"{name}.in_layers.2", fan_in, fan_out, 3)
        linear(f"{name}.emb_layers.1", emb, fan_out)
        norm(f"{name}.out_layers.0", fan_out)
        conv(f"{name}.out_layers.3", fan_out, fan_out, 3)
        if fan_out != fan_in:
            conv(f"{name}.skip_connection", fan_in, fan_out, 1)

    def transformer(name, channels, depth):
        inner = heads_width(config, channels)
        project = linear if config["use_linear_in_transformer"] else (lambda n, i, o: conv(n, i, o, 1))
        norm(f"{name}.norm", channels)
        project(f"{name}.proj_in", channels, inner)
        for d in range(depth):
            block = f"{name}.transformer_blocks.{d}"
            for attn, source in (("attn1", inner), ("attn2", config["context_dim"])):
                linear(f"{block}.{attn}.to_q", inner, inner, bias=False)
                linear(f"{block}.{attn}.to_k", source, inner, bias=False)
                linear(f"{block}.{attn}.to_v", source, inner, bias=False)
                linear(f"{block}.{attn}.to_out.0", inner, inner)
            linear(f"{block}.ff.net.0.proj", inner, inner * 8)  # GEGLU: two halves of 4 x inner
            linear(f"{block}.ff.net.2", inner * 4, inner)
            for n in ("norm1", "norm2", "norm3"):
                norm(f"{block}.{n}", inner)
        project(f"{name}.proj_out", inner, channels)

    linear("time_embed.0", width, emb)
    linear("time_embed.2", emb, emb)
    if config.get("adm_in_channels"):
        linear("label_emb.0.0", config["adm_in_channels"], emb)
        linear("label_emb.0.2", emb, emb)
    conv("input_blocks.0.0", config["in_channels"], width, 3)
    conv("zero_convs.0.0", width, width, 1)
    hint = [config["hint_channels"], 16, 16, 32, 32, 96, 96, 256, width]
    for i in range(8):
        conv(f"input_hint_block.{2 * i}", hint[i], hint[i + 1], 3)
    depths, channels, index = list(config["transformer_depth"]), width, 1
    for level, mult in enumerate(config["channel_mult"]):
        for _ in range(config["num_res_blocks"][level]):
            resblock(f"input_blocks.{index}.0", channels, mult * width)
            channels = mult * width
            depth = depths.pop(0)
            if depth:
                transformer(f"input_blocks.{index}.1", channels, depth)
            conv(f"zero_convs.{index}.0", channels, channels, 1)
            index += 1
        if level != len(config["channel_mult"]) - 1:
            conv(f"input_blocks.{index}.0.op", channels, channels, 3)
            conv(f"zero_convs.{index}.0", channels, channels, 1)
            index += 1
    resblock("middle_block.0", channels, channels)
    if config["transformer_depth_middle"] >= 0:
        transformer("middle_block.1", channels, config["transformer_depth_middle"])
        resblock("middle_block.2", channels, channels)
    conv("middle_block_out.0", channels, channels, 1)
    return out


def count_blocks(keys, pattern: str) -> int:
    count = 0
    while any(k.startswith(pattern.format(count)) for k in keys):
        count += 1
    return count


def comfy_detect(shapes: dict[str, tuple]) -> dict:
    """The UNet config ComfyUI reads off an original-layout ControlNet (prefix removed): the rules of
    comfy/model_detection.py ``detect_unet_config`` (what ``model_config_from_unet`` calls from
    comfy/controlnet.py ``load_controlnet_state_dict``), for the parts a ControlNet has."""
    width = shapes["input_blocks.0.0.weight"][0]
    config = {"in_channels": shapes["input_blocks.0.0.weight"][1], "model_channels": width, "context_dim": None,
              "use_linear_in_transformer": False,
              "adm_in_channels": shapes["label_emb.0.0.weight"][1] if "label_emb.0.0.weight" in shapes else None}
    res_blocks, mults, depths, last_res, last_mult = [], [], [], 0, 0
    for i in range(count_blocks(shapes, "input_blocks.{}.")):
        block = f"input_blocks.{i}."
        if f"{block}0.op.weight" in shapes:  # a new level
            res_blocks.append(last_res)
            mults.append(last_mult)
            last_res = last_mult = 0
        elif f"{block}0.in_layers.0.weight" in shapes:
            last_res += 1
            last_mult = shapes[f"{block}0.out_layers.3.weight"][0] // width
            depth = count_blocks(shapes, f"{block}1.transformer_blocks.{{}}")
            depths.append(depth)
            if depth and config["context_dim"] is None:
                config["context_dim"] = shapes[f"{block}1.transformer_blocks.0.attn2.to_k.weight"][1]
                config["use_linear_in_transformer"] = len(shapes[f"{block}1.proj_in.weight"]) == 2
    res_blocks.append(last_res)
    mults.append(last_mult)
    if "middle_block.1.proj_in.weight" in shapes:
        middle = count_blocks(shapes, "middle_block.1.transformer_blocks.{}")
    else:
        middle = -1 if "middle_block.0.in_layers.0.weight" in shapes else -2
    return {**config, "num_res_blocks": res_blocks, "channel_mult": mults, "transformer_depth": depths,
            "transformer_depth_middle": middle, "hint_channels": shapes["input_hint_block.0.weight"][1]}


# comfy/supported_models.py SD15: what a detected config must hold to be SD 1.5, and the heads that follows
COMFY_SD15 = {"context_dim": 768, "model_channels": 320, "use_linear_in_transformer": False, "adm_in_channels": None}
COMFY_SD15_HEADS = {"num_heads": 8, "num_head_channels": -1}
COMFY_BASE_HEADS = {"num_heads": -1, "num_head_channels": 64}  # comfy/supported_models_base.py BASE: any other model


def comfy_config(shapes: dict[str, tuple]) -> dict:
    detected = comfy_detect(shapes)
    sd15 = all(detected[k] == v for k, v in COMFY_SD15.items())
    return {**detected, **(COMFY_SD15_HEADS if sd15 else COMFY_BASE_HEADS)}


def tiny_cldm_config(controlnet) -> dict:
    """The tiny preset in the original ControlNet's terms, with its own head count (4)."""
    config = controlnet.config
    return {"in_channels": 4, "model_channels": 32, "hint_channels": 3, "num_res_blocks": [1, 1], "channel_mult": [1, 2],
            "transformer_depth": [1, 0], "transformer_depth_middle": 1, "context_dim": config["cross_attention_dim"],
            "use_linear_in_transformer": False, "adm_in_channels": None,
            "num_heads": config["attention_head_dim"], "num_head_channels": -1}


def test_single_file_keys_are_the_original_controlnets_for_the_tiny_preset(controlnet, tmp_path):
    """The tiny file against the original ControlNet's rules. ComfyUI reads its layout (levels, blocks,
    depths, widths) as the preset's; its head width is another matter: a model it does not recognise
    gets 64-channel heads, which the tiny preset's 32-channel attention cannot hold, so a tiny
    ControlNet is for the key layout only (an SD 1.5 one is recognised: the tests below)."""
    path = cnf.save_single_file(controlnet, tmp_path / "cn.safetensors")
    shapes = {k.removeprefix("control_model."): v for k, v in file_shapes(path).items()}
    assert len(shapes) == len(controlnet.state_dict()) == 128
    expected = tiny_cldm_config(controlnet)
    assert cldm_shapes(expected) == shapes
    detected = comfy_detect(shapes)
    assert detected == {k: expected[k] for k in detected}


def test_sd15_keys_are_those_of_a_real_control_v11p_sd15_canny(sd15):
    """The SD 1.5 ControlNet's original-layout keys, derived from its diffusers config, against
    (1) the original ControlNet's rules with lllyasviel/ControlNet models/cldm_v15.yaml's settings
    (model_channels 320, channel_mult 1 2 4 4, 2 res blocks, attention at 1 2 4, 8 heads, context 768,
    hint 3 channels) and (2) shapes from a key listing of control_v11p_sd15_canny.pth (its state dict
    printed with ``torch.Size``, 340 tensors under control_model.), a few of them written out here."""
    shapes = original_shapes(sd15)
    cldm_v15 = {"in_channels": 4, "model_channels": 320, "hint_channels": 3, "num_res_blocks": [2, 2, 2, 2],
                "channel_mult": [1, 2, 4, 4], "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0], "transformer_depth_middle": 1,
                "context_dim": 768, "use_linear_in_transformer": False, "num_heads": 8}
    assert cldm_shapes(cldm_v15) == shapes
    listed = {"input_hint_block.14.weight": (320, 256, 3, 3), "input_blocks.4.0.skip_connection.weight": (640, 320, 1, 1),
              "input_blocks.7.1.transformer_blocks.0.ff.net.0.proj.weight": (10240, 1280),
              "input_blocks.1.1.proj_in.weight": (320, 320, 1, 1), "input_blocks.8.1.transformer_blocks.0.attn2.to_k.weight":
              (1280, 768), "zero_convs.11.0.weight": (1280, 1280, 1, 1), "middle_block_out.0.weight": (1280, 1280, 1, 1),
              "time_embed.0.weight": (1280, 320), "input_blocks.9.0.op.weight": (1280, 1280, 3, 3)}
    assert len(shapes) == 340 and {k: shapes[k] for k in listed} == listed
    assert not any(k.startswith("input_blocks.10.1") or k.startswith("input_blocks.11.1") for k in shapes)


# ------------------------------------------------------------------------------ ComfyUI


def test_comfyui_recognises_our_sd15_single_file(sd15):
    """comfy/controlnet.py ``load_controlnet_state_dict``: a file with ``control_model.zero_convs.0.0.weight``
    is the original layout; its config is detected from the shapes (``comfy_detect``) and matched to SD 1.5;
    ``comfy.cldm.cldm.ControlNet`` is built with it and loads the file (prefix removed) with strict=False,
    so every key must be one it has, at its shape, and none of its own may be missing."""
    shapes = original_shapes(sd15)
    assert "zero_convs.0.0.weight" in shapes and "input_hint_block.0.weight" in shapes
    config = comfy_config(shapes)
    assert config["num_heads"] == 8  # matched to SD 1.5
    assert cldm_shapes(config) == shapes


def comfy_diffusers_match(shapes: dict[str, tuple]) -> dict:
    """comfy/model_detection.py ``unet_config_from_diffusers_unet``: what it compares with its known
    UNets (SD 1.5 among them) to pick a config for a diffusers-layout ControlNet."""
    match, depths = {}, []
    for block in range(count_blocks(shapes, "down_blocks.{}")):
        attentions = count_blocks(shapes, f"down_blocks.{block}.attentions.{{}}")
        for a in range(attentions):
            depth = count_blocks(shapes, f"down_blocks.{block}.attentions.{a}.transformer_blocks.{{}}")
            depths.append(depth)
            if depth:
                match["context_dim"] = shapes[f"down_blocks.{block}.attentions.{a}.transformer_blocks.0.attn2.to_k.weight"][1]
        if not attentions:
            depths += [0] * count_blocks(shapes, f"down_blocks.{block}.resnets.{{}}")
    return {**match, "transformer_depth": depths, "model_channels": shapes["conv_in.weight"][0],
            "in_channels": shapes["conv_in.weight"][1], "adm_in_channels": None}


COMFY_RESNET = {"in_layers.0": "norm1", "in_layers.2": "conv1", "emb_layers.1": "time_emb_proj", "out_layers.0": "norm2",
                "out_layers.3": "conv2", "skip_connection": "conv_shortcut"}
COMFY_ATTENTION = ["proj_in", "proj_out", "norm"]
COMFY_TRANSFORMER = ["norm1", "norm2", "norm3", "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                     "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ff.net.0.proj", "ff.net.2"]


def comfy_diffusers_map(config: dict, keys) -> dict[str, str]:
    """diffusers key -> original key as ComfyUI converts a diffusers-layout ControlNet: comfy/utils.py
    ``unet_to_diffusers`` (its input-block, middle-block and basic parts; a ControlNet has no others),
    with comfy/controlnet.py ``load_controlnet_state_dict``'s additions (controlnet_mid_block,
    controlnet_down_blocks.N while the file has them, the hint encoder's convolutions in order)."""
    out = {}

    def pair(source, target, names, suffixes=("weight", "bias")):
        for name in names:
            for s in suffixes:
                out[f"{source}.{COMFY_RESNET.get(name, name)}.{s}"] = f"{target}.{name}.{s}"

    def attention(source, target, depth):
        pair(source, target, COMFY_ATTENTION)
        for t in range(depth):
            for name in COMFY_TRANSFORMER:
                suffixes = ("weight",) if name.split(".")[-1] in ("to_q", "to_k", "to_v") else ("weight", "bias")
                pair(f"{source}.transformer_blocks.{t}", f"{target}.transformer_blocks.{t}", [name], suffixes)

    depths = list(config["transformer_depth"])
    for x, blocks in enumerate(config["num_res_blocks"]):
        n = 1 + (blocks + 1) * x
        for i in range(blocks):
            pair(f"down_blocks.{x}.resnets.{i}", f"input_blocks.{n}.0", COMFY_RESNET)
            depth = depths.pop(0)
            if depth:
                attention(f"down_blocks.{x}.attentions.{i}", f"input_blocks.{n}.1", depth)
            n += 1
        for s in ("weight", "bias"):
            out[f"down_blocks.{x}.downsamplers.0.conv.{s}"] = f"input_blocks.{n}.0.op.{s}"
    attention("mid_block.attentions.0", "middle_block.1", config["transformer_depth_middle"])
    for i, n in enumerate((0, 2)):
        pair(f"mid_block.resnets.{i}", f"middle_block.{n}", COMFY_RESNET)
    for source, target in (("conv_in", "input_blocks.0.0"), ("time_embedding.linear_1", "time_embed.0"),
                           ("time_embedding.linear_2", "time_embed.2"), ("controlnet_mid_block", "middle_block_out.0")):
        for s in ("weight", "bias"):
            out[f"{source}.{s}"] = f"{target}.{s}"
    count = 0
    while f"controlnet_down_blocks.{count}.weight" in keys:
        for s in ("weight", "bias"):
            out[f"controlnet_down_blocks.{count}.{s}"] = f"zero_convs.{count}.0.{s}"
        count += 1
    count = 0
    while True:
        source = "controlnet_cond_embedding.conv_in" if count == 0 else f"controlnet_cond_embedding.blocks.{count - 1}"
        last = f"{source}.weight" not in keys
        source = "controlnet_cond_embedding.conv_out" if last else source
        for s in ("weight", "bias"):
            out[f"{source}.{s}"] = f"input_hint_block.{count * 2}.{s}"
        if last:
            return out
        count += 1


def test_comfyui_converts_our_diffusers_sd15_file_key_for_key(sd15):
    """comfy/controlnet.py ``load_controlnet_state_dict``: a file with
    ``controlnet_cond_embedding.conv_in.weight`` is diffusers' layout; its UNet config must match a known
    one (``unet_config_from_diffusers_unet``: SD 1.5 here), and every key must be in the conversion map
    (a leftover key is dropped with a warning) and land where our single file puts it."""
    shapes = {k: tuple(v.shape) for k, v in sd15.state_dict().items()}
    assert cnf.DIFFUSERS_MARKER in shapes
    assert comfy_diffusers_match(shapes) == {"context_dim": 768, "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0],
                                             "model_channels": 320, "in_channels": 4, "adm_in_channels": None}
    sd15_config = {"num_res_blocks": [2, 2, 2, 2], "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0], "transformer_depth_middle": 1}
    mapping = comfy_diffusers_map(sd15_config, shapes)
    assert {k: mapping.get(k) for k in shapes} == cnf.original_key_map(sd15)


def repository_tree(variable: str, tmp_path: Path, *paths: str) -> Path:
    """The checkout named by the environment variable ``variable``: a work tree, or a bare git dir whose
    HEAD (``paths`` of it, or all) is exported here; the test is skipped without one."""
    source = os.environ.get(variable)
    if not source or not Path(source).exists():
        pytest.skip(f"{variable} names no checkout of the tool")
    source = Path(source)
    if (source / "HEAD").is_file() and (source / "objects").is_dir():  # a bare repository
        tree = tmp_path / "tree"
        tree.mkdir()
        archive = subprocess.run(["git", f"--git-dir={source}", "archive", "HEAD", *paths], check=True, capture_output=True).stdout
        tar = tmp_path / "tree.tar"
        tar.write_bytes(archive)
        with tarfile.open(tar) as handle:
            handle.extractall(tree, filter="data")
        return tree
    return source


COMFY_LOAD = r"""
import json, sys
import torch
config, path = json.loads(sys.argv[1]), sys.argv[2]
sys.argv = sys.argv[:1] + ["--cpu"]  # comfy's command line is parsed when comfy.model_management is imported
try:
    import comfy.ops
    from comfy.cldm.cldm import ControlNet
except ImportError as error:
    print(f"cannot import ComfyUI here: {error}")
    sys.exit(3)
from safetensors.torch import load_file
model = ControlNet(image_size=32, use_spatial_transformer=True, legacy=False, dtype=torch.float32, device="cpu",
                   operations=comfy.ops.disable_weight_init, **config)
state = {k[len("control_model."):]: v.float() for k, v in load_file(path).items()}
model.load_state_dict(state, strict=True)
print("loaded", len(state))
"""


@pytest.mark.slow
def test_comfyui_own_controlnet_loads_our_single_file_strictly(controlnet, tmp_path):
    """ComfyUI's comfy.cldm.cldm.ControlNet itself, built with the tiny preset's layout and head count, loads
    our single file with strict=True (in a subprocess with the checkout first on sys.path)."""
    tree = repository_tree("COMFYUI_DIR", tmp_path)
    path = cnf.save_single_file(controlnet, tmp_path / "cn.safetensors")
    result = subprocess.run([sys.executable, "-c", COMFY_LOAD, json.dumps(tiny_cldm_config(controlnet)), str(path)], cwd=tree,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(tree)})
    if result.returncode == 3:
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-2:] == ["loaded", "128"]


# ------------------------------------------------------------------------------ AUTOMATIC1111's sd-webui-controlnet

# scripts/controlnet_model_guess.py ``controlnet_default_config``: the one config the extension builds for
# any ControlNet without label_emb (it reads hint_channels from input_hint_block.0.weight and context_dim
# from input_blocks.5.1.transformer_blocks.0.attn2.to_k.weight): SD 1.5's.
EXTENSION_SD15 = {"adm_in_channels": None, "in_channels": 4, "model_channels": 320, "num_res_blocks": 2,
                  "attention_resolutions": [1, 2, 4], "transformer_depth": [1, 1, 1, 0], "channel_mult": [1, 2, 4, 4],
                  "transformer_depth_middle": 1, "use_linear_in_transformer": False, "context_dim": 768, "num_heads": 8,
                  "global_average_pooling": False}


def extension_cldm_config(config: dict, shapes: dict[str, tuple]) -> dict:
    """scripts/cldm.py ``ControlNet.__init__`` in ``cldm_shapes``' terms: a level attends when its
    downsampling factor is in attention_resolutions, with that level's transformer_depth."""
    levels = len(config["channel_mult"])
    depths = [config["transformer_depth"][level] if 2 ** level in config["attention_resolutions"] else 0
              for level in range(levels) for _ in range(config["num_res_blocks"])]
    return {**config, "num_res_blocks": [config["num_res_blocks"]] * levels, "transformer_depth": depths,
            "hint_channels": shapes["input_hint_block.0.weight"][1],
            "context_dim": shapes["input_blocks.5.1.transformer_blocks.0.attn2.to_k.weight"][1]}


def extension_diffusers_map(keys) -> dict[str, str]:
    """diffusers key -> original key as the extension converts a diffusers-layout ControlNet:
    scripts/controlnet_diffusers.py ``convert_from_diffuser_state_dict`` (SD 1.5's blocks written out:
    4 levels, 12 zero convolutions, 8 hint convolutions), its substitutions applied in its order."""
    exact = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
             "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
             "conv_in": "input_blocks.0.0", "controlnet_mid_block": "middle_block_out.0"}
    exact = {f"{k}.{s}": f"{v}.{s}" for k, v in exact.items() for s in ("weight", "bias")}
    resnet = [("in_layers.0", "norm1"), ("in_layers.2", "conv1"), ("out_layers.0", "norm2"), ("out_layers.3", "conv2"),
              ("emb_layers.1", "time_emb_proj"), ("skip_connection", "conv_shortcut")]
    layers = []
    for i in range(4):
        for j in range(10):
            layers += [(f"input_blocks.{3 * i + j + 1}.0.", f"down_blocks.{i}.resnets.{j}."),
                       (f"input_blocks.{3 * i + j + 1}.1.", f"down_blocks.{i}.attentions.{j}.")]
        layers.append((f"input_blocks.{3 * (i + 1)}.0.op.", f"down_blocks.{i}.downsamplers.0.conv."))
    layers += [("middle_block.1.", "mid_block.attentions.0.")] + [(f"middle_block.{2 * j}.", f"mid_block.resnets.{j}.")
                                                                  for j in range(2)]
    hint = ["conv_in"] + [f"blocks.{i}" for i in range(6)] + ["conv_out"]
    layers += [(f"input_hint_block.{2 * i}.", f"controlnet_cond_embedding.{name}.") for i, name in enumerate(hint)]
    layers += [(f"zero_convs.{i}.0.", f"controlnet_down_blocks.{i}.") for i in range(12)]
    out = {}
    for key in keys:
        name = exact.get(key, key)
        if "resnets" in key:
            for original, diffusers in resnet:
                name = name.replace(diffusers, original)
        for original, diffusers in layers:
            name = name.replace(diffusers, original)
        out[key] = name
    return out


def test_extension_loads_our_sd15_files(sd15):
    """scripts/controlnet_model_guess.py ``build_model_by_guess``: ``control_model.`` is removed from every
    key, a file with ``input_hint_block.0.weight`` and no ``label_emb.0.0.bias`` is built as
    ``controlnet_default_config`` and loaded with strict=False: every key must be one it has, at its
    shape, and none of its own missing. A diffusers-layout file (``controlnet_cond_embedding.conv_in.weight``)
    is converted first: each key must land where our single file puts it."""
    shapes = original_shapes(sd15)
    assert "input_hint_block.0.weight" in shapes and "label_emb.0.0.bias" not in shapes
    assert cldm_shapes(extension_cldm_config(EXTENSION_SD15, shapes)) == shapes
    assert extension_diffusers_map(sd15.state_dict()) == cnf.original_key_map(sd15)


def test_extension_own_code_agrees(sd15, tmp_path):
    """With a checkout of the extension: its own convert_from_diffuser_state_dict (a module of plain Python)
    converts our diffusers keys to our single file's, and its controlnet_default_config is the one above."""
    tree = repository_tree("SD_WEBUI_CONTROLNET_DIR", tmp_path, "scripts")
    spec = importlib.util.spec_from_file_location("controlnet_diffusers", tree / "scripts" / "controlnet_diffusers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    state = sd15.state_dict()
    converted = module.convert_from_diffuser_state_dict(dict(state))
    mapping = cnf.original_key_map(sd15)
    assert set(converted) == set(mapping.values())
    assert all(converted[mapping[k]] is v for k, v in state.items())
    source = (tree / "scripts" / "controlnet_model_guess.py").read_text()
    default = next(node.value for node in ast.parse(source).body if isinstance(node, ast.Assign)
                   and getattr(node.targets[0], "id", None) == "controlnet_default_config")
    assert ast.literal_eval(default) == EXTENSION_SD15

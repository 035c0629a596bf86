"""ControlNet files other tools load, written and read.

* ``save_diffusers``: a diffusers folder (``config.json`` + ``diffusion_pytorch_model.safetensors``), what
  ``ControlNetModel.from_pretrained(folder)`` loads. ComfyUI's ControlNetLoader and AUTOMATIC1111's
  sd-webui-controlnet take its weights file alone as well (they convert diffusers' names; both know the
  SD 1.5 layout only, by its shapes).
* ``save_single_file``: one ``.safetensors`` in the original layout of lllyasviel's ControlNet
  (``control_model.input_blocks.*``, ``zero_convs.N.0.*``, ``input_hint_block.*``, ``middle_block.*``,
  ``middle_block_out.0.*``, ``time_embed.*``, ``label_emb.*`` where the config has one), what ComfyUI,
  the AUTOMATIC1111 extension and diffusers' ``ControlNetModel.from_single_file`` read; fp16 unless asked
  otherwise, the diffusers config in its header (``controlnet_config``).
* ``load_controlnet``: a diffusers folder, a diffusers-layout ``.safetensors`` or an original-layout one
  (with or without ``control_model.``) as a ``ControlNetModel`` in fp32; safetensors only.

The key map is derived from the model's config (blocks, layers per block, which blocks attend): the
encoder half of ``sd.original_layout.unet_prefixes`` plus the ControlNet's own parts, so it holds for the SD 1.x
ControlNet and the tiny preset alike.
"""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path
from typing import Callable

import torch

import sd.files
import sd.formats
import sd.original_layout

log = logging.getLogger("sd_controlnet")

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"
PREFIX = "control_model."  # lllyasviel's ControlLDM holds the ControlNet as its ``control_model``
CONFIG_METADATA = "controlnet_config"  # our single files' header: the diffusers config, as JSON
DIFFUSERS_MARKER = "controlnet_cond_embedding.conv_in.weight"  # how ComfyUI and the extension tell diffusers' layout
ORIGINAL_MARKER = "input_hint_block.0.weight"
# The original ControlNet builds its hint encoder with these widths and no others (ComfyUI's and the
# extension's copies too): convolutions of 16, 16, 32, 32, 96, 96, 256 channels, then the model's width.
HINT_CHANNELS = (16, 32, 96, 256)
# Keys that mark other kinds of control model, which this module does not read.
OTHER_KINDS = {"lora_controlnet": "a Control-LoRA",
               "difference": "a difference ControlNet (weights relative to its base)"}
RENAMES = {"resnet": sd.original_layout.UNET_RESNET}
LABEL_FIELDS = ("addition_embed_type", "class_embed_type", "num_class_embeds")  # where a label embedding goes


# ---------------------------------------------------------------------------------------------
# Key map
# ---------------------------------------------------------------------------------------------


def _layers(config) -> int:
    layers = config["layers_per_block"]
    return layers if isinstance(layers, int) else layers[0]


def label_prefixes(config) -> list[tuple[str, str, str]]:
    """Where the original layout keeps the label embedding (``label_emb``): diffusers' ``add_embedding``
    (SDXL's ``text_time``) or ``class_embedding`` (a linear pair, or an ``nn.Embedding`` of class ids)."""
    if config.get("addition_embed_type") == "text_time":
        part = "add_embedding"
    elif config.get("class_embed_type") in ("timestep", "projection"):
        part = "class_embedding"
    elif config.get("class_embed_type") is None and config.get("num_class_embeds"):
        return [("class_embedding", "label_emb", "plain")]
    else:
        return []
    return [(f"{part}.linear_1", "label_emb.0.0", "plain"), (f"{part}.linear_2", "label_emb.0.2", "plain")]


def original_prefixes(config, hint: int) -> list[tuple[str, str, str]]:
    """``(diffusers prefix, original prefix, kind)`` for every part of a ControlNetModel of ``config``
    whose hint encoder has ``hint`` convolutions between its first and its last."""
    encoder = sd.original_layout.unet_prefixes({**config, "up_block_types": ()})  # the UNet's encoder half
    out = [p for p in encoder if p[0] not in ("conv_norm_out", "conv_out")]
    zero_convs = len(config["block_out_channels"]) * (_layers(config) + 1)  # conv_in, each layer, each downsampler
    out += [("controlnet_cond_embedding.conv_in", "input_hint_block.0", "plain"),
            ("controlnet_cond_embedding.conv_out", f"input_hint_block.{2 * hint + 2}", "plain"),
            ("controlnet_mid_block", "middle_block_out.0", "plain")]
    out += [(f"controlnet_cond_embedding.blocks.{i}", f"input_hint_block.{2 * i + 2}", "plain") for i in range(hint)]
    out += [(f"controlnet_down_blocks.{i}", f"zero_convs.{i}.0", "plain") for i in range(zero_convs)]
    return out + label_prefixes(config)


def hint_blocks(config) -> int:
    """How many convolutions a ControlNetModel's hint encoder has between its first and its last."""
    return 2 * (len(config["conditioning_embedding_out_channels"]) - 1)


def original_key_map(controlnet) -> dict[str, str]:
    """diffusers key -> original-layout key (without ``control_model.``) for every tensor of ``controlnet``;
    a part the original layout has no place for (a text projection, an unusual class embedding) is a
    ValueError naming it."""
    prefixes = original_prefixes(controlnet.config, hint_blocks(controlnet.config))
    keys = list(controlnet.state_dict())
    homeless = [k for k in keys if not any(k == p[0] or k.startswith(p[0] + ".") for p in prefixes)]
    if homeless:
        raise ValueError(f"the original ControlNet layout has no place for this ControlNet's {homeless[0]}"
                         f"{_more(homeless)}; save it with save_diffusers")
    return sd.original_layout.key_map(keys, prefixes, RENAMES)


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def public_config(config) -> dict:
    """A model config without diffusers' bookkeeping entries (``_class_name``, ``_use_default_values``...)."""
    return {k: v for k, v in dict(config).items() if not k.startswith("_")}


def save_diffusers(controlnet, folder: str | Path) -> Path:
    """Write ``FOLDER/config.json`` and ``FOLDER/diffusion_pytorch_model.safetensors`` (the weights in
    their own dtype), atomically: an older folder there is replaced whole or not at all."""
    folder = Path(folder)

    def write(staging: Path) -> None:
        controlnet.save_pretrained(str(staging), safe_serialization=True)

    sd.files.write_folder_atomic(folder, write)
    return folder


def save_single_file(controlnet, path: str | Path, dtype: torch.dtype = torch.float16,
                     metadata: dict[str, str] | None = None) -> Path:
    """Write ``controlnet`` to the ``.safetensors`` file ``path`` in the original layout, each tensor
    ``control_model.<original key>`` in ``dtype``, with the diffusers config (and ``metadata``) in the
    header; atomically."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"{path}: a ControlNet single file is a .safetensors file; name it NAME.safetensors")
    channels = tuple(controlnet.config["conditioning_embedding_out_channels"])
    if channels != HINT_CHANNELS:
        raise ValueError(f"conditioning_embedding_out_channels {channels}: the original layout's readers build the "
                         f"hint encoder with {HINT_CHANNELS} only; save this ControlNet with save_diffusers")
    mapping = original_key_map(controlnet)
    tensors = {}
    for key, tensor in controlnet.state_dict().items():
        tensor = tensor.detach().to("cpu")
        tensors[PREFIX + mapping[key]] = (tensor.to(dtype) if tensor.is_floating_point() else tensor).contiguous()
    header = {"format": "pt", CONFIG_METADATA: json.dumps(public_config(controlnet.config), sort_keys=True),
              **(metadata or {})}
    from safetensors.torch import save_file

    sd.files.write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=header))
    if controlnet.config.get("global_pool_conditions") and not path.stem.endswith("_shuffle"):
        log.warning("%s: ComfyUI and the AUTOMATIC1111 extension pool this ControlNet's outputs "
                    "(global_pool_conditions) only when the file name ends in _shuffle", path)
    return path


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def controlnet_file(path: str | Path) -> Path:
    """``path``, a ``.safetensors`` file that exists; a pickle (``.pth``, ``.ckpt``, ``.bin``) is refused."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"{path}: ControlNet files are read as .safetensors only (unpickling a "
                         f"{path.suffix or 'pickle'} file can run code); convert it to .safetensors with safetensors' "
                         "save_file in a tool you trust")
    if not path.is_file():
        raise FileNotFoundError(f"ControlNet file {path} is missing")
    return path


def load_controlnet(source: str | Path, unet_config=None):
    """A ``ControlNetModel`` (fp32, eval mode) from a diffusers folder (or a pipeline folder's
    ``controlnet/``), or a ``.safetensors`` file in diffusers' or the original layout.

    A single file's config: ``unet_config`` (the base UNet's config, e.g. ``unet.config``) when given, with
    the hint encoder read off the weights; else the config the file records (our ``save_single_file``);
    else inferred from the tensor shapes, taking SD 1.x's head count and GroupNorm groups, which the
    shapes do not show. Every tensor must fit: a missing, extra or misshaped one is a ValueError naming
    the file and the key as the file spells it.
    """
    from diffusers import ControlNetModel

    path = Path(source)
    if path.is_dir():
        return _load_folder(path)
    file = controlnet_file(path)
    tensors = sd.files.read_weights(file)
    recorded = recorded_config(file)
    state, spell = diffusers_state(tensors, file, unet_config if unet_config is not None else recorded)
    if unet_config is not None:
        config = config_from_unet(unet_config, state, spell, file)
    else:
        config = recorded or inferred_config(state, spell, file)
    model = ControlNetModel.from_config(config)
    load_checked(model, state, spell, file)
    return model.eval()


def _load_folder(folder: Path):
    from diffusers import ControlNetModel

    found = next((f for f in (folder, folder / "controlnet") if (f / CONFIG_FILE).is_file()), None)
    if found is None:
        raise FileNotFoundError(f"{folder}: no {CONFIG_FILE}; a diffusers ControlNet folder holds {CONFIG_FILE} and "
                                f"{WEIGHTS_FILE}")
    weights = found / WEIGHTS_FILE
    if not weights.is_file():
        pickle = " (it holds diffusion_pytorch_model.bin, a pickle: convert it to .safetensors)" if (
            found / "diffusion_pytorch_model.bin").exists() else ""
        raise FileNotFoundError(f"{weights} is missing{pickle}")
    config = ControlNetModel.load_config(str(found))
    if config.get("_class_name", "ControlNetModel") != "ControlNetModel":
        raise ValueError(f"{found / CONFIG_FILE} describes a {config['_class_name']}, not a ControlNetModel")
    model = ControlNetModel.from_config(config)
    load_checked(model, sd.files.read_weights(weights), lambda key: key, weights)
    return model.eval()


def recorded_config(file: Path) -> dict | None:
    """The diffusers config a single file records in its header (``save_single_file``), or None."""
    text = sd.formats.single_file_metadata(file).get(CONFIG_METADATA)
    if text is None:
        return None
    try:
        config = json.loads(text)
    except ValueError as error:
        raise ValueError(f"{file}: its {CONFIG_METADATA} header is not JSON ({error}); pass unet_config") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: its {CONFIG_METADATA} header is not a JSON object; pass unet_config")
    return config


def diffusers_state(tensors: dict[str, torch.Tensor], file: Path, config=None) -> tuple[dict, Callable[[str], str]]:
    """A ControlNet file's tensors under diffusers' names, and ``spell``: a diffusers name -> the key the
    file has (or would have) for it, for messages.

    An original-layout file's block layout is read off its key names; ``config`` (a UNet or ControlNet
    config) says where a label embedding goes, which the names do not.
    """
    for key, kind in OTHER_KINDS.items():
        if key in tensors:
            raise ValueError(f"{file}: {kind}, not a whole ControlNet; this loader reads whole ControlNets only")
    if DIFFUSERS_MARKER in tensors:
        return dict(tensors), lambda key: key
    prefix = PREFIX if PREFIX + ORIGINAL_MARKER in tensors else ""
    if prefix + ORIGINAL_MARKER not in tensors:
        raise ValueError(f"{file}: not a ControlNet: it has neither {DIFFUSERS_MARKER} (diffusers' layout) nor "
                         f"{ORIGINAL_MARKER} or {PREFIX}{ORIGINAL_MARKER} (the original layout)")
    own = {key[len(prefix):]: key for key in tensors if key.startswith(prefix)}
    if len(own) < len(tensors):
        log.info("%s: %d tensors beside the ControlNet (a whole SD checkpoint?) are not read", file,
                 len(tensors) - len(own))
    hint = len({key.split(".")[1] for key in own if key.startswith("input_hint_block.")}) - 2
    label = {k: v for k, v in dict(config or {}).items() if k in LABEL_FIELDS}
    prefixes = original_prefixes({**block_layout(own, file), **label}, hint)
    state = {}
    for key, file_key in own.items():
        name = diffusers_name(key, prefixes)
        if name is None:
            advice = "; where a label embedding goes is not in the weights: pass unet_config" if (
                key.startswith("label_emb")) else ""
            raise ValueError(f"{file}: {file_key} has no place in a ControlNet of this layout{advice}")
        state[name] = tensors[file_key]

    def spell(name: str) -> str:
        try:
            return prefix + sd.original_layout.key_map([name], prefixes, RENAMES)[name]
        except KeyError:
            return name

    return state, spell


def block_layout(keys, file: Path) -> dict:
    """The block layout of an original-layout ControlNet from its key names (no prefix): the levels, the
    layers per level, which levels attend. Enough for its key map; the widths are the shapes' business."""
    inputs = {int(key.split(".")[1]) for key in keys if key.startswith("input_blocks.")}
    if not inputs:
        raise ValueError(f"{file}: has no input_blocks.*: not a ControlNet in the original layout")
    downsamplers = sorted(i for i in inputs if f"input_blocks.{i}.0.op.weight" in keys)
    layers = downsamplers[0] - 1 if downsamplers else max(inputs)
    levels = len(downsamplers) + 1
    level_of = {f"input_blocks.{1 + b * (layers + 1) + l}.1": b for b in range(levels) for l in range(layers)}
    attends = {level_of[head] for head in (".".join(key.split(".")[:3]) for key in keys) if head in level_of}
    return {"block_out_channels": [0] * levels, "layers_per_block": layers,
            "down_block_types": ["CrossAttnDownBlock2D" if b in attends else "DownBlock2D" for b in range(levels)]}


def diffusers_name(key: str, prefixes) -> str | None:
    """An original-layout key's diffusers name (the inverse of ``sd.original_layout.key_map``), or None."""
    match = max((p for p in prefixes if key == p[1] or key.startswith(p[1] + ".")), key=lambda p: len(p[1]),
                default=None)
    if match is None:
        return None
    source, target, kind = match
    rest = key[len(target):]
    for new, old in RENAMES.get(kind, {}).items():
        if rest.startswith(f".{old}."):
            rest = f".{new}." + rest[len(old) + 2:]
            break
    return source + rest


def _count(keys, pattern: str) -> int:
    """How many of ``pattern.format(0)``, ``pattern.format(1)``, ... begin some key, counting up from 0."""
    count = 0
    while any(key.startswith(pattern.format(count)) for key in keys):
        count += 1
    return count


def _shape(state, spell, key: str, file: Path) -> torch.Size:
    if key not in state:
        raise ValueError(f"{file}: lacks {spell(key)}, which the ControlNet's layout is read from; "
                         "damaged, or not a ControlNet")
    return state[key].shape


def hint_config(state, spell, file: Path) -> dict:
    """The hint encoder's config (conditioning channels and widths), read off its weights."""
    conv_in = _shape(state, spell, "controlnet_cond_embedding.conv_in.weight", file)
    blocks = _count(state, "controlnet_cond_embedding.blocks.{}.")
    widths = [conv_in[0]] + [_shape(state, spell, f"controlnet_cond_embedding.blocks.{2 * i + 1}.weight", file)[0]
                             for i in range(blocks // 2)]
    return {"conditioning_channels": conv_in[1], "conditioning_embedding_out_channels": widths}


def config_from_unet(unet_config, state, spell, file: Path) -> dict:
    """The config ``ControlNetModel.from_unet`` gives a ControlNet of a UNet with ``unet_config``, with the
    hint encoder the weights hold."""
    from diffusers import ControlNetModel

    accepted = set(inspect.signature(ControlNetModel.__init__).parameters) - {"self"}
    config = {k: v for k, v in public_config(unet_config).items() if k in accepted}
    return {**config, **hint_config(state, spell, file)}


def inferred_config(state, spell, file: Path) -> dict:
    """The config of a ControlNet whose file records none, from its tensor shapes.

    The attention head count and GroupNorm groups change no shape: they are SD 1.x's (diffusers' defaults,
    8 and 32), which the log says. Label or text-projection embeddings come in kinds the shapes do not
    tell apart: a file with one needs ``unet_config``.
    """
    extra = sorted({key.split(".")[0] for key in state if key.startswith(("add_embedding.", "class_embedding.",
                                                                          "encoder_hid_proj."))})
    if extra:
        raise ValueError(f"{file}: has {', '.join(spell(e) for e in extra)}, whose kind the weights do not say; pass "
                         "unet_config (the base UNet's config)")
    levels = _count(state, "down_blocks.{}.")
    # transformer blocks per attention, per level (0: the level has none); diffusers takes one number, or one per level
    depths = [_count(state, f"down_blocks.{b}.attentions.0.transformer_blocks.{{}}.") for b in range(levels)]
    deep = {d for d in depths if d}
    cross = next((v.shape[1] for k, v in state.items() if k.endswith(".attn2.to_k.weight")), 768)
    proj_in = next((v.ndim for k, v in state.items() if k.endswith(".proj_in.weight")), 4)
    config = {
        "in_channels": _shape(state, spell, "conv_in.weight", file)[1],
        "block_out_channels": [_shape(state, spell, f"down_blocks.{b}.resnets.0.conv2.weight", file)[0]
                               for b in range(max(levels, 1))],
        "layers_per_block": _count(state, "down_blocks.0.resnets.{}."),
        "down_block_types": ["CrossAttnDownBlock2D" if d else "DownBlock2D" for d in depths],
        "mid_block_type": "UNetMidBlock2DCrossAttn" if _count(state, "mid_block.attentions.{}.") else "UNetMidBlock2D",
        "transformer_layers_per_block": [d or 1 for d in depths] if len(deep) > 1 else max(deep, default=1),
        "cross_attention_dim": cross, "use_linear_projection": proj_in == 2,
        **hint_config(state, spell, file)}
    log.warning("%s records no config: its head count and GroupNorm groups are taken as SD 1.x's (8, 32), which the "
                "weights do not show; pass unet_config (the base UNet's config) for another base", file)
    return config


def _more(keys: list) -> str:
    return f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""


def load_checked(model, state: dict[str, torch.Tensor], spell, file: Path) -> None:
    """``model.load_state_dict(state)`` once every tensor is there and fits; else a ValueError naming
    ``file`` and the first wrong key as the file spells it."""
    own = model.state_dict()
    missing = [key for key in own if key not in state]
    unexpected = [key for key in state if key not in own]
    misshaped = [key for key in own if key in state and tuple(state[key].shape) != tuple(own[key].shape)]
    if missing:
        raise ValueError(f"{file}: lacks {spell(missing[0])}{_more(missing)} of the ControlNet its other weights and "
                         "config describe; damaged or cut short?")
    if unexpected:
        raise ValueError(f"{file}: {spell(unexpected[0])}{_more(unexpected)} has no place in the ControlNet its config "
                         "describes; another architecture, or the wrong unet_config?")
    if misshaped:
        key = misshaped[0]
        raise ValueError(f"{file}: {spell(key)}{_more(misshaped)} has shape {tuple(state[key].shape)} where the "
                         f"ControlNet its config describes has {tuple(own[key].shape)}; the wrong unet_config?")
    model.load_state_dict(state)

"""The original (LDM) layout of SD 1.x single files, as AUTOMATIC1111, ComfyUI, sd-scripts and the
community's checkpoints write them, and the key maps between it and diffusers' / transformers' names.

* ``unet_key_map`` / ``vae_key_map`` / ``text_key_map``: diffusers name -> original name for a model's
  state dict, derived from its config (blocks, layers per block, which blocks attend), so they hold for
  the SD 1.x UNet and any other UNet2DConditionModel / AutoencoderKL layout alike.
* ``OriginalFile``: a ``.safetensors`` or ``.ckpt`` file read as the files of other tools are written:
  a ``.ckpt``'s ``state_dict``, an EMA kept beside the live weights (``model_ema.*``), fp16 tensors, a
  text encoder saved without ``text_model.``, position-id buffers, a VAE-only file (``encoder.*`` /
  ``decoder.*``) and files holding only some of the three models. Tensors are read per model, never
  the whole file at once.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from sd.cli import first_line

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
TEXT_PREFIX = "cond_stage_model.transformer.text_model."

# Sub-module names inside a ResNet block: diffusers -> original.
UNET_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1",
               "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}
VAE_RESNET = {"conv_shortcut": "nin_shortcut"}
VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


# ---------------------------------------------------------------------------------------------
# Key maps
# ---------------------------------------------------------------------------------------------


def _layers(config) -> int:
    layers = config["layers_per_block"]
    return layers if isinstance(layers, int) else layers[0]


def unet_prefixes(config) -> list[tuple[str, str, str]]:
    """``(diffusers prefix, original prefix, kind)`` for every block of a UNet2DConditionModel."""
    layers, blocks = _layers(config), len(config["block_out_channels"])
    out = [("time_embedding.linear_1", "time_embed.0", "plain"), ("time_embedding.linear_2", "time_embed.2", "plain"),
           ("conv_in", "input_blocks.0.0", "plain"), ("conv_norm_out", "out.0", "plain"), ("conv_out", "out.2", "plain")]
    for b, kind in enumerate(config["down_block_types"]):
        for l in range(layers):
            index = 1 + b * (layers + 1) + l
            out.append((f"down_blocks.{b}.resnets.{l}", f"input_blocks.{index}.0", "resnet"))
            if "CrossAttn" in kind:
                out.append((f"down_blocks.{b}.attentions.{l}", f"input_blocks.{index}.1", "plain"))
        if b < blocks - 1:
            out.append((f"down_blocks.{b}.downsamplers.0.conv", f"input_blocks.{1 + b * (layers + 1) + layers}.0.op",
                        "plain"))
    out += [("mid_block.resnets.0", "middle_block.0", "resnet"), ("mid_block.attentions.0", "middle_block.1", "plain"),
            ("mid_block.resnets.1", "middle_block.2", "resnet")]
    for b, kind in enumerate(config["up_block_types"]):
        attends = "CrossAttn" in kind
        for l in range(layers + 1):
            index = b * (layers + 1) + l
            out.append((f"up_blocks.{b}.resnets.{l}", f"output_blocks.{index}.0", "resnet"))
            if attends:
                out.append((f"up_blocks.{b}.attentions.{l}", f"output_blocks.{index}.1", "plain"))
        if b < blocks - 1:
            out.append((f"up_blocks.{b}.upsamplers.0.conv",
                        f"output_blocks.{b * (layers + 1) + layers}.{2 if attends else 1}.conv", "plain"))
    return out


def vae_prefixes(config) -> list[tuple[str, str, str]]:
    layers, blocks = config["layers_per_block"], len(config["block_out_channels"])
    out = [("quant_conv", "quant_conv", "plain"), ("post_quant_conv", "post_quant_conv", "plain")]
    for part in ("encoder", "decoder"):
        out += [(f"{part}.conv_in", f"{part}.conv_in", "plain"), (f"{part}.conv_out", f"{part}.conv_out", "plain"),
                (f"{part}.conv_norm_out", f"{part}.norm_out", "plain"),
                (f"{part}.mid_block.resnets.0", f"{part}.mid.block_1", "resnet"),
                (f"{part}.mid_block.resnets.1", f"{part}.mid.block_2", "resnet"),
                (f"{part}.mid_block.attentions.0", f"{part}.mid.attn_1", "attention")]
    for b in range(blocks):
        for l in range(layers):
            out.append((f"encoder.down_blocks.{b}.resnets.{l}", f"encoder.down.{b}.block.{l}", "resnet"))
        if b < blocks - 1:
            out.append((f"encoder.down_blocks.{b}.downsamplers.0.conv", f"encoder.down.{b}.downsample.conv", "plain"))
        # The original decoder numbers its up blocks from the lowest resolution: up.{n-1} runs first.
        for l in range(layers + 1):
            out.append((f"decoder.up_blocks.{b}.resnets.{l}", f"decoder.up.{blocks - 1 - b}.block.{l}", "resnet"))
        if b < blocks - 1:
            out.append((f"decoder.up_blocks.{b}.upsamplers.0.conv", f"decoder.up.{blocks - 1 - b}.upsample.conv",
                        "plain"))
    return out


def _rename(key: str, prefixes, renames: dict[str, dict[str, str]]) -> str:
    """Map one diffusers key to the original layout via the longest matching block prefix."""
    best = max((p for p in prefixes if key == p[0] or key.startswith(p[0] + ".")), key=lambda p: len(p[0]),
               default=None)
    if best is None:
        raise KeyError(f"no original-layout name for {key!r}")
    source, target, kind = best
    rest = key[len(source):]  # "" or ".sub.module.weight"
    for old, new in renames.get(kind, {}).items():
        if rest.startswith(f".{old}."):
            rest = f".{new}." + rest[len(old) + 2:]
            break
    return target + rest


def key_map(state_dict_keys, prefixes, renames) -> dict[str, str]:
    mapping = {key: _rename(key, prefixes, renames) for key in state_dict_keys}
    if len(set(mapping.values())) != len(mapping):
        raise AssertionError("key map is not one-to-one")
    return mapping


def unet_key_map(unet) -> dict[str, str]:
    return {k: UNET_PREFIX + v for k, v in key_map(unet.state_dict(), unet_prefixes(unet.config),
                                                     {"resnet": UNET_RESNET}).items()}


def vae_key_map(vae) -> dict[str, str]:
    renames = {"resnet": VAE_RESNET, "attention": VAE_ATTENTION}
    return {k: VAE_PREFIX + v for k, v in key_map(vae.state_dict(), vae_prefixes(vae.config), renames).items()}


def text_key_map(text_encoder) -> dict[str, str]:
    """transformers 5 drops the ``text_model.`` prefix from CLIPTextModel keys; the original keeps it."""
    return {k: TEXT_PREFIX + k.removeprefix("text_model.") for k in text_encoder.state_dict()}



def _vae_tensor_to_original(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The original VAE attention uses 1x1 convs where diffusers uses linears."""
    if ".mid.attn_1." in name and name.endswith(".weight") and tensor.ndim == 2:
        return tensor[:, :, None, None]
    return tensor


def to_original(model, mapping: dict[str, str], half: bool = False) -> dict[str, torch.Tensor]:
    """``model``'s tensors under their original names (``mapping``: a key map above); fp16 with ``half``."""
    out = {}
    for key, tensor in model.state_dict().items():
        name = mapping[key]
        tensor = _vae_tensor_to_original(name, tensor.detach().cpu().contiguous())
        out[name] = (tensor.half() if half and tensor.is_floating_point() else tensor).contiguous()
    return out


# ---------------------------------------------------------------------------------------------
# Reading the files other tools write
# ---------------------------------------------------------------------------------------------

PREFIXES = {"unet": UNET_PREFIX, "vae": VAE_PREFIX, "text_encoder": TEXT_PREFIX}
PART_NAMES = {"unet": "UNet", "vae": "VAE", "text_encoder": "text encoder"}
TEXT_ROOT = "cond_stage_model.transformer."  # older files lack the text_model. level below it
VAE_ONLY_ROOTS = ("encoder.", "decoder.", "quant_conv.", "post_quant_conv.")  # a VAE saved alone (vae-ft-mse-*)
EMA_PREFIX = "model_ema."  # the original trainer's EMA of the UNet, kept beside the live weights in full files


def ema_name(name: str) -> str:
    """The EMA key of an original UNet key: the original EMA stores each ``model.<name>`` parameter as a
    buffer named without dots (``model_ema.diffusion_modelinput_blocks00weight``)."""
    return EMA_PREFIX + name.removeprefix("model.").replace(".", "")


def read_single_file(path: str | Path) -> dict[str, torch.Tensor]:
    """A ``.safetensors`` file, or a ``.ckpt`` read with ``weights_only=True`` (never unpickling code) and
    memory-mapped where its format allows, its ``state_dict`` when it wraps one. A damaged file is a
    one-line ValueError naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path))
        except SafetensorError as error:
            raise ValueError(f"{path}: not a readable safetensors file, damaged or truncated ({error})") from error
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:  # the legacy (pre-zip) format cannot be memory-mapped
            if "mmap" not in str(error):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # pickles holding objects beyond tensors are refused
        reason = str(error).split("WeightsUnpickler error:")[-1]  # torch's own advice comes first; the cause last
        raise ValueError(f"{path}: not loadable without unpickling arbitrary objects, or damaged "
                         f"({first_line(reason).split('. ')[0]}); convert it to .safetensors with a tool you "
                         "trust") from error
    state = state.get("state_dict", state) if isinstance(state, dict) else state
    if not isinstance(state, dict):
        raise ValueError(f"{path}: holds a {type(state).__name__}, not a state dict of tensors")
    return {name: tensor for name, tensor in state.items() if isinstance(tensor, torch.Tensor)}


class OriginalFile:
    """A single file's tensors under the canonical original names (``PREFIXES``), read per model.

    ``use_ema``: a UNet kept with its EMA (``model_ema.*``) gives the EMA's weights, else the live ones.
    ``notes`` says what was met on the way (which UNet weights were taken, fp16, renamed text keys, a
    VAE-only file), for the log line that names where each model came from.
    """

    def __init__(self, path: str | Path, use_ema: bool = True):
        self.path = Path(path)
        self._tensors = None if self.path.suffix == ".safetensors" else read_single_file(self.path)
        shapes = self._read_shapes() if self._tensors is None else {
            k: (tuple(t.shape), t.dtype) for k, t in self._tensors.items()}
        self.names, self.notes = canonical_names(shapes, use_ema)  # canonical -> key in the file
        self.shapes = {name: shapes[key][0] for name, key in self.names.items()}
        self.dtypes = {name: shapes[key][1] for name, key in self.names.items()}

    def _read_shapes(self) -> dict[str, tuple[tuple, torch.dtype]]:
        from safetensors import SafetensorError, safe_open

        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such file")
        try:
            with safe_open(str(self.path), framework="pt") as f:
                return {k: (tuple(f.get_slice(k).get_shape()), _DTYPES.get(f.get_slice(k).get_dtype(), torch.float32))
                        for k in f.keys()}
        except SafetensorError as error:
            raise ValueError(f"{self.path}: not a readable safetensors file, damaged or truncated ({error})") from error

    @property
    def parts(self) -> list[str]:
        """The models the file holds: ``unet``, ``vae``, ``text_encoder``, in that order."""
        return [part for part, prefix in PREFIXES.items() if any(n.startswith(prefix) for n in self.names)]

    def tensors(self, names) -> dict[str, torch.Tensor]:
        """The tensors of canonical ``names``, read from the file (only those)."""
        from safetensors import SafetensorError, safe_open

        if self._tensors is not None:
            return {name: self._tensors[self.names[name]] for name in names}
        try:
            with safe_open(str(self.path), framework="pt") as f:
                return {name: f.get_tensor(self.names[name]) for name in names}
        except SafetensorError as error:
            raise ValueError(f"{self.path}: not a readable safetensors file, damaged or truncated ({error})") from error

    def describe(self, part: str) -> str:
        """Where ``part`` came from, for the log: ``single file X (EMA weights, fp16)``."""
        prefix = PREFIXES[part]
        notes = [note for note_part, note in self.notes if note_part in (part, None)]
        if any(dtype == torch.float16 for name, dtype in self.dtypes.items() if name.startswith(prefix)):
            notes.append("fp16 weights")
        return f"single file {self.path}" + (f" ({', '.join(notes)})" if notes else "")

    def fits(self, model, mapping: dict[str, str]) -> bool:
        """Whether the file holds every tensor of ``model`` (``mapping``: its key map) in its shape."""
        own = model.state_dict()
        for key, name in mapping.items():
            if name not in self.shapes:
                if not name.endswith("position_ids"):
                    return False
            elif _squeezed(self.shapes[name], own[key].ndim) != tuple(own[key].shape):
                return False
        return True

    def state_for(self, model, mapping: dict[str, str], what: str) -> dict[str, torch.Tensor]:
        """The part of the file that belongs to ``model`` (``mapping``: its key map) under the model's own
        names and dtypes: a missing tensor, another shape or a non-finite value is a ValueError naming the
        file. A position-id buffer the file lacks keeps the model's own."""
        own = model.state_dict()
        wanted = {key: name for key, name in mapping.items() if name in self.names}
        missing = [name for key, name in mapping.items() if key not in wanted and not name.endswith("position_ids")]
        if missing:
            raise ValueError(f"{self.path} lacks {len(missing)} {what} tensors, e.g. {missing[:3]}; is it an SD 1.x "
                             "checkpoint of this architecture?")
        read = self.tensors(wanted.values())
        out = {}
        for key, name in wanted.items():
            tensor = read[name]
            if tensor.ndim == 4 and own[key].ndim == 2:
                tensor = tensor[:, :, 0, 0]
            if tuple(tensor.shape) != tuple(own[key].shape):
                raise ValueError(f"{self.path}: {name} of shape {tuple(tensor.shape)} does not fit {what} {key} "
                                 f"{tuple(own[key].shape)}")
            tensor = tensor.to(own[key].dtype)
            if tensor.is_floating_point() and not all_finite(tensor):
                raise ValueError(f"{self.path}: {name} holds non-finite values (NaN or inf); the file is damaged, "
                                 "use another copy")
            out[key] = tensor
        return out


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or inf in ``tensor``: a NaN or inf anywhere makes its sum non-finite, so a finite sum (one fast
    pass) settles it; a non-finite sum (or one that overflowed) is settled value by value."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32}


def _squeezed(shape: tuple, ndim: int) -> tuple:
    """A 1x1 convolution's shape as a linear's, where the model holds a linear (the original VAE attention)."""
    return shape[:2] if len(shape) == 4 and ndim == 2 and shape[2:] == (1, 1) else shape


def canonical_names(shapes: dict, use_ema: bool) -> tuple[dict[str, str], list[tuple[str | None, str]]]:
    """``({canonical name: key in the file}, notes)`` for a file's keys: a VAE saved alone gets the
    ``first_stage_model.`` prefix, a text encoder saved without ``text_model.`` gets it, and the UNet's names
    point at its EMA (``model_ema.*``) when ``use_ema`` and the file keeps a complete one. ``notes``:
    ``(part or None, what was done)``."""
    keys = list(shapes)
    notes: list[tuple[str | None, str]] = []
    vae_only = (not any(k.startswith(("model.diffusion_model.", VAE_PREFIX, TEXT_ROOT)) for k in keys)
                and any(k.startswith(("encoder.", "decoder."))for k in keys))
    names = {}
    for key in keys:
        if vae_only and key.startswith(VAE_ONLY_ROOTS):
            names[VAE_PREFIX + key] = key
        elif key.startswith(TEXT_ROOT) and not key.startswith(TEXT_PREFIX):
            names[TEXT_PREFIX + key[len(TEXT_ROOT):]] = key
        elif not key.startswith(EMA_PREFIX):
            names[key] = key
    if vae_only:
        notes.append(("vae", "a VAE-only file"))
    if any(k.startswith(TEXT_ROOT) and not k.startswith(TEXT_PREFIX) for k in keys):
        notes.append(("text_encoder", "text encoder keys without text_model."))
    unet = [name for name in names if name.startswith(UNET_PREFIX)]
    ema = [ema_name(name) for name in unet]
    if unet and any(k.startswith(EMA_PREFIX) for k in keys):
        complete = all(name in shapes for name in ema)
        if use_ema and complete:
            names.update(zip(unet, ema))
            notes.append(("unet", "its EMA weights, model_ema.*"))
        elif use_ema:
            notes.append(("unet", "its live weights: its model_ema.* is incomplete"))
        else:
            notes.append(("unet", "its live weights, model.diffusion_model.*; its EMA left"))
    return names, notes


# ---------------------------------------------------------------------------------------------
# The SD 1.x UNet's 25 blocks, as the block-merge tools, kohya and AUTOMATIC1111's LoRA block weights name them
# ---------------------------------------------------------------------------------------------

BLOCKS = (*(f"IN{i:02d}" for i in range(12)), "M00", *(f"OUT{i:02d}" for i in range(12)))
LBW_BLOCKS = ("BASE", *BLOCKS)  # a LoRA block-weight vector's 26 entries; BASE: the text encoder
LBW17 = ("BASE", "IN01", "IN02", "IN04", "IN05", "IN07", "IN08", "M00", *(f"OUT{i:02d}" for i in range(3, 12)))
_BLOCK_PATTERNS = ((re.compile(r"^model\.diffusion_model\.input_blocks\.(\d+)\."), "IN"),
                   (re.compile(r"^model\.diffusion_model\.middle_block\."), "M"),
                   (re.compile(r"^model\.diffusion_model\.output_blocks\.(\d+)\."), "OUT"))


def block_of(name: str) -> str | None:
    """The SD 1.x UNet block of an original-layout key (``IN04``, ``M00``, ``OUT11``), None outside them (the
    time embedding, the output layer)."""
    for pattern, kind in _BLOCK_PATTERNS:
        found = pattern.match(name)
        if found:
            return "M00" if kind == "M" else f"{kind}{int(found.group(1)):02d}"
    return None


def block_weights(values) -> dict[str, float]:
    """A LoRA block-weight vector as AUTOMATIC1111's LoRA Block Weight extension takes it: 26 values (``BASE``, the
    text encoder, then ``BLOCKS``), or 17 (``LBW17``: the blocks that attend; the others then stay at 1)."""
    values = [float(v) for v in values]
    if len(values) == 17:
        named = dict(zip(LBW17, values))
        return {block: named.get(block, 1.0) for block in LBW_BLOCKS}
    if len(values) == 26:
        return dict(zip(LBW_BLOCKS, values))
    raise ValueError(f"a block-weight vector has 17 or 26 values ({', '.join(LBW17)}; or BASE, IN00-IN11, M00, "
                     f"OUT00-OUT11), got {len(values)}")


def unet_blocks(config) -> "callable":
    """A function from a UNet's parameter or module name (diffusers' names, a PEFT layer's within them too) to its
    block (``block_of``), None outside the blocks: by the longest diffusers block prefix that starts the name."""
    prefixes = sorted(((source, target) for source, target, _ in unet_prefixes(config)), key=lambda p: -len(p[0]))

    def block(name: str) -> str | None:
        for source, target in prefixes:
            if name == source or name.startswith(source + "."):
                return block_of(f"{UNET_PREFIX}{target}.")
        return None

    return block

"""Stable Diffusion 1.x model assembly and diffusion math.

Everything here is importable without side effects:

* ``build_unet``: the SD 1.x UNet (``"sd1"``, 859,520,964 parameters) or a tiny CPU preset, with
  zero-initialised output projections for from-scratch training.
* ``load_vae`` / ``load_text_encoder`` / ``load_tokenizer``: the frozen parts, from a hub id, a local
  folder (a diffusers pipeline folder works too), a single file or the seeded ``"tiny"`` presets;
  ``model_from_file``: any of the three models of a single file (``sd.original_layout``).
* The DDPM training schedule, latent scaling, prediction targets and ``diffusion_loss`` with Min-SNR.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from pathlib import Path

import torch

import sd.cli
import sd.embedding.tokens
import sd.original_layout
import sd.tokenizer

# ---------------------------------------------------------------------------------------------
# Constants of the SD 1.x recipe
# ---------------------------------------------------------------------------------------------

NUM_TRAIN_TIMESTEPS = 1000
PREDICTION_TYPES = ("epsilon", "v_prediction", "flow")  # flow: sd.flow
BETA_START = 0.00085
BETA_END = 0.012
SD1_SCALING_FACTOR = 0.18215
TOKENIZER_MAX_LENGTH = 77
DEFAULT_VAE = "stabilityai/sd-vae-ft-mse"
DEFAULT_TEXT_ENCODER = "openai/clip-vit-large-patch14"
TINY_SEED = 0

# UNet2DConditionModel configurations. "sd1" is the exact SD 1.x UNet (v1-inference.yaml).
UNET_PRESETS = {
    "sd1": dict(
        sample_size=64,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=(320, 640, 1280, 1280),
        layers_per_block=2,
        cross_attention_dim=768,
        # diffusers names the SD 1.x head count "attention_head_dim" (8 heads of varying width).
        attention_head_dim=8,
        norm_num_groups=32,
    ),
}
# Trains on a CPU in milliseconds per step; cross-attention width matches the tiny text encoder.
UNET_PRESETS["tiny"] = dict(
    UNET_PRESETS["sd1"], sample_size=8, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), block_out_channels=(32, 64), layers_per_block=1,
    cross_attention_dim=64, attention_head_dim=4, norm_num_groups=8)
# The built-in demo's UNet (4.2M parameters): 64x64 images, 8x8 latents, attention at both levels.
UNET_PRESETS["demo"] = dict(
    UNET_PRESETS["tiny"], down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), block_out_channels=(64, 128), norm_num_groups=32)

# Text encoder preset: the real CLIP tokenizer's vocabulary, a small transformer on top.
TINY_TEXT_ENCODER = dict(
    vocab_size=49408,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=TOKENIZER_MAX_LENGTH,
    bos_token_id=49406,
    eos_token_id=49407,
    pad_token_id=49407,
)

# The SD 1.x AutoencoderKL architecture (the config of sd-vae-ft-mse), for benchmarks with random weights.
SD1_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    latent_channels=4,
    norm_num_groups=32,
    sample_size=512,
    scaling_factor=SD1_SCALING_FACTOR,
)
# AutoencoderKL preset with the real VAE's interface: 4 latent channels, downsampling factor 8.
TINY_VAE = dict(SD1_VAE, block_out_channels=(16, 32, 32, 32), layers_per_block=1, norm_num_groups=8, sample_size=64)
# CLIP ViT-L/14's text tower, as SD 1.x uses it.
SD1_TEXT_ENCODER = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                        num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768)
# The architectures a single file's models are recognised as, by their tensors' names and shapes.
FILE_CONFIGS = {"unet": UNET_PRESETS, "vae": {"sd1": SD1_VAE, "tiny": TINY_VAE},
                "text_encoder": {"sd1": SD1_TEXT_ENCODER, "tiny": TINY_TEXT_ENCODER}}


# ---------------------------------------------------------------------------------------------
# UNet
# ---------------------------------------------------------------------------------------------


def build_unet(
    preset: str | dict = "sd1",
    *,
    from_scratch: bool = True,
    grad_checkpointing: bool = False,
    channels_last: bool = False,
    seed: int | None = None,
):
    """Build a ``UNet2DConditionModel`` from a preset name or a config dict.

    ``from_scratch`` zero-initialises the output projections (see ``zero_init_output_projections``),
    so the untrained UNet predicts exactly zero and every residual branch starts as the identity.
    ``seed`` makes the random initialisation reproducible without touching the global RNG.
    """
    from diffusers import UNet2DConditionModel

    if isinstance(preset, str):
        if preset not in UNET_PRESETS:
            raise ValueError(f"unknown UNet preset {preset!r}; choose one of {sorted(UNET_PRESETS)}")
        config = UNET_PRESETS[preset]
    else:
        config = dict(preset)
    with _seeded(seed):
        unet = UNet2DConditionModel(**config)
    if from_scratch:
        zero_init_output_projections(unet)
    use_sdpa_attention(unet)
    configure_unet(unet, grad_checkpointing=grad_checkpointing, channels_last=channels_last)
    return unet


def configure_unet(unet, *, grad_checkpointing: bool = False, channels_last: bool = False):
    """Switch gradient checkpointing and the channels_last memory format on or off."""
    if grad_checkpointing:
        unet.enable_gradient_checkpointing()
    else:
        unet.disable_gradient_checkpointing()
    unet.to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    return unet


def zero_init_output_projections(unet) -> list[str]:
    """Zero every layer that writes into a residual stream, and the UNet's final conv.

    Zeroed: each ResNet block's ``conv2``, each attention's output projection (``to_out.0``, self and
    cross), each feed-forward's last linear (``ff.net.2``), each transformer's ``proj_out`` and the
    UNet's ``conv_out``. Every block then starts as the identity and the model output is exactly
    zero (the "zero module" initialisation of the original SD and ADM code bases). Returns the
    names of the zeroed modules.
    """
    from diffusers.models.attention import FeedForward
    from diffusers.models.attention_processor import Attention
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    targets = []
    for name, module in unet.named_modules():
        if isinstance(module, ResnetBlock2D):
            targets.append((f"{name}.conv2", module.conv2))
        elif isinstance(module, Attention):
            targets.append((f"{name}.to_out.0", module.to_out[0]))
        elif isinstance(module, FeedForward):
            targets.append((f"{name}.net.2", module.net[-1]))
        elif isinstance(module, Transformer2DModel):
            targets.append((f"{name}.proj_out", module.proj_out))
    targets.append(("conv_out", unet.conv_out))
    with torch.no_grad():
        for _, layer in targets:
            layer.weight.zero_()
            if layer.bias is not None:
                layer.bias.zero_()
    return [name for name, _ in targets]


def use_sdpa_attention(model) -> None:
    """Route every attention layer through ``F.scaled_dot_product_attention``."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    if hasattr(model, "set_attn_processor"):
        model.set_attn_processor(AttnProcessor2_0())


def training_flops_per_image(preset: str | dict = "sd1", latent_size: int = 64) -> int:
    """Model FLOPs of one training image through the UNet, forward + backward (no recomputation).

    Counted by ``torch.utils.flop_counter.FlopCounterMode`` on the meta device, so it costs no
    memory and gives the same number on every machine: on meta, attention runs as explicit matmuls
    and is counted in full (on a real CPU the fused SDPA kernel is not counted). SD 1.x: 2.41e12 at
    512 px (64x64 latents), 0.54e12 at 256 px. This is the numerator of MFU.
    """
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        unet = build_unet(preset, from_scratch=False)
        context_dim = unet.config.cross_attention_dim
        latents = torch.empty(1, unet.config.in_channels, latent_size, latent_size)
        context = torch.empty(1, TOKENIZER_MAX_LENGTH, context_dim)
        timesteps = torch.zeros(1, dtype=torch.long)
        with FlopCounterMode(display=False) as counter:
            unet(latents, timesteps, encoder_hidden_states=context).sample.sum().backward()
    return int(counter.get_total_flops())


ATTENTION_CHOICES = ("auto", "cudnn", "flash", "efficient", "math")


def sdpa_backends(device, choice: str = "auto") -> list:
    """The SDPA kernels allowed on ``device``, in the order tried: on CUDA by ``choice`` (the config's
    ``attention``), flash then math elsewhere.

    ``auto``: flash, else memory-efficient. ``cudnn``: cuDNN's fused attention first (on Hopper it
    may beat flash for SD 1.x's heads of 40, 80 and 160 channels; ``bench/gpu_window.sh`` measures both), then as auto.
    ``flash``, ``efficient``: that kernel alone. ``math``: the reference, which materialises the full
    attention matrix and keeps it for the backward pass; it costs a GPU memory and time for nothing,
    so the other choices exclude it and a shape the fast kernels cannot take fails loudly. On a CPU
    the flash kernel (where torch has one for the shape and dtype) trains the tiny UNet at 128 px in
    about two thirds of the math kernel's memory; ``choice`` is for GPUs and ignored there.
    """
    from torch.nn.attention import SDPBackend

    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"attention: {choice!r} is not one of {', '.join(ATTENTION_CHOICES)}")
    if torch.device(device).type != "cuda":
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    fast = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    return {"auto": fast, "cudnn": [SDPBackend.CUDNN_ATTENTION, *fast], "flash": fast[:1], "efficient": fast[1:],
            "math": [SDPBackend.MATH]}[choice]


def attention_context(device, choice: str = "auto"):
    """Context the trainer and sampler enter so attention runs on the kernels of ``sdpa_backends``, tried
    in that order."""
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(sdpa_backends(device, choice), set_priority=True)


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# Frozen parts: VAE, text encoder, tokenizer
# ---------------------------------------------------------------------------------------------


def _local_subfolder(name_or_path: str, subfolder: str) -> str | None:
    """Return ``subfolder`` when ``name_or_path`` is a local diffusers pipeline folder holding it."""
    path = Path(name_or_path)
    if path.is_dir() and not (path / "config.json").exists() and (path / subfolder).is_dir():
        return subfolder
    return None


_HUB_REACHABLE: dict[str, bool] = {}  # host -> whether a connection to it opened, once per process


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the model hub (``HF_ENDPOINT``, else huggingface.co) takes a connection within ``timeout``
    seconds; asked once per process. Behind a proxy (``HTTPS_PROXY`` and the like) the answer is yes:
    only the proxy knows."""
    import socket
    from urllib.parse import urlparse

    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"
    if host not in _HUB_REACHABLE:
        try:
            socket.create_connection((host, 443), timeout=timeout).close()
            _HUB_REACHABLE[host] = True
        except OSError:
            _HUB_REACHABLE[host] = False
    return _HUB_REACHABLE[host]


def hub_options(name_or_path: str) -> dict:
    """``from_pretrained`` options for ``name_or_path``: a hub id while the hub cannot be reached loads from
    the local cache alone (``local_files_only``), so that it fails in seconds, not after minutes of
    retries, when the files are not there (a compute node without internet)."""
    if Path(name_or_path).exists() or not sd.cli.looks_like_hub_id(name_or_path):
        return {}
    if os.environ.get("HF_HUB_OFFLINE") or not hub_reachable():
        return {"local_files_only": True}
    return {}


def moved(module, device=None, dtype=None):
    """``module.to(device=device, dtype=dtype)``. A diffusers model that keeps no module in float32 is moved
    by torch's own ``Module.to``: diffusers' override warns "should be kept in float32: []" on every cast,
    even with nothing to keep (its check tests the list against None after making it a list)."""
    if getattr(module, "_keep_in_fp32_modules", None):
        return module.to(device=device, dtype=dtype)
    return torch.nn.Module.to(module, device=device, dtype=dtype)


def frozen(model, loaded_from: str | None = None):
    model.requires_grad_(False)
    model.eval()
    if loaded_from:
        model.loaded_from = loaded_from
    return model


class LoadError(ValueError):
    """A model part that could not be loaded, in one line naming it and the ways to fix it."""


HUB_FIX = "a local folder, or a hub id with the hub reachable (HF_HUB_OFFLINE unset)"


def from_pretrained(cls, what: str, name_or_path: str, **kwargs):
    """``cls.from_pretrained`` with ``hub_options``; a part that cannot be loaded (a hub id not in the cache while
    the hub cannot be reached, a folder without its files) is a LoadError naming ``what`` and the source."""
    options = hub_options(name_or_path)
    try:
        return cls.from_pretrained(name_or_path, **kwargs, **options)
    except (OSError, ValueError) as error:
        offline = "the hub cannot be reached and it is not in the local cache; " if options else ""
        raise LoadError(f"{what} {name_or_path}: cannot be loaded ({sd.cli.first_line(error)}); {offline}give "
                        f"{HUB_FIX}") from error


def load_vae(name_or_path: str = DEFAULT_VAE, *, subfolder: str | None = None, seed: int = TINY_SEED):
    """The frozen ``AutoencoderKL``: a hub id, a local folder (or pipeline folder), a single file (a whole
    checkpoint's VAE, or a VAE-only file) or ``"tiny"``. ``loaded_from`` says which."""
    from diffusers import AutoencoderKL

    if name_or_path == "tiny":
        with _seeded(seed):
            return frozen(AutoencoderKL(**TINY_VAE), f"tiny (random, seed {seed})")
    if Path(name_or_path).is_file():
        return frozen(model_from_file(name_or_path, "vae"))
    subfolder = subfolder or _local_subfolder(name_or_path, "vae")
    kwargs = {"subfolder": subfolder} if subfolder else {}
    return frozen(from_pretrained(AutoencoderKL, "vae", name_or_path, **kwargs), _source_kind(name_or_path))


def load_text_encoder(
    name_or_path: str = DEFAULT_TEXT_ENCODER, *, subfolder: str | None = None, seed: int = TINY_SEED
):
    """The frozen ``CLIPTextModel`` whose hidden states condition the UNet: a hub id, a local folder (or
    pipeline folder), a single file holding one, or ``"tiny"``. ``loaded_from`` says which."""
    from transformers import CLIPTextConfig, CLIPTextModel

    if name_or_path == "tiny":
        with _seeded(seed):
            return frozen(CLIPTextModel(CLIPTextConfig(**TINY_TEXT_ENCODER)), f"tiny (random, seed {seed})")
    if Path(name_or_path).is_file():
        return frozen(model_from_file(name_or_path, "text_encoder"))
    subfolder = subfolder or _local_subfolder(name_or_path, "text_encoder")
    kwargs = {"subfolder": subfolder} if subfolder else {}
    return frozen(from_pretrained(CLIPTextModel, "text_encoder", name_or_path, **kwargs), _source_kind(name_or_path))


def _source_kind(name_or_path: str) -> str:
    path = Path(name_or_path)
    if path.is_dir():
        return f"{'diffusers folder' if (path / 'model_index.json').exists() else 'folder'} {name_or_path}"
    return f"hub id {name_or_path}"


def encoder_digest(vae) -> str:
    """A short SHA-256 of the weights latents depend on: the VAE's encoder and ``quant_conv``, as float32.
    A VAE whose decoder alone was fine-tuned (sd-vae-ft-mse) encodes as the original does and has its digest."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(vae.state_dict().items()):
        if name.startswith(("encoder.", "quant_conv.")):
            digest.update(name.encode())
            digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def loaded_from(model) -> str:
    """Where a model of ``load_vae`` / ``load_text_encoder`` / ``model_from_file`` came from, for the log."""
    return getattr(model, "loaded_from", "") or "built here"


# ---------------------------------------------------------------------------------------------
# Single files: the models of a .safetensors / .ckpt in the original layout (sd.original_layout)
# ---------------------------------------------------------------------------------------------


def open_file(path: str | Path, use_ema: bool = True) -> sd.original_layout.OriginalFile:
    """A single file's names and shapes (its tensors are read per model); an unreadable one is a LoadError.
    The config, the run's build and each model's loader ask for the same file: it is opened once while it stays
    the same file (its size, time and inode), which spares a ``.ckpt`` its pickle read each time."""
    try:
        stat = Path(path).stat()
        return _opened(str(path), stat.st_size, stat.st_mtime_ns, stat.st_ino, use_ema)
    except (OSError, ValueError) as error:
        raise LoadError(sd.cli.first_line(error)) from error


@functools.lru_cache(maxsize=2)
def _opened(path: str, size: int, mtime_ns: int, inode: int, use_ema: bool) -> sd.original_layout.OriginalFile:
    return sd.original_layout.OriginalFile(path, use_ema)


def empty_model(part: str, config: dict):
    """A ``part`` (``unet``, ``vae``, ``text_encoder``) of ``config`` on the meta device: its tensors' names and
    shapes without memory or random initialisation."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    with torch.device("meta"):
        if part == "unet":
            return UNet2DConditionModel(**config)
        return AutoencoderKL(**config) if part == "vae" else CLIPTextModel(CLIPTextConfig(**config))


def key_map(part: str, model) -> dict[str, str]:
    """``model``'s key map to the original layout (``sd.original_layout``)."""
    maps = {"unet": sd.original_layout.unet_key_map, "vae": sd.original_layout.vae_key_map,
            "text_encoder": sd.original_layout.text_key_map}
    return maps[part](model)


def file_preset(file: sd.original_layout.OriginalFile, part: str) -> str | None:
    """The name in ``FILE_CONFIGS[part]`` whose architecture the file's ``part`` has, by its tensors' names and
    shapes; None when no known one fits."""
    for name, config in FILE_CONFIGS[part].items():
        model = empty_model(part, config)
        if file.fits(model, key_map(part, model)):
            return name
    return None


def model_from_file(source, part: str, *, use_ema: bool = True, preset: str | None = None):
    """The ``part`` of a single file (a path or an ``OriginalFile``), of the architecture its tensors have
    (or ``preset``'s), built without random initialisation; ``loaded_from`` names the file and what was
    taken. A file without that model, or of no known architecture, is a LoadError saying so."""
    file = source if isinstance(source, sd.original_layout.OriginalFile) else open_file(source, use_ema)
    what = sd.original_layout.PART_NAMES[part]
    if part not in file.parts:
        holds = " and ".join(sd.original_layout.PART_NAMES[p] for p in file.parts) or "no SD 1.x model"
        raise LoadError(f"{what} {file.path}: the file holds {holds}, no {what}; name the {what} to use "
                        f"({'vae' if part == 'vae' else 'text_encoder' if part == 'text_encoder' else 'init_from'})")
    preset = preset or file_preset(file, part)
    if preset is None:
        raise LoadError(f"{what} {file.path}: its tensors fit no {what} known here ({', '.join(FILE_CONFIGS[part])}); "
                        "an SD 2.x or SDXL file is not an SD 1.x model")
    model = empty_model(part, FILE_CONFIGS[part][preset])
    try:
        state = file.state_for(model, key_map(part, model), what)
    except (OSError, ValueError) as error:
        raise LoadError(sd.cli.first_line(error)) from error
    model.load_state_dict(state, assign=True, strict=False)
    _materialise_buffers(model)
    model.loaded_from = file.describe(part)
    return model


def _materialise_buffers(model) -> None:
    """Buffers no state dict holds (CLIP's ``position_ids``) left on the meta device: built as the model
    builds them; any other is an error (a model of this kind changed)."""
    for module_name, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is None or not buffer.is_meta:
                continue
            if name != "position_ids":
                raise RuntimeError(f"{type(model).__name__}: {module_name}.{name} has no value in a state dict")
            module._buffers[name] = torch.arange(buffer.shape[-1]).expand(buffer.shape).clone()


class TokenizerError(LoadError):
    """A tokenizer that could not be loaded, in one line naming it and the ways to fix it."""


# Below this many tokens a "tokenizer" is the empty shell transformers builds when it finds no
# vocabulary (offline, a wrong folder): every caption would become [BOS, UNK, UNK, ...].
MIN_VOCABULARY = 1000


def load_tokenizer(name_or_path: str = DEFAULT_TEXT_ENCODER, *, subfolder: str | None = None):
    """The CLIP tokenizer (77 tokens). ``"tiny"`` is the real CLIP BPE built offline (see below), and so is a
    single file's (which holds none: SD 1.x's is CLIP ViT-L/14's).
    One that cannot be loaded, or comes back without a vocabulary, is a TokenizerError."""
    from transformers import CLIPTokenizer

    requested = name_or_path
    if name_or_path == "tiny" or Path(name_or_path).is_file():  # a single file's: SD 1.x's CLIP vocabulary
        name_or_path, subfolder = str(sd.tokenizer.clip_tokenizer_folder()), None
    subfolder = subfolder or _local_subfolder(name_or_path, "tokenizer")
    kwargs = {"subfolder": subfolder} if subfolder else {}
    fix = ("use --tokenizer tiny (the CLIP vocabulary, built offline), a local folder with vocab.json and "
           "merges.txt, or a hub id with the hub reachable (HF_HUB_OFFLINE unset)")
    options = hub_options(name_or_path)
    if options:
        fix = f"the hub cannot be reached and it is not in the local cache; {fix}"
    try:
        tokenizer = CLIPTokenizer.from_pretrained(name_or_path, model_max_length=TOKENIZER_MAX_LENGTH, **kwargs,
                                                  **options)
    except (OSError, ValueError) as error:
        raise TokenizerError(f"tokenizer {requested}: cannot be loaded ({sd.cli.first_line(error)}); {fix}") from error
    if len(tokenizer) < MIN_VOCABULARY:
        offline = " with HF_HUB_OFFLINE set" if os.environ.get("HF_HUB_OFFLINE") else ""
        raise TokenizerError(f"tokenizer {requested}: no vocabulary found ({len(tokenizer)} tokens{offline}); {fix}")
    return tokenizer


def tokenize(tokenizer, prompts: list[str]) -> torch.Tensor:
    """Token ids ``(B, 77)``, padded and truncated the way SD 1.x was trained. A token of several learned
    vectors is written out as all of them (``sd.embedding.tokens.expand``)."""
    return tokenizer(
        sd.embedding.tokens.expand(tokenizer, prompts),
        padding="max_length",
        max_length=TOKENIZER_MAX_LENGTH,
        truncation=True,
        return_tensors="pt",
    ).input_ids


# CLIP skip: the UNet's text condition is the hidden state ``clip_skip`` layers from the end, through the final
# layer norm (1: the last layer's, ``last_hidden_state``). AUTOMATIC1111 ("Clip skip", sd_hijack_clip.py),
# sd-scripts (``--clip_skip``, train_util.get_hidden_states) and ComfyUI (CLIPSetLastLayer -n, its SD 1.x CLIP
# normalising the hidden layer) compute the same; the anime family of SD 1.x models is trained at 2.
CLIP_SKIP_ATTRIBUTE = "clip_skip"


def set_clip_skip(text_encoder, clip_skip: int):
    """Make ``text_condition`` read ``text_encoder``'s hidden state ``clip_skip`` layers from the end, for every
    user of this encoder (training, its text cache, validation, sampling). Returns the encoder."""
    layers = text_encoder.config.num_hidden_layers
    if isinstance(clip_skip, bool) or not isinstance(clip_skip, int) or not 1 <= clip_skip <= layers:
        raise ValueError(f"clip_skip {clip_skip!r}: a whole number from 1 (the last layer) to {layers} (this text "
                         "encoder's layers)")
    setattr(text_encoder, CLIP_SKIP_ATTRIBUTE, clip_skip)
    return text_encoder


def clip_skip_of(text_encoder) -> int:
    return getattr(text_encoder, CLIP_SKIP_ATTRIBUTE, 1)


def text_condition(text_encoder, input_ids: torch.Tensor) -> torch.Tensor:
    """The UNet's context for token ids ``(B, 77)``: ``(B, 77, hidden)``, at the encoder's CLIP skip."""
    clip_skip = clip_skip_of(text_encoder)
    device = next(text_encoder.parameters()).device
    input_ids = input_ids.to(device, non_blocking=True)
    if clip_skip == 1:
        return text_encoder(input_ids).last_hidden_state
    hidden = text_encoder(input_ids, output_hidden_states=True).hidden_states[-clip_skip]
    return getattr(text_encoder, "text_model", text_encoder).final_layer_norm(hidden)  # transformers 4 nests it


@torch.no_grad()
def encode_prompt_ids(text_encoder, input_ids: torch.Tensor) -> torch.Tensor:
    """``text_condition`` without gradients."""
    return text_condition(text_encoder, input_ids)


# ---------------------------------------------------------------------------------------------
# Noise schedule, latent scaling, targets and the loss
# ---------------------------------------------------------------------------------------------


def ddpm_alphas_cumprod(num_timesteps: int = NUM_TRAIN_TIMESTEPS, zero_terminal_snr: bool = False) -> torch.Tensor:
    """alpha-bar_t of the SD 1.x schedule: "scaled_linear" betas 0.00085 -> 0.012, float64 ``(T,)``.

    ``zero_terminal_snr``: rescaled so the last timestep is pure noise (Lin et al. 2023,
    arXiv:2305.08891, Algorithm 1): sqrt(alpha-bar) is shifted so its last value is 0 and scaled so
    its first keeps its value. The SD schedule otherwise ends at alpha-bar 0.0047, so the model never
    sees pure noise in training yet starts from it in sampling (images stuck near mid-grey). The last
    value is stored as exactly 0, as diffusers' DDPM and DDIM schedulers store it; every consumer here
    handles it: ``add_noise`` and the v target are finite, the Min-SNR weight of v-prediction there is
    min(0, gamma) / (0 + 1) = 0, and DDIM with v-prediction steps from it (epsilon cannot: x0 =
    (x - eps) / 0, which is why the config and the sampler refuse that pairing).
    """
    betas = torch.linspace(BETA_START**0.5, BETA_END**0.5, num_timesteps, dtype=torch.float64) ** 2
    alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
    if not zero_terminal_snr:
        return alphas_cumprod
    root = alphas_cumprod.sqrt()  # tensor ops only, no .item(): sd.train.memory builds the step on fake tensors
    return ((root - root[-1]) * (root[0] / (root[0] - root[-1]))) ** 2


def schedule_conflict(prediction_type: str, zero_terminal_snr: bool) -> str | None:
    """Why a model cannot use this schedule, or None. The zero-terminal-SNR schedule (Lin et al. 2023)
    ends at pure noise, where only a v_prediction (or sample) target still names an image: an epsilon
    prediction there is the noise itself."""
    if zero_terminal_snr and prediction_type != "v_prediction":
        return (f"a zero-terminal-SNR schedule starts from pure noise, where a {prediction_type} prediction "
                "gives no image")
    return None


def noise_schedule_config(prediction_type: str = "epsilon", zero_terminal_snr: bool = False) -> dict:
    """The SD 1.x schedule as a diffusers scheduler config (what a pipeline's scheduler/ folder holds).

    ``zero_terminal_snr`` adds diffusers' own switch for the rescaled schedule and "trailing" timestep
    spacing, so that sampling starts at the last timestep (pure noise) as the model was trained
    (Lin et al. 2023, sections 3.1 and 3.3). Nothing else needs changing: DDIM keeps SD's final
    alpha-bar (``set_alpha_to_one=False``, as our DDIM), and Euler and DPM-Solver++ end at sigma 0
    (their default ``final_sigmas_type="zero"``) and replace the terminal alpha-bar 0 by 2**-24 themselves
    so their first sigma is finite.
    """
    config = dict(
        num_train_timesteps=NUM_TRAIN_TIMESTEPS,
        beta_start=BETA_START,
        beta_end=BETA_END,
        beta_schedule="scaled_linear",
        prediction_type=prediction_type,
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
        timestep_spacing="leading",
    )
    if zero_terminal_snr:
        config.update(rescale_betas_zero_snr=True, timestep_spacing="trailing")
    return config


def build_noise_scheduler(prediction_type: str = "epsilon", scheduler_class=None, zero_terminal_snr: bool = False):
    """A diffusers scheduler on the training schedule (``DDPMScheduler`` unless another class is given)."""
    if scheduler_class is None:
        from diffusers import DDPMScheduler as scheduler_class
    # from_config drops the keys a scheduler class does not take (DDPM has no set_alpha_to_one).
    return scheduler_class.from_config(noise_schedule_config(prediction_type, zero_terminal_snr))


def scale_latents(latents: torch.Tensor, scaling_factor: float = SD1_SCALING_FACTOR) -> torch.Tensor:
    """VAE posterior mean -> the unit-variance space the UNet is trained in."""
    return latents * scaling_factor


def unscale_latents(latents: torch.Tensor, scaling_factor: float = SD1_SCALING_FACTOR) -> torch.Tensor:
    return latents / scaling_factor


def _per_sample(values: torch.Tensor, timesteps: torch.Tensor, ndim: int) -> torch.Tensor:
    """Gather ``values[timesteps]`` as float32 shaped ``(B, 1, 1, 1)`` for broadcasting."""
    out = values.to(timesteps.device)[timesteps].float()
    return out.reshape(-1, *([1] * (ndim - 1)))


def sample_timesteps(batch_size: int, generator: torch.Generator, num_timesteps: int = NUM_TRAIN_TIMESTEPS):
    """Uniform integer timesteps ``(B,)`` drawn from the dedicated diffusion generator."""
    return torch.randint(0, num_timesteps, (batch_size,), generator=generator, device=generator.device)


def add_noise(latents, noise, timesteps, alphas_cumprod):
    """Forward diffusion q(x_t | x_0): ``sqrt(a) * x0 + sqrt(1 - a) * eps``."""
    a = _per_sample(alphas_cumprod, timesteps, latents.ndim)
    return a.sqrt() * latents.float() + (1 - a).sqrt() * noise.float()


def prediction_target(latents, noise, timesteps, alphas_cumprod, prediction_type: str):
    """What the UNet learns to predict: the noise, or v = sqrt(a) * eps - sqrt(1 - a) * x0."""
    if prediction_type == "epsilon":
        return noise.float()
    if prediction_type == "v_prediction":
        a = _per_sample(alphas_cumprod, timesteps, latents.ndim)
        return a.sqrt() * noise.float() - (1 - a).sqrt() * latents.float()
    raise ValueError(f"prediction_type must be 'epsilon' or 'v_prediction', got {prediction_type!r}")


def predicted_x0(sample, model_output, timesteps, alphas_cumprod, prediction_type: str) -> torch.Tensor:
    """The clean latents a prediction implies at ``sample`` = x_t, float32 (``prediction_target``'s inverse).

    ``timesteps``: ``(B,)``, one per sample. epsilon: ``(x_t - sqrt(1 - a) * eps) / sqrt(a)``, undefined
    where a = 0 (the zero-terminal-SNR schedule's last timestep); v: ``sqrt(a) * x_t - sqrt(1 - a) * v``.
    Never clamped (see ``sd.sampling.ddim_step``).
    """
    a = _per_sample(alphas_cumprod, timesteps, sample.ndim)
    x_t, out = sample.float(), model_output.float()
    if prediction_type == "epsilon":
        return (x_t - (1 - a).sqrt() * out) / a.sqrt()
    if prediction_type == "v_prediction":
        return a.sqrt() * x_t - (1 - a).sqrt() * out
    raise ValueError(f"prediction_type must be 'epsilon' or 'v_prediction', got {prediction_type!r}")


def predicted_noise(sample, model_output, timesteps, alphas_cumprod, prediction_type: str) -> torch.Tensor:
    """The noise a prediction implies at ``sample`` = x_t, float32: epsilon is the output itself; from v,
    ``sqrt(a) * v + sqrt(1 - a) * x_t``."""
    if prediction_type == "epsilon":
        return model_output.float()
    if prediction_type == "v_prediction":
        a = _per_sample(alphas_cumprod, timesteps, sample.ndim)
        return a.sqrt() * model_output.float() + (1 - a).sqrt() * sample.float()
    raise ValueError(f"prediction_type must be 'epsilon' or 'v_prediction', got {prediction_type!r}")


def snr(timesteps: torch.Tensor, alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """Signal-to-noise ratio a / (1 - a) at each timestep, float64 ``(B,)``."""
    a = alphas_cumprod.to(timesteps.device)[timesteps]
    return a / (1 - a)


def min_snr_weights(timesteps, alphas_cumprod, prediction_type: str, gamma: float | None) -> torch.Tensor:
    """Per-sample loss weights of Min-SNR-gamma (Hang et al. 2023, arXiv:2303.09556), float32 ``(B,)``.

    The paper's weight is min(SNR, gamma) on the x0-MSE. Predicting epsilon, the MSE already carries
    a factor SNR relative to x0-MSE, so the weight is min(SNR, gamma) / SNR. Predicting v, the MSE
    carries SNR + 1, so the weight is min(SNR, gamma) / (SNR + 1); dividing by SNR there (a bug
    several trainers shipped) over-weights the noisiest timesteps. ``gamma`` None or 0 disables it.

    At SNR 0 (the last timestep of a zero-terminal-SNR schedule) the v weight is 0, the formula's own
    value, and the epsilon weight its limit 1 rather than 0 / 0.
    """
    if not gamma:
        return torch.ones(timesteps.shape, dtype=torch.float32, device=timesteps.device)
    s = snr(timesteps, alphas_cumprod)
    clipped = torch.clamp(s, max=gamma)
    if prediction_type == "epsilon":
        weights = torch.where(s > 0, clipped / s, torch.ones_like(s))
    elif prediction_type == "v_prediction":
        weights = clipped / (s + 1)
    else:
        raise ValueError(f"prediction_type must be 'epsilon' or 'v_prediction', got {prediction_type!r}")
    return weights.float()


LOSS_TYPES = ("l2", "l1", "huber", "smooth_l1")
HUBER_SCHEDULES = ("snr", "exponential", "constant")


def huber_thresholds(timesteps, alphas_cumprod, schedule: str = "snr", c: float = 0.1, scale: float = 1.0):
    """Per-sample ``c`` of the pseudo-Huber losses, float32 ``(B,)``, as kohya's sd-scripts schedules it
    (``--huber_schedule``; Khrapov & Popov 2024, arXiv:2403.16728): ``constant``, c x scale; ``exponential``,
    from scale at t = 0 down to c x scale at t = 1000; ``snr``, (1 - c) / (1 + sigma_t)^2 + c with
    sigma_t = sqrt((1 - abar_t) / abar_t): near 1 (about L2) at low noise, c at high noise (its ``scale``
    is not applied, as in sd-scripts)."""
    t = timesteps.to(torch.float32)
    if schedule == "constant":
        return torch.full(t.shape, c * scale, dtype=torch.float32, device=t.device)
    if schedule == "exponential":
        return torch.exp(t * (math.log(c) / NUM_TRAIN_TIMESTEPS)) * scale
    if schedule == "snr":
        abar = alphas_cumprod.to(t.device, torch.float32)[timesteps]
        sigmas = ((1 - abar) / abar).sqrt()
        return (1 - c) / (1 + sigmas) ** 2 + c
    raise ValueError(f"huber_schedule must be one of {', '.join(HUBER_SCHEDULES)}, got {schedule!r}")


def elementwise_loss(model_pred: torch.Tensor, target: torch.Tensor, loss_type: str = "l2",
                     huber_c: torch.Tensor | None = None) -> torch.Tensor:
    """The loss of each element in float32: ``l2`` squared error, ``l1`` absolute error, and with the
    per-sample ``huber_c`` ``(B,)`` the pseudo-Huber ``huber`` 2c (sqrt(e^2 + c^2) - c) (about e^2 for small
    errors, 2c|e| for large) and ``smooth_l1`` 2 (sqrt(e^2 + c^2) - c), kohya's sd-scripts' forms."""
    error = model_pred.float() - target.float()
    if loss_type == "l2":
        return error.square()
    if loss_type == "l1":
        return error.abs()
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    c = huber_c.to(error.device, torch.float32).view(-1, *([1] * (error.ndim - 1)))
    smooth = 2 * ((error.square() + c.square()).sqrt() - c)
    return smooth * c if loss_type == "huber" else smooth


def debiased_weights(timesteps, alphas_cumprod, prediction_type: str) -> torch.Tensor:
    """Per-sample weights of debiased estimation (Yu et al. 2024, arXiv:2310.08442), float32 ``(B,)``, as
    kohya's sd-scripts applies them: 1 / sqrt(SNR) predicting epsilon, 1 / (SNR + 1) predicting v, with the
    SNR capped at 1000 (it is infinite at t = 0 of some schedules)."""
    s = torch.clamp(snr(timesteps, alphas_cumprod), max=1000.0)
    weights = 1 / (s + 1) if prediction_type == "v_prediction" else s.rsqrt()
    return weights.float()


def diffusion_loss(
    model_pred: torch.Tensor,
    target: torch.Tensor,
    timesteps: torch.Tensor,
    alphas_cumprod: torch.Tensor,
    prediction_type: str = "epsilon",
    min_snr_gamma: float | None = 5.0,
    mask: torch.Tensor | None = None,
    loss_type: str = "l2",
    huber_c: torch.Tensor | None = None,
    debiased: bool = False,
) -> torch.Tensor:
    """Per-sample Min-SNR-weighted loss (``elementwise_loss``: MSE by default) in float32, shape ``(B,)``;
    the trainer takes the mean. ``debiased``: also weighted by ``debiased_weights``.

    ``mask`` ``(B, 1, h, w)``, weights in 0..1 (``masked_loss``): each element's loss is multiplied by
    its position's weight before the per-sample mean, as kohya's sd-scripts ``--masked_loss`` does. A
    masked-out region teaches nothing, and a sample counts in proportion to the weight it keeps (the
    mean is over every element, not over the mask's sum, so a small kept region is not amplified).
    """
    loss = elementwise_loss(model_pred, target, loss_type, huber_c)
    if mask is not None:
        loss = loss * mask.to(device=loss.device, dtype=torch.float32)
    loss = loss.mean(dim=tuple(range(1, loss.ndim)))
    loss = loss * min_snr_weights(timesteps, alphas_cumprod, prediction_type, min_snr_gamma)
    return loss * debiased_weights(timesteps, alphas_cumprod, prediction_type) if debiased else loss


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _seeded(seed: int | None):
    """Seed the CPU RNG for the body only, leaving the caller's RNG stream untouched."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield

"""A ControlNet beside a frozen UNet: building one from the UNet (diffusers' ``ControlNetModel.from_unet``:
a copy of its encoder, zero convolutions out), the two as one module the trainer and the samplers call
like a UNet, control images as tensors, and loading a trained ControlNet from a run of ours or a file.

A ControlNet (Zhang et al. 2023, "Adding Conditional Control to Text-to-Image Diffusion Models") sees the
noisy latents, the prompt and a conditioning image (edges, a mask, depth) and adds one residual to each of
the UNet's skip connections and its middle block; its output convolutions start at zero, so a new one
leaves the base model's predictions exactly as they were.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch

import sd.controlnet.formats
import sd.data.shards
import sd.files
import sd.formats
import sd.lora.adapters
import sd.run_folder

CONTROLNET_FILE = "controlnet.safetensors"  # a ControlNet run's checkpoint: the ControlNet's weights
EMA_PREFIX = "controlnet."  # its EMA's names in ema.safetensors (the EMA averages ControlledUNet's trainable part)


class ControlledUNet(torch.nn.Module):
    """The UNet and a ControlNet as one module with a UNet's call: ``model(sample, timestep,
    encoder_hidden_states=..., controlnet_cond=...)``; ``.sample`` of the result is the UNet's prediction.

    ``controlnet_cond``: ``(B', 3, H, W)`` in [0, 1] at the image's pixel size; a batch B that is a multiple of
    B' repeats it (a CFG batch of ``[uncond; cond]`` conditions both halves on the same image, as diffusers'
    pipeline does). Without ``controlnet_cond`` the image and scale bound by ``controlling`` are used, so the
    samplers, which call a UNet, need no change.
    """

    def __init__(self, unet, controlnet):
        super().__init__()
        self.unet = unet
        self.controlnet = controlnet
        self._bound: tuple[torch.Tensor, float] | None = None

    @property
    def config(self):
        return self.unet.config

    @contextlib.contextmanager
    def controlling(self, control: torch.Tensor, scale: float = 1.0):
        """Calls without ``controlnet_cond`` inside the body use ``control`` at ``scale``."""
        previous, self._bound = self._bound, (control, scale)
        try:
            yield self
        finally:
            self._bound = previous

    def forward(self, sample, timestep, encoder_hidden_states, controlnet_cond=None, conditioning_scale=None):
        if controlnet_cond is None:
            if self._bound is None:
                raise ValueError("a ControlNet needs a control image: pass controlnet_cond, or call inside controlling()")
            controlnet_cond, bound_scale = self._bound
            conditioning_scale = bound_scale if conditioning_scale is None else conditioning_scale
        if sample.shape[0] != controlnet_cond.shape[0]:
            if sample.shape[0] % controlnet_cond.shape[0]:
                raise ValueError(f"{controlnet_cond.shape[0]} control images for a batch of {sample.shape[0]}")
            controlnet_cond = controlnet_cond.repeat(sample.shape[0] // controlnet_cond.shape[0], 1, 1, 1)
        down, middle = self.controlnet(sample, timestep, encoder_hidden_states=encoder_hidden_states,
                                       controlnet_cond=controlnet_cond.to(sample.device, self.controlnet.dtype),
                                       conditioning_scale=1.0 if conditioning_scale is None else conditioning_scale,
                                       return_dict=False)
        return self.unet(sample, timestep, encoder_hidden_states=encoder_hidden_states,
                         down_block_additional_residuals=down, mid_block_additional_residual=middle)


def new_controlnet(unet, seed: int = 0):
    """A ControlNet for ``unet``'s architecture and weights: its encoder copied, the conditioning image's
    embedding drawn from ``seed`` (the global RNG is left as it was), the output convolutions zero."""
    from diffusers import ControlNetModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        controlnet = ControlNetModel.from_unet(unet, conditioning_channels=3)
    return controlnet.to(unet.device)


def attach(config, unet) -> ControlledUNet:
    """A training config's ControlNet on ``unet``, which is frozen (the ControlNet alone trains): new
    (``new_controlnet``) or ``controlnet_from``'s, with gradient checkpointing when the config asks for it.
    With bf16 or fp16 the frozen UNet's weights are stored in that type (autocast computes in it anyway)."""
    controlnet = (load(config.controlnet.init_from, unet, use_ema=True) if config.controlnet.init_from
                  else new_controlnet(unet, config.seed)).to(unet.device)
    if config.grad_checkpointing:
        controlnet.enable_gradient_checkpointing()
    unet.requires_grad_(False)
    controlnet.requires_grad_(True).train()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.precision)
    if dtype is not None:
        sd.lora.adapters.cast_base(unet, dtype)
    return ControlledUNet(unet, controlnet)


def control_batch(control: torch.Tensor, device: torch.device, dropout: float = 0.0,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """A batch's stored control images ``(B, 3, H, W)`` uint8 as the ControlNet's input: float in [0, 1]
    on ``device``; with ``dropout``, each sample's image is blank (zeros) with that probability."""
    pixels = control.to(device, non_blocking=True).float() / 255.0
    if dropout > 0:
        keep = torch.rand(pixels.shape[0], generator=generator, device=generator.device) >= dropout
        pixels = pixels * keep.to(device, pixels.dtype)[:, None, None, None]
    return pixels


MAX_CONTROL_BYTES = 256 << 20  # a conditioning image file larger than this is refused before it is read


def read_control_image(path: str | Path, width: int | None = None, height: int | None = None) -> torch.Tensor:
    """A conditioning image file as ``(1, 3, H, W)`` float in [0, 1]: grey or RGBA made RGB, resized to
    ``width`` x ``height`` when given and different (Lanczos, as diffusers' image processor does). It is
    decoded as the data stages decode images (``sd.data.shards.decode_image``): a truncated or undecodable
    file, or one declaring more than ``DEFAULT_MAX_PIXELS``, is a ValueError naming it."""
    from PIL import Image

    path = Path(path)
    try:
        rgb = sd.data.shards.decode_image(sd.files.read_file_bounded(path, MAX_CONTROL_BYTES), path.suffix.lstrip("."))
    except (OSError, sd.data.shards.ImageSkip) as error:
        raise ValueError(f"control image {path}: {error}") from error
    if width and height and (rgb.shape[1], rgb.shape[0]) != (width, height):
        rgb = np.asarray(Image.fromarray(rgb).resize((width, height), Image.Resampling.LANCZOS))
    return torch.from_numpy(rgb.astype(np.float32) / 255.0).permute(2, 0, 1)[None]


# ---------------------------------------------------------------------------------------------
# Loading a trained ControlNet
# ---------------------------------------------------------------------------------------------


def is_controlnet_run(source: str) -> bool:
    """Whether ``source`` is a ControlNet run or checkpoint of ours (its config sets ``control``)."""
    path = Path(source)
    if not path.is_dir() or (path / "config.json").is_file():  # a file, or a diffusers model folder
        return False
    config = sd.formats.run_config(source)
    return bool(config and config.get("control"))


def run_base(source: str) -> str:
    """The base model (``init_from``) a ControlNet run of ours was trained on."""
    config = sd.formats.run_config(source) or {}
    if not config.get("init_from"):
        raise ValueError(f"{source}: a ControlNet run that names no init_from, the base it was trained on")
    return str(config["init_from"])


def load(source: str, unet, *, use_ema: bool = True):
    """A trained ControlNet for ``unet``'s architecture: from a ControlNet run or checkpoint of ours (its EMA
    unless ``use_ema=False`` or it has none), or any file ``sd.controlnet.formats.load_controlnet`` reads (a
    diffusers folder, a single file in the diffusers or the original layout)."""
    if not is_controlnet_run(source):
        return sd.controlnet.formats.load_controlnet(source, unet_config=dict(unet.config))
    folder = sd.run_folder.resolve_checkpoint(Path(source))
    controlnet = new_controlnet(unet).to("cpu")
    path = sd.formats.verified(folder / CONTROLNET_FILE)
    state = sd.files.read_weights(path)
    ema_path = folder / "ema.safetensors"
    if use_ema and ema_path.exists():
        path = sd.formats.verified(ema_path)
        state = {name[len(EMA_PREFIX):]: tensor for name, tensor in sd.files.read_weights(path).items()
                 if name.startswith(EMA_PREFIX)}
    sd.formats.load_into(controlnet, state, path)
    return controlnet

"""A ControlNet run as a training mode (``control``): a ControlNet beside init_from's frozen UNet, fed a
conditioning image per sample; the ControlNet alone trains and is saved (``controlnet``, diffusers' names)."""

from __future__ import annotations

from dataclasses import dataclass

import dataclasses
import logging
import re
from pathlib import Path

import torch

import sd.cli
import sd.controlnet.model
import sd.training_mode
from sd.cli import ConfigError
from sd.settings import setting, refused, OnResume, FREE, FRACTION, MATH

log = logging.getLogger("sd_train")


@dataclass(frozen=True)
class ControlNetConfig:
    """A ControlNet beside init_from's frozen UNet, steered by conditioning images."""

    control: str = setting("ControlNet: the name of the conditioning images it learns from (canny, seg, ...: the "
                           "latent folders' files from encode_latents.py --control NAME); init_from, the base, stays "
                           "frozen and the ControlNet alone trains; empty = no ControlNet", "", resume=refused(MATH))
    dropout: float = setting("ControlNet: probability that a sample's conditioning image is blank (all zeros) "
                             "in a step", 0.0, allowed=FRACTION, resume=refused(MATH))
    init_from: str = setting("ControlNet: train on from this ControlNet (a ControlNet run of ours, a diffusers "
                             "folder or a single file); empty = a new one, a copy of the base UNet's encoder with "
                             "zero convolutions out", "",
                             resume=OnResume(FREE, "a resume loads its checkpoint's ControlNet"))
    validation_images: list = setting("ControlNet: the sample grid's conditioning images, one file per validation "
                                      "prompt", default_factory=list)


class ControlNet(sd.training_mode.Mode):
    what = "ControlNet"
    frozen_base = True
    whole_unet = False
    unet_blocks_train = False  # the ControlNet's blocks train; the UNet's stay frozen
    batch_inputs = ("control",)  # (B, 3, H, W) uint8 at the image's size, after the loss mask
    missing_inputs = "a control image per sample (latents encoded without encode_latents.py --control?)"
    prompt_inputs = True  # a control image per validation prompt

    @classmethod
    def wanted(cls, config) -> bool:
        return bool(config.controlnet.control)

    @classmethod
    def check(cls, config, check_paths: bool = True) -> None:
        """A ControlNet run's settings, and the modes it cannot be combined with."""
        if not config.controlnet.control:
            for name in ("init_from", "validation_images", "dropout"):
                if getattr(config.controlnet, name):
                    name = f"controlnet.{name}"
                    raise ConfigError(f"{name} belongs to a ControlNet run: set controlnet.control (the conditioning "
                                      f"images' name) too, or unset {name}")
            return
        if not re.fullmatch(r"[a-z0-9_]+", config.controlnet.control) or config.controlnet.control == "mask":
            raise ConfigError("controlnet.control: the conditioning images' name (lower-case letters, digits, _; "
                              f"not 'mask', the loss masks), got {config.controlnet.control!r}")
        if check_paths and not config.init_from:
            raise ConfigError("controlnet.control: a ControlNet conditions a trained model: set init_from (the "
                              "base: a run of ours, a diffusers folder or hub id, or a single file)")
        refused = {"lora.rank": (config.lora.rank, "a LoRA"),
                   "embedding.token": (config.embedding.token, "textual inversion"),
                   "distill.method": (config.distill.method, "distillation"),
                   "subject.instance_dir": (config.subject.instance_dir, "a DreamBooth folder"),
                   "lora.text_encoder": (config.lora.text_encoder, "a text-encoder adapter"),
                   "data.masked_loss": (config.data.masked_loss, "loss masks"),
                   "eval.every": (config.eval.every, "eval.every (FID of samples needs a control image per prompt: "
                                                     "score saved samples with SD_Eval.py)")}
        for name, (value, what) in refused.items():
            if value:
                raise ConfigError(f"controlnet.control: a ControlNet run does not train with {what}; unset {name}")
        if config.sharding != "none":
            raise ConfigError("controlnet.control: a ControlNet run runs on DDP; set sharding: none (got "
                              f"{config.sharding})")
        if config.validate_every and config.validation_prompts and \
                len(config.controlnet.validation_images) != len(config.validation_prompts):
            raise ConfigError("controlnet.validation_images: one conditioning image per validation prompt "
                              f"({len(config.validation_prompts)} prompts, "
                              f"{len(config.controlnet.validation_images)} images); or set validation_prompts: [] "
                              "for no sample grid")
        drawn = config.validate_every and config.validation_prompts  # the grid is drawn, on these images
        for path in config.controlnet.validation_images if check_paths and drawn else ():
            if not isinstance(path, str) or not Path(path).is_file():
                raise ConfigError(f"controlnet.validation_images: {path} is no file (give one conditioning image per "
                                  "validation prompt, or validate_every: 0 for no sample grid)")

    def attach(self, unet, text_encoder) -> sd.controlnet.model.ControlledUNet:
        """The frozen base with a ControlNet, new or ``controlnet_from``'s."""
        config = self.config
        try:
            model = sd.controlnet.model.attach(config, unet)
        except (OSError, KeyError, ValueError) as error:  # the message names the file
            raise ConfigError(f"controlnet.init_from: cannot load {config.controlnet.init_from}: "
                              f"{sd.cli.first_line(error)}") from error
        log.info("ControlNet on %r conditioning images (%s): %d trainable parameters; the base UNet is frozen",
                 config.controlnet.control, f"from {config.controlnet.init_from}" if config.controlnet.init_from
                 else "new, zero convolutions out", sum(p.numel() for p in model.controlnet.parameters()))
        return model

    def estimate_attach(self, unet, text_encoder):
        """A new ControlNet: its architecture is all the estimate needs."""
        return sd.controlnet.model.attach(dataclasses.replace(self.config, controlnet_from=""), unet)

    def trained_weights(self, step) -> dict[str, object]:
        return {"controlnet": step.unet.controlnet}

    def model_inputs(self, inputs: dict, device: torch.device, generator: torch.Generator) -> dict:
        return {"controlnet_cond": sd.controlnet.model.control_batch(inputs["control"], device,
                                                                     self.config.controlnet.dropout, generator)}

    def estimate_inputs(self, images: int, resolution: int) -> tuple:
        return (torch.zeros(images, 3, resolution, resolution, dtype=torch.uint8),)

    def shown_inputs(self, inputs: dict) -> list:
        control = inputs["control"][0].permute(1, 2, 0)  # (H, W, 3) in [0, 1]
        return [(control * 255).round().clamp(0, 255).to(torch.uint8).numpy()]

    def sample_inputs(self, index: int, width: int, height: int) -> dict:
        image = self.config.controlnet.validation_images[index]
        return {"control": sd.controlnet.model.read_control_image(image, width, height)}

"""ControlNet in ``SD_ImageGen.py``: every sample conditioned on ``--control IMAGE`` through ``--controlnet`` (or a
ControlNet run given as ``--ckpt``, which samples on its base), and the ControlNet written alone
(``--export_controlnet``: the original layout, or diffusers')."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

import sd.controlnet.formats
import sd.controlnet.model
import sd.formats
import sd.run_folder
from sd.imagegen.headers import file_header
from sd.sampling import Pipeline

log = logging.getLogger("sd_imagegen")
FORMATS = ("original", "diffusers")


@dataclass(frozen=True)
class Settings:
    controlnet: str | None = None
    control: tuple[str, ...] = ()
    scale: float = 1.0
    export: str | None = None
    format: str = "original"


def add_flags(parser) -> None:
    parser.add_argument("--controlnet", metavar="PATH", help="condition the samples with this ControlNet: a ControlNet "
                        "run of ours, a diffusers ControlNet folder, or a single .safetensors (original or diffusers "
                        "layout)")
    parser.add_argument("--control", metavar="IMAGE", action="append", default=[],
                        help="the conditioning image (edges, a mask, ...) of every sample, with --controlnet; repeat "
                        "it once per prompt to give each prompt its own; the samples' size defaults to the first's")
    parser.add_argument("--control_scale", type=float, default=1.0, help="scale of the ControlNet's residuals "
                        "(default: %(default)s)")
    parser.add_argument("--export_controlnet", metavar="OUT", help="write the ControlNet (--controlnet, or --ckpt when "
                        "it is a ControlNet run): one file OUT, or with --controlnet_format diffusers a folder OUT")
    parser.add_argument("--controlnet_format", choices=FORMATS, default="original",
                        help="layout of --export_controlnet: original (control_model.* keys: ComfyUI, AUTOMATIC1111's "
                        "sd-webui-controlnet) or diffusers (a ControlNetModel folder) (default: %(default)s)")


def settings(args, error, prompts: int) -> Settings:
    for control in args.control:
        if not Path(control).is_file():
            error(f"--control {control} is no file")
    if len(args.control) > 1 and len(args.control) != prompts:
        error(f"{len(args.control)} --control images for {prompts} prompts: give one for all, or one per prompt in "
              "their order")
    if args.control_scale < 0 or not math.isfinite(args.control_scale):
        error("--control_scale must be a number >= 0")
    return Settings(args.controlnet, tuple(args.control), args.control_scale, args.export_controlnet,
                    args.controlnet_format)


def run_as_ckpt(settings: Settings, ckpt: str) -> tuple[Settings, str]:
    """A ControlNet run given as ``--ckpt`` samples on its base with itself as the ControlNet: the settings and the
    checkpoint to load."""
    if not sd.controlnet.model.is_controlnet_run(ckpt):
        return settings, ckpt
    if settings.controlnet:
        raise ValueError(f"{ckpt} is a ControlNet run, and --controlnet {settings.controlnet} another ControlNet: "
                         "give one of them")
    base = sd.controlnet.model.run_base(ckpt)
    log.info("%s is a ControlNet run: its base %s with it as the ControlNet", ckpt, base)
    return dataclasses.replace(settings, controlnet=ckpt), base


def check_base(settings: Settings, ckpt: str, model: Pipeline) -> None:
    """A ControlNet run of ours on the base it records (as loaded now, ``ckpt``) must be that base's weights."""
    controlnet = settings.controlnet
    if controlnet and sd.controlnet.model.is_controlnet_run(controlnet) and \
            sd.controlnet.model.run_base(controlnet) == ckpt:
        sd.formats.check_trained_base(sd.run_folder.resolve_checkpoint(Path(controlnet)), ckpt, model.unet,
                                      what="ControlNet")


def load(settings: Settings, model: Pipeline, use_ema: bool, sampling: bool, half: bool):
    """``--controlnet`` for the model's UNet (None without one), after ``--export_controlnet`` wrote it."""
    if not settings.controlnet:
        if settings.control or settings.export:
            raise ValueError(f"--{'control' if settings.control else 'export_controlnet'} needs a ControlNet: "
                             "--controlnet PATH, or a ControlNet run as --ckpt")
        return None
    if sampling and not settings.control:
        raise ValueError("a ControlNet conditions every sample on an image: give --control IMAGE")
    controlnet = sd.controlnet.model.load(settings.controlnet, model.unet, use_ema=use_ema)
    log.info("ControlNet %s", settings.controlnet)
    if settings.export:
        out = Path(settings.export)
        if settings.format == "diffusers":
            sd.controlnet.formats.save_diffusers(controlnet, out)
        else:
            out = out if out.suffix == ".safetensors" else out.with_name(out.name + ".safetensors")
            sd.controlnet.formats.save_single_file(controlnet, out, dtype=torch.float16 if half else torch.float32,
                                                   metadata=file_header("controlnet", out, model, settings.controlnet))
        log.info("wrote ControlNet %s (%s layout%s)", out, settings.format, ", fp16" if half else "")
    return controlnet


def control_size(settings: Settings) -> tuple[int, int]:
    """``(width, height)`` of the first ``--control`` image: the samples' size unless given; a ValueError unless it
    is a multiple of 8 on both sides."""
    _, _, height, width = sd.controlnet.model.read_control_image(settings.control[0]).shape
    if width % 8 or height % 8:
        raise ValueError(f"--control {settings.control[0]} is not a multiple of 8 pixels on each side: give --height "
                         "and --width (it is resized to them)")
    return width, height


def images(settings: Settings, prompts: int, width: int, height: int) -> list:
    """Each prompt's conditioning image at the samples' size; a file that does not decode is a ValueError naming
    it."""
    read = [sd.controlnet.model.read_control_image(path, width, height) for path in settings.control]
    return read * prompts if len(read) == 1 else read


def records(settings: Settings, prompts: int) -> list[dict]:
    """What each prompt's images record in ``images.json`` of their ControlNet and control image."""
    return [{"controlnet": settings.controlnet, "control": settings.control[p if len(settings.control) > 1 else 0],
             "control_scale": settings.scale} for p in range(prompts)]

"""Whole-model exports of ``SD_ImageGen.py``: a diffusers pipeline folder and a single file in the original SD
layout (fp16 with ``--half``), each saying what the model is (``Pipeline.file_metadata``). A learned token stays
out of them (``--export_embedding`` writes it): the vocabulary keeps the size other tools expect."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import sd.embedding.tokens
import sd.formats
from sd.imagegen.headers import file_header
from sd.sampling import Pipeline

log = logging.getLogger("sd_imagegen")


@dataclass(frozen=True)
class Settings:
    diffusers: str | None = None
    single_file: str | None = None
    half: bool = False

    @property
    def whole(self) -> bool:
        return bool(self.diffusers or self.single_file)


def add_flags(parser) -> None:
    parser.add_argument("--export_diffusers", metavar="DIR", help="write a diffusers StableDiffusionPipeline folder")
    parser.add_argument("--export_single_file", metavar="FILE", help="write one .safetensors in the original SD "
                        "layout")
    parser.add_bool("--half", help="fp16 weights in --export_single_file and --export_controlnet")


def settings(args, error) -> Settings:
    return Settings(args.export_diffusers, args.export_single_file, args.half)


def export(settings: Settings, model: Pipeline, source: str) -> None:
    if model.learned_tokens:
        log.info("the learned token is not part of the model's files: write it with --export_embedding")
    with sd.embedding.tokens.without_added(model.text_encoder):
        if settings.diffusers:
            sd.formats.export_diffusers(Path(settings.diffusers), model.unet, model.vae, model.text_encoder,
                                        model.tokenizer, model.prediction_type, model.zero_terminal_snr,
                                        model.flow_shift, model.distilled)
            log.info("wrote diffusers pipeline folder %s", settings.diffusers)
        if settings.single_file:
            metadata = {**file_header("checkpoint", settings.single_file, model, source), **model.file_metadata()}
            sd.formats.save_single_file(Path(settings.single_file), model.unet, model.vae, model.text_encoder,
                                        half=settings.half, metadata=metadata)
            log.info("wrote single file %s%s", settings.single_file, " (fp16)" if settings.half else "")

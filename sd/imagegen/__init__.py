"""``SD_ImageGen.py``'s work in pieces, each declaring the flags it reads (``add_flags``), checking them into its
part of the ``Request`` (``settings``), and doing its work: the model read (``model``), the samples drawn
(``sampling``), whole-model exports (``exports``), LoRA files and a run's adapter (``lora``), learned tokens
(``embedding``) and a ControlNet (``controlnet``). What a model is (its prediction, schedule, shift, trained
size, default sampler) its loader says (``sd.sampling.Pipeline``); nothing here derives it again.

Errors a user can fix are ``ValueError`` / ``OSError`` / ``KeyError`` naming the file or flag; those met while
the model is read come as ``CannotLoad``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from safetensors import SafetensorError

import sd.cli
import sd.controlnet.model
import sd.formats
from sd.imagegen import controlnet, embedding, exports, lora, model, sampling
from sd.imagegen.sampling import Interrupted

PIECES = (model, sampling, exports, lora, embedding, controlnet)  # in the order --help shows their flags
ERRORS = (KeyError, ValueError, OSError, SafetensorError)  # what a user can fix; the message names the file

__all__ = ["CannotLoad", "ERRORS", "Interrupted", "PIECES", "Request", "add_flags", "request_of", "run"]


@dataclass(frozen=True)
class Request:
    """What ``SD_ImageGen.py`` was asked, checked: each piece's settings."""

    model: model.Settings
    sampling: sampling.Settings
    exports: exports.Settings
    lora: lora.Settings
    embedding: embedding.Settings
    controlnet: controlnet.Settings

    @property
    def merging(self) -> bool:
        """Whether the base is used whole (sampled or exported), not just a run's adapter."""
        return bool(self.sampling.prompt or self.exports.whole)


class CannotLoad(Exception):
    """The model of ``--ckpt`` (or the base of a ControlNet run given as ``--ckpt``) could not be read."""


def add_flags(parser) -> None:
    for piece in PIECES:
        piece.add_flags(parser)


def request_of(args, error) -> Request:
    """The parsed flags checked into a ``Request``; ``error(message)`` refuses them (the parser's error)."""
    model_settings = model.settings(args, error)
    sampled = sampling.settings(args, error, model_settings.ckpt, model_settings.prediction_type)
    exported = exports.settings(args, error)
    request = Request(model_settings, sampled, exported, lora.settings(args, error, sampled.prompt or exported.whole),
                      embedding.settings(args, error, exported.whole),
                      controlnet.settings(args, error, len(sampled.prompt)))
    if not (request.sampling.prompt or exported.whole or request.lora.export or request.embedding.export
            or request.controlnet.export):
        error("give --prompt (or --prompts_file) to sample, or an --export_* flag")
    return request


def run(request: Request) -> None:
    """Read the model, write the exports asked for, then draw the samples (``sampling.Interrupted`` on Ctrl-C)."""
    ckpt = request.model.ckpt
    try:
        controls, ckpt = controlnet.run_as_ckpt(request.controlnet, ckpt)
        loaded = model.load(dataclasses.replace(request.model, ckpt=ckpt), request.merging)
        if not request.model.allow_other_base:
            controlnet.check_base(controls, ckpt, loaded)
        if request.sampling.prompt:
            sampling.checked(request.sampling, loaded, ckpt)
    except ERRORS as problem:
        hint = " (or --allow_other_base to use it on this base)" if isinstance(problem, sd.formats.BaseMismatch) else ""
        raise CannotLoad(f"cannot load {ckpt}: {sd.cli.first_line(problem)}{hint}") from problem
    if request.lora.export:
        lora.export(request.lora, loaded, ckpt)
    if request.embedding.export:
        embedding.export(request.embedding, loaded, ckpt)
    embedding.add(request.embedding, loaded)
    if request.merging:  # the plain, merged weights
        lora.merge(request.lora, loaded)
    net = controlnet.load(controls, loaded, not request.model.no_ema, bool(request.sampling.prompt),
                          request.exports.half)
    if request.exports.whole:
        exports.export(request.exports, loaded, ckpt)
    if not request.sampling.prompt:
        return
    prompts = len(request.sampling.prompt)
    if net is None:
        settings = sampling.sized(request.sampling, loaded)
        sampling.sample(settings, loaded, [None] * prompts, [{}] * prompts)
        return
    given = request.sampling.height is not None and request.sampling.width is not None
    settings = sampling.sized(request.sampling, loaded, None if given else controlnet.control_size(controls),
                              "the control image's size")
    images = controlnet.images(controls, prompts, settings.width, settings.height)
    loaded.unet = sd.controlnet.model.ControlledUNet(loaded.unet, net)
    sampling.sample(settings, loaded, images, controlnet.records(controls, prompts), controls.scale)

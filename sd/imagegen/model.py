"""The model ``SD_ImageGen.py`` samples or exports (``--ckpt``), and how it is read: which weights (EMA, live, a
post-hoc EMA of any length), the parts that override its own, and what it predicts when its records say
otherwise."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

import sd.cli
import sd.flow
import sd.formats
import sd.posthoc_ema
import sd.run_folder
from sd.sampling import Pipeline

log = logging.getLogger("sd_imagegen")


@dataclass(frozen=True)
class Settings:
    ckpt: str
    no_ema: bool = False
    ema_length: float | None = None
    arch: str = "auto"
    prediction_type: str = "auto"
    zero_terminal_snr: bool | None = None
    flow_shift: float | None = None
    vae: str | None = None
    text_encoder: str | None = None
    tokenizer: str | None = None
    allow_other_base: bool = False
    clip_skip: int | None = None  # None: what the model records


def add_flags(parser) -> None:
    parser.add_argument("--ckpt", required=True, help="our checkpoint or run folder, a diffusers folder or hub id, "
                        "or a single .safetensors/.ckpt file")
    parser.add_bool("--no_ema", help="use the live weights of our checkpoints, not the EMA")
    parser.add_argument("--ema_length", type=float, default=None, help="a run trained with posthoc_ema_every: the "
                        "UNet's EMA of this relative length (sigma_rel, e.g. 0.05; the kept ones are 0.05 and 0.10) "
                        "rebuilt from its snapshots, at the newest one up to the checkpoint's step")
    parser.add_bool("--best", help="--ckpt is a run folder trained with keep_best: use the checkpoint of its best "
                    "evaluation, which its best.json names")
    parser.add_argument("--arch", choices=("auto", *sorted(sd.formats.SINGLE_FILE_ARCHS)), default="auto",
                        help="architecture of a single-file --ckpt; auto = what its tensors' shapes say (default: "
                        "%(default)s)")
    parser.add_argument("--clip_skip", default="auto",
                        help="CLIP skip: condition on the text encoder's hidden state this many layers from the end "
                        "(2: as AUTOMATIC1111's 'Clip skip: 2', ComfyUI's CLIPSetLastLayer -2); auto = what the "
                        "model records (its training config, a single file's clip_skip or ss_clip_skip), else 1 "
                        "(default: %(default)s)")
    parser.add_argument("--prediction_type", choices=("auto", *sd.formats.PREDICTION_TYPES), default="auto",
                        help="what the UNet predicts; auto = what the checkpoint records (its training config, a "
                        "single file's metadata, a diffusers scheduler config), epsilon when it records nothing "
                        "(default: %(default)s)")
    parser.add_argument("--flow_shift", type=float, default=None, help="the flow samplers' time shift (above 1: more "
                        "steps at high noise); default: what the checkpoint records (its training config's flow_shift, "
                        "a single file's metadata, a diffusers FlowMatch scheduler's shift), else 1; in [0.1, 10] as "
                        "in training")
    parser.add_argument("--zero_terminal_snr", type=sd.cli.parse_auto_bool, default=None, metavar="auto|true|false",
                        help="sample on the zero-terminal-SNR schedule with trailing timesteps (needs v_prediction); "
                        "auto = what the checkpoint records (its training config, a single file's metadata, a "
                        "diffusers scheduler config's rescale_betas_zero_snr), false when it records nothing "
                        "(default: auto)")
    parser.add_argument("--vae", help="override the checkpoint's VAE (hub id, folder or tiny)")
    parser.add_argument("--text_encoder", help="override the checkpoint's text encoder (hub id, folder or tiny)")
    parser.add_argument("--tokenizer", help="override the checkpoint's tokenizer (hub id, folder or tiny)")
    parser.add_bool("--allow_other_base", help="apply a LoRA run's adapter, or a ControlNet run given as --ckpt, even "
                    "to a base that is not the one it was trained on (its init_from now holds other weights); refused "
                    "otherwise")


def settings(args, error) -> Settings:
    if args.ema_length is not None and not 0 < args.ema_length < 12 ** -0.5:
        error(f"--ema_length: a relative length in (0, 0.2887), got {args.ema_length}")
    if args.ema_length is not None and args.no_ema:
        error("--ema_length replaces the EMA by a rebuilt one; drop --no_ema")
    ckpt = args.ckpt
    if args.best:
        try:
            ckpt = str(sd.run_folder.best_checkpoint(args.ckpt))
        except FileNotFoundError as problem:
            error(f"--best: {problem}")
    if args.flow_shift is not None:
        try:
            sd.flow.check_shift(args.flow_shift, "--flow_shift")
        except ValueError as problem:
            error(str(problem))
    clip_skip = None if args.clip_skip == "auto" else args.clip_skip
    if clip_skip is not None:
        try:
            clip_skip = int(clip_skip)
        except ValueError:
            clip_skip = 0
        if clip_skip < 1:
            error(f"--clip_skip: auto or a whole number >= 1, got {args.clip_skip}")
    return Settings(ckpt, args.no_ema, args.ema_length, args.arch, args.prediction_type, args.zero_terminal_snr,
                    args.flow_shift, args.vae, args.text_encoder, args.tokenizer, args.allow_other_base, clip_skip)


def load(settings: Settings, merging: bool) -> Pipeline:
    """The model ``settings.ckpt`` names. Unless ``allow_other_base``, a LoRA run's base is checked against the
    base its adapter was trained on when the base is used whole (``merging``: sampled or exported whole)."""
    model = sd.formats.load_pipeline(settings.ckpt, use_ema=not settings.no_ema, vae=settings.vae,
                                     text_encoder=settings.text_encoder, tokenizer=settings.tokenizer,
                                     arch=settings.arch,
                                     prediction_type=None if settings.prediction_type == "auto"
                                     else settings.prediction_type,
                                     zero_terminal_snr=settings.zero_terminal_snr,
                                     check_base=merging and not settings.allow_other_base,
                                     flow_shift=settings.flow_shift, clip_skip=settings.clip_skip)
    log.info("loaded %s (%s)", model.source, model.describe())
    if settings.ema_length is not None:
        use_posthoc_ema(settings, model)
    return model


def use_posthoc_ema(settings: Settings, model: Pipeline) -> None:
    """``--ema_length``: the trained weights (the UNet's, and a text adapter's or learned token's) replaced by the
    EMA of that length rebuilt from the run's post-hoc EMA snapshots (``sd.posthoc_ema``), at the newest
    snapshot up to the checkpoint's step that can be read."""
    if sd.formats.run_config(settings.ckpt) is None:
        raise ValueError(f"--ema_length rebuilds an EMA from a run of ours; {settings.ckpt} is none")
    checkpoint = sd.run_folder.resolve_checkpoint(settings.ckpt)
    run_dir, at = checkpoint.parent.parent, sd.run_folder.checkpoint_step(checkpoint)
    steps = [s for s, _ in sd.posthoc_ema.snapshots(run_dir) if s <= at]
    if not steps:
        raise ValueError(f"--ema_length: {run_dir / sd.posthoc_ema.FOLDER} holds no snapshot up to step {at} "
                         "(train with posthoc_ema_every)")
    for step in reversed(steps):
        try:
            weights, step = sd.posthoc_ema.reconstruct(run_dir, settings.ema_length, step)
            break
        except sd.posthoc_ema.DamagedSnapshot as problem:
            log.warning("--ema_length: %s; the EMA is rebuilt at an earlier snapshot", problem)
    else:
        raise ValueError(f"--ema_length: no snapshot in {run_dir / sd.posthoc_ema.FOLDER} up to step {at} can be read")
    params = dict(model.unet.named_parameters())
    params.update({sd.run_folder.EMA_TEXT_PREFIX + name: p for name, p in model.text_encoder.named_parameters()})
    missing = [name for name in weights if name not in params]
    if missing:
        raise ValueError(f"--ema_length: the snapshots hold weights the model lacks, e.g. {missing[:2]}")
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)
    text = any(name.startswith(sd.run_folder.EMA_TEXT_PREFIX) for name in weights)
    log.info("the UNet's%s EMA of length %g rebuilt from %d post-hoc EMA snapshots at step %d",
             " and the text encoder's" if text else "", settings.ema_length, len([s for s in steps if s <= step]),
             step)

"""LoRA in ``SD_ImageGen.py``: a LoRA run's own adapter written alone (``--export_lora``: the kohya layout, or
diffusers'), and LoRA files merged into the weights that are sampled or exported whole (``--lora FILE[:SCALE]``,
after the run's own adapter)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import sd.embedding.formats
import sd.lora.formats
import sd.metadata
import sd.original_layout
from sd.imagegen.headers import file_header, training_record
from sd.sampling import Pipeline

log = logging.getLogger("sd_imagegen")


@dataclass(frozen=True)
class Settings:
    merged: tuple[tuple, ...] = ()  # --lora: (file or folder, scale, block weights or None)
    export: str | None = None
    format: str = sd.lora.formats.DEFAULT_LORA_FORMAT


def add_flags(parser) -> None:
    parser.add_argument("--export_lora", metavar="OUT", help="write the LoRA adapter of --ckpt (a LoRA run of ours): "
                        "the file OUT (.safetensors added if missing), or with --lora_format diffusers a folder OUT "
                        "holding pytorch_lora_weights.safetensors")
    parser.add_argument("--lora_format", choices=sd.lora.formats.LORA_FORMATS,
                        default=sd.lora.formats.DEFAULT_LORA_FORMAT,
                        help="layout of --export_lora: kohya (lora_unet_...: ComfyUI, AUTOMATIC1111, sd-scripts and "
                        "diffusers load it) or diffusers (PEFT keys: diffusers' load_lora_weights only; the other "
                        "tools skip them) (default: %(default)s)")
    parser.add_argument("--lora", action="append", default=[], metavar="FILE_OR_DIR[:SCALE[:BLOCKS]]",
                        help="merge this LoRA (a kohya .safetensors, or a diffusers file or folder) into the weights "
                        "before sampling and the full exports, times SCALE (default 1), each layer also times its "
                        "block's weight in BLOCKS: 17 or 26 comma-separated values as AUTOMATIC1111's LoRA Block "
                        "Weight extension takes them (BASE, the text encoder, then IN00-IN11, M00, OUT00-OUT11; 17: "
                        "the blocks that attend); repeat for several")


def parse_lora_spec(spec: str) -> tuple[str, float]:
    """``FILE_OR_DIR[:SCALE]`` -> (path, scale). A path may hold ':' itself (``C:\\x``, ``a:b.safetensors``):
    the text after the last ':' is a scale only when it reads as a number, and never when the whole
    text names an existing file or folder."""
    path, sep, tail = spec.rpartition(":")
    if not sep or Path(spec).exists():
        return spec, 1.0
    try:
        scale = float(tail)
    except ValueError:
        return spec, 1.0
    if not math.isfinite(scale) or not path:
        raise ValueError(f"--lora {spec}: give FILE_OR_DIR[:SCALE] with a finite SCALE")
    return path, scale


def parse_lora_blocks(spec: str) -> tuple[str, float, dict[str, float] | None]:
    """``FILE_OR_DIR[:SCALE[:W1,W2,...]]`` -> (path, scale, block weights or None): the 17 or 26 values of
    AUTOMATIC1111's LoRA Block Weight extension (``sd.original_layout.block_weights``) after the scale."""
    head, sep, tail = spec.rpartition(":")
    if sep and "," in tail and not Path(spec).exists():
        try:
            blocks = sd.original_layout.block_weights(tail.split(","))
        except ValueError as problem:
            raise ValueError(f"--lora {spec}: {problem}") from None
        path, scale = parse_lora_spec(head)
        return path, scale, blocks
    return (*parse_lora_spec(spec), None)


def settings(args, error, merging: bool) -> Settings:
    """``merging``: the weights are sampled or exported whole (what ``--lora`` merges into)."""
    if args.export_lora and args.lora_format == "diffusers" and args.export_lora.endswith(".safetensors"):
        error("--export_lora with --lora_format diffusers is a folder: give it a name without .safetensors, "
              "or leave out --lora_format for one kohya .safetensors file")
    if args.lora and not merging:
        error("--lora merges into the weights that are sampled or exported whole (--export_diffusers, "
              "--export_single_file); --export_lora writes the --ckpt's own adapter alone")
    try:
        merged = tuple(parse_lora_blocks(spec) for spec in args.lora)
    except ValueError as problem:
        error(str(problem))
    return Settings(merged, args.export_lora, args.lora_format)


def merge(settings: Settings, model: Pipeline) -> None:
    """The run's own adapter and every ``--lora`` merged into the plain weights."""
    sd.lora.formats.merge_adapters(model, list(settings.merged))


def export(settings: Settings, model: Pipeline, source: str) -> None:
    """``--export_lora``: the adapter of the run ``source``, with its kohya training keys and, for a pivotal run,
    its learned token (bundled in a kohya file for AUTOMATIC1111, and written beside it for ComfyUI and
    diffusers: ``--embedding`` files are added after the exports)."""
    if not model.has_adapter:
        raise ValueError(f"{source} carries no LoRA adapter to export (--export_lora takes a LoRA run of ours; "
                         "--lora merges LoRA files into a model)")
    title = Path(settings.export).name.removesuffix(".safetensors")
    record = training_record(source)
    header = file_header("lora", title, model, source, record)
    if record is not None:
        header.update(sd.metadata.kohya_training_keys(record, title))
    tokens = model.learned_tokens
    path = sd.lora.formats.lora_output(settings.export, settings.format)
    beside = {token: sd.embedding.formats.embedding_output(path.parent, token) for token in tokens}
    if path in beside.values():
        raise ValueError(f"--export_lora {path}: the learned token's embedding file would take that name; name the "
                         "LoRA otherwise")
    kohya = settings.format == "kohya"
    path = sd.lora.formats.save_model_lora(settings.export, model.unet, model.text_encoder, settings.format,
                                           metadata=header, embeddings=tokens if kohya else None)
    log.info("wrote LoRA %s (%s format)%s", path, settings.format,
             f" bundling token {', '.join(tokens)}" if tokens and kohya else "")
    log.info("%s", sd.lora.formats.sd_scripts_usage(path))
    if tokens and kohya:  # diffusers' load_lora_weights refuses a file with bundle_emb keys
        log.info("for diffusers: the same export with --lora_format diffusers writes the LoRA without the token, "
                 "whose embedding is written beside it (load_lora_weights, then load_textual_inversion)")
    for token, vectors in tokens.items():
        out = sd.embedding.formats.write_embedding(beside[token], token, vectors,
                                                   metadata=file_header("textual-inversion", beside[token], model,
                                                                        source, record))
        log.info("wrote embedding %s of token %s beside it (ComfyUI, diffusers)", out, token)

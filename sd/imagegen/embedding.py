"""Learned tokens in ``SD_ImageGen.py``: a textual-inversion run's token written alone (``--export_embedding``:
AUTOMATIC1111's layout, or diffusers'), and tokens added from embedding files for sampling (``--embedding
FILE[:TOKEN]``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import sd.embedding.formats
import sd.embedding.tokens
from sd.imagegen.headers import file_header
from sd.sampling import Pipeline

log = logging.getLogger("sd_imagegen")


@dataclass(frozen=True)
class Settings:
    added: tuple[tuple[str, str | None], ...] = ()  # --embedding: (file, token or None)
    export: str | None = None
    format: str = sd.embedding.formats.DEFAULT_EMBEDDING_FORMAT


def add_flags(parser) -> None:
    parser.add_argument("--embedding", action="append", default=[], metavar="FILE[:TOKEN]",
                        help="add a learned token from this embedding file (AUTOMATIC1111 / ComfyUI / diffusers "
                        "layout) for sampling; TOKEN names it (default: the file's key, else its name); repeatable")
    parser.add_argument("--export_embedding", metavar="OUT", help="write the token learned by --ckpt (a textual "
                        "inversion run of ours): OUT.safetensors, or a file in the folder OUT")
    parser.add_argument("--embedding_format", choices=sd.embedding.formats.EMBEDDING_FORMATS,
                        default=sd.embedding.formats.DEFAULT_EMBEDDING_FORMAT,
                        help="layout of --export_embedding: a1111 (emb_params: AUTOMATIC1111, ComfyUI, and diffusers "
                        "with token=) or diffusers (keyed by the token: learned_embeds.safetensors) "
                        "(default: %(default)s)")


def parse_embedding_spec(spec: str) -> tuple[str, str | None]:
    """``FILE[:TOKEN]`` -> (path, token or None); a path that exists as written is taken whole."""
    path, sep, token = spec.rpartition(":")
    if not sep or Path(spec).exists() or not path or "/" in token or "\\" in token:
        return spec, None
    return path, token


def settings(args, error, exporting_whole: bool) -> Settings:
    if args.embedding and exporting_whole:
        error("--embedding adds a token for sampling only; the full exports keep the model's vocabulary "
              "(give the embedding file to the other tool beside the model)")
    return Settings(tuple(parse_embedding_spec(spec) for spec in args.embedding), args.export_embedding,
                    args.embedding_format)


def export(settings: Settings, model: Pipeline, source: str) -> None:
    if not model.learned_tokens:
        raise ValueError(f"{source} has learned no token to export (--export_embedding takes a textual inversion "
                         "run of ours)")
    token, vectors = next(iter(model.learned_tokens.items()))
    out = sd.embedding.formats.embedding_output(settings.export, token, settings.format)
    header = file_header("textual-inversion", out if settings.format == "a1111" else out.parent, model, source)
    path = sd.embedding.formats.write_embedding(settings.export, token, vectors, settings.format, metadata=header)
    log.info("wrote embedding %s of token %s (%d vector(s), %s format)", path, token, vectors.shape[0],
             settings.format)


def add(settings: Settings, model: Pipeline) -> None:
    for path, token in settings.added:
        token, vectors = sd.embedding.formats.read_embedding(path, token)
        try:
            sd.embedding.tokens.add_token(model.tokenizer, model.text_encoder, token, vectors)
        except sd.embedding.tokens.EmbeddingError as problem:
            raise sd.embedding.tokens.EmbeddingError(f"--embedding {path}: {problem}") from problem
        log.info("added token %s (%d vector(s)) from %s", token, vectors.shape[0], path)

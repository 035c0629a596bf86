"""A folder of images as the studio's Data page shows it, and the commands that turn it into a dataset.

``scan_folder`` reads what ``01e_import_folder.py`` would: each image's caption (``photo.txt``), its size from
the file's first 64 KB (nothing is decoded) and so the files it would skip, with the reason 01e's own rules give
(``sd.data.stages.check_import``), and the aspect-ratio bucket each image falls in; ``write_caption`` writes only
an image's caption that 01e reads; the commands are the data stages' own, as a user types them.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import sd.data.buckets
import sd.data.shards
import sd.data.stages
import sd.files
from sd.studio.jobs import python_command


@dataclass
class FolderScan:
    folder: Path
    images: list[str] = field(default_factory=list)  # relative paths 01e would import, sorted
    captions: dict[str, str] = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (relative path, reason)
    buckets: Counter = field(default_factory=Counter)  # "WxH" -> images


def caption_path(folder: Path, rel: str) -> Path:
    return Path(folder) / (rel.rsplit(".", 1)[0] + ".txt")


def write_caption(folder: Path, rel: str, text: str) -> Path:
    """``rel``'s caption file written; ``rel`` must be an image that 01e reads from ``folder`` (a ValueError
    otherwise: a name with ``..``, an absolute one or any other file never reaches the disk)."""
    images, _ = sd.data.stages.list_images(Path(folder))
    if rel not in images:
        raise ValueError(f"{rel!r} is not an image that 01e_import_folder.py reads from {folder}")
    path = caption_path(folder, rel)
    sd.files.write_text_atomic(path, text.strip() + "\n")
    return path


HEADER_BYTES = 64 << 10  # where an image's size is found (a JPEG's EXIF thumbnail can push it past a few KB)


def header_size(path: Path) -> tuple[int, int]:
    """An image's width and height from its first ``HEADER_BYTES`` (the whole file when its size lies further
    in); nothing is decoded, and no read asks for more than the file holds."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > sd.data.stages.MAX_MEMBER_BYTES:
            raise ValueError(f"{path} is over {sd.data.stages.MAX_MEMBER_BYTES} bytes")
        head = handle.read(min(HEADER_BYTES, size))
        try:
            return sd.data.shards.image_size(head)
        except Exception:  # noqa: BLE001 - cut off before the size: read on
            if len(head) >= size:
                raise
            return sd.data.shards.image_size(head + handle.read())


def page_of(scan: FolderScan, number: int, size: int) -> list[tuple[str, str]]:
    """``(relative path, caption)`` of page ``number`` (from 1; clamped to the last) of ``size`` images."""
    pages = max(1, -(-len(scan.images) // size))
    start = (min(max(int(number), 1), pages) - 1) * size
    return [(rel, scan.captions[rel]) for rel in scan.images[start:start + size]]


def scan_folder(folder: Path, resolution: int = 512, min_size: int | None = None,
                max_pixels: int = sd.data.shards.DEFAULT_MAX_PIXELS) -> FolderScan:
    """What importing ``folder`` at ``resolution`` would keep and skip (01e's reasons), read from the headers."""
    folder = Path(folder)
    scan = FolderScan(folder)
    smallest = sd.data.stages.default_min_size(resolution) if min_size is None else min_size
    # encode_latents.py --buckets' sizes (64 px steps; 8 px below 64 px, where no 64 px step fits)
    buckets = sd.data.buckets.default_buckets(resolution, 64 if resolution >= 64 else 8)
    images, _ = sd.data.stages.list_images(folder)
    for rel in images:
        caption = sd.data.stages.read_caption(caption_path(folder, rel))
        try:
            size = header_size(folder / rel)
        except Exception:  # noqa: BLE001 - any reader's error: the file would be skipped, after its caption's rules
            size = None
        try:
            sd.data.stages.check_import(caption, size, min_size=smallest, max_pixels=max_pixels)
            if size is None:
                raise sd.data.shards.ImageSkip("undecodable")
        except sd.data.shards.ImageSkip as skip:
            scan.skipped.append((rel, skip.reason))
            continue
        width, height = size
        scan.images.append(rel)
        scan.captions[rel] = caption
        bucket = buckets[sd.data.buckets.nearest_bucket(width, height, buckets)]
        scan.buckets[sd.data.buckets.name(bucket)] += 1
    return scan


def import_command(folder: Path, shards: Path, resolution: int, keep_aspect: bool) -> list[str]:
    return python_command("pipeline/01e_import_folder.py", "--input", folder, "--out", shards, "--resolution",
                          resolution, *(["--keep_aspect"] if keep_aspect else []))


def vae_command(shards: Path, vae: Path, resolution: int) -> list[str]:
    """A VAE for the images, as the README's quick start 2 trains one (the ``tiny`` preset: minutes on a CPU)."""
    return python_command("train_vae.py", "--input", f"{shards}/*.tar", "--out", vae, "--resolution", resolution,
                          "--preset", "tiny")


def encode_command(shards: Path, latents: Path, vae: str, resolution: int, buckets: bool) -> list[str]:
    return python_command("encode_latents.py", "--input", f"{shards}/*.tar", "--out", latents, "--vae", vae,
                          "--resolution", resolution, *(["--buckets"] if buckets else []))


def dataset_commands(shards: Path, captions: Path, latents: Path, dataset: Path, tokenizer: str) -> list[list[str]]:
    return [python_command("pipeline/04_preprocess_to_cache.py", "--input", f"{shards}/*.tar", "--out", captions,
                           "--tokenizer", tokenizer),
            python_command("pipeline/05_build_hf_dataset.py", "--captions", captions, "--latents", latents,
                           "--out", dataset)]

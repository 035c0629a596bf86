"""Webdataset shards and image decoding shared by encode_latents.py and the pipeline stages.

* A shard is a tar ``NNNNN.tar`` whose samples are consecutive members sharing a key:
  ``<key>.jpg|png|webp`` (the image), ``<key>.txt`` (the caption), ``<key>.json`` (metadata).
  ``read_shard`` splits an in-memory tar and keeps what precedes a damaged member; ``write_shard``
  writes one atomically.
* ``decode_image`` turns image bytes into RGB pixels, refusing truncated, undecodable and huge images
  with an ``ImageSkip`` whose ``reason`` is the counter the caller adds it to; ``resize_center_crop``
  makes the square the VAE sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

import SD_Files


IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
DEFAULT_MAX_PIXELS = 8192 * 8192


@dataclass
class ShardSample:
    key: str
    image: bytes | None = None
    image_ext: str = ""
    caption: str | None = None
    metadata: bytes | None = None


def split_member_name(name: str) -> tuple[str, str]:
    """webdataset naming: the key is everything before the first dot of the file name."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


def read_shard(data: bytes) -> tuple[list[ShardSample], str | None]:
    """The samples of an in-memory tar, in order, and the key cut off if the tar is truncated.

    Members of one sample are consecutive and share a key. Reading stops at the first damaged
    member; the samples before it are kept.
    """
    import io
    import tarfile

    samples: dict[str, ShardSample] = {}
    truncated_key = None
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, ext = split_member_name(member.name)
                truncated_key = key
                payload = tar.extractfile(member).read()
                if len(payload) != member.size:
                    raise tarfile.ReadError("unexpected end of data")
                truncated_key = None
                sample = samples.setdefault(key, ShardSample(key))
                if ext in IMAGE_EXTENSIONS:
                    sample.image, sample.image_ext = payload, ext
                elif ext == "txt":
                    sample.caption = payload.decode("utf-8", errors="replace").strip()
                elif ext == "json":
                    sample.metadata = payload
    except (tarfile.TarError, EOFError, OSError) as error:
        truncated_key = truncated_key or f"<after {len(samples)} samples: {error}>"
        samples.pop(truncated_key, None)
        return list(samples.values()), truncated_key
    return list(samples.values()), None


def write_shard(path: Path, samples: list[ShardSample]) -> None:
    """Write a webdataset tar atomically (see ``write_tar``)."""
    SD_Files.write_atomic(path, lambda tmp: write_tar(tmp, samples))


def write_tar(path: Path, samples: list[ShardSample]) -> None:
    """A webdataset tar at ``path``: ``key.ext`` members, a sample's members together, in order."""
    import io
    import tarfile

    def add(tar, name: str, payload: bytes):
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(payload), 0o644, 0
        tar.addfile(info, io.BytesIO(payload))

    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for sample in samples:
            if sample.image is not None:
                add(tar, f"{sample.key}.{sample.image_ext}", sample.image)
            if sample.caption is not None:
                add(tar, f"{sample.key}.txt", sample.caption.encode("utf-8"))
            if sample.metadata is not None:
                add(tar, f"{sample.key}.json", sample.metadata)


def looks_truncated(data: bytes, ext: str) -> bool:
    """Cheap end-of-file checks: decoders often return a half-grey image for a cut-off file."""
    if ext in ("jpg", "jpeg"):
        return data.rstrip(b"\x00\r\n ")[-2:] != b"\xff\xd9"
    if ext == "png":
        return b"IEND" not in data[-16:]
    if ext == "webp":
        return len(data) < 12 or int.from_bytes(data[4:8], "little") + 8 > len(data)
    return False


class ImageSkip(Exception):
    """An image that cannot be used; ``reason`` is one of the skip counters."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def image_size(data: bytes) -> tuple[int, int]:
    """``(width, height)`` from the file header, without decoding the pixels."""
    import io
    import warnings

    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Image.open(io.BytesIO(data)) as image:
            return image.size


def decode_image(data: bytes, ext: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """RGB ``(H, W, 3)`` uint8 via OpenCV; raises ``ImageSkip`` for truncated, undecodable or huge images."""
    import cv2

    if looks_truncated(data, ext):
        raise ImageSkip("truncated_image")
    try:
        width, height = image_size(data)
    except Exception as error:  # PIL raises many types for garbage, incl. its decompression-bomb error
        if "decompression bomb" in str(error).lower():
            raise ImageSkip("too_large", str(error)) from error
        raise ImageSkip("undecodable", str(error)) from error
    if width * height > max_pixels:
        raise ImageSkip("too_large", f"{width}x{height}")
    bgr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    if bgr is None:
        raise ImageSkip("undecodable")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def resize_center_crop(image: np.ndarray, resolution: int) -> np.ndarray:
    """Scale the short side to ``resolution`` (area filter down, cubic up), then crop the centre square."""
    import cv2

    height, width = image.shape[:2]
    scale = resolution / min(height, width)
    new_w, new_h = max(resolution, round(width * scale)), max(resolution, round(height * scale))
    if (new_w, new_h) != (width, height):
        interpolation = cv2.INTER_AREA if scale < 1 else cv2.INTER_CUBIC
        image = cv2.resize(image, (new_w, new_h), interpolation=interpolation)
    top, left = (new_h - resolution) // 2, (new_w - resolution) // 2
    return np.ascontiguousarray(image[top : top + resolution, left : left + resolution])

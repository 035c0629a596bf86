"""Image shards with real JPEG/PNG images and the usual kinds of damage, for tests."""

import io
from pathlib import Path

import numpy as np
from PIL import Image

import sd.data.shards


def image_bytes(array: np.ndarray, fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def random_image(rng, height: int, width: int) -> np.ndarray:
    """Smooth colour blobs (compress like photos, unlike white noise)."""
    small = rng.integers(0, 256, size=(max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(small).resize((width, height), Image.BILINEAR))


def clean_shard(path: Path, keys: list[str], rng, size: int = 64, fmt: str = "PNG") -> dict[str, np.ndarray]:
    """A shard of square images at ``size`` (so preprocessing is only decoding); returns key -> RGB."""
    path.parent.mkdir(parents=True, exist_ok=True)
    samples, pixels = [], {}
    for key in keys:
        array = random_image(rng, size, size)
        data = image_bytes(array, fmt)
        pixels[key] = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        samples.append(sd.data.shards.ShardSample(key, data, "png" if fmt == "PNG" else "jpg", f"caption of {key}", b"{}"))
    sd.data.shards.write_shard(path, samples)
    return pixels


def sparse_tar(path: Path, members: list[tuple[str, int | bytes]]) -> None:
    """A tar whose members given as a size are holes in the file: declared, never written to disk."""
    import tarfile

    with open(path, "wb") as file:
        for name, content in members:
            info = tarfile.TarInfo(name)
            info.size = content if isinstance(content, int) else len(content)
            file.write(info.tobuf(format=tarfile.USTAR_FORMAT))
            if isinstance(content, int):
                file.seek(content, 1)
            else:
                file.write(content)
            file.seek(-info.size % 512, 1)
        file.write(bytes(1024))  # the end-of-archive blocks

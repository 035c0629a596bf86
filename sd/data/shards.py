"""Webdataset shards and image decoding shared by encode_latents.py and the pipeline stages.

* A shard is a tar ``NNNNN.tar`` whose samples are consecutive members sharing a key:
  ``<key>.jpg|png|webp`` (the image), ``<key>.txt`` (the caption), ``<key>.json`` (metadata).
  ``TarSamples`` reads one a sample at a time (bounded memory) and keeps what precedes a damaged
  member; ``read_shard`` does the same for a tar in memory; ``write_shard`` writes one atomically.
* ``decode_image`` turns image bytes into RGB pixels, refusing truncated, undecodable, huge and
  extremely elongated images with an ``ImageSkip`` whose ``reason`` is the counter the caller adds it
  to; ``resize_center_crop`` makes the square the VAE sees, cutting it out before scaling, and
  ``resize_keep_aspect`` scales the whole image (for aspect-ratio buckets, which crop later).
* A sample may carry a loss mask, ``<key>.mask.png``: a grey image of the image's size, grey level
  0..255 = weight 0..1 of each pixel in the training loss. ``decode_mask`` reads and checks it against
  its image; ``latent_mask`` reduces it to latent resolution (the mean weight of each 8x8 block).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import sd.data.buckets
import sd.files

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
DEFAULT_MAX_PIXELS = 8192 * 8192
# Long side / short side above which an image is refused ("extreme_aspect"): its centre square would
# keep under an eighth of it, and a 12000x1 strip says nothing its caption describes.
DEFAULT_MAX_ASPECT = 8.0


@dataclass
class ShardSample:
    key: str
    image: bytes | None = None
    image_ext: str = ""
    caption: str | None = None
    metadata: bytes | None = None
    problem: str | None = None  # set by TarSamples: the skip reason of a sample no reader may use
    mask: bytes | None = None  # the loss mask's image file, ``<key>.mask.png``
    controls: dict = field(default_factory=dict)  # conditioning images (ControlNet): name -> ``<key>.<name>.png``
    rejected: bytes | None = None  # a preference pair's other image, ``<key>.rejected.<ext>`` (``image`` is preferred)
    rejected_ext: str = ""


# Characters no key may hold: the control characters (Unicode category Cc: ``\n``, ``\r``, ``\x85``
# ...) and the line and paragraph separators U+2028 / U+2029, at all of which ``str.splitlines``
# splits, and lone surrogates (what a tar member name that is not UTF-8 decodes to: it cannot be
# written back as UTF-8).
UNSAFE_KEY_CHARACTERS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def is_valid_key(key: str) -> bool:
    """A key a reader can trust: keys end up one per line in ``keys.txt``, in parquet and in file names,
    so empty parts, absolute paths, ``..``, backslashes, line breaks and control characters are refused.

    Every stage that forms or reads keys asks this before it writes one; a refused sample is skipped and
    counted as ``bad_key``.
    """
    if not key or key.startswith("/") or "\\" in key or UNSAFE_KEY_CHARACTERS.search(key):
        return False
    return all(part not in ("", "..") for part in key.split("/"))


def split_member_name(name: str) -> tuple[str, str]:
    """webdataset naming: the key is everything before the first dot of the file name."""
    folder, slash, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return f"{folder}{slash}{stem}", ext.lower()  # "/abs.jpg" keeps its "/", for is_valid_key to refuse


class TarSamples:
    """The samples of a webdataset tar, one at a time as the file is read: memory holds one sample's
    members (and the keys seen), whatever the shard's size.

    ``for sample in TarSamples(file, size)``: members that follow each other and share a key are one
    sample. A key that comes back after another key is a sample of its own with ``problem``
    ``duplicate_key`` (the first keeps the key), as is one that repeats a member (``dup.png, dup.txt,
    dup.png``). A key a reader cannot trust is ``bad_key``, a caption that is not UTF-8
    ``bad_caption_encoding``, a member to be read that is over ``max_member_bytes`` ``too_large_member``
    (it is not read).

    Only the payloads of ``fields`` (``image``, ``caption``, ``metadata``, ``mask``, ``control``, ``rejected``) are read; a member of another
    field stands as ``b""`` and passing it over is a seek. Reading stops at the first member whose data
    runs past ``size`` (a cut-off file) or that tarfile cannot read; that member's sample is dropped
    and, once the loop ends, ``truncated_key`` names it (``<after N samples: error>`` where no key was
    read). A file that is not a tar at all raises ``tarfile.ReadError`` from the first ``next``.
    """

    FIELDS = ("image", "caption", "metadata", "mask", "control", "rejected")

    def __init__(self, file, size: int, fields=FIELDS, max_member_bytes: int | None = None):
        self.file, self.size, self.fields, self.max_member_bytes = file, size, set(fields), max_member_bytes
        self.truncated_key: str | None = None
        self.count = 0  # samples yielded

    def __iter__(self):
        import tarfile

        seen: set[str] = set()
        current: ShardSample | None = None
        reading = None
        try:
            with tarfile.open(fileobj=self.file, mode="r:") as tar:
                while (member := tar.next()) is not None:
                    tar.members.clear()  # tarfile keeps every header it reads; a shard's are not needed again
                    if not member.isfile():
                        continue
                    key, ext = split_member_name(member.name)
                    if current is None or key != current.key:
                        if current is not None:
                            self.count += 1
                            yield current
                        current = ShardSample(key)
                        if key in seen:
                            current.problem = "duplicate_key"
                        seen.add(key)
                    reading = key
                    if member.size < 0 or member.offset_data + member.size > self.size:
                        raise tarfile.ReadError("unexpected end of data")
                    payload = b""
                    if field_of(ext) in self.fields:
                        if self.max_member_bytes is not None and member.size > self.max_member_bytes:
                            current.problem = current.problem or "too_large_member"
                        else:
                            payload = tar.extractfile(member).read()
                            if len(payload) != member.size:
                                raise tarfile.ReadError("unexpected end of data")
                    reading = None
                    add_member(current, ext, payload)
        except (tarfile.TarError, EOFError) as error:
            if self.count == 0 and current is None:
                raise  # not a tar: nothing was read
            self.truncated_key = reading or f"<after {self.count + (current is not None)} samples: {error}>"
            if reading is not None:
                current = None  # the sample whose member is cut off
        if current is not None:
            self.count += 1
            yield current


def read_shard(data: bytes) -> tuple[list[ShardSample], str | None]:
    """``TarSamples`` of an in-memory tar: the samples, in order, and the key cut off if the tar is
    truncated (``<...>`` with no sample when ``data`` is not a tar)."""
    import io
    import tarfile

    reader = TarSamples(io.BytesIO(data), len(data))
    try:
        return list(reader), reader.truncated_key
    except (tarfile.TarError, EOFError) as error:
        return [], f"<after 0 samples: {error}>"


MASK_NAME = "mask"  # the companion name of a sample's loss mask; every other name is a conditioning image's
MASK_EXTENSION = "mask.png"  # the member a sample's loss mask is written as: <key>.mask.png
REJECTED_NAME = "rejected"  # a preference pair's rejected image: <key>.rejected.jpg|png|webp beside the preferred one


CONTROL_NAME = re.compile(r"[a-z0-9_]+")  # a conditioning image's name: <key>.<name>.png


def is_control_name(name: str) -> bool:
    """Whether ``name`` can name conditioning images (``mask`` is the loss mask's)."""
    return bool(CONTROL_NAME.fullmatch(name)) and name not in (MASK_NAME, REJECTED_NAME)


def field_of(ext: str) -> str | None:
    if ext.startswith("mask.") and ext[len("mask."):] in IMAGE_EXTENSIONS:
        return "mask"
    if ext.startswith(REJECTED_NAME + ".") and ext[len(REJECTED_NAME) + 1:] in IMAGE_EXTENSIONS:
        return "rejected"
    name, dot, image_ext = ext.partition(".")
    if dot and image_ext in IMAGE_EXTENSIONS and is_control_name(name):
        return "control"
    return "image" if ext in IMAGE_EXTENSIONS else {"txt": "caption", "json": "metadata"}.get(ext)


def add_member(sample: ShardSample, ext: str, payload: bytes) -> None:
    if not is_valid_key(sample.key):
        sample.problem = "bad_key"
    field = field_of(ext)
    if field is None:
        return
    if field == "control":
        name = ext.partition(".")[0]
        if name in sample.controls:
            sample.problem = sample.problem or "duplicate_key"
        sample.controls[name] = payload
        return
    if getattr(sample, field) is not None:
        sample.problem = sample.problem or "duplicate_key"
    if field == "image":
        sample.image, sample.image_ext = payload, ext
    elif field == "metadata":
        sample.metadata = payload
    elif field == "mask":
        sample.mask = payload
    elif field == "rejected":
        sample.rejected, sample.rejected_ext = payload, ext[len(REJECTED_NAME) + 1:]
    else:
        try:
            sample.caption = payload.decode("utf-8").strip()
        except UnicodeDecodeError:
            sample.caption, sample.problem = "", sample.problem or "bad_caption_encoding"


def write_shard(path: Path, samples: list[ShardSample]) -> None:
    """Write a webdataset tar atomically (see ``write_tar``)."""
    sd.files.write_atomic(path, lambda tmp: write_tar(tmp, samples))


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
            if sample.mask is not None:
                add(tar, f"{sample.key}.{MASK_EXTENSION}", sample.mask)
            if sample.rejected is not None:
                add(tar, f"{sample.key}.{REJECTED_NAME}.{sample.rejected_ext}", sample.rejected)
            for name, payload in sorted(sample.controls.items()):
                add(tar, f"{sample.key}.{name}.png", payload)


def sniff_format(data: bytes) -> str | None:
    """The image format from the file's first bytes; a file's name is not trusted to say it."""
    if data.startswith(b"\xff\xd8\xff"):
        return "jpg"
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None


def ends_whole(data: bytes, fmt: str) -> bool:
    """Whether the file ends with its format's end (JPEG's EOI marker, PNG's IEND chunk, the size WebP's
    RIFF header declares): a cheap check that needs no decoding. A file that does not is cut off, or
    carries bytes after its end (cameras and editors append MPF, Samsung SEFH and motion-photo trailers
    to JPEGs); ``decode_image`` lets the decoders tell which."""
    if fmt in ("jpg", "jpeg"):
        return data.rstrip(b"\x00\r\n ")[-2:] == b"\xff\xd9"
    if fmt == "png":
        return b"IEND" in data[-16:]
    if fmt == "webp":
        return len(data) >= 12 and int.from_bytes(data[4:8], "little") + 8 <= len(data)
    return True


def decodes_whole(data: bytes) -> bool:
    """Whether Pillow decodes every pixel of ``data``. It refuses image data that runs out before the
    image does ("image file is truncated"), whichever OpenCV is installed: some OpenCV versions fill the
    missing rows of a cut-off JPEG with grey rather than refusing it."""
    import io
    import warnings

    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(data)) as image:
                image.load()
    except Exception:  # PIL raises many types for damaged data
        return False
    return True


class ImageSkip(Exception):
    """An image that cannot be used; ``reason`` is one of the skip counters."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.member: str | None = None  # the companion at fault (``mask``, a conditioning image's name), if any


def image_size(data: bytes) -> tuple[int, int]:
    """``(width, height)`` from the file header, without decoding the pixels."""
    import io
    import warnings

    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Image.open(io.BytesIO(data)) as image:
            return image.size


def check_size(width: int, height: int, max_pixels: int = DEFAULT_MAX_PIXELS, max_aspect: float = DEFAULT_MAX_ASPECT,
               min_size: int = 0) -> None:
    """``ImageSkip`` for an image of ``width`` x ``height`` pixels that is not imported: more pixels than
    ``max_pixels`` (``too_large``), more elongated than ``max_aspect`` (``extreme_aspect``), or narrower or lower
    than ``min_size`` (``too_small``: it would be upscaled into blur)."""
    if width * height > max_pixels:
        raise ImageSkip("too_large", f"{width}x{height}")
    if max(width, height) > max_aspect * min(width, height):
        raise ImageSkip("extreme_aspect", f"{width}x{height}")
    if min(width, height) < min_size:
        raise ImageSkip("too_small", f"{width}x{height} pixels, below the minimum side of {min_size}")


def header_size(data: bytes) -> tuple[int, int] | None:
    """``image_size``, or None when the header cannot be read (``decode_image`` then says why)."""
    try:
        return image_size(data)
    except Exception:  # noqa: BLE001 - PIL raises many types for garbage
        return None


def decode_image(data: bytes, ext: str, max_pixels: int = DEFAULT_MAX_PIXELS,
                 max_aspect: float = DEFAULT_MAX_ASPECT) -> np.ndarray:
    """RGB ``(H, W, 3)`` uint8 via OpenCV; raises ``ImageSkip`` for truncated, undecodable, huge or
    extremely elongated images (size and shape are read from the header, before decoding). Bytes after
    the image's end (a camera's trailer) are ignored; image data cut short is ``truncated_image``.

    The bytes decide the format: ``ext``, the name's extension, is only what the source claims (a PNG
    named ``.jpg`` decodes as the PNG it is; an HTML error page named ``.jpg`` is ``undecodable``).
    """
    import cv2

    fmt = sniff_format(data)
    if fmt is None:
        raise ImageSkip("undecodable", f"not a JPEG, PNG or WebP file (named .{ext})")
    whole = ends_whole(data, fmt)
    try:
        width, height = image_size(data)
    except Exception as error:  # PIL raises many types for garbage, incl. its decompression-bomb error
        if "decompression bomb" in str(error).lower():
            raise ImageSkip("too_large", str(error)) from error
        raise ImageSkip("undecodable" if whole else "truncated_image", str(error)) from error
    check_size(width, height, max_pixels, max_aspect)
    bgr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    # Not ending with its end marker, the file is kept only if both decoders read all of it: libpng in
    # OpenCV refuses a cut-off PNG that Pillow reads, Pillow a cut-off JPEG that some OpenCVs fill.
    if not whole and (bgr is None or not decodes_whole(data)):
        raise ImageSkip("truncated_image")
    if bgr is None:
        raise ImageSkip("undecodable")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def resize_center_crop(image: np.ndarray, resolution: int) -> np.ndarray:
    """The centre square scaled to ``resolution`` (area filter down, cubic up): the short side is scaled
    to ``resolution`` and the long one cropped to it; the square bucket of ``sd.data.buckets.fit_to_bucket``.

    The square is cut before scaling, so the work is bounded by the input and the output: scaling the
    whole image first would turn a 12000x1 strip into 1.5M x 128 pixels (590 MB) at 128 px, to keep
    128 x 128 of them.
    """
    return sd.data.buckets.fit_to_bucket(image, (resolution, resolution))[0]


KEEP_ASPECT_SIDES = ("short", "long")


def resize_keep_aspect(image: np.ndarray, resolution: int, side: str = "short",
                       max_aspect: float = DEFAULT_MAX_ASPECT) -> np.ndarray:
    """The whole image scaled so that its ``side`` ("short" or "long") is ``resolution`` pixels, the
    other side in proportion (rounded to the nearest pixel, at least 1): area filter down, cubic up.
    Returned as is when that side is already ``resolution``.

    Nothing is cropped, so with ``side="short"`` the output's long side is ``resolution`` times the
    aspect ratio: images more elongated than ``max_aspect`` raise ``ImageSkip("extreme_aspect")``
    (``decode_image`` refuses them first in the stages), so that a 12000x1 strip is not scaled to
    1.5M x 128 pixels at 128 px.
    """
    import cv2

    if side not in KEEP_ASPECT_SIDES:
        raise ValueError(f"side must be one of {KEEP_ASPECT_SIDES}, got {side!r}")
    height, width = image.shape[:2]
    if max(height, width) > max_aspect * min(height, width):
        raise ImageSkip("extreme_aspect", f"{width}x{height}")
    fixed = min(height, width) if side == "short" else max(height, width)
    if fixed == resolution:
        return image

    def scaled(length: int) -> int:  # round half up in integers: no float error at .5
        return max(1, (2 * length * resolution + fixed) // (2 * fixed))

    interpolation = cv2.INTER_AREA if fixed > resolution else cv2.INTER_CUBIC
    return cv2.resize(image, (scaled(width), scaled(height)), interpolation=interpolation)


# ---------------------------------------------------------------------------------------------
# Loss masks
# ---------------------------------------------------------------------------------------------

MASK_SKIPS = ("bad_mask", "mask_mismatch")  # the skip reasons that name a sample's mask, not its image


def decode_mask(data: bytes, size: tuple[int, int], max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """The loss mask of an image of ``size`` ``(width, height)``: ``(height, width)`` uint8 grey levels.

    A colour mask counts by its luminance. A mask of another size but the image's aspect ratio (each
    side scaled by one factor, to within rounding) is scaled to the image's size; one of another aspect
    ratio raises ``ImageSkip("mask_mismatch")``, one that does not decode ``ImageSkip("bad_mask")``.
    """
    import cv2

    try:
        rgb = decode_image(data, "png", max_pixels)
    except ImageSkip as skip:
        raise ImageSkip("bad_mask", str(skip)) from None
    return scaled_to_image(cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY), size, "mask_mismatch", "mask")


def scaled_to_image(pixels: np.ndarray, size: tuple[int, int], mismatch: str, what: str) -> np.ndarray:
    """An image's companion (its loss mask, a conditioning image) brought to the image's ``size``
    ``(width, height)``: as it is at that size; scaled when it has the image's aspect ratio (each side
    scaled by one factor, to within rounding); else ``ImageSkip(mismatch)``."""
    import cv2

    width, height = size
    own_height, own_width = pixels.shape[:2]
    if (own_width, own_height) == (width, height):
        return pixels
    # |mw * h - mh * w| is at most (w + h) / 2 when both sides are one scaling of the image's, rounded
    if 2 * abs(own_width * height - own_height * width) > width + height:
        raise ImageSkip(mismatch, f"a {own_width}x{own_height} {what} for a {width}x{height} image")
    shrink = own_width >= width and own_height >= height
    return cv2.resize(pixels, (width, height), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)


# ---------------------------------------------------------------------------------------------
# Conditioning images (ControlNet)
# ---------------------------------------------------------------------------------------------


def decode_control(data: bytes, size: tuple[int, int], max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """A conditioning image of an image of ``size`` ``(width, height)``: ``(height, width, 3)`` uint8 RGB
    (a grey file repeated to three channels), scaled as ``scaled_to_image`` says; one that does not decode
    raises ``ImageSkip("bad_control")``, one of another aspect ratio ``ImageSkip("control_mismatch")``."""
    try:
        rgb = decode_image(data, "png", max_pixels)
    except ImageSkip as skip:
        raise ImageSkip("bad_control", str(skip)) from None
    return scaled_to_image(rgb, size, "control_mismatch", "conditioning image")


def encode_png(pixels: np.ndarray) -> bytes:
    """``(H, W)`` grey or ``(H, W, 3)`` RGB uint8 as a PNG file (lossless); an RGB image whose channels are
    equal is written grey (a third of the bytes: edges, masks and depth are grey)."""
    import cv2

    if pixels.ndim == 3 and (pixels[..., 0] == pixels[..., 1]).all() and (pixels[..., 0] == pixels[..., 2]).all():
        pixels = pixels[..., 0]
    elif pixels.ndim == 3:
        pixels = cv2.cvtColor(pixels, cv2.COLOR_RGB2BGR)
    ok, data = cv2.imencode(".png", pixels)
    if not ok:
        raise ValueError("PNG encoding failed")
    return data.tobytes()


def decode_png(data, flipped: bool = False) -> np.ndarray:
    """``encode_png``'s bytes back as ``(3, H, W)`` uint8 RGB (grey repeated), mirrored left-right when
    ``flipped``."""
    pixels = png_pixels(data)
    pixels = pixels[:, ::-1] if flipped else pixels
    return np.ascontiguousarray(np.broadcast_to(pixels, (3, *pixels.shape)) if pixels.ndim == 2
                                else pixels.transpose(2, 0, 1))


def png_pixels(data) -> np.ndarray:
    """``encode_png``'s bytes back as they were: ``(H, W)`` grey or ``(H, W, 3)`` RGB uint8; ValueError for
    bytes that are not such an image."""
    import cv2

    pixels = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    if pixels is None:
        raise ValueError("not a PNG file")
    if pixels.dtype != np.uint8 or pixels.ndim not in (2, 3) or (pixels.ndim == 3 and pixels.shape[2] != 3):
        raise ValueError(f"a {pixels.dtype} image of shape {pixels.shape}, not 8-bit grey or RGB")
    return pixels if pixels.ndim == 2 else cv2.cvtColor(pixels, cv2.COLOR_BGR2RGB)


def encode_mask(mask: np.ndarray) -> bytes:
    """``(H, W)`` uint8 grey levels as a PNG file (lossless: the weights stay as they were)."""
    import cv2

    ok, data = cv2.imencode(".png", mask)
    if not ok:
        raise ImageSkip("bad_mask", "PNG encoding failed")
    return data.tobytes()


def latent_mask(mask: np.ndarray, factor: int = 8) -> np.ndarray:
    """``(H, W)`` uint8 grey levels -> ``(H / factor, W / factor)`` float16 weights in 0..1: the mean of
    each ``factor`` x ``factor`` block (an area average, as the VAE's latent covers that block)."""
    height, width = mask.shape
    if height % factor or width % factor:
        raise ValueError(f"a {width}x{height} mask does not divide into {factor}x{factor} blocks")
    blocks = mask.reshape(height // factor, factor, width // factor, factor).astype(np.float32)
    return (blocks.mean(axis=(1, 3)) / 255.0).astype(np.float16)

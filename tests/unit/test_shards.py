"""sd.data.shards: which keys a reader can trust, which image files are whole, and resize_keep_aspect
(the whole image scaled by its short or long side)."""

import io

import cv2
import numpy as np
import pytest
from PIL import Image

import sd.data.shards

from shard_factory import random_image

RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)
# Every character str.splitlines splits on, the other control characters, and a lone surrogate (what
# a file name that is not UTF-8 decodes to; it cannot be written back as UTF-8).
LINE_BREAKS = ["\n", "\r", "\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]


@pytest.mark.parametrize("char", LINE_BREAKS + ["\x00", "\t", "\x1b", "\x7f", "\x9f", "\udcff"])
def test_a_key_with_a_line_break_or_control_character_is_refused(char):
    assert len(f"a{char}b".splitlines()) == (2 if char in LINE_BREAKS else 1)
    assert not sd.data.shards.is_valid_key(f"a{char}b")


@pytest.mark.parametrize("key", ["k0", "00001234", "folder/name", "caf\u00e9 \u65e5\u672c", "a b_c-d"])
def test_ordinary_keys_are_kept(key):
    assert sd.data.shards.is_valid_key(key)


def photo(fmt: str, **options) -> tuple[bytes, np.ndarray]:
    """A 96x128 image file and the pixels OpenCV decodes from it."""
    buffer = io.BytesIO()
    Image.fromarray(random_image(np.random.default_rng(0), 96, 128)).save(buffer, format=fmt, **options)
    data = buffer.getvalue()
    return data, cv2.cvtColor(cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)


# What cameras and editors append after an image's end marker: a Samsung SEFH/SEFT block, a motion
# photo's MP4, arbitrary bytes.
TRAILERS = [b"trailer bytes", b"\x00" * 16 + b"SEFHXXXX\x01\x00\x00\x00" + b"\x00" * 8 + b"SEFT",
            b"\x00\x00\x00\x18ftypmp42\x00\x00\x00\x00mp42isom" + bytes(range(256))]


@pytest.mark.parametrize("fmt, options", [("JPEG", {"quality": 90}), ("JPEG", {"progressive": True}), ("PNG", {})])
@pytest.mark.parametrize("trailer", TRAILERS, ids=["text", "samsung", "motion_photo"])
def test_an_image_with_bytes_after_its_end_decodes_and_is_kept(fmt, options, trailer):
    data, pixels = photo(fmt, **options)
    assert np.array_equal(sd.data.shards.decode_image(data + trailer, fmt.lower()), pixels)


@pytest.mark.parametrize("fmt, options", [("JPEG", {"quality": 90}), ("JPEG", {"progressive": True}), ("PNG", {}),
                                          ("WEBP", {})])
@pytest.mark.parametrize("kept", [0.7, 0.95])
def test_an_image_cut_short_is_skipped_as_truncated_even_with_bytes_after_the_cut(fmt, options, kept):
    data, _ = photo(fmt, **options)
    for damaged in (data[: int(len(data) * kept)], data[: int(len(data) * kept)] + b"trailer bytes"):
        with pytest.raises(sd.data.shards.ImageSkip) as info:
            sd.data.shards.decode_image(damaged, fmt.lower())
        assert info.value.reason == "truncated_image"


def test_a_cut_jpeg_is_truncated_where_opencv_fills_its_missing_rows(monkeypatch):
    data, _ = photo("JPEG", quality=90)
    monkeypatch.setattr(cv2, "imdecode", lambda buffer, flags: np.full((96, 128, 3), 128, np.uint8))
    with pytest.raises(sd.data.shards.ImageSkip) as info:
        sd.data.shards.decode_image(data[: int(len(data) * 0.7)], "jpg")
    assert info.value.reason == "truncated_image"


def banded(height: int, width: int) -> np.ndarray:
    """Red, green, blue vertical bands over the first quarter, the middle half and the last quarter."""
    image = np.zeros((height, width, 3), np.uint8)
    image[:, : width // 4] = RED
    image[:, width // 4 : 3 * width // 4] = GREEN
    image[:, 3 * width // 4 :] = BLUE
    return image


@pytest.mark.parametrize("height, width, resolution, side, shape", [
    (100, 200, 64, "short", (64, 128, 3)),
    (100, 200, 64, "long", (32, 64, 3)),
    (300, 100, 64, "short", (192, 64, 3)),  # tall
    (300, 100, 64, "long", (64, 21, 3)),  # 100 * 64 / 300 = 21.3
    (5, 16, 8, "long", (3, 8, 3)),  # 2.5 rounds up, not to the even 2
    (10, 20, 64, "short", (64, 128, 3)),  # enlarged
])
def test_the_chosen_side_gets_the_resolution_and_the_other_follows(height, width, resolution, side, shape):
    assert sd.data.shards.resize_keep_aspect(banded(height, width), resolution, side).shape == shape


def test_nothing_is_cropped():
    # A centre square of this 2:1 image would lose the red and blue bands entirely.
    out = sd.data.shards.resize_keep_aspect(banded(100, 200), 64)  # -> 64 x 128: bands at 0-32, 32-96, 96-128
    assert (out[:, :30] == RED).all() and (out[:, 34:94] == GREEN).all() and (out[:, 98:] == BLUE).all()
    rows = banded(100, 200).transpose(1, 0, 2).copy()  # 200 high, 100 wide, the bands as rows
    tall = sd.data.shards.resize_keep_aspect(rows, 32, "long")  # -> 32 x 16
    assert (tall[:7] == RED).all() and (tall[9:23] == GREEN).all() and (tall[25:] == BLUE).all()


def test_area_filter_down_cubic_up_and_unchanged_at_size():
    image = np.random.default_rng(0).integers(0, 256, (30, 40, 3), np.uint8)
    down = sd.data.shards.resize_keep_aspect(image, 15)
    assert np.array_equal(down, cv2.resize(image, (20, 15), interpolation=cv2.INTER_AREA))
    up = sd.data.shards.resize_keep_aspect(image, 60)
    assert np.array_equal(up, cv2.resize(image, (80, 60), interpolation=cv2.INTER_CUBIC))
    assert sd.data.shards.resize_keep_aspect(image, 30) is image
    assert sd.data.shards.resize_keep_aspect(image, 40, "long") is image


def test_an_elongated_strip_is_refused_not_scaled_to_a_huge_image():
    strip = np.zeros((10, 20000, 3), np.uint8)  # short side 10 -> 64 would make 128000 x 64 pixels
    with pytest.raises(sd.data.shards.ImageSkip) as info:
        sd.data.shards.resize_keep_aspect(strip, 64)
    assert info.value.reason == "extreme_aspect"
    # Within a raised limit the short side still never drops under one pixel.
    assert sd.data.shards.resize_keep_aspect(np.zeros((1, 64, 3), np.uint8), 8, "long", max_aspect=100).shape == (1, 8, 3)
    with pytest.raises(ValueError, match="side must be one of"):
        sd.data.shards.resize_keep_aspect(strip[:, :20], 8, "width")

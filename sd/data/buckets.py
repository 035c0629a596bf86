"""Aspect-ratio buckets: train on images as they are instead of their centre squares.

A bucket is an image size ``(width, height)``. The default list for a base resolution R holds the
sizes whose sides are multiples of ``step`` (64 px for SD 1.x: its UNet halves the latent three times)
and whose pixel count is as close to R x R as the step allows without exceeding it, from 1:1 out to
a side ratio of 4 (``R/2`` to ``2R`` per side: 512x512, 576x448, 640x384, 704x320, 768x320, 832x256 ...
and their transposes). None has more pixels than R x R, so a batch of any bucket needs no more memory
than a square batch at R.

Each image goes to the bucket nearest its aspect ratio (in log ratio, so 2:1 and 1:2 are equally far
from 1:1), is scaled so that it covers the bucket and loses only the excess of its long side, cut
centred (``fit_to_bucket``: the crop's offset and the original size are returned, to be recorded).

At training time a bucket with fewer samples than one global batch cannot fill a batch of its own;
``merge_small`` folds it into the nearest bucket by aspect ratio, and ``fit_latents`` brings its
latents to that bucket's shape (a centred crop to the aspect ratio, then a bilinear resize);
``fit_images`` brings their conditioning images along, the same crop at pixel scale.
"""

from __future__ import annotations

import math
import re

import numpy as np

Bucket = tuple[int, int]  # (width, height) in pixels


def default_buckets(resolution: int, step: int = 64) -> list[Bucket]:
    """Sizes of about ``resolution``**2 pixels (never more), sides multiples of ``step`` from about half
    to twice ``resolution``; sorted from the tallest to the widest."""
    area = resolution * resolution
    low = max(step, resolution // 2 // step * step)
    buckets = {(resolution // step * step,) * 2} if resolution >= step else set()
    width = resolution // step * step + step
    while width <= 2 * resolution:
        height = area // width // step * step
        if height < low:
            break
        buckets.update({(width, height), (height, width)})
        width += step
    if not buckets:
        raise ValueError(f"no bucket of {step} px steps fits {resolution} px; use a smaller bucket step")
    return sorted(buckets, key=lambda b: b[0] / b[1])


def parse_bucket_list(text: str) -> list[Bucket]:
    """``"512x512,576x448"`` -> ``[(512, 512), (576, 448)]``; each side a positive multiple of 8."""
    buckets = []
    for part in (p.strip() for p in text.split(",")):
        match = re.fullmatch(r"(\d+)\s*[xX]\s*(\d+)", part)
        if not match:
            raise ValueError(f"bucket {part!r} is not WIDTHxHEIGHT (e.g. 576x448)")
        width, height = int(match.group(1)), int(match.group(2))
        if width <= 0 or height <= 0 or width % 8 or height % 8:
            raise ValueError(f"bucket {part}: width and height must be positive multiples of 8")
        buckets.append((width, height))
    if len(set(buckets)) != len(buckets):
        raise ValueError(f"bucket list {text!r} names a size twice")
    return sorted(buckets, key=lambda b: b[0] / b[1])


def name(bucket: Bucket) -> str:
    return f"{bucket[0]}x{bucket[1]}"


def nearest_bucket(width: int, height: int, buckets: list[Bucket]) -> int:
    """Index of the bucket nearest the aspect ratio ``width / height`` (in log ratio); between two
    equally near, the one with more pixels, then the first."""
    target = math.log(width / height)
    return min(range(len(buckets)),
               key=lambda i: (round(abs(math.log(buckets[i][0] / buckets[i][1]) - target), 12),
                              -buckets[i][0] * buckets[i][1], i))


def fit_to_bucket(image: np.ndarray, bucket: Bucket) -> tuple[np.ndarray, tuple[int, int]]:
    """``image`` (H, W, 3) scaled to cover ``bucket`` and its excess cut off, centred: ``(pixels of the
    bucket's size, (top, left))``, the crop's offset in the scaled image (SDXL's crop coordinates).

    The kept region is cut from the source before scaling (area filter down, cubic up), so the work is
    bounded by the input and the output, whatever the aspect ratio.
    """
    import cv2

    height, width = image.shape[:2]
    bucket_width, bucket_height = bucket
    scale = max(bucket_width / width, bucket_height / height)
    keep_width = min(width, max(1, round(bucket_width / scale)))
    keep_height = min(height, max(1, round(bucket_height / scale)))
    top, left = (height - keep_height) // 2, (width - keep_width) // 2
    region = image[top : top + keep_height, left : left + keep_width]
    if (keep_width, keep_height) != (bucket_width, bucket_height):
        shrink = keep_width >= bucket_width and keep_height >= bucket_height
        region = cv2.resize(region, (bucket_width, bucket_height),
                            interpolation=cv2.INTER_AREA if shrink else cv2.INTER_CUBIC)
    return np.ascontiguousarray(region), (round(top * scale), round(left * scale))


def fit_latents(latents: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Latents ``(B, C, h, w)`` brought to ``shape`` ``(C, H, W)``: the centred region of the target's
    aspect ratio, resized bilinearly (antialiased when shrinking). For samples of a merged bucket only:
    the bucket they were encoded for had too few samples to fill a batch."""
    import torch

    _, _, h, w = latents.shape
    _, target_h, target_w = shape
    top, left, keep_h, keep_w = latent_crop(h, w, target_h, target_w)
    region = latents[:, :, top : top + keep_h, left : left + keep_w]
    return _resized(region, target_h, target_w).to(torch.float16).numpy()


def fit_images(images: np.ndarray, shape: tuple[int, ...], factor: int = 8) -> np.ndarray:
    """Pixel images ``(B, C, factor * h, factor * w)`` uint8 (conditioning images) of latents ``(., h, w)``
    brought to the latent ``shape`` ``(., H, W)`` as ``fit_latents`` brings those latents: the same region,
    its bounds ``factor`` times theirs, resized bilinearly to ``(factor * H, factor * W)`` and rounded, so
    each pixel stays under the latent it was encoded with."""
    import torch

    _, _, height, width = images.shape
    top, left, keep_h, keep_w = latent_crop(height // factor, width // factor, shape[-2], shape[-1])
    region = images[:, :, factor * top : factor * (top + keep_h), factor * left : factor * (left + keep_w)]
    resized = _resized(region, factor * shape[-2], factor * shape[-1])
    return resized.round().clamp(0, 255).to(torch.uint8).numpy()


def latent_crop(h: int, w: int, target_h: int, target_w: int) -> tuple[int, int, int, int]:
    """``(top, left, height, width)`` of the centred region of an ``h`` x ``w`` latent with the aspect ratio
    of ``target_h`` x ``target_w``."""
    scale = max(target_w / w, target_h / h)
    keep_w, keep_h = min(w, max(1, round(target_w / scale))), min(h, max(1, round(target_h / scale)))
    return (h - keep_h) // 2, (w - keep_w) // 2, keep_h, keep_w


def _resized(region: np.ndarray, target_h: int, target_w: int):
    """``region`` ``(B, C, h, w)`` as a float32 tensor of ``(B, C, target_h, target_w)``, bilinear
    (antialiased when shrinking)."""
    import torch
    import torch.nn.functional as F

    tensor = torch.from_numpy(np.ascontiguousarray(region)).float()
    keep_h, keep_w = region.shape[-2:]
    return F.interpolate(tensor, size=(target_h, target_w), mode="bilinear", align_corners=False,
                         antialias=keep_h > target_h or keep_w > target_w)


def aspect(shape: tuple[int, ...]) -> float:
    """Width over height of a latent shape ``(C, h, w)``."""
    return shape[-1] / shape[-2]


def merge_small(counts: dict[tuple, int], minimum: int) -> dict[tuple, tuple]:
    """Where each latent shape's samples train: ``{shape: shape it trains at}``.

    While the smallest group holds fewer than ``minimum`` samples (one global batch) and another
    group is left, it joins the group nearest in aspect ratio (log ratio; between equals, the larger
    group): its samples are not lost, they train at that group's shape.
    """
    target = {shape: shape for shape in counts}
    groups = {shape: n for shape, n in counts.items() if n > 0}
    while len(groups) > 1:
        small = min(groups, key=lambda s: (groups[s], aspect(s), s))
        if groups[small] >= minimum:
            break
        into = min((s for s in groups if s != small),
                   key=lambda s: (round(abs(math.log(aspect(s) / aspect(small))), 12), -groups[s], s))
        groups[into] += groups.pop(small)
        for shape, goes in target.items():
            if goes == small:
                target[shape] = into
    return target

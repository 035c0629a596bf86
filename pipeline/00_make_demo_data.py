"""Stage 00: a synthetic captioned dataset for the built-in demo, written as image shards.

    python pipeline/00_make_demo_data.py --out runs/demo/shards [--count 4000] [--size 64] [--seed 0]

Each image is one shape (circle, square, triangle) in one of six colours on a white background,
captioned "a red circle on a white background". Some colour x shape combinations are held out of the
training data (``--holdout``) so the demo can test whether the model composes what it learned.
Writes NNNNN.tar + NNNNN_stats.json shards, ``demo_prompts.json`` (the seen and held-out
combinations and the palette) and ``prompts.txt`` (all of them, one per line, for sampling); with
``--vae_count N``, also N images of the shapes in cyan (``VAE_ONLY_PALETTE``) into ``--vae_out``, for
training the VAE only, so that it decodes a colour the UNet never sees (the demo's new concept).
Seeded: the same flags give the same bytes.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

import sd.data.shards
import sd.data.stages
import sd.files
import sd.runtime

STAGE = "00_make_demo_data"
PALETTE = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 200, 30),
           "purple": (140, 60, 180), "orange": (245, 130, 30)}
# Colours the VAE is trained on (--vae_count) and the UNet's data never has: the demo's new concept
# (demo/concept.py) teaches one of them to the trained UNet, as a VAE trained on a broad image set can
# encode colours a fine-tuning set brings.
VAE_ONLY_PALETTE = {"cyan": (20, 190, 200)}
SHAPES = ("circle", "square", "triangle")
BACKGROUND = (255, 255, 255)
DEFAULT_HOLDOUT = "blue circle,yellow square,purple triangle"
SUPERSAMPLE = 4  # draw large, then downscale: anti-aliased edges like a real photo's


def parse_args(argv):
    parser = sd.data.stages.StageArgumentParser(__file__, __doc__)
    parser.add_out("output folder for the shards and demo_prompts.json")
    parser.add_argument("--count", type=int, default=4000, help="training images")
    parser.add_argument("--size", type=int, default=64, help="image side in pixels")
    parser.add_argument("--shard_size", type=int, default=1000, help="images per shard")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--vae_count", type=int, default=0,
                        help="also this many images of the shapes in VAE_ONLY_PALETTE's colours (cyan), for the VAE "
                             "only: a VAE that has seen only the palette decodes every other colour as one of it")
    parser.add_argument("--vae_out", help="folder of the --vae_count images' shards (default: OUT/../vae_shards)")
    parser.add_argument("--holdout", default=DEFAULT_HOLDOUT,
                        help="comma-separated 'colour shape' pairs kept out of training")
    parser.shapes_outputs("count", "size", "shard_size", "seed", "vae_count", "holdout")
    args = parser.parse_args(argv)
    if args.count < 1 or args.size < 16 or args.shard_size < 1 or args.vae_count < 0:
        parser.error("--count and --shard_size must be >= 1, --size >= 16 and --vae_count >= 0")
    args = argparse.Namespace(**{**vars(args), "holdout": [tuple(pair.split()) for pair in args.holdout.split(",")
                                                           if pair.strip()]})
    for pair in args.holdout:
        if len(pair) != 2 or pair[0] not in PALETTE or pair[1] not in SHAPES:
            parser.error(f"--holdout: {' '.join(pair)!r} is not '<colour> <shape>' with a colour of "
                         f"{sorted(PALETTE)} and a shape of {list(SHAPES)}")
    return args


def caption(colour: str, shape: str) -> str:
    return f"a {colour} {shape} on a white background"


def draw_shape(colour: str, shape: str, size: int, rng: np.random.Generator,
               palette: dict | None = None) -> tuple[np.ndarray, dict]:
    """RGB ``(size, size, 3)``: the shape about 45-70% of the image wide, its centre jittered.
    ``palette``: colour name -> RGB (default: PALETTE)."""
    scale = SUPERSAMPLE * size
    extent = rng.uniform(0.45, 0.7) * scale
    cx, cy = (0.5 + rng.uniform(-0.08, 0.08, size=2)) * scale
    image = Image.new("RGB", (scale, scale), BACKGROUND)
    draw = ImageDraw.Draw(image)
    half = extent / 2
    box = (cx - half, cy - half, cx + half, cy + half)
    fill = tuple((palette or PALETTE)[colour])
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:  # an upward triangle filling its box
        draw.polygon([(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)], fill=fill)
    small = image.resize((size, size), Image.LANCZOS)
    meta = {"colour": colour, "shape": shape, "extent": round(extent / scale, 3),
            "centre": [round(cx / scale, 3), round(cy / scale, 3)]}
    return np.asarray(small), meta


def png(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def write_shards(out: Path, count: int, args, pick, prefix: str) -> sd.data.stages.Summary:
    """``count`` images in shards of ``args.shard_size``; ``pick(i, rng)`` -> (colour name, shape,
    palette). Each shard has its own generator, so the stage resumes shard by shard with the same bytes."""
    summary = sd.data.stages.Summary(STAGE)
    shards = range(-(-count // args.shard_size))
    for index in summary.pending(out, list(shards)):
        start = index * args.shard_size
        shard_rng = np.random.default_rng([args.seed, index] + ([1] if prefix == "vae" else []))
        samples = []
        for i in range(start, min(count, start + args.shard_size)):
            colour, shape, palette = pick(i, shard_rng)
            array, meta = draw_shape(colour, shape, args.size, shard_rng, palette)
            text = caption(colour, shape)
            samples.append(sd.data.shards.ShardSample(f"{prefix}{i:06d}", png(array), "png", text,
                                               json.dumps({"caption": text, **meta}).encode()))
        summary.add(sd.data.stages.write_shard(out, index, samples, sd.data.stages.ShardStats()))
    return summary


@sd.data.stages.ends_cleanly_on_a_full_disk(STAGE)
def main(argv=None) -> int:
    sd.runtime.start_process(uses_torch=False)
    args = parse_args(argv)
    out = Path(args.out)
    seen = [(c, s) for c in PALETTE for s in SHAPES if (c, s) not in args.holdout]
    rng = np.random.default_rng(args.seed)
    combos = [seen[i] for i in rng.integers(0, len(seen), size=args.count)]
    sd.data.stages.keep_settings(args)
    summary = write_shards(out, args.count, args, lambda i, _: (*combos[i], PALETTE), "demo")
    if args.vae_count:
        def vae_only(i, shard_rng):
            colour = list(VAE_ONLY_PALETTE)[int(shard_rng.integers(len(VAE_ONLY_PALETTE)))]
            return colour, SHAPES[int(shard_rng.integers(len(SHAPES)))], VAE_ONLY_PALETTE

        vae_out = Path(args.vae_out) if args.vae_out else out.parent / "vae_shards"
        write_shards(vae_out, args.vae_count, args, vae_only, "vae").finish(vae_out, colours=list(VAE_ONLY_PALETTE))
    prompts = {"palette": PALETTE, "shapes": list(SHAPES), "background": BACKGROUND,
               "seen": [caption(c, s) for c, s in seen], "held_out": [caption(c, s) for c, s in args.holdout]}
    sd.files.write_json_atomic(out / "demo_prompts.json", prompts)
    sd.files.write_text_atomic(out / "prompts.txt", "".join(p + "\n" for p in prompts["seen"] + prompts["held_out"]))
    summary.finish(out, seen_combinations=len(seen), held_out=len(args.holdout))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The demo's aspect-ratio buckets: wide and tall images whose shape sits at one end.

    python demo/aspect.py images --prompts runs/demo/shards/demo_prompts.json --out runs/demo/aspect [--count 600]
    python demo/aspect.py report --out runs/demo/aspect

``images`` writes ``OUT/shards``: images captioned like the demo's ("a red circle on a white
background"), two in five 3:1 wide (288x96) with the shape in the left or right third, two in five
1:3 tall with it in the top or bottom third, one in five square with it in the middle (as the demo's
own). A centre square of a wide or tall image is white: the shape lies wholly outside it. Also
``OUT/prompts.txt`` (the seen prompts) for sampling.

``report`` scores the samples in ``OUT/samples_<run>_<wide|tall>`` (written by SD_ImageGen.py at
144x48 and 48x144 for the runs ``base``, ``buckets`` and ``square``): a sample counts when it
holds one shape (no other region of at least a quarter of its area), of the prompt's colour, whose
centre lies in an outer third of the long side, as in the training images. It prints and writes
``OUT/aspect.json``: that fraction (``at_end``), and the fraction whose largest shape has the
prompt's colour (``colour``), per run and orientation.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

import sd.cli
import sd.data.shards
import sd.data.stages
import sd.files
from demo.evaluate import report_table, step_parser

SIDE = 96  # the short side of the drawn images; SD_ImageGen samples at half of it
RUNS = {"base": "demo model (squares only)", "buckets": "fine-tuned in buckets", "square": "fine-tuned on centre squares"}
ORIENTATIONS = {"wide": (144, 48), "tall": (48, 144)}  # (width, height) of the samples


def draw_at_end(colour: str, shape: str, orientation: str, rng: np.random.Generator, palette: dict) -> np.ndarray:
    """RGB ``(SIDE, 3 SIDE, 3)`` (wide) or ``(3 SIDE, SIDE, 3)`` (tall): the shape, 55-75% of the short
    side across, in the first or last third of the long side, never reaching the middle third."""
    from PIL import Image, ImageDraw

    scale = 4 * SIDE  # drawn large, then scaled down: anti-aliased edges
    extent = rng.uniform(0.55, 0.75) * scale
    along = rng.uniform(0.02 * scale + extent / 2, scale - extent / 2 - 0.02 * scale)  # inside one third
    if rng.random() < 0.5:
        along = 3 * scale - along  # the far third
    across = (0.5 + rng.uniform(-0.05, 0.05)) * scale
    cx, cy = (along, across) if orientation == "wide" else (across, along)
    size = (3 * scale, scale) if orientation == "wide" else (scale, 3 * scale)
    image = Image.new("RGB", size, (255, 255, 255))
    draw, half, fill = ImageDraw.Draw(image), extent / 2, tuple(palette[colour])
    box = (cx - half, cy - half, cx + half, cy + half)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)], fill=fill)
    return np.asarray(image.resize((size[0] // 4, size[1] // 4), Image.LANCZOS))


def make_images(prompts_file: Path, out: Path, count: int, seed: int, shard_size: int = 500) -> None:
    stage00 = importlib.import_module("pipeline.00_make_demo_data")
    prompts = json.loads(prompts_file.read_text())
    palette = {k: tuple(v) for k, v in prompts["palette"].items()}
    seen = [(p.split()[1], p.split()[2]) for p in prompts["seen"]]
    summary = sd.data.stages.Summary("demo_aspect")
    for index in summary.pending(out / "shards", list(range(-(-count // shard_size)))):
        rng = np.random.default_rng([seed, index])
        samples = []
        for i in range(index * shard_size, min(count, (index + 1) * shard_size)):
            colour, shape = seen[int(rng.integers(len(seen)))]
            kind = ("wide", "wide", "tall", "tall", "square")[i % 5]
            if kind == "square":
                image = stage00.draw_shape(colour, shape, SIDE, rng, palette)[0]
            else:
                image = draw_at_end(colour, shape, kind, rng, palette)
            text = stage00.caption(colour, shape)
            samples.append(sd.data.shards.ShardSample(f"aspect{i:06d}", stage00.png(image), "png", text,
                                                 json.dumps({"caption": text, "kind": kind}).encode()))
        summary.add(sd.data.stages.write_shard(out / "shards", index, samples, sd.data.stages.ShardStats()))
    summary.finish(out / "shards")
    sd.files.write_text_atomic(out / "prompts.txt", "".join(p + "\n" for p in prompts["seen"]))
    print(f"{count} images (2/5 wide, 2/5 tall with the shape at an end, 1/5 square) in {out / 'shards'}")


def at_an_end(image: np.ndarray, colour: str, palette: dict, background) -> tuple[bool, bool]:
    """``(the largest shape has the prompt's colour, and it is the only shape and its centre lies in
    an outer third of the long side)``."""
    from demo import evaluate

    region = evaluate.largest_region(image, background)
    found, _ = evaluate.classify(image, palette, background)
    if region is None or found != colour:
        return False, False
    shapes = int((evaluate.foreground_regions(image, background)[1] >= region.sum() / 4).sum())
    rows, cols = np.nonzero(region)
    height, width = region.shape
    position = cols.mean() / width if width > height else rows.mean() / height
    return True, shapes == 1 and not 1 / 3 <= position <= 2 / 3


def score(folder: Path, palette: dict, background) -> dict:
    from PIL import Image

    records = json.loads((folder / "images.json").read_text())
    hits = [at_an_end(np.asarray(Image.open(folder / r["file"]).convert("RGB")), r["prompt"].split()[1], palette,
                      background) for r in records]
    n = len(hits)
    return {"colour": sum(c for c, _ in hits) / n, "at_end": sum(e for _, e in hits) / n, "n": n}


def report(out: Path, prompts_file: Path) -> dict:
    prompts = json.loads(prompts_file.read_text())
    palette, background = {k: tuple(v) for k, v in prompts["palette"].items()}, tuple(prompts["background"])
    table = {run: {o: score(out / f"samples_{run}_{o}", palette, background) for o in ORIENTATIONS}
             for run in RUNS if (out / f"samples_{run}_wide").exists()}
    return report_table(out / "aspect.json", table, RUNS)


def main(argv=None) -> int:
    parser = step_parser(__doc__, "aspect step's", 600, "how many", seed=2, prompts_required=True)
    args = parser.parse_args(argv)
    if args.action == "images":
        make_images(Path(args.prompts), Path(args.out), args.count, args.seed)
    else:
        report(Path(args.out), Path(args.prompts))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The demo's ControlNet: the shape drawn where a mask says, on the demo model, which only ever drew it near
the middle.

    python demo/control.py images --prompts runs/demo/shards/demo_prompts.json --out runs/demo/control [--count 2000]
    python demo/control.py report --prompts runs/demo/shards/demo_prompts.json --out runs/demo/control

``images`` writes ``OUT/shards``: images captioned like the demo's ("a red circle on a white background")
whose shape, 30-50% of the image across, lies anywhere, each with its silhouette as the conditioning image
``<key>.seg.png`` (white on black). It also writes the test cases: ``OUT/controls/NN.png``, the silhouette
of a seen prompt's shape 40% across, centred at 30% or 70% of each side (a corner, where the demo model never
draws), and ``OUT/controls.json`` (``[{"prompt", "control"}, ...]``).

``report`` scores the samples of each test case: ``OUT/samples_control`` (the ControlNet, conditioned on the
case's mask) and ``OUT/samples_base`` (the demo model on the same prompts, no control: chance), both from
SD_ImageGen.py with the cases' prompts in order. A sample's shape is its largest region off the background; it
matches when its intersection over union with the mask exceeds 0.5. It prints and writes
``OUT/control.json`` (the fraction that match, the mean IoU, and the fraction whose shape has the prompt's
colour) and ``OUT/control.png`` (per case: the mask, then ControlNet samples, then the demo model's).
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import numpy as np

import sd.data.shards
import sd.data.stages
import sd.files
from demo.evaluate import report_table, step_parser

SIDE = 64  # pixels of the drawn images (the demo's size)
NAME = "seg"  # the conditioning images' name: <key>.seg.png, encode_latents.py --control seg
CORNERS = ((0.3, 0.3), (0.7, 0.3), (0.3, 0.7), (0.7, 0.7))  # test centres (x, y) as fractions of the sides
CASES = 8  # test cases: seen prompts, two at each corner
RUNS = {"control": "ControlNet on the mask", "base": "demo model, no control (chance)"}
MATCH = 0.5  # IoU above which a sample's shape is where its mask is


def draw(colour: str, shape: str, centre: tuple[float, float], extent: float, palette: dict,
         side: int = SIDE) -> tuple[np.ndarray, np.ndarray]:
    """``(RGB (side, side, 3), silhouette (side, side) uint8)``: the shape ``extent`` of the side across at
    ``centre`` (fractions of the sides) on the demo's white, and the same shape white on black."""
    from PIL import Image, ImageDraw

    scale = 4 * side  # drawn large, then scaled down: anti-aliased edges
    cx, cy, half = centre[0] * scale, centre[1] * scale, extent * scale / 2
    image, mask = Image.new("RGB", (scale, scale), (255, 255, 255)), Image.new("L", (scale, scale), 0)
    for canvas, fill in ((ImageDraw.Draw(image), tuple(palette[colour])), (ImageDraw.Draw(mask), 255)):
        box = (cx - half, cy - half, cx + half, cy + half)
        if shape == "circle":
            canvas.ellipse(box, fill=fill)
        elif shape == "square":
            canvas.rectangle(box, fill=fill)
        else:  # an upward triangle filling its box, as the demo's
            canvas.polygon([(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)], fill=fill)
    size = (side, side)
    return (np.asarray(image.resize(size, Image.LANCZOS)), np.asarray(mask.resize(size, Image.LANCZOS)))


def png(array: np.ndarray) -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def make_images(prompts_file: Path, out: Path, count: int, seed: int, side: int = SIDE, shard_size: int = 500) -> None:
    stage00 = importlib.import_module("pipeline.00_make_demo_data")
    prompts = json.loads(prompts_file.read_text())
    palette = {k: tuple(v) for k, v in prompts["palette"].items()}
    seen = [(p.split()[1], p.split()[2]) for p in prompts["seen"]]
    summary = sd.data.stages.Summary("demo_control")
    for index in summary.pending(out / "shards", list(range(-(-count // shard_size)))):
        rng = np.random.default_rng([seed, index])
        samples = []
        for i in range(index * shard_size, min(count, (index + 1) * shard_size)):
            colour, shape = seen[int(rng.integers(len(seen)))]
            extent = rng.uniform(0.3, 0.5)
            centre = tuple(rng.uniform(extent / 2 + 0.02, 1 - extent / 2 - 0.02, size=2))
            image, mask = draw(colour, shape, centre, extent, palette, side)
            text = stage00.caption(colour, shape)
            sample = sd.data.shards.ShardSample(f"control{i:06d}", png(image), "png", text,
                                                json.dumps({"caption": text, "centre": [round(c, 3) for c in centre],
                                                            "extent": round(extent, 3)}).encode())
            sd.data.shards.add_member(sample, f"{NAME}.png", png(mask))
            samples.append(sample)
        summary.add(sd.data.stages.write_shard(out / "shards", index, samples, sd.data.stages.ShardStats()))
    summary.finish(out / "shards")
    write_cases(out, prompts, palette, seed, side)
    print(f"{count} images with their silhouettes ({NAME}) in {out / 'shards'}; {CASES} test masks in {out / 'controls'}")


def write_cases(out: Path, prompts: dict, palette: dict, seed: int, side: int) -> None:
    """The test cases: a seen prompt's silhouette at a corner, two per corner; also ``prompts.txt`` and
    ``controls.txt``, their prompts and masks a line each in the same order (SD_ImageGen.py's
    ``--prompts_file`` and one ``--control`` per prompt)."""
    rng = np.random.default_rng([seed, 1 << 20])
    chosen = rng.choice(len(prompts["seen"]), size=CASES, replace=False)
    cases = []
    for n, index in enumerate(chosen):
        prompt = prompts["seen"][int(index)]
        _, colour, shape = prompt.split()[:3]
        _, mask = draw(colour, shape, CORNERS[n % len(CORNERS)], 0.4, palette, side)
        path = out / "controls" / f"{n:02d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        from PIL import Image

        sd.files.save_png_atomic(path, Image.fromarray(mask))
        cases.append({"prompt": prompt, "control": str(path)})
    sd.files.write_text_atomic(out / "controls.json", json.dumps(cases, indent=1) + "\n")
    sd.files.write_text_atomic(out / "prompts.txt", "".join(case["prompt"] + "\n" for case in cases))
    sd.files.write_text_atomic(out / "controls.txt", "".join(case["control"] + "\n" for case in cases))


def iou(image: np.ndarray, mask: np.ndarray, background) -> float:
    """Intersection over union of the sample's largest region off the background with the mask (> 127)."""
    from demo import evaluate

    region = evaluate.largest_region(image, background)
    target = mask > 127
    if region is None:
        return 0.0
    union = np.logical_or(region, target).sum()
    return float(np.logical_and(region, target).sum() / union) if union else 0.0


def read_rgb(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def score(folder: Path, cases: list[dict], palette: dict, background) -> tuple[dict, dict]:
    """One run's row, and each case's samples (for the picture)."""
    from demo import evaluate

    try:
        records = json.loads((folder / "images.json").read_text())
    except (OSError, ValueError) as error:
        raise SystemExit(f"demo/control.py: {folder / 'images.json'}: {error}; sample the run again")
    by_prompt = {case["prompt"]: i for i, case in enumerate(cases)}
    ious, colours, images = [], [], {i: [] for i in range(len(cases))}
    for record in records:
        case = by_prompt.get(record["prompt"])
        if case is None:
            continue
        image = read_rgb(folder / record["file"])
        mask = read_rgb(Path(cases[case]["control"]))[..., 0]
        ious.append(iou(image, mask, background))
        found, _ = evaluate.classify(image, palette, background)
        colours.append(found == record["prompt"].split()[1])
        images[case].append(image)
    if not ious:
        raise SystemExit(f"demo/control.py: {folder} holds no sample of the test prompts; sample them again")
    return ({"match": float(np.mean([v > MATCH for v in ious])), "mean_iou": round(float(np.mean(ious)), 3),
             "colour": float(np.mean(colours)), "n": len(ious)}, images)


def report(out: Path, prompts_file: Path) -> dict:
    import sd.sampling

    prompts = json.loads(prompts_file.read_text())
    palette, background = {k: tuple(v) for k, v in prompts["palette"].items()}, tuple(prompts["background"])
    cases = json.loads((out / "controls.json").read_text())
    table, samples = {}, {}
    for run in RUNS:
        if (out / f"samples_{run}").exists():
            table[run], samples[run] = score(out / f"samples_{run}", cases, palette, background)
    rows = []
    for i, case in enumerate(cases[: len(CORNERS)]):  # one case per corner
        mask = np.repeat(read_rgb(Path(case["control"]))[..., :1], 3, axis=2)
        row = [mask] + [image for run in RUNS if run in samples for image in samples[run][i][:2]]
        rows.append((f"{case['prompt']}: mask, ControlNet x2, demo model x2", row))
    sd.sampling.save_grid(out / "control.png", rows)
    return report_table(out / "control.json", table, RUNS, numbers=("mean_iou",))


def main(argv=None) -> int:
    parser = step_parser(__doc__, "ControlNet step's", 2000, "how many", seed=3, prompts_required=True)
    parser.add_argument("--size", type=int, default=SIDE, help="images: side in pixels (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.action == "images":
        make_images(Path(args.prompts), Path(args.out), args.count, args.seed, args.size)
    else:
        report(Path(args.out), Path(args.prompts))
    return 0


if __name__ == "__main__":
    sys.exit(main())

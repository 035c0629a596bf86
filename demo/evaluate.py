"""Score how well generated demo images follow their prompts: colour, shape, and both.

    python demo/evaluate.py --images runs/demo/samples --prompts runs/demo/shards/demo_prompts.json --out runs/demo/eval.json

For each image (named in the sampler's images.json with its prompt): the shape is the largest
connected region of pixels far from the white background; its colour is the palette colour nearest
to the region's median, and its shape class comes from how much of its bounding box it fills (a
square fills it all, a circle pi/4, a triangle half). Accuracies are reported separately for the combinations seen in training and
for the held-out ones.

``preference_score(images, prompts)`` scores single images on the same reading, as the oracle that ranks
``pipeline/01g_draw_pairs.py``'s drawings into preference pairs (``--scorer demo.evaluate:preference_score``).
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image

import sd.cli
import sd.files

FOREGROUND_DISTANCE = 80  # RGB distance from white beyond which a pixel is shape, not background
# Fill-ratio boundaries: triangle 0.5 | circle 0.785 | square 1.0, split half way.
TRIANGLE_BELOW = 0.64
SQUARE_ABOVE = 0.89


def foreground_regions(image: np.ndarray, background=(255, 255, 255)) -> tuple[np.ndarray, np.ndarray]:
    """``(labels (H, W), areas)``: the connected regions of pixels far from the background (after a
    3x3 opening that cuts thin bridges), labelled 1.. with ``areas[i - 1]`` pixels (0 = background)."""
    import cv2

    distance = np.linalg.norm(image.astype(np.float32) - np.array(background, np.float32), axis=-1)
    mask = (distance > FOREGROUND_DISTANCE).astype(np.uint8)
    mask = cv2.morphologyEx(mask, cv2.MORPH_OPEN, np.ones((3, 3), np.uint8))
    _, labels, stats, _ = cv2.connectedComponentsWithStats(mask, connectivity=8)
    return labels, stats[1:, cv2.CC_STAT_AREA]


def largest_region(image: np.ndarray, background=(255, 255, 255)) -> np.ndarray | None:
    """Boolean ``(H, W)`` mask of the largest foreground region, or None when there is none of at
    least 12 pixels."""
    labels, areas = foreground_regions(image, background)
    if not len(areas) or areas.max() < 12:
        return None
    return labels == 1 + int(np.argmax(areas))


def classify(image: np.ndarray, palette: dict[str, tuple], background=(255, 255, 255)) -> tuple[str | None, str | None]:
    """``(colour, shape)`` measured from an RGB uint8 image; None where there is no foreground.

    The shape is the largest connected foreground region, so stray specks or smudges elsewhere in a
    sample do not count as part of it.
    """
    colour, shape, _ = measure(image, palette, background)
    return colour, shape


def measure(image: np.ndarray, palette: dict[str, tuple], background=(255, 255, 255)):
    """``classify``'s ``(colour, shape)`` and the region's median RGB (None, None, None: no foreground)."""
    region = largest_region(image, background)
    if region is None:
        return None, None, None
    median = np.median(image.astype(np.float32)[region], axis=0)
    colour = min(palette, key=lambda name: np.linalg.norm(median - np.array(palette[name], np.float32)))
    rows, cols = np.nonzero(region)
    fill = region.sum() / ((rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1))
    shape = "triangle" if fill < TRIANGLE_BELOW else "square" if fill > SQUARE_ABOVE else "circle"
    return colour, shape, median


def clearly(median: np.ndarray | None, colour: str, palette: dict[str, tuple]) -> bool:
    """Whether a shape of ``median`` colour is clearly ``colour``: nearer to it than half the distance
    from it to the nearest other palette colour. A new concept's colour must be drawn, not a blend
    of two known colours that happens to fall nearest to it (the demo base model's green, shifted
    towards the cyan its VAE decodes, was (30, 177, 138): 64 from cyan, 79 from green)."""
    if median is None:
        return False
    target = np.array(palette[colour], np.float32)
    others = min(np.linalg.norm(target - np.array(v, np.float32)) for name, v in palette.items() if name != colour)
    return float(np.linalg.norm(median - target)) < others / 2


def parse_prompt(prompt: str, palette, shapes) -> tuple[str, str]:
    words = prompt.split()
    colour = next(w for w in words if w in palette)
    shape = next(w for w in words if w in shapes)
    return colour, shape


def score(records: list[dict], images_dir: Path, prompts: dict) -> dict:
    """Accuracies by group: ``seen``, ``held_out`` and, when ``prompts`` has ``concepts`` (prompt ->
    [colour, shape] for a word the base model never saw, e.g. "a sks circle"), ``concept``, whose
    samples count in their colour only when they are ``clearly`` in it."""
    palette = {k: tuple(v) for k, v in prompts["palette"].items()}
    held_out = set(prompts["held_out"])
    concepts = prompts.get("concepts", {})
    groups = {"seen": [], "held_out": []} | ({"concept": []} if concepts else {})
    for record in records:
        image = np.asarray(Image.open(images_dir / record["file"]).convert("RGB"))
        if record["prompt"] in concepts:
            want_colour, want_shape = concepts[record["prompt"]]
        else:
            want_colour, want_shape = parse_prompt(record["prompt"], palette, prompts["shapes"])
        colour, shape, median = measure(image, palette, tuple(prompts["background"]))
        group = "concept" if record["prompt"] in concepts else "held_out" if record["prompt"] in held_out else "seen"
        right_colour = colour == want_colour and (group != "concept" or clearly(median, want_colour, palette))
        groups[group].append((right_colour, shape == want_shape))
    result = {}
    for group, hits in groups.items():
        n = len(hits)
        result[group] = {"colour": sum(c for c, _ in hits) / n if n else None,
                         "shape": sum(s for _, s in hits) / n if n else None,
                         "both": sum(c and s for c, s in hits) / n if n else None, "n": n}
    return result


def preference_score(images: list[np.ndarray], prompts: list[str]) -> list[float]:
    """The demo's oracle for preference pairs (``pipeline/01g_draw_pairs.py --scorer
    demo.evaluate:preference_score``): how well each RGB uint8 ``(H, W, 3)`` image draws its prompt ("a red
    circle on a white background"), higher is better. 1 point for the prompted colour and 1 for the prompted
    shape, both as ``measure`` reads the largest shape, plus ``colour_share`` of the prompted colour times 0.99, a
    term in [0, 1) that ranks images with the same points, so best against worst is rarely a tie. A prompt that
    names no palette colour or no shape is a ValueError naming it."""
    stage00 = importlib.import_module("pipeline.00_make_demo_data")
    palette, shapes, background = stage00.PALETTE, stage00.SHAPES, stage00.BACKGROUND
    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} images for {len(prompts)} prompts")
    scores = []
    for image, prompt in zip(images, prompts):
        try:
            want_colour, want_shape = parse_prompt(prompt, palette, shapes)
        except StopIteration:
            raise ValueError(f"{prompt!r} names no colour of {', '.join(palette)} or no shape of {', '.join(shapes)} "
                             "(the demo's prompts are 'a red circle on a white background')") from None
        colour, shape, _ = measure(image, palette, background)
        share = colour_share(image, want_colour, palette, background)
        scores.append(float(colour == want_colour) + float(shape == want_shape) + 0.99 * share)
    return scores


def colour_share(image: np.ndarray, colour: str, palette: dict[str, tuple], background=(255, 255, 255)) -> float:
    """The share of ``image``'s pixels nearer to palette colour ``colour`` than to every other palette colour and
    to the background: in [0, 1]."""
    references = np.array([palette[colour], *(rgb for name, rgb in palette.items() if name != colour), background],
                          np.float32)
    distance = np.linalg.norm(image.astype(np.float32)[..., None, :] - references, axis=-1)  # (H, W, colours + 1)
    return float((distance.argmin(axis=-1) == 0).mean())


def step_parser(description: str, folder: str, count: int, count_help: str, seed: int, prompts_required: bool):
    """The command line of a demo step with two actions: ``images`` (make its training images) and
    ``report`` (score its samples)."""
    parser = sd.cli.ArgumentParser(description=description)
    parser.add_argument("action", choices=("images", "report"))
    parser.add_argument("--out", required=True, help=f"the {folder} folder")
    parser.add_argument("--prompts", required=prompts_required,
                        help="demo_prompts.json of pipeline/00_make_demo_data.py")
    parser.add_argument("--count", type=int, default=count, help=f"images: {count_help} (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=seed, help="images: seed (default: %(default)s)")
    return parser


def report_table(path: Path, table: dict[str, dict], names: dict[str, str], numbers: tuple[str, ...] = ()) -> dict:
    """Write ``table`` (run -> scores, nested at most one level) as JSON to ``path`` and print it: a line
    per run, its name from ``names``, a column per score (fractions as percentages, the columns named in
    ``numbers`` as numbers, none as -)."""
    sd.files.write_text_atomic(path, json.dumps(table, indent=1) + "\n")
    flat = {run: {f"{group} {name}".strip(): value for group, inner in scores.items()
                  for name, value in (inner.items() if isinstance(inner, dict) else [("", inner)])}
            for run, scores in table.items()}
    columns = list(next(iter(flat.values()), {}))
    width = max(len(name) for name in names.values()) + 2
    print(f"{'':{width}s}" + "".join(f"{column:>16s}" for column in columns))
    for run, scores in flat.items():
        print(f"{names[run]:{width}s}" + "".join(f"{scores[c]:>16.0%}" if isinstance(scores[c], float)
                                                 and c not in numbers else f"{'-' if scores[c] is None else scores[c]:>16}"
                                                 for c in columns))
    return table


def main(argv=None) -> int:
    parser = sd.cli.ArgumentParser(description=__doc__)
    parser.add_argument("--images", required=True, help="folder written by SD_ImageGen.py (with images.json)")
    parser.add_argument("--prompts", required=True, help="demo_prompts.json written by pipeline/00_make_demo_data.py "
                        "(or demo/concept.py's concept_prompts.json)")
    parser.add_argument("--out", required=True, help="where to write eval.json")
    args = parser.parse_args(argv)
    images_dir = Path(args.images)
    records = json.loads((images_dir / "images.json").read_text())
    prompts = json.loads(Path(args.prompts).read_text())
    result = score(records, images_dir, prompts)
    sd.files.write_text_atomic(Path(args.out), json.dumps(result, indent=1) + "\n")
    for group, values in result.items():
        if values["n"]:
            print(f"{group:9s} n={values['n']:3d}  colour {values['colour']:.0%}  shape {values['shape']:.0%}  "
                  f"both {values['both']:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The demo's FID: its samples against fresh ground-truth drawings of the same prompts (SD_Eval.py).

    python demo/fid.py --samples runs/demo/samples --prompts runs/demo/shards/demo_prompts.json --out runs/demo/fid

For the prompts of the samples' ``images.json`` (each as often as it was sampled) this draws, as the
training data was drawn but with other seeds (so no image is one the model trained on): a reference
set, a second ground-truth set, and a blank canvas per image. It scores the samples, the second set
(the floor: the FID between two ground-truth sets of this size) and the blank canvases (a model that
draws nothing) against the reference with ``SD_Eval.py --features tiny``, the offline stand-in
features (seeded random convolutions, not Inception): the three numbers compare with each other,
not with published FIDs. Writes ``OUT/fid.json``.
"""

from __future__ import annotations

import importlib
import json
import runpy
import sys
from pathlib import Path

import numpy as np
from PIL import Image

import sd.cli
import sd.files
from demo.evaluate import parse_prompt

ROOT = Path(__file__).resolve().parents[1]
# SD_Eval.py's command line, in this process (a script at the root, not a module of the package).
sd_eval_main = runpy.run_path(str(ROOT / "SD_Eval.py"), run_name="SD_Eval")["main"]

demo_data = importlib.import_module("pipeline.00_make_demo_data")
SETS = {"reference": 1001, "ground_truth": 1002}  # seeds of the drawings (the training images use seed 0)
FEATURES_NOTE = "tiny: SD_Eval.py's offline stand-in (seeded random conv features, not Inception)"


def draw_set(folder: Path, prompts: list[str], size: int, seed: int, palette: dict, shapes) -> None:
    """One drawing per prompt, ``NNNNNN.png``, from one seeded stream."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i, prompt in enumerate(prompts):
        colour, shape = parse_prompt(prompt, palette, shapes)
        image, _ = demo_data.draw_shape(colour, shape, size, rng, palette)
        sd.files.save_png_atomic(folder / f"{i:06d}.png", Image.fromarray(image))


def blank_set(folder: Path, n: int, size: int, background) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    canvas = Image.fromarray(np.full((size, size, 3), background, np.uint8))
    for i in range(n):
        sd.files.save_png_atomic(folder / f"{i:06d}.png", canvas)


def fid(images: Path, reference: Path, out: Path) -> float:
    code = sd_eval_main(["--images", str(images), "--reference", str(reference), "--features", "tiny",
                         "--clip_model", "none", "--device", "cpu", "--out", str(out)])
    if code != 0:
        raise SystemExit(f"demo/fid.py: SD_Eval.py could not score {images}")
    return json.loads(out.read_text())["fid"]


def main(argv=None) -> int:
    parser = sd.cli.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", required=True, help="folder written by SD_ImageGen.py (with images.json)")
    parser.add_argument("--prompts", required=True, help="demo_prompts.json written by pipeline/00_make_demo_data.py")
    parser.add_argument("--out", required=True, help="folder for the drawn sets and fid.json")
    args = parser.parse_args(argv)
    samples, out = Path(args.samples), Path(args.out)
    records = json.loads((samples / "images.json").read_text())
    spec = json.loads(Path(args.prompts).read_text())
    palette = {name: tuple(rgb) for name, rgb in spec["palette"].items()}
    prompts = [record["prompt"] for record in records]
    size = Image.open(samples / records[0]["file"]).size[0]
    for name, seed in SETS.items():
        draw_set(out / name, prompts, size, seed, palette, spec["shapes"])
    blank_set(out / "blank", len(prompts), size, tuple(spec["background"]))
    result = {"features": FEATURES_NOTE, "n": len(prompts)}
    for name, images in (("samples", samples), ("ground_truth", out / "ground_truth"), ("blank", out / "blank")):
        result[name] = fid(images, out / "reference", out / f"scores_{name}.json")
    sd.files.write_json_atomic(out / "fid.json", result)
    print(f"FID against fresh ground-truth drawings ({result['n']} images, {FEATURES_NOTE}):")
    print(f"  ground truth (floor) {result['ground_truth']:8.2f}\n  demo model           {result['samples']:8.2f}\n"
          f"  blank canvas         {result['blank']:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

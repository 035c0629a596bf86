"""The demo's new concept: a colour the base model never saw, taught by a DreamBooth LoRA, by a learned
token (textual inversion), and by both in one run (pivotal tuning).

    python demo/concept.py images --prompts runs/demo/shards/demo_prompts.json --out runs/demo/concept \
        --vae runs/demo/vae [--count 12]
    python demo/concept.py report --out runs/demo/concept

``images`` draws ``--count`` cyan circles (the demo's shapes, in a colour outside its palette) into
``OUT/instance/``, and writes ``OUT/concept_prompts.json`` (the demo's prompts and palette plus cyan,
with the instance prompts as concepts: "a sks circle on a white background" and, with the learned
token, "a <cyan-sks> circle on a white background" are a cyan circle; with ``--vae``, cyan is scored as
the VAE gives it back, the colour a latent model can draw), ``OUT/prompts.txt`` (the seen prompts, then
the instance prompt) and ``OUT/prompts_embedding.txt`` (the seen prompts, then the token's prompt) for
sampling. ``report`` reads the evaluations ``OUT/eval_base.json``, ``OUT/eval_prior.json``,
``OUT/eval_no_prior.json``, ``OUT/eval_embedding.json`` and ``OUT/eval_pivotal.json`` (written by
demo/evaluate.py for the base model, the two adapters, the token and the token with a LoRA; those there are) and prints and writes ``OUT/concept.json``: the
concept's accuracy, and the seen prompts' accuracy before and after (the token leaves every weight as
it was, so the seen prompts' images are the base model's).
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

import sd.cli
import sd.data.dreambooth
import sd.files
import sd.model
from demo.evaluate import report_table, step_parser

CONCEPT_PROMPT = "a sks circle on a white background"
EMBEDDING_PROMPT = "a <cyan-sks> circle on a white background"  # configs/demo_embedding.yaml's instance prompt
CONCEPT = ("cyan", "circle")
CYAN = (20, 190, 200)  # pipeline/00_make_demo_data.py's VAE_ONLY_PALETTE
RUNS = {"base": "base model", "prior": "LoRA with prior preservation", "no_prior": "LoRA without prior preservation",
        "embedding": "textual inversion (a learned token)",
        "pivotal": "pivotal tuning (a learned token and a LoRA)"}


def as_decoded(images: list[np.ndarray], vae_path: str, background) -> tuple[int, int, int]:
    """The median shape colour of ``images`` after a round trip through the VAE: the colour a model
    working in its latents can produce for them (the small demo VAE shifts colours it saw little of)."""
    import torch

    vae = sd.model.load_vae(vae_path)
    latents = torch.from_numpy(sd.data.dreambooth.encode_images(vae, images, torch.device("cpu"))).float()
    with torch.no_grad():
        decoded = ((vae.decode(latents).sample.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).numpy()
    shape = np.stack([np.linalg.norm(i.astype(np.float32) - np.array(background, np.float32), axis=-1) > 80
                      for i in images])
    return tuple(int(v) for v in np.median(decoded[shape], axis=0))


def make_images(prompts_file: Path, out: Path, count: int, size: int, seed: int, vae: str | None) -> None:
    from PIL import Image

    stage00 = importlib.import_module("pipeline.00_make_demo_data")
    prompts = json.loads(prompts_file.read_text())
    palette = {**{k: tuple(v) for k, v in prompts["palette"].items()}, CONCEPT[0]: CYAN}
    rng = np.random.default_rng(seed)
    images = [stage00.draw_shape(CONCEPT[0], CONCEPT[1], size, rng, palette)[0] for _ in range(count)]
    for i, image in enumerate(images):
        sd.files.write_atomic(out / "instance" / f"sks_{i:03d}.png", lambda tmp: Image.fromarray(image).save(tmp, "PNG"))
    reference = as_decoded(images, vae, prompts["background"]) if vae else CYAN
    print(f"cyan {CYAN} comes back from the VAE as {reference}: the concept's colour in the evaluation")
    concept_prompts = {**prompts, "palette": {**palette, CONCEPT[0]: reference},
                       "concepts": {CONCEPT_PROMPT: list(CONCEPT), EMBEDDING_PROMPT: list(CONCEPT)},
                       "concept_drawn": CYAN}
    sd.files.write_text_atomic(out / "concept_prompts.json", json.dumps(concept_prompts, indent=1) + "\n")
    sd.files.write_text_atomic(out / "prompts.txt", "".join(p + "\n" for p in prompts["seen"] + [CONCEPT_PROMPT]))
    sd.files.write_text_atomic(out / "prompts_embedding.txt",
                               "".join(p + "\n" for p in prompts["seen"] + [EMBEDDING_PROMPT]))
    print(f"{count} instance images of {CONCEPT_PROMPT!r} (cyan {CYAN}) in {out / 'instance'}")


def report(out: Path) -> dict:
    scores = {name: json.loads((out / f"eval_{name}.json").read_text()) for name in RUNS
              if (out / f"eval_{name}.json").exists()}
    table = {name: {"concept_colour": s["concept"]["colour"], "concept_both": s["concept"]["both"],
                    "seen_colour": s["seen"]["colour"], "seen_both": s["seen"]["both"]} for name, s in scores.items()}
    return report_table(out / "concept.json", table, RUNS)


def main(argv=None) -> int:
    parser = step_parser(__doc__, "concept's", 12, "instance images", seed=1, prompts_required=False)
    parser.add_argument("--size", type=int, default=64, help="images: pixels (default: %(default)s)")
    parser.add_argument("--vae", help="images: the demo VAE; the concept's colour in the evaluation is cyan as it "
                        "comes back from an encode and decode (default: cyan as drawn)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.action == "images":
        if not args.prompts:
            parser.error("images needs --prompts")
        make_images(Path(args.prompts), out, args.count, args.size, args.seed, args.vae)
    else:
        report(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Evaluate a model by FID, CLIP score and Inception Score, on demand or during training.

    python SD_Eval.py --images DIR --reference DIR_OR_NPZ [--prompts FILE] [--features inception|tiny] [--out FILE]
    python SD_Eval.py --ckpt PATH --prompts FILE --n N --images DIR --reference DIR_OR_NPZ [--steps 50 --cfg 7.5 ...]
    torchrun --nproc_per_node 8 SD_Eval.py --ckpt PATH --num_prompts N ...  # prompts shared out across the ranks
    python SD_Eval.py --runs RUN_DIR_OR_PHASE_YAML ... --prompts FILE --n N --reference NPZ --table phases.md
    python SD_Eval.py --reference DIR [--reference_size 512]    # only compute and cache the reference statistics

Scoring ``--images DIR``: the images its ``images.json`` names (SD_ImageGen.py and this script write
one), else every image in DIR; sorted by name. The prompts are ``--prompts FILE`` (line i for the
i-th image) or, without it, those of ``images.json``; CLIP score needs them. ``--ckpt`` first generates one image per prompt (the
first ``--n`` prompts; image i uses seed ``--seed + i``) into ``--images`` through the sampling path
of SD_ImageGen.py, skipping images already there, then scores them. ``--runs`` does that for the
newest complete checkpoint of each run (or phase YAML's ``out_dir``) and writes one table.

Scores (printed, and written as JSON to ``--out``, default ``DIR/scores.json``):
* ``fid``: Frechet distance between Gaussians fitted to the features of the images and of the
  reference (Heusel et al. 2017). ``--reference`` is a folder of images (its statistics are computed
  once and cached in it as ``fid_stats.<features>[.<size>].npz``) or such an ``.npz`` with ``mu``
  and ``sigma`` (the layout pytorch-fid and clean-fid write, so published reference statistics load).
* ``clip_score``: 100 x the cosine similarity of CLIP's image and text embeddings, floored at 0,
  averaged over the images (the definition of torchmetrics' CLIPScore and of MLPerf's evaluation).
* ``inception_score`` (``--inception_score``): exp of the mean KL divergence between each image's
  class distribution and their mean, over 10 consecutive splits (Salimans et al. 2016).

Feature extractors (``--features``):
* ``inception``: torch-fidelity's InceptionV3, the 2015-12-05 TensorFlow graph's weights with the
  TensorFlow 1.x bilinear resize to 299 px reimplemented: its FID reproduces the reference
  implementation's (TTUR, and pytorch-fid's) numbers. torchmetrics' FID uses the same network but by
  default resizes with antialiasing, so its numbers differ from the reference; clean-fid's default
  mode resizes differently by design (a different metric). Its weights download from torch-fidelity's
  release on first use; it needs ``pip install torch-fidelity`` (which needs torchvision). CLIP:
  ``--clip_model`` (transformers ``CLIPModel``; default openai/clip-vit-large-patch14; MLPerf uses
  laion/CLIP-ViT-H-14-laion2B-s32B-b79K).
* ``tiny``: offline stand-ins with the same interfaces, seeded random weights: a small conv net
  (64 features, 10 logits) and a small ``CLIPModel`` with the CLIP tokenizer. Their numbers compare
  models with each other on one setup only; they are not comparable with published FIDs.

Deterministic: images are cut into batches of ``--batch_size`` in index order whatever the number of
ranks; batch k is made on rank k mod world size, and every batch's features are added to the
statistics in batch order, so the scores are the same on 1 or 8 GPUs and on every re-run. Memory is
bounded by the batch: the statistics are running sums over chunks of 1024 features, never the
features of the whole set.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import sd.cli
import sd.distributed
import sd.files
import sd.formats
import sd.run_folder
import sd.runtime
import sd.train.config
import sd.train.config_loading
from sd.distributed import Dist
from sd.evaluation import (
    DEFAULT_CLIP_MODEL,
    FEATURES,
    EvalError,
    Extractors,
    Sampling,
    evaluate_folder,
    evaluate_pipeline,
    read_prompts,
    reference_stats,
)

log = logging.getLogger("sd_eval")


# =============================================================================================
# Command line
# =============================================================================================


def parse_args(argv=None):
    parser = sd.cli.ArgumentParser(description=__doc__)
    parser.add_argument("--images", help="folder of the images to score (with --ckpt: where they are generated)")
    parser.add_argument("--reference", required=True, help="folder of reference images, or an .npz of their "
                        "statistics (mu, sigma) computed with the same --features")
    parser.add_argument("--reference_size", type=int, default=0,
                        help="scale the reference images' centre square to this many pixels first; 0 = as stored")
    parser.add_argument("--prompts", help="prompts: a text file (one per line) or a .tsv/.csv with a 'caption' column; "
                        "line i belongs to image i (by name), or with --ckpt / --runs, the prompts to generate")
    parser.add_argument("--num_prompts", type=int,
                        help="with --ckpt / --runs: generate for the first N prompts (default: all)")
    parser.add_argument("--n", "--images_per_prompt", dest="n", type=int, default=1,
                        help="with --ckpt / --runs: images per prompt, as in SD_ImageGen.py (default: %(default)s; "
                        "image i has seed + i); under torchrun spell it --images_per_prompt (torchrun's own parser "
                        "takes --n for an abbreviation of its flags)")
    parser.add_argument("--features", choices=FEATURES, default="inception",
                        help="inception (torch-fidelity's InceptionV3 + --clip_model) or tiny (offline stand-ins)")
    parser.add_argument("--clip_model", default=DEFAULT_CLIP_MODEL,
                        help="CLIP for the CLIP score (hub id or folder; none = no CLIP score); with --features tiny the "
                        "stand-in CLIP unless none")
    parser.add_bool("--inception_score", help="also compute the Inception Score")
    parser.add_argument("--batch_size", type=int, default=16, help="images per generation and feature batch")
    parser.add_argument("--out", help="JSON of the scores (default: IMAGES/scores.json)")
    parser.add_argument("--ckpt", help="generate the images first with this checkpoint (any SD_ImageGen.py --ckpt)")
    parser.add_argument("--runs", nargs="+", metavar="RUN", help="evaluate the newest checkpoint of each run folder "
                        "(or phase YAML's out_dir) and write --table")
    parser.add_argument("--table", help="with --runs: the table (Markdown; a .json beside it)")
    parser.add_argument("--steps", type=int, default=None, help="sampler steps (default: 50; 4 with --sampler lcm, "
                        "which takes 1..50; a DMD generator's own with onestep, which takes 1..4)")
    parser.add_argument("--cfg", type=float, default=None, help="classifier-free guidance scale (default: 7.5; 1 with "
                        "--sampler lcm and onestep)")
    parser.add_argument("--sampler", choices=("auto", *sd.sampling.SAMPLERS), default="auto", help="the sampler; "
                        "auto = lcm for a run of ours trained with distill: lcm, onestep for distill: dmd, flow_euler "
                        "for a model trained as a flow, else ddim (each run's own with --runs; default: %(default)s)")
    parser.add_argument("--negative", default="", help="negative prompt")
    parser.add_argument("--seed", type=int, default=0, help="image i uses seed + i")
    parser.add_argument("--height", type=int, default=512, help="pixels, a multiple of 8")
    parser.add_argument("--width", type=int, default=512, help="pixels, a multiple of 8")
    parser.add_bool("--no_ema", help="use the live weights of our checkpoints, not the EMA")
    parser.add_argument("--device", default="auto", help="auto (this rank's GPU, else CPU), cpu, cuda")
    parser.add_argument("--precision", choices=("auto", *sd.runtime.PRECISIONS), default="auto",
                        help="generation precision; auto = bf16 on CUDA, fp32 on CPU (features are always fp32)")
    args = parser.parse_args(argv)
    if args.runs and not (args.table and args.prompts):
        parser.error("--runs needs --prompts (what to generate) and --table (where the table goes)")
    if args.ckpt and not args.images:
        parser.error("--ckpt needs --images DIR: where the generated images go")
    if (args.ckpt or args.runs) and not args.prompts:
        parser.error("--ckpt needs --prompts: the prompts to generate")
    if args.sampler == "auto" and args.ckpt:
        args.sampler = sd.formats.recorded_default_sampler(args.ckpt)
    # --runs with auto: each run's sampler and its defaults (sampling_of); checked here as ddim's
    sampler = "ddim" if args.sampler == "auto" else args.sampler
    try:  # onestep: the steps the DMD generator was trained for
        steps, cfg = sd.formats.sampling_defaults(args.ckpt or "", sampler, args.steps, args.cfg, 50, 7.5)
    except (KeyError, ValueError, OSError) as problem:
        parser.error(f"--sampler {sampler}: {problem}")
    resolved = {"steps": steps, "cfg": cfg} if args.sampler != "auto" else {}
    for name in ("batch_size", "steps", "n") + (("num_prompts",) if args.num_prompts is not None else ()):
        if {**vars(args), "steps": steps, **resolved}[name] < 1:
            parser.error(f"--{name} must be >= 1")
    problem = sd.sampling.settings_error(sampler, steps, cfg)
    if problem:
        parser.error(f"--sampler {args.sampler}, --steps {steps}, --cfg {cfg:g}: {problem}")
    if not 0 <= args.seed < 2**63:
        parser.error(f"--seed must be a whole number in [0, 2^63), got {args.seed}")
    if args.height % 8 or args.width % 8 or min(args.height, args.width) <= 0:
        parser.error("--height and --width must be positive multiples of 8")
    if args.reference_size < 0:
        parser.error("--reference_size must be >= 0")
    if str(args.clip_model).lower() == "none":
        resolved["clip_model"] = None
    elif args.features == "tiny":
        resolved["clip_model"] = "tiny"  # the stand-in CLIP
    return argparse.Namespace(**{**vars(args), **resolved})


def sampling_of(args, ckpt: str) -> Sampling:
    """The sampling of ``ckpt``'s images: ``--sampler auto`` and its step and guidance defaults resolved for it."""
    sampler, steps, cfg = args.sampler, args.steps, args.cfg
    if sampler == "auto":
        sampler = sd.formats.recorded_default_sampler(ckpt)
        try:
            steps, cfg = sd.formats.sampling_defaults(ckpt, sampler, steps, cfg, 50, 7.5)
        except (KeyError, ValueError, OSError) as problem:
            raise EvalError(f"{ckpt}: --sampler auto ({sampler}): {problem}") from None
        problem = sd.sampling.settings_error(sampler, steps, cfg)
        if problem:
            raise EvalError(f"{ckpt}: --sampler auto ({sampler}), --steps {steps}, --cfg {cfg:g}: {problem}")
    return Sampling(steps=steps, cfg=cfg, sampler=sampler, negative=args.negative, seed=args.seed,
                    height=args.height, width=args.width)


def evaluate_checkpoint(args, ckpt: str, images_dir: Path, prompts: list[str], extractors: Extractors,
                        reference: dict, d: Dist) -> dict:
    pipe = sd.formats.load_pipeline(ckpt, use_ema=not args.no_ema)
    pipe.to(d.device, sd.runtime.resolve_precision(args.precision, d.device))
    sampling = sampling_of(args, ckpt)
    scores = evaluate_pipeline(pipe, prompts, sampling, extractors, reference, d, args.batch_size,
                               images_dir, args.inception_score, pipe.source)
    return {**scores, "ckpt": str(ckpt), **vars(sampling)}


def evaluate_runs(args, prompts: list[str], extractors: Extractors, reference: dict, d: Dist) -> list[dict]:
    """The newest complete checkpoint of each run: its scores, step and images seen (cached per checkpoint)."""
    rows = []
    for run in args.runs:
        run_dir = run_folder(run)
        folder = sd.run_folder.latest_checkpoint(run_dir / "checkpoints")
        if folder is None:
            raise EvalError(f"{run_dir}: no complete checkpoint under {run_dir / 'checkpoints'}")
        state = sd.run_folder.load_torch(folder / "train_state.pt")
        out = run_dir / "eval" / folder.name
        scores = evaluate_checkpoint(args, str(folder), out / "images", prompts, extractors, reference, d)
        row = {"run": str(run), "step": int(state["step"]), "images_seen": int(state["samples_seen"]), **scores}
        if d.is_main:
            sd.files.write_json_atomic(out / "scores.json", row)
        rows.append(row)
    return rows


def run_folder(run: str) -> Path:
    """A run folder, or a phase YAML's ``out_dir``."""
    if run.endswith((".yaml", ".yml")):
        return Path(sd.train.config_loading.load_config(["--config", run], check_paths=False).out_dir)
    return Path(run)


def write_table(path: Path, rows: list[dict]) -> None:
    lines = ["| run | step | images seen | FID | CLIP score |", "|---|---:|---:|---:|---:|"]
    for row in rows:
        clip = f"{row['clip_score']:.2f}" if "clip_score" in row else "-"
        lines.append(f"| {row['run']} | {row['step']} | {row['images_seen']:,} | {row['fid']:.3f} | {clip} |")
    sd.files.write_text_atomic(path, "\n".join(lines) + "\n")
    sd.files.write_json_atomic(path.with_suffix(".json"), rows)


def report(scores: dict) -> str:
    parts = [f"FID {scores['fid']:.4f}"]
    if "clip_score" in scores:
        parts.append(f"CLIP score {scores['clip_score']:.3f}")
    if "inception_score" in scores:
        parts.append(f"IS {scores['inception_score']:.3f} +- {scores['inception_score_std']:.3f}")
    return "  ".join(parts) + f"  (n={scores['n']})"


def main(argv=None) -> int:
    sd.runtime.start_process()
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    d = sd.distributed.setup(args.device)
    try:
        return evaluate(args, d)
    except (ValueError, OSError, KeyError) as error:  # EvalError and the loaders' errors name the file
        print(f"SD_Eval.py: {sd.cli.first_line(error)}", file=sys.stderr)
        return 2
    finally:
        sd.distributed.teardown()


def evaluate(args, d: Dist) -> int:
    generating = bool(args.ckpt or args.runs)
    prompts = read_prompts(args.prompts, args.num_prompts if generating else None) if args.prompts else None
    if generating:
        prompts = [prompt for prompt in prompts for _ in range(args.n)]  # each prompt's images side by side
        if d.is_main:
            log.info("generating %d image(s) per prompt for %d prompts: %d images", args.n, len(prompts) // args.n,
                     len(prompts))
    extractors = Extractors(args.features, args.clip_model).to(d.device)
    reference = reference_stats(args.reference, extractors, d, args.batch_size, args.reference_size)
    if not args.images and not args.runs:  # the reference's statistics alone, cached for later runs
        if d.is_main:
            print(f"reference statistics of {reference['n']} images: {reference.get('path', args.reference)}")
        return 0
    common = {"features": args.features, "clip_model": args.clip_model if extractors.clip is not None else None,
              "reference": str(args.reference), "reference_n": reference["n"]}
    if args.runs:
        rows = [{**row, **common} for row in evaluate_runs(args, prompts, extractors, reference, d)]
        if d.is_main:
            write_table(Path(args.table), rows)
            print(Path(args.table).read_text(), end="")
        return 0
    images_dir = Path(args.images)
    if args.ckpt:
        scores = evaluate_checkpoint(args, args.ckpt, images_dir, prompts, extractors, reference, d)
    else:
        scores = evaluate_folder(images_dir, prompts, extractors, reference, d, args.batch_size, args.inception_score)
    scores = {**scores, **common, "images": str(images_dir)}
    if d.is_main:
        out = Path(args.out) if args.out else images_dir / "scores.json"
        sd.files.write_json_atomic(out, scores)
        print(report(scores))
        log.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

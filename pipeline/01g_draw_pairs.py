"""Stage 01g: draw several images per prompt from a model, rank them, and write preference-pair shards
(Diffusion-DPO training data).

    python pipeline/01g_draw_pairs.py --model MODEL --prompts prompts.txt --out DIR [--per_prompt 2]
        [--scorer clip|user|MODULE:FUNCTION] [--pairs best_worst|all] [--min_gap 0] [--clip_model ID]
        [--steps 25] [--cfg 7.5] [--sampler auto] [--negative ""] [--width W --height H] [--seed 0]
        [--batch_size 8] [--shard_size 1000] [--max_prompts N] [--rescore]
        [--vae ID --text_encoder ID --clip_skip N --no_ema] [--device auto] [--precision auto]

Three steps, each resumable; the draw folder ``DIR`` is the one ``sd/data/preference.py`` describes (the studio's
Prefer page reads it):

1. Draw. For prompt i (the non-blank lines of ``--prompts``, counted from 0; a .tsv/.csv takes its ``caption``
   column), K = ``--per_prompt`` images with seeds ``--seed + i * K + k`` (k = 0 .. K-1), the noise
   ``SD_ImageGen.py --seed`` draws for that seed, written as ``DIR/candidates/<i>_<k>.png`` (6-digit i, each
   PNG atomically, with its generation parameters as SD_ImageGen.py writes them); once all K are written the
   prompt's line is appended to ``DIR/candidates.jsonl``. Images are drawn ``--batch_size`` at a time across
   prompts. A re-run draws only the prompts that have no line yet (a prompt cut off half way is drawn again
   whole): stop it at any time (Ctrl-C, or ``--max_prompts`` per run) and run the same command again. A batch
   is part of the arithmetic, so an image drawn in another batch may differ by a grey level from the
   uninterrupted run's. The drawing settings (model, sampler, steps, cfg, size, seed, K, negative prompt, VAE,
   text encoder, CLIP skip, EMA) are kept in ``DIR/01g_draw_pairs.settings``; a re-run with another value of
   one of them, or with a prompt file whose drawn prompts changed, is refused naming it.
   ``--model`` is anything SD_ImageGen.py samples (a run or checkpoint folder of ours, a diffusers folder or hub
   id, a single .safetensors/.ckpt file), read by its loader: a LoRA run's adapter is merged into its base.
2. Score. ``--scorer clip`` (default): the CLIP score of each image against its prompt, SD_Eval.py's
   (``100 * max(cos, 0)`` with ``--clip_model``; ``tiny`` is the offline stand-in). ``--scorer MODULE:FUNCTION``:
   ``FUNCTION(images, prompts)`` of an importable module (or of a ``path/to/file.py``), given lists of RGB uint8
   ``(H, W, 3)`` arrays and their prompts, whole prompts' images at a time, returning one finite number per
   image (higher is better); ``demo.evaluate:preference_score`` is the demo's. An error importing or calling
   it, or a result of the wrong length or not finite, stops the stage with one line naming it (and the
   prompt); the prompts scored before keep their scores. Scores are appended to ``DIR/scores.jsonl``, one line per prompt (``index``, ``scorer``,
   ``scores``, and ``candidates``, a hash of the candidates line they score): a re-run scores only what that
   scorer has not scored; another scorer scores afresh and keeps the earlier one's lines, so switching back
   costs nothing. ``--rescore`` scores every prompt again (the newer line wins): for a scorer whose code
   changed. ``--scorer user``: the answers the studio's Prefer page wrote to ``DIR/choices.jsonl`` (python
   SD_Studio.py --root FOLDER_HOLDING_DIR, page Prefer); every question answered a or b is a pair, ties and
   skips are counted, and the questions still unanswered are counted and named as what to do next.
3. Pairs. Per prompt, ``--pairs best_worst`` (default): the highest score against the lowest; ``all``: every
   two images. A pair whose scores differ by ``--min_gap`` or less is no pair but a ``tie`` (counted). The
   pairs are written to ``DIR/shards/NNNNN.tar`` (``--shard_size`` pairs each) with ``NNNNN_stats.json``,
   rewritten whole by every run from the current candidates and scores or answers (new answers change them;
   each shard is written atomically, shards left over from a larger earlier run are removed), then
   ``01g_draw_pairs_summary.json``. A sample's key is ``<i>_<preferred>_<rejected>``: ``key.png`` the
   preferred image, ``key.rejected.png`` the rejected one, ``key.txt`` the prompt, ``key.json``
   ``{"index", "prompt", "model", "scorer", "preferred": {"image", "seed", "score"}, "rejected": {...}}``
   (with ``--scorer user`` no scores but ``"answer": {"a", "b", "choice"}``). ``encode_latents.py --pairs`` encodes
   both images (the rejected latents beside the preferred) for ``preference.method: dpo`` runs.

Exit status 0 when it finished (with ``--scorer user`` also while questions wait for answers), 1 when the
pairs came out empty (every pair a tie), 2 with one line when it could not run (a bad flag, a model that does
not load, a scorer that fails, changed settings), 130 on Ctrl-C (what was drawn is kept).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import importlib.util
import json
import logging
import math
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import sd.cli
import sd.data.preference as preference
import sd.data.shards
import sd.data.stages
import sd.files
import sd.runtime

STAGE = "01g_draw_pairs"
SCORES = "scores.jsonl"
SHARDS = "shards"
CANDIDATE_FOLDER = "candidates"
PAIRINGS = ("best_worst", "all")
DEFAULT_STEPS, DEFAULT_CFG = 25, 7.5
USER, CLIP = "user", "clip"

log = logging.getLogger(STAGE)


class StageError(ValueError):
    """Why the stage cannot go on: its one line."""


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = sd.data.stages.StageArgumentParser(__file__, __doc__)
    add = parser.add_argument
    add("--model", required=True, help="what to draw from: a run or checkpoint folder of ours, a diffusers folder or "
        "hub id, or a single .safetensors/.ckpt file (required)")
    add("--prompts", required=True, help="prompts: a text file, one per line (blank lines skipped), or a .tsv/.csv "
        "with a caption column (required)")
    parser.add_out("the draw folder: candidates/, candidates.jsonl, scores.jsonl, shards/")
    add("--per_prompt", type=int, default=2, help="images drawn per prompt, K >= 2")
    add("--scorer", default=CLIP, help="what ranks the images: clip (the CLIP score against the prompt), user (the "
        "answers of the studio's Prefer page in choices.jsonl) or MODULE:FUNCTION (a function of an importable "
        "module or of a .py file: FUNCTION(images, prompts) -> one number per image, higher is better)")
    add("--pairs", choices=PAIRINGS, default=None, help="pairs per prompt: best_worst (the highest score against the "
        "lowest) or all (every two images); not with --scorer user, where every a/b answer is a pair "
        "(default: best_worst)")
    add("--min_gap", type=float, default=None, help="two images whose scores differ by this much or less are a tie, "
        "no pair (default: 0, equal scores only)")
    add("--clip_model", default=None, help="--scorer clip: the CLIP (hub id or folder; tiny: the offline stand-in) "
        "(default: SD_Eval.py's, openai/clip-vit-large-patch14)")
    parser.add_bool("--rescore", help="score every drawn prompt again, not only those the scorer has not scored "
                    "(default: off)")
    add("--steps", type=int, default=None, help=f"sampler steps (default: {DEFAULT_STEPS}; 4 with lcm; a DMD generator's own "
        "with onestep)")
    add("--cfg", type=float, default=None, help=f"classifier-free guidance scale (default: {DEFAULT_CFG}; 1 with lcm and onestep)")
    add("--sampler", default="auto", help="auto (the model's own: lcm for a latent consistency model of ours, "
        "onestep for a DMD generator, flow_euler for a flow, else ddim) or a sampler of SD_ImageGen.py --sampler "
        "(ddim, dpm++, euler, lcm, onestep, flow_euler, flow_heun)")
    add("--negative", default="", help="negative prompt, the unconditional branch of CFG (default: empty)")
    add("--width", type=int, default=None, help="pixels, a multiple of 8 (default: --height, else the size the model "
        "was trained at)")
    add("--height", type=int, default=None, help="pixels, a multiple of 8 (default: --width, else the size the model "
        "was trained at)")
    add("--seed", type=int, default=0, help="image k of prompt i uses seed + i * K + k (default: 0)")
    add("--batch_size", type=int, default=8, help="images per UNet call, and per scorer call (whole prompts)")
    add("--shard_size", type=int, default=1000, help="pairs per output shard")
    add("--max_prompts", type=int, default=None, help="draw at most this many more prompts in this run, then score "
        "and pair what is drawn (default: all of them)")
    parser.add_bool("--no_ema", help="draw with the live weights of our checkpoints, not the EMA (default: off)")
    add("--vae", default=None, help="override the model's VAE (hub id, folder or tiny) (default: its own)")
    add("--text_encoder", default=None, help="override the model's text encoder (hub id, folder or tiny) "
        "(default: its own)")
    add("--clip_skip", default="auto", help="condition on the text encoder's hidden state this many layers from the "
        "end, as SD_ImageGen.py --clip_skip; auto = what the model records")
    add("--device", default="auto", help="auto (CUDA, then Apple MPS, then CPU), cpu, cuda, mps: drawing and CLIP")
    add("--precision", default="auto", choices=("auto", *sd.runtime.PRECISIONS),
        help="model precision; auto = bf16 on CUDA, fp16 on MPS, fp32 on CPU")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_values(args)
    except ValueError as error:
        parser.error(str(error))
    return args


def check_values(args) -> None:
    """A ValueError naming the first flag that is out of range or does not apply."""
    if args.per_prompt < 2:
        raise ValueError(f"--per_prompt must be >= 2 (a pair needs two images), got {args.per_prompt}")
    for name in ("batch_size", "shard_size", "max_prompts"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if any(side is not None and (side <= 0 or side % 8) for side in (args.width, args.height)):
        raise ValueError("--width and --height must be positive multiples of 8")
    if not 0 <= args.seed < 2**63:
        raise ValueError(f"--seed must be a whole number in [0, 2^63), got {args.seed}")
    if args.min_gap is not None and not (math.isfinite(args.min_gap) and args.min_gap >= 0):
        raise ValueError(f"--min_gap must be a finite number >= 0, got {args.min_gap}")
    if args.scorer not in (CLIP, USER):
        module, colon, function = args.scorer.rpartition(":")
        if not (colon and module and function.isidentifier()):
            raise ValueError(f"--scorer must be clip, user or MODULE:FUNCTION, got {args.scorer!r}")
    if args.scorer == USER:
        given = [flag for flag, value in (("pairs", args.pairs), ("min_gap", args.min_gap), ("rescore", args.rescore))
                 if value not in (None, False)]
        if given:
            raise ValueError(f"--{given[0]} does not apply to --scorer user: every question answered a or b is a pair")
    if args.clip_model is not None and args.scorer != CLIP:
        raise ValueError("--clip_model applies to --scorer clip only")
    if args.clip_skip != "auto" and not (args.clip_skip.isdigit() and int(args.clip_skip) >= 1):
        raise ValueError(f"--clip_skip: auto or a whole number >= 1, got {args.clip_skip}")


# ---------------------------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Drawing:
    """What decides the candidate images; ``width`` / ``height`` None: the model's trained size (``sized``)."""

    model: str
    sampler: str
    steps: int
    cfg: float
    width: int | None
    height: int | None
    seed: int
    per_prompt: int
    negative: str
    no_ema: bool
    vae: str | None
    text_encoder: str | None
    clip_skip: int | None

    def recorded(self) -> dict:
        """The settings file's record: ``{"--flag": value}``."""
        return {f"--{name}": value for name, value in dataclasses.asdict(self).items()}

    def seeds(self, index: int) -> list[int]:
        return [self.seed + index * self.per_prompt + k for k in range(self.per_prompt)]

    def sized(self, trained_side: int) -> "Drawing":
        width = self.width or self.height or trained_side
        return dataclasses.replace(self, width=width, height=self.height or width)


def model_name(model: str) -> str:
    """A local model by its absolute path (a re-run from another folder is the same model), else the hub id."""
    path = Path(model)
    return str(path.resolve()) if path.exists() else model


def drawing_of(args) -> Drawing:
    """The drawing settings, with the sampler of ``auto`` (what the model records) and its steps and cfg defaults
    resolved before the model is loaded."""
    import sd.formats
    import sd.sampling

    sampler = sd.formats.recorded_default_sampler(args.model) if args.sampler == "auto" else args.sampler
    if sampler not in sd.sampling.SAMPLERS:
        raise StageError(f"--sampler must be auto or one of {', '.join(sd.sampling.SAMPLERS)}, got {sampler!r}")
    try:  # onestep: the steps the DMD generator was trained for
        steps, cfg = sd.formats.sampling_defaults(args.model, sampler, args.steps, args.cfg, DEFAULT_STEPS, DEFAULT_CFG)
    except (KeyError, ValueError, OSError) as problem:
        raise StageError(f"--sampler {sampler}: {problem}") from None
    problem = sd.sampling.settings_error(sampler, steps, cfg)
    if problem:
        raise StageError(f"--sampler {sampler}, --steps {steps}, --cfg {cfg:g}: {problem}")
    return Drawing(model_name(args.model), sampler, steps, cfg, args.width, args.height, args.seed, args.per_prompt,
                   args.negative, bool(args.no_ema), args.vae, args.text_encoder,
                   None if args.clip_skip == "auto" else int(args.clip_skip))


def check_drawing(out: Path, drawing: Drawing, candidates: list[dict]) -> dict:
    """The drawing settings ``DIR/01g_draw_pairs.settings`` is to keep, checked: once a prompt is drawn, other
    values than those kept are refused (``sd.data.stages.SettingsChanged`` naming the first), as every stage
    refuses them beside its finished outputs."""
    path = sd.data.stages.settings_path(out, STAGE)
    settings, saved = drawing.recorded(), {}
    if candidates and path.exists():
        try:
            saved = json.loads(path.read_text())
        except (ValueError, OSError) as error:
            raise sd.data.stages.SettingsChanged(f"{path} is unreadable ({sd.cli.first_line(error)}): the settings "
                                                 f"of the images in {out} are unknown; use another --out") from None
        for name, value in settings.items():
            if name in saved and saved[name] != value:
                raise sd.data.stages.SettingsChanged(
                    f"{out} holds images drawn with {name} {saved[name]!r}, not {value!r}: use another --out, or "
                    f"delete {out} to draw them again")
    return {**saved, **settings}


def check_prompts(out: Path, prompts: list[str], candidates: list[dict], prompts_file: str) -> None:
    """A StageError when a drawn prompt is not the prompt of its index in ``prompts`` any more."""
    for record in candidates:
        index = record["index"]
        now = prompts[index] if index < len(prompts) else None
        if now != record.get("prompt"):
            said = f"is now {now!r}" if now is not None else f"is gone (the file has {len(prompts)} prompts)"
            raise StageError(f"{out / preference.CANDIDATES}: prompt {index} was drawn as {record.get('prompt')!r} "
                             f"but in {prompts_file} it {said}: use another --out for other prompts (new prompts "
                             "may be added at the end)")


def load_model(drawing: Drawing, device, precision: str):
    """The model through SD_ImageGen.py's loader (its EMA weights, a LoRA run's adapter merged), on ``device``."""
    import sd.imagegen.lora
    import sd.imagegen.model
    import sd.runtime

    settings = sd.imagegen.model.Settings(drawing.model, no_ema=drawing.no_ema, vae=drawing.vae,
                                          text_encoder=drawing.text_encoder, clip_skip=drawing.clip_skip)
    try:
        pipe = sd.imagegen.model.load(settings, merging=True)
    except Exception as error:  # noqa: BLE001 - the loaders raise many kinds; the stage ends with one line
        raise StageError(f"cannot load --model {drawing.model}: {sd.cli.first_line(error)}") from error
    problem = pipe.sampler_error(drawing.sampler)
    if problem:
        raise StageError(f"--model {drawing.model} is {problem}")
    sd.imagegen.lora.merge(sd.imagegen.lora.Settings(), pipe)  # a LoRA run's own adapter, as SD_ImageGen.py merges
    return pipe.to(device, sd.runtime.resolve_precision(precision, device))


def candidate_path(index: int, k: int) -> str:
    """An image's file name in the draw folder (relative to it, as candidates.jsonl names it)."""
    return f"{CANDIDATE_FOLDER}/{index:06d}_{k}.png"


def draw(out: Path, drawing: Drawing, prompts: list[str], todo: list[int], pipe, batch_size: int, device) -> None:
    """Images of the prompts ``todo`` (K each, ``batch_size`` per UNet call across prompts), each PNG written as its
    batch ends, a prompt's line appended once its last image is written."""
    import sd.model
    import sd.sampling
    from tqdm.auto import tqdm

    jobs = [(index, k) for index in todo for k in range(drawing.per_prompt)]
    clip_skip = sd.model.clip_skip_of(pipe.text_encoder)
    with tqdm(total=len(jobs), unit="image", desc=f"{STAGE} ({drawing.sampler}, {drawing.steps} steps, "
                                                   f"{drawing.width}x{drawing.height})") as bar:
        for start in range(0, len(jobs), batch_size):
            chunk = jobs[start : start + batch_size]
            seeds = [drawing.seeds(index)[k] for index, k in chunk]
            images = sd.sampling.generate_batch(pipe, [prompts[index] for index, _ in chunk], drawing.negative, seeds,
                                                steps=drawing.steps, cfg=drawing.cfg, sampler=drawing.sampler,
                                                height=drawing.height, width=drawing.width, device=device)
            for (index, k), seed, image in zip(chunk, seeds, images):
                text = sd.sampling.parameters_text(prompts[index], drawing.negative, seed, drawing, pipe.source,
                                                   clip_skip)
                sd.sampling.save_png(out / candidate_path(index, k), image, text)
                if k == drawing.per_prompt - 1:
                    preference.append_candidate(out, candidate_record(drawing, index, prompts[index]))
            bar.update(len(chunk))


def candidate_record(drawing: Drawing, index: int, prompt: str) -> dict:
    """A prompt's candidates.jsonl line (the format of ``sd/data/preference.py``)."""
    return {"index": index, "prompt": prompt, "images": [candidate_path(index, k) for k in range(drawing.per_prompt)],
            "seeds": drawing.seeds(index), "model": drawing.model, "sampler": drawing.sampler,
            "steps": drawing.steps, "cfg": drawing.cfg, "width": drawing.width, "height": drawing.height}


def draw_missing(args, out: Path, prompts: list[str], candidates: list[dict]) -> int:
    """Check the drawing settings against the folder's, then draw the prompts not drawn yet (at most
    ``--max_prompts``); the number drawn."""
    drawing = drawing_of(args)
    settings = check_drawing(out, drawing, candidates)
    check_prompts(out, prompts, candidates, args.prompts)
    drawn = {record["index"] for record in candidates}
    todo = [index for index in range(len(prompts)) if index not in drawn][: args.max_prompts]
    if not todo:
        return 0
    device = sd.runtime.pick_device(args.device)
    pipe = load_model(drawing, device, args.precision)
    sd.files.write_json_atomic(sd.data.stages.settings_path(out, STAGE), settings)  # before the first image
    drawing = drawing.sized(pipe.trained_size[0])
    log.info("drawing %d images of %d prompts (%d drawn before) with %s", len(todo) * drawing.per_prompt, len(todo),
             len(drawn), pipe.source)
    draw(out, drawing, prompts, todo, pipe, args.batch_size, device)
    return len(todo)


# ---------------------------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------------------------


def scorer_name(args) -> str:
    """What scores.jsonl calls the scorer: ``clip:<model>`` or ``MODULE:FUNCTION``."""
    if args.scorer == CLIP:
        import sd.evaluation

        return f"{CLIP}:{args.clip_model or sd.evaluation.DEFAULT_CLIP_MODEL}"
    return args.scorer


def clip_scorer(clip_model: str, device):
    """SD_Eval.py's CLIP score, ``sd.evaluation.Extractors.clip_scores``, with no FID network: the extractors are
    built with the tiny FID stand-in (a few convolutions, never used here) and given the CLIP, so a real CLIP
    needs no torch-fidelity."""
    import sd.evaluation

    extractors = sd.evaluation.Extractors("tiny", None)
    features = "tiny" if clip_model == "tiny" else "inception"  # load_clip's switch between the stand-in and a CLIP
    try:
        extractors.clip, extractors.tokenizer = sd.evaluation.load_clip(features, clip_model)
    except (OSError, ValueError) as error:
        raise StageError(f"--clip_model {clip_model}: cannot load it ({sd.cli.first_line(error)})") from error
    return extractors.to(device).clip_scores


def imported_scorer(spec: str):
    """``FUNCTION`` of ``MODULE`` (a dotted name, or a path to a .py file); a StageError saying why it cannot be."""
    module_name, _, function_name = spec.rpartition(":")
    try:
        if module_name.endswith(".py"):
            where = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            if where is None or not Path(module_name).is_file():
                raise FileNotFoundError(f"no file {module_name}")
            module = importlib.util.module_from_spec(where)
            where.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any error of the user's module is its one line
        raise StageError(f"--scorer {spec}: cannot import {module_name} ({type(error).__name__}: "
                         f"{sd.cli.first_line(error)})") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise StageError(f"--scorer {spec}: {module_name} has no function {function_name}")
    return function


def scorer_of(args, name: str):
    if args.scorer == CLIP:
        return clip_scorer(name.partition(":")[2], sd.runtime.pick_device(args.device))
    return imported_scorer(args.scorer)


def fingerprint(record: dict) -> str:
    """A short hash of a candidates line: scores of another drawing of the same index are not reused."""
    return hashlib.sha1(json.dumps(record, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def read_scores(out: Path, name: str, candidates: list[dict]) -> dict[int, list[float]]:
    """The scores scorer ``name`` gave each drawn prompt (its last line of scores.jsonl), by index."""
    current = {record["index"]: (fingerprint(record), len(record["images"])) for record in candidates}
    scores = {}
    for record in preference.read_lines(out / SCORES):
        index, values = record.get("index"), record.get("scores")
        if (record.get("scorer") == name and index in current and record.get("candidates") == current[index][0]
                and isinstance(values, list) and len(values) == current[index][1]):
            scores[index] = [float(value) for value in values]
    return scores


def read_candidate(out: Path, name: str) -> np.ndarray:
    """A candidate image as RGB uint8 ``(H, W, 3)``; a StageError naming a file that is missing or damaged."""
    path = out / name
    try:
        return sd.data.shards.decode_image(path.read_bytes(), "png")
    except (OSError, sd.data.shards.ImageSkip) as error:
        raise StageError(f"{path}: cannot read it ({sd.cli.first_line(error)}): delete its prompt's line from "
                         f"{out / preference.CANDIDATES} to draw it again") from None


def score_missing(args, out: Path, candidates: list[dict]) -> tuple[str, dict[int, list[float]]]:
    """Every drawn prompt's scores: those scores.jsonl holds, and the rest scored now and appended."""
    from tqdm.auto import tqdm

    name = scorer_name(args)
    scores = {} if args.rescore else read_scores(out, name, candidates)
    todo = [record for record in candidates if record["index"] not in scores]
    if not todo:
        return name, scores
    scorer = scorer_of(args, name)
    per_call = max(1, args.batch_size // args.per_prompt)
    for start in tqdm(range(0, len(todo), per_call), desc=f"{STAGE} score ({name})", unit="call"):
        group = todo[start : start + per_call]
        values = scored_group(out, name, scorer, group)
        for record, row in zip(group, values):
            line = {"index": record["index"], "scorer": name, "scores": row, "candidates": fingerprint(record)}
            preference.append_line(out / SCORES, line)
            scores[record["index"]] = row
    return name, scores


def scored_group(out: Path, name: str, scorer, group: list[dict]) -> list[list[float]]:
    """The scores of the images of the prompts ``group`` in one call, split by prompt; a StageError naming the
    prompt when the call fails or its result is not one finite number per image."""
    images = [read_candidate(out, image) for record in group for image in record["images"]]
    texts = [record["prompt"] for record in group for _ in record["images"]]
    what = (f"prompt {group[0]['index']} ({group[0]['prompt']!r})" if len(group) == 1 else
            f"prompts {group[0]['index']} to {group[-1]['index']} (the first {group[0]['prompt']!r})")
    try:
        result = scorer(images, texts)
    except Exception as error:  # noqa: BLE001 - whatever the user's scorer raises is its one line
        raise StageError(f"--scorer {name} failed on {what}: {type(error).__name__}: {sd.cli.first_line(error)}") \
            from None
    try:
        values = np.asarray(result, dtype=np.float64)
    except (TypeError, ValueError):
        raise StageError(f"--scorer {name} returned {type(result).__name__} for {what}, not one number per "
                         "image") from None
    if values.shape != (len(images),):
        raise StageError(f"--scorer {name} returned {values.size} scores for the {len(images)} images of {what}: "
                         "it must return one number per image")
    rows, start = [], 0
    for record in group:
        row = values[start : start + len(record["images"])]
        start += len(row)
        if not np.isfinite(row).all():
            raise StageError(f"--scorer {name} gave an image of prompt {record['index']} ({record['prompt']!r}) a "
                             f"score that is not finite: {row.tolist()}")
        rows.append(row.tolist())
    return rows


# ---------------------------------------------------------------------------------------------
# Pairs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pair:
    """Image ``preferred`` of prompt ``index`` over image ``rejected``, by their ``scores`` (the prompt's images'),
    or by the user's ``answer``."""

    index: int
    preferred: int
    rejected: int
    scores: list[float] | None = None
    answer: dict | None = None


def ranked_pairs(index: int, scores: list[float], pairing: str, min_gap: float) -> tuple[list[Pair], list[str]]:
    """One prompt's pairs from its images' scores, and the ties (``"<i>_<a>_<b>"``): ``best_worst`` the highest
    score against the lowest (the first highest, the last lowest: two images even when all scores are equal),
    ``all`` every two images; scores within ``min_gap`` tie."""
    if pairing == "best_worst":
        best, worst = int(np.argmax(scores)), len(scores) - 1 - int(np.argmin(scores[::-1]))
        candidates = [(min(best, worst), max(best, worst))]
    else:
        candidates = [(a, b) for a in range(len(scores)) for b in range(a + 1, len(scores))]
    pairs, ties = [], []
    for a, b in candidates:
        if abs(scores[a] - scores[b]) <= min_gap:
            ties.append(f"{index:06d}_{a}_{b}")
            continue
        preferred, rejected = (a, b) if scores[a] > scores[b] else (b, a)
        pairs.append(Pair(index, preferred, rejected, scores=scores))
    return pairs, ties


def scored_pairs(candidates: list[dict], scores: dict, pairing: str, min_gap: float,
                 summary: sd.data.stages.Summary) -> list[Pair]:
    pairs = []
    for record in candidates:
        found, ties = ranked_pairs(record["index"], scores[record["index"]], pairing, min_gap)
        pairs += found
        count(summary, "tie", ties)
    return pairs


def user_pairs(out: Path, candidates: list[dict], summary: sd.data.stages.Summary) -> tuple[list[Pair], int]:
    """The pairs of the questions answered a or b, in question order; ties and skips counted; and the number of
    questions not answered yet."""
    answers = preference.read_choices(out)
    judged = {(index, a, b) for index, a, b in preference.questions(candidates)}
    pairs, unanswered = [], []
    for index, preferred, rejected in preference.judged_pairs(candidates, answers):
        a, b = sorted((preferred, rejected))
        pairs.append(Pair(index, preferred, rejected, answer={"a": a, "b": b, "choice": answers[(index, a, b)]}))
    for key in sorted(judged):
        name = "{:06d}_{}_{}".format(*key)
        if key not in answers:
            unanswered.append(name)
        elif answers[key] in ("tie", "skip"):
            count(summary, answers[key], [name])
    count(summary, "unanswered", unanswered)
    return pairs, len(unanswered)


def count(summary: sd.data.stages.Summary, reason: str, names: list[str]) -> None:
    """Pairs that are none (a tie, a skipped or unanswered question), counted in the summary by reason."""
    if names:
        summary.dropped[reason] += len(names)
        summary.note_examples({reason: names})


def pair_sample(out: Path, pair: Pair, record: dict, scorer: str) -> sd.data.shards.ShardSample:
    """The shard sample of ``pair``: the preferred image, the rejected one beside it, the prompt, the metadata."""
    def image(k: int) -> dict:
        entry = {"image": record["images"][k], "seed": record["seeds"][k]}
        return {**entry, "score": pair.scores[k]} if pair.scores is not None else entry

    meta = {"index": pair.index, "prompt": record["prompt"], "model": record.get("model"), "scorer": scorer,
            "preferred": image(pair.preferred), "rejected": image(pair.rejected),
            **({"answer": pair.answer} if pair.answer is not None else {})}

    def read(k: int) -> bytes:
        read_candidate(out, record["images"][k])  # refuses a damaged file, naming it
        return (out / record["images"][k]).read_bytes()

    return sd.data.shards.ShardSample(f"{pair.index:06d}_{pair.preferred}_{pair.rejected}",
                                      read(pair.preferred), "png", record["prompt"],
                                      json.dumps(meta).encode("utf-8"), rejected=read(pair.rejected),
                                      rejected_ext="png")


def write_shards(out: Path, pairs: list[Pair], candidates: list[dict], scorer: str, shard_size: int,
                 summary: sd.data.stages.Summary) -> Path:
    """The pairs as ``DIR/shards/NNNNN.tar`` + stats, every shard written again, the ones beyond them removed."""
    folder = out / SHARDS
    folder.mkdir(parents=True, exist_ok=True)
    by_index = {record["index"]: record for record in candidates}
    shards = -(-len(pairs) // shard_size)
    for number in range(shards):
        chunk = pairs[number * shard_size : (number + 1) * shard_size]
        samples = [pair_sample(out, pair, by_index[pair.index], scorer) for pair in chunk]
        summary.add(sd.data.stages.write_shard(folder, number, samples, sd.data.stages.ShardStats(), scorer=scorer))
    for path in sorted(folder.glob("[0-9][0-9][0-9][0-9][0-9]*")):
        stem = path.name.split(".")[0].removesuffix("_stats")
        if stem.isdigit() and int(stem) >= shards and path.name in (f"{stem}.tar", f"{stem}_stats.json"):
            path.unlink()
    return folder


# ---------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------


def make_pairs(args, out: Path, candidates: list[dict]) -> int:
    """Score (or read the answers), pair, write the shards and the summary; the exit status."""
    summary = sd.data.stages.Summary(STAGE)
    name, unanswered = USER, 0
    if args.scorer == USER:
        pairs, unanswered = user_pairs(out, candidates, summary)
    else:
        name, scores = score_missing(args, out, candidates)
        pairs = scored_pairs(candidates, scores, args.pairs or "best_worst", args.min_gap or 0.0, summary)
    folder = write_shards(out, pairs, candidates, name, args.shard_size, summary)
    summary.finish(folder, prompts=len(candidates), images=sum(len(r["images"]) for r in candidates), scorer=name,
                   pairs=args.pairs or ("answered" if args.scorer == USER else "best_worst"),
                   min_gap=args.min_gap or 0.0)
    if unanswered:
        total = len(preference.questions(candidates))
        print(f"{STAGE}: {unanswered} of {total} questions are not answered yet: answer them on the studio's Prefer "
              f"page (python SD_Studio.py --root {out.resolve().parent}, page Prefer, folder {out.name}), then run "
              "this command again to make their pairs")
        return 0
    fix = ("answer a or b where one image is better" if args.scorer == USER else
           "the scores are within --min_gap: a smaller --min_gap, a larger --per_prompt, or --pairs all")
    return summary.exit_code({"tie": fix, "skip": fix})


def read_prompts(path: str) -> list[str]:
    """The prompts of ``--prompts``, read as SD_Eval.py and SD_Reflow.py read theirs."""
    import sd.evaluation  # torch: imported after --help, which the data stages answer without it

    try:
        return sd.evaluation.read_prompts(path)
    except sd.evaluation.EvalError as error:
        raise StageError(f"--prompts: {error}") from None


@sd.data.stages.ends_cleanly_on_a_full_disk(STAGE)
def main(argv=None) -> int:
    args = parse_args(argv)
    sd.runtime.start_process()
    sd.data.stages.setup_logging()
    out = Path(args.out)
    try:
        prompts = read_prompts(args.prompts)
        draw_missing(args, out, prompts, preference.read_candidates(out))
        candidates = preference.read_candidates(out)
        if not candidates:
            raise StageError(f"{out} holds no drawn prompt")
        return make_pairs(args, out, candidates)
    except (StageError, sd.data.stages.SettingsChanged, preference.PreferenceError, OSError) as error:
        if sd.data.stages.disk_full(error):
            raise  # ends_cleanly_on_a_full_disk's line
        print(f"{STAGE}.py: error: {sd.cli.first_line(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        drawn = len(preference.read_candidates(out)) if (out / preference.CANDIDATES).exists() else 0
        print(f"{STAGE}.py: interrupted (Ctrl-C); {drawn} prompts' images are kept in {out}: run the same command "
              "again to go on from them", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())

"""Stage 03c: captions and tags for images, by a captioning model and a WD14 tagger, with a review sheet.

    python pipeline/03c_caption_images.py --input PHOTO_DIR --out CAPTION_DIR [--captioner blip|florence2|none|ID]
        [--tagger wd14|none|ID] [--existing keep|replace|join] [--trigger TEXT] [--batch_size 8]
    python pipeline/03c_caption_images.py --input 'SHARD_DIR/*.tar' --out DIR ...

Two inputs:
* a folder of images (searched recursively, hidden files and ``*_mask.*`` loss masks left out, as
  ``01e_import_folder.py`` reads it): writes ``CAPTION_DIR/<relative path>.txt`` per image (``sub/a.jpg`` ->
  ``sub/a.txt``), never into the folder itself; ``01e_import_folder.py --input PHOTO_DIR --captions
  CAPTION_DIR`` then imports the images with them. Its existing captions are the ``.txt`` beside each image.
* image shards (a quoted glob): writes ``DIR/NNNNN.tar`` per input shard, each sample as it was with its
  caption (``key.txt``) replaced and its ``key.json`` gaining ``generated_caption`` and ``tags``, then
  ``NNNNN_stats.json``; ``encode_latents.py`` and stage 04 read them.

Models: ``--captioner`` is a transformers image-to-text model (``blip``:
Salesforce/blip-image-captioning-large, ``florence2``: florence-community/Florence-2-base, or any hub id or
local folder of BLIP, Florence-2 or another model ``AutoModelForImageTextToText`` loads), asked ``--prompt``
(Florence-2: a task token, by default ``<DETAILED_CAPTION>``), at most ``--max_length`` new tokens, greedy or
``--num_beams``. ``--tagger`` is a WD14 tagger in ONNX (``wd14``: SmilingWolf/wd-swinv2-tagger-v3, or a hub id
or folder with ``model.onnx`` and ``selected_tags.csv``) run by onnxruntime. Either may be ``none``, or ``tiny``:
small models built offline to try the stage without the hub (nonsense captions, tags from the colours). A model
that cannot be loaded (offline and not cached, a wrong folder) stops the stage in one line naming it.

What the models say is kept per input shard (per ``--shard_size`` images of a folder) in
``OUT/captioning/NAME.parquet`` (``key``, ``existing``, ``caption``, ``tags``, ``scores``, ``categories``: every tag
scored at least 0.1) with ``NAME_stats.json`` as its done marker: a re-run skips those parts, and one with
another captioner, tagger, prompt, length or beams into the same --out is refused, as is switching between
``--existing keep`` and the other two (keep runs no model on a captioned image). Every other flag (how captions
are put together: --trigger, the thresholds, --drop_tags, --min_tag_count, replace or join...) applies when the
captions are written, after every part is done: changing one and running again rewrites the captions without
running a model again.

A caption is: ``--trigger`` (unless the caption starts with it already), then the caption (with ``--existing
keep``, an image that has one keeps it and no model runs on it; ``replace``: the generated one; ``join``:
both), then the tags kept (character tags over --character_threshold, general ones over --threshold, best
first, ``long_hair`` -> ``long hair`` unless --replace_underscores false; those in --drop_tags or carried by
fewer than --min_tag_count images of the whole input left out), all joined with ", " (``--tags_first`` puts
the tags before the caption). An image left with no caption at all is skipped as ``no_caption``.

Review, at the end: ``OUT/review/sheet_NNNN.png`` (pages of thumbnails with their captions; the first
--review_pages pages) and ``OUT/review/tags.csv`` (each of the tagger's tags with the images whose captions carry
it; not the trigger nor pieces of a sentence). The LoRA files of a run trained on these captions record every
comma-separated piece of them in ``ss_tag_frequency``, as sd-scripts does.

Images that cannot be read are skipped and counted by reason, named in the stats (``undecodable``,
``truncated_image``, ``too_large``...); an input shard that cannot be read at all is left out of the captions,
named under ``failed_shards`` in the summary, and tried again by the next run. Memory holds one batch of images and one part's captions.
Several GPUs: ``torchrun --nproc_per_node=N`` (or ``--rank`` / ``--world_size`` from another launcher):
rank r captions parts r, r+N, ..., no rank waits for another, and whichever finishes the last part writes
the captions and the review (or run the command once more). Ctrl-C ends in one line; finished parts are kept.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import tarfile
from collections import Counter
from pathlib import Path

from tqdm import tqdm

import sd.cli
import sd.data.captioning
import sd.data.review
import sd.data.shards
import sd.data.stages
import sd.files
import sd.runtime

STAGE = "03c_caption_images"
MODEL_DIR = "captioning"  # OUT/captioning/NAME.parquet: what the models said, per part
REVIEW_DIR = "review"
CAPTIONS_LOCK = ".captions.lock"  # held while the captions and the review are written
MODEL_FLAGS = ("captioner", "prompt", "max_length", "num_beams", "tagger")
log = logging.getLogger(STAGE)


def parse_args(argv):
    parser = sd.data.stages.StageArgumentParser(__file__, __doc__)
    add = parser.add_argument
    parser.add_input("a folder of images, searched recursively, or a glob of image shards, quoted: 'SHARD_DIR/*.tar'",
                     old=("--shards", "--src"))
    parser.add_out("output folder: caption files mirroring the folder's images, or NNNNN.tar shards (not the input's "
                   "folder)")
    add("--captioner", default="blip",
        help="captioning model: blip, florence2, a hub id or local folder, none, or tiny (a small random model built "
             "here: the stage tried offline, its captions nonsense words) (default: %(default)s)")
    add("--prompt", default=None,
        help="what the captioner is asked: BLIP continues it (e.g. 'a photo of'), Florence-2 takes a task token "
             "(<CAPTION>, <DETAILED_CAPTION>, <MORE_DETAILED_CAPTION>) (default: none for BLIP, <DETAILED_CAPTION> "
             "for Florence-2)")
    add("--max_length", type=int, default=75, help="most new tokens of a generated caption (default: %(default)s)")
    add("--num_beams", type=int, default=1, help="beam search width; 1 is greedy decoding (default: %(default)s)")
    add("--tagger", default="none",
        help="WD14 tagger: wd14, a hub id or local folder with model.onnx and selected_tags.csv, none, or tiny "
             "(a small model built here, its tags from the image's colours) (default: %(default)s)")
    add("--batch_size", type=int, default=8, help="images per model call (default: %(default)s)")
    add("--existing", choices=sd.data.captioning.EXISTING, default="keep",
        help="an image's existing caption: keep it (no model runs on that image), replace it, or join the generated "
             "caption after it (default: %(default)s)")
    add("--trigger", default="", help="put first in every caption: a trigger word or class, e.g. 'sks dog' "
                                      "(default: none)")
    parser.add_bool("--tags_first", help="tags before the generated caption instead of after it (default: off)")
    add("--threshold", type=float, default=0.35, help="general tags scored at least this are kept (default: %(default)s)")
    add("--character_threshold", type=float, default=0.85,
        help="character tags scored at least this are kept (default: %(default)s)")
    parser.add_bool("--rating_tags", help="keep the most likely rating tag (general, sensitive, questionable, "
                                          "explicit) (default: off)")
    parser.add_bool("--replace_underscores", default=True,
                    help="write tags with spaces (long_hair -> long hair); emoticons such as ^_^ keep theirs "
                         "(default: on)")
    add("--drop_tags", action="append", default=[], metavar="A,B",
        help="tags never written, in either spelling; repeatable (default: none)")
    add("--min_tag_count", type=int, default=1,
        help="leave out tags carried by fewer images than this over the whole input (default: %(default)s, all)")
    add("--shard_size", type=int, default=100,
        help="folder input: images per part, the unit a re-run resumes by (a CPU captions 100 in minutes) "
             "(default: %(default)s)")
    add("--max_pixels", type=int, default=sd.data.shards.DEFAULT_MAX_PIXELS,
        help="skip images with more pixels than this, read from the header (default: %(default)s)")
    add("--review_pages", type=int, default=10,
        help="contact-sheet pages of 20 images written to OUT/review; 0 writes none (default: %(default)s)")
    add("--device", default="auto", help="auto (this rank's GPU if there is one), cuda, cuda:N or cpu (default: auto)")
    add("--precision", choices=("fp32", "bf16", "fp16"), default=None,
        help="the captioner's weights (default: fp16 on a GPU, fp32 on the CPU)")
    add("--rank", type=int, default=None, help="this worker's rank without torchrun (default: torchrun's, or 0)")
    add("--world_size", type=int, default=None, help="workers without torchrun (default: torchrun's, or 1)")
    args = parser.parse_args(argv)
    captioner = None if args.captioner.lower() == "none" else args.captioner
    tagger = None if args.tagger.lower() == "none" else args.tagger
    drop = tuple(sorted({tag.strip() for value in args.drop_tags for tag in value.split(",") if tag.strip()}))
    args = argparse.Namespace(**{**vars(args), "captioner": captioner, "tagger": tagger, "drop_tags": drop})
    if captioner is None and tagger is None:
        parser.error("--captioner none and --tagger none: give at least one model")
    for name in ("max_length", "num_beams", "batch_size", "shard_size", "max_pixels", "min_tag_count"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    for name in ("threshold", "character_threshold"):
        if not sd.data.captioning.TAG_FLOOR <= getattr(args, name) <= 1:
            parser.error(f"--{name} must be between {sd.data.captioning.TAG_FLOOR} and 1, got {getattr(args, name)}")
    if args.review_pages < 0:
        parser.error(f"--review_pages must be >= 0, got {args.review_pages}")
    if (args.rank is None) != (args.world_size is None):
        parser.error("--rank and --world_size go together")
    if args.world_size is not None and not 0 <= args.rank < args.world_size:
        parser.error(f"--rank must be in 0..{args.world_size - 1}, got {args.rank}")
    if captioner is None and args.prompt is not None:
        parser.error("--prompt needs a --captioner")
    return args


def compose_options(args) -> sd.data.captioning.ComposeOptions:
    return sd.data.captioning.ComposeOptions(
        existing=args.existing, trigger=args.trigger, tags_first=args.tags_first, threshold=args.threshold,
        character_threshold=args.character_threshold, rating_tags=args.rating_tags,
        replace_underscores=args.replace_underscores, drop_tags=args.drop_tags, min_tag_count=args.min_tag_count)


def model_settings(args) -> dict:
    """What shapes the models' parts: the models and how they are asked, and whether they read the images that
    have a caption (``--existing keep`` leaves those out)."""
    def named(value):  # a local folder by its absolute path: the same folder given relative to elsewhere matches
        return str(Path(value).resolve()) if isinstance(value, str) and Path(value).exists() else value

    return {**{f"--{name}": named(getattr(args, name)) for name in MODEL_FLAGS},
            "--existing": "keep" if args.existing == "keep" else "replace or join"}


# ---------------------------------------------------------------------------------------------
# Inputs: parts of samples, each (key, image bytes, image extension, existing caption, problem)
# ---------------------------------------------------------------------------------------------


class FolderInput:
    """A folder of images cut into parts of ``shard_size`` in sorted order; a sample's key is its relative path."""

    def __init__(self, root: Path, shard_size: int):
        self.root = root
        images, _ = sd.data.stages.list_images(root)
        self.parts = {f"{i // shard_size:05d}": images[i : i + shard_size] for i in range(0, len(images), shard_size)}
        self.count = len(images)

    def samples(self, name: str):
        for rel in self.parts[name]:
            path = self.root / rel
            try:
                data = sd.files.read_file_bounded(path, sd.data.stages.MAX_MEMBER_BYTES)
            except OSError:
                yield rel, None, "", "", "unreadable_file"
                continue
            except ValueError:
                yield rel, None, "", "", "too_large_member"
                continue
            caption, problem = "", None
            text = path.with_name(path.name.rsplit(".", 1)[0] + ".txt")
            if text.is_file():
                try:
                    caption = text.read_text(encoding="utf-8").strip()
                except UnicodeDecodeError:
                    problem = "bad_caption_encoding"
            yield rel, data, rel.rsplit(".", 1)[-1].lower(), caption, problem


class ShardInput:
    """Image shards, one part each, named by the shard's file name."""

    def __init__(self, by_stem: dict[str, Path]):
        self.parts = by_stem
        self.count = sd.data.stages.input_sample_count(list(by_stem.values()))

    def samples(self, name: str):
        with open(self.parts[name], "rb") as file:
            reader = sd.data.shards.TarSamples(file, os.fstat(file.fileno()).st_size,
                                               fields=("image", "caption"),
                                               max_member_bytes=sd.data.stages.MAX_MEMBER_BYTES)
            for sample in reader:
                problem = sample.problem or (None if sample.image is not None else "no_image")
                yield sample.key, sample.image, sample.image_ext, (sample.caption or "").strip(), problem
            if reader.truncated_key is not None:
                yield reader.truncated_key, None, "", "", "truncated_tar"


def open_input(args):
    """``FolderInput`` or ``ShardInput`` for ``--input``, or a ``UsageError``."""
    out = Path(args.out).resolve()
    source = Path(args.input)
    if source.is_dir():
        if source.resolve() == out or source.resolve() in out.parents:
            raise sd.data.stages.UsageError(f"--out {args.out} is inside --input {args.input}; write the captions "
                                            "to a folder of their own (01e_import_folder.py --captions reads it)")
        folder = FolderInput(source, args.shard_size)
        if not folder.count:
            raise sd.data.stages.UsageError(f"no images ({', '.join(sd.data.shards.IMAGE_EXTENSIONS)}) under {source}")
        return folder
    shards = ShardInput(sd.data.stages.input_shards(args.input))
    if any(path.parent.resolve() == out for path in shards.parts.values()):
        raise sd.data.stages.UsageError(f"--out {args.out} holds input shards; write to another folder")
    return shards


# ---------------------------------------------------------------------------------------------
# The models, part by part
# ---------------------------------------------------------------------------------------------


class Models:
    """The captioner and the tagger, loaded on first use (a rank with nothing to do loads neither)."""

    def __init__(self, args, device):
        self.args, self.device = args, device
        self.captioner = self.tagger = None
        self.loaded = False

    def load(self) -> None:
        if self.loaded:
            return
        args = self.args
        if args.captioner:
            dtype = sd.runtime.resolve_precision(args.precision, self.device)
            self.captioner = sd.data.captioning.load_captioner(
                args.captioner, device=self.device, dtype=dtype, prompt=args.prompt, max_length=args.max_length,
                num_beams=args.num_beams)
            log.info("captioner %s (%s) on %s in %s, prompt %r", args.captioner, self.captioner.family,
                     self.device, str(dtype).replace("torch.", ""), self.captioner.prompt)
        if args.tagger:
            self.tagger = sd.data.captioning.load_tagger(args.tagger, device=self.device)
            log.info("tagger %s: %d tags at %d px, onnxruntime on %s", args.tagger, len(self.tagger.names),
                     self.tagger.size, self.tagger.session.get_providers()[0])
        self.loaded = True

    def run(self, images: list) -> tuple[list[str], list[list]]:
        captions = self.captioner.caption(images) if self.captioner else [""] * len(images)
        tags = self.tagger.tag(images) if self.tagger else [[] for _ in images]
        return captions, tags


def to_pil(data: bytes, ext: str, max_pixels: int):
    from PIL import Image

    return Image.fromarray(sd.data.shards.decode_image(data, ext, max_pixels))


def model_part(source, name: str, folder: Path, models: Models, args, bar) -> dict:
    """Write ``folder/NAME.parquet`` (what the models said of each readable sample) and its stats."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    stats = sd.data.stages.ShardStats()
    rows = {"key": [], "existing": [], "caption": [], "tags": [], "scores": [], "categories": []}
    batch: list = []  # (row index, PIL image)

    def flush():
        if batch:
            captions, tags = models.run([image for _, image in batch])
            for (row, _), caption, found in zip(batch, captions, tags):
                rows["caption"][row] = caption
                rows["tags"][row] = [tag for tag, _, _ in found]
                rows["scores"][row] = [score for _, score, _ in found]
                rows["categories"][row] = [category for _, _, category in found]
            bar.update(len(batch))
            batch.clear()

    seen = set()
    for key, data, ext, existing, problem in source.samples(name):
        if problem is None and key in seen:
            problem = "duplicate_key"
        seen.add(key)
        if problem is not None:
            stats.skip(problem, key)
            bar.update(1)
            continue
        needs_model = not (args.existing == "keep" and existing)
        image = None
        if needs_model:
            try:
                image = to_pil(data, ext, args.max_pixels)
            except sd.data.shards.ImageSkip as skip:
                stats.skip(skip.reason, key)
                bar.update(1)
                continue
            except Exception:  # noqa: BLE001 - a decoder failing in a way of its own: one bad image, not a bad run
                stats.skip("undecodable", key)
                bar.update(1)
                continue
        for column, value in (("key", key), ("existing", existing), ("caption", ""), ("tags", []), ("scores", []),
                              ("categories", [])):
            rows[column].append(value)
        stats.successes += 1
        if image is None:
            bar.update(1)
        else:
            batch.append((len(rows["key"]) - 1, image))
            if len(batch) >= args.batch_size:
                flush()
    flush()
    schema = pa.schema([("key", pa.string()), ("existing", pa.string()), ("caption", pa.string()),
                        ("tags", pa.list_(pa.string())), ("scores", pa.list_(pa.float32())),
                        ("categories", pa.list_(pa.int8()))])
    table = pa.Table.from_pydict(rows, schema=schema)
    return sd.data.stages.write_output(folder, name, lambda tmp: pq.write_table(table, tmp), stats,
                                       suffix=".parquet", part=name)


# ---------------------------------------------------------------------------------------------
# Captions written from the models' parts
# ---------------------------------------------------------------------------------------------


def part_table(folder: Path, name: str) -> dict[str, tuple[str, str, list]]:
    """``{key: (existing, generated, tags as (tag, score, category))}`` of one finished part."""
    import pyarrow.parquet as pq

    table = pq.read_table(sd.data.stages.output_paths(folder, name, ".parquet")[0]).to_pydict()
    return {key: (existing, caption, list(zip(tags, scores, categories)))
            for key, existing, caption, tags, scores, categories in zip(
                table["key"], table["existing"], table["caption"], table["tags"], table["scores"], table["categories"])}


def dataset_tag_counts(folder: Path, names: list[str], options) -> Counter:
    """Images per kept tag over every part (before ``min_tag_count``), for ``--min_tag_count``."""
    counts = Counter()
    for name in names:
        for existing, _, tags in part_table(folder, name).values():
            if not (options.existing == "keep" and existing):
                counts.update(sd.data.captioning.kept_tags(tags, options))
    return counts


def written_tags(captions) -> Counter:
    """Images per tagger tag over ``(caption, generated, kept tags)`` entries, counting the tags a caption
    carries (not its other pieces: the trigger, a sentence's fragments, a kept caption's words); bounded by
    the tagger's vocabulary."""
    counts = Counter()
    for caption, _, kept in captions:
        pieces = set(sd.data.captioning.caption_tags(caption))
        counts.update(tag for tag in set(kept) if tag in pieces)
    return counts


def final_captions(folder: Path, name: str, options, counts: Counter) -> dict[str, tuple[str, str, list[str]]]:
    """``{key: (caption, generated caption, kept tags)}`` of one part."""
    captions = {}
    for key, (existing, generated, tags) in part_table(folder, name).items():
        kept = sd.data.captioning.kept_tags(tags, options)
        if options.min_tag_count > 1:
            kept = [tag for tag in kept if counts[tag] >= options.min_tag_count]
        captions[key] = (sd.data.captioning.compose(existing, generated, kept, options), generated, kept)
    return captions


def fingerprint(options, counts: Counter, settings: dict) -> str:
    record = {"options": options.record(), "models": settings}
    if options.min_tag_count > 1:
        record["counts"] = sorted(counts.items())
    return hashlib.sha1(json.dumps(record, sort_keys=True).encode()).hexdigest()


def write_shard_captions(source: ShardInput, name: str, out: Path, captions: dict, model_stats: dict, digest: str,
                         bar) -> dict:
    """``out/NAME.tar``: the input shard's samples the models read, their captions and metadata replaced."""
    stats = sd.data.stages.ShardStats()
    for reason, count in model_stats.get("failed", {}).items():  # what the model pass skipped stays skipped
        stats.failed[reason] += count
    stats.examples = {reason: list(keys) for reason, keys in model_stats.get("examples", {}).items()}

    def kept():
        with open(source.parts[name], "rb") as file:
            reader = sd.data.shards.TarSamples(file, os.fstat(file.fileno()).st_size,
                                               max_member_bytes=sd.data.stages.MAX_MEMBER_BYTES)
            for sample in reader:
                bar.update(1)
                entry = captions.get(sample.key) if sample.problem is None else None
                if entry is None:
                    continue  # counted by the model pass
                caption, generated, tags = entry
                if not caption:
                    stats.skip("no_caption", sample.key)
                    continue
                sample.caption = caption
                sample.metadata = updated_metadata(sample.metadata, caption, generated, tags)
                stats.successes += 1
                yield sample

    return sd.data.stages.write_output(out, name, lambda tmp: sd.data.shards.write_tar(tmp, kept()), stats,
                                       shard=str(source.parts[name]), compose_sha1=digest)


def updated_metadata(metadata: bytes | None, caption: str, generated: str, tags: list[str]) -> bytes:
    try:
        record = json.loads(metadata) if metadata else {}
    except ValueError:
        record = {}
    if not isinstance(record, dict):
        record = {}
    if "caption" in record:  # the caption an earlier stage recorded: now the one written beside it
        record["caption"] = caption
    record.update({"generated_caption": generated, "tags": tags})
    return json.dumps(record, ensure_ascii=False).encode("utf-8")


def write_folder_captions(out: Path, captions: dict) -> tuple[int, Counter]:
    """``out/<relative path>.txt`` per image with a caption (rewritten only when it changed); returns the
    captions written and the skips."""
    written, skipped = 0, Counter()
    for rel, (caption, _, _) in captions.items():
        if not caption:
            skipped["no_caption"] += 1
            continue
        path = out / (rel.rsplit(".", 1)[0] + ".txt")
        if not (path.is_file() and path.read_text(encoding="utf-8", errors="replace") == caption + "\n"):
            sd.files.write_text_atomic(path, caption + "\n")
        written += 1
    return written, skipped


def write_captions(source, out: Path, folder: Path, args, settings: dict, failed: dict[str, str]) -> int:
    """Every caption from the finished parts, the review and the summary (run once every part is done but
    those in ``failed``, which could not be read); returns the exit status (1: no caption written)."""
    options = compose_options(args)
    names = [name for name in source.parts if name not in failed]
    counts = dataset_tag_counts(folder, names, options) if options.min_tag_count > 1 else Counter()
    digest = fingerprint(options, counts, settings)
    summary = sd.data.stages.Summary(STAGE)
    tags = Counter()
    images = 0
    sheets = sd.data.review.ContactSheets(out / REVIEW_DIR, max_pages=args.review_pages) if args.review_pages else None
    for path in (out / REVIEW_DIR).glob("sheet_*.png"):
        path.unlink()
    total = sum(len(part) for part in source.parts.values()) if isinstance(source, FolderInput) else source.count
    with tqdm(total=total, unit="img", desc=f"{STAGE} captions", dynamic_ncols=True) as bar:
        for name in names:
            captions = final_captions(folder, name, options, counts)
            model_stats = json.loads(sd.data.stages.output_paths(folder, name, ".parquet")[1].read_text())
            if isinstance(source, FolderInput):
                written, skipped = write_folder_captions(out, captions)
                bar.update(len(source.parts[name]))
                summary.kept += written
                summary.dropped.update(model_stats.get("failed", {}))
                summary.dropped.update(skipped)
                summary.note_examples(model_stats.get("examples", {}))
            else:
                _, stats_path = sd.data.stages.output_paths(out, name)
                done = sd.data.stages.output_done(out, name) and \
                    json.loads(stats_path.read_text()).get("compose_sha1") == digest
                if done:
                    summary.add_done(stats_path)
                    bar.update(model_stats.get("count", 0))
                else:
                    summary.add(write_shard_captions(source, name, out, captions, model_stats, digest, bar))
            images += sum(1 for caption, _, _ in captions.values() if caption)
            tags.update(written_tags(captions.values()))
            if sheets is not None and not sheets.full:
                add_to_review(sheets, source, name, captions, args.max_pixels)
    pages = sheets.close() if sheets is not None else []
    sd.data.review.write_tag_table(out / REVIEW_DIR / "tags.csv", tags, images)
    for name, error in failed.items():
        summary.input_failed("unreadable_input", name, error)
    summary.finish(out, input=args.input, models=settings, compose=options.record(), review_pages=len(pages),
                   tags=len(tags), failed_shards=summary.failed_inputs)
    if pages:
        print(f"{STAGE}: review {len(pages)} contact sheets in {out / REVIEW_DIR} (sheet_0001.png ...) and "
              f"{out / REVIEW_DIR / 'tags.csv'} before training on these captions")
    return summary.exit_code()


def add_to_review(sheets, source, name: str, captions: dict, max_pixels: int) -> None:
    """The part's captioned images, in order, onto the contact sheets until they are full."""
    for key, data, ext, _, problem in source.samples(name):
        if sheets.full:
            return
        entry = captions.get(key)
        if entry is None or not entry[0] or problem is not None:
            continue
        try:
            image = to_pil(data, ext, max_pixels)
        except Exception:  # noqa: BLE001 - read once already; shown as unreadable rather than stopping the review
            image = None
        sheets.add(image, entry[0], key)


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


@sd.data.stages.ends_cleanly_on_a_full_disk(STAGE)
def main(argv=None) -> int:
    sd.runtime.start_process(uses_torch=False)  # torch comes with the models, after the command line is read
    args = parse_args(argv)
    sd.data.stages.setup_logging()
    import sd.distributed as distributed


    try:
        source = open_input(args)
    except sd.data.stages.UsageError as error:
        print(f"{STAGE}.py: {error}", file=sys.stderr)
        return 2
    out = Path(args.out)
    folder = out / MODEL_DIR
    settings = model_settings(args)
    try:  # before any work: other models than those the finished parts were made with
        sd.data.stages.check_settings(folder, STAGE, settings)
    except sd.data.stages.SettingsChanged as error:
        print(f"{STAGE}.py: {error}", file=sys.stderr)
        return 2
    d = distributed.independent(args.device, args.rank, args.world_size)
    new_out = not out.exists()
    rank_lock = sd.files.FolderLock(folder, ".lock" if d.world_size == 1 else f".lock.rank{d.rank}of{d.world_size}")
    try:  # one process per rank: a second launch of the same command is told who runs it
        rank_lock.acquire()
    except sd.files.FolderLocked as error:
        print(f"{STAGE}.py: {error}", file=sys.stderr)
        return 2
    try:
        code = run(source, out, folder, settings, args, d)
    finally:
        rank_lock.release()
    if code and new_out and out.is_dir() and not any(out.iterdir()):
        out.rmdir()  # a run refused before any output leaves no folder behind
    return code


def run(source, out: Path, folder: Path, settings: dict, args, d) -> int:
    names = list(source.parts)
    mine = [name for i, name in enumerate(names) if i % d.world_size == d.rank
            and not sd.data.stages.output_done(folder, name, ".parquet")]
    models = Models(args, d.device)
    failed: dict[str, str] = {}  # parts this run could not read: left out of the captions, named, tried again next run
    try:
        if mine:
            models.load()  # a model that cannot be loaded stops the stage here, before any output
        sd.data.stages.record_settings(folder, STAGE, settings)
        if mine:
            log.info("%d parts, this rank (%d of %d) captions %d of them", len(names), d.rank, d.world_size, len(mine))
            counted = [len(source.parts[n]) for n in mine] if isinstance(source, FolderInput) else None
            total = sum(counted) if counted else sd.data.stages.input_sample_count([source.parts[n] for n in mine])
            with tqdm(total=total, unit="img", desc=f"{STAGE} models", dynamic_ncols=True) as bar:
                for name in mine:
                    try:
                        model_part(source, name, folder, models, args, bar)
                    except (OSError, tarfile.TarError, EOFError) as error:  # named; tried again next run
                        if sd.data.stages.disk_full(error):
                            raise
                        log.warning("%s: part %s unreadable (%s); the next run tries it again", STAGE, name, error)
                        failed[name] = sd.cli.first_line(error)
        missing = [name for name in names if name not in failed
                   and not sd.data.stages.output_done(folder, name, ".parquet")]
        if missing:
            print(f"{STAGE}: {len(names) - len(missing)} of {len(names)} parts captioned in {folder}; the rest "
                  f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}) belong to other ranks or could not "
                  "be read: the captions are written once all are done (run the same command again)")
            return 0
        lock = sd.files.FolderLock(out, CAPTIONS_LOCK)
        try:
            lock.acquire()
        except sd.files.FolderLocked as error:  # another rank finished at the same moment and writes them
            print(f"{STAGE}: the captions are being written by another process ({error})")
            return 0
        try:
            code = write_captions(source, out, folder, args, settings, failed)
        finally:
            lock.release()
    except sd.data.captioning.ModelLoadError as error:
        print(f"{STAGE}.py: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{STAGE}.py: interrupted; the finished parts in {folder} are kept: run the same command to go on",
              file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())

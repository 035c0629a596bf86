"""Import a local folder of images into webdataset shards.

    python pipeline/01e_import_folder.py --input DIR --out SHARD_DIR [--layout flat|metadata|template] \\
        [--resolution 512] [--keep_aspect [short|long]] [--control NAME ...]

Reads every image under ``--input`` (recursively; hidden files and folders are ignored) with its
caption, in one of three layouts:

* ``flat`` (default): ``photo.png`` + ``photo.txt`` beside it (the kohya / DreamBooth layout).
* ``metadata``: ``photo.png`` + ``photo.json`` (or ``photo.png.json``) holding at least
  ``{"tags": ["tag a", ...], "score": 7.5}`` (a booru-style export). The caption is built from the
  tags: excluded, dropped, renamed, scored, bonus-weighted and optionally shuffled (see --help).
* ``template``: every image gets ``--template`` with ``{folder}`` replaced by its parent folder's
  name (identity datasets such as VGGFace2: ``n000001/0001_01.jpg``), optionally mapped through
  ``--template_map``.

Writes ``SHARD_DIR/NNNNN.tar`` (``key.jpg``, ``key.txt`` caption, ``key.json`` metadata with the
source path, the original and the written size and, for the metadata layout, the final tags and
score), each followed by ``NNNNN_stats.json`` (its done marker: kept and skipped counts by reason),
and ``01e_import_folder_summary.json`` at the end. ``key.jpg`` is the centre square scaled to
``--resolution``; with ``--keep_aspect`` it is the whole image, its short side (``--keep_aspect long``:
its long side) scaled to ``--resolution`` and the other in proportion, for ``encode_latents.py
--buckets``, which crops each image to its aspect-ratio bucket. Either way images more elongated
than 8:1 are skipped (``extreme_aspect``), which bounds an output's long side at 8 x ``--resolution``.

Loss masks (for ``SD_Train.py --masked_loss``): ``photo_mask.png`` (or any image extension) beside
``photo.jpg`` is that image's mask, grey level 0..255 = weight 0..1 of each pixel in the training loss
(black: not learnt, white: learnt in full). It is resized and cropped exactly as its image and travels
as ``key.mask.png``; a mask of another size but the same aspect ratio is first scaled to its image's
size. A mask of another aspect ratio (``mask_mismatch``) or one that does not decode (``bad_mask``)
skips its image, counted and named by the mask's path; so do two masks for one image
(``ambiguous_mask``). Files named ``*_mask.<ext>`` are never imported as images: one without its image
is counted as ``orphan_masks`` in the summary. The stats count the samples with a mask as ``masked``.

Conditioning images (for ControlNet training, ``encode_latents.py --control NAME``): with ``--control NAME``
(repeatable), ``photo_NAME.png`` (or any image extension) beside ``photo.jpg`` is its conditioning image
``NAME`` (edges, depth, a pose, a subject mask), travelling as ``key.NAME.png``, grey or colour as it
is: the rules of masks apply, with their own reasons (``control_mismatch``, ``bad_control``,
``ambiguous_control``, the file named; ``orphan_controls`` in the summary). An image without one is
imported without it (``encode_latents.py --control`` skips it as ``no_control``); the stats count the
samples carrying each name under ``controls``. Without ``--control NAME`` a ``photo_NAME.png`` is an
image like any other.

Images are sorted by relative path and cut into shards of ``--shard_size``, so a re-run skips
finished shards and is a no-op once all are done. The key is the relative path without its
extension, ``/`` -> ``__`` and other punctuation -> ``_`` (``sub/dir/img.01.png`` ->
``sub__dir__img_01``); a collision or a very long path gets a short hash of the path appended.
Bad images and captions (a caption file that is not UTF-8: ``bad_caption_encoding``) are skipped and
counted, never fatal; an image's format is read from its bytes, not its extension. Images narrower or
lower than ``--min_size`` pixels (default: a quarter of ``--resolution``) are skipped as ``too_small``
rather than upscaled into blur. The console's last line counts the skipped images by reason and names
the first few of each; the stats and summary files name up to 20.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import random
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

import sd.data.shards
import sd.data.stages
import sd.files
import sd.runtime

STAGE = "01e_import_folder"
DEFAULT_TEMPLATE = "a photo of a person"
MAX_KEY_BYTES = 80  # USTAR member names hold 100 bytes; keys carry no folder, plus ".json"
METADATA_ONLY = ("exclude_tags", "drop_tags", "tag_map", "rename", "min_score", "tag_bonus", "score_tags",
                 "shuffle_tags")
TEMPLATE_ONLY = ("template", "template_map")
MASK = sd.data.shards.MASK_NAME  # photo_mask.png: the loss mask of photo.jpg; photo_NAME.png: --control NAME

log = logging.getLogger(STAGE)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CaptionRules:
    """Everything that decides a caption; its hash guards resumed shards against changed options."""

    layout: str
    default_caption: str | None
    caption_prefix: str
    exclude_tags: frozenset = frozenset()
    drop_tags: frozenset = frozenset()
    renames: dict = field(default_factory=dict)
    min_score: float | None = None
    tag_bonus: dict = field(default_factory=dict)
    score_tags: bool = False
    shuffle_tags: bool = False
    keep_first: int = 1
    seed: int = 0
    template: str = DEFAULT_TEMPLATE
    template_map: dict = field(default_factory=dict)
    captions_dir: str | None = None  # flat: where photo.txt is found (None: beside the image)

    def fingerprint(self, **extra) -> str:
        record = {**asdict(self), **extra}
        if record["captions_dir"] is None:  # shards written before --captions existed still match
            del record["captions_dir"]
        text = json.dumps(record, sort_keys=True, default=sorted)  # frozensets -> sorted lists
        return hashlib.sha1(text.encode("utf-8")).hexdigest()


def build_parser() -> argparse.ArgumentParser:
    parser = sd.data.stages.StageArgumentParser(__file__, __doc__)
    add = parser.add_argument
    parser.add_input("folder of images to import, searched recursively", old=("--src",))
    parser.add_out("output folder for NNNNN.tar + NNNNN_stats.json")
    add("--layout", choices=("flat", "metadata", "template"), default="flat",
        help="where captions come from: flat = same-name .txt, metadata = same-name .json tags, "
             "template = --template per folder (default: %(default)s)")
    parser.add_resolution("side of the square output images in pixels, a multiple of 8; with --keep_aspect "
                          "the short (or long) side")
    add("--keep_aspect", nargs="?", const="short", choices=sd.data.shards.KEEP_ASPECT_SIDES, default=None,
        metavar="short|long",
        help="keep the whole image instead of its centre square: its short side (--keep_aspect alone) or its "
             "long side (--keep_aspect long) scaled to --resolution, for encode_latents.py --buckets "
             "(default: off, the centre square)")
    add("--shard_size", type=int, default=1000, help="images per output shard (default: %(default)s)")
    add("--max_pixels", type=int, default=sd.data.shards.DEFAULT_MAX_PIXELS,
        help="skip images with more pixels than this, read from the header (default: %(default)s)")
    add("--min_size", type=int, default=None,
        help="skip images whose width or height is below this many pixels (too_small): they would be "
             "upscaled into blur; 0 imports every size (default: a quarter of --resolution)")
    add("--captions", default=None, metavar="DIR",
        help="flat: read photo.txt from DIR at the image's relative path (sub/a.jpg -> DIR/sub/a.txt), e.g. the "
             "captions 03c_caption_images.py wrote (default: beside each image)")
    add("--default_caption", default=None,
        help="flat/metadata: caption for images whose .txt is missing or empty, or whose tags are all removed "
             "(default: none, such images are skipped as no_caption)")
    add("--caption_prefix", default="", help="text put first in every caption, joined with ', ' (default: none)")
    add("--exclude_tags", action="append", default=[], metavar="A,B",
        help="metadata: skip images carrying any of these tags; repeatable (default: none)")
    add("--drop_tags", action="append", default=[], metavar="A,B",
        help="metadata: remove these tags from captions, keep the image; repeatable (default: none)")
    add("--tag_map", default=None, metavar="FILE.json",
        help='metadata: JSON {"old tag": "new tag"} renaming tags; "" removes a tag (default: none)')
    add("--rename", action="append", default=[], metavar="OLD=NEW",
        help="metadata: rename one tag (overrides --tag_map; OLD= removes it); repeatable (default: none)")
    add("--min_score", type=float, default=None,
        help="metadata: skip images whose score plus bonuses is below this; images without a score are "
             "then skipped as no_score (default: no threshold)")
    add("--tag_bonus", action="append", default=[], metavar="TAG=X",
        help="metadata: add X to the score of images carrying TAG, before --min_score; repeatable "
             "(default: none)")
    parser.add_bool("--score_tags", help="metadata: start each caption with score_N, N = floor(score + bonuses) "
                                         "clamped to 0..9 (default: off)")
    parser.add_bool("--shuffle_tags",
                    help="metadata: shuffle tag order per image, seeded by --seed and the key (default: off)")
    add("--keep_first", type=int, default=1,
        help="with --shuffle_tags: tags kept in place at the front (default: %(default)s)")
    add("--seed", type=int, default=0, help="seed of --shuffle_tags (default: %(default)s)")
    add("--template", default=None,
        help=f"template: caption with {{folder}} = parent folder name (default: {DEFAULT_TEMPLATE!r})")
    add("--template_map", default=None, metavar="FILE.json",
        help='template: JSON {"folder": "name"} used for {folder}; unmapped folders keep their name (default: none)')
    add("--control", action="append", default=[], metavar="NAME",
        help="import photo_NAME.<ext> beside photo.jpg as its conditioning image key.NAME.png (ControlNet: "
             "encode_latents.py --control NAME), cut and scaled as its image; NAME is lower-case letters, digits "
             "and _; repeatable, or NAME,NAME (default: none)")
    return parser


def parse_args(argv=None) -> tuple[argparse.Namespace, CaptionRules]:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args = check_values(args)
        rules = make_rules(args)
    except ValueError as error:
        parser.error(str(error))
    return args, rules


def check_values(args) -> argparse.Namespace:
    """The flags checked, as a new namespace with ``--control``'s names split, deduplicated and sorted."""
    control = sorted({name.strip() for value in args.control for name in value.split(",") if name.strip()})
    args = argparse.Namespace(**{**vars(args), "control": control})
    for name in args.control:
        if not sd.data.shards.is_control_name(name):
            raise ValueError(f"--control {name!r}: a conditioning image's name is lower-case letters, digits and _, "
                             f"not {MASK!r} (photo_mask.png is the loss mask, always imported)")
    if args.resolution % 8:
        raise ValueError(f"--resolution must be a positive multiple of 8, got {args.resolution}")
    for name in ("shard_size", "max_pixels"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.keep_first < 0:
        raise ValueError(f"--keep_first must be >= 0, got {args.keep_first}")
    if args.min_size is not None and args.min_size < 0:
        raise ValueError(f"--min_size must be >= 0 (0 imports every size), got {args.min_size}")
    if not Path(args.input).is_dir():
        raise ValueError(f"--input {args.input} is not a folder")
    if args.captions is not None and not Path(args.captions).is_dir():
        raise ValueError(f"--captions {args.captions} is not a folder")
    # Options of another layout would be silently ignored; a user who passes them expects an effect.
    def given(name):  # 0 and "" count as given: --min_score 0 is a real threshold
        value = getattr(args, name)
        return value is not None and value is not False and value != []

    wrong = [name for name in METADATA_ONLY if args.layout != "metadata" and given(name)]
    wrong += [name for name in TEMPLATE_ONLY if args.layout != "template" and given(name)]
    if args.layout == "template" and given("default_caption"):
        wrong.append("default_caption")
    if args.layout != "flat" and given("captions"):
        wrong.append("captions")
    if wrong:
        raise ValueError(f"--{wrong[0]} does not apply to --layout {args.layout}")
    return args


def make_rules(args) -> CaptionRules:
    renames = load_string_map(args.tag_map, "--tag_map") if args.tag_map else {}
    renames.update(pairs(args.rename, "--rename"))
    bonus = {}
    for tag, value in pairs(args.tag_bonus, "--tag_bonus").items():
        try:
            bonus[tag] = float(value)
        except ValueError:
            raise ValueError(f"--tag_bonus {tag}={value}: {value!r} is not a number") from None
        if not math.isfinite(bonus[tag]):
            raise ValueError(f"--tag_bonus {tag}={value} is not finite")
    return CaptionRules(
        layout=args.layout, default_caption=args.default_caption, caption_prefix=clean_prefix(args.caption_prefix),
        exclude_tags=frozenset(tag_list(args.exclude_tags)), drop_tags=frozenset(tag_list(args.drop_tags)),
        renames=renames, min_score=args.min_score, tag_bonus=bonus, score_tags=args.score_tags,
        shuffle_tags=args.shuffle_tags, keep_first=args.keep_first, seed=args.seed,
        template=args.template if args.template is not None else DEFAULT_TEMPLATE,
        template_map=load_string_map(args.template_map, "--template_map") if args.template_map else {},
        captions_dir=str(Path(args.captions).resolve()) if args.captions else None)


def tag_list(values: list[str]) -> list[str]:
    return [tag.strip() for value in values for tag in value.split(",") if tag.strip()]


def pairs(values: list[str], flag: str) -> dict[str, str]:
    result = {}
    for value in values:
        old, sep, new = value.rpartition("=") if flag == "--tag_bonus" else value.partition("=")
        if not sep or not old.strip():
            raise ValueError(f"{flag} {value!r}: expected {'TAG=X' if flag == '--tag_bonus' else 'OLD=NEW'}")
        result[old.strip()] = new.strip()
    return result


def load_string_map(path: str, flag: str) -> dict[str, str]:
    try:
        mapping = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{flag} {path}: {error}") from None
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise ValueError(f'{flag} {path}: expected a JSON object of strings, {{"old": "new", ...}}')
    return {old.strip(): new.strip() for old, new in mapping.items()}


def clean_prefix(prefix: str) -> str:
    # The prefix is joined with ", ", so a trailing separator the user typed would double it.
    return prefix.strip().rstrip(",").strip()


# ---------------------------------------------------------------------------------------------
# Listing and keys
# ---------------------------------------------------------------------------------------------


def match_files(images: list[str], files: list[str], name: str = MASK) -> tuple[dict[str, list[str]], list[str]]:
    """``({image: [its companions]}, companions without an image)``: ``dir/photo_NAME.*`` belongs to
    ``dir/photo.*`` (``name``: ``mask``, or a conditioning image's)."""
    by_stem: dict[str, list[str]] = {}
    for file in files:
        by_stem.setdefault(file.rsplit(".", 1)[0][: -len(name) - 1], []).append(file)
    found = {}
    for image in images:
        if (stem := image.rsplit(".", 1)[0]) in by_stem:
            found[image] = by_stem[stem]
    matched = {file for image_files in found.values() for file in image_files}
    return found, [file for file in files if file not in matched]


def match_companions(images: list[str], files: dict[str, list[str]]) -> tuple[dict[str, dict[str, list[str]]],
                                                                              dict[str, list[str]]]:
    """``({image: {name: its files}}, {name: files without an image})`` over every companion name."""
    found: dict[str, dict[str, list[str]]] = {}
    orphans = {}
    for name, companions in files.items():
        matched, orphans[name] = match_files(images, companions, name)
        for image, rels in matched.items():
            found.setdefault(image, {})[name] = rels
    return found, orphans


def path_hash(rel: str) -> str:
    return hashlib.sha1(os.fsencode(rel)).hexdigest()[:8]  # a name that is not UTF-8 hashes as its bytes


def base_key(rel: str) -> str:
    stem = rel.rsplit(".", 1)[0]
    return "__".join(re.sub(r"[^\w-]", "_", part) for part in stem.split("/"))


def make_keys(rels: list[str]) -> list[str]:
    """One unique key per path, from the path alone (so the same file keeps its key across runs)."""
    keys = [base_key(rel) for rel in rels]
    seen: dict[str, int] = {}
    for key in keys:
        seen[key] = seen.get(key, 0) + 1
    for i, (rel, key) in enumerate(zip(rels, keys)):
        if seen[key] > 1 or len(key.encode("utf-8")) > MAX_KEY_BYTES:
            short = key.encode("utf-8")[: MAX_KEY_BYTES - 10].decode("utf-8", errors="ignore")
            keys[i] = f"{short}_{path_hash(rel)}"
    if len(set(keys)) != len(keys):
        raise RuntimeError("two image paths map to the same key even with a path hash")
    return keys


# ---------------------------------------------------------------------------------------------
# Captions (each returns caption + metadata, the caption None or "" where there is none to use, which
# sd.data.stages.check_import refuses; or raises sd.data.shards.ImageSkip with the reason)
# ---------------------------------------------------------------------------------------------


def join_caption(rules: CaptionRules, parts: list[str]) -> str:
    return ", ".join(([rules.caption_prefix] if rules.caption_prefix else []) + parts)


def flat_caption(src: Path, rel: str, rules: CaptionRules) -> tuple[str | None, dict]:
    text = sd.data.stages.read_caption(Path(rules.captions_dir or src) / (rel.rsplit(".", 1)[0] + ".txt"))
    if text == "":
        text = rules.default_caption or ""
    return (join_caption(rules, [text]) if text else text), {}


def template_caption(rel: str, rules: CaptionRules, src_name: str) -> tuple[str, dict]:
    folder = rel.rsplit("/", 2)[-2] if "/" in rel else src_name
    name = rules.template_map.get(folder, folder)
    # str.replace, not str.format: a template may contain other braces.
    return join_caption(rules, [rules.template.replace("{folder}", name)]), {"folder": folder}


def read_tag_record(src: Path, rel: str) -> tuple[list[str], float | None]:
    """Tags and score from ``photo.json`` or ``photo.png.json`` (both exporters exist)."""
    stem_json, full_json = src / (rel.rsplit(".", 1)[0] + ".json"), src / (rel + ".json")
    path = stem_json if stem_json.is_file() else full_json
    if not path.is_file():
        raise sd.data.shards.ImageSkip("no_metadata", f"{stem_json.name} missing")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        tags, score = record.get("tags", []), record.get("score")
        if isinstance(tags, str):
            tags = tags.split(",")
        if not isinstance(tags, list) or not all(isinstance(tag, str) for tag in tags):
            raise ValueError("tags is not a list of strings")
        if score is not None:
            if isinstance(score, bool):
                raise ValueError("score is not a number")
            score = float(score)
            if not math.isfinite(score):
                raise ValueError("score is not finite")
    except (OSError, UnicodeDecodeError, ValueError, TypeError, AttributeError) as error:
        raise sd.data.shards.ImageSkip("bad_metadata", f"{path.name}: {error}") from None
    return [tag.strip() for tag in tags if tag.strip()], score


def metadata_caption(src: Path, rel: str, key: str, rules: CaptionRules) -> tuple[str, dict]:
    source_tags, source_score = read_tag_record(src, rel)
    renamed = [(tag, rules.renames.get(tag, tag)) for tag in source_tags]
    # A tag matches exclude/drop/bonus lists under its source name or its renamed one, so a user
    # can write whichever they see.
    names = {name for pair in renamed for name in pair}
    if names & rules.exclude_tags:
        raise sd.data.shards.ImageSkip("excluded_tag", ", ".join(sorted(names & rules.exclude_tags)))
    score = source_score
    if score is not None:
        score += sum(bonus for tag, bonus in rules.tag_bonus.items() if tag in names)
    if rules.min_score is not None and score is None:
        raise sd.data.shards.ImageSkip("no_score")
    if rules.min_score is not None and score < rules.min_score:
        raise sd.data.shards.ImageSkip("low_score", f"{score} < {rules.min_score}")
    tags = final_tags(renamed, rules, key)
    if not tags and rules.default_caption:
        tags = [rules.default_caption]
    if not tags:
        return "", {}
    score_tag = [f"score_{min(9, max(0, math.floor(score)))}"] if rules.score_tags and score is not None else []
    meta = {"tags": tags, "score": score, "source_score": source_score}
    return join_caption(rules, score_tag + tags), meta


def final_tags(renamed: list[tuple[str, str]], rules: CaptionRules, key: str) -> list[str]:
    tags: list[str] = []
    for source, new in renamed:
        if new and source not in rules.drop_tags and new not in rules.drop_tags and new not in tags:
            tags.append(new)  # two tags renamed to one name appear once
    if rules.shuffle_tags:
        # Seeded by the key (a string seed is hashed with SHA-512, stable across processes), so a
        # re-run or a resumed run writes the same caption.
        head, tail = tags[: rules.keep_first], tags[rules.keep_first :]
        random.Random(f"{rules.seed}/{key}").shuffle(tail)
        tags = head + tail
    return tags


def caption_for(src: Path, rel: str, key: str, rules: CaptionRules) -> tuple[str, dict]:
    if rules.layout == "metadata":
        return metadata_caption(src, rel, key, rules)
    if rules.layout == "template":
        return template_caption(rel, rules, src.resolve().name)
    return flat_caption(src, rel, rules)


# ---------------------------------------------------------------------------------------------
# Shards
# ---------------------------------------------------------------------------------------------


# The skip reasons that name a companion file (the loss mask, a conditioning image), not its image.
COMPANION_SKIPS = (*sd.data.shards.MASK_SKIPS, "ambiguous_mask", "bad_control", "control_mismatch", "ambiguous_control")


def import_shard(src: Path, out: Path, index: int, items: list[tuple[str, str]], rules: CaptionRules,
                 args, fingerprints: dict, bar, companions: dict[str, dict[str, list[str]]] | None = None) -> dict:
    """Shard ``index`` of ``items`` (relative path, key); ``companions``: each image's mask and
    conditioning-image files by name."""
    stats, samples = sd.data.stages.ShardStats(), []
    companions = companions or {}
    for rel, key in items:
        files = companions.get(rel, {})
        try:
            caption, meta = caption_for(src, rel, key, rules)
            sd.data.stages.check_import(caption)  # the caption's rules first: no image read for a caption refused
            data = sd.files.read_file_bounded(src / rel, sd.data.stages.MAX_MEMBER_BYTES)
            payloads = read_companions(src, files)
            sd.data.stages.check_import(caption, sd.data.shards.header_size(data), min_size=min_size(args),
                                        max_pixels=args.max_pixels)  # and the size's, from the header
            mask = payloads.pop(MASK, None)
            if mask is not None:
                meta = {**meta, "mask_source": files[MASK][0]}
            if payloads:
                meta = {**meta, "control_sources": {name: files[name][0] for name in payloads}}
            samples.append(sd.data.stages.image_sample(key, data, sd.data.stages.image_extension(rel), caption,
                                                    args.resolution, {"source": rel, **meta}, args.max_pixels,
                                                    args.keep_aspect, mask, payloads))
        except sd.data.shards.ImageSkip as skip:
            if skip.reason in COMPANION_SKIPS:  # the companion is at fault: it is the file named
                named = " and ".join(files.get(skip.member or MASK, []))
                log.warning("%s: %s (its image %s is skipped)", named, skip, rel)
                stats.skip(skip.reason, named)
            else:
                stats.skip(skip.reason, rel)
        except sd.files.TooLarge as error:  # no image file is this big: refused before it is read whole
            log.warning("%s", error)
            stats.skip("too_large_file", rel)
        except OSError as error:  # unreadable file (permissions, vanished mid-run)
            log.warning("%s: %s", rel, error)
            stats.skip("unreadable", rel)
        bar.update(1)
    masked = sum(sample.mask is not None for sample in samples)
    counts = {name: sum(name in sample.controls for sample in samples) for name in args.control}
    return sd.data.stages.write_shard(out, index, samples, stats, masked=masked,
                                      **({"controls": counts} if counts else {}), **fingerprints)


def read_companions(src: Path, files: dict[str, list[str]]) -> dict[str, bytes]:
    """The files of an image's companions by name (its one mask, its conditioning images); two files of
    one name raise ``ImageSkip("ambiguous_mask")`` (``ambiguous_control``), an unreadable one
    ``ImageSkip("bad_mask")`` (``bad_control``), with ``member`` the name."""
    payloads = {}
    for name, rels in files.items():
        what = "mask" if name == MASK else "control"
        try:
            if len(rels) > 1:
                raise sd.data.shards.ImageSkip(f"ambiguous_{what}", f"two {name} files for one image: keep one")
            try:
                payloads[name] = sd.files.read_file_bounded(src / rels[0], sd.data.stages.MAX_MEMBER_BYTES)
            except (OSError, sd.files.TooLarge) as error:
                raise sd.data.shards.ImageSkip(f"bad_{what}", str(error)) from None
        except sd.data.shards.ImageSkip as skip:
            skip.member = name
            raise
    return payloads


def shard_fingerprints(items: list[tuple[str, str]], rules: CaptionRules, args,
                       companions: dict[str, dict[str, list[str]]] | None = None) -> dict:
    sources = hashlib.sha1(b"\n".join(os.fsencode(rel) for rel, _ in items)).hexdigest()
    # keep_aspect enters only when set, so shards written before the flag existed still match; so do
    # the masks and the conditioning images, only for a shard with at least one.
    shape = {"keep_aspect": args.keep_aspect} if args.keep_aspect else {}
    if min_size(args) != sd.data.stages.default_min_size(args.resolution):  # likewise the default minimum size
        shape["min_size"] = min_size(args)
    fingerprints = {"sources_sha1": sources,
                    "options_sha1": rules.fingerprint(resolution=args.resolution, max_pixels=args.max_pixels, **shape)}
    companions = companions or {}
    for key, picked in (("masks_sha1", lambda name: name == MASK), ("controls_sha1", lambda name: name != MASK)):
        pairs = [os.fsencode(f"{rel}\t{file}" if key == "masks_sha1" else f"{rel}\t{name}\t{file}")
                 for rel, _ in items for name, files in sorted(companions.get(rel, {}).items()) if picked(name)
                 for file in files]
        if pairs:
            fingerprints[key] = hashlib.sha1(b"\n".join(pairs)).hexdigest()
    return fingerprints


FINGERPRINT_CHANGES = {"sources_sha1": "images under --input", "masks_sha1": "masks under --input",
                       "controls_sha1": "conditioning images under --input (or --control)",
                       "options_sha1": "options"}


def min_size(args) -> int:
    """The smallest width and height imported: ``--min_size``, or a quarter of ``--resolution``."""
    return sd.data.stages.default_min_size(args.resolution) if args.min_size is None else args.min_size


def check_done_shards(out: Path, plan: list[list[tuple[str, str]]], rules: CaptionRules, args,
                      companions: dict[str, dict[str, list[str]]] | None = None) -> str | None:
    """Why finished shards in ``out`` do not match this run (changed folder, masks, conditioning images or
    options), or None.

    Skipping them anyway would mix two imports in one dataset, or miss and duplicate images.
    """
    for stats_path in sorted(out.glob("[0-9][0-9][0-9][0-9][0-9]_stats.json")):
        index = int(stats_path.name[:5])
        if index >= len(plan):
            return f"{stats_path} is beyond the {len(plan)} shards this folder makes now"
        record = json.loads(stats_path.read_text())
        expected = shard_fingerprints(plan[index], rules, args, companions)
        for name, changed in FINGERPRINT_CHANGES.items():
            if record.get(name) != expected.get(name):
                return f"shard {index:05d} in {out} was written from different {changed}"
    return None


def warn_orphans(orphans: dict[str, list[str]]) -> None:
    for name, files in orphans.items():
        if files:
            log.warning("%d %s files have no image beside them (photo_%s.png needs photo.jpg or another image "
                        "extension), not imported: %s", len(files), name, name, ", ".join(files[:10]))


@sd.data.stages.ends_cleanly_on_a_full_disk(STAGE)
def main(argv=None) -> int:
    sd.runtime.start_process(uses_torch=False)
    args, rules = parse_args(argv)
    sd.data.stages.setup_logging()
    src, out = Path(args.input), Path(args.out)
    rels, companion_files = sd.data.stages.list_images(src, (MASK, *args.control))
    if not rels:  # most likely a wrong --input; an empty dataset is never what was meant
        print(f"01e_import_folder.py: no images ({', '.join(sd.data.shards.IMAGE_EXTENSIONS)}) under {src}", file=sys.stderr)
        return 2
    companions, orphans = match_companions(rels, companion_files)
    warn_orphans(orphans)
    items = list(zip(rels, make_keys(rels)))
    plan = [items[i : i + args.shard_size] for i in range(0, len(items), args.shard_size)]
    out.mkdir(parents=True, exist_ok=True)
    problem = check_done_shards(out, plan, rules, args, companions)
    if problem:
        print(f"01e_import_folder.py: {problem}; use a fresh --out", file=sys.stderr)
        return 2
    masks = sum(MASK in files for files in companions.values())
    log.info("%d images (%d with a mask%s) under %s -> %d shards of up to %d", len(items), masks,
             "".join(f", {sum(n in f for f in companions.values())} with {n}" for n in args.control), src,
             len(plan), args.shard_size)
    summary = sd.data.stages.Summary(STAGE)
    todo = summary.pending(out, list(range(len(plan))))
    with tqdm(total=sum(len(plan[i]) for i in todo), unit="img", desc=STAGE) as bar:
        for index in todo:
            record = import_shard(src, out, index, plan[index], rules, args,
                                  shard_fingerprints(plan[index], rules, args, companions), bar, companions)
            summary.add(record)
    records = [json.loads(sd.data.stages.output_paths(out, i)[1].read_text()) for i in range(len(plan))]
    examples = lambda files: {"count": len(files), "examples": files[:sd.data.stages.MAX_EXAMPLES]}  # noqa: E731
    extra = {"controls": {name: sum(r.get("controls", {}).get(name, 0) for r in records) for name in args.control},
             "orphan_controls": {name: examples(orphans[name]) for name in args.control}} if args.control else {}
    summary.finish(out, layout=args.layout, source=str(src.resolve()), images=len(items),
                   resolution=args.resolution, keep_aspect=args.keep_aspect,
                   masked=sum(r.get("masked", 0) for r in records), orphan_masks=examples(orphans[MASK]), **extra)
    code = summary.exit_code({"too_small": f"their shorter side is under {min_size(args)} px (a quarter of "
                                           f"--resolution {args.resolution}): import at a smaller --resolution "
                                           "(e.g. 64), or keep them with --min_size 0"})
    if code:  # the empty shards go (done marker first), so the command with the fix starts afresh in --out
        for index in range(len(plan)):
            for path in reversed(sd.data.stages.output_paths(out, index)):
                path.unlink(missing_ok=True)
    return code


if __name__ == "__main__":
    sys.exit(main())

"""COCO images and captions -> square webdataset shards, optionally only images with a tall person.

    python pipeline/01d_download_coco.py --images DIR_OR_ZIP --captions captions_train2017.json --out SHARD_DIR \\
        [--instances instances_train2017.json --person_filter] [--min_person_height 0.55] [--seg] \\
        [--shard_size 1000] [--resolution 512] [--download_dir DIR] [--keep_archives] [--workers 8]

Input: ``--images`` is a folder of ``<file_name>`` images or a zip holding ``train2017/<file_name>``,
a local path or a URL (e.g. http://images.cocodataset.org/zips/train2017.zip). ``--captions`` and
``--instances`` are COCO JSON files, paths or URLs (the files inside
http://images.cocodataset.org/annotations/annotations_trainval2017.zip). The caption of an image is
its first caption by annotation id; all its captions go into the metadata. With ``--person_filter``
only images with a non-crowd "person" box at least ``--min_person_height`` x the image height are kept.

With ``--seg`` (needs ``--instances``) each image also gets its subject mask as a conditioning image,
``coco_{id}.seg.png`` (ControlNet training: ``encode_latents.py --control seg``): white where any
instance of ``--seg_category`` (default person; crowd regions included, as they are people too) lies,
black elsewhere, drawn at the image's size from the instances' polygons (``cv2.fillPoly``, corners at
the nearest pixel) or run-length encodings (COCO's RLE, plain or compressed), then cut and scaled as
the image. An image without such an instance gets an all-black mask (its metadata's
``seg_instances`` is 0); one whose segmentation is malformed is skipped (``bad_segmentation``).

Output: the images sorted by id, split into shards of ``--shard_size``: ``SHARD_DIR/NNNNN.tar`` holds
images ``[N * size, (N + 1) * size)`` (``coco_{image id}.jpg`` at ``--resolution``, ``.txt``, ``.json``),
then ``NNNNN_stats.json`` (the done marker), and ``01d_download_coco_summary.json``. A re-run skips
finished shards (and downloads no images zip when all are done). Images without a caption, without
a (tall enough) person, missing from the folder or zip, undecodable or truncated, or over
``sd.data.stages.MAX_MEMBER_BYTES`` (``too_large_member``, checked before reading) are skipped and
counted by reason. Downloaded JSON files are kept in the download folder (a re-run plans its shards
from them); a downloaded images zip is deleted once every shard is written, unless --keep_archives.
"""

from __future__ import annotations

import json
import logging
import sys
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

import numpy as np
from tqdm import tqdm

import sd.data.shards
import sd.data.stages
import sd.files
import sd.runtime

STAGE = "01d_download_coco"
SEG = "seg"  # the conditioning image's name of --seg: coco_{id}.seg.png

log = logging.getLogger(STAGE)


def is_url(source: str) -> bool:
    return "://" in source and not source.startswith("file://")


def local_path(source: str) -> Path:
    return Path(source.removeprefix("file://"))


def parse_args(argv):
    parser = sd.data.stages.StageArgumentParser(__file__, __doc__)
    parser.add_required("--images", "folder of COCO images, or a zip of them (path or URL, e.g. "
                                    "http://images.cocodataset.org/zips/train2017.zip)")
    parser.add_required("--captions", "COCO captions JSON (path or URL), e.g. captions_train2017.json")
    parser.add_out("output folder for the NNNNN.tar shards")
    parser.add_argument("--instances", default=None,
                        help="COCO instances JSON (path or URL), e.g. instances_train2017.json; "
                             "needed by --person_filter (default: none)")
    parser.add_bool("--person_filter",
                    help="keep only images with a non-crowd person box of at least --min_person_height "
                         "(default: off)")
    parser.add_argument("--min_person_height", type=float, default=0.55,
                        help="smallest person box height, as a fraction of the image height, for --person_filter")
    parser.add_bool("--seg", help="write each image's subject mask (every --seg_category instance's polygons or RLE) "
                                  "as its conditioning image coco_{id}.seg.png, for encode_latents.py --control seg; "
                                  "needs --instances (default: off)")
    parser.add_argument("--seg_category", default="person",
                        help="with --seg: the COCO category whose instances make the subject mask "
                             "(default: %(default)s)")
    parser.add_argument("--shard_size", type=int, default=1000, help="images (before filtering) per output shard")
    parser.add_resolution()
    parser.add_download_flags("images zip and annotation files")
    parser.shapes_outputs("resolution", "shard_size", "person_filter", "min_person_height", "seg", "seg_category")
    args = parser.parse_args(argv)
    for flag in ("images", "captions", "instances"):
        source = getattr(args, flag)
        if source is not None and not is_url(source) and not local_path(source).exists():
            parser.error(f"--{flag}: {source} does not exist")
    if args.person_filter and args.instances is None:
        parser.error("--person_filter needs --instances (the COCO instances JSON with the person boxes)")
    if args.seg and args.instances is None:
        parser.error("--seg needs --instances (the COCO instances JSON with the instances' segmentations)")
    if not 0 < args.min_person_height <= 1:
        parser.error("--min_person_height must be in (0, 1]")
    if args.shard_size < 1:
        parser.error("--shard_size must be >= 1")
    return args


# ---------------------------------------------------------------------------------------------
# Annotations
# ---------------------------------------------------------------------------------------------


def fetch(source: str, args) -> Path:
    """A local path for ``source``, downloading a URL into the download folder (once)."""
    if not is_url(source):
        return local_path(source)
    name = PurePosixPath(source.split("?")[0]).name
    return sd.data.stages.download(source, args.download_dir / name, retries=args.retries)


def read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:  # ValueError: bad JSON or bad UTF-8
        raise ValueError(f"{path} is not readable JSON ({error})") from None


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def checked_entries(coco, path: Path, name: str, fields: tuple[str, ...]) -> list[dict]:
    """``coco[name]``, a list of objects whose ``fields`` are integers; anything else names the file."""
    entries = coco.get(name) if isinstance(coco, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path} is not a COCO file (needs a list '{name}')")
    for entry in entries:
        if not isinstance(entry, dict) or not all(isinstance(entry.get(f), int) for f in fields):
            raise ValueError(f"{path}: an entry of '{name}' without integer {', '.join(fields)}: {str(entry)[:80]}")
    return entries


def read_captions(path: Path) -> tuple[list[dict], dict[int, list[str]]]:
    """The images sorted by id, and each image's captions in annotation-id order."""
    coco = read_json(path)
    images = sorted(checked_entries(coco, path, "images", ("id",)), key=lambda image: image["id"])
    for image in images:
        if image.get("height") is not None and not (is_number(image["height"]) and image["height"] > 0):
            raise ValueError(f"{path}: image {image['id']} has height {image['height']!r}, not a positive number")
    captions: dict[int, list[str]] = {}
    for annotation in sorted(checked_entries(coco, path, "annotations", ("id", "image_id")), key=lambda a: a["id"]):
        text = str(annotation.get("caption") or "").strip()
        if text:
            captions.setdefault(annotation["image_id"], []).append(text)
    return images, captions


def category_ids(coco, path: Path, name: str) -> set[int]:
    ids = {c["id"] for c in checked_entries(coco, path, "categories", ("id",)) if c.get("name") == name}
    if not ids:
        raise ValueError(f"{path} has no {name!r} category")
    return ids


def tallest_persons(path: Path, coco=None) -> dict[int, float]:
    """``image id -> height in pixels`` of its tallest non-crowd person box (``coco``: the file, already read).

    Crowd boxes cover a group of people, so their height says nothing about one full body.
    """
    coco = read_json(path) if coco is None else coco
    person_ids = category_ids(coco, path, "person")
    tallest: dict[int, float] = {}
    for annotation in checked_entries(coco, path, "annotations", ("image_id",)):
        if annotation.get("category_id") in person_ids and not annotation.get("iscrowd"):
            box = annotation.get("bbox")
            if not (isinstance(box, list) and len(box) == 4 and all(is_number(v) for v in box)):
                raise ValueError(f"{path}: annotation {annotation.get('id')} has bbox {box!r}, not 4 numbers")
            tallest[annotation["image_id"]] = max(float(box[3]), tallest.get(annotation["image_id"], 0.0))
    return tallest


# ---------------------------------------------------------------------------------------------
# Segmentations (--seg)
# ---------------------------------------------------------------------------------------------


class BadSegmentation(ValueError):
    """An instance's segmentation that is neither polygons nor a run-length encoding of its stated size."""


def instance_segments(path: Path, coco, category: str) -> dict[int, list]:
    """``image id -> [segmentation, ...]`` of every instance of ``category``, compact: a polygon as an
    ``(N, 2)`` float32 array, an RLE as ``(counts, (height, width))``; a malformed one stays as
    ``BadSegmentation`` (its image is skipped, the others are not). Images without one are absent."""
    ids = category_ids(coco, path, category)
    segments: dict[int, list] = {}
    for annotation in checked_entries(coco, path, "annotations", ("image_id",)):
        if annotation.get("category_id") in ids:
            try:
                segment = compact_segmentation(annotation.get("segmentation"))
            except BadSegmentation as error:
                segment = BadSegmentation(f"annotation {annotation.get('id')}: {error}")
            segments.setdefault(annotation["image_id"], []).extend(segment if isinstance(segment, list) else [segment])
    return segments


def compact_segmentation(segmentation) -> list:
    """COCO's ``segmentation`` (a list of flat ``[x1, y1, x2, y2, ...]`` polygons, or an RLE object
    ``{"counts": [...] or "...", "size": [height, width]}``) as ``instance_segments`` keeps it."""
    if isinstance(segmentation, dict):
        size, counts = segmentation.get("size"), segmentation.get("counts")
        if not (isinstance(size, list) and len(size) == 2 and all(isinstance(v, int) and v > 0 for v in size)):
            raise BadSegmentation(f"RLE size {size!r} is not [height, width]")
        if isinstance(counts, str):
            counts = rle_string_counts(counts)
        if not (isinstance(counts, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in counts)):
            raise BadSegmentation("RLE counts are neither a list of integers nor a compressed string")
        return [(np.asarray(counts, dtype=np.int64), (size[0], size[1]))]
    if not isinstance(segmentation, list):
        raise BadSegmentation(f"segmentation of type {type(segmentation).__name__}, not polygons or RLE")
    polygons = []
    for polygon in segmentation:
        if not (isinstance(polygon, list) and len(polygon) >= 6 and len(polygon) % 2 == 0
                and all(is_number(v) for v in polygon)):
            raise BadSegmentation("a polygon is not an even list of at least 6 numbers")
        polygons.append(np.asarray(polygon, dtype=np.float32).reshape(-1, 2))
    return polygons


def rle_string_counts(text: str) -> list[int]:
    """The run lengths of COCO's compressed RLE string (pycocotools' ``rleFrString``): each count is a
    little-endian run of 5-bit groups, ``chr(48 + group)``, with 0x20 set on every group but the last and
    the last's 0x10 bit its sign; from the fourth count on, each is stored as its difference from the
    count two before it."""
    counts: list[int] = []
    position = 0
    while position < len(text):
        value, shift, more = 0, 0, True
        while more:
            if position >= len(text):
                raise BadSegmentation("compressed RLE string ends inside a count")
            group = ord(text[position]) - 48
            if not 0 <= group < 64:
                raise BadSegmentation(f"compressed RLE string holds {text[position]!r}")
            value |= (group & 0x1F) << shift
            more = bool(group & 0x20)
            position, shift = position + 1, shift + 5
            if not more and group & 0x10:
                value -= 1 << shift  # sign-extend
        if len(counts) > 2:
            value += counts[-2]
        counts.append(value)
    return counts


def rle_mask(counts: np.ndarray, height: int, width: int) -> np.ndarray:
    """``(height, width)`` uint8 0/1 from run lengths: alternating runs of 0 and 1, starting with 0, down
    the columns (COCO's RLE is column-major)."""
    counts = np.asarray(counts, dtype=np.int64)
    if (counts < 0).any() or counts.sum() != height * width:
        raise BadSegmentation(f"RLE runs cover {counts.sum()} pixels, not {height}x{width}")
    values = (np.arange(len(counts)) % 2).astype(np.uint8)
    return np.repeat(values, counts).reshape(width, height).T


def subject_mask(segments: list, width: int, height: int) -> np.ndarray:
    """``(height, width)`` uint8, 255 inside any of ``segments`` (``instance_segments``' entries of one
    image, in the image's pixel coordinates), 0 elsewhere. Each polygon is filled on its own, so the result
    is their union whatever their overlaps."""
    import cv2

    mask = np.zeros((height, width), dtype=np.uint8)
    for segment in segments:
        if isinstance(segment, BadSegmentation):
            raise sd.data.shards.ImageSkip("bad_segmentation", str(segment))
        if isinstance(segment, tuple):
            counts, (rle_height, rle_width) = segment
            if (rle_height, rle_width) != (height, width):
                raise sd.data.shards.ImageSkip("bad_segmentation", f"an RLE of {rle_width}x{rle_height} in a "
                                                                   f"{width}x{height} image")
            try:
                mask |= rle_mask(counts, height, width) * np.uint8(255)
            except BadSegmentation as error:
                raise sd.data.shards.ImageSkip("bad_segmentation", str(error)) from None
        else:
            cv2.fillPoly(mask, [np.round(segment).astype(np.int32)], 255)
    return mask


def seg_drawer(image: dict, segments: list):
    """The ``(width, height) -> mask`` function ``sd.data.stages.image_sample`` calls for ``coco_{id}.seg.png``:
    the mask drawn at the size the annotations give the image (the decoded size when they give none;
    a copy of the image at another scale gets the mask scaled)."""
    def draw(width: int, height: int) -> np.ndarray:
        size = (image.get("width"), image.get("height"))
        if all(isinstance(v, int) and v > 0 for v in size):
            width, height = size
        return subject_mask(segments, width, height)

    return draw


# ---------------------------------------------------------------------------------------------
# Images
# ---------------------------------------------------------------------------------------------


class FolderImages:
    """Images read from a folder by COCO file name."""

    def __init__(self, folder: Path):
        self.folder = folder

    def read(self, file_name: str) -> bytes | None:
        path = self.folder / file_name
        return sd.files.read_file_bounded(path, sd.data.stages.MAX_MEMBER_BYTES) if path.is_file() else None

    def close(self) -> None:
        pass


class ZipImages:
    """Images read from a zip (in place, never extracted) by COCO file name.

    Members are indexed without their top folder, so ``train2017/x.jpg`` answers to ``x.jpg``.
    """

    def __init__(self, path: Path):
        self.archive = zipfile.ZipFile(path)
        self.members = {}
        for info in self.archive.infolist():
            if info.is_dir() or not sd.data.stages.is_safe_member(info.filename):
                continue
            parts = PurePosixPath(info.filename).parts
            self.members["/".join(parts[1:] if len(parts) > 1 else parts)] = info

    def read(self, file_name: str) -> bytes | None:
        info = self.members.get(file_name)
        return sd.files.read_zip_member(self.archive, info, sd.data.stages.MAX_MEMBER_BYTES) if info is not None else None

    def close(self) -> None:
        self.archive.close()


def open_images(args):
    """The image source named by --images; raises DownloadError or zipfile.BadZipFile."""
    path = fetch(args.images, args)
    if path.is_dir():
        return FolderImages(path), None
    try:
        return ZipImages(path), (path if is_url(args.images) else None)
    except zipfile.BadZipFile:
        if is_url(args.images):
            path.unlink(missing_ok=True)  # a damaged download: fetch it again next time
        raise


# ---------------------------------------------------------------------------------------------
# Shards
# ---------------------------------------------------------------------------------------------


def person_check(image: dict, tallest: dict[int, float], min_height: float) -> tuple[str | None, float]:
    """``(skip reason or None, tallest person height / image height)``."""
    if image["id"] not in tallest:
        return "no_person", 0.0
    fraction = tallest[image["id"]] / image["height"] if image.get("height") else 0.0
    return ("person_too_small" if fraction < min_height else None), fraction


def shard_items(images: list[dict], captions: dict, tallest: dict | None, source, args, stats,
                segments: dict | None = None):
    """``(key, bytes, ext, caption, metadata, conditioning images)`` of every usable image; the rest are
    counted in ``stats``. ``segments`` (``--seg``): each image's instances, drawn as its ``seg`` image."""
    for image in images:
        key, file_name = f"coco_{image['id']}", str(image.get("file_name", ""))
        metadata = {"source": "coco", "image_id": image["id"], "file_name": file_name,
                    "captions": captions.get(image["id"], [])}
        if not metadata["captions"]:
            stats.skip("no_caption", key)
            continue
        if tallest is not None:
            reason, metadata["person_height_fraction"] = person_check(image, tallest, args.min_person_height)
            if reason:
                stats.skip(reason, key)
                continue
        ext = sd.data.stages.image_extension(file_name)
        if not sd.data.stages.is_safe_member(file_name) or ext is None:
            stats.skip("unsafe_path" if ext else "unsupported_format", key)
            continue
        try:
            data = source.read(file_name)
        except sd.files.TooLarge as error:  # a zip bomb, or a file no image should be
            log.warning("%s: %s", key, error)
            stats.skip("too_large_member", file_name)
            continue
        except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as error:  # one damaged entry or unreadable file
            log.warning("%s: cannot read %s: %s", key, file_name, error)
            stats.skip("unreadable_member", key)
            continue
        if data is None:
            stats.skip("missing_image", key)
            continue
        controls = None
        if segments is not None:
            mine = segments.get(image["id"], [])
            metadata["seg_instances"] = len(mine)
            controls = {SEG: seg_drawer(image, mine)}
        yield key, data, ext, metadata["captions"][0], metadata, controls


def write_coco_shard(index: int, images: list[dict], captions: dict, tallest, source, args, pool,
                     segments: dict | None = None) -> dict:
    stats = sd.data.stages.ShardStats()
    items = shard_items(images, captions, tallest, source, args, stats, segments)
    samples = sd.data.stages.convert_images(items, stats, pool, args.resolution, read_ahead=4 * args.workers)
    first = images[0]["id"] if images else None
    return sd.data.stages.write_shard(args.out, index, samples, stats, first_image_id=first)

def load_inputs(args):
    """Images by id, captions, the tallest person per image (None without --person_filter) and each
    image's instances of --seg_category (None without --seg). The instances file is read once."""
    images, captions = read_captions(fetch(args.captions, args))
    tallest = segments = None
    if args.person_filter or args.seg:
        path = fetch(args.instances, args)
        coco = read_json(path)
        tallest = tallest_persons(path, coco) if args.person_filter else None
        segments = instance_segments(path, coco, args.seg_category) if args.seg else None
    return images, captions, tallest, segments


def write_pending(pending: list[int], images, captions, tallest, args, summary, segments=None) -> None:
    source, downloaded_zip = open_images(args)
    try:
        with ThreadPoolExecutor(args.workers) as pool:
            for index in tqdm(pending, desc="COCO shards", unit="shard"):
                chunk = images[index * args.shard_size:(index + 1) * args.shard_size]
                summary.add(write_coco_shard(index, chunk, captions, tallest, source, args, pool, segments))
    finally:
        source.close()
    if downloaded_zip is not None and not args.keep_archives:
        downloaded_zip.unlink(missing_ok=True)


@sd.data.stages.ends_cleanly_on_a_full_disk(STAGE)
def main(argv=None) -> int:
    sd.runtime.start_process(uses_torch=False)
    args = parse_args(argv)
    summary = sd.data.stages.start_downloads(args, STAGE)
    try:
        images, captions, tallest, segments = load_inputs(args)
    except (sd.data.stages.DownloadError, ValueError, OSError) as error:  # each names its file or URL
        if sd.data.stages.disk_full(error):  # not the input's fault: the stage ends
            raise
        print(f"{STAGE}: cannot read the COCO annotations: {error}", file=sys.stderr)
        return 2
    shard_count = -(-len(images) // args.shard_size)
    pending = summary.pending(args.out, list(range(shard_count)))
    sd.data.stages.keep_settings(args)
    if pending:  # a finished run opens (and downloads) no images
        try:
            write_pending(pending, images, captions, tallest, args, summary, segments)
        except (sd.data.stages.DownloadError, zipfile.BadZipFile) as error:
            print(f"{STAGE}: cannot read the images {args.images}: {error}", file=sys.stderr)
            return 2
    summary.finish(args.out, images=len(images), shards=shard_count, person_filter=args.person_filter,
                   min_person_height=args.min_person_height if args.person_filter else None,
                   **({"seg_category": args.seg_category} if args.seg else {}))
    return summary.exit_code()


if __name__ == "__main__":
    sys.exit(main())

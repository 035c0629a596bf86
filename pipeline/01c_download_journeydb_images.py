"""Download JourneyDB image archives and turn each into one square webdataset shard, captions from the annotations.

    python pipeline/01c_download_journeydb_images.py --archives 0-9 --annotations PATH_OR_URL --out SHARD_DIR \\
        [--base_url https://huggingface.co/datasets/JourneyDB/JourneyDB/resolve/main/data/train/imgs] \\
        [--caption prompt|caption] [--resolution 512] [--download_dir DIR] [--keep_archives] [--workers 8]

Input: archive N is ``{base_url}/{N:03d}.tgz`` holding ``{N:03d}/<name>.jpg`` (paths may start with
``./``). The annotations are JSON lines, plain, gzip-compressed (``.jsonl.gz``) or a ``.tgz`` holding
one ``.jsonl`` (the released file is ``train_anno_realease_repath.jsonl.tgz`` next to ``imgs/``), each
line like ``{"img_path": "./imgs/000/abc.jpg", "prompt": "...", "Task2": {"Caption": "..."}}``. Images
are matched to lines by the last two path components (``000/abc.jpg``). ``--caption prompt`` uses the
prompt; ``--caption caption`` uses Task2.Caption and falls back to the prompt.

Output: ``SHARD_DIR/NNNNN.tar`` with NNNNN = the archive number (``key.jpg`` at ``--resolution``,
``key.txt``, ``key.json`` with the prompt, the Task2 caption and the original size), then
``NNNNN_stats.json`` (the done marker), and ``01c_download_journeydb_images_summary.json``. Keys are
``jdb_{NNN}_{image stem}``. A re-run skips finished archives without downloading or reading anything.
Images without an annotation, undecodable or truncated images, unsafe member paths and members
over ``sd.data.stages.MAX_MEMBER_BYTES`` (``too_large_member``) are skipped and counted by reason; an archive that does not exist (HTTP 404) or cannot be read is counted in the
summary (a bad archive is deleted so the next run downloads it again) and the stage goes on. A
downloaded annotation file is kept in the download folder: every archive needs it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import re
import sys
import tarfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

from tqdm import tqdm

import sd.data.stages
import sd.runtime

STAGE = "01c_download_journeydb_images"
DEFAULT_BASE_URL = "https://huggingface.co/datasets/JourneyDB/JourneyDB/resolve/main/data/train/imgs"
ANNOTATIONS_URL = ("https://huggingface.co/datasets/JourneyDB/JourneyDB/resolve/main/data/train/"
                   "train_anno_realease_repath.jsonl.tgz")
# What a damaged .tgz raises while it is streamed.
ARCHIVE_ERRORS = (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile)

log = logging.getLogger(STAGE)


def parse_args(argv):
    parser = sd.data.stages.StageArgumentParser(__file__, __doc__)
    parser.add_required("--archives", "archive numbers to fetch: a range list such as 0-9 or 0,3")
    parser.add_required("--annotations", f"annotation JSON lines (.jsonl, .jsonl.gz or a .tgz holding one .jsonl): "
                                         f"a path or URL, e.g. {ANNOTATIONS_URL}")
    parser.add_out("output folder for the NNNNN.tar shards")
    parser.add_argument("--base_url", default=DEFAULT_BASE_URL, help="folder URL (or local folder) holding NNN.tgz")
    parser.add_argument("--caption", choices=("prompt", "caption"), default="prompt",
                        help="caption source: the generation prompt, or Task2.Caption (falling back to the prompt)")
    parser.add_resolution()
    parser.add_download_flags("tgz archives")
    parser.shapes_outputs("resolution", "caption")
    args = parser.parse_args(argv)
    args = argparse.Namespace(**{**vars(args), "archives": parser.number_list(args.archives, "--archives")})
    if "://" not in args.annotations and not Path(args.annotations).is_file():
        parser.error(f"--annotations: {args.annotations} does not exist")
    return args


# ---------------------------------------------------------------------------------------------
# Annotations
# ---------------------------------------------------------------------------------------------


def match_name(path: str) -> str:
    """The last two path components (``000/abc.jpg``): what an image and its annotation share."""
    return "/".join(PurePosixPath(path.replace("\\", "/")).parts[-2:])


def annotation_lines(path: Path):
    """Raw lines (bytes) of a .jsonl, a gzip-compressed one, or the first .jsonl inside a tar(.gz).

    Bytes, not text: a line that is not UTF-8 is one bad line for the caller to count, not the end.
    """
    if tarfile.is_tarfile(path):
        with tarfile.open(path, "r|*") as tar:
            for member in tar:
                if member.isfile() and member.name.endswith(".jsonl"):
                    yield from tar.extractfile(member)
                    return
        raise ValueError(f"{path} holds no .jsonl file")
    with open(path, "rb") as handle:
        compressed = handle.read(2) == b"\x1f\x8b"
    with (gzip.open if compressed else open)(path, "rb") as handle:
        yield from handle


def read_annotations(path: Path, folders: set[str]) -> tuple[dict[str, tuple[str, str]], int]:
    """``match name -> (prompt, Task2 caption)`` for images in ``folders``, and the count of unreadable lines.

    Only the wanted archives' lines are kept: the full file describes millions of images.
    """
    annotations, bad_lines = {}, 0
    for line in tqdm(annotation_lines(path), desc="annotations", unit=" lines"):
        if not line.strip():
            continue
        try:
            record = json.loads(line)  # bytes: UTF-8 checked here (a UnicodeDecodeError is a ValueError)
            name = match_name(record["img_path"])
        except (ValueError, KeyError, TypeError, AttributeError):
            bad_lines += 1
            continue
        if name.split("/")[0] in folders:
            task2 = record.get("Task2") if isinstance(record.get("Task2"), dict) else {}
            annotations[name] = (str(record.get("prompt") or "").strip(), str(task2.get("Caption") or "").strip())
    return annotations, bad_lines


def load_annotations(args, archives: list[int]):
    """Download (once) and read the annotations of ``archives``; raises DownloadError / ValueError / OSError."""
    source = args.annotations
    if "://" in source and not source.startswith("file://"):
        source = sd.data.stages.download(source, args.download_dir / PurePosixPath(source.split("?")[0]).name,
                                      retries=args.retries)
    path = Path(str(source).removeprefix("file://"))
    return read_annotations(path, {f"{n:03d}" for n in archives})


# ---------------------------------------------------------------------------------------------
# Archives
# ---------------------------------------------------------------------------------------------


def pick_caption(annotation: tuple[str, str] | None, field: str) -> str:
    if annotation is None:
        return ""
    prompt, task2_caption = annotation
    return (task2_caption or prompt) if field == "caption" else prompt


def archive_items(tar: tarfile.TarFile, number: int, annotations: dict, field: str, stats: sd.data.stages.ShardStats):
    """``(key, bytes, ext, caption, metadata)`` of every usable image; the rest are counted in ``stats``."""
    seen = set()
    for member in tar:
        ext = sd.data.stages.image_extension(member.name)
        if member.isdir() or ext is None:
            continue
        # Links are refused too: they could point anywhere, and a stream cannot follow them.
        if not member.isfile() or not sd.data.stages.is_safe_member(member.name):
            stats.skip("unsafe_path", member.name)
            continue
        name = match_name(member.name)
        key = re.sub(r"[^A-Za-z0-9_-]", "_", f"jdb_{number:03d}_{PurePosixPath(name).name.split('.')[0]}")
        annotation = annotations.get(name)
        caption = pick_caption(annotation, field)
        if not sd.data.stages.admit_sample(stats, seen, key, caption):
            continue
        if member.size > sd.data.stages.MAX_MEMBER_BYTES:  # the size the stream will inflate to, from the header
            log.warning("archive %d: %s has %d bytes, over the cap of %d", number, member.name, member.size,
                        sd.data.stages.MAX_MEMBER_BYTES)
            stats.skip("too_large_member", member.name)
            continue
        metadata = {"source": "journeydb", "archive": number, "img_path": name,
                    "prompt": annotation[0], "task2_caption": annotation[1]}
        yield key, tar.extractfile(member).read(), ext, caption, metadata


def convert_archive(path: Path, number: int, annotations: dict, args):
    """All samples of one archive and their stats; raises one of ARCHIVE_ERRORS for a damaged archive."""
    stats = sd.data.stages.ShardStats()
    # Streamed ("r|*"): one pass over the gzip, members read in order, nothing extracted to disk.
    with tarfile.open(path, "r|*") as tar, ThreadPoolExecutor(args.workers) as pool:
        items = archive_items(tar, number, annotations, args.caption, stats)
        samples = sd.data.stages.convert_images(items, stats, pool, args.resolution, read_ahead=4 * args.workers)
    return samples, stats


def process_archive(args, number: int, annotations: dict, summary: sd.data.stages.Summary) -> None:
    sd.data.stages.archive_to_shard(args, number, f"{number:03d}.tgz",
                                 lambda path: convert_archive(path, number, annotations, args), ARCHIVE_ERRORS,
                                 summary, "missing_archive", archive=number, caption_field=args.caption)


@sd.data.stages.ends_cleanly_on_a_full_disk(STAGE)
def main(argv=None) -> int:
    sd.runtime.start_process(uses_torch=False)
    args = parse_args(argv)
    summary = sd.data.stages.start_downloads(args, STAGE)
    pending = summary.pending(args.out, args.archives)
    annotations, bad_lines = {}, 0
    if pending:  # a finished run reads (and downloads) nothing
        try:
            annotations, bad_lines = load_annotations(args, pending)
        except (sd.data.stages.DownloadError, ValueError, OSError, *ARCHIVE_ERRORS) as error:
            if sd.data.stages.disk_full(error):  # not the input's fault: the stage ends
                raise
            print(f"{STAGE}: cannot read the annotations {args.annotations}: {error}", file=sys.stderr)
            return 2
    sd.data.stages.keep_settings(args)
    for number in tqdm(pending, desc="JourneyDB archives", unit="archive"):
        process_archive(args, number, annotations, summary)
    summary.finish(args.out, archives=len(args.archives), failed_archives=summary.failed_inputs,
                   bad_annotation_lines=bad_lines, caption_field=args.caption)
    return summary.exit_code()


if __name__ == "__main__":
    sys.exit(main())

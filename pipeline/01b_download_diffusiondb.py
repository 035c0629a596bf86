"""Download DiffusionDB parts and turn each into one square webdataset shard, the prompt as caption.

    python pipeline/01b_download_diffusiondb.py --parts 1-500 --out SHARD_DIR \\
        [--base_url https://huggingface.co/datasets/poloclub/diffusiondb/resolve/main/images] \\
        [--resolution 512] [--download_dir DIR] [--keep_archives] [--workers 8]

Input: part N is ``{base_url}/part-{N:06d}.zip``; it holds the images (``<name>.png`` or ``.webp``) and
``part-{N:06d}.json``, which maps each image file name to
``{"p": prompt, "se": seed, "c": cfg, "st": steps, "sa": sampler}``.

Output: ``SHARD_DIR/NNNNN.tar`` with NNNNN = the part number (``key.jpg`` at ``--resolution``, ``key.txt``
= the prompt, ``key.json`` = seed, cfg, steps, sampler and the original size), then
``NNNNN_stats.json`` (the done marker), and ``01b_download_diffusiondb_summary.json``. Keys are
``ddb_{part}_{image stem}``. A re-run skips finished parts without downloading them. Images without a
prompt, undecodable or truncated images, unsafe member paths and members that inflate past
``sd.data.stages.MAX_MEMBER_BYTES`` (``too_large_member``, checked before reading) are skipped and
counted by reason; a part that does not exist (HTTP 404) or is not a valid zip is counted in the
summary (a bad zip is deleted so the next run downloads it again) and the stage goes on with the
other parts.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

from tqdm import tqdm

import sd.data.stages
import sd.files
import sd.runtime

STAGE = "01b_download_diffusiondb"
DEFAULT_BASE_URL = "https://huggingface.co/datasets/poloclub/diffusiondb/resolve/main/images"
# DiffusionDB's short metadata names -> the names written to each sample's JSON.
FIELD_NAMES = {"se": "seed", "c": "cfg", "st": "steps", "sa": "sampler"}

log = logging.getLogger(STAGE)


def parse_args(argv):
    parser = sd.data.stages.StageArgumentParser(__file__, __doc__)
    parser.add_required("--parts", "part numbers to fetch: a range list such as 1-500 or 1,4,9")
    parser.add_out("output folder for the NNNNN.tar shards")
    parser.add_argument("--base_url", default=DEFAULT_BASE_URL,
                        help="folder URL (or local folder) holding part-NNNNNN.zip")
    parser.add_resolution()
    parser.add_download_flags("zip parts")
    parser.shapes_outputs("resolution")
    args = parser.parse_args(argv)
    return argparse.Namespace(**{**vars(args), "parts": parser.number_list(args.parts, "--parts")})


def sample_key(part: int, file_name: str) -> str:
    """webdataset cuts keys at the first dot and reads slashes as folders, so keep only safe characters."""
    stem = PurePosixPath(file_name).name.split(".")[0]
    return re.sub(r"[^A-Za-z0-9_-]", "_", f"ddb_{part}_{stem}")


def read_prompts(archive: zipfile.ZipFile, part: int) -> dict:
    """The part's ``file name -> metadata`` table; an absent table leaves every image without a caption."""
    name = f"part-{part:06d}.json"
    members = [m for m in archive.namelist() if PurePosixPath(m).name == name]
    if not members:
        log.warning("part %d has no %s; its images have no captions", part, name)
        return {}
    table = json.loads(sd.files.read_zip_member(archive, archive.getinfo(members[0]), sd.data.stages.MAX_MEMBER_BYTES))
    if not isinstance(table, dict):
        raise ValueError(f"{name} is not a JSON object")
    return table


def image_members(archive: zipfile.ZipFile, stats: sd.data.stages.ShardStats) -> list[zipfile.ZipInfo]:
    """Image entries in name order; unsafe paths are counted and left out."""
    members = []
    for info in sorted(archive.infolist(), key=lambda i: i.filename):
        if info.is_dir() or sd.data.stages.image_extension(info.filename) is None:
            continue
        if not sd.data.stages.is_safe_member(info.filename):
            stats.skip("unsafe_path", info.filename)
            continue
        members.append(info)
    return members


def part_items(archive: zipfile.ZipFile, part: int, stats: sd.data.stages.ShardStats):
    """``(key, bytes, ext, caption, metadata)`` of every usable image; the rest are counted in ``stats``."""
    prompts = read_prompts(archive, part)
    seen = set()
    for info in image_members(archive, stats):
        file_name = PurePosixPath(info.filename).name
        key = sample_key(part, file_name)
        entry = prompts.get(file_name)
        caption = str(entry.get("p") or "").strip() if isinstance(entry, dict) else ""
        if not sd.data.stages.admit_sample(stats, seen, key, caption):
            continue
        try:
            data = sd.files.read_zip_member(archive, info, sd.data.stages.MAX_MEMBER_BYTES)
        except sd.files.TooLarge as error:  # a zip bomb, or a member no image should be
            log.warning("part %d: %s", part, error)
            stats.skip("too_large_member", info.filename)
            continue
        except (zipfile.BadZipFile, zlib.error, EOFError) as error:  # a damaged entry in an otherwise readable zip
            log.warning("part %d: cannot read %s: %s", part, info.filename, error)
            stats.skip("unreadable_member", key)
            continue
        metadata = {"source": "diffusiondb", "part": part, "file_name": file_name,
                    **{FIELD_NAMES.get(k, k): v for k, v in entry.items() if k != "p"}}
        yield key, data, sd.data.stages.image_extension(file_name), caption, metadata


def convert_part(archive_path: Path, part: int, resolution: int, workers: int):
    """All samples of one part and their stats; raises ``zipfile.BadZipFile`` / ``ValueError`` for a bad part."""
    stats = sd.data.stages.ShardStats()
    with zipfile.ZipFile(archive_path) as archive, ThreadPoolExecutor(workers) as pool:
        samples = sd.data.stages.convert_images(part_items(archive, part, stats), stats, pool, resolution,
                                             read_ahead=4 * workers)
    return samples, stats


def process_part(args, part: int, summary: sd.data.stages.Summary) -> None:
    sd.data.stages.archive_to_shard(args, part, f"part-{part:06d}.zip",
                                 lambda path: convert_part(path, part, args.resolution, args.workers),
                                 (zipfile.BadZipFile, zlib.error, EOFError, ValueError), summary, "missing_part",
                                 part=part)


@sd.data.stages.ends_cleanly_on_a_full_disk(STAGE)
def main(argv=None) -> int:
    sd.runtime.start_process(uses_torch=False)
    args = parse_args(argv)
    summary = sd.data.stages.start_downloads(args, STAGE)
    sd.data.stages.keep_settings(args)
    for part in tqdm(summary.pending(args.out, args.parts), desc="DiffusionDB parts", unit="part"):
        process_part(args, part, summary)
    summary.finish(args.out, parts=len(args.parts), failed_parts=summary.failed_inputs)
    return summary.exit_code()


if __name__ == "__main__":
    sys.exit(main())

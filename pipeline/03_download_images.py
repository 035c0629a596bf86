"""Download the images of filtered LAION metadata with img2dataset into webdataset shards.

    python pipeline/03_download_images.py --input DIR --out SHARD_DIR [--resolution 512] \\
        [--keep_aspect [short|long]] [--processes 4] [--threads 16] \\
        [--distributor multiprocessing|pyspark|ray] [--spark_master URL] [--url_col URL] \\
        [--caption_col TEXT] [--shard_size 10000] [--timeout 10] [--retries 2]

Input: the parquet files of 02_filter_metadata.py (a folder, or one file). URL and caption columns are
detected as in stage 02 unless given, and checked as there (a URL column of numbers is one line
naming the file and column, exit 2, before img2dataset starts); the score columns present
(aesthetic, similarity, watermark, NSFW) are copied into every sample's JSON.

Output (written by img2dataset): ``SHARD_DIR/NNNNN.tar`` (``key.jpg``, ``key.txt`` the caption,
``key.json`` the metadata with the original and the written size), ``NNNNN.parquet`` and
``NNNNN_stats.json``, the shard's done marker; then ``03_download_images_summary.json`` with the
successes, the failures by img2dataset's reason and the size options. ``key.jpg`` is the centre
square at ``--resolution``; with ``--keep_aspect`` it is the whole image, its short side
(``--keep_aspect long``: its long side) scaled to ``--resolution`` and the other in proportion, for
``encode_latents.py --buckets``, which crops each image to its aspect-ratio bucket. Either way
smaller images are enlarged, and images more elongated than 8:1 are dropped ("aspect ratio too
large"), as the other stages do.

img2dataset runs in incremental mode, so a re-run downloads only unfinished shards (and when all are
finished it is not started at all); it does not compare options, so a re-run with another
``--resolution`` or ``--keep_aspect`` needs a fresh ``--out``. Sites whose ``X-Robots-Tag`` header
says noai/noimageai/noindex/noimageindex are skipped, img2dataset's default.
Exits 1 when a shard is still unfinished after img2dataset's own retries: run the same command again.

``--distributor`` is img2dataset's: ``multiprocessing`` (one machine, ``--processes`` x ``--threads``),
``pyspark`` (``pip install pyspark``; local with ``--processes`` cores, the Spark cluster at
``--spark_master``, or the ``--master`` of ``spark-submit`` when it runs this script; every executor
downloads whole shards) or ``ray`` (``pip install ray``; the cluster at ``RAY_ADDRESS``, else a local
one). On a cluster, ``--input`` and ``--out`` must be the same path on every machine (a shared file
system), and every worker needs this Python environment (``PYSPARK_PYTHON`` names it for Spark).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import sys
from pathlib import Path

import pyarrow.parquet as pq

import sd.data.shards
import sd.data.stages
import sd.runtime

STAGE = "03_download_images"
DISK_FULL_BELOW = 16 << 20  # free bytes under which unfinished shards are put down to a full disk
SUMMARY_NAME = f"{STAGE}_summary.json"
SCORE_ROLES = ("aesthetic", "similarity", "watermark", "nsfw")
# Columns img2dataset writes itself and refuses in save_additional_columns (img2dataset/main.py).
IMG2DATASET_RESERVED = {"key", "caption", "url", "width", "height", "original_width", "original_height",
                        "status", "error_message", "exif", "md5", "sha256", "sha512"}
SHARD_DIGITS = 5  # img2dataset's oom_shard_count default: NNNNN.tar
DISTRIBUTORS = {"multiprocessing": None, "pyspark": "pyspark", "ray": "ray"}  # img2dataset's, and what each imports
# --keep_aspect -> img2dataset's resize_mode (img2dataset/resizer.py): both scale the whole image by
# the named side, enlarging small ones (resize_only_if_bigger stays False).
RESIZE_MODES = {"short": "keep_ratio", "long": "keep_ratio_largest"}
log = logging.getLogger(STAGE)


def parse_args(argv):
    parser = sd.data.stages.StageArgumentParser(__file__, __doc__)
    parser.add_input("folder of filtered parquet files (or one parquet file)")
    parser.add_out("output folder for the NNNNN.tar shards")
    parser.add_resolution("side of the square (centre-cropped) output images in pixels; with --keep_aspect "
                          "the short (or long) side")
    parser.add_argument("--keep_aspect", nargs="?", const="short", choices=sorted(RESIZE_MODES), default=None,
                        metavar="short|long",
                        help="keep the whole image instead of its centre square: its short side (--keep_aspect "
                             "alone; img2dataset's keep_ratio) or its long side (--keep_aspect long; "
                             "keep_ratio_largest) scaled to --resolution, smaller images enlarged too; for "
                             "encode_latents.py --buckets (default: off, the centre square)")
    parser.add_argument("--processes", type=int, default=4, help="img2dataset download processes")
    parser.add_argument("--threads", type=int, default=16, help="download threads per process")
    parser.add_argument("--distributor", choices=sorted(DISTRIBUTORS), default="multiprocessing",
                        help="how img2dataset spreads the shards: processes on this machine, a Spark or a Ray cluster")
    parser.add_argument("--spark_master", default="",
                        help="with --distributor pyspark: the cluster's master URL, e.g. spark://HOST:7077 "
                             "(default: local[--processes], this machine)")
    parser.add_argument("--url_col", default=None, help="URL column (default: detected as in stage 02, URL|url)")
    parser.add_argument("--caption_col", default=None,
                        help="caption column (default: detected as in stage 02, TEXT|caption|text)")
    parser.add_argument("--shard_size", type=int, default=10000, help="samples per output shard")
    parser.add_argument("--timeout", type=int, default=10, help="seconds before one image download is abandoned")
    parser.add_retries("extra tries of a failed image download")
    parser.shapes_outputs("resolution", "keep_aspect", "url_col", "caption_col", "shard_size")
    args = parser.parse_args(argv)
    if min(args.processes, args.threads, args.shard_size, args.timeout) < 1:
        parser.error("--processes, --threads, --shard_size and --timeout must be >= 1")
    if args.spark_master and args.distributor != "pyspark":
        parser.error("--spark_master needs --distributor pyspark")
    module = DISTRIBUTORS[args.distributor]
    if module and importlib.util.find_spec(module) is None:
        parser.error(f"--distributor {args.distributor} needs {module}: pip install {module}")
    return args


def input_files(source: Path) -> list[Path]:
    """The files img2dataset will read, in its order (it sorts the folder's *.parquet)."""
    if source.is_dir():
        return sorted(source.glob("*.parquet"))
    return [source] if source.suffix == ".parquet" and source.is_file() else []


def detect_columns(files: list[Path], args) -> tuple[str, str, list[str]]:
    """URL column, caption column and the score columns to keep; the same names in every file, since
    img2dataset takes one name per role for all of them. Raises sd.data.stages.UsageError."""
    overrides = {"url": args.url_col, "caption": args.caption_col}
    found = set()
    for path in files:
        columns = sd.data.stages.parquet_columns(path, overrides)
        scores = tuple(columns[role] for role in SCORE_ROLES if columns[role] not in (None, *IMG2DATASET_RESERVED))
        found.add((columns["url"], columns["caption"], scores))
    if len(found) > 1:
        raise sd.data.stages.UsageError(f"the input files name their columns differently ({sorted(found)}); "
                                 "download them in separate runs")
    url, caption, scores = found.pop()
    return url, caption, list(scores)


def check_output_folder(out: Path) -> None:
    """img2dataset reads every OUT/*.json as a done marker named by the number before its first '_'."""
    for path in out.glob("*.json") if out.is_dir() else []:
        if path.name != SUMMARY_NAME and not re.fullmatch(r"\d+_.*\.json", path.name):
            raise ValueError(f"{path} would be taken for a shard's done marker by img2dataset; move it away")


def expected_shards(files: list[Path], shard_size: int) -> list[int]:
    """The shard numbers img2dataset gives these inputs: each file ceil(rows / shard_size), numbered on."""
    total = sum(math.ceil(pq.ParquetFile(path).metadata.num_rows / shard_size) for path in files)
    return list(range(total))


def stats_path(out: Path, shard: int) -> Path:
    return out / f"{shard:0{SHARD_DIGITS}d}_stats.json"


def run_img2dataset(args, url_col: str, caption_col: str, scores: list[str]) -> None:
    # sd.runtime.start_process() has set NO_ALBUMENTATIONS_UPDATE: this import pulls in albumentations,
    # which otherwise asks the network for a newer version.
    from img2dataset import download

    with spark_session(args):
        download(
            url_list=str(args.input), input_format="parquet", url_col=url_col, caption_col=caption_col,
            save_additional_columns=scores or None, output_folder=str(args.out), output_format="webdataset",
            image_size=args.resolution, resize_mode=RESIZE_MODES.get(args.keep_aspect, "center_crop"),
            # img2dataset scales the whole image before it crops (or instead): a 20000x10 strip would become
            # 1M x 512 pixels. The limit the other stages refuse at ("extreme_aspect") bounds that.
            max_aspect_ratio=sd.data.shards.DEFAULT_MAX_ASPECT, encode_format="jpg", encode_quality=95,
            processes_count=args.processes, thread_count=args.threads, number_sample_per_shard=args.shard_size,
            timeout=args.timeout, retries=args.retries, incremental_mode="incremental", enable_wandb=False,
            distributor=args.distributor,
        )


@contextlib.contextmanager
def spark_session(args):
    """For --distributor pyspark, the session img2dataset runs on: it takes the active one (as its
    pyspark example shows) or makes a local[processes] one itself."""
    if args.distributor != "pyspark":
        yield
        return
    from pyspark.sql import SparkSession

    if args.spark_master:
        builder = SparkSession.builder.master(args.spark_master)
    elif "PYSPARK_GATEWAY_PORT" in os.environ:  # started by spark-submit: its --master and --conf hold
        builder = SparkSession.builder
    else:
        # Local workers run pyspark's default "python3" from PATH, which may lack img2dataset: this one has it.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        yield
        return
    spark = builder.appName(STAGE).getOrCreate()
    log.info("Spark master %s", spark.sparkContext.master)
    try:
        yield
    finally:
        spark.stop()


def summarize(out: Path, shards: list[int], done_before: set[int], args) -> sd.data.stages.Summary:
    """Add up img2dataset's per-shard stats: successes, and failures by its status message."""
    summary = sd.data.stages.Summary(STAGE)
    missing, failed_to_download, failed_to_resize = [], 0, 0
    for shard in shards:
        path = stats_path(out, shard)
        if not path.exists():
            missing.append(shard)
            continue
        stats = json.loads(path.read_text())
        summary.kept += stats["successes"]
        summary.dropped.update({reason: n for reason, n in stats["status_dict"].items() if reason != "success"})
        failed_to_download += stats["failed_to_download"]
        failed_to_resize += stats["failed_to_resize"]
    summary.shards_skipped = len(done_before)
    summary.shards_written = len(shards) - len(done_before) - len(missing)
    summary.finish(out, failed_to_download=failed_to_download, failed_to_resize=failed_to_resize,
                   shards_unfinished=missing, resolution=args.resolution, keep_aspect=args.keep_aspect)
    return summary


@sd.data.stages.ends_cleanly_on_a_full_disk(STAGE)
def main(argv=None) -> int:
    sd.runtime.start_process(uses_torch=False)
    args = parse_args(argv)
    sd.data.stages.setup_logging()
    args = argparse.Namespace(**{**vars(args), "input": Path(args.input), "out": Path(args.out)})
    files = input_files(args.input)
    try:
        if not files:
            raise ValueError(f"no parquet files at {args.input}")
        url_col, caption_col, scores = detect_columns(files, args)
        check_output_folder(args.out)
    except Exception as error:  # a usage problem (stage 02's UsageError, ValueError) or an unreadable input
        if sd.data.stages.disk_full(error):  # not the input's fault: the stage ends
            raise
        print(f"{STAGE}.py: {error}", file=sys.stderr)
        return 2
    shards = expected_shards(files, args.shard_size)
    done_before = {shard for shard in shards if stats_path(args.out, shard).exists()}
    # The summary is a *.json in the shard folder: img2dataset would read "03_..." as shard 3 done.
    (args.out / SUMMARY_NAME).unlink(missing_ok=True)
    sd.data.stages.keep_settings(args)
    if len(done_before) < len(shards):
        log.info("downloading %d of %d shards (url %s, caption %s, extra %s)", len(shards) - len(done_before),
                 len(shards), url_col, caption_col, scores)
        run_img2dataset(args, url_col, caption_col, scores)
    summary = summarize(args.out, shards, done_before, args)
    unfinished = [shard for shard in shards if not stats_path(args.out, shard).exists()]
    if unfinished:
        free = shutil.disk_usage(args.out).free
        full = (f": the disk of {args.out} is full ({free} bytes free; img2dataset's workers printed why above), free "
                "some space and" if free < DISK_FULL_BELOW else ";")
        print(f"{STAGE}.py: shards {unfinished} did not finish{full} run the same command again "
              "(finished shards are kept, unfinished ones are downloaded again)", file=sys.stderr)
        return 1
    return summary.exit_code({reason: "the URLs could not be fetched or decoded (img2dataset's status above)"
                              for reason in summary.dropped})


if __name__ == "__main__":
    sys.exit(main())

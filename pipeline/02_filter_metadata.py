"""Filter LAION metadata parquet files by aesthetic score, CLIP similarity, size, watermark and NSFW
probability, and drop duplicate URLs and duplicate caption+size rows.

    python pipeline/02_filter_metadata.py --input 'DIR/*.parquet' --out DIR \\
        [--min_aesthetic 6.5] [--min_similarity 0.28] [--min_size 512] [--max_watermark 0.5] \\
        [--max_nsfw 0.5] [--url_col ..] [--caption_col ..] [--width_col ..] [--height_col ..] \\
        [--aesthetic_col ..] [--similarity_col ..] [--watermark_col ..] [--nsfw_col ..]

The defaults are phase 1 of the reference curriculum (aesthetic >= 6.5, similarity >= 0.28, both sides
>= 512 px, watermark < 0.5, unsafe < 0.5); phase 2 is
``--min_aesthetic 7.5 --max_watermark 0.15 --min_similarity 0.30``.

Input: parquet files from 01_download_metadata.py (or any LAION variant). Column names are found
case-insensitively unless given: URL ``URL|url``; caption ``TEXT|caption|text``; ``WIDTH|width``,
``HEIGHT|height``; aesthetic ``aesthetic|AESTHETIC_SCORE|aesthetic_score|prediction``; similarity
``similarity|clip_similarity|SIMILARITY``; watermark ``pwatermark|watermark``; NSFW ``punsafe`` (a
probability) or ``NSFW`` (labels UNLIKELY/UNSURE/NSFW: only UNLIKELY is kept). A filter whose column
is absent is skipped with a warning; URL and caption are required. A missing (null) score fails its
filter: a row cannot show that it passes.

Each row is dropped for the first failing reason, in this order: missing_url_or_caption,
low_aesthetic, low_similarity, too_small, watermark, nsfw, duplicate_url, duplicate_caption_size (same
caption and width x height as an earlier kept row). Duplicates are found across all inputs, processed
in sorted order. A column of the wrong type (URL or caption not text; a score, size or NSFW column
holding lists, structs or bytes) stops the stage before any work with one line naming the file and
column, exit 2.

Output, per input file: ``OUT/<stem>.parquet`` (the kept rows, all original columns), then
``OUT/<stem>_stats.json`` (counts per reason; the done marker), and ``02_filter_metadata_summary.json``.
A re-run skips done files and re-reads their kept rows so later files are deduplicated the same way.
"""

from __future__ import annotations

import glob
import json
import logging
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import SD_Pipeline  # noqa: E402
import SD_Runtime  # noqa: E402

STAGE = "02_filter_metadata"
log = logging.getLogger(STAGE)

REASONS = ("missing_url_or_caption", "low_aesthetic", "low_similarity", "too_small", "watermark", "nsfw",
           "duplicate_url", "duplicate_caption_size")
SAFE_NSFW_LABEL = "UNLIKELY"  # LAION-5B's string NSFW column: UNLIKELY / UNSURE / NSFW


def parse_args(argv):
    parser = SD_Pipeline.StageArgumentParser(__file__, __doc__)
    parser.add_input("glob of input parquet files, quoted: 'DIR/*.parquet'")
    parser.add_out("output folder for the filtered parquet files")
    parser.add_argument("--min_aesthetic", type=float, default=6.5, help="keep rows with aesthetic score >= this")
    parser.add_argument("--min_similarity", type=float, default=0.28, help="keep rows with CLIP similarity >= this")
    parser.add_argument("--min_size", type=int, default=512, help="keep rows with width and height >= this (px)")
    parser.add_argument("--max_watermark", type=float, default=0.5, help="keep rows with watermark probability < this")
    parser.add_argument("--max_nsfw", type=float, default=0.5, help="keep rows with unsafe probability < this")
    for role, names in SD_Pipeline.COLUMN_CANDIDATES.items():
        parser.add_argument(f"--{role}_col", default=None,
                            help=f"{role} column (default: the first of {'|'.join(names)} present, any case)")
    return parser.parse_args(argv)


def thresholds(args) -> dict:
    return {"min_aesthetic": args.min_aesthetic, "min_similarity": args.min_similarity,
            "min_size": args.min_size, "max_watermark": args.max_watermark, "max_nsfw": args.max_nsfw}


def plan(args) -> tuple[list[tuple[Path, dict]], Path]:
    """Check the whole command line before any work: inputs, columns, output names, earlier results."""
    paths = sorted(Path(p) for p in glob.glob(args.input) if p.endswith(".parquet"))
    if not paths and Path(args.input).is_dir():
        paths = sorted(Path(args.input).glob("*.parquet"))
    if not paths:
        raise SD_Pipeline.UsageError(f"no parquet files match {args.input!r}")
    out = Path(args.out)
    if any(path.parent.resolve() == out.resolve() for path in paths):
        raise SD_Pipeline.UsageError(f"--out {out} holds the inputs; the outputs would overwrite them, pick another folder")
    stems = [path.stem for path in paths]
    if len(set(stems)) != len(stems):
        raise SD_Pipeline.UsageError("two inputs share a file name; their outputs would collide (filter them separately)")
    overrides = {role: getattr(args, f"{role}_col") for role in SD_Pipeline.COLUMN_CANDIDATES}
    files = []
    for path in paths:
        columns = SD_Pipeline.parquet_columns(path, overrides)
        files.append((path, columns))
        check_earlier_run(out / f"{path.stem}_stats.json", thresholds(args))
    return files, out


def check_earlier_run(stats_path: Path, wanted: dict) -> None:
    """Done files are skipped on a re-run, so thresholds that changed would silently mix two phases."""
    if stats_path.exists():
        earlier = json.loads(stats_path.read_text()).get("thresholds")
        if earlier != wanted:
            raise SD_Pipeline.UsageError(f"{stats_path} was filtered with {earlier}, not {wanted}; use another --out")


def warn_skipped_filters(files: list[tuple[Path, dict]]) -> None:
    for role in ("aesthetic", "similarity", "width", "height", "watermark", "nsfw"):
        missing = [path.name for path, columns in files if columns[role] is None]
        if missing:
            log.warning("no %s column (looked for %s) in %s: that filter is skipped there", role,
                        "|".join(SD_Pipeline.COLUMN_CANDIDATES[role]), ", ".join(missing))


def numeric(frame: pd.DataFrame, column: str | None) -> np.ndarray | None:
    """Float values with NaN for nulls and junk (NaN fails every comparison, so the row is dropped)."""
    return None if column is None else pd.to_numeric(frame[column], errors="coerce").to_numpy(dtype=float)


def text(frame: pd.DataFrame, column: str) -> np.ndarray:
    """Stripped strings with "" for nulls."""
    return frame[column].fillna("").astype(str).str.strip().to_numpy(dtype=object)


def failure_masks(frame: pd.DataFrame, columns: dict, limits: dict) -> list[np.ndarray | None]:
    """One boolean "fails" mask per reason in REASONS before the duplicate checks (None: filter skipped)."""
    missing = (text(frame, columns["url"]) == "") | (text(frame, columns["caption"]) == "")
    aesthetic = numeric(frame, columns["aesthetic"])
    similarity = numeric(frame, columns["similarity"])
    sides = [numeric(frame, columns[role]) for role in ("width", "height") if columns[role] is not None]
    watermark = numeric(frame, columns["watermark"])
    return [
        missing,
        None if aesthetic is None else ~(aesthetic >= limits["min_aesthetic"]),
        None if similarity is None else ~(similarity >= limits["min_similarity"]),
        np.logical_or.reduce([~(side >= limits["min_size"]) for side in sides]) if sides else None,
        None if watermark is None else ~(watermark < limits["max_watermark"]),
        nsfw_mask(frame, columns["nsfw"], limits["max_nsfw"]),
    ]


def nsfw_mask(frame: pd.DataFrame, column: str | None, max_nsfw: float) -> np.ndarray | None:
    if column is None:
        return None
    if pd.api.types.is_numeric_dtype(frame[column]):
        return ~(numeric(frame, column) < max_nsfw)
    return text(frame, column) != SAFE_NSFW_LABEL


class DuplicateIndex:
    """URLs and (caption, width, height) of every row kept so far, across files."""

    def __init__(self):
        self.urls: set[str] = set()
        self.caption_sizes: set[tuple] = set()

    def add_frame(self, frame: pd.DataFrame, columns: dict) -> None:
        urls, keys = self.row_keys(frame, columns)
        self.urls.update(urls)
        self.caption_sizes.update(key for key in keys if key is not None)

    @staticmethod
    def row_keys(frame: pd.DataFrame, columns: dict) -> tuple[np.ndarray, list]:
        """Each row's URL and its (caption, width, height) key; the key is None without both size columns,
        because a caption alone is too weak a sign of the same image."""
        urls, captions = text(frame, columns["url"]), text(frame, columns["caption"])
        if columns["width"] is None or columns["height"] is None:
            return urls, [None] * len(urls)
        widths, heights = numeric(frame, columns["width"]), numeric(frame, columns["height"])
        return urls, list(zip(captions, widths.tolist(), heights.tolist()))


def assign_reasons(frame: pd.DataFrame, columns: dict, limits: dict, index: DuplicateIndex) -> np.ndarray:
    """Per row, the index in REASONS of its first failing check, or -1 for a kept row."""
    reasons = np.full(len(frame), -1, dtype=np.int64)
    for number, fails in enumerate(failure_masks(frame, columns, limits)):
        if fails is not None:
            reasons[(reasons == -1) & fails] = number
    urls, keys = DuplicateIndex.row_keys(frame, columns)
    duplicate_url, duplicate_key = REASONS.index("duplicate_url"), REASONS.index("duplicate_caption_size")
    # Sequential on purpose: a row is a duplicate only of an earlier row that was itself kept.
    for row in np.flatnonzero(reasons == -1):
        if urls[row] in index.urls:
            reasons[row] = duplicate_url
        elif keys[row] is not None and keys[row] in index.caption_sizes:
            reasons[row] = duplicate_key
        else:
            index.urls.add(urls[row])
            if keys[row] is not None:
                index.caption_sizes.add(keys[row])
    return reasons


def role_columns(columns: dict) -> list[str]:
    return list(dict.fromkeys(name for name in columns.values() if name is not None))


def filter_file(path: Path, columns: dict, out: Path, limits: dict, index: DuplicateIndex) -> dict:
    """Write ``<stem>.parquet`` with the kept rows, then ``<stem>_stats.json``; return the stats record."""
    table = pq.read_table(path)
    frame = table.select(role_columns(columns)).to_pandas()
    reasons = assign_reasons(frame, columns, limits, index)
    kept = np.flatnonzero(reasons == -1)
    urls = text(frame, columns["url"])
    stats = SD_Pipeline.ShardStats()
    stats.successes = int(len(kept))
    for number, reason in enumerate(REASONS):
        rows = np.flatnonzero(reasons == number)
        if len(rows):
            stats.failed[reason] = int(len(rows))
            stats.examples[reason] = [str(url) for url in urls[rows[:SD_Pipeline.MAX_EXAMPLES]]]
    return SD_Pipeline.write_output(out, path.stem, lambda tmp: pq.write_table(table.take(kept), tmp), stats,
                                    ".parquet", input=str(path), columns=columns, thresholds=limits)


def main(argv=None) -> int:
    SD_Runtime.start_process()
    args = parse_args(argv)
    SD_Pipeline.setup_logging()
    try:
        files, out = plan(args)
    except SD_Pipeline.UsageError as error:
        print(f"{STAGE}.py: {error}", file=sys.stderr)
        return 2
    warn_skipped_filters(files)
    out.mkdir(parents=True, exist_ok=True)
    limits, index, summary = thresholds(args), DuplicateIndex(), SD_Pipeline.Summary(STAGE)
    for path, columns in tqdm(files, desc="filter", unit="file"):
        kept_path, stats_path = SD_Pipeline.output_paths(out, path.stem, ".parquet")
        if SD_Pipeline.output_done(out, path.stem, ".parquet"):
            # Re-seed from the kept rows so later files are deduplicated exactly as in the first run.
            index.add_frame(pq.read_table(kept_path, columns=role_columns(columns)).to_pandas(), columns)
            summary.add_done(stats_path)
        else:
            try:
                summary.add(filter_file(path, columns, out, limits, index))
            except (OSError, pa.ArrowException) as error:  # a damaged file whose footer read fine
                print(f"{STAGE}.py: {path}: not a readable parquet file ({error})", file=sys.stderr)
                return 2
    summary.finish(out, thresholds=limits)
    return 0


if __name__ == "__main__":
    sys.exit(main())

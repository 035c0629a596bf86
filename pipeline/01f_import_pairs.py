"""Import a preference-pairs dataset in the Pick-a-Pic layout into pair shards, for Diffusion-DPO.

    python pipeline/01f_import_pairs.py --input 'pickapic_v2/data/train-*.parquet' --out SHARD_DIR \\
        [--ties drop|both] [--resolution 0] [--shard_size 1000] [--max_pairs 0] [--batch_rows 64] \\
        [--max_pixels N] [--workers 8]

Input: Pick-a-Pic v2's parquet files, on local disk (this stage downloads nothing):

    huggingface-cli download yuvalkirstain/pickapic_v2 --repo-type dataset --local-dir pickapic_v2

``--input`` is one parquet file, a folder (every ``*.parquet`` under it, sorted; hidden folders are
passed over) or a quoted glob. Each row is one pair: ``caption`` (the prompt), ``jpg_0`` and ``jpg_1``
(the two images' file bytes) and ``label_0`` (1 = image 0 preferred, 0 = image 1 preferred, 0.5 = a
tie). ``has_label``, ``are_different``, ``image_0_uid``, ``image_1_uid``, ``model_0``, ``model_1``,
``ranking_id`` and ``user_id`` are copied into each sample's metadata where the files have them. A
missing path stops the stage before any work with one line saying how to download the dataset, as
does a file that is not parquet or lacks one of the four columns used (exit status 2).

Output: ``SHARD_DIR/NNNNN.tar``, webdataset pair samples: ``<key>.<ext>`` the PREFERRED image,
``<key>.rejected.<ext>`` the rejected one, ``<key>.txt`` the prompt and ``<key>.json`` the metadata
(the copied columns, ``label_0``, ``preferred``: which source image, 0 or 1, is ``<key>.<ext>``,
``tie``, ``source`` file name, ``row`` in it, and each image's written size); then ``NNNNN_stats.json``
(the done marker: kept pairs and skipped rows by reason, with examples) and, at the end,
``01f_import_pairs_summary.json``. ``encode_latents.py --pairs`` encodes both images of each pair.

The images are stored as their bytes are (no re-encoding; the extension is read from the bytes) after
a full decode checks them; ``--resolution N`` instead scales both images of a pair so that their short
side is N pixels, keeping the aspect ratio, and writes them as JPEG.

Rows are skipped, counted by reason and named, in this order: ``no_label`` (``has_label`` false, or
``label_0`` missing, NaN or not 0, 0.5 or 1), ``tie`` (``label_0`` 0.5 with ``--ties drop``, the
default), ``same_image`` (``are_different`` false, or the two images byte for byte the same),
``no_caption`` (an empty prompt), ``no_image`` (an image column empty), then the image checks
(``undecodable``, ``truncated_image``, ``too_large`` over ``--max_pixels``, ``extreme_aspect`` over
8:1), named by the row's key and the image column at fault. ``--ties both`` writes a tie twice, once
in each order, so that on average it pulls neither way.

Keys are ``<file stem>-<row in the file, 6 digits>`` (``train-00000-of-00645-...-000123``), a tie
written both ways ``...-000123-tie0`` (image 0 preferred) and ``...-000123-tie1``: unique across the
dataset and the same on every run. Shard N holds the input rows N x ``--shard_size`` onwards, the files
taken in sorted order as one sequence (skipped rows make a shard smaller; a tie written both ways counts
twice). Memory holds one ``--batch_rows`` batch of rows (and the parquet reader's row group), never a
file or a whole shard: the samples stream into the shard's tar. A re-run skips finished shards and writes the others byte for byte as one run would; a shard
that an earlier ``--max_pairs`` cut short is written again whole. A re-run with another ``--ties``,
``--resolution``, ``--shard_size`` or ``--max_pixels`` into the same ``--out`` is refused, naming the
flag, as is input that no longer gives the rows a finished shard was made from. Ctrl-C or a full disk
ends the stage in one line; every shard is written under a temporary name and renamed, so no
half-written shard is left and the same command goes on from the finished ones.
"""

from __future__ import annotations

import decimal
import glob
import hashlib
import json
import logging
import math
import numbers
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

import sd.cli
import sd.data.shards
import sd.data.stages
import sd.files
import sd.runtime

STAGE = "01f_import_pairs"
DOWNLOAD = "huggingface-cli download yuvalkirstain/pickapic_v2 --repo-type dataset --local-dir pickapic_v2"
DOWNLOAD_HINT = f"download Pick-a-Pic v2 first: {DOWNLOAD} (then --input 'pickapic_v2/data/train-*.parquet')"
CAPTION, IMAGES, LABEL = "caption", ("jpg_0", "jpg_1"), "label_0"
REQUIRED = (CAPTION, *IMAGES, LABEL)
COPIED = ("has_label", "are_different", "image_0_uid", "image_1_uid", "model_0", "model_1", "ranking_id", "user_id")
TIE = 0.5
TIES = ("drop", "both")
MAX_STEM = 60  # key characters kept of a file's stem (a USTAR member name holds 100 bytes, the key plus ".rejected.webp")
FIXES = {"tie": "every pair was a tie: --ties both writes each tie once in each order",
         "no_label": "the rows carry no usable label_0 (1, 0 or 0.5): check that --input is Pick-a-Pic's train split",
         "same_image": "every pair shows one image twice"}

log = logging.getLogger(STAGE)


# ---------------------------------------------------------------------------------------------
# Command line and input files
# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = sd.data.stages.StageArgumentParser(__file__, __doc__)
    add = parser.add_argument
    parser.add_input("a Pick-a-Pic parquet file, a folder (every *.parquet under it) or a quoted glob")
    parser.add_out("output folder for NNNNN.tar + NNNNN_stats.json")
    add("--ties", choices=TIES, default="drop",
        help="label_0 0.5: drop = skip the pair (counted as tie), both = write it once in each order "
             "(default: %(default)s)")
    add("--resolution", type=int, default=0,
        help="scale both images of a pair so that their short side is this many pixels (a multiple of 8), keeping "
             "the aspect ratio, and write them as JPEG; 0 stores the images' bytes as they are (default: %(default)s)")
    add("--shard_size", type=int, default=1000, help="input rows (pairs) per output shard (default: %(default)s)")
    add("--max_pairs", type=int, default=0,
        help="read only the first this many input rows (pairs), for a trial; 0 reads all (default: %(default)s)")
    add("--batch_rows", type=int, default=64,
        help="rows read from parquet and decoded at a time: memory holds one batch (default: %(default)s)")
    add("--max_pixels", type=int, default=sd.data.shards.DEFAULT_MAX_PIXELS,
        help="skip pairs with an image of more pixels than this, read from its header (too_large) "
             "(default: %(default)s)")
    parser.add_workers()
    parser.checks += [
        ("resolution", lambda n: n == 0 or (n >= 8 and n % 8 == 0), "--resolution must be 0 or a multiple of 8, "
                                                                    "got {value}"),
        ("shard_size", lambda n: n >= 1, "--shard_size must be >= 1, got {value}"),
        ("max_pairs", lambda n: n >= 0, "--max_pairs must be >= 0 (0 reads all), got {value}"),
        ("batch_rows", lambda n: n >= 1, "--batch_rows must be >= 1, got {value}"),
        ("max_pixels", lambda n: n >= 1, "--max_pixels must be >= 1, got {value}"),
    ]
    parser.shapes_outputs("ties", "resolution", "shard_size", "max_pixels")
    return parser.parse_args(argv)


def input_files(text: str) -> list[Path]:
    """The parquet files ``--input`` names, sorted; a ``UsageError`` (with the download command) when
    there are none."""
    path = Path(text)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.parquet")
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
        where = f"no *.parquet under {text}"
    else:
        pattern = re.search(r"[*?[]", text) is not None
        files = sorted(Path(p) for p in glob.glob(text) if Path(p).is_file()) if pattern else []
        where = f"no file matches {text}" if pattern else f"{text} does not exist"
    if not files:
        raise sd.data.stages.UsageError(f"--input: {where}; {DOWNLOAD_HINT}")
    return files


@dataclass(frozen=True)
class Source:
    """One input file: its rows and the columns read from it."""

    path: Path
    stem: str  # the key's first part
    rows: int
    row_groups: tuple[int, ...]  # rows per row group
    columns: tuple[str, ...]


def open_source(path: Path) -> Source:
    """A parquet file's shape from its footer (no row is read); a ``UsageError`` naming the file for one that
    is not parquet, lacks a column used, or holds a type no row could use."""
    import pyarrow.parquet as pq

    try:
        metadata = pq.ParquetFile(path).metadata
        schema = metadata.schema.to_arrow_schema()
    except Exception as error:  # pyarrow raises several types for a damaged file
        raise sd.data.stages.UsageError(f"{path}: not a readable parquet file ({sd.cli.first_line(error)})") from None
    missing = [name for name in REQUIRED if name not in schema.names]
    if missing:
        raise sd.data.stages.UsageError(f"{path}: no {', '.join(missing)} column (a Pick-a-Pic file has "
                                        f"{', '.join(REQUIRED)}); columns are {', '.join(schema.names)}")
    for name in REQUIRED:
        if not column_type_fits(name, schema.field(name).type):
            raise sd.data.stages.UsageError(f"{path}: column {name!r} holds {schema.field(name).type}, which "
                                            f"no Pick-a-Pic row has there")
    columns = (*REQUIRED, *(name for name in COPIED if name in schema.names))
    groups = tuple(metadata.row_group(i).num_rows for i in range(metadata.num_row_groups))
    return Source(path, key_stem(path), metadata.num_rows, groups, columns)


def column_type_fits(name: str, kind) -> bool:
    import pyarrow as pa

    if pa.types.is_null(kind):
        return True
    if name == CAPTION:
        return pa.types.is_string(kind) or pa.types.is_large_string(kind)
    if name == LABEL:
        return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_decimal(kind)
    binary = (pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
              or (hasattr(pa.types, "is_binary_view") and pa.types.is_binary_view(kind)))
    # an image written by the datasets library's Image feature: a struct of its bytes and its path
    return binary or (pa.types.is_struct(kind) and kind.get_field_index("bytes") >= 0)


def key_stem(path: Path) -> str:
    """A file's stem made safe for keys: webdataset cuts a key at its first dot, so only letters, digits,
    ``_`` and ``-`` stay; a long stem is cut and a hash of it appended."""
    stem = path.name[: -len(".parquet")] if path.name.endswith(".parquet") else path.stem
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", stem)
    if len(safe) > MAX_STEM:
        safe = f"{safe[:MAX_STEM - 11]}_{hashlib.sha1(stem.encode('utf-8', 'surrogateescape')).hexdigest()[:10]}"
    return safe


def open_sources(paths: list[Path]) -> list[Source]:
    sources = [open_source(path) for path in paths]
    if not any(source.rows for source in sources):
        raise sd.data.stages.UsageError(f"{', '.join(str(p) for p in paths[:3])}{', ...' if len(paths) > 3 else ''}: "
                                        f"no rows; {DOWNLOAD_HINT}")
    seen: dict[str, Path] = {}
    for source in sources:
        if source.stem in seen:  # their keys would collide
            raise sd.data.stages.UsageError(f"{seen[source.stem]} and {source.path} give keys of one name "
                                            f"({source.stem}-...): rename one, or import them into two folders")
        seen[source.stem] = source.path
    return sources


# ---------------------------------------------------------------------------------------------
# The plan: shard N is input rows N x shard_size onwards
# ---------------------------------------------------------------------------------------------


def plan_shards(sources: list[Source], shard_size: int, max_pairs: int) -> list[list[tuple[int, int, int]]]:
    """Per shard, its ``(source index, first row, end row)`` segments: the files' rows as one sequence,
    cut into runs of ``shard_size`` (the first ``max_pairs`` only, when it is not 0)."""
    total = sum(source.rows for source in sources)
    total = min(total, max_pairs) if max_pairs else total
    plan, shard, room, taken = [], [], shard_size, 0
    for index, source in enumerate(sources):
        start = 0
        while start < source.rows and taken < total:
            count = min(source.rows - start, room, total - taken)
            shard.append((index, start, start + count))
            start, room, taken = start + count, room - count, taken + count
            if room == 0:
                plan.append(shard)
                shard, room = [], shard_size
    if shard:
        plan.append(shard)
    return plan


def described(sources: list[Source], segments) -> list[list]:
    """Segments as a stats file records them: ``[file name, first row, end row]``."""
    return [[sources[index].path.name, start, end] for index, start, end in segments]


def check_done_shards(out: Path, sources: list[Source], plan: list) -> list[int]:
    """The finished shards a trial cut short (their rows a beginning of what the plan gives them now), to
    be written again; a ``UsageError`` for one made from other rows than the plan gives it. A finished
    shard holding more rows than the plan gives it (a later, smaller ``--max_pairs``) is kept."""
    redo = []
    for index, segments in enumerate(plan):
        data, stats = sd.data.stages.output_paths(out, index)
        if not (stats.exists() and data.exists()):
            continue
        try:
            done = json.loads(stats.read_text()).get("sources")
        except (OSError, ValueError, AttributeError):
            done = None
        wanted = described(sources, segments)
        if done == wanted or starts(done, wanted):
            continue
        if starts(wanted, done):
            redo.append(index)
            continue
        raise sd.data.stages.UsageError(
            f"shard {index:05d} in {out} was made from other input rows ({rows_text(done)}) than this run gives it "
            f"({rows_text(wanted)}): give the same --input as before, or use a fresh --out")
    return redo


def starts(whole, part) -> bool:
    """Whether the rows of segments ``part`` are the first rows of segments ``whole``."""
    if not (isinstance(part, list) and part and isinstance(whole, list) and len(part) <= len(whole)):
        return False
    last, own = part[-1], whole[len(part) - 1]
    return (part[:-1] == whole[: len(part) - 1] and isinstance(last, list) and len(last) == 3
            and last[:2] == own[:2] and isinstance(last[2], int) and last[2] <= own[2])


def rows_text(segments) -> str:
    if not isinstance(segments, list) or not segments:
        return "not recorded"
    return "; ".join(f"{s[0]} rows {s[1]}-{s[2] - 1}" for s in segments if isinstance(s, list) and len(s) == 3)


# ---------------------------------------------------------------------------------------------
# Rows to pair samples
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One input row, as read."""

    key: str
    source: str  # the file's name
    index: int  # the row in that file
    caption: object
    label: object
    images: tuple  # the two images' bytes (or None)
    copied: dict  # the columns copied into the metadata


class Skip(Exception):
    """A row that gives no pair: ``reason`` is its counter, ``name`` what the stats name."""

    def __init__(self, reason: str, name: str):
        super().__init__(f"{reason}: {name}")
        self.reason, self.name = reason, name


def preferred_image(row: Row, ties: str) -> int | None:
    """0 or 1, the source image preferred; None for a tie kept (``--ties both``). ``Skip`` for a row whose
    label says nothing (``no_label``) or a tie to drop."""
    label = label_value(row.label)
    if row.copied.get("has_label") is False or label not in (0.0, TIE, 1.0):
        raise Skip("no_label", row.key)
    if label == TIE:
        if ties == "drop":
            raise Skip("tie", row.key)
        return None
    return 0 if label == 1.0 else 1


def label_value(value) -> float | None:
    """``label_0`` as a float; None for a value that is no finite number."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, decimal.Decimal)):
        return None
    label = float(value)
    return label if math.isfinite(label) else None


def checked_images(row: Row, resolution: int, max_pixels: int) -> list[tuple[bytes, str, tuple[int, int]]]:
    """Both images as ``(file bytes, extension, (width, height))`` as written: decoded in full to check
    them, then their bytes as they are, or scaled (short side ``resolution``) and JPEG-encoded."""
    if row.copied.get("are_different") is False or (row.images[0] and row.images[0] == row.images[1]):
        raise Skip("same_image", row.key)
    if not isinstance(row.caption, str) or not row.caption.strip():
        raise Skip("no_caption", row.key)
    written = []
    for column, data in zip(IMAGES, row.images):
        if not data:
            raise Skip("no_image", f"{row.key} ({column})")
        try:
            rgb = sd.data.shards.decode_image(data, "jpg", max_pixels)
            if resolution:
                rgb = sd.data.shards.resize_keep_aspect(rgb, resolution, "short")
                data = sd.data.stages.encode_jpeg(rgb)
        except sd.data.shards.ImageSkip as skip:
            raise Skip(skip.reason, f"{row.key} ({column})") from None
        written.append((data, sd.data.shards.sniff_format(data), (rgb.shape[1], rgb.shape[0])))
    return written


def pair_samples(row: Row, args) -> list[sd.data.shards.ShardSample]:
    """The samples of one row: one pair, or a tie written in both orders (``--ties both``)."""
    preferred = preferred_image(row, args.ties)
    images = checked_images(row, args.resolution, args.max_pixels)
    if preferred is not None:
        return [pair_sample(row, row.key, images, preferred, tie=False)]
    return [pair_sample(row, f"{row.key}-tie{first}", images, first, tie=True) for first in (0, 1)]


def pair_sample(row: Row, key: str, images: list, preferred: int, tie: bool) -> sd.data.shards.ShardSample:
    (data, ext, size), (rejected, rejected_ext, rejected_size) = images[preferred], images[1 - preferred]
    metadata = {"key": key, "source": row.source, "row": row.index, **row.copied, LABEL: label_value(row.label),
                "preferred": preferred, "tie": tie, "width": size[0], "height": size[1],
                "rejected_width": rejected_size[0], "rejected_height": rejected_size[1]}
    caption = row.caption.strip()
    return sd.data.shards.ShardSample(key, data, ext, caption, json.dumps(metadata, default=str).encode("utf-8"),
                                      rejected=rejected, rejected_ext=rejected_ext)


def convert(row: Row, args):
    """``pair_samples``, or the ``Skip`` it raised (for a thread pool's map)."""
    try:
        return pair_samples(row, args)
    except Skip as skip:
        return skip


# ---------------------------------------------------------------------------------------------
# Reading and writing
# ---------------------------------------------------------------------------------------------


def read_rows(source: Source, start: int, end: int, batch_rows: int):
    """Lists of ``Row`` for rows ``start`` to ``end`` of ``source``, at most ``batch_rows`` at a time,
    reading only the row groups that hold them."""
    import pyarrow.parquet as pq

    first_rows, offset = [], 0
    for count in source.row_groups:
        first_rows.append(offset)
        offset += count
    groups = [i for i, count in enumerate(source.row_groups) if first_rows[i] < end and first_rows[i] + count > start]
    if not groups:
        return
    position = first_rows[groups[0]]
    with pq.ParquetFile(source.path) as parquet:
        for batch in parquet.iter_batches(batch_size=batch_rows, row_groups=groups, columns=list(source.columns)):
            low, high = max(start, position), min(end, position + batch.num_rows)
            if low < high:
                yield batch_rows_of(source, batch.slice(low - position, high - low), low)
            position += batch.num_rows
            if position >= end:
                return


def batch_rows_of(source: Source, batch, first: int) -> list[Row]:
    values = {name: batch.column(name).to_pylist() for name in source.columns}
    rows = []
    for i in range(batch.num_rows):
        images = tuple(image_bytes(values[column][i]) for column in IMAGES)
        copied = {name: json_value(values[name][i]) for name in COPIED if name in values}
        rows.append(Row(f"{source.stem}-{first + i:06d}", source.path.name, first + i, values[CAPTION][i],
                        values[LABEL][i], images, copied))
    return rows


def image_bytes(value) -> bytes | None:
    if isinstance(value, dict):  # the datasets library's Image struct
        value = value.get("bytes")
    return bytes(value) if isinstance(value, (bytes, bytearray, memoryview)) else None


def json_value(value):
    """A copied column's value as JSON writes it (a non-finite number as null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def import_shard(out: Path, index: int, sources: list[Source], segments, args, pool, bar) -> dict:
    """Shard ``index`` from its rows, then its stats file (the done marker). The samples go into the tar as
    their batch is converted: memory holds one batch, never the shard."""
    stats, tie_rows = sd.data.stages.ShardStats(), 0

    def samples():
        nonlocal tie_rows
        for source_index, start, end in segments:
            for rows in read_rows(sources[source_index], start, end, args.batch_rows):
                for result in pool.map(lambda row: convert(row, args), rows):
                    if isinstance(result, Skip):
                        stats.skip(result.reason, result.name)
                        continue
                    tie_rows += len(result) == 2  # a tie written in both orders
                    for sample in result:
                        if sd.data.shards.is_valid_key(sample.key):
                            stats.successes += 1
                            yield sample
                        else:
                            stats.skip("bad_key", sample.key)
                bar.update(len(rows))

    # sd.data.stages.write_output's two steps, with the stats taken once the samples have streamed through
    data_path, stats_path = sd.data.stages.output_paths(out, index)
    sd.files.write_atomic(data_path, lambda tmp: sd.data.shards.write_tar(tmp, samples()))
    record = stats.as_dict(sources=described(sources, segments), ties=args.ties, ties_written_both_ways=tie_rows)
    sd.files.write_json_atomic(stats_path, record)
    return record


def forget_outputs(out: Path, plan: list, stage_settings: bool) -> None:
    """Remove the shards of ``plan`` (each done marker first) and, with ``stage_settings``, the recorded settings."""
    for index in range(len(plan)):
        for path in reversed(sd.data.stages.output_paths(out, index)):
            path.unlink(missing_ok=True)
    if stage_settings:
        sd.data.stages.settings_path(out, STAGE).unlink(missing_ok=True)


def run(args, out: Path, sources: list[Source], plan: list) -> int:
    summary = sd.data.stages.Summary(STAGE)
    todo = summary.pending(out, list(range(len(plan))))
    rows = sum(end - start for index in todo for _, start, end in plan[index])
    log.info("%d input rows in %d files -> %d shards of up to %d rows; %d to write", sum(s.rows for s in sources),
             len(sources), len(plan), args.shard_size, len(todo))
    with ThreadPoolExecutor(args.workers) as pool, tqdm(total=rows, unit="pair", desc=STAGE) as bar:
        for index in todo:
            summary.add(import_shard(out, index, sources, plan[index], args, pool, bar))
    records = [json.loads(sd.data.stages.output_paths(out, i)[1].read_text()) for i in range(len(plan))]
    both = sum(record.get("ties_written_both_ways", 0) for record in records)
    summary.finish(out, pairs=summary.kept, ties=args.ties, ties_dropped=summary.dropped.get("tie", 0),
                   ties_written_both_ways=both, input_rows=sum(end - start for shard in plan for _, start, end in shard),
                   resolution=args.resolution, files=[source.path.name for source in sources])
    tie_line = (f"dropped {summary.dropped.get('tie', 0)} (--ties drop)" if args.ties == "drop"
                else f"{both} written in both orders ({2 * both} of the {summary.kept} pairs; --ties both)")
    print(f"{STAGE}: {summary.kept} pairs written; ties: {tie_line}")
    code = summary.exit_code(FIXES)
    if code:  # nothing usable: the empty shards go, so the corrected command starts afresh in --out
        forget_outputs(out, plan, stage_settings=True)
    return code


@sd.data.stages.ends_cleanly_on_a_full_disk(STAGE)
def main(argv=None) -> int:
    sd.runtime.start_process(uses_torch=False)
    args = parse_args(argv)
    sd.data.stages.setup_logging()
    out = Path(args.out)
    try:
        sources = open_sources(input_files(args.input))
        plan = plan_shards(sources, args.shard_size, args.max_pairs)
        redo = check_done_shards(out, sources, plan)
    except sd.data.stages.UsageError as error:
        print(f"{STAGE}.py: error: {error}", file=sys.stderr)
        return 2
    sd.data.stages.keep_settings(args)
    for index in redo:  # cut short by an earlier --max_pairs: the done marker goes first
        log.info("shard %05d was cut short by an earlier --max_pairs: writing it again whole", index)
        sd.data.stages.output_paths(out, index)[1].unlink()
    try:
        return run(args, out, sources, plan)
    except KeyboardInterrupt:
        print(f"{STAGE}.py: interrupted; the finished shards in {out} are kept: run the same command to go on",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

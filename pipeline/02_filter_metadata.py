"""Filter LAION metadata parquet files by aesthetic score, CLIP similarity, size, watermark and NSFW
probability, and drop duplicate URLs and duplicate caption+size rows.

    python pipeline/02_filter_metadata.py --input 'DIR/*.parquet' --out DIR \\
        [--min_aesthetic 6.5] [--min_similarity 0.28] [--min_size 512] [--max_watermark 0.5] \\
        [--max_nsfw 0.5] [--url_col ..] [--caption_col ..] [--width_col ..] [--height_col ..] \\
        [--aesthetic_col ..] [--similarity_col ..] [--watermark_col ..] [--nsfw_col ..] \\
        [--memory_limit 4GB] [--threads N] [--dedup false]

The defaults are phase 1 of the reference curriculum (aesthetic >= 6.5, similarity >= 0.28, both sides
>= 512 px, watermark < 0.5, unsafe < 0.5); phase 2 is
``--min_aesthetic 7.5 --max_watermark 0.15 --min_similarity 0.30``.

Input: parquet files from 01_download_metadata.py (or any LAION variant). Column names are found
case-insensitively unless given: URL ``URL|url``; caption ``TEXT|caption|text``; ``WIDTH|width``,
``HEIGHT|height``; aesthetic ``aesthetic|AESTHETIC_SCORE|aesthetic_score|prediction``; similarity
``similarity|clip_similarity|SIMILARITY``; watermark ``pwatermark|watermark``; NSFW ``punsafe`` (a
probability) or ``NSFW`` (labels UNLIKELY/UNSURE/NSFW: only UNLIKELY is kept). A filter whose column
is absent is skipped with a warning; URL and caption are required. A missing (null) or NaN score fails
its filter: a row cannot show that it passes. URL and caption are compared with surrounding whitespace
stripped (Python's ``str.strip``).

Each row is dropped for the first failing reason, in this order: missing_url_or_caption,
low_aesthetic, low_similarity, too_small, watermark, nsfw, duplicate_url, duplicate_caption_size (same
caption and width x height as an earlier kept row). Duplicates are found across all inputs, processed
in sorted order: a row is a duplicate only of an earlier row that was itself kept. ``--dedup false``
applies the filters alone (the first step of a run split across machines, see README). A column of the
wrong type (URL or caption not text; a score, size or NSFW column holding lists, structs or bytes)
stops the stage before any work with one line naming the file and column, exit 2.

The work runs in DuckDB, streaming over each file within ``--memory_limit``: what does not fit (the
rows of a file that pass the filters, the URLs and caption keys kept so far) spills to
``OUT/.duckdb_tmp``, removed at the end. Python holds at most about 32 MB of rows at a time.

Output, per input file: ``OUT/<stem>.parquet`` (the kept rows in input order, all original columns and
types), then ``OUT/<stem>_stats.json`` (counts per reason; the done marker), and
``02_filter_metadata_summary.json``. A re-run skips done files and re-reads their kept rows so later
files are deduplicated the same way.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

import sd.data.stages
import sd.runtime

STAGE = "02_filter_metadata"
log = logging.getLogger(STAGE)

REASONS = ("missing_url_or_caption", "low_aesthetic", "low_similarity", "too_small", "watermark", "nsfw",
           "duplicate_url", "duplicate_caption_size")
FILTER_FIXES = {  # every row dropped for one reason: the flag to loosen
    "missing_url_or_caption": "the rows lack a URL or a caption: check --url_col and --caption_col",
    "low_aesthetic": "lower --min_aesthetic", "low_similarity": "lower --min_similarity",
    "too_small": "lower --min_size", "watermark": "raise --max_watermark", "nsfw": "raise --max_nsfw",
}
SAFE_NSFW_LABEL = "UNLIKELY"  # LAION-5B's string NSFW column: UNLIKELY / UNSURE / NSFW
# What Python's str.strip() removes (the previous pandas code stripped with it); DuckDB's trim() alone
# removes spaces only.
WHITESPACE = "".join(char for char in map(chr, range(sys.maxunicode + 1)) if char.isspace())
BATCH_ROWS = 65_536  # rows per Arrow batch handed from DuckDB to Python
WRITE_BYTES = 32 << 20  # kept rows gathered in Python per parquet row group: memory beside DuckDB's limit
TMP_DIR = ".duckdb_tmp"  # inside --out: DuckDB spills here; removed when the stage ends
MEMORY_SIZE = re.compile(r"\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB|%)", re.IGNORECASE)  # as DuckDB reads it


def parse_args(argv):
    parser = sd.data.stages.StageArgumentParser(__file__, __doc__)
    parser.add_input("glob of input parquet files, quoted: 'DIR/*.parquet'")
    parser.add_out("output folder for the filtered parquet files")
    parser.add_argument("--min_aesthetic", type=float, default=6.5, help="keep rows with aesthetic score >= this")
    parser.add_argument("--min_similarity", type=float, default=0.28, help="keep rows with CLIP similarity >= this")
    parser.add_argument("--min_size", type=int, default=512, help="keep rows with width and height >= this (px)")
    parser.add_argument("--max_watermark", type=float, default=0.5, help="keep rows with watermark probability < this")
    parser.add_argument("--max_nsfw", type=float, default=0.5, help="keep rows with unsafe probability < this")
    for role, names in sd.data.stages.COLUMN_CANDIDATES.items():
        parser.add_argument(f"--{role}_col", default=None,
                            help=f"{role} column (default: the first of {'|'.join(names)} present, any case)")
    parser.add_argument("--memory_limit", default="4GB",
                        help="most memory DuckDB may hold (e.g. 4GB, 500MB, 50%% of RAM); beyond it, it spills "
                             "to OUT/.duckdb_tmp")
    parser.checks.append(("memory_limit", lambda text: MEMORY_SIZE.fullmatch(text.strip()) is not None,
                          "--memory_limit {value}: give a size such as 4GB, 500MB or 50%"))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="DuckDB worker threads")
    parser.checks.append(("threads", lambda n: n >= 1, "--threads must be >= 1"))
    parser.add_bool("--dedup", default=True,
                    help="drop duplicate URLs and caption+size rows across files (false: the filters alone)")
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
        raise sd.data.stages.UsageError(f"no parquet files match {args.input!r}")
    out = Path(args.out)
    if any(path.parent.resolve() == out.resolve() for path in paths):
        raise sd.data.stages.UsageError(f"--out {out} holds the inputs; the outputs would overwrite them, pick another folder")
    stems = [path.stem for path in paths]
    if len(set(stems)) != len(stems):
        raise sd.data.stages.UsageError("two inputs share a file name; their outputs would collide (filter them separately)")
    overrides = {role: getattr(args, f"{role}_col") for role in sd.data.stages.COLUMN_CANDIDATES}
    files = []
    for path in paths:
        columns = sd.data.stages.parquet_columns(path, overrides)
        files.append((path, columns))
        check_earlier_run(out / f"{path.stem}_stats.json", thresholds(args), args.dedup)
    return files, out


def check_earlier_run(stats_path: Path, wanted: dict, dedup: bool) -> None:
    """Done files are skipped on a re-run, so thresholds that changed would silently mix two phases."""
    if stats_path.exists():
        earlier = json.loads(stats_path.read_text())
        if earlier.get("thresholds") != wanted:
            raise sd.data.stages.UsageError(f"{stats_path} was filtered with {earlier.get('thresholds')}, not {wanted}; "
                                         "use another --out")
        if earlier.get("dedup", True) != dedup:
            raise sd.data.stages.UsageError(f"{stats_path} was written with --dedup {earlier.get('dedup', True)}, "
                                         f"not {dedup}; use another --out")


def warn_skipped_filters(files: list[tuple[Path, dict]]) -> None:
    for role in ("aesthetic", "similarity", "width", "height", "watermark", "nsfw"):
        missing = [path.name for path, columns in files if columns[role] is None]
        if missing:
            log.warning("no %s column (looked for %s) in %s: that filter is skipped there", role,
                        "|".join(sd.data.stages.COLUMN_CANDIDATES[role]), ", ".join(missing))


# ---------------------------------------------------------------------------------------------
# SQL for one file's columns. Each expression matches what the previous pandas code computed: text is
# str.strip()-ped, pd.to_numeric(errors="coerce") is TRY_CAST to DOUBLE, and a NULL or NaN score fails
# its filter. Each filter is written as "passes", true only for a row that passes it, in a form simple
# enough for DuckDB to evaluate while it reads the file.
# ---------------------------------------------------------------------------------------------


def quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def literal(value) -> str:
    """A SQL literal: a string, or a float that may be inf or nan."""
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return f"CAST('{float(value)!r}' AS DOUBLE)"


WHITESPACE_CODES = ", ".join(str(ord(char)) for char in WHITESPACE)


def maybe_blank(column: str) -> str:
    """True for every NULL, empty or all-whitespace string and a few others: a test of the first
    character cheap enough for every row (ASCII whitespace and the empty string compare below "!"; the
    other whitespace characters are at or above chr(133))."""
    text = quoted(column)
    return f"({text} IS NULL OR {text} < '!' OR ({text} >= chr(133) AND ascii({text}) IN ({WHITESPACE_CODES})))"


def blank(column: str) -> str:
    """NULL, empty or all whitespace. trim() with a list of characters is slow (about 4 us a string), so
    it runs only where the first character is whitespace."""
    text = quoted(column)
    return (f"CASE WHEN {text} IS NULL OR strlen({text}) = 0 THEN true WHEN ascii({text}) IN ({WHITESPACE_CODES}) "
            f"THEN trim({text}, {literal(WHITESPACE)}) = '' ELSE false END")


def stripped(column: str) -> str:
    """The column's text without surrounding whitespace (trimmed only where an end is whitespace)."""
    text = quoted(column)
    return (f"CASE WHEN ascii({text}) IN ({WHITESPACE_CODES}) OR ascii(right({text}, 1)) IN ({WHITESPACE_CODES}) "
            f"THEN trim({text}, {literal(WHITESPACE)}) ELSE {text} END")


def is_numeric(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind) or \
        pa.types.is_decimal(kind)


def number(column: str, schema: pa.Schema) -> str:
    """The column as DOUBLE: CAST for a number column, TRY_CAST (NULL for junk) for text."""
    cast = "CAST" if is_numeric(schema.field(column).type) else "TRY_CAST"
    return f"{cast}({quoted(column)} AS DOUBLE)"


def not_nan(column: str, schema: pa.Schema) -> str:
    """Written out because DuckDB orders NaN above every number (NaN >= 6.5 is true); see also connect()."""
    kind = schema.field(column).type
    exact = pa.types.is_integer(kind) or pa.types.is_boolean(kind) or pa.types.is_decimal(kind)
    return "" if exact else f" AND NOT isnan({number(column, schema)})"


def at_least(column: str, limit: float, schema: pa.Schema) -> str:
    return f"{number(column, schema)} >= {literal(limit)}{not_nan(column, schema)}"


def below(column: str, limit: float, schema: pa.Schema) -> str:
    return f"{number(column, schema)} < {literal(limit)}{not_nan(column, schema)}"


def filter_passes(columns: dict, limits: dict, schema: pa.Schema) -> list[tuple[int, str]]:
    """(index in REASONS, SQL true when the row passes that filter, else false or NULL) for the filters
    after the URL and caption check whose column is present, in REASONS order."""
    passes = []
    if columns["aesthetic"] is not None:
        passes.append((1, at_least(columns["aesthetic"], limits["min_aesthetic"], schema)))
    if columns["similarity"] is not None:
        passes.append((2, at_least(columns["similarity"], limits["min_similarity"], schema)))
    sides = [at_least(columns[role], limits["min_size"], schema) for role in ("width", "height")
             if columns[role] is not None]
    if sides:
        passes.append((3, " AND ".join(f"({side})" for side in sides)))
    if columns["watermark"] is not None:
        passes.append((4, below(columns["watermark"], limits["max_watermark"], schema)))
    nsfw = columns["nsfw"]
    if nsfw is not None:
        numeric = is_numeric(schema.field(nsfw).type)
        passes.append((5, below(nsfw, limits["max_nsfw"], schema) if numeric
                       else f"{stripped(nsfw)} = {literal(SAFE_NSFW_LABEL)}"))
    return passes


def first_failure(passes: list[tuple[int, str]]) -> str:
    """The REASONS index of the first filter in ``passes`` the row fails, -1 if none."""
    return "CASE " + "".join(f"WHEN NOT coalesce({sql}, false) THEN {index} " for index, sql in passes) + "ELSE -1 END"


def scan(path: Path) -> str:
    return f"read_parquet({literal(str(path))}, file_row_number = true, hive_partitioning = false)"


# ---------------------------------------------------------------------------------------------
# One file in DuckDB: count the filter failures, keep the candidates, deduplicate, write
# ---------------------------------------------------------------------------------------------

# What the stage adds to a candidate row: its row number in the file and its duplicate keys (prefixed so
# they cannot collide with the file's own columns).
DERIVED = ("_02_row", "_02_reason", "_02_url", "_02_caption", "_02_width", "_02_height")
KEY_SQL_TYPES = "_02_caption VARCHAR, _02_width DOUBLE, _02_height DOUBLE"


def connect(out: Path, memory_limit: str, threads: int) -> duckdb.DuckDBPyConnection:
    """An in-memory database that spills to ``OUT/.duckdb_tmp`` beyond ``memory_limit``. It holds the
    duplicate index: the URLs and caption keys of every row kept so far."""
    # The optimizer's statistics propagation trusts parquet min/max, which leave NaN out: DuckDB 2.0 folds
    # isnan(x) to false where a file's statistics are finite, so a NaN score would pass its filter.
    con = duckdb.connect(config={"memory_limit": memory_limit, "threads": threads,
                                 "temp_directory": str(out / TMP_DIR), "preserve_insertion_order": False,
                                 "disabled_optimizers": "statistics_propagation"})
    con.execute(f"CREATE TABLE seen_urls (_02_url VARCHAR); CREATE TABLE seen_keys ({KEY_SQL_TYPES})")
    return con


def key_columns(columns: dict, schema: pa.Schema) -> str:
    """A row's URL and its (caption, width, height) key; the key is NULL without both size columns,
    because a caption alone is too weak a sign of the same image."""
    url = f"{stripped(columns['url'])} AS _02_url"
    if columns["width"] is None or columns["height"] is None:
        return f"{url}, NULL::VARCHAR AS _02_caption, NULL::DOUBLE AS _02_width, NULL::DOUBLE AS _02_height"
    return (f"{url}, {stripped(columns['caption'])} AS _02_caption, {number(columns['width'], schema)} AS _02_width, "
            f"{number(columns['height'], schema)} AS _02_height")


def load_candidates(con, path: Path, passes: list, columns: dict, schema: pa.Schema) -> None:
    """Table ``candidates``: every row that passes the number filters or may lack a URL or caption, all
    its columns, plus DERIVED: ``_02_reason`` is -1 for a row that passes every filter (0 when URL or
    caption is missing, the first failing filter otherwise). One read of the file's text columns."""
    url, caption = columns["url"], columns["caption"]
    every_number = " AND ".join(f"({sql})" for _, sql in passes) or "true"
    con.execute(f"""CREATE OR REPLACE TABLE candidates AS
        SELECT file_row_number AS _02_row,
               CASE WHEN ({blank(url)}) OR ({blank(caption)}) THEN 0 ELSE {first_failure(passes)} END AS _02_reason,
               {key_columns(columns, schema)}, * EXCLUDE (file_row_number)
        FROM {scan(path)} WHERE ({every_number}) OR {maybe_blank(url)} OR {maybe_blank(caption)}""")


def count_failures(con, path: Path, passes: list, url_column: str) -> dict[int, tuple[int, list[str]]]:
    """REASONS index -> (rows failing that filter first, the URLs of the first MAX_EXAMPLES of them).
    Rows without URL or caption are counted from ``candidates``; the number filters in a read of the
    number columns alone, leaving those rows out."""
    url = f"coalesce({quoted(url_column)}, '')"
    count, examples = con.execute(f"""SELECT count(*), min_by({url}, _02_row, {sd.data.stages.MAX_EXAMPLES})
        FROM candidates WHERE _02_reason = 0""").fetchall()[0]
    failures = {0: (count, [example.strip() for example in examples])} if count else {}
    if not passes:
        return failures
    rows = con.execute(f"""SELECT reason, count(*), min_by(row, row, {sd.data.stages.MAX_EXAMPLES}) FROM (
            SELECT {first_failure(passes)} AS reason, file_row_number AS row FROM {scan(path)}
            WHERE file_row_number NOT IN (SELECT _02_row FROM candidates WHERE _02_reason = 0))
        WHERE reason > 0 GROUP BY reason""").fetchall()
    wanted = sorted({row for _, _, example_rows in rows for row in example_rows})
    urls = dict(con.execute(f"""SELECT file_row_number, {url} FROM {scan(path)}
        WHERE file_row_number IN ({', '.join(map(str, wanted)) or 'NULL'})""").fetchall())
    for reason, count, example_rows in rows:
        failures[reason] = (count, [urls[row].strip() for row in example_rows])
    return failures


# One round of the greedy rule "a row is a duplicate only of an earlier kept row", for all undecided
# rows at once: a row that comes first among the undecided rows sharing its URL and first among those
# sharing its key is kept (every earlier neighbour is already dropped), and the later rows sharing
# either with it are dropped. Each round keeps at least the first undecided row, so the loop ends;
# it takes as many rounds as the longest chain of rows where each one's fate waits on the one before
# (a handful in practice) and gives exactly the sequential result. Text is compared only for the few
# rows left after the row-number join, so DuckDB builds its hash tables on those. (The rows kept in
# earlier rounds have no neighbours left among the undecided rows, so comparing with all of ``kept``
# is the same as comparing with this round's.)
DEDUP_ROUND = """
CREATE OR REPLACE TABLE chosen AS
    SELECT _02_row FROM (SELECT min(_02_row) AS _02_row FROM undecided GROUP BY _02_url)
    WHERE _02_row IN (SELECT min(_02_row) FROM undecided WHERE _02_caption IS NOT NULL
                      GROUP BY _02_caption, _02_width, _02_height
                      UNION ALL SELECT _02_row FROM undecided WHERE _02_caption IS NULL);
INSERT INTO kept SELECT u.* FROM undecided u SEMI JOIN chosen c ON u._02_row = c._02_row;
CREATE OR REPLACE TABLE undecided AS SELECT u.* FROM undecided u ANTI JOIN chosen c ON u._02_row = c._02_row;
CREATE OR REPLACE TABLE undecided AS
    SELECT u.* FROM undecided u
    WHERE NOT EXISTS (SELECT 1 FROM kept k WHERE k._02_url = u._02_url)
      AND NOT EXISTS (SELECT 1 FROM kept k WHERE k._02_caption = u._02_caption AND k._02_width = u._02_width
                                                 AND k._02_height = u._02_height);
"""


def deduplicate(con) -> int:
    """Table ``kept``: the candidates that are not duplicates of a row kept earlier (in an earlier file,
    the index, or earlier in this file). Returns the number of rounds it took."""
    con.execute(f"""CREATE OR REPLACE TABLE kept (_02_row BIGINT, _02_url VARCHAR, {KEY_SQL_TYPES});
        CREATE OR REPLACE TABLE undecided AS
            SELECT _02_row, _02_url, _02_caption, _02_width, _02_height FROM candidates c
            WHERE _02_reason = -1 AND NOT EXISTS (SELECT 1 FROM seen_urls s WHERE s._02_url = c._02_url)
              AND NOT EXISTS (SELECT 1 FROM seen_keys s WHERE s._02_caption = c._02_caption
                                                           AND s._02_width = c._02_width
                                                           AND s._02_height = c._02_height)""")
    rounds = 0
    while scalar(con, "SELECT count(*) FROM undecided"):
        con.execute(DEDUP_ROUND)
        rounds += 1
    return rounds


def count_duplicates(con) -> dict[int, tuple[int, list[str]]]:
    """Like ``count_failures`` for the candidates not kept: a duplicate URL if an earlier kept row (in
    the index or this file) has the URL, else a duplicate caption and size."""
    url, key = REASONS.index("duplicate_url"), REASONS.index("duplicate_caption_size")
    rows = con.execute(f"""
        CREATE OR REPLACE TABLE dropped AS
            SELECT _02_row, _02_url FROM candidates c
            WHERE _02_reason = -1 AND NOT EXISTS (SELECT 1 FROM kept k WHERE k._02_row = c._02_row);
        WITH url_kept_before AS (
            SELECT d._02_row FROM dropped d SEMI JOIN seen_urls s ON s._02_url = d._02_url
            UNION ALL
            SELECT d._02_row FROM dropped d SEMI JOIN kept k ON k._02_url = d._02_url AND k._02_row < d._02_row)
        SELECT CASE WHEN _02_row IN (SELECT _02_row FROM url_kept_before) THEN {url} ELSE {key} END AS reason,
               count(*), min_by(_02_url, _02_row, {sd.data.stages.MAX_EXAMPLES})
        FROM dropped GROUP BY reason""").fetchall()
    return {reason: (count, urls) for reason, count, urls in rows}


def remember_kept(con) -> None:
    """Add this file's kept rows to the index that later files are deduplicated against."""
    con.execute("""INSERT INTO seen_urls SELECT _02_url FROM kept;
        INSERT INTO seen_keys SELECT _02_caption, _02_width, _02_height FROM kept WHERE _02_caption IS NOT NULL""")


def remember_done_file(con, kept_path: Path, columns: dict) -> None:
    """The index from a file finished by an earlier run: its kept rows, re-read."""
    key_sql = key_columns(columns, pq.read_schema(kept_path))
    con.execute(f"CREATE OR REPLACE TABLE kept AS SELECT {key_sql} FROM {scan(kept_path)}")
    remember_kept(con)


def scalar(con, query: str):
    """One value; fetchall() because DuckDB 2 refuses new work while a result is only partly fetched."""
    return con.execute(query).fetchall()[0][0]


def arrow_batches(relation, rows: int):
    """A reader of Arrow batches: to_arrow_reader in DuckDB 2, fetch_arrow_reader before it."""
    read = getattr(relation, "to_arrow_reader", None) or relation.fetch_arrow_reader
    return read(rows)


def write_kept(con, schema: pa.Schema, tmp: Path) -> None:
    """The kept rows in input order, with the input's columns and Arrow types (DuckDB's types are cast
    back, e.g. to large_string or dictionary), about WRITE_BYTES of rows per row group."""
    relation = con.sql(f"""SELECT * EXCLUDE ({', '.join(DERIVED)}) FROM candidates
        WHERE _02_row IN (SELECT _02_row FROM kept) ORDER BY _02_row""")
    with pq.ParquetWriter(tmp, schema) as writer:
        pending, size = [], 0
        for batch in arrow_batches(relation, BATCH_ROWS):
            arrays = [column if column.type == field.type else column.cast(field.type)
                      for column, field in zip(batch.columns, schema)]
            pending.append(pa.RecordBatch.from_arrays(arrays, schema=schema))
            size += batch.nbytes
            if size >= WRITE_BYTES:
                writer.write_table(pa.Table.from_batches(pending))
                pending, size = [], 0
        if pending:
            writer.write_table(pa.Table.from_batches(pending))


def filter_file(con, path: Path, columns: dict, out: Path, limits: dict, dedup: bool) -> dict:
    """Write ``<stem>.parquet`` with the kept rows, then ``<stem>_stats.json``; return the stats record."""
    schema = pq.read_schema(path)
    passes = filter_passes(columns, limits, schema)
    load_candidates(con, path, passes, columns, schema)
    failures = count_failures(con, path, passes, columns["url"])
    if dedup:
        rounds = deduplicate(con)
        log.debug("%s: duplicates resolved in %d rounds", path.name, rounds)
        failures.update(count_duplicates(con))
    else:
        con.execute("CREATE OR REPLACE TABLE kept AS SELECT _02_row FROM candidates WHERE _02_reason = -1")
    stats = sd.data.stages.ShardStats()
    stats.successes = scalar(con, "SELECT count(*) FROM kept")
    for number, reason in enumerate(REASONS):
        if number in failures:
            stats.failed[reason], stats.examples[reason] = failures[number]
    record = sd.data.stages.write_output(out, path.stem, lambda tmp: write_kept(con, schema, tmp), stats, ".parquet",
                                      input=str(path), columns=columns, thresholds=limits, dedup=dedup)
    if dedup:
        remember_kept(con)
    con.execute("".join(f"DROP TABLE IF EXISTS {table};" for table in ("candidates", "undecided", "chosen", "kept",
                                                                          "dropped")))
    return record


def one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def run(con, files: list[tuple[Path, dict]], out: Path, args) -> int:
    limits, summary = thresholds(args), sd.data.stages.Summary(STAGE)
    for path, columns in tqdm(files, desc="filter", unit="file"):
        kept_path, stats_path = sd.data.stages.output_paths(out, path.stem, ".parquet")
        if sd.data.stages.output_done(out, path.stem, ".parquet"):
            if args.dedup:  # so later files are deduplicated exactly as in the first run
                remember_done_file(con, kept_path, columns)
            summary.add_done(stats_path)
            continue
        try:
            summary.add(filter_file(con, path, columns, out, limits, args.dedup))
        except duckdb.OutOfMemoryException as error:
            print(f"{STAGE}.py: {path}: more memory needed than --memory_limit {args.memory_limit} allows; raise it "
                  f"or lower --threads ({one_line(error)})", file=sys.stderr)
            return 2
        except (OSError, pa.ArrowException, duckdb.IOException, duckdb.InvalidInputException) as error:
            if sd.data.stages.disk_full(error):  # not the input's fault: the stage ends
                raise
            # a damaged file whose footer read fine
            print(f"{STAGE}.py: {path}: not a readable parquet file ({one_line(error)})", file=sys.stderr)
            return 2
    summary.finish(out, thresholds=limits, dedup=args.dedup)
    return summary.exit_code(FILTER_FIXES)


@sd.data.stages.ends_cleanly_on_a_full_disk(STAGE)
def main(argv=None) -> int:
    sd.runtime.start_process(uses_torch=False)
    args = parse_args(argv)
    sd.data.stages.setup_logging()
    try:
        files, out = plan(args)
    except sd.data.stages.UsageError as error:
        print(f"{STAGE}.py: {error}", file=sys.stderr)
        return 2
    warn_skipped_filters(files)
    out.mkdir(parents=True, exist_ok=True)
    con = connect(out, args.memory_limit, args.threads)
    try:
        return run(con, files, out, args)
    finally:
        con.close()
        shutil.rmtree(out / TMP_DIR, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

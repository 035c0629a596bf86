"""Download the LAION-2B-en aesthetic metadata parquet files from the Hugging Face hub (or copy them
from a local folder) and count their rows.

    python pipeline/01_download_metadata.py --out DIR [--repo_id laion/laion2B-en-aesthetic] \\
        [--revision main] [--patterns '*.parquet' ...] [--local_dir DIR]

Input: the dataset repository ``--repo_id`` at ``--revision`` (files matching ``--patterns``), or with
``--local_dir`` the matching files already on disk (e.g. on a cluster's shared storage).

Output: the parquet files under ``DIR`` (same relative paths as in the repository or local folder) and
``01_download_metadata_summary.json`` with every file's row count (read from the parquet footer) and the
total. ``huggingface_hub.snapshot_download`` resumes by itself; a local copy is atomic per file and a
re-run skips files already copied with the same size. A file that is not readable parquet is counted
under ``unreadable_parquet`` and named in the summary.
"""

from __future__ import annotations

import fnmatch
import logging
import shutil
import sys
from pathlib import Path

import pyarrow.parquet as pq
from tqdm import tqdm

import sd.data.stages
import sd.files
import sd.runtime

STAGE = "01_download_metadata"
DEFAULT_REPO = "laion/laion2B-en-aesthetic"
log = logging.getLogger(STAGE)


def parse_args(argv):
    parser = sd.data.stages.StageArgumentParser(__file__, __doc__)
    parser.add_out("folder the parquet files are downloaded or copied to")
    parser.add_argument("--repo_id", default=DEFAULT_REPO, help="Hugging Face dataset repository")
    parser.add_argument("--revision", default="main", help="branch, tag or commit of the repository")
    parser.add_argument("--patterns", nargs="+", default=["*.parquet"],
                        help="glob patterns of the files to fetch, matched against paths in the repository")
    parser.add_argument("--local_dir", default=None,
                        help="copy matching files from this folder instead of downloading "
                             "(default: none, download from the hub)")
    return parser.parse_args(argv)


def matching_files(root: Path, patterns: list[str]) -> list[Path]:
    """Files under ``root`` whose relative path matches a pattern (fnmatch, as the hub's allow_patterns),
    leaving out hidden folders such as the hub client's ``.cache``."""
    found = []
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if path.is_file() and not any(part.startswith(".") for part in relative.parts) \
                and any(fnmatch.fnmatch(relative.as_posix(), pattern) for pattern in patterns):
            found.append(path)
    return found


def copy_local(source_root: Path, out: Path, patterns: list[str]) -> tuple[int, int]:
    """Copy the matching files into ``out``; returns (copied, already there)."""
    copied = skipped = 0
    for source in tqdm(matching_files(source_root, patterns), desc="copy", unit="file"):
        dest = out / source.relative_to(source_root)
        if dest.exists() and dest.stat().st_size == source.stat().st_size:
            skipped += 1
            continue
        sd.files.write_atomic(dest, lambda tmp, source=source: shutil.copyfile(source, tmp))
        copied += 1
    return copied, skipped


def download_hub(args, out: Path) -> None:
    import huggingface_hub

    # snapshot_download skips files already complete in local_dir and resumes partial ones.
    huggingface_hub.snapshot_download(repo_id=args.repo_id, repo_type="dataset", revision=args.revision,
                                      allow_patterns=args.patterns, local_dir=str(out))


def count_rows(out: Path, patterns: list[str], summary: sd.data.stages.Summary) -> list[dict]:
    """Row count of every parquet file in ``out`` from its footer (no data is read)."""
    files = []
    for path in tqdm([p for p in matching_files(out, patterns) if p.suffix == ".parquet"], desc="count", unit="file"):
        name = path.relative_to(out).as_posix()
        try:
            rows = pq.ParquetFile(path).metadata.num_rows
        except Exception as error:  # pyarrow raises several types for a damaged file
            if sd.data.stages.disk_full(error):  # not the input's fault: the stage ends
                raise
            log.error("%s: not readable parquet (%s)", path, error)
            summary.dropped["unreadable_parquet"] += 1
            files.append({"file": name, "rows": None, "bytes": path.stat().st_size, "error": str(error)})
            continue
        summary.kept += rows
        files.append({"file": name, "rows": rows, "bytes": path.stat().st_size})
    return files


@sd.data.stages.ends_cleanly_on_a_full_disk(STAGE)
def main(argv=None) -> int:
    sd.runtime.start_process(uses_torch=False)
    args = parse_args(argv)
    sd.data.stages.setup_logging()
    out = Path(args.out)
    source = Path(args.local_dir) if args.local_dir else None
    if source is not None and not source.is_dir():
        print(f"{STAGE}.py: --local_dir {source} is not a folder", file=sys.stderr)
        return 2
    if source is not None and not matching_files(source, args.patterns):
        print(f"{STAGE}.py: no files in {source} match {' '.join(args.patterns)}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    summary = sd.data.stages.Summary(STAGE)
    if source is not None:
        summary.shards_written, summary.shards_skipped = copy_local(source, out, args.patterns)
    else:
        download_hub(args, out)
    files = count_rows(out, args.patterns, summary)
    if source is None:
        summary.shards_written = len(files)  # the hub client does not say which files it skipped
    summary.finish(out, source=str(source) if source else f"hf://datasets/{args.repo_id}@{args.revision}",
                   files=files, rows=summary.kept)
    return 0


if __name__ == "__main__":
    sys.exit(main())

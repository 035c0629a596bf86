"""Stage 05: caption parquet + a latent folder -> the `datasets` folder SD_Train.py reads.

    python pipeline/05_build_hf_dataset.py --captions CAPTION_DIR --latents LATENT_DIR --out DATASET_DIR [--val_fraction 0.01]

Joins the captions of stage 04 to the latents of encode_latents.py by key and keeps only captions
that have a latent (the rest are counted and named: their images were skipped by the encoder, or
their shards are not encoded yet). A deterministic hash of the key puts a sample in the
``validation`` split with probability ``--val_fraction``, so the split never changes when data is
added. The result is a DatasetDict written with ``save_to_disk`` (columns key, caption, input_ids),
assembled under a temporary name and renamed. 05_build_hf_dataset_summary.json in it, written last,
records what it was built from; a re-run on unchanged inputs does nothing. A caption file that is not
what stage 04 writes (key and caption text, 77 integer token ids per row), a damaged latent folder
or one encode_latents.py has not finished stops the stage with one line naming it, exit 2, before
anything is written.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import sd.data.stages
import sd.data.training_data
import sd.files
import sd.model
import sd.runtime

STAGE = "05_build_hf_dataset"


def parse_args(argv):
    parser = sd.data.stages.StageArgumentParser(__file__, __doc__)
    # Two inputs, so neither is --input: the caption shards and the latents they join to.
    parser.add_required("--captions", "folder of NNNNN.parquet caption shards (stage 04)")
    parser.add_required("--latents", "latent folder (encode_latents.py) the captions join to")
    parser.add_out("output datasets folder (train and validation splits)")
    parser.add_argument("--val_fraction", type=float, default=0.01,
                        help="fraction of keys in the validation split, picked by a hash of the key")
    args = parser.parse_args(argv)
    if not 0 <= args.val_fraction < 1:
        parser.error(f"--val_fraction must be in [0, 1), got {args.val_fraction}")
    return args


def is_validation(key: str, fraction: float) -> bool:
    """Stable across runs, machines and dataset growth: the first 60 bits of SHA-1 of the key."""
    return int(hashlib.sha1(key.encode("utf-8")).hexdigest()[:15], 16) / 16**15 < fraction


def caption_files(folder: Path) -> list[Path]:
    """Caption shards finished by stage 04 (their stats file exists)."""
    return sorted(p for p in folder.glob("*.parquet") if sd.data.stages.output_done(folder, p.stem, ".parquet"))


def input_fingerprint(files: list[Path], args) -> dict:
    entries = {str(p): [p.stat().st_size, p.stat().st_mtime_ns] for p in files}
    return {"files": entries, "val_fraction": args.val_fraction}


def load_captions(files: list[Path]):
    """All caption shards as one table of key (string), caption (string), input_ids (77 int32);
    a file that is not that is a DataError naming it."""
    import pyarrow as pa

    if not files:
        return None
    return pa.concat_tables([read_caption_file(path) for path in files])


def read_caption_file(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as error:
        if sd.data.stages.disk_full(error):  # not the input's fault: the stage ends
            raise
        raise sd.data.training_data.DataError(f"{path} is not a readable parquet file ({error})") from None
    missing = {"key", "caption", "input_ids"} - set(table.column_names)
    if missing:
        raise sd.data.training_data.DataError(f"{path} lacks the columns {sorted(missing)} (stage 04 writes key, caption, input_ids)")
    for name in ("key", "caption"):
        kind = table.schema.field(name).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise sd.data.training_data.DataError(f"{path}: column {name!r} holds {kind}, not text")
        if table.column(name).null_count:
            raise sd.data.training_data.DataError(f"{path}: column {name!r} has {table.column(name).null_count} empty (null) values")
    ids_type = pa.list_(pa.int32(), sd.model.TOKENIZER_MAX_LENGTH)
    try:
        input_ids = table.column("input_ids").cast(ids_type)
    except (pa.ArrowException, NotImplementedError) as error:  # not lists of 77 integers
        raise sd.data.training_data.DataError(f"{path}: input_ids of type {table.schema.field('input_ids').type} are not "
                                f"{sd.model.TOKENIZER_MAX_LENGTH} token ids per row ({error})") from None
    return pa.table({"key": table.column("key").cast(pa.string()), "caption": table.column("caption").cast(pa.string()),
                     "input_ids": input_ids})


def join(table, latent_keys: set[str], val_fraction: float):
    """Row indices of the train and validation splits, and what was dropped."""
    train, validation, seen = [], [], set()
    dropped = {"no_latent": [], "duplicate_key": []}
    for row, key in enumerate(table.column("key").to_pylist()):
        if key in seen:
            dropped["duplicate_key"].append(key)
        elif key not in latent_keys:
            dropped["no_latent"].append(key)
        else:
            (validation if is_validation(key, val_fraction) else train).append(row)
        seen.add(key)
    return train, validation, dropped, seen


def write_dataset(table, train_rows, val_rows, out: Path) -> None:
    """save_to_disk into a staging folder, then swap it in; empty splits are left out."""
    from datasets import Dataset, DatasetDict
    from datasets.table import InMemoryTable

    splits = {}
    for name, rows in (("train", train_rows), ("validation", val_rows)):
        if rows:
            splits[name] = Dataset(InMemoryTable(table.take(rows)))
    sd.files.write_folder_atomic(out, lambda staging: DatasetDict(splits).save_to_disk(str(staging)))


def up_to_date(summary: sd.data.stages.Summary, out: Path, fingerprint: dict) -> dict | None:
    """The summary of an earlier build from the same inputs, or None."""
    path = summary.path(out)
    record = json.loads(path.read_text()) if path.exists() else {}
    return record if record.get("inputs") == fingerprint else None


@sd.data.stages.ends_cleanly_on_a_full_disk(STAGE)
def main(argv=None) -> int:
    sd.runtime.start_process()
    args = parse_args(argv)
    captions_dir, latents_dir, out = Path(args.captions), Path(args.latents), Path(args.out)
    for name, folder in (("--captions", captions_dir), ("--latents", latents_dir)):
        if not folder.is_dir():
            print(f"{STAGE}.py: {name} folder {folder} does not exist", file=sys.stderr)
            return 2
    files = caption_files(captions_dir)
    if not files:
        print(f"{STAGE}.py: no finished caption shards in {captions_dir} (run stage 04 first)", file=sys.stderr)
        return 2
    key_files = sorted(latents_dir.glob("*.keys.txt")) or sorted(latents_dir.glob("*.npy"))
    fingerprint = input_fingerprint(files + key_files, args)
    summary = sd.data.stages.Summary(STAGE)
    earlier = up_to_date(summary, out, fingerprint)
    if earlier is not None:
        print(f"{STAGE}: {out} is up to date (train {earlier['train']}, validation {earlier['validation']})")
        return 0
    try:
        keys = sd.data.training_data.latent_keys(latents_dir)
        table = load_captions(files)
    except sd.data.training_data.DataError as error:
        print(f"{STAGE}.py: {error}", file=sys.stderr)
        return 2
    train_rows, val_rows, dropped, caption_keys = join(table, set(keys), args.val_fraction)
    write_dataset(table, train_rows, val_rows, out)
    latents_without_caption = [k for k in keys if k not in caption_keys]
    summary.kept = len(train_rows) + len(val_rows)
    summary.dropped.update({reason: len(names) for reason, names in dropped.items()})
    summary.note_examples(dropped)
    # Written last, into the finished folder: the record of what it was built from.
    summary.finish(out, train=len(train_rows), validation=len(val_rows),
                   latents_without_caption=len(latents_without_caption), latents=str(latents_dir),
                   captions=str(captions_dir), inputs=fingerprint)
    print(f"  train {len(train_rows)}, validation {len(val_rows)}; latents without a caption "
          f"{len(latents_without_caption)}")
    if dropped["no_latent"]:
        print(f"  e.g. no latent for: {', '.join(dropped['no_latent'][:5])}")
    if args.val_fraction > 0 and not val_rows:
        print(f"  no sample fell into the validation split ({len(train_rows)} samples at --val_fraction "
              f"{args.val_fraction}, about {len(train_rows) * args.val_fraction:.1f} expected): the trainer will "
              f"report no validation loss; raise --val_fraction to have some")
    return summary.exit_code()


if __name__ == "__main__":
    sys.exit(main())

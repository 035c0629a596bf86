"""Stage 05: caption parquet + a latent folder -> the `datasets` folder SD_Train.py reads.

    python pipeline/05_build_hf_dataset.py --captions CAPTION_DIR --latents LATENT_DIR --out DATASET_DIR [--val_fraction 0.01]

Joins the captions of stage 04 to the latents of encode_latents.py by key and keeps only captions
that have a latent (the rest are counted and named: their images were skipped by the encoder, or
their shards are not encoded yet). A deterministic hash of the key puts a sample in the
``validation`` split with probability ``--val_fraction``, so the split never changes when data is
added. The result is a DatasetDict written with ``save_to_disk`` (columns key, caption, input_ids),
assembled under a temporary name and renamed. build_stats.json in it records what it was built from;
a re-run on unchanged inputs does nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import SD_Data
import SD_Files

STAGE = "05_build_hf_dataset"
MAX_EXAMPLES = 20


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--captions", required=True, help="folder of NNNNN.parquet caption shards (stage 04)")
    parser.add_argument("--latents", required=True, help="latent folder (encode_latents.py) the captions join to")
    parser.add_argument("--out", required=True, help="output datasets folder (train and validation splits)")
    parser.add_argument("--val_fraction", type=float, default=0.01,
                        help="fraction of keys in the validation split, picked by a hash of the key (default: %(default)s)")
    args = parser.parse_args(argv)
    if not 0 <= args.val_fraction < 1:
        parser.error(f"--val_fraction must be in [0, 1), got {args.val_fraction}")
    return args


def is_validation(key: str, fraction: float) -> bool:
    """Stable across runs, machines and dataset growth: the first 60 bits of SHA-1 of the key."""
    return int(hashlib.sha1(key.encode("utf-8")).hexdigest()[:15], 16) / 16**15 < fraction


def caption_files(folder: Path) -> list[Path]:
    """Caption shards finished by stage 04 (their stats file exists)."""
    return sorted(p for p in folder.glob("*.parquet") if (folder / f"{p.stem}_stats.json").exists())


def input_fingerprint(files: list[Path], args) -> dict:
    entries = {str(p): [p.stat().st_size, p.stat().st_mtime_ns] for p in files}
    return {"files": entries, "val_fraction": args.val_fraction}


def load_captions(files: list[Path]):
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not files:
        return None
    return pa.concat_tables([pq.read_table(p, columns=["key", "caption", "input_ids"]) for p in files])


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
    staging = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    DatasetDict(splits).save_to_disk(str(staging))
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(staging, out)
        shutil.rmtree(old)
    else:
        os.replace(staging, out)


def main(argv=None) -> int:
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
    stats_path = out / "build_stats.json"
    if stats_path.exists() and json.loads(stats_path.read_text()).get("inputs") == fingerprint:
        record = json.loads(stats_path.read_text())
        print(f"{STAGE}: {out} is up to date (train {record['train']}, validation {record['validation']})")
        return 0
    keys = SD_Data.latent_keys(latents_dir)
    table = load_captions(files)
    train_rows, val_rows, dropped, caption_keys = join(table, set(keys), args.val_fraction)
    write_dataset(table, train_rows, val_rows, out)
    latents_without_caption = [k for k in keys if k not in caption_keys]
    record = {"stage": STAGE, "train": len(train_rows), "validation": len(val_rows),
              "dropped": {reason: len(keys) for reason, keys in dropped.items()},
              "examples": {reason: keys[:MAX_EXAMPLES] for reason, keys in dropped.items() if keys},
              "latents_without_caption": len(latents_without_caption),
              "latents": str(latents_dir), "captions": str(captions_dir), "inputs": fingerprint}
    SD_Files.write_text_atomic(stats_path, json.dumps(record, indent=1) + "\n")
    print(f"{STAGE}: train {len(train_rows)}, validation {len(val_rows)}; dropped: captions without a latent "
          f"{len(dropped['no_latent'])}, duplicate keys {len(dropped['duplicate_key'])}; latents without a caption "
          f"{len(latents_without_caption)}; output in {out}")
    if dropped["no_latent"]:
        print(f"  e.g. no latent for: {', '.join(dropped['no_latent'][:5])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

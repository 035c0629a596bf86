"""Stage 04: image shards -> caption parquet with 77 CLIP token ids per sample.

    python pipeline/04_preprocess_to_cache.py --shards 'SHARD_DIR/*.tar' --out CAPTION_DIR [--tokenizer ID_OR_PATH|tiny]

For each input shard NNNNN.tar, writes CAPTION_DIR/NNNNN.parquet with columns ``key`` (string),
``caption`` (string) and ``input_ids`` (77 int32 CLIP token ids, padded with the end token and
truncated the way SD 1.x was trained), then NNNNN_stats.json as the shard's done marker. Samples
without a caption, or without an image, are skipped and counted. A re-run skips finished shards.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

import SD_Files
import SD_Model
import SD_Pipeline
import SD_Shards

STAGE = "04_preprocess_to_cache"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", required=True, help="glob of image shards, quoted: 'SHARD_DIR/*.tar'")
    parser.add_argument("--out", required=True, help="output folder for NNNNN.parquet caption shards")
    parser.add_argument("--tokenizer", default=SD_Model.DEFAULT_TEXT_ENCODER,
                        help="CLIP tokenizer hub id, local folder, or 'tiny' (the same BPE, built offline) "
                             "(default: %(default)s)")
    parser.add_argument("--batch_size", type=int, default=4096, help="captions per tokenizer call (default: %(default)s)")
    return parser.parse_args(argv)


def caption_table(keys: list[str], captions: list[str], input_ids: np.ndarray):
    import pyarrow as pa

    ids = pa.FixedSizeListArray.from_arrays(pa.array(input_ids.reshape(-1), type=pa.int32()), SD_Model.TOKENIZER_MAX_LENGTH)
    return pa.table({"key": pa.array(keys, pa.string()), "caption": pa.array(captions, pa.string()), "input_ids": ids})


def process_shard(path: Path, out: Path, tokenizer, batch_size: int) -> dict:
    import pyarrow.parquet as pq

    stats = SD_Pipeline.ShardStats()
    samples, truncated_key = SD_Shards.read_shard(path.read_bytes())
    if truncated_key is not None:
        stats.skip("truncated_tar", truncated_key)
    keys, captions = [], []
    for sample in samples:
        if sample.image is None:
            stats.skip("no_image", sample.key)
        elif not sample.caption:
            stats.skip("no_caption", sample.key)
        else:
            keys.append(sample.key)
            captions.append(sample.caption)
    input_ids = np.zeros((len(keys), SD_Model.TOKENIZER_MAX_LENGTH), dtype=np.int32)
    for start in range(0, len(keys), batch_size):
        batch = captions[start : start + batch_size]
        input_ids[start : start + len(batch)] = SD_Model.tokenize(tokenizer, batch).numpy()
    stem = path.name[: -len(".tar")]
    table = caption_table(keys, captions, input_ids)
    SD_Files.write_atomic(out / f"{stem}.parquet", lambda tmp: pq.write_table(table, tmp))
    stats.successes = len(keys)
    record = stats.as_dict(shard=str(path))
    SD_Files.write_text_atomic(out / f"{stem}_stats.json", json.dumps(record, indent=1) + "\n")
    return record


def main(argv=None) -> int:
    args = parse_args(argv)
    SD_Pipeline.setup_logging()
    paths = sorted(Path(p) for p in glob.glob(args.shards) if p.endswith(".tar"))
    if not paths:
        print(f"{STAGE}.py: no shards match {args.shards!r}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = SD_Pipeline.Summary(STAGE)
    todo = []
    for path in paths:
        stats_path = out / f"{path.name[:-len('.tar')]}_stats.json"
        if stats_path.exists() and (out / f"{path.name[:-len('.tar')]}.parquet").exists():
            summary.add_done(stats_path)
        else:
            todo.append(path)
    if todo:
        from tqdm.auto import tqdm

        tokenizer = SD_Model.load_tokenizer(args.tokenizer)
        for path in tqdm(todo, desc="tokenize", unit="shard"):
            summary.add(process_shard(path, out, tokenizer, args.batch_size))
    summary.finish(out, tokenizer=args.tokenizer)
    return 0


if __name__ == "__main__":
    sys.exit(main())

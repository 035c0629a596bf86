"""Stage 04: image shards -> caption parquet with 77 CLIP token ids per sample.

    python pipeline/04_preprocess_to_cache.py --input 'SHARD_DIR/*.tar' --out CAPTION_DIR [--tokenizer ID_OR_PATH|tiny]

For each input shard NNNNN.tar, writes CAPTION_DIR/NNNNN.parquet with columns ``key`` (string),
``caption`` (string) and ``input_ids`` (77 int32 CLIP token ids, padded with the end token and
truncated the way SD 1.x was trained), then NNNNN_stats.json as the shard's done marker. Samples
without a caption or an image, with an unusable key (empty, absolute, ``..``, control characters),
a caption that is not UTF-8, or a member given twice are skipped and counted, as encode_latents.py
skips them. A re-run skips finished shards.
``--shards`` is the old spelling of ``--input`` and still works.
"""

from __future__ import annotations

import glob
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's modules

import numpy as np  # noqa: E402

import SD_Model  # noqa: E402
import SD_Pipeline  # noqa: E402
import SD_Runtime  # noqa: E402
import SD_Shards  # noqa: E402

STAGE = "04_preprocess_to_cache"


def parse_args(argv):
    parser = SD_Pipeline.StageArgumentParser(__file__, __doc__)
    parser.add_input("glob of image shards, quoted: 'SHARD_DIR/*.tar'", old=("--shards",))
    parser.add_out("output folder for NNNNN.parquet caption shards")
    parser.add_argument("--tokenizer", default=SD_Model.DEFAULT_TEXT_ENCODER,
                        help="CLIP tokenizer hub id, local folder, or 'tiny' (the same BPE, built offline)")
    parser.add_argument("--batch_size", type=int, default=4096, help="captions per tokenizer call")
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
        if sample.problem is not None:  # a bad key, a caption that is not UTF-8, a member given twice
            stats.skip(sample.problem, sample.key)
        elif sample.image is None:
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
    table = caption_table(keys, captions, input_ids)
    stats.successes = len(keys)
    return SD_Pipeline.write_output(out, stem(path), lambda tmp: pq.write_table(table, tmp), stats, ".parquet",
                                    shard=str(path))


def stem(path: Path) -> str:
    return path.name[: -len(".tar")]


def main(argv=None) -> int:
    SD_Runtime.start_process()
    args = parse_args(argv)
    SD_Pipeline.setup_logging()
    paths = sorted(Path(p) for p in glob.glob(args.input) if p.endswith(".tar"))
    if not paths:
        print(f"{STAGE}.py: no shards match {args.input!r}", file=sys.stderr)
        return 2
    by_stem = {stem(path): path for path in paths}
    if len(by_stem) != len(paths):
        print(f"{STAGE}.py: two input shards share a file name; their outputs would collide", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = SD_Pipeline.Summary(STAGE)
    todo = summary.pending(out, list(by_stem), ".parquet")
    if todo:
        from tqdm.auto import tqdm

        tokenizer = SD_Model.load_tokenizer(args.tokenizer)
        for name in tqdm(todo, desc="tokenize", unit="shard"):
            try:
                summary.add(process_shard(by_stem[name], out, tokenizer, args.batch_size))
            except OSError as error:  # the tar itself cannot be read: counted and named, tried again next run
                summary.input_failed("unreadable_tar", by_stem[name].name, error)
    summary.finish(out, tokenizer=args.tokenizer, failed_shards=summary.failed_inputs)
    return 0


if __name__ == "__main__":
    sys.exit(main())

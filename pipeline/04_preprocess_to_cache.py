"""Stage 04: image shards -> caption parquet with 77 CLIP token ids per sample.

    python pipeline/04_preprocess_to_cache.py --input 'SHARD_DIR/*.tar' --out CAPTION_DIR [--tokenizer ID_OR_PATH|tiny]

For each input shard NNNNN.tar, writes CAPTION_DIR/NNNNN.parquet with columns ``key`` (string),
``caption`` (string) and ``input_ids`` (77 int32 CLIP token ids, padded with the end token and
truncated the way SD 1.x was trained), then NNNNN_stats.json as the shard's done marker. Samples
without a caption or an image, with an unusable key (empty, absolute, ``..``, line breaks, control
characters), a caption that is not UTF-8, or a member given twice are skipped and counted, as
encode_latents.py skips them. A re-run skips finished shards.

Captions are read without the images (a LAION shard is ~99.9% image bytes). When img2dataset's
NNNNN.parquet lies next to NNNNN.tar (its key, caption and status columns) and the tar ends with its
end-of-archive blocks, only those three columns are read. Otherwise the tar is walked header by header:
``.txt`` payloads are read, image and ``.json`` payloads are passed over by seeking, and a caption
member over sd.data.stages.MAX_MEMBER_BYTES is skipped as ``too_large_member``. Both give the same
output and the same counts for an img2dataset shard; memory holds one shard's keys and captions.
``--shards`` is the old spelling of ``--input`` and still works.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tarfile
from pathlib import Path

import numpy as np

import sd.data.captions
import sd.data.shards
import sd.data.stages
import sd.model
import sd.runtime

STAGE = "04_preprocess_to_cache"
IMG2DATASET_COLUMNS = ("key", "caption", "status")  # what the caption read needs of img2dataset's parquet
log = logging.getLogger(STAGE)


def parse_args(argv):
    parser = sd.data.stages.StageArgumentParser(__file__, __doc__)
    parser.add_input("glob of image shards, quoted: 'SHARD_DIR/*.tar'", old=("--shards",))
    parser.add_out("output folder for NNNNN.parquet caption shards")
    parser.add_argument("--tokenizer", default=sd.model.DEFAULT_TEXT_ENCODER,
                        help="CLIP tokenizer hub id, local folder, or 'tiny' (the same BPE, built offline)")
    parser.add_argument("--batch_size", type=int, default=4096, help="captions per tokenizer call")
    return parser.parse_args(argv)


def process_shard(path: Path, out: Path, tokenizer, batch_size: int) -> dict:
    import pyarrow.parquet as pq

    stats = sd.data.stages.ShardStats()
    samples = img2dataset_samples(path)
    truncated_key = None
    if samples is None:
        samples, truncated_key = tar_samples(path)
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
    input_ids = np.zeros((len(keys), sd.model.TOKENIZER_MAX_LENGTH), dtype=np.int32)
    for start in range(0, len(keys), batch_size):
        batch = captions[start : start + batch_size]
        input_ids[start : start + len(batch)] = sd.model.tokenize(tokenizer, batch).numpy()
    table = sd.data.captions.caption_table(keys, captions, input_ids)
    stats.successes = len(keys)
    name = sd.data.stages.shard_stem(path)
    return sd.data.stages.write_output(out, name, lambda tmp: pq.write_table(table, tmp), stats, ".parquet",
                                    shard=str(path))


def tar_samples(path: Path) -> tuple[list[sd.data.shards.ShardSample], str | None]:
    """``sd.data.shards.TarSamples`` of the tar at ``path`` without its images: only ``.txt`` payloads are
    read (over sd.data.stages.MAX_MEMBER_BYTES: ``too_large_member``); an image or ``.json`` member stands
    as ``b""``.

    Passing a member over is a seek: through a one-page buffer, what is read is the 4 kB around each
    header, never a payload's bulk. (A 2850-sample shard of 77 kB images, 221 MB, read from a cold
    page cache: 22 MB came from the disk with this buffer, 39 MB unbuffered, 221 MB with 64 kB.)
    An OSError (the file cannot be read at all) is left to the caller.
    """
    with open(path, "rb", buffering=4096) as file:
        reader = sd.data.shards.TarSamples(file, os.fstat(file.fileno()).st_size, fields=("caption",),
                                      max_member_bytes=sd.data.stages.MAX_MEMBER_BYTES)
        try:
            return list(reader), reader.truncated_key
        except (tarfile.TarError, EOFError) as error:
            return [], f"<after 0 samples: {error}>"


def img2dataset_samples(path: Path) -> list[sd.data.shards.ShardSample] | None:
    """The samples of an img2dataset shard from the NNNNN.parquet it writes next to NNNNN.tar: the rows
    with status "success" are the tar's samples, in its order, and their captions its ``.txt`` files.

    None (read the tar instead) when there is no such parquet, it is unreadable or lacks those
    columns as text, a success row has no key, or the tar does not end with its end-of-archive blocks
    (a cut-off tar lost samples the parquet still lists).
    """
    parquet = path.with_suffix(".parquet")
    if not parquet.is_file() or not tar_is_complete(path):
        return None
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(parquet)
        text = (pa.types.is_string, pa.types.is_large_string)
        if not all(name in schema.names and any(is_text(schema.field(name).type) for is_text in text)
                   for name in IMG2DATASET_COLUMNS):
            return None
        table = pq.read_table(parquet, columns=list(IMG2DATASET_COLUMNS))
    except (OSError, pa.ArrowException) as error:
        log.warning("%s: %s; reading the captions from %s", parquet, error, path.name)
        return None
    table = table.filter(pc.equal(table.column("status"), "success"))
    if table.column("key").null_count:
        return None
    samples, seen = [], set()
    for key, caption in zip(table.column("key").to_pylist(), table.column("caption").to_pylist()):
        # img2dataset writes str(caption), or "" for a null one, into the tar's .txt.
        sample = sd.data.shards.ShardSample(key, image=b"", caption=(caption or "").strip(),
                                       problem=None if sd.data.shards.is_valid_key(key) else "bad_key")
        # As TarSamples reads the tar: a key right after itself is one sample given twice, skipped;
        # a key back after others is a later sample of its own, skipped (the first keeps the key).
        if samples and samples[-1].key == key:
            samples[-1].problem = samples[-1].problem or "duplicate_key"
            continue
        if key in seen:
            sample.problem = sample.problem or "duplicate_key"
        seen.add(key)
        samples.append(sample)
    return samples


def tar_is_complete(path: Path) -> bool:
    """Whether the tar ends with the two zero blocks every tar writer closes it with."""
    try:
        with open(path, "rb", buffering=0) as file:
            size = os.fstat(file.fileno()).st_size
            if size < 1024 or size % 512:
                return False
            file.seek(size - 1024)
            return file.read(1024) == bytes(1024)
    except OSError:
        return False



@sd.data.stages.ends_cleanly_on_a_full_disk(STAGE)
def main(argv=None) -> int:
    sd.runtime.start_process()
    args = parse_args(argv)
    sd.data.stages.setup_logging()
    try:
        by_stem = sd.data.stages.input_shards(args.input)
    except sd.data.stages.UsageError as error:
        print(f"{STAGE}.py: {error}", file=sys.stderr)
        return 2
    out = Path(args.out)
    summary = sd.data.stages.Summary(STAGE)
    earlier = json.loads(summary.path(out).read_text()) if summary.path(out).exists() else {}
    try:  # before any output: a tokenizer that cannot be loaded, or another one than the folder's
        tokenizer = sd.model.load_tokenizer(args.tokenizer)
        sd.data.stages.record_settings(out, STAGE, {"tokenizer": args.tokenizer},
                                       earlier={k: earlier[k] for k in ("tokenizer",) if k in earlier})
    except (sd.model.TokenizerError, sd.data.stages.SettingsChanged) as error:
        print(f"{STAGE}.py: {error}", file=sys.stderr)
        return 2
    todo = summary.pending(out, list(by_stem), ".parquet")
    if todo:
        from tqdm.auto import tqdm

        for name in tqdm(todo, desc="tokenize", unit="shard"):
            try:
                summary.add(process_shard(by_stem[name], out, tokenizer, args.batch_size))
            except OSError as error:  # the tar itself cannot be read: counted and named, tried again next run
                if sd.data.stages.disk_full(error):  # not the input's fault: the stage ends
                    raise
                summary.input_failed("unreadable_tar", by_stem[name].name, error)
    summary.finish(out, tokenizer=args.tokenizer, failed_shards=summary.failed_inputs)
    return summary.exit_code()


if __name__ == "__main__":
    sys.exit(main())

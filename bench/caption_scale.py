"""Benchmark: the caption side of the data at scale, our readers against the previous ones.

    python bench/caption_scale.py                                  # about a minute on a 2-core CPU
    python bench/caption_scale.py --sizes 100000,1000000 --shard_sizes 1000,5000,10000

1. The trainer's caption load (``sd.data.training_data.load_caption_split``, run by every rank at every start) on a
   caption dataset of ``--sizes`` rows laid out as ``05_build_hf_dataset.py`` writes it: the Arrow
   load against the previous per-row conversion through datasets' Python objects. Each load runs in
   a fresh process: seconds, rows/s, the ratio, and the process's peak RSS (VmHWM) and its growth
   over the RSS before the load (both processes have imported torch and datasets, as the trainer has).
2. Stage 04's caption read (``process_shard``) on one img2dataset-like shard per ``--shard_sizes``
   (``--image_kb`` of incompressible image bytes per sample, a caption and a JSON, and the parquet
   img2dataset writes beside it) in three ways: the previous whole-tar read, the tar read header by
   header, and the parquet. Per way: the seconds to read the captions with the shard evicted from the
   page cache (``posix_fadvise``: cold, as a first pass over a dataset on disk) and cached (warm), the
   whole shard (read, tokenize, write) warm, and the bytes that read calls returned (``/proc/self/io``
   rchar; the disk may read ahead more).
Prints both tables, the ratios, and one JSON line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import sd.cli
import sd.data.shards
import sd.data.training_data
import sd.model
from bench import harness

stage04 = importlib.import_module("pipeline.04_preprocess_to_cache")
WORDS = "a photo of the red blue cat dog on in with at beach city night portrait painting oil old".split()


def parse_args(argv=None):
    parser = sd.cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100000", help="caption dataset rows, comma-separated")
    parser.add_argument("--shard_sizes", default="1000,4000", help="samples per stage-04 shard, comma-separated")
    parser.add_argument("--image_kb", type=int, default=77, help="image bytes per sample (LAION: ~77 kB at 512 px)")
    parser.add_argument("--dir", default="", help="work folder (default: a temporary one, removed)")
    parser.add_argument("--json", default="", help="also write the result JSON to this file")
    # One load in a fresh process (how caption_load_rows measures each): the way, and the dataset.
    parser.add_argument("--load", choices=["per_row", "arrow"], help=argparse.SUPPRESS)
    parser.add_argument("--dataset", default="", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def captions(rng, n: int) -> list[str]:
    lengths = rng.integers(4, 30, n)
    words = np.array(WORDS)[rng.integers(0, len(WORDS), int(lengths.sum()))]
    ends = np.cumsum(lengths)
    return [" ".join(words[end - length : end]) for end, length in zip(ends, lengths)]


# ---------------------------------------------------------------------------------------------
# 1. The trainer's caption load
# ---------------------------------------------------------------------------------------------


def build_caption_dataset(folder: Path, rows: int) -> None:
    """A train split of ``rows`` (9-digit keys, captions, 77 int32 ids) saved as stage 05 saves it."""
    import pyarrow as pa
    from datasets import Dataset, DatasetDict
    from datasets.table import InMemoryTable

    rng = np.random.default_rng(0)
    ids = np.full((rows, sd.model.TOKENIZER_MAX_LENGTH), harness.EOS, dtype=np.int32)
    ids[:, 0] = harness.BOS
    ids[:, 1:20] = rng.integers(300, 49000, (rows, 19), dtype=np.int32)
    table = pa.table({"key": [f"{i:09d}" for i in range(rows)], "caption": captions(rng, rows),
                      "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids.reshape(-1)), ids.shape[1])})
    DatasetDict({"train": Dataset(InMemoryTable(table))}).save_to_disk(str(folder))


def per_row_load(dataset_dir: str):
    """The previous sd.data.training_data.load_caption_split: datasets' Python objects, row by row."""
    from datasets import load_from_disk

    table = load_from_disk(dataset_dir)["train"]
    keys = list(table["key"])
    return keys, np.asarray(table.with_format("numpy")["input_ids"], dtype=np.int64).reshape(len(keys), -1)


def memory_mb(field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process. Not ``ru_maxrss``: Linux carries that over
    ``exec`` from the forking parent, so a child of a big parent reports the parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure_load(way: str, dataset_dir: str) -> dict:
    """Runs in its own process (``--load``): one load, timed, with this process's memory."""
    import datasets  # noqa: F401  (imported before the baseline, as in the trainer)

    before = memory_mb("VmRSS")
    start = time.perf_counter()
    keys, input_ids = per_row_load(dataset_dir) if way == "per_row" else sd.data.training_data.load_caption_split(dataset_dir, "train")
    seconds = time.perf_counter() - start
    peak = memory_mb("VmHWM")
    return {"seconds": seconds, "rows": len(keys), "peak_rss_mb": round(peak), "rss_growth_mb": round(peak - before),
            "checksum": int(input_ids.sum() % 1_000_003) + sum(map(len, keys[:: max(1, len(keys) // 1000)]))}


def caption_load_rows(work: Path, sizes: list[int]) -> list[dict]:
    rows = []
    for size in sizes:
        folder = work / f"captions_{size}"
        build_caption_dataset(folder, size)
        results = {}
        for way in ("per_row", "arrow"):
            out = subprocess.run([sys.executable, __file__, "--load", way, "--dataset", str(folder)],
                                 capture_output=True, text=True, check=True)
            results[way] = json.loads(out.stdout.strip().splitlines()[-1])
        if results["per_row"]["checksum"] != results["arrow"]["checksum"]:
            raise SystemExit(f"the two loads of {folder} differ")
        for way, result in results.items():
            rows.append({"rows": size, "way": way, "seconds": round(result["seconds"], 5),
                         "rows_per_s": round(size / result["seconds"]), "peak_rss_mb": result["peak_rss_mb"],
                         "rss_growth_mb": result["rss_growth_mb"]})
        rows[-1]["speedup"] = round(results["per_row"]["seconds"] / results["arrow"]["seconds"], 1)
        print(f"  {size} rows: per-row {results['per_row']['seconds']:.2f} s, arrow {results['arrow']['seconds']:.3f} s",
              flush=True)
    return rows


# ---------------------------------------------------------------------------------------------
# 2. Stage 04's caption read
# ---------------------------------------------------------------------------------------------


def build_shard(folder: Path, samples: int, image_kb: int) -> Path:
    """An img2dataset-like shard: every 20th download failed (in the parquet only, as img2dataset writes)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(samples)
    texts = captions(rng, samples)
    keys = [f"{i:09d}" for i in range(samples)]
    ok = [i % 20 != 7 for i in range(samples)]
    folder.mkdir(parents=True, exist_ok=True)
    tar = folder / "00000.tar"
    sd.data.shards.write_shard(tar, [
        sd.data.shards.ShardSample(key, b"\xff\xd8\xff" + rng.bytes(image_kb * 1024 - 5) + b"\xff\xd9", "jpg", text,
                              json.dumps({"key": key, "caption": text, "status": "success", "width": 512}).encode())
        for key, text, good in zip(keys, texts, ok) if good])
    pq.write_table(pa.table({"url": [f"http://example.com/{k}.jpg" for k in keys], "caption": texts, "key": keys,
                             "status": ["success" if good else "failed_to_download" for good in ok],
                             "width": pa.array([512] * samples, pa.int32())}), folder / "00000.parquet")
    return tar


def evict(path: Path) -> None:
    """Drop a file's pages from the page cache (only this file; nothing else is touched)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def io_counters() -> dict:
    path = Path("/proc/self/io")
    if not path.exists():
        return {}
    return {k: int(v) for k, v in (line.split(": ") for line in path.read_text().splitlines())}


def previous_read(path: Path):
    """What process_shard did before: the whole tar into memory, then split."""
    return sd.data.shards.read_shard(path.read_bytes())


WAYS = {  # (samples from the parquet?, tar reader)
    "previous: whole tar": (False, previous_read),
    "tar, headers only": (False, stage04.tar_samples),
    "img2dataset parquet": (True, stage04.tar_samples),
}


def read_captions(tar: Path, way: str):
    use_parquet, tar_reader = WAYS[way]
    samples = stage04.img2dataset_samples(tar) if use_parquet else None
    return samples if samples is not None else tar_reader(tar)[0]


def timed_read(tar: Path, way: str, cold: bool) -> tuple[float, int, int, int]:
    """Seconds, bytes read calls returned, bytes the disk read, samples."""
    if cold:
        for path in (tar, tar.with_suffix(".parquet")):
            evict(path)
    io = io_counters()
    start = time.perf_counter()
    samples = read_captions(tar, way)
    seconds = time.perf_counter() - start
    after = io_counters()
    delta = {k: after[k] - io[k] for k in ("rchar", "read_bytes")} if io else {"rchar": -1, "read_bytes": -1}
    return seconds, delta["rchar"], delta["read_bytes"], len(samples)


def whole_shard(tar: Path, way: str, out: Path, tokenizer) -> float:
    """process_shard end to end with this way of reading (the other readers switched off)."""
    use_parquet, tar_reader = WAYS[way]
    saved = stage04.img2dataset_samples, stage04.tar_samples
    if not use_parquet:
        stage04.img2dataset_samples = lambda path: None
    stage04.tar_samples = tar_reader
    try:
        start = time.perf_counter()
        stage04.process_shard(tar, out, tokenizer, 4096)
        return time.perf_counter() - start
    finally:
        stage04.img2dataset_samples, stage04.tar_samples = saved


def stage04_rows(work: Path, shard_sizes: list[int], image_kb: int) -> list[dict]:
    import pyarrow.parquet as pq

    tokenizer = sd.model.load_tokenizer("tiny")
    rows = []
    for size in shard_sizes:
        tar = build_shard(work / f"shard_{size}", size, image_kb)
        outputs = []
        for way in WAYS:
            cold, rchar, disk, kept = timed_read(tar, way, cold=True)
            warm = min(timed_read(tar, way, cold=False)[0] for _ in range(2))
            out = work / f"out_{size}_{len(outputs)}"
            total = whole_shard(tar, way, out, tokenizer)
            outputs.append(pq.read_table(out / "00000.parquet"))
            rows.append({"samples": size, "way": way, "tar_mb": round(tar.stat().st_size / 2**20, 1),
                         "cold_read_s": round(cold, 4), "warm_read_s": round(warm, 4), "shard_s": round(total, 3),
                         "read_mb": round(rchar / 2**20, 3), "disk_mb": round(disk / 2**20, 2), "samples_read": kept})
        if not all(table.equals(outputs[0]) for table in outputs):
            raise SystemExit(f"stage 04 outputs of the {size}-sample shard differ between the ways of reading")
        base = rows[-3]
        for row in rows[-2:]:
            row["cold_speedup"] = round(base["cold_read_s"] / row["cold_read_s"], 1)
            row["bytes_ratio"] = round(base["read_mb"] / max(row["read_mb"], 1e-6))
        print(f"  {size}-sample shard done", flush=True)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.load:
        print(json.dumps(measure_load(args.load, args.dataset)))
        return 0
    with tempfile.TemporaryDirectory(dir=args.dir or None) as work:
        load = caption_load_rows(Path(work), harness.parse_list(args.sizes))
        print("trainer caption load (sd.data.training_data.load_caption_split), one fresh process per load")
        harness.print_table(load, lambda r: f"{r['rows']} rows, {r['way']}", [
            ("seconds", "seconds", ".3f"), ("rows_per_s", "rows/s", ",d"), ("peak_rss_mb", "peak RSS MB", "d"),
            ("rss_growth_mb", "RSS growth", "d"), ("speedup", "ratio", ".1f")])
        shards = stage04_rows(Path(work), harness.parse_list(args.shard_sizes), args.image_kb)
        print(f"stage 04 caption read, {args.image_kb} kB images (ratios against the previous whole-tar read)")
        harness.print_table(shards, lambda r: f"{r['samples']} samples ({r['tar_mb']} MB), {r['way']}", [
            ("cold_read_s", "cold s", ".4f"), ("warm_read_s", "warm s", ".4f"), ("shard_s", "shard s", ".3f"),
            ("read_mb", "read MB", ".3f"), ("disk_mb", "disk MB", ".2f"), ("cold_speedup", "cold ratio", ".1f"),
            ("bytes_ratio", "bytes ratio", "d")])
    harness.emit({"cpus": os.cpu_count(), "image_kb": args.image_kb, "caption_load": load, "stage04": shards},
                 args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

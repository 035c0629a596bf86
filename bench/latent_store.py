"""Benchmark: host memory and batch rate of the trainer's latent store, against a private copy per rank.

    python bench/latent_store.py                          # 10k and 40k latents of 4x64x64 (512 px), 2 ranks
    python bench/latent_store.py --sizes 50000,200000 --ranks 8

For each size, a latent folder like encode_latents.py writes (float16 ``NNNNN.npy`` shards of
``--shard_size`` and keys files) is built, then ``--ranks`` processes start at once, as the ranks of
one machine do, and each loads the folder:
* ours: ``sd.data.training_data.LatentStore`` (the files memory-mapped, each rank reading its share once into the
  page cache, which holds the one copy all ranks map);
* peer: the previous store, every shard copied into one array private to each process.
Each process reports its load time, the memory of its own that loading added (``RssAnon``) and the rate of random batches of
``--batch`` it assembles (``gather``: samples/s). Then the files are dropped from the page cache
(``posix_fadvise(DONTNEED)``) and one process reads batches on demand (``mmap_latents: true``): the
rate from storage, for latent sets larger than RAM. Prints a table, the growth from the smallest
to the largest size, the memory per machine projected to 1.3M latents and 8 ranks, and one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import numpy as np

import sd.cli
import sd.data.training_data

SHAPE = (4, 64, 64)
PROJECTED_LATENTS = 1_300_000


def make_folder(folder: Path, n: int, shard_size: int) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for shard, start in enumerate(range(0, n, shard_size)):
        rows = min(shard_size, n - start)
        np.save(folder / f"{shard:05d}.npy", rng.standard_normal((rows, *SHAPE), dtype=np.float32).astype(np.float16))
        (folder / f"{shard:05d}.keys.txt").write_text("".join(f"k{start + i}\n" for i in range(rows)))
    return sum(p.stat().st_size for p in folder.glob("*.npy"))


def rss_anon_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def private_copy(folder: Path) -> np.ndarray:
    """The previous store: every shard copied into one array of this process."""
    files = sorted(folder.glob("*.npy"))
    arrays = [np.load(f, mmap_mode="r") for f in files]
    data = np.empty((sum(len(a) for a in arrays), *SHAPE), dtype=np.float16)
    at = 0
    for a in arrays:
        data[at : at + len(a)] = a
        at += len(a)
    return data


def worker(folder: str, mode: str, rank: int, ranks: int, batch: int, batches: int) -> None:
    """One rank: load, then assemble random batches; prints one JSON line (memory: what loading added)."""
    baseline = rss_anon_mb()
    start = time.perf_counter()
    if mode == "ours":
        store = sd.data.training_data.LatentStore(folder, threads=4, share=(rank, ranks))
        gather = store.gather
        n = len(store)
    elif mode == "storage":
        store = sd.data.training_data.LatentStore(folder, mmap=True)
        gather = store.gather
        n = len(store)
    else:
        data = private_copy(Path(folder))
        n = len(data)

        def gather(rows):
            return data[rows]
    load = time.perf_counter() - start
    rng = np.random.default_rng(rank)
    start = time.perf_counter()
    for _ in range(batches):
        gather(np.sort(rng.choice(n, batch, replace=False)))
    rate = batches * batch / (time.perf_counter() - start)
    print(json.dumps({"load_s": load, "rss_anon_mb": rss_anon_mb() - baseline, "samples_per_s": rate}))


def run_ranks(folder: Path, mode: str, ranks: int, batch: int, batches: int) -> list[dict]:
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(folder), mode, str(r), str(ranks),
                               str(batch), str(batches)], stdout=subprocess.PIPE, text=True)
             for r in range(ranks)]
    results = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"a {mode} worker failed ({p.returncode})")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def drop_from_page_cache(folder: Path) -> None:
    for path in folder.glob("*.npy"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        folder, mode, rank, ranks, batch, batches = sys.argv[2:8]
        worker(folder, mode, int(rank), int(ranks), int(batch), int(batches))
        return 0
    parser = sd.cli.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="10000,40000", help="latents per folder, comma-separated")
    parser.add_argument("--ranks", type=int, default=2, help="processes loading the folder at once (one machine)")
    parser.add_argument("--shard_size", type=int, default=1000, help="latents per shard file")
    parser.add_argument("--batch", type=int, default=64, help="samples per batch")
    parser.add_argument("--batches", type=int, default=50, help="random batches timed per process")
    parser.add_argument("--dir", default=None, help="where to build the folders (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="also write the result to this file")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for n in sizes:
            folder = Path(tmp) / f"latents_{n}"
            size_mb = make_folder(folder, n, args.shard_size) / 2**20
            ours = run_ranks(folder, "ours", args.ranks, args.batch, args.batches)
            peer = run_ranks(folder, "private", args.ranks, args.batch, args.batches)
            drop_from_page_cache(folder)
            storage = run_ranks(folder, "storage", 1, args.batch, args.batches)[0]
            rows.append({"latents": n, "data_mb": size_mb, "ranks": args.ranks,
                         "ours_rss_anon_mb": sum(r["rss_anon_mb"] for r in ours),
                         "peer_rss_anon_mb": sum(r["rss_anon_mb"] for r in peer),
                         "ours_load_s": max(r["load_s"] for r in ours), "peer_load_s": max(r["load_s"] for r in peer),
                         "ours_samples_per_s": min(r["samples_per_s"] for r in ours),
                         "peer_samples_per_s": min(r["samples_per_s"] for r in peer),
                         "storage_samples_per_s": storage["samples_per_s"]})
            shutil.rmtree(folder, ignore_errors=True)
    print(f"{'latents':>8} {'data MB':>8} | {'own memory of all ranks, MB':>28} | {'load s':>13} | "
          f"{'batch samples/s':>24} | {'from storage':>12}")
    print(f"{'':>8} {'':>8} | {'ours':>8} {'peer':>8} {'ratio':>10} | {'ours':>6} {'peer':>6} | "
          f"{'ours':>7} {'peer':>7} {'ratio':>8} | {'samples/s':>12}")
    for r in rows:
        print(f"{r['latents']:>8} {r['data_mb']:>8.0f} | {r['ours_rss_anon_mb']:>8.0f} {r['peer_rss_anon_mb']:>8.0f} "
              f"{r['ours_rss_anon_mb'] / r['peer_rss_anon_mb']:>10.3f} | {r['ours_load_s']:>6.2f} "
              f"{r['peer_load_s']:>6.2f} | {r['ours_samples_per_s']:>7.0f} {r['peer_samples_per_s']:>7.0f} "
              f"{r['ours_samples_per_s'] / r['peer_samples_per_s']:>8.2f} | {r['storage_samples_per_s']:>12.0f}")
    first, last = rows[0], rows[-1]
    growth = {key: last[key] / first[key] for key in ("data_mb", "ours_rss_anon_mb", "peer_rss_anon_mb")}
    per_latent_mb = last["data_mb"] / last["latents"]
    projected = {"data_gb": PROJECTED_LATENTS * per_latent_mb / 1024,
                 "peer_per_8_rank_machine_gb": 8 * PROJECTED_LATENTS * per_latent_mb / 1024,
                 "ours_per_machine_gb": PROJECTED_LATENTS * per_latent_mb / 1024}
    print(f"growth {first['latents']} -> {last['latents']} latents: data x{growth['data_mb']:.1f}, own memory "
          f"ours x{growth['ours_rss_anon_mb']:.2f}, peer x{growth['peer_rss_anon_mb']:.1f}")
    print(f"projected to {PROJECTED_LATENTS:,} latents at 512 px on 8 ranks: {projected['data_gb']:.1f} GB of "
          f"latents; peer {projected['peer_per_8_rank_machine_gb']:.0f} GB of process memory per machine, ours "
          f"{projected['ours_per_machine_gb']:.1f} GB of page cache shared by the ranks")
    result = {"rows": rows, "growth": growth, "projected": projected}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

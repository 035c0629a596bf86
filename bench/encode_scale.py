"""Benchmark: peak memory of encode_latents.py against the shard size (issue 14).

    python bench/encode_scale.py                                   # CPU: tiny VAE, 64 px, 1000 and 10000 images a shard
    python bench/encode_scale.py --script OLD/encode_latents.py    # the same for another version of the script
    python bench/encode_scale.py --buckets                         # aspect-ratio buckets, images of five shapes

For each shard size, one folder of ``--shards`` shards of that many generated JPEGs (larger than the
resolution, so they are resized as real data is) is encoded by ``encode_latents.py`` in a fresh process
on the CPU; the peak resident memory is that process's own (``ru_maxrss`` from ``wait4``). A pipeline
whose decoded images in flight are bounded peaks at about the same memory at both sizes; one that holds
whole shards grows with them. ``--buckets`` encodes images of five aspect ratios into buckets
(``--buckets --bucket_step 16``), where images also wait for their bucket's batch. Prints the peak at each size, the growth, the ratio large/small, the tar
size per shard (the prefetch still holds a shard's compressed bytes whole) and one JSON line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import sd.cli
from bench import harness


def make_shards(folder: Path, images: int, per_shard: int, resolution: int, aspects: bool = False) -> None:
    """bench/encode_throughput.py's shards."""
    from bench import encode_throughput

    encode_throughput.make_shards(folder, images, per_shard, resolution, aspects=aspects)


def encode_peak(script: Path, shards: Path, out: Path, args) -> dict:
    """Run the encoder in a child process: its own peak RSS, its wall time (start-up included) and the
    in-flight peak it logs."""
    command = [sys.executable, str(script), "--shards", str(shards / "*.tar"), "--out", str(out), "--vae", "tiny",
               "--resolution", str(args.resolution), "--batch_size", str(args.batch_size), "--workers",
               str(args.workers), "--device", "cpu"] + (["--buckets", "--bucket_step", "16"] if args.buckets else [])
    log = out.with_suffix(".log")
    environment = dict(os.environ)
    start = time.perf_counter()
    with open(log, "w") as handle:
        child = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=environment, cwd=ROOT)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - start
    text = log.read_text()
    if child.returncode != 0:
        raise RuntimeError(f"{script} failed ({child.returncode}):\n{text[-3000:]}")
    in_flight = re.search(r"at most (\d+) images were decoded ahead of the VAE \(limit (\d+)\)", text)
    return {"peak_rss_mb": round(usage.ru_maxrss / 1024, 1),  # KiB on Linux
            "seconds": round(seconds, 1), "in_flight_peak": int(in_flight[1]) if in_flight else None,
            "in_flight_limit": int(in_flight[2]) if in_flight else None}


def main(argv=None) -> dict:
    parser = sd.cli.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1000,10000",
                        help="images per shard, small then large (default: %(default)s)")
    parser.add_argument("--shards", type=int, default=1, help="shards at each size (default: %(default)s)")
    parser.add_argument("--resolution", type=int, default=64, help="pixels (default: %(default)s)")
    parser.add_argument("--batch_size", type=int, default=16, help="(default: %(default)s)")
    parser.add_argument("--workers", type=int, default=2, help="decode threads (default: %(default)s)")
    parser.add_argument("--script", default=str(ROOT / "encode_latents.py"), help="the encoder to measure")
    parser.add_argument("--json", default="", help="also write the result JSON to this file")
    parser.add_bool("--buckets", help="images of five aspect ratios, encoded into aspect-ratio buckets")
    args = parser.parse_args(argv)
    small, large = harness.parse_list(args.sizes)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in (small, large):
            shards = Path(tmp) / f"shards_{size}"
            make_shards(shards, size * args.shards, size, args.resolution, aspects=args.buckets)
            tar_mb = sum(p.stat().st_size for p in shards.glob("*.tar")) / args.shards / 2**20
            row = {"images_per_shard": size, "tar_mb_per_shard": round(tar_mb, 1),
                   **encode_peak(Path(args.script), shards, Path(tmp) / f"latents_{size}", args)}
            rows.append(row)
            print(f"{size:6d} images a shard ({tar_mb:5.1f} MB tar): peak RSS {row['peak_rss_mb']:7.1f} MB, "
                  f"{row['seconds']:6.1f} s, decoded ahead at most {row['in_flight_peak']} "
                  f"(limit {row['in_flight_limit']})")
    growth = rows[1]["peak_rss_mb"] - rows[0]["peak_rss_mb"]
    ratio = rows[1]["peak_rss_mb"] / rows[0]["peak_rss_mb"]
    print(f"growth {growth:.1f} MB for {large // small}x the shard size; ratio peak {large}/{small} = {ratio:.2f}x")
    result = {"benchmark": "encode_scale", "script": os.path.relpath(args.script, ROOT), "device": "cpu",
              "resolution": args.resolution, "batch_size": args.batch_size, "workers": args.workers,
              "buckets": args.buckets,
              "shards": args.shards, "rows": rows, "growth_mb": round(growth, 1), "ratio": round(ratio, 3)}
    harness.emit(result, args.json)
    return result


if __name__ == "__main__":
    main()

"""Benchmark: the studio's reads against the size of what it shows (its memory must not follow the data).

    python bench/studio_scale.py                         # about 2 minutes on a 2-core CPU
    python bench/studio_scale.py --folders 100000 --image_kb 8 --metrics 10000   # a large folder of small files

1. The Data page's scan of a folder of ``--folders`` images (JPEGs with captions): seconds, and the Python
   memory held at its peak (tracemalloc), against the same scan reading every image whole to learn its size,
   measured on the same folder of ``--image_kb`` files; a page of thumbnails is 24 of them
   whatever the folder's size.
2. The Train page's reader of ``metrics.jsonl`` with ``--metrics`` logged steps: seconds and peak Python memory,
   against reading every line into a list (what a naive page does), on the same file.
Prints a table, the ratios, and one JSON line.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path


def measured(call):
    tracemalloc.start()
    start = time.perf_counter()
    try:
        result = call()
        seconds = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return result, seconds, peak / 2**20


def make_folder(folder: Path, n: int, kilobytes: int) -> None:
    """``n`` JPEGs of about ``kilobytes`` each (a photo's size: noise compresses little) with their captions."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True)
    side = max(16, int((kilobytes * 1024 / 1.2) ** 0.5))
    pixels = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    data = buffer.getvalue()
    for i in range(n):
        (folder / f"img{i:06d}.jpg").write_bytes(data)
        (folder / f"img{i:06d}.txt").write_text(f"a photo number {i}")


def whole_file_scan(folder: Path):
    """The same scan reading each image whole (the way before it read the first 64 KB)."""
    from sd.studio import data

    kept, data.HEADER_BYTES = data.HEADER_BYTES, 1 << 40
    try:
        return data.scan_folder(folder, resolution=64)
    finally:
        data.HEADER_BYTES = kept


def make_metrics(path: Path, n: int) -> None:
    with open(path, "w") as handle:
        for step in range(n):
            handle.write(json.dumps({"step": step, "loss": 0.1 + 1 / (step + 1), "lr": 1e-4, "grad_norm": 0.5,
                                     "images_per_s": 12.5}) + "\n")


def all_lines(path: Path) -> int:
    with open(path) as handle:
        return len([json.loads(line) for line in handle])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folders", default="1000,10000", help="images per folder (default: %(default)s)")
    parser.add_argument("--metrics", default="10000,100000,1000000", help="logged steps (default: %(default)s)")
    parser.add_argument("--image_kb", type=int, default=200, help="each image's size in KB (default: %(default)s)")
    args = parser.parse_args(argv)
    from sd.studio import data, jobs

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_folder(tmp / "warm_up", 2, args.image_kb)  # the readers' first imports are not counted in a row
        data.scan_folder(tmp / "warm_up", resolution=64)
        whole_file_scan(tmp / "warm_up")
        for n in (int(x) for x in args.folders.split(",")):
            folder = tmp / f"folder_{n}"
            make_folder(folder, n, args.image_kb)
            scan, seconds, peak = measured(lambda: data.scan_folder(folder, resolution=64))
            _, peer_seconds, peer_peak = measured(lambda: whole_file_scan(folder))
            page, page_seconds, _ = measured(lambda: data.page_of(scan, 10**9, 24))
            assert len(scan.images) == n and len(page) == min(24, n - (n - 1) // 24 * 24)
            rows.append({"what": "folder scan", "size": n, "seconds": round(seconds, 3), "peak_mb": round(peak, 2),
                         "peer_seconds": round(peer_seconds, 3), "peer_peak_mb": round(peer_peak, 2),
                         "page_seconds": round(page_seconds, 6)})
            print(json.dumps(rows[-1]), flush=True)
        for n in (int(x) for x in args.metrics.split(",")):
            path = tmp / f"metrics_{n}.jsonl"
            make_metrics(path, n)
            tail = jobs.JsonlTail(path)
            _, seconds, peak = measured(tail.read)
            _, peer_seconds, peer_peak = measured(lambda: all_lines(path))
            rows.append({"what": "metrics read", "size": n, "seconds": round(seconds, 3), "peak_mb": round(peak, 2),
                         "peer_seconds": round(peer_seconds, 3), "peer_peak_mb": round(peer_peak, 2),
                         "points_kept": len(tail.rows)})
            print(json.dumps(rows[-1]), flush=True)
    print(f"{'what':14} {'size':>9} {'seconds':>8} {'peak MB':>8} {'peer s':>8} {'peer MB':>8} {'MB ratio':>9}")
    for r in rows:
        print(f"{r['what']:14} {r['size']:>9} {r['seconds']:>8} {r['peak_mb']:>8} {r['peer_seconds']:>8} "
              f"{r['peer_peak_mb']:>8} {r['peak_mb'] / max(r['peer_peak_mb'], 1e-9):>9.3f}")
    print(json.dumps({"bench": "studio_scale", "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

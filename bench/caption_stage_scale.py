"""Benchmark: stage 03c's time and peak memory against the number of images (its own work, tiny models).

    python bench/caption_stage_scale.py                      # about 5 minutes on a 2-core CPU
    python bench/caption_stage_scale.py --sizes 1000,10000

A folder of ``--sizes`` JPEG photos (512 x 384) is captioned by a tiny random BLIP and a tiny WD14-style
tagger (``sd.data.tiny_captioners``: the models' own time is bench/captioner_speed.py's), each run in a
fresh process: its seconds, images per second and peak RSS (VmHWM), and the same for the second run, which
only composes the captions again with another ``--trigger``. Memory should not grow with the folder: one
batch of images and one part's captions are held at a time. Prints a table and one JSON line, and the
ratio of the largest size's peak to the smallest's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def make_folder(folder: Path, n: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    base = [Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).resize((512, 384), Image.BILINEAR)
            for _ in range(16)]
    for i in range(n):
        base[i % 16].save(folder / f"photo_{i:06d}.jpg", quality=90)


def peak_run(argv: list[str]) -> tuple[float, float]:
    """Seconds and peak RSS (GB) of the stage run in a fresh process."""
    code = ("import resource, runpy, sys\n"
            "sys.argv = sys.argv[1:]\n"
            "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", code, str(ROOT / "pipeline/03c_caption_images.py"), *argv],
                            capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - start
    if result.returncode:
        raise SystemExit(result.stderr[-2000:])
    peak = int(result.stdout.strip().splitlines()[-1].split()[1])
    return seconds, peak / 2**20


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="500,2000,8000", help="images per run (default: %(default)s)")
    parser.add_argument("--shard_size", type=int, default=500, help="images per part (default: %(default)s)")
    args = parser.parse_args(argv)
    from sd.data.tiny_captioners import tiny_blip, tiny_tagger

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        blip, tagger = tiny_blip(tmp / "blip"), tiny_tagger(tmp / "tagger")
        for n in (int(x) for x in args.sizes.split(",")):
            make_folder(tmp / f"photos_{n}", n)
            common = ["--input", str(tmp / f"photos_{n}"), "--out", str(tmp / f"out_{n}"), "--captioner", str(blip),
                      "--tagger", str(tagger), "--max_length", "8", "--shard_size", str(args.shard_size)]
            seconds, peak = peak_run(common)
            again, again_peak = peak_run([*common, "--trigger", "sks"])
            rows.append({"images": n, "seconds": round(seconds, 1), "images_per_s": round(n / seconds, 1),
                         "peak_rss_gb": round(peak, 3), "compose_again_s": round(again, 1),
                         "compose_again_peak_gb": round(again_peak, 3)})
            print(json.dumps(rows[-1]), flush=True)
    print(f"{'images':>8} {'seconds':>8} {'img/s':>7} {'peak GB':>8} {'again s':>8} {'again GB':>9}")
    for r in rows:
        print(f"{r['images']:>8} {r['seconds']:>8} {r['images_per_s']:>7} {r['peak_rss_gb']:>8} {r['compose_again_s']:>8} "
              f"{r['compose_again_peak_gb']:>9}")
    growth = rows[-1]["peak_rss_gb"] / rows[0]["peak_rss_gb"]
    print(f"peak at {rows[-1]['images']} images / at {rows[0]['images']}: {growth:.3f}x")
    print(json.dumps({"bench": "caption_stage_scale", "rows": rows, "peak_growth": round(growth, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

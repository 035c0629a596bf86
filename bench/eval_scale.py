"""Benchmark: SD_Eval.py's FID statistics and distance against the usual approach, by set size.

    python bench/eval_scale.py                               # 2048-d features (Inception's), N = 5000, 20000, 80000
    python bench/eval_scale.py --sizes 500,2000 --dim 64     # quick

1. Statistics of N features of width D arriving in batches of ``--batch`` (as an extractor yields
   them; seeded, so both sides see the same numbers). Ours: ``sd.evaluation.FeatureStats``, running float64
   sums of the features and their outer products over chunks of 1024 rows. The peer: pytorch-fid's approach (every feature kept
   in an (N, D) float64 array, then ``np.mean`` and ``np.cov``; torch-fidelity and clean-fid also keep
   them all). Each side runs in a fresh child process per N, so the peak RSS (``ru_maxrss``) is its own.
   Prints time and peak memory per N, their growth, and the largest difference between the two
   ``mu`` / ``sigma``.
2. The distance at D between the statistics of the largest N and a shifted copy: ours (eigenvalues of
   the symmetric ``sigma1^(1/2) sigma2 sigma1^(1/2)``) against pytorch-fid's ``scipy.linalg.sqrtm`` of
   ``sigma1 sigma2``: the time ratio and the difference of the values.
Ends with one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

import sd.cli
import sd.evaluation
from bench import harness


def feature_batches(n: int, dim: int, batch: int, seed: int = 0):
    """Seeded float32 features in batches: a random mixing of a Gaussian, non-negative as pooled features are."""
    rng = np.random.default_rng(seed)
    mixing = rng.normal(size=(dim, dim)).astype(np.float32) / np.sqrt(dim)
    for start in range(0, n, batch):
        rows = min(batch, n - start)
        yield np.abs(rng.normal(size=(rows, dim)).astype(np.float32) @ mixing)


def child(impl: str, n: int, dim: int, batch: int, out: str) -> None:
    """One side at one size: writes mu and sigma to ``out`` (.npz) and prints its compute seconds."""

    start = time.perf_counter()
    if impl == "ours":
        stats = sd.evaluation.FeatureStats(dim)
        for features in feature_batches(n, dim, batch):
            stats.add(features)
        mu, sigma = stats.mean_cov()
    else:
        kept = np.empty((n, dim))
        for i, features in enumerate(feature_batches(n, dim, batch)):
            kept[i * batch : i * batch + len(features)] = features
        mu, sigma = np.mean(kept, axis=0), np.cov(kept, rowvar=False)
    seconds = time.perf_counter() - start
    np.savez(out, mu=mu, sigma=sigma)
    print(json.dumps({"seconds": seconds}))


def run_child(impl: str, n: int, args, out: Path) -> dict:
    command = [sys.executable, __file__, "--child", impl, "--sizes", str(n), "--dim", str(args.dim),
               "--batch", str(args.batch), "--json", str(out)]
    child_process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                     env=os.environ)
    stdout = child_process.stdout.read()
    _, status, usage = os.wait4(child_process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{impl} at {n} failed")
    return {"impl": impl, "n": n, "seconds": round(json.loads(stdout.strip().splitlines()[-1])["seconds"], 3),
            "peak_rss_mb": round(usage.ru_maxrss / 1024, 1)}


def distance_part(mu: np.ndarray, sigma: np.ndarray, repeats: int = 3) -> dict:
    """Ours against scipy.linalg.sqrtm on the statistics and a shifted, rescaled copy of them."""
    import scipy.linalg


    mu2, sigma2 = mu * 1.05 + 0.01, sigma * 1.1

    def peer() -> float:  # pytorch-fid's calculate_frechet_distance, without its offset retry
        covmean = scipy.linalg.sqrtm(sigma @ sigma2).real
        diff = mu - mu2
        return float(diff @ diff + np.trace(sigma) + np.trace(sigma2) - 2 * np.trace(covmean))

    times = {}
    for name, fn in (("ours", lambda: sd.evaluation.frechet_distance(mu, sigma, mu2, sigma2)), ("peer", peer)):
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            value = fn()
            best = min(best, time.perf_counter() - start)
        times[name] = (best, value)
    return {"ours_s": round(times["ours"][0], 4), "peer_s": round(times["peer"][0], 4),
            "ratio_peer_over_ours": round(times["peer"][0] / times["ours"][0], 2),
            "fid_ours": times["ours"][1], "fid_peer": times["peer"][1],
            "abs_difference": abs(times["ours"][1] - times["peer"][1])}


def main(argv=None) -> dict:
    parser = sd.cli.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="5000,20000,80000", help="numbers of images (default: %(default)s)")
    parser.add_argument("--dim", type=int, default=2048, help="feature width (default: %(default)s, Inception's)")
    parser.add_argument("--batch", type=int, default=64, help="features per batch (default: %(default)s)")
    parser.add_argument("--json", default="", help="also write the result JSON to this file")
    parser.add_argument("--child", choices=("ours", "peer"), help=argparse_hidden())
    args = parser.parse_args(argv)
    sizes = harness.parse_list(args.sizes)
    if args.child:
        child(args.child, sizes[0], args.dim, args.batch, args.json)
        return {}
    import tempfile

    rows, differences = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            results = {impl: run_child(impl, n, args, Path(tmp) / f"{impl}_{n}.npz") for impl in ("ours", "peer")}
            ours, peer = (np.load(Path(tmp) / f"{impl}_{n}.npz") for impl in ("ours", "peer"))
            differences.append(max(float(np.abs(ours["mu"] - peer["mu"]).max()),
                                   float(np.abs(ours["sigma"] - peer["sigma"]).max())))
            rows += results.values()
            print(f"N={n:7d}  ours {results['ours']['seconds']:7.2f} s {results['ours']['peak_rss_mb']:8.1f} MB   "
                  f"peer {results['peer']['seconds']:7.2f} s {results['peer']['peak_rss_mb']:8.1f} MB   "
                  f"time peer/ours {results['peer']['seconds'] / max(results['ours']['seconds'], 1e-9):.2f}x   "
                  f"max |diff| {differences[-1]:.2e}")
        distance = distance_part(ours["mu"], ours["sigma"])
    growth = {impl: round([r for r in rows if r["impl"] == impl][-1]["peak_rss_mb"]
                          / [r for r in rows if r["impl"] == impl][0]["peak_rss_mb"], 2) for impl in ("ours", "peer")}
    print(f"peak memory at N={sizes[-1]} over N={sizes[0]} ({sizes[-1] / sizes[0]:.0f}x the images): "
          f"ours {growth['ours']}x, peer {growth['peer']}x")
    print(f"distance at D={args.dim}: ours {distance['ours_s']:.3f} s, scipy sqrtm {distance['peer_s']:.3f} s "
          f"(ratio peer/ours {distance['ratio_peer_over_ours']}), |FID difference| {distance['abs_difference']:.2e}")
    result = {"dim": args.dim, "batch": args.batch, "rows": rows, "max_stat_difference": max(differences),
              "memory_growth": growth, "distance": distance}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()

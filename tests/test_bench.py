"""Every benchmark runs on the CPU with tiny models and prints its ratio against its peer."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_bench(script: str, *args) -> tuple[str, dict]:
    result = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    return result.stdout, json.loads(lines[-1])


def test_encode_latents_bench_prints_both_rates_and_the_ratio():
    stdout, result = run_bench("encode_latents.py", "--images", "48", "--per_shard", "16", "--batch_size", "8")
    assert "ratio ours/naive" in stdout
    assert result["encoded"] == 48
    for key in ("ours_images_per_s", "naive_images_per_s", "vae_only_images_per_s"):
        assert result[key] > 0
    assert result["ratio_vs_naive"] == round(result["ours_images_per_s"] / result["naive_images_per_s"], 2)

"""Benchmark: encode_latents.py against the naive loop a user would write, in one process.

    python bench/encode_throughput.py                         # CPU: tiny VAE, 64 px
    python bench/encode_throughput.py --vae sd1 --resolution 512 --images 2048 --batch_size 64   # GPU

Both encode the same generated JPEG shards with the same VAE weights:
* ours: encode_latents.main (prefetch thread, OpenCV decode pool, pinned batches, writer thread);
* naive: for each image, PIL decode + resize + crop, a batch of one through the VAE, wait, repeat.
Also measured: the VAE alone on device-resident random pixels at the same batch size, the ceiling
for any pipeline. Prints images/s of each, the ratios, and one JSON line for BENCHMARKS.md.
"""

from __future__ import annotations

import io
import json
import runpy
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import sd.cli
import sd.data.shards
import sd.model
import sd.runtime
from bench import harness

ROOT = Path(__file__).resolve().parents[1]
# The command itself, in this process (a script at the root, not a module of the package).
encode_latents_main = runpy.run_path(str(ROOT / "encode_latents.py"), run_name="encode_latents")["main"]

# (height, width) per resolution of the --aspects images: landscape, portrait, square, 3:1 and 1:3
ASPECTS = ((1.25, 1.6), (1.6, 1.25), (1.25, 1.25), (0.8, 2.4), (2.4, 0.8))


def make_shards(folder: Path, images: int, per_shard: int, resolution: int, seed: int = 0,
                aspects: bool = False) -> None:
    """JPEG photos-like images, 1.25x the resolution on the short side (they need resizing, as real data);
    ``aspects``: image i in the i-th shape of ASPECTS, in turn (for aspect-ratio buckets)."""
    rng = np.random.default_rng(seed)
    shapes = [(int(resolution * h), int(resolution * w)) for h, w in (ASPECTS if aspects else ASPECTS[:1])]
    for shard, start in enumerate(range(0, images, per_shard)):
        samples = []
        for i in range(start, min(images, start + per_shard)):
            height, width = shapes[i % len(shapes)]
            small = rng.integers(0, 256, size=(height // 16, width // 16, 3), dtype=np.uint8)
            buffer = io.BytesIO()
            Image.fromarray(small).resize((width, height), Image.BICUBIC).save(buffer, format="JPEG", quality=90)
            samples.append(sd.data.shards.ShardSample(f"{i:08d}", buffer.getvalue(), "jpg", f"image {i}"))
        sd.data.shards.write_shard(folder / f"{shard:05d}.tar", samples)


def naive_encode(shards: list[Path], vae, device, dtype, resolution: int) -> int:
    """What a first script does: one image at a time, PIL, synchronous."""
    count = 0
    for path in shards:
        latents = []
        with tarfile.open(path) as tar:
            for member in tar:
                if not member.name.endswith(".jpg"):
                    continue
                image = Image.open(tar.extractfile(member)).convert("RGB")
                scale = resolution / min(image.size)
                image = image.resize((max(resolution, round(image.width * scale)),
                                      max(resolution, round(image.height * scale))), Image.BICUBIC)
                left, top = (image.width - resolution) // 2, (image.height - resolution) // 2
                image = image.crop((left, top, left + resolution, top + resolution))
                pixels = torch.from_numpy(np.asarray(image)).permute(2, 0, 1)[None].to(device, dtype) / 127.5 - 1
                with torch.no_grad():
                    latents.append(vae.encode(pixels).latent_dist.mean.to(torch.float16).cpu().numpy())
                count += 1
        np.save(path.with_suffix(".naive.npy"), np.concatenate(latents))
    return count


def vae_ceiling(vae, device, dtype, resolution: int, batch_size: int, batches: int) -> float:
    pixels = torch.rand(batch_size, 3, resolution, resolution, device=device, dtype=dtype) * 2 - 1
    with torch.no_grad(), sd.model.attention_context(device):
        vae.encode(pixels)  # warm-up
        sd.runtime.synchronize(device)
        start = time.perf_counter()
        for _ in range(batches):
            vae.encode(pixels).latent_dist.mean.to(torch.float16)
        sd.runtime.synchronize(device)
    return batch_size * batches / (time.perf_counter() - start)


def parse_args(argv=None):
    parser = sd.cli.ArgumentParser(description=__doc__)
    parser.add_argument("--vae", choices=["tiny", "sd1"], default="tiny", help="tiny, or the SD 1.x VAE architecture "
                        "with random weights (default: %(default)s)")
    parser.add_argument("--resolution", type=int, default=64, help="pixels (default: %(default)s)")
    parser.add_argument("--images", type=int, default=192, help="images in all (default: %(default)s)")
    parser.add_argument("--per_shard", type=int, default=64, help="images per shard (default: %(default)s)")
    parser.add_argument("--batch_size", type=int, default=32, help="our batch size (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=8, help="our decode threads (default: %(default)s)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (default: %(default)s)")
    parser.add_argument("--json", default="", help="also write the result JSON to this file")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = sd.runtime.pick_device(args.device)
    dtype = sd.runtime.resolve_precision("auto", device)  # what encode_latents.py picks for this device
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_shards(tmp / "shards", args.images, args.per_shard, args.resolution)
        if args.vae == "tiny":
            vae_id, vae = "tiny", sd.model.load_vae("tiny")
        else:
            vae = harness.random_vae("sd1", seed=0)
            vae.save_pretrained(tmp / "vae")
            vae_id = str(tmp / "vae")
        vae = vae.to(device=device, dtype=dtype).eval()
        shards = sorted((tmp / "shards").glob("*.tar"))

        # Warm both paths (CUDA context, kernel selection) on one shard, outside the timings.
        encode_latents_main(["--shards", str(shards[0]), "--out", str(tmp / "warm"), "--vae", vae_id,
                             "--resolution", str(args.resolution), "--batch_size", str(args.batch_size),
                             "--workers", str(args.workers), "--device", str(device)])
        naive_encode(shards[:1], vae, device, dtype, args.resolution)

        start = time.perf_counter()
        encode_latents_main(["--shards", str(tmp / "shards" / "*.tar"), "--out", str(tmp / "ours"), "--vae", vae_id,
                             "--resolution", str(args.resolution), "--batch_size", str(args.batch_size),
                             "--workers", str(args.workers), "--device", str(device)])
        ours = args.images / (time.perf_counter() - start)
        start = time.perf_counter()
        naive_encode(shards, vae, device, dtype, args.resolution)
        naive = args.images / (time.perf_counter() - start)
        ceiling = vae_ceiling(vae, device, dtype, args.resolution, args.batch_size,
                              max(2, args.images // args.batch_size))
        count = json.loads((tmp / "ours" / "latents.json").read_text())["count"]

    result = {
        "benchmark": "encode_latents", "device": harness.device_name(device), "torch": torch.__version__,
        "vae": args.vae, "resolution": args.resolution, "images": args.images, "encoded": count,
        "batch_size": args.batch_size, "workers": args.workers, "dtype": str(dtype).replace("torch.", ""),
        "ours_images_per_s": round(ours, 2), "naive_images_per_s": round(naive, 2),
        "vae_only_images_per_s": round(ceiling, 2), "ratio_vs_naive": round(ours / naive, 2),
        "fraction_of_vae_ceiling": round(ours / ceiling, 3),
    }
    print(f"ours   {ours:9.1f} images/s")
    print(f"naive  {naive:9.1f} images/s")
    print(f"VAE    {ceiling:9.1f} images/s (encoder alone, pixels already on the device)")
    print(f"ratio ours/naive = {ours / naive:.2f}x; ours reaches {100 * ours / ceiling:.0f}% of the VAE alone")
    harness.emit(result, args.json)
    return result


if __name__ == "__main__":
    main()

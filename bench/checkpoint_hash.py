"""Benchmark: what verifying checkpoints costs, against the save itself and against SHA-256.

    python bench/checkpoint_hash.py                     # SD 1.x size: UNet + EMA + AdamW state, 13.8 GB
    python bench/checkpoint_hash.py --scale 0.01        # the same files at 1% of the size (a quick check)

Writes the files of one SD 1.x training checkpoint the way ``sd.train.checkpoint.save`` does (fp32 UNet and
EMA as safetensors, the AdamW moments with ``torch.save``, each file fsynced), with tensors of the real
SD 1.x UNet shapes (859,520,964 parameters; ``--scale`` shrinks every tensor's first dimension), then
times ``sd.run_folder.describe_files`` (xxh3-128, files in parallel threads) on them, which is what a
save adds, and one SHA-256 pass over the same bytes (the hash other tools record for model files).
Right after the write the files are in the page cache, as they are when a save hashes them. Prints
seconds, GB/s, the ratio hash/save and sha256/xxh3, and one JSON line. Peak extra memory: the UNet's
tensors twice (the optimizer's two moments), 6.9 GB at full size. Needs about 14 GB free in --dir.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

import sd.cli
import sd.model
import sd.run_folder
import sd.train.checkpoint as ckpt


def unet_shapes(scale: float) -> dict[str, tuple[int, ...]]:
    """The SD 1.x UNet's parameter shapes (built on the meta device: no memory), scaled along dim 0."""
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel(**sd.model.UNET_PRESETS["sd1"])
    return {name: (max(1, round(p.shape[0] * scale)), *p.shape[1:]) for name, p in unet.named_parameters()}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(sd.run_folder.HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def main(argv=None) -> int:
    parser = sd.cli.ArgumentParser(description=__doc__)
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the SD 1.x size (default 1)")
    parser.add_argument("--dir", default=None, help="where to write the files (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="also write the result to this file")
    args = parser.parse_args(argv)
    if not 0 < args.scale <= 1:
        parser.error(f"--scale must be in (0, 1], got {args.scale}")
    generator = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(shape, generator=generator) for name, shape in unet_shapes(args.scale).items()}
    params = sum(t.numel() for t in weights.values())
    folder = Path(tempfile.mkdtemp(prefix="ckpt_hash_", dir=args.dir))
    try:
        paths = [folder / "unet.safetensors", folder / "ema.safetensors", folder / "optimizer.pt"]
        saves = []
        for path in paths[:2]:
            saves.append(timed(lambda: (ckpt.save_weights(weights, path), fsync(path)))[1])
        moments = {i: {"exp_avg": t, "exp_avg_sq": t.clone()} for i, t in enumerate(weights.values())}
        saves.append(timed(lambda: (ckpt.save_torch({"state": moments}, paths[2]), fsync(paths[2])))[1])
        del moments
        size = sum(p.stat().st_size for p in paths)
        _, xxh = timed(lambda: sd.run_folder.describe_files(paths))
        _, sha = timed(lambda: [sha256_file(p) for p in paths])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    save = sum(saves)
    result = {"parameters": params, "bytes": size, "save_s": save, "xxh3_s": xxh, "sha256_s": sha,
              "hash_over_save": xxh / save, "sha256_over_xxh3": sha / xxh, "cpu_count": os.cpu_count()}
    print(f"{params:,} parameters; checkpoint files {size / 1e9:.2f} GB")
    print(f"save (write + fsync)   {save:7.2f} s  {size / save / 1e9:6.2f} GB/s")
    print(f"xxh3-128 manifest      {xxh:7.2f} s  {size / xxh / 1e9:6.2f} GB/s   hash/save = {xxh / save:.3f}")
    print(f"sha256 (one thread)    {sha:7.2f} s  {size / sha / 1e9:6.2f} GB/s   sha256/xxh3 = {sha / xxh:.1f}")
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result) + "\n")
    return 0


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


if __name__ == "__main__":
    sys.exit(main())

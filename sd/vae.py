"""Training a VAE on image shards (``train_vae.py``): the presets, the loss (L1 + MSE on pixels with
foreground weighting, a small KL term), the loop, held-out PSNR and the atomic save."""

from __future__ import annotations

import glob
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch

import sd.data.shards
import sd.files
import sd.model
import sd.runtime

log = logging.getLogger("train_vae")

# A small AutoencoderKL with SD's interface (factor 8, 4 latent channels) that trains on a CPU in minutes.
VAE_PRESETS = {
    "demo": dict(sd.model.TINY_VAE, block_out_channels=(16, 32, 64, 64), norm_num_groups=8),
    "tiny": sd.model.TINY_VAE,
    "sd1": sd.model.SD1_VAE,
}


class InputError(Exception):
    """A problem with the user's input that one line can explain (exit status 2)."""


def shard_paths(pattern: str) -> list[str]:
    """The shard files ``pattern`` names: a glob, or a folder meaning its ``*.tar``."""
    if Path(pattern).is_dir():
        pattern = str(Path(pattern) / "*.tar")
    paths = sorted(p for p in glob.glob(pattern) if Path(p).is_file())
    if not paths:
        raise InputError(f"--shards {pattern!r} matches no shard files (expected 'DIR/*.tar')")
    return paths


def load_images(pattern: str, resolution: int, max_images: int) -> torch.Tensor:
    """All usable images of the shards as uint8 ``(N, 3, R, R)``; bad ones are counted and skipped."""
    images, skipped = [], {}
    for path in shard_paths(pattern):
        samples, _ = sd.data.shards.read_shard(Path(path).read_bytes())
        for sample in samples:
            if sample.image is None:
                continue
            try:
                rgb = sd.data.shards.decode_image(sample.image, sample.image_ext)
            except sd.data.shards.ImageSkip as skip:
                skipped[skip.reason] = skipped.get(skip.reason, 0) + 1
                continue
            images.append(sd.data.shards.resize_center_crop(rgb, resolution))
            if max_images and len(images) >= max_images:
                break
        if max_images and len(images) >= max_images:
            break
    if skipped:
        log.warning("skipped images: %s", skipped)
    if not images:
        raise InputError(f"--shards {pattern!r}: no usable images in {len(shard_paths(pattern))} shard file(s)")
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()


def to_pixels(batch: torch.Tensor, device) -> torch.Tensor:
    return batch.to(device).float() / 127.5 - 1.0


def foreground_weights(pixels: torch.Tensor, weight: float) -> torch.Tensor:
    """``weight`` where a pixel differs from the median colour of its image's border, 1 elsewhere."""
    if weight == 1.0:
        return torch.ones_like(pixels[:, :1])
    border = torch.cat([pixels[:, :, 0], pixels[:, :, -1], pixels[:, :, :, 0], pixels[:, :, :, -1]], dim=2)
    background = border.median(dim=2).values[:, :, None, None]  # (B, 3, 1, 1)
    differs = (pixels - background).abs().amax(dim=1, keepdim=True) > 0.1
    return 1.0 + (weight - 1.0) * differs.float()


def vae_loss(vae, pixels: torch.Tensor, args, generator: torch.Generator):
    posterior = vae.encode(pixels).latent_dist
    noise = torch.randn(posterior.mean.shape, generator=generator, device=generator.device).to(posterior.mean.device)
    latents = posterior.mean + posterior.std * noise
    recon = vae.decode(latents).sample.float()
    weights = foreground_weights(pixels, args.foreground_weight)
    error = recon - pixels
    reconstruction = ((error.abs() + error.square()) * weights).mean()
    kl = posterior.kl().mean() / pixels[0].numel()
    return reconstruction + args.kl_weight * kl, reconstruction


def build_vae(args):
    from diffusers import AutoencoderKL

    if args.init_from:
        vae = sd.model.load_vae(args.init_from)
        vae.requires_grad_(True)
        return vae
    with sd.model._seeded(args.seed):
        vae = AutoencoderKL(**VAE_PRESETS[args.preset])
    latent = vae.config.latent_channels
    with torch.no_grad():  # quant_conv emits (mean, logvar): start the log-variance low
        vae.quant_conv.bias[latent:].fill_(args.initial_logvar)
    return vae


@torch.no_grad()
def evaluate(vae, images: torch.Tensor, device, batch_size: int) -> tuple[float, float]:
    """Held-out PSNR (dB) of mean reconstructions, and the std of the latent means."""
    vae.eval()
    squared, count, latents = 0.0, 0, []
    for start in range(0, len(images), batch_size):
        pixels = to_pixels(images[start : start + batch_size], device)
        mean = vae.encode(pixels).latent_dist.mean
        recon = vae.decode(mean).sample.clamp(-1, 1)
        squared += ((recon - pixels) / 2).square().sum().item()  # in [0, 1] units
        count += pixels.numel()
        latents.append(mean.float().cpu())
    vae.train()
    return 10 * math.log10(1.0 / (squared / count)), torch.cat(latents).std().item()


def save(vae, out: Path, stats: dict) -> None:
    """``out`` as a diffusers folder with ``vae_stats.json``, swapped in whole (sd.files)."""
    def write(staging: Path) -> None:
        vae.save_pretrained(str(staging), safe_serialization=True)
        sd.files.write_json_atomic(staging / "vae_stats.json", stats)

    sd.files.write_folder_atomic(out, write)


def lr_factor(step: int, warmup_steps: int, max_steps: int) -> float:
    """Linear warm-up times a cosine decay to 0 over ``max_steps``."""
    warmup = min(1.0, (step + 1) / max(1, warmup_steps))
    return warmup * 0.5 * (1 + math.cos(math.pi * min(1.0, step / max_steps)))


def train(vae, train_images: torch.Tensor, args, device) -> None:
    """``args.max_steps`` AdamW steps on random, randomly flipped batches (all draws seeded)."""
    from tqdm.auto import tqdm

    optimizer = torch.optim.AdamW(vae.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, args.warmup_steps, args.max_steps))
    generator = torch.Generator(device=device).manual_seed(args.seed)
    order = torch.Generator().manual_seed(args.seed)
    bar = tqdm(range(args.max_steps), desc="vae", unit="step")
    for step in bar:
        batch = train_images[torch.randint(0, len(train_images), (args.batch_size,), generator=order)]
        flip = torch.rand(args.batch_size, generator=order) < 0.5
        batch = torch.where(flip[:, None, None, None], batch.flip(-1), batch)
        with sd.runtime.autocast(args.precision, device):
            loss, reconstruction = vae_loss(vae, to_pixels(batch, device), args, generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{reconstruction.item():.4f}")


def fit(args, device: torch.device) -> dict:
    """``train_vae.py``: load the shards' images (some held out), train, measure the held-out PSNR and
    the latents' scale, save to ``args.out``; returns the stats saved beside the weights."""
    images = load_images(args.shards, args.resolution, args.max_images)
    holdout = images[: args.holdout]
    train_images = images[args.holdout:] if len(images) > args.holdout else images
    vae = build_vae(args).to(device).train()
    log.info("%d training images, %d held out, %s on %s", len(train_images), len(holdout), args.precision, device)
    start = time.perf_counter()
    psnr_start, _ = evaluate(vae, holdout, device, args.batch_size * 4)
    train(vae, train_images, args, device)
    psnr, latent_std = evaluate(vae, holdout, device, args.batch_size * 4)
    vae.register_to_config(scaling_factor=1.0 / latent_std)
    stats = {"psnr_db": round(psnr, 2), "psnr_db_start": round(psnr_start, 2), "latent_std": latent_std,
             "scaling_factor": 1.0 / latent_std, "steps": args.max_steps,
             "seconds": round(time.perf_counter() - start, 1), "images": len(train_images)}
    save(vae.to("cpu", torch.float32), Path(args.out), stats)
    log.info("held-out PSNR %.2f dB (%.2f dB before training), scaling factor %.4f; saved %s",
             stats["psnr_db"], stats["psnr_db_start"], stats["scaling_factor"], args.out)
    return stats

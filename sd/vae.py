"""Training a VAE on image shards (``train_vae.py``): the presets, the loss (L1 + MSE on pixels with
foreground weighting, a small KL term), the loop, held-out PSNR and the atomic save."""

from __future__ import annotations

import glob
import logging
import math
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import torch

import sd.cli
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


class ResumeMismatch(InputError):
    """The saved training state was made with other settings than this run's."""


class Stopped(Exception):
    """Training stopped early (Ctrl-C, or ``--stop_at_step``) with its state saved; ``code``: exit status."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


# The settings a saved state must share with the run that resumes it: they fix the data, the model
# and every draw.
RESUME_FIXED = ("preset", "init_from", "resolution", "max_steps", "batch_size", "lr", "warmup_steps", "kl_weight",
                "foreground_weight", "initial_logvar", "precision", "holdout", "max_images", "seed")


def resume_path(out: Path) -> Path:
    """Where the training state of a VAE headed for ``out`` is kept until the VAE is saved."""
    return Path(out).with_name(Path(out).name + ".resume") / "state.pt"


def save_state(path: Path, step: int, vae, optimizer, schedule, generator, order, args, images: list[str]) -> None:
    state = {"step": step, "vae": vae.state_dict(), "optimizer": optimizer.state_dict(),
             "schedule": schedule.state_dict(), "noise_rng": generator.get_state(), "order_rng": order.get_state(),
             "settings": {name: getattr(args, name) for name in RESUME_FIXED}, "shards": images}
    sd.files.write_atomic(path, lambda tmp: torch.save(state, tmp))


def load_state(path: Path, args, images: list[str]) -> dict | None:
    """The saved state for this run, or None without one (or with a damaged one, named in the log and
    set aside: training starts over); other settings are a ResumeMismatch."""
    if not path.exists():
        return None
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
        saved = state["settings"]
    except Exception as error:  # truncated, overwritten, not ours: torch and pickle raise many kinds
        damaged = path.with_name(path.name + ".damaged")
        path.replace(damaged)
        log.warning("%s is damaged (%s): moved to %s, training starts over", path, sd.cli.first_line(error), damaged)
        return None
    changed = [f"{name} {saved.get(name)!r}, not {getattr(args, name)!r}" for name in RESUME_FIXED
               if saved.get(name) != getattr(args, name)]
    if state["shards"] != images:
        changed.append(f"shards: {len(state['shards'])} files, not these {len(images)}"
                       if len(state["shards"]) != len(images) else "other shard files")
    if changed:
        raise ResumeMismatch(f"{path} was saved with {'; '.join(changed)}; restore them, or delete "
                             f"{path.parent} to start over")
    return state


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


def train(vae, train_images: torch.Tensor, args, device, state_path: Path, shards: list[str]) -> None:
    """``args.max_steps`` AdamW steps on random, randomly flipped batches (all draws seeded). The state
    is saved to ``state_path`` every ``args.save_steps`` steps (and at ``--stop_at_step``), and a saved
    one is resumed from: the steps after it are the ones an uninterrupted run takes, bit for bit."""
    from tqdm.auto import tqdm

    optimizer = torch.optim.AdamW(vae.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, args.warmup_steps, args.max_steps))
    generator = torch.Generator(device=device).manual_seed(args.seed)
    order = torch.Generator().manual_seed(args.seed)
    start = 0
    state = load_state(state_path, args, shards)
    if state is not None:
        vae.load_state_dict(state["vae"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        generator.set_state(state["noise_rng"])
        order.set_state(state["order_rng"])
        start = state["step"]
        log.info("resumed from %s at step %d of %d", state_path, start, args.max_steps)

    def save(step: int) -> None:
        save_state(state_path, step, vae, optimizer, schedule, generator, order, args, shards)

    bar = tqdm(range(start, args.max_steps), desc="vae", unit="step", initial=start, total=args.max_steps)
    stopper = sd.runtime.StopSignal()  # Ctrl-C or SIGTERM: the step under way finishes, then the state is saved
    try:
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
            done = step + 1
            if stopper.requested() and done < args.max_steps:
                save(done)
                bar.close()
                what = "Ctrl-C" if stopper.signum == signal.SIGINT else signal.Signals(stopper.signum).name
                raise Stopped(f"stopped by {what} after step {done} of {args.max_steps}; state saved to {state_path}, "
                              "run the same command to resume", 128 + stopper.signum)
            if done == args.stop_at_step:
                save(done)
                raise Stopped(f"stopped after step {done} (--stop_at_step); state saved to {state_path}, "
                              "run the same command to resume", 0)
            if done % args.save_steps == 0 or done == args.max_steps:  # the last too: Ctrl-C while the
                save(done)  # VAE is measured and saved costs no step
    finally:
        stopper.restore()
        bar.close()


def fit(args, device: torch.device) -> dict:
    """``train_vae.py``: load the shards' images (some held out), train, measure the held-out PSNR and
    the latents' scale, save to ``args.out``; returns the stats saved beside the weights."""
    images = load_images(args.shards, args.resolution, args.max_images)
    state_path = resume_path(Path(args.out))
    held = min(args.holdout, len(images) // 4)  # a few images: a quarter of them at most
    holdout, train_images = images[:held], images[held:]
    measured = holdout if held else train_images
    vae = build_vae(args).to(device).train()
    log.info("%d training images, %d held out, %s on %s", len(train_images), held, args.precision, device)
    if not held:
        log.warning("only %d images: none held out, so the PSNR below is measured on the training images",
                    len(images))
    start = time.perf_counter()
    psnr_start, _ = evaluate(vae, measured, device, args.batch_size * 4)
    train(vae, train_images, args, device, state_path, [Path(p).name for p in shard_paths(args.shards)])
    psnr, latent_std = evaluate(vae, measured, device, args.batch_size * 4)
    vae.register_to_config(scaling_factor=1.0 / latent_std)
    stats = {"psnr_db": round(psnr, 2), "psnr_db_start": round(psnr_start, 2), "latent_std": latent_std,
             "scaling_factor": 1.0 / latent_std, "steps": args.max_steps,
             "seconds": round(time.perf_counter() - start, 1), "images": len(train_images), "held_out": held}
    save(sd.model.moved(vae, "cpu", torch.float32), Path(args.out), stats)
    shutil.rmtree(state_path.parent, ignore_errors=True)  # the VAE is saved: nothing left to resume
    log.info("%s PSNR %.2f dB (%.2f dB before training), scaling factor %.4f; saved %s",
             "held-out" if held else "training-set", stats["psnr_db"], stats["psnr_db_start"],
             stats["scaling_factor"], args.out)
    return stats

"""Train (or fine-tune) a VAE on image shards, for styles a stock VAE renders poorly.

    python train_vae.py --shards 'DIR/*.tar' --out VAE_DIR [--preset demo] [--resolution 64] [--max_steps 900]
                        [--batch_size 16] [--lr 4e-3] [--kl_weight 1e-6] [--foreground_weight 5] [--precision auto|bf16|fp32]
    python train_vae.py --shards 'DIR/*.tar' --out VAE_DIR --init_from stabilityai/sd-vae-ft-mse --resolution 512 --lr 1e-5

A diffusers ``AutoencoderKL`` learns to reconstruct the images (L1 + MSE on pixels in [-1, 1]) with a
small KL term towards a unit Gaussian. Pixels that differ from the image's border colour can weigh
more (``--foreground_weight``): on sparse images (logos, shapes, line art) the background would
otherwise dominate the loss and colours wash out. The result is a diffusers folder (``save_pretrained``)
whose ``scaling_factor`` is measured as 1 / std of the latents, so the UNet trains on unit variance.
It is written under a temporary name and renamed; ``vae_stats.json`` in it records the held-out PSNR
before and after training. ``--max_steps`` was ``--steps`` (still accepted): ``--steps`` is the sampler's.
"""

from __future__ import annotations

import argparse
import signal
import logging
import sys
from pathlib import Path

import torch

import sd.cli
import sd.data.shards
import sd.files
import sd.model
import sd.runtime
import sd.vae

log = logging.getLogger("train_vae")  # sd.vae's logger

def parse_args(argv=None):
    parser = sd.cli.ArgumentParser(prog="train_vae.py", description=__doc__)
    parser.add_argument("--shards", "--input", dest="shards", required=True,
                        help="glob of image shards, quoted: 'DIR/*.tar' (or the folder; --input: the data "
                        "stages' spelling)")
    parser.add_argument("--out", required=True, help="output diffusers VAE folder")
    parser.add_argument("--preset", choices=sorted(sd.vae.VAE_PRESETS), default="demo", help="architecture of a new VAE")
    parser.add_argument("--init_from", help="fine-tune this VAE (hub id, folder, or a single file: a whole checkpoint's VAE or a "
                        "VAE-only file) instead of a new one")
    parser.add_argument("--resolution", type=int, default=64, help="training size, multiple of 8")
    parser.add_argument("--max_steps", type=int, default=900, help="optimizer steps")
    parser.add_alias("--steps", "max_steps", type=int)
    parser.add_argument("--batch_size", type=int, default=16, help="images per optimizer step")
    parser.add_argument("--lr", type=float, default=4e-3, help="peak AdamW learning rate, cosine decay")
    parser.add_argument("--warmup_steps", type=int, default=50, help="linear warm-up")
    parser.add_argument("--kl_weight", type=float, default=1e-6, help="weight of the KL term")
    parser.add_argument("--foreground_weight", type=float, default=5.0,
                        help="loss weight of pixels unlike the image's border colour; 1 = uniform")
    parser.add_argument("--initial_logvar", type=float, default=-6.0,
                        help="initial posterior log-variance of a new VAE: low, so early samples are near the mean")
    # fp16 would need a GradScaler; bf16 autocast trains this VAE as well as fp32 does.
    parser.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                        help="autocast dtype; auto = bf16 on CUDA, fp32 elsewhere (bf16 autocast on a CPU without "
                             "native bf16, e.g. AVX2 only, measured 15x slower than fp32)")
    parser.add_argument("--holdout", type=int, default=64, help="images kept out of training for the PSNR (at most a "
                        "quarter of them; with fewer than 4 images none, and the PSNR is of the training images)")
    parser.add_argument("--max_images", type=int, default=0, help="use at most this many images; 0 = all")
    parser.add_argument("--seed", type=int, default=0, help="seed of the init, batch order, flips and noise")
    parser.add_argument("--save_steps", type=int, default=100,
                        help="save the training state to OUT.resume every N steps, at the last step and at Ctrl-C or "
                        "SIGTERM (after the step under way); the same command resumes from it exactly; removed when "
                        "the VAE is saved (default: %(default)s)")
    parser.add_argument("--stop_at_step", type=int, default=0, help="save the state after this step and exit, as an "
                        "interruption would; 0 = off")
    parser.add_argument("--device", default="auto", help="auto (CUDA, then MPS, then CPU), cpu, cuda or mps")
    args = parser.parse_args(argv)
    if args.resolution % 8 or args.resolution <= 0:
        parser.error("--resolution must be a positive multiple of 8")
    for name in ("max_steps", "batch_size", "save_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.holdout < 1 or args.max_images < 0 or args.warmup_steps < 0 or args.stop_at_step < 0:
        parser.error("--holdout must be >= 1, --max_images, --warmup_steps and --stop_at_step >= 0")
    return args


def main(argv=None) -> int:
    sd.runtime.start_process()
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    device = sd.runtime.pick_device(args.device)
    if args.precision == "auto":
        args = argparse.Namespace(**{**vars(args), "precision": "bf16" if device.type == "cuda" else "fp32"})
    torch.manual_seed(args.seed)
    try:
        with sd.runtime.interrupting_signals():
            sd.vae.fit(args, device)
    except (sd.vae.InputError, sd.vae.ResumeMismatch, sd.model.LoadError) as error:
        print(f"train_vae.py: error: {error}", file=sys.stderr)
        return 2
    except sd.vae.Stopped as stop:
        print(f"train_vae.py: {stop}", file=sys.stderr)
        return stop.code
    except KeyboardInterrupt as error:  # outside a step: loading the images, measuring or saving the VAE
        signum = getattr(error, "signum", signal.SIGINT)
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        state = sd.vae.resume_path(Path(args.out))
        kept = (f"the state saved in {state} is kept: the same command resumes from it" if state.exists()
                else "no training state was saved yet")
        print(f"train_vae.py: interrupted ({what}) outside a training step; {kept}", file=sys.stderr)
        return 128 + signum
    return 0


if __name__ == "__main__":
    sys.exit(main())

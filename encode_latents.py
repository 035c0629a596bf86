"""Encode webdataset image shards into fp16 VAE latents, keeping the accelerator busy.

    python encode_latents.py --shards 'DIR/*.tar' --out DIR --vae ID_OR_PATH [--resolution 512]
                             [--batch_size 64] [--workers 16] [--precision bf16] [--compile] [--device auto]
                             [--buckets [--bucket_list WxH,...] [--bucket_step 64]] [--flip]
                             [--max_encode_pixels 4194304] [--control NAME[,NAME]] [--pairs]
    torchrun --nproc_per_node 8 encode_latents.py --shards ... --out ...           # one process per GPU
    python encode_latents.py ... --rank $SLURM_ARRAY_TASK_ID --world_size $SLURM_ARRAY_TASK_COUNT

Four stages overlap and stream: a reader thread reads the tars a sample at a time, up to --prefetch
samples ahead (never a whole shard in memory); a pool of threads decodes (OpenCV), cuts out the
centre square (or, with --buckets, the image's aspect-ratio bucket) and scales it, a bounded number
of images ahead of the VAE whatever the shard size; batches are assembled in pinned memory and copied
to the device without blocking; the VAE encodes while a writer thread moves finished latents to the
host and appends them to the shard's output file.

Per input shard NNNNN.tar the output folder gets NNNNN.npy (float16, (N, 4, H/8, W/8), the posterior
mean, unscaled), NNNNN.report.json (what was skipped and why) and NNNNN.keys.txt, written last as
the shard's done marker; --flip adds NNNNN.flip.npy with the latents of the mirrored images (the
trainer reads them with ``flip: true``). With --buckets (``sd.data.buckets``: sizes of about
--resolution squared pixels, each image in the one nearest its aspect ratio, scaled to cover it and
cropped minimally) a shard gets one NNNNN.WxH.npy (and NNNNN.WxH.flip.npy) per bucket it fills, and
NNNNN.buckets.json before its keys file: the buckets in the order of the keys (grouped by bucket),
each with its size, latent shape and count, and per key its original size and crop offset.
A sample with a loss mask (``key.mask.png``, from pipeline/01e_import_folder.py) has it cut and
scaled as its image and reduced to latent resolution (each 8x8 pixel block's mean weight, 0..1):
NNNNN.mask.npy (float16, (N, 1, H/8, W/8); per bucket NNNNN.WxH.mask.npy) beside the latents, only
for a shard (or bucket) with at least one mask, weight 1 for its samples without one; the mirrored
latents use the mirrored mask, which the trainer flips itself.
--control NAME stores each sample's conditioning image ``key.NAME.png`` (a ControlNet's input: edges, a
mask, depth; pipeline/03b_derive_control.py and 01e make them) cut and scaled exactly as its image, at
pixel resolution, losslessly: NNNNN.NAME.pngs (each row's PNG, concatenated; per bucket NNNNN.WxH.NAME.pngs)
and NNNNN.NAME.offsets.npy (where each row's begins). A sample without it is skipped (``no_control``). The
mirrored latents' conditioning images are these mirrored, by the trainer.
--pairs encodes preference pairs (pipeline/01f_import_pairs.py, 01g_draw_pairs.py): each sample's image is
the preferred one and ``key.rejected.<ext>`` the rejected one, brought to the preferred image's size and cut and
scaled as it was (one bucket, one crop), into NNNNN.rejected.npy (per bucket NNNNN.WxH.rejected.npy) row for row
beside the latents. A sample without it is skipped (``no_rejected``), one of another aspect ratio too
(``rejected_mismatch``).
latents.json holds the settings (VAE id, scaling factor, resolution, latent shape or bucket list,
dtype, flip) and the totals (``masked``: the samples with a mask). It is written first, with ``"complete": false``, before any shard is
encoded, and again
with ``"complete": true`` once every input shard has been through (the trainer refuses a folder that
is not complete). A re-run compares its settings with it before any work: a mismatch stops with exit
2 and writes nothing. A re-run encodes only the shards not done; bad samples are skipped, counted and
named, never fatal; a shard that gives no latent at all (an empty or unreadable tar, no usable
sample) is named under ``failed_shards`` and tried again by the next run. ``--dtype`` is the old
spelling of ``--precision`` and still works.

Several processes (torchrun's ranks, or --rank/--world_size) share one folder and nothing else: shard
i of the sorted list is rank i % world_size's; each rank encodes its own on its device (cuda:LOCAL_RANK)
and the rank that finds every input shard through when it finishes writes the totals. No process
waits for another, so a slow or crashed rank holds nobody up; re-running a crashed rank's command
(or any rank's) encodes what it left and completes latents.json.
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import sys
from pathlib import Path

import sd.cli
import sd.data.buckets
import sd.data.encode
import sd.data.shards
import sd.model
import sd.runtime

log = logging.getLogger("encode_latents")
PRECISION_CHOICES = ("auto", *sd.runtime.PRECISIONS)


def parse_args(argv=None):
    parser = sd.cli.ArgumentParser(prog="encode_latents.py", description=__doc__)
    parser.add_argument("--shards", "--input", dest="shards", required=True,
                        help="glob of input tars, quoted: 'DIR/*.tar' (--input: the data stages' spelling)")
    parser.add_argument("--out", required=True, help="output folder for the latent shards and latents.json")
    parser.add_argument("--vae", default=sd.model.DEFAULT_VAE,
                        help="VAE hub id, local folder (a diffusers pipeline folder works) or 'tiny'")
    parser.add_argument("--resolution", type=int, default=512,
                        help="square output size in pixels; must be a multiple of 8")
    parser.add_bool("--buckets", help="aspect-ratio buckets: each image goes to the size of about --resolution "
                    "squared pixels nearest its aspect ratio (--bucket_step px steps, sides from half to twice "
                    "--resolution), is scaled to cover it and cropped minimally, instead of its centre square; "
                    "per shard one NNNNN.WxH.npy per bucket and NNNNN.buckets.json (SD_Train.py detects them)")
    parser.add_argument("--bucket_list", default=None, metavar="WxH,...",
                        help="with --buckets (implies it): the bucket sizes instead of the default list, e.g. "
                             "512x512,576x448,448x576; sides multiples of 8 (of 64 for the SD 1.x UNet)")
    parser.add_argument("--bucket_step", type=int, default=64,
                        help="side step of the default bucket list in pixels (64 for SD 1.x), a multiple of 8")
    parser.add_argument("--batch_size", type=int, default=64, help="images per VAE call")
    parser.add_argument("--workers", type=int, default=16, help="decode threads")
    parser.add_argument("--precision", choices=PRECISION_CHOICES, default="auto",
                        help="VAE compute precision; auto = bf16 on CUDA, fp16 on MPS, fp32 on the CPU. "
                             "The latents are always stored as fp16")
    parser.add_alias("--dtype", "precision", choices=PRECISION_CHOICES)
    parser.add_bool("--compile", help="torch.compile the VAE encoder")
    parser.add_argument("--device", default="auto", help="auto (CUDA, then MPS, then the CPU), cpu, cuda or cuda:N")
    parser.add_bool("--flip", help="also store the latents of the horizontally flipped images (NNNNN.flip.npy; "
                    "SD_Train.py --flip trains on them for a random half of the samples)")
    parser.add_argument("--max_pixels", type=int, default=sd.data.shards.DEFAULT_MAX_PIXELS,
                        help="skip images with more pixels than this, read from the header")
    parser.add_argument("--max_encode_pixels", type=int, default=sd.data.encode.MAX_ENCODE_PIXELS,
                        help="largest image size the VAE is given, in pixels (--resolution squared, or a bucket's "
                             "width x height; the default is 2048x2048): a larger one stops the run before any work")
    parser.add_argument("--max_aspect", type=float, default=sd.data.shards.DEFAULT_MAX_ASPECT,
                        help="skip images whose long side is more than this many times the short side "
                             "(extreme_aspect), read from the header")
    parser.add_argument("--prefetch", type=int, default=256,
                        help="samples read from the tars ahead of the decode threads (their compressed bytes "
                             "are held; whole shards never are)")
    parser.add_argument("--rank", type=int, default=None,
                        help="this process's place among --world_size processes started without torchrun "
                             "(a SLURM array: $SLURM_ARRAY_TASK_ID); under torchrun it comes from RANK")
    parser.add_argument("--world_size", type=int, default=None,
                        help="how many processes share the shards (shard i of the sorted list goes to rank "
                             "i %% world_size); under torchrun it comes from WORLD_SIZE")
    parser.add_argument("--control", default=(), type=control_names, metavar="NAME[,NAME]",
                        help="also store each sample's conditioning images key.NAME.png (ControlNet training), cut "
                             "and scaled as its image; a sample without one is skipped")
    parser.add_bool("--pairs", help="preference pairs (pipeline/01f_import_pairs.py, 01g_draw_pairs.py): also encode "
                    "each sample's rejected image key.rejected.<ext>, cut and scaled as its preferred image, into "
                    "NNNNN.rejected.npy (SD_Train.py --preference.method dpo trains on them); a sample without one "
                    "is skipped")
    args = parser.parse_args(argv)
    if args.pairs and args.flip:
        parser.error("--pairs takes no --flip: a pair's latents are trained unmirrored")
    for name in args.control:
        if not sd.data.shards.is_control_name(name):
            parser.error(f"--control {name!r}: a conditioning image's name is lower-case letters, digits and _ "
                         "(key.NAME.png; not mask, the loss mask's)")
    if args.resolution <= 0 or args.resolution % 8:
        parser.error(f"--resolution must be a positive multiple of 8, got {args.resolution}")
    for name in ("batch_size", "workers", "prefetch", "max_pixels", "max_encode_pixels", "max_aspect"):
        if not getattr(args, name) >= 1:
            parser.error(f"--{name} must be >= 1")
    check_ranks(parser, args)
    args = argparse.Namespace(**vars(args), bucket_sizes=bucket_sizes(parser, args))
    check_encode_sizes(parser, args)
    return args


def control_names(text: str) -> tuple[str, ...]:
    """``--control NAME[,NAME]`` as a tuple of names."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def bucket_sizes(parser, args) -> list[sd.data.buckets.Bucket] | None:
    """The bucket list of ``--buckets`` / ``--bucket_list``, or None for square centre crops."""
    if args.bucket_step <= 0 or args.bucket_step % 8:
        parser.error(f"--bucket_step must be a positive multiple of 8, got {args.bucket_step}")
    try:
        if args.bucket_list is not None:
            return sd.data.buckets.parse_bucket_list(args.bucket_list)
        return sd.data.buckets.default_buckets(args.resolution, args.bucket_step) if args.buckets else None
    except ValueError as error:
        parser.error(f"--bucket_list: {error}" if args.bucket_list is not None else str(error))


def check_encode_sizes(parser, args) -> None:
    """Every size images are encoded at within --max_encode_pixels, before anything is written: an image
    of a 16384x8192 bucket takes 403 MB of host memory, and a batch of them fails part way through."""
    sizes = args.bucket_sizes or [(args.resolution, args.resolution)]
    for width, height in sizes:
        if width * height > args.max_encode_pixels:
            what = f"bucket {width}x{height}" if args.bucket_sizes else f"--resolution {args.resolution}"
            parser.error(f"{what} has {width * height} pixels, over --max_encode_pixels {args.max_encode_pixels} "
                         f"(an image of it takes {width * height * 3 / 1e6:.0f} MB, a batch --batch_size times "
                         "that); choose smaller sizes, or raise --max_encode_pixels if the memory is there")


def check_ranks(parser, args) -> None:
    if (args.rank is None) != (args.world_size is None):
        parser.error("--rank and --world_size go together: give both or neither")
    if args.rank is None:
        return
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        parser.error("--rank and --world_size are for launchers without torchrun; under torchrun "
                     "(WORLD_SIZE is set) leave them out")
    if not (args.world_size >= 1 and 0 <= args.rank < args.world_size):
        parser.error(f"--rank must be in 0..{args.world_size - 1} (--world_size {args.world_size}), got {args.rank}")


def main(argv=None) -> int:
    sd.runtime.start_process()
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    paths = sorted(Path(p) for p in glob.glob(args.shards))
    if not paths:
        print(f"encode_latents.py: no shards match {args.shards!r}", file=sys.stderr)
        return 2
    stems = [p.name for p in paths]
    if len(set(stems)) != len(stems):
        print("encode_latents.py: two input shards share a file name; their outputs would collide", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"encode_latents.py: error: --out {out} is a file, not a folder", file=sys.stderr)
        return 2
    try:
        return sd.data.encode.encode(paths, out, args)
    except sd.model.LoadError as error:
        print(f"encode_latents.py: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

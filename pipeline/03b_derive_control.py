"""Stage 03b: image shards -> the same shards with a conditioning image (a ControlNet's input) per sample.

    python pipeline/03b_derive_control.py --input 'SHARD_DIR/*.tar' --out DIR --kind canny [--low 100 --high 200]
        [--name canny] [--workers 8]

For each input shard NNNNN.tar, writes DIR/NNNNN.tar holding its samples (image, caption, metadata, loss
mask and conditioning images already there, as they were) each with ``key.NAME.png`` added (NAME is
``--name``, by default the kind; one already there is replaced), then DIR/NNNNN_stats.json as the shard's
done marker, and 03b_derive_control_summary.json at the end. ``encode_latents.py --control NAME`` reads
them, cut and scaled as their images. The first ``--examples`` conditioning images of the first shard are
also written as files, ``DIR/examples/NN.NAME.png`` with the sample's caption in ``NN.txt``: a control
image for ``SD_ImageGen.py --control`` and a training run's ``validation_controls``.

Kinds:
* ``canny``: the image's edges by OpenCV's Canny detector (``cv2.Canny`` on the image in grey, 3x3 Sobel,
  hysteresis thresholds ``--low`` and ``--high`` on the L1 gradient), white edges on black at the image's
  size: the conditioning images of a Canny ControlNet. Edges are found at the shard's size, the size
  training sees, so they stay one pixel wide.

Samples that cannot get one are left out and counted by reason, their keys named in the stats: an image
that does not decode (``undecodable``, ``truncated_image``, ``too_large``...), no image (``no_image``),
no caption (``no_caption``), a bad or repeated key, a caption that is not UTF-8 (as encode_latents.py
skips them); a tar cut off ends its shard there (``truncated_tar``) and one that cannot be read at all
is named under ``failed_shards`` in the summary and tried again by the next run. Members of other
kinds than those above (no stage of this pipeline writes any) are not carried.

Work streams sample by sample: a reader, ``--workers`` threads decoding and detecting, and the writer of
the output tar, with at most 2 x --workers samples between them, so memory does not grow with the
shard. A re-run skips the shards whose stats file exists; one with other --kind, --name or thresholds
into the same --out is refused. ``--shards`` (encode_latents.py's spelling) works as well as ``--input``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tarfile
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

import sd.data.shards
import sd.data.stages
import sd.files
import sd.runtime

STAGE = "03b_derive_control"
KINDS = ("canny",)
log = logging.getLogger(STAGE)


def parse_args(argv):
    parser = sd.data.stages.StageArgumentParser(__file__, __doc__)
    parser.add_input("glob of image shards, quoted: 'SHARD_DIR/*.tar'", old=("--shards",))
    parser.add_out("output folder for the NNNNN.tar shards with their conditioning images (not the input folder)")
    parser.add_argument("--kind", choices=KINDS, required=True,
                        help="what to derive: canny = OpenCV Canny edges of the image in grey (required)")
    parser.add_argument("--name", default=None,
                        help="the conditioning images' name, key.NAME.png (encode_latents.py --control NAME): "
                             "lower-case letters, digits and _ (default: the kind)")
    parser.add_argument("--low", type=float, default=100.0,
                        help="canny: the lower hysteresis threshold on the gradient; weaker edges are dropped, "
                             "those between --low and --high kept where they join a strong one (default: %(default)s)")
    parser.add_argument("--high", type=float, default=200.0,
                        help="canny: the upper hysteresis threshold; a gradient above it is an edge "
                             "(default: %(default)s)")
    parser.add_argument("--examples", type=int, default=8,
                        help="conditioning images of the first shard also written as files to OUT/examples/ "
                             "(NN.NAME.png and its caption NN.txt), for SD_ImageGen.py --control and "
                             "validation_controls; 0 = none (default: %(default)s)")
    parser.add_workers()
    args = parser.parse_args(argv)
    if args.examples < 0:
        parser.error("--examples must be >= 0")
    args = argparse.Namespace(**{**vars(args), "name": args.kind if args.name is None else args.name})
    if not sd.data.shards.is_control_name(args.name):
        parser.error(f"--name {args.name!r}: a conditioning image's name is lower-case letters, digits and _ "
                     "(and not mask, the loss mask's)")
    if not 0 <= args.low <= args.high:
        parser.error(f"--low and --high must satisfy 0 <= low <= high, got {args.low} and {args.high}")
    return args


# ---------------------------------------------------------------------------------------------
# One sample
# ---------------------------------------------------------------------------------------------


def canny_edges(rgb, low: float, high: float):
    """``(H, W)`` uint8: 255 on the Canny edges of ``rgb`` ``(H, W, 3)`` in grey, 0 elsewhere."""
    import cv2

    return cv2.Canny(cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY), low, high)


def derive(sample: sd.data.shards.ShardSample, args) -> tuple[sd.data.shards.ShardSample, str | None]:
    """``sample`` with its conditioning image ``args.name`` added, or with the reason it cannot have one."""
    if sample.problem is not None:  # a bad key, a caption that is not UTF-8, a member given twice
        return sample, sample.problem
    if sample.image is None:
        return sample, "no_image"
    if not sample.caption:
        return sample, "no_caption"
    try:
        rgb = sd.data.shards.decode_image(sample.image, sample.image_ext)
        sample.controls[args.name] = sd.data.shards.encode_png(canny_edges(rgb, args.low, args.high))
    except sd.data.shards.ImageSkip as skip:
        return sample, skip.reason
    except Exception:  # noqa: BLE001 - a decoder failing in a way of its own: one bad image, not a bad run
        return sample, "undecodable"
    return sample, None


# ---------------------------------------------------------------------------------------------
# One shard
# ---------------------------------------------------------------------------------------------


def derived_samples(reader, args, pool, window: int):
    """``(sample, skip reason or None)`` of each sample ``reader`` yields, in order, derived on ``pool``
    with at most ``window`` samples submitted and not yet handed on."""
    pending: deque = deque()
    for sample in reader:
        pending.append(pool.submit(derive, sample, args))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def derive_shard(path: Path, out: Path, args, pool, bar) -> dict:
    """Write ``out``/``path.name`` and its stats file; raises OSError or tarfile.ReadError (nothing written)
    when the tar cannot be read at all."""
    stats = sd.data.stages.ShardStats()
    with open(path, "rb") as file:
        reader = sd.data.shards.TarSamples(file, os.fstat(file.fileno()).st_size,
                                           max_member_bytes=sd.data.stages.MAX_MEMBER_BYTES)

        def kept():
            for sample, reason in derived_samples(reader, args, pool, 2 * args.workers):
                bar.update(1)
                if reason is None:
                    stats.successes += 1
                    yield sample
                else:
                    stats.skip(reason, sample.key)

        def write(tmp):
            sd.data.shards.write_tar(tmp, kept())
            if reader.truncated_key is not None:
                stats.skip("truncated_tar", reader.truncated_key)

        name = sd.data.stages.shard_stem(path)
        return sd.data.stages.write_output(out, name, write, stats, shard=str(path), kind=args.kind,
                                           control=args.name, low=args.low, high=args.high)


def write_examples(out: Path, first: str, name: str, count: int) -> list[Path]:
    """The first ``count`` conditioning images of output shard ``first`` as ``out/examples/NN.NAME.png`` and
    their captions ``NN.txt`` (written atomically; those there already are kept)."""
    folder, written = out / "examples", []
    path = sd.data.stages.output_paths(out, first)[0]
    if not count or not path.exists():
        return written
    with open(path, "rb") as file:
        reader = sd.data.shards.TarSamples(file, os.fstat(file.fileno()).st_size, fields=("caption", "control"),
                                           max_member_bytes=sd.data.stages.MAX_MEMBER_BYTES)
        for sample in reader:
            if len(written) == count:
                break
            if sample.problem is None and sample.controls.get(name):
                image, caption = folder / f"{len(written):02d}.{name}.png", folder / f"{len(written):02d}.txt"
                if not image.exists():
                    data = sample.controls[name]
                    sd.files.write_atomic(image, lambda tmp: Path(tmp).write_bytes(data))
                    sd.files.write_text_atomic(caption, (sample.caption or "") + "\n")
                written.append(image)
    return written


@sd.data.stages.ends_cleanly_on_a_full_disk(STAGE)
def main(argv=None) -> int:
    sd.runtime.start_process(uses_torch=False)
    args = parse_args(argv)
    sd.data.stages.setup_logging()
    try:
        by_stem = sd.data.stages.input_shards(args.input)
    except sd.data.stages.UsageError as error:
        print(f"{STAGE}.py: {error}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if any(path.parent.resolve() == out.resolve() for path in by_stem.values()):
        print(f"{STAGE}.py: --out {out} holds input shards; write to another folder", file=sys.stderr)
        return 2
    try:  # before any output: other settings than those the folder's finished shards were made with
        sd.data.stages.record_settings(out, STAGE, {"--kind": args.kind, "--name": args.name, "--low": args.low,
                                                    "--high": args.high})
    except sd.data.stages.SettingsChanged as error:
        print(f"{STAGE}.py: {error}", file=sys.stderr)
        return 2
    summary = sd.data.stages.Summary(STAGE)
    todo = summary.pending(out, list(by_stem))
    with ThreadPoolExecutor(args.workers, thread_name_prefix="derive") as pool, \
            tqdm(total=sd.data.stages.input_sample_count([by_stem[name] for name in todo]), unit="img", desc=f"{STAGE} {args.name}",
                 dynamic_ncols=True) as bar:
        for name in todo:
            try:
                summary.add(derive_shard(by_stem[name], out, args, pool, bar))
            except (OSError, tarfile.TarError, EOFError) as error:  # counted and named, tried again next run
                if sd.data.stages.disk_full(error):  # not the input's fault: the stage ends
                    raise
                summary.input_failed("unreadable_tar", by_stem[name].name, error)
    examples = write_examples(out, sorted(by_stem)[0], args.name, args.examples)
    summary.finish(out, kind=args.kind, name=args.name, low=args.low, high=args.high,
                   failed_shards=summary.failed_inputs, examples_folder=str(out / "examples") if examples else None)
    if examples:
        print(f"{STAGE}: {len(examples)} conditioning images as files in {out / 'examples'} ({examples[0].name} ...): "
              "for SD_ImageGen.py --control and validation_controls")
    return summary.exit_code()


if __name__ == "__main__":
    sys.exit(main())

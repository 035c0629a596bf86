"""Encode webdataset image shards into fp16 VAE latents, keeping the accelerator busy.

    python encode_latents.py --shards 'DIR/*.tar' --out DIR --vae ID_OR_PATH [--resolution 512]
                             [--batch_size 64] [--workers 16] [--precision bf16] [--compile] [--device auto]

Four stages overlap: a prefetch thread reads whole shards ahead and splits the tar in memory; a pool
of threads decodes (OpenCV), cuts out the centre square and scales it; batches are assembled in
pinned memory and copied to the device without blocking; the VAE encodes while a writer thread moves
finished latents to the host and saves each completed shard.

Per input shard NNNNN.tar the output folder gets NNNNN.npy (float16, (N, 4, H/8, W/8), the posterior
mean, unscaled), NNNNN.report.json (what was skipped and why) and NNNNN.keys.txt, written last as
the shard's done marker; --flip adds NNNNN.flip.npy with the latents of the mirrored images (the
trainer reads them with ``flip: true``). latents.json holds the settings (VAE id, scaling factor,
resolution, latent shape, dtype, flip) and the totals. It is written first, with ``"complete": false``, before any shard is encoded, and again
with ``"complete": true`` once every input shard has been through (the trainer refuses a folder that
is not complete). A re-run compares its settings with it before any work: a mismatch stops with exit
2 and writes nothing. A re-run encodes only the shards not done; bad samples are skipped, counted and
named, never fatal; a shard that gives no latent at all (an empty or unreadable tar, no usable
sample) is named under ``failed_shards`` and tried again by the next run. ``--dtype`` is the old
spelling of ``--precision`` and still works.
"""

from __future__ import annotations

import glob
import json
import logging
import queue
import sys
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import SD_Cli
import SD_Faults
import SD_Files
import SD_Model
import SD_Runtime
import SD_Shards

log = logging.getLogger("encode_latents")
PRECISION_CHOICES = ("auto", *SD_Runtime.PRECISIONS)


def parse_args(argv=None):
    parser = SD_Cli.ArgumentParser(prog="encode_latents.py", description=__doc__)
    parser.add_argument("--shards", required=True, help="glob of input tars, quoted: 'DIR/*.tar'")
    parser.add_argument("--out", required=True, help="output folder for the latent shards and latents.json")
    parser.add_argument("--vae", default=SD_Model.DEFAULT_VAE,
                        help="VAE hub id, local folder (a diffusers pipeline folder works) or 'tiny'")
    parser.add_argument("--resolution", type=int, default=512,
                        help="square output size in pixels; must be a multiple of 8")
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
    parser.add_argument("--max_pixels", type=int, default=SD_Shards.DEFAULT_MAX_PIXELS,
                        help="skip images with more pixels than this, read from the header")
    parser.add_argument("--max_aspect", type=float, default=SD_Shards.DEFAULT_MAX_ASPECT,
                        help="skip images whose long side is more than this many times the short side "
                             "(extreme_aspect), read from the header")
    parser.add_argument("--prefetch", type=int, default=2, help="shards read ahead of the encoder")
    args = parser.parse_args(argv)
    if args.resolution <= 0 or args.resolution % 8:
        parser.error(f"--resolution must be a positive multiple of 8, got {args.resolution}")
    for name in ("batch_size", "workers", "prefetch", "max_pixels", "max_aspect"):
        if not getattr(args, name) >= 1:
            parser.error(f"--{name} must be >= 1")
    return args


# ---------------------------------------------------------------------------------------------
# Shard bookkeeping
# ---------------------------------------------------------------------------------------------


@dataclass
class ShardJob:
    """One input shard on its way through the pipeline."""

    path: Path
    keys: list[str] = field(default_factory=list)  # encoded keys, in shard order
    skipped: dict[str, list[str]] = field(default_factory=dict)  # reason -> keys
    failed: str | None = None  # why the whole shard gave no latent (empty_tar, unreadable_tar, no_usable_sample)
    latents: np.ndarray | None = None  # (N, 4, h, w) float16, filled by the writer
    flipped: np.ndarray | None = None

    @property
    def stem(self) -> str:
        return self.path.name[: -len(".tar")] if self.path.name.endswith(".tar") else self.path.stem

    def skip(self, reason: str, key: str) -> None:
        self.skipped.setdefault(reason, []).append(key)


def outputs(out: Path, stem: str) -> dict[str, Path]:
    return {"npy": out / f"{stem}.npy", "flip": out / f"{stem}.flip.npy", "report": out / f"{stem}.report.json",
            "keys": out / f"{stem}.keys.txt"}


def shard_done(out: Path, stem: str, flip: bool) -> bool:
    files = outputs(out, stem)
    return files["keys"].exists() and files["npy"].exists() and (not flip or files["flip"].exists())


# What a re-run must share with the run that started a folder: anything else mixes latents that do not
# belong together (other shapes, another VAE's space, flipped or not) in one folder, silently.
SETTINGS = ("vae", "scaling_factor", "resolution", "latent_shape", "dtype", "flip")


class FolderMismatch(Exception):
    """The output folder holds another encoding, or a latents.json that cannot be read: exit 2, nothing written."""


def read_meta(out: Path) -> dict:
    """The folder's latents.json, or {} for a new folder."""
    path = out / "latents.json"
    if not path.exists():
        return {}
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:  # ValueError: bad JSON or bad UTF-8
        raise FolderMismatch(f"{path} is not readable JSON ({error}); remove the folder or write to another --out")
    if not isinstance(meta, dict):
        raise FolderMismatch(f"{path} is not a JSON object; remove the folder or write to another --out")
    return meta


def requested_settings(args) -> dict:
    """The settings known from the command line alone, checked before the VAE is loaded."""
    return {"vae": args.vae, "resolution": args.resolution, "dtype": "float16", "flip": bool(args.flip)}


def vae_settings(args, vae_config) -> dict:
    """Every setting in SETTINGS, once the VAE is loaded."""
    latent_shape = [int(vae_config.latent_channels), args.resolution // 8, args.resolution // 8]
    return {**requested_settings(args), "scaling_factor": float(vae_config.scaling_factor),
            "latent_shape": latent_shape}


def compare_settings(out: Path, previous: dict, settings: dict) -> None:
    for key in SETTINGS:
        if key in previous and key in settings and previous[key] != settings[key]:
            raise FolderMismatch(f"{out} was encoded with {key}={previous[key]!r} but this run asks for "
                                 f"{key}={settings[key]!r}; use the same settings or another --out")


def check_existing_shards(out: Path, settings: dict) -> None:
    """A folder without latents.json (an older version wrote it only at the end) is checked by its shards."""
    for keys_file in sorted(out.glob("*.keys.txt")):
        npy = out / keys_file.name.replace(".keys.txt", ".npy")
        try:
            shape = list(np.load(npy, mmap_mode="r").shape[1:])
        except (OSError, ValueError):
            continue  # unreadable: the trainer names it; the shape question is for the readable ones
        if shape != settings["latent_shape"]:
            raise FolderMismatch(f"{out} holds {npy.name} with latent_shape={shape} but this run asks for "
                                 f"latent_shape={settings['latent_shape']}; use the same settings or another --out")
        return


def read_report(path: Path) -> dict:
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(report, dict) and isinstance(report.get("skipped"), dict):
            return report
    except (OSError, ValueError):
        pass
    raise FolderMismatch(f"{path} is damaged; delete it and its shard's .keys.txt, then re-run to encode that shard again")


def write_summary(out: Path, meta: dict, complete: bool) -> dict:
    """latents.json: the settings, then totals over every shard report in the folder (so resumed runs add
    up). ``complete`` is False while a run is under way: the trainer refuses such a folder."""
    encoded, skipped, shards, failed = 0, Counter(), 0, {}
    for report_path in sorted(out.glob("*.report.json")):
        done = (out / report_path.name.replace(".report.json", ".keys.txt")).exists()
        report = read_report(report_path)
        if not (done or report.get("failed")):
            continue  # a shard under way (or left by a killed run): counted once it is done
        skipped.update({reason: len(keys) for reason, keys in report["skipped"].items()})
        if done:
            shards += 1
            encoded += report["encoded"]
        else:
            failed.setdefault(report["failed"], []).append(Path(report["shard"]).name)
    summary = {**meta, "complete": complete, "shards": shards, "count": encoded,
               "skipped": dict(sorted(skipped.items())), "failed_shards": dict(sorted(failed.items()))}
    SD_Files.write_text_atomic(out / "latents.json", json.dumps(summary, indent=2) + "\n")
    return summary


# ---------------------------------------------------------------------------------------------
# Pipeline stages
# ---------------------------------------------------------------------------------------------


def read_job(path: Path) -> tuple[ShardJob, list[SD_Shards.ShardSample]]:
    """A shard's job and samples; a shard that cannot be read at all is marked failed, not raised."""
    job = ShardJob(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        log.warning("%s: cannot read the file (%s)", path, error)
        job.failed = "unreadable_tar"
        return job, []
    if not data:
        job.failed = "empty_tar"
        return job, []
    samples, truncated_key = SD_Shards.read_shard(data)
    if truncated_key is not None and not samples and truncated_key.startswith("<"):
        log.warning("%s: not a readable tar (%s)", path, truncated_key)
        job.failed = "unreadable_tar"
    elif truncated_key is not None:
        job.skip("truncated_tar", truncated_key)
    return job, samples


def prefetch_shards(paths: list[Path], depth: int):
    """Yield ``(job, samples)`` with a thread reading and splitting up to ``depth`` shards ahead."""
    handoff: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def reader():
        for path in paths:
            handoff.put(read_job(path))
        handoff.put(done)

    threading.Thread(target=reader, daemon=True, name="shard-reader").start()
    while (item := handoff.get()) is not done:
        yield item


def decode_sample(sample: SD_Shards.ShardSample, resolution: int, max_pixels: int, max_aspect: float):
    """``(key, image (res, res, 3) uint8)`` or ``(key, skip reason)``."""
    if sample.problem is not None:  # a bad key, a caption that is not UTF-8, a member given twice
        return sample.key, sample.problem
    if sample.image is None:
        return sample.key, "no_image"
    if not sample.caption:
        return sample.key, "no_caption"
    try:
        image = SD_Shards.decode_image(sample.image, sample.image_ext, max_pixels, max_aspect)
        return sample.key, SD_Shards.resize_center_crop(image, resolution)
    except SD_Shards.ImageSkip as skip:
        return sample.key, skip.reason
    except Exception:  # a decoder failing in a way of its own: still one bad image, not a bad run
        return sample.key, "undecodable"


class Writer:
    """Moves latents to the host and saves each shard once its last batch is back."""

    def __init__(self, out: Path, flip: bool):
        self.out, self.flip = out, flip
        self.jobs: queue.Queue = queue.Queue(maxsize=8)
        self.error: BaseException | None = None
        self.finished: list[ShardJob] = []
        self.thread = threading.Thread(target=self._run, daemon=True, name="latent-writer")
        self.thread.start()

    def put(self, job: ShardJob, start: int, latents: torch.Tensor, flipped: torch.Tensor | None):
        if self.error is not None:
            raise self.error
        self.jobs.put((job, start, latents, flipped))

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error

    def _run(self):
        while (item := self.jobs.get()) is not None:
            if self.error is not None:
                continue
            try:
                self._handle(*item)
            except BaseException as error:  # surfaced to the main thread by put()/close()
                self.error = error

    def _handle(self, job: ShardJob, start: int, latents, flipped):
        if latents is None:  # the shard's closing notice: its batches were all queued before it
            self._save(job)
            return
        host = latents.cpu().numpy()  # waits for this batch only; the device works on
        job.latents[start : start + len(host)] = host
        if flipped is not None:
            job.flipped[start : start + len(host)] = flipped.cpu().numpy()

    def _save(self, job: ShardJob):
        files = outputs(self.out, job.stem)
        if job.failed is not None:  # nothing to save: the report counts and names the shard, no done marker
            report = {"shard": str(job.path), "encoded": 0, "skipped": job.skipped, "failed": job.failed}
            SD_Files.write_text_atomic(files["report"], json.dumps(report, indent=1) + "\n")
            self.finished.append(job)
            return
        for name, array in (("latents", job.latents), ("flipped", job.flipped)):
            if array is None:
                continue
            bad = ~np.isfinite(array.reshape(len(array), -1)).all(axis=1)
            if bad.any():
                keys = [k for k, b in zip(job.keys, bad) if b]
                raise RuntimeError(f"{job.path.name}: non-finite {name} for keys {keys[:10]} (a VAE overflow: "
                                   "try --precision fp32 or bf16)")
        SD_Files.save_npy_atomic(files["npy"], job.latents)
        if self.flip:
            SD_Files.save_npy_atomic(files["flip"], job.flipped)
        SD_Faults.point("after_npy", job.stem)  # tests: SD_FAULT=after_npy:NNNNN kills the run here
        report = {"shard": str(job.path), "encoded": len(job.keys), "skipped": job.skipped}
        SD_Files.write_text_atomic(files["report"], json.dumps(report, indent=1) + "\n")
        SD_Files.write_text_atomic(files["keys"], "".join(k + "\n" for k in job.keys))
        job.latents = job.flipped = None
        self.finished.append(job)


class Encoder:
    """uint8 images -> fp16 posterior means, on the device, without waiting for the results."""

    def __init__(self, vae, device: torch.device, dtype: torch.dtype, compile_encoder: bool, flip: bool):
        self.vae, self.device, self.dtype, self.flip = vae, device, dtype, flip
        self.encode_fn = torch.compile(self._encode) if compile_encoder else self._encode

    def _encode(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.vae.encode(pixels).latent_dist.mean

    @torch.no_grad()
    def __call__(self, images: list[np.ndarray]):
        batch = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2)  # (B, 3, H, W) uint8
        if self.device.type == "cuda":
            batch = batch.pin_memory().to(self.device, non_blocking=True)
        pixels = (batch.to(self.dtype) / 127.5 - 1.0).contiguous()
        with SD_Model.attention_context(self.device):
            latents = self.encode_fn(pixels).to(torch.float16)
            flipped = self.encode_fn(pixels.flip(-1)).to(torch.float16) if self.flip else None
        return latents, flipped


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def estimated_images(paths: list[Path]) -> int | None:
    """From img2dataset's NNNNN_stats.json when every shard has one (for the progress bar's total)."""
    total = 0
    for path in paths:
        stats = path.with_name(path.name.replace(".tar", "_stats.json"))
        try:
            successes = json.loads(stats.read_text(encoding="utf-8")).get("successes", 0)
            total += int(successes)
        except (OSError, ValueError, TypeError, AttributeError):  # absent or not img2dataset's: no estimate
            return None
    return total


def encode_shards(todo: list[Path], args, encoder: Encoder, writer: Writer) -> None:
    """Decode in the pool, batch per shard (never across shards), encode, hand off to the writer.

    Batches never span two shards, so a shard is always split into the same batches: an interrupted
    and resumed run writes the same bytes as an uninterrupted one.
    """
    from tqdm.auto import tqdm

    bar = tqdm(total=estimated_images(todo), unit="img", desc="encode", dynamic_ncols=True)
    with ThreadPoolExecutor(args.workers, thread_name_prefix="decode") as pool:
        pending = []  # (job, futures): decoding runs ahead by the prefetch depth
        shards = prefetch_shards(todo, args.prefetch)
        for job, samples in shards:
            futures = [pool.submit(decode_sample, s, args.resolution, args.max_pixels, args.max_aspect)
                       for s in samples]
            pending.append((job, futures))
            if len(pending) > args.prefetch:
                _encode_job(*pending.pop(0), args, encoder, writer, bar)
        for job, futures in pending:
            _encode_job(job, futures, args, encoder, writer, bar)
    bar.close()


def _encode_job(job: ShardJob, futures, args, encoder: Encoder, writer: Writer, bar) -> None:
    decoded = []
    for future in futures:
        key, result = future.result()
        if isinstance(result, str):
            job.skip(result, key)
        else:
            decoded.append((key, result))
    job.keys = [k for k, _ in decoded]
    if not decoded:
        job.failed = job.failed or "no_usable_sample"
        writer.put(job, 0, None, None)  # the writer writes its report, after the shards queued before it
        log.warning("%s: nothing to encode (%s); the shard is counted under failed_shards in latents.json",
                    job.path, job.failed)
        return
    latent_shape = (len(decoded), 4, args.resolution // 8, args.resolution // 8)
    job.latents = np.empty(latent_shape, dtype=np.float16)
    job.flipped = np.empty(latent_shape, dtype=np.float16) if args.flip else None
    for start in range(0, len(decoded), args.batch_size):
        images = [image for _, image in decoded[start : start + args.batch_size]]
        latents, flipped = encoder(images)
        writer.put(job, start, latents, flipped)
        bar.update(len(images))
    writer.put(job, 0, None, None)  # the closing notice: save once the batches before it are back
    skipped = sum(len(v) for v in job.skipped.values())
    if skipped:
        bar.write(f"{job.path.name}: skipped {skipped} ({', '.join(f'{r} {len(k)}' for r, k in job.skipped.items())})")


def main(argv=None) -> int:
    SD_Runtime.start_process()
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
        # Before any work: a folder begun with other settings, or a damaged latents.json, stops the run.
        previous = read_meta(out)
        compare_settings(out, previous, requested_settings(args))
        device = SD_Runtime.pick_device(args.device)
        dtype = SD_Runtime.resolve_precision(args.precision, device)
        vae = SD_Model.load_vae(args.vae).to(device=device, dtype=dtype)
        meta = vae_settings(args, vae.config)
        compare_settings(out, previous, meta)
        if not previous:
            check_existing_shards(out, meta)
        meta["compute_dtype"] = str(dtype).replace("torch.", "")
        return encode_folder(paths, out, args, meta, Encoder(vae, device, dtype, args.compile, args.flip))
    except FolderMismatch as error:
        print(f"encode_latents.py: error: {error}", file=sys.stderr)
        return 2


def encode_folder(paths: list[Path], out: Path, args, meta: dict, encoder: Encoder) -> int:
    """Settings first (marked incomplete), then the shards not done, then the totals (marked complete)."""
    out.mkdir(parents=True, exist_ok=True)
    todo = [p for p in paths if not shard_done(out, ShardJob(p).stem, args.flip)]
    log.info("%d shards, %d already encoded, %d to do, on %s in %s", len(paths), len(paths) - len(todo),
             len(todo), encoder.device, meta["compute_dtype"])
    if todo:
        write_summary(out, meta, complete=False)
        writer = Writer(out, args.flip)
        try:
            try:
                encode_shards(todo, args, encoder, writer)
            finally:
                writer.close()
        except RuntimeError as error:
            print(f"encode_latents.py: error: {error}", file=sys.stderr)
            return 1
    summary = write_summary(out, meta, complete=True)
    skipped = ", ".join(f"{reason} {n}" for reason, n in summary["skipped"].items()) or "none"
    log.info("done: %d latents in %d shards in %s; skipped: %s", summary["count"], summary["shards"], out, skipped)
    for reason, names in summary["failed_shards"].items():
        log.warning("%d shards gave no latent (%s): %s", len(names), reason, ", ".join(names[:20]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

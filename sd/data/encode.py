"""Image shards to fp16 VAE latent shards (``encode_latents.py``; its help describes the layout).

Four stages overlap and stream: a reader thread reads the tars a sample at a time; a pool of threads
decodes, crops and scales; batches are assembled in pinned memory and copied without blocking; the
VAE encodes while a writer thread appends finished latents to the shard's output file. A shard's
``keys.txt`` is written last as its done marker; ``latents.json`` holds the settings (checked against
a re-run's before any work) and, once every input shard is through, the totals.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import queue
import socket
import sys
import tarfile
import threading
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import sd.data.buckets
import sd.data.shards
import sd.data.stages
import sd.distributed
import sd.faults
import sd.files
import sd.model
import sd.runtime

log = logging.getLogger("encode_latents")

# The largest image size the VAE is given (--max_encode_pixels): four times the pixels of the 1024x1024
# class of buckets (SDXL's), 12.6 MB an image and 805 MB a batch of 64 on the host.
MAX_ENCODE_PIXELS = 2048 * 2048


def encode(paths: list[Path], out: Path, args) -> int:
    """Encode ``paths`` (input shards) into ``out`` with the settings of ``args`` (encode_latents.py's
    flags): the folder's settings are checked before any work, then this rank's shards not done are
    encoded. Returns the exit code."""
    place = sd.distributed.independent(args.device, args.rank, args.world_size)
    lock = sd.files.FolderLock(out, lock_name(place))
    try:
        lock.acquire()
    except sd.files.FolderLocked as error:
        print(f"encode_latents.py: error: {error}", file=sys.stderr)
        return 2
    try:
        return encode_locked(paths, out, args, place)
    finally:
        lock.release()


def lock_name(place: sd.distributed.Dist) -> str:
    """One process per rank writes to a folder: ``.lock``, or with several ranks ``.lock.rankRofW``
    (the ranks share the folder, each encoding shards of its own)."""
    name = sd.files.FolderLock.NAME
    return name if place.world_size == 1 else f"{name}.rank{place.rank}of{place.world_size}"


def encode_locked(paths: list[Path], out: Path, args, place: sd.distributed.Dist) -> int:
    try:
        # Before any work: a folder begun with other settings, or a damaged latents.json, stops the run.
        previous = read_meta(out)
        compare_settings(out, previous, requested_settings(args))
        dtype = sd.runtime.resolve_precision(args.precision, place.device)
        vae = sd.model.load_vae(args.vae)
        meta = {**vae_settings(args, vae.config), "vae_encoder": sd.model.encoder_digest(vae)}
        vae = sd.model.moved(vae, place.device, dtype)
        compare_settings(out, previous, meta)
        if not previous:
            check_existing_shards(out, meta)
        meta["compute_dtype"] = str(dtype).replace("torch.", "")
        encoder = Encoder(vae, place.device, dtype, args.compile, args.flip)
        return encode_folder(paths, out, args, meta, encoder, place)
    except FolderMismatch as error:
        print(f"encode_latents.py: error: {error}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------------------------------------
# Shard bookkeeping
# ---------------------------------------------------------------------------------------------


@dataclass
class ShardJob:
    """One input shard on its way through the pipeline."""

    path: Path
    keys: list[str] = field(default_factory=list)  # encoded keys, in shard order, appended batch by batch
    buckets: dict[int, list] = field(default_factory=dict)  # --buckets: bucket -> [(key, (h, w), (top, left))]
    skipped: dict[str, list[str]] = field(default_factory=dict)  # reason -> keys
    failed: str | None = None  # why the whole shard gave no latent (empty_tar, unreadable_tar, no_usable_sample)
    truncated: str | None = None  # the key cut off where the tar ends early (set once it has been read)
    rows: dict[tuple, NpyRows] = field(default_factory=dict)  # the writer's open files: ("npy"|"flip", bucket)
    non_finite: list[tuple[str, str]] = field(default_factory=list)  # (output, key) of non-finite latents
    masked: int = 0  # samples encoded with a loss mask

    @property
    def stem(self) -> str:
        return self.path.name[: -len(".tar")] if self.path.name.endswith(".tar") else self.path.stem

    def skip(self, reason: str, key: str) -> None:
        self.skipped.setdefault(reason, []).append(key)


def shards_of_rank(paths: list[Path], rank: int, world_size: int) -> list[Path]:
    """Shard i of the sorted list is rank i % world_size's: every rank computes the same split alone."""
    return sorted(paths)[rank::world_size]


def outputs(out: Path, stem: str) -> dict[str, Path]:
    return {"npy": out / f"{stem}.npy", "flip": out / f"{stem}.flip.npy", "report": out / f"{stem}.report.json",
            "keys": out / f"{stem}.keys.txt", "buckets": out / f"{stem}.buckets.json"}


LATENT_SUFFIXES = {"npy": "", "flip": ".flip", "mask": ".mask", "rejected": ".rejected"}  # output -> suffix before .npy


def latent_file(out: Path, stem: str, name: str, bucket: sd.data.buckets.Bucket | None) -> Path:
    """``NNNNN.npy`` / ``NNNNN.flip.npy`` / ``NNNNN.mask.npy``, or per bucket ``NNNNN.WxH.npy`` ..."""
    middle = "" if bucket is None else f".{sd.data.buckets.name(bucket)}"
    return out / f"{stem}{middle}{LATENT_SUFFIXES[name]}.npy"


def shard_done(out: Path, stem: str, flip: bool, bucketed: bool = False) -> bool:
    """The keys file is written last; a bucketed shard's layout file and arrays come before it."""
    files = outputs(out, stem)
    if bucketed:
        return files["keys"].exists() and files["buckets"].exists()
    return files["keys"].exists() and files["npy"].exists() and (not flip or files["flip"].exists())


# What a re-run must share with the run that started a folder: anything else mixes latents that do not
# belong together (other shapes, another VAE's space, flipped or not) in one folder, silently.
SETTINGS = ("vae", "vae_encoder", "scaling_factor", "resolution", "latent_shape", "dtype", "flip", "buckets", "control",
            "pairs")


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
    buckets = None if args.bucket_sizes is None else [list(b) for b in args.bucket_sizes]
    return {"vae": args.vae, "resolution": args.resolution, "dtype": "float16", "flip": bool(args.flip),
            "buckets": buckets, "control": list(getattr(args, "control", None) or ()),
            "pairs": bool(getattr(args, "pairs", False))}


def vae_settings(args, vae_config) -> dict:
    """Every setting in SETTINGS, once the VAE is loaded (``latent_shape`` None with buckets: one per
    bucket, recorded in each shard's NNNNN.buckets.json)."""
    channels = int(vae_config.latent_channels)
    latent_shape = None if args.bucket_sizes else [channels, args.resolution // 8, args.resolution // 8]
    return {**requested_settings(args), "scaling_factor": float(vae_config.scaling_factor),
            "latent_shape": latent_shape, "latent_channels": channels}


# Settings a folder encoded before they existed does not record, and what it was encoded with.
LATER_SETTINGS = {"control": [], "pairs": False}


def compare_settings(out: Path, previous: dict, settings: dict) -> None:
    """Stop (``FolderMismatch``) when ``out``'s latents.json (``previous``; {} for a new folder) was written
    with other settings than these."""
    previous = {**LATER_SETTINGS, **previous} if previous else previous
    for key in SETTINGS:
        if key in previous and key in settings and previous[key] != settings[key]:
            raise FolderMismatch(f"{out} was encoded with {key}={previous[key]!r} but this run asks for "
                                 f"{key}={settings[key]!r}; use the same settings or another --out")


def check_existing_shards(out: Path, settings: dict) -> None:
    """A folder without latents.json (an older version wrote it only at the end) is checked by its shards."""
    if settings["latent_shape"] is None:  # --buckets: such a folder predates buckets, so it holds squares
        if any(out.glob("*.keys.txt")):
            raise FolderMismatch(f"{out} holds square latents but this run asks for --buckets; use another --out")
        return
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


def folder_totals(out: Path) -> tuple[dict, set[str]]:
    """Totals over every shard report in the folder (so resumed runs and other ranks add up), and the
    stems of the shards that are through: done (their keys file exists) or failed. ``skipped_examples``
    names the first keys skipped for each reason (every shard's report names them all)."""
    encoded, masked, skipped, shards, failed, through = 0, 0, Counter(), 0, {}, set()
    examples: dict[str, list[str]] = {}
    for report_path in sorted(out.glob("*.report.json")):
        stem = report_path.name[: -len(".report.json")]
        done = (out / f"{stem}.keys.txt").exists()
        report = read_report(report_path)
        if not (done or report.get("failed")):
            continue  # a shard under way (or left by a killed run): counted once it is done
        through.add(stem)
        skipped.update({reason: len(keys) for reason, keys in report["skipped"].items()})
        for reason, keys in report["skipped"].items():
            named = examples.setdefault(reason, [])
            named.extend(keys[: sd.data.stages.MAX_EXAMPLES - len(named)])
        if done:
            shards += 1
            encoded += report["encoded"]
            masked += report.get("masked", 0)
        else:
            failed.setdefault(report["failed"], []).append(Path(report["shard"]).name)
    totals = {"shards": shards, "count": encoded, "masked": masked, "skipped": dict(sorted(skipped.items())),
              "skipped_examples": dict(sorted(examples.items())), "failed_shards": dict(sorted(failed.items()))}
    return totals, through


def write_summary(out: Path, meta: dict, complete: bool, exclusive: bool = False, totals: dict | None = None) -> dict:
    """latents.json: the settings, then the folder's totals. ``complete`` is False while a run is under
    way: the trainer refuses such a folder. ``exclusive``: only if there is none yet (FileExistsError
    otherwise), so that of several ranks starting on a new folder one sets the settings."""
    summary = {**meta, "complete": complete, **(folder_totals(out)[0] if totals is None else totals)}
    # Several ranks may write latents.json at once, and sd.files' temporary name is one per target:
    # each process writes a file of its own first, then renames (or links) it onto latents.json.
    mine, target = out / f".latents.json.{socket.gethostname()}.{os.getpid()}", out / "latents.json"
    sd.files.write_text_atomic(mine, json.dumps(summary, indent=2) + "\n")
    try:
        if not exclusive:
            os.replace(mine, target)
            return summary
        try:
            os.link(mine, target)  # atomic, and refused when the file exists
        except FileExistsError:
            raise
        except OSError:  # a file system without hard links: check, then rename (a narrow race, no link)
            if target.exists():
                raise FileExistsError(target) from None
            os.replace(mine, target)
    finally:
        mine.unlink(missing_ok=True)
    return summary


def start_folder(out: Path, meta: dict) -> None:
    """Settings first, before this rank encodes anything, marked incomplete. On a new folder the first
    rank creates latents.json; the others (and re-runs) compare their settings with it, then mark it."""
    try:
        write_summary(out, meta, complete=False, exclusive=True)
    except FileExistsError:
        compare_settings(out, read_meta(out), meta)
        write_summary(out, meta, complete=False)


def finish_folder(out: Path, meta: dict, paths: list[Path]) -> dict | None:
    """latents.json marked complete, with the totals, once every input shard is through; None (and
    nothing written) while shards of other ranks are still under way: the last rank to finish writes it."""
    totals, through = folder_totals(out)
    waiting = [p.name for p in paths if ShardJob(p).stem not in through]
    if waiting:
        log.info("%d input shards are not through yet (%s%s): the rank that finishes them writes the totals; "
                 "re-running any rank's command completes a folder whose ranks were stopped", len(waiting),
                 ", ".join(waiting[:5]), ", ..." if len(waiting) > 5 else "")
        return None
    return write_summary(out, meta, complete=True, totals=totals)


# ---------------------------------------------------------------------------------------------
# Pipeline stages
# ---------------------------------------------------------------------------------------------


def shard_samples(job: ShardJob):
    """The samples of ``job``'s tar, one at a time (``sd.data.shards.TarSamples``: one sample's bytes in
    memory, whatever the shard's size). A shard that cannot be read at all is marked failed, not
    raised; a cut-off one keeps what precedes the cut and ``job.truncated`` names the key cut off."""
    path = job.path
    try:
        file = open(path, "rb")
    except OSError as error:
        log.warning("%s: cannot read the file (%s)", path, error)
        job.failed = "unreadable_tar"
        return
    with file:
        size = os.fstat(file.fileno()).st_size
        if not size:
            job.failed = "empty_tar"
            return
        reader = sd.data.shards.TarSamples(file, size, max_member_bytes=sd.data.stages.MAX_MEMBER_BYTES)
        try:
            yield from reader
        except (tarfile.TarError, EOFError) as error:  # raised before any sample: not a tar
            log.warning("%s: not a readable tar (%s)", path, error)
            job.failed = "unreadable_tar"
            return
        except OSError as error:  # a read failing part way (a storage error): what came before is kept
            reader.truncated_key = f"<after {reader.count} samples: {error}>"
        job.truncated = reader.truncated_key


def read_ahead(paths: list[Path], depth: int):
    """Yield ``(job, sample)`` for every sample of every shard in order, and ``(job, None)`` after a
    shard's last, with a thread reading up to ``depth`` samples ahead of the caller (their compressed
    bytes are all it holds: memory does not grow with the shard)."""
    handoff: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def reader():
        try:
            for path in paths:
                job = ShardJob(path)
                for sample in shard_samples(job):
                    handoff.put((job, sample))
                handoff.put((job, None))
        except BaseException as error:  # noqa: BLE001 - raised again in the caller's thread
            handoff.put(error)
        handoff.put(done)

    threading.Thread(target=reader, daemon=True, name="shard-reader").start()
    while (item := handoff.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item


def decode_sample(sample: sd.data.shards.ShardSample, resolution: int, max_pixels: int, max_aspect: float,
                  buckets: list[sd.data.buckets.Bucket] | None = None, controls: tuple[str, ...] = (),
                  pairs: bool = False):
    """``(key, image (res, res, 3) uint8)`` or ``(key, skip reason)``; with ``buckets``
    ``(key, (bucket index, image (H, W, 3) of that bucket, original (h, w), crop (top, left)))``.

    A sample with a loss mask (``<key>.mask.png``) gets it as a fourth channel of its image, ``(H, W, 4)``,
    cut and scaled exactly as the image. With ``controls`` (conditioning images' names) the result is
    ``(that result, {name: PNG bytes})``: each ``<key>.<name>.png`` cut and scaled as the image, encoded
    here in the decode threads; a sample without one of them is skipped (``no_control``). With ``pairs`` (a
    preference pair's rejected image ``<key>.rejected.<ext>`` beside the preferred one) the result is ``(that
    result, the PNGs or None, the rejected image)``: brought to the preferred image's size and cut and scaled as
    it was, so both latents of a pair share the bucket and the crop; a sample without one is skipped
    (``no_rejected``), one of another aspect ratio too (``rejected_mismatch``)."""
    if sample.problem is not None:  # a bad key, a caption that is not UTF-8, a member given twice
        return sample.key, sample.problem
    if sample.image is None:
        return sample.key, "no_image"
    if not sample.caption:
        return sample.key, "no_caption"
    try:
        image = sd.data.shards.decode_image(sample.image, sample.image_ext, max_pixels, max_aspect)
        height, width = image.shape[:2]
        mask = None if sample.mask is None else sd.data.shards.decode_mask(sample.mask, (width, height), max_pixels)
        if buckets is None:
            result = with_mask(sd.data.shards.resize_center_crop, image, mask, resolution)
            fit = lambda pixels: sd.data.shards.resize_center_crop(pixels, resolution)  # noqa: E731
        else:
            bucket = sd.data.buckets.nearest_bucket(width, height, buckets)
            pixels, crop = sd.data.buckets.fit_to_bucket(image, buckets[bucket])
            if mask is not None:
                pixels = np.dstack([pixels, sd.data.buckets.fit_to_bucket(mask, buckets[bucket])[0]])
            result = (bucket, pixels, (height, width), crop)
            fit = lambda pixels: sd.data.buckets.fit_to_bucket(pixels, buckets[bucket])[0]  # noqa: E731
        pngs = fitted_controls(sample, controls, (width, height), fit, max_pixels) if controls else None
        if pairs:
            return sample.key, (result, pngs, fit(rejected_image(sample, (width, height), max_pixels)))
        return sample.key, result if not controls else (result, pngs)
    except sd.data.shards.ImageSkip as skip:
        return sample.key, skip.reason
    except Exception:  # a decoder failing in a way of its own: still one bad image, not a bad run
        return sample.key, "undecodable"


def fitted_controls(sample: sd.data.shards.ShardSample, names: tuple[str, ...], size: tuple[int, int], fit,
                    max_pixels: int) -> dict[str, bytes]:
    """The conditioning images ``names`` of ``sample`` brought to its image's decoded ``size`` ``(width,
    height)``, then cut and scaled by ``fit`` as the image was, as PNG bytes (``sd.data.shards.encode_png``)."""
    missing = [name for name in names if name not in sample.controls]
    if missing:
        raise sd.data.shards.ImageSkip("no_control", ", ".join(missing))
    return {name: sd.data.shards.encode_png(fit(sd.data.shards.decode_control(sample.controls[name], size, max_pixels)))
            for name in names}


def rejected_image(sample: sd.data.shards.ShardSample, size: tuple[int, int], max_pixels: int) -> np.ndarray:
    """A pair's rejected image ``(height, width, 3)`` uint8 at its preferred image's ``size`` ``(width, height)``."""
    if sample.rejected is None:
        raise sd.data.shards.ImageSkip("no_rejected")
    try:
        rgb = sd.data.shards.decode_image(sample.rejected, sample.rejected_ext, max_pixels)
    except sd.data.shards.ImageSkip as skip:
        raise sd.data.shards.ImageSkip("bad_rejected", str(skip)) from None
    return sd.data.shards.scaled_to_image(rgb, size, "rejected_mismatch", "rejected image")


def with_mask(fit, image: np.ndarray, mask: np.ndarray | None, *size) -> np.ndarray:
    """``fit(image, *size)``, with ``fit(mask, *size)`` as a fourth channel when there is a mask."""
    pixels = fit(image, *size)
    return pixels if mask is None else np.dstack([pixels, fit(mask, *size)])


def split_masks(images: list[np.ndarray]) -> tuple[list[np.ndarray], np.ndarray | None]:
    """Decoded images (``(H, W, 3)``, or ``(H, W, 4)`` with a loss mask) -> ``(the RGB images, masks
    (B, 1, H/8, W/8) float16 at latent resolution)``: weight 1 where an image has no mask; None when
    none of them has one."""
    rgb = [image[..., :3] for image in images]
    if all(image.shape[-1] == 3 for image in images):
        return rgb, None
    height, width = images[0].shape[:2]
    masks = np.ones((len(images), 1, height // 8, width // 8), dtype=np.float16)
    for i, image in enumerate(images):
        if image.shape[-1] == 4:
            masks[i, 0] = sd.data.shards.latent_mask(image[..., 3])
    return rgb, masks


class NpyRows:
    """An .npy file written a batch of rows at a time under its temporary name, renamed into place by
    ``commit``: the rows go to the file as they come, never all held in memory.

    The header is written first for 0 rows and rewritten with the final count. numpy pads the header so
    the first axis can grow to 21 digits in place (``np.lib.format.GROWTH_AXIS_MAX_DIGITS``), so its
    length does not change and the file is byte for byte what ``np.save`` writes for the whole array.
    """

    def __init__(self, path: Path, row_shape: tuple[int, ...], dtype=np.float16):
        self.path, self.tmp = path, sd.files.temporary_name(path)
        self.row_shape, self.dtype, self.count = tuple(row_shape), np.dtype(dtype), 0
        self.handle = open(self.tmp, "wb")
        try:
            self.header_size = self.handle.write(self._header())
        except BaseException:
            self.discard()
            raise

    def _header(self) -> bytes:
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, {"descr": np.lib.format.dtype_to_descr(self.dtype),
                                                      "fortran_order": False, "shape": (self.count, *self.row_shape)})
        return header.getvalue()

    def append(self, rows: np.ndarray) -> None:
        self.handle.write(np.ascontiguousarray(rows, dtype=self.dtype).tobytes())
        self.count += len(rows)

    def commit(self) -> None:
        header = self._header()
        if len(header) != self.header_size:
            raise RuntimeError(f"{self.path.name}: this numpy writes .npy headers whose size depends on the row "
                               "count; upgrade numpy")
        self.handle.seek(0)
        self.handle.write(header)
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        try:
            self.handle.close()
        except OSError:  # a full disk fails the flush of what is buffered: the file goes all the same
            pass
        finally:
            self.tmp.unlink(missing_ok=True)


def control_files(latents: Path, name: str) -> tuple[Path, Path]:
    """The conditioning images ``name`` beside the latent array ``latents`` (``NNNNN[.WxH].npy``): each row's
    PNG file, concatenated (``NNNNN[.WxH].<name>.pngs``), and where each begins and ends
    (``NNNNN[.WxH].<name>.offsets.npy``, int64, rows + 1)."""
    stem = latents.name[: -len(".npy")]
    return latents.with_name(f"{stem}.{name}.pngs"), latents.with_name(f"{stem}.{name}.offsets.npy")


class PngRows:
    """A shard's conditioning images of one name, written a batch at a time under temporary names and
    renamed into place by ``commit`` (the bytes, then the offsets): never all held in memory."""

    def __init__(self, paths: tuple[Path, Path]):
        self.path, self.offsets_path = paths
        self.tmp = sd.files.temporary_name(self.path)
        self.offsets, self.count = [0], 0
        self.handle = open(self.tmp, "wb")

    def append(self, pngs: list[bytes]) -> None:
        for data in pngs:
            self.handle.write(data)
            self.offsets.append(self.offsets[-1] + len(data))
        self.count += len(pngs)

    def commit(self) -> None:
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        os.replace(self.tmp, self.path)
        sd.files.save_npy_atomic(self.offsets_path, np.asarray(self.offsets, dtype=np.int64))

    def discard(self) -> None:
        try:
            self.handle.close()
        except OSError:
            pass
        finally:
            self.tmp.unlink(missing_ok=True)


class Writer:
    """Moves latents to the host, appends them to their shard's files, and completes each shard once its
    last batch is back."""

    NAMES = {"npy": "latents", "flip": "flipped", "rejected": "rejected"}  # output file -> its rows, in messages

    def __init__(self, out: Path, flip: bool, buckets: list[sd.data.buckets.Bucket] | None = None):
        self.out, self.flip, self.buckets = out, flip, buckets
        self.jobs: queue.Queue = queue.Queue(maxsize=8)
        self.error: BaseException | None = None
        self.current: ShardJob | None = None  # the shard whose files are open
        self.thread = threading.Thread(target=self._run, daemon=True, name="latent-writer")
        self.thread.start()

    def put(self, job: ShardJob, keys: list[str] | None, latents: torch.Tensor | None, flipped: torch.Tensor | None,
            bucket: int | None = None, masks: np.ndarray | None = None, controls: list[dict] | None = None,
            rejected: torch.Tensor | None = None):
        """One batch of ``job`` (its ``keys``, in order; with buckets, all of ``bucket``; ``masks``: the
        batch's loss masks, ``split_masks``; ``controls``: each sample's conditioning images as PNG bytes by
        name; ``rejected``: the latents of each pair's rejected image), or with ``latents`` None the shard's
        closing notice."""
        if self.error is not None:
            raise self.error
        self.jobs.put((job, keys, latents, flipped, bucket, masks, controls, rejected))

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()
        if self.current is not None:  # a shard cut off by an error: no half-written file is left
            self._discard(self.current)
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

    def _handle(self, job: ShardJob, keys, latents, flipped, bucket, masks, controls, rejected=None):
        if latents is None:  # the closing notice: the shard's batches were all queued before it
            self._save(job)
            return
        self.current = job
        self._append_masks(job, masks, len(keys), latents.shape[-2:], bucket)
        for name in sorted(controls[0]) if controls else ():
            if (f"control:{name}", bucket) not in job.rows:
                prefix = latent_file(self.out, job.stem, "npy", None if bucket is None else self.buckets[bucket])
                job.rows[f"control:{name}", bucket] = PngRows(control_files(prefix, name))
            job.rows[f"control:{name}", bucket].append([pngs[name] for pngs in controls])
        self._append(job, "npy", keys, latents, bucket)
        if flipped is not None:
            self._append(job, "flip", keys, flipped, bucket)
        if rejected is not None:
            self._append(job, "rejected", keys, rejected, bucket)

    def _append_masks(self, job: ShardJob, masks: np.ndarray | None, count: int, size, bucket: int | None) -> None:
        """The batch's rows of ``NNNNN.mask.npy`` (per bucket ``NNNNN.WxH.mask.npy``), begun at the first
        mask of the shard (or bucket): the rows before it, and later rows without a mask, weigh 1. A
        shard without a mask gets no such file. The mirrored latents' masks are these mirrored (the
        trainer flips them), so none is written for them."""
        if masks is None and ("mask", bucket) not in job.rows:
            return
        row_shape = (1, *size)
        if ("mask", bucket) not in job.rows:
            path = latent_file(self.out, job.stem, "mask", None if bucket is None else self.buckets[bucket])
            rows = job.rows["mask", bucket] = NpyRows(path, row_shape)
            earlier = job.rows["npy", bucket].count if ("npy", bucket) in job.rows else 0
            for start in range(0, earlier, 1024):
                rows.append(np.ones((min(1024, earlier - start), *row_shape), dtype=np.float16))
        job.rows["mask", bucket].append(np.ones((count, *row_shape), np.float16) if masks is None else masks)

    def _append(self, job: ShardJob, name: str, keys: list[str], latents: torch.Tensor, bucket: int | None) -> None:
        host = latents.cpu().numpy()  # waits for this batch only; the device works on
        finite = np.isfinite(host.reshape(len(host), -1)).all(axis=1)
        job.non_finite.extend((name, key) for key, ok in zip(keys, finite) if not ok)
        if (name, bucket) not in job.rows:
            size = None if bucket is None else self.buckets[bucket]
            job.rows[name, bucket] = NpyRows(latent_file(self.out, job.stem, name, size), host.shape[1:])
        job.rows[name, bucket].append(host)

    def _discard(self, job: ShardJob) -> None:
        for rows in job.rows.values():
            rows.discard()
        job.rows, self.current = {}, None

    def _save(self, job: ShardJob):
        files = outputs(self.out, job.stem)
        if job.failed is not None:  # nothing to save: the report counts and names the shard, no done marker
            self._discard(job)
            report = {"shard": str(job.path), "encoded": 0, "skipped": job.skipped, "failed": job.failed}
            sd.files.write_text_atomic(files["report"], json.dumps(report, indent=1) + "\n")
            return
        for name, label in self.NAMES.items():
            keys = [key for file, key in job.non_finite if file == name]
            if keys:
                self._discard(job)
                raise RuntimeError(f"{job.path.name}: non-finite {label} for keys {keys[:10]} (a VAE overflow: "
                                   "try --precision fp32 or bf16)")
        for rows in job.rows.values():
            rows.commit()
        for (name, bucket) in job.rows:  # a mask file left by an earlier encoding of this shard is not its own
            if name == "npy" and ("mask", bucket) not in job.rows:
                size = None if bucket is None else self.buckets[bucket]
                latent_file(self.out, job.stem, "mask", size).unlink(missing_ok=True)
        latent_shapes = {bucket: list(rows.row_shape) for (name, bucket), rows in job.rows.items() if name == "npy"}
        job.rows, self.current = {}, None
        sd.faults.point("after_npy", job.stem)  # tests: SD_FAULT=after_npy:NNNNN kills the run here
        keys = job.keys
        if self.buckets is not None:
            keys = self._save_layout(job, files["buckets"], latent_shapes)
        report = {"shard": str(job.path), "encoded": len(job.keys), "masked": job.masked, "skipped": job.skipped}
        sd.files.write_text_atomic(files["report"], json.dumps(report, indent=1) + "\n")
        sd.files.write_text_atomic(files["keys"], "".join(k + "\n" for k in keys))

    def _save_layout(self, job: ShardJob, path: Path, latent_shapes: dict) -> list[str]:
        """NNNNN.buckets.json: the buckets in the order of the keys file (keys grouped by bucket, each
        group in its array's row order), with each sample's original size and crop; returns the keys."""
        order = sorted(job.buckets)
        samples = [sample for bucket in order for sample in job.buckets[bucket]]
        layout = {"buckets": [{"size": list(self.buckets[b]), "latent_shape": latent_shapes[b],
                               "count": len(job.buckets[b])} for b in order],
                  "original_size": [list(original) for _, original, _ in samples],
                  "crop_top_left": [list(crop) for _, _, crop in samples]}
        sd.files.write_text_atomic(path, json.dumps(layout, separators=(",", ":")) + "\n")
        return [key for key, _, _ in samples]


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
        with sd.model.attention_context(self.device):
            latents = self.encode_fn(pixels).to(torch.float16)
            flipped = self.encode_fn(pixels.flip(-1)).to(torch.float16) if self.flip else None
        return latents, flipped


def in_flight_limit(batch_size: int, workers: int) -> int:
    """Images decoding or decoded and not yet handed to the VAE: the batch being filled, one more behind
    it, and two per decode thread so that none of them waits. A few batches, whatever the shard size."""
    return 2 * batch_size + 2 * workers


class InFlight:
    """Counts the images handed to the decode pool and not yet to the VAE, and keeps the peak."""

    def __init__(self, limit: int):
        self.limit, self.count, self.peak = limit, 0, 0

    def add(self, n: int) -> None:
        self.count += n
        self.peak = max(self.peak, self.count)

    def remove(self, n: int) -> None:
        self.count -= n


class ShardStream:
    """Decode -> batch -> encode -> writer, image by image in shard order, decoding ahead of the VAE by
    at most ``in_flight.limit`` images. Before, up to three whole shards were decoded at once (0.79 MB an
    image at 512 px: about 24 GB at 10k-image shards); now the decoded images in memory do not grow
    with the shard (issue 14).

    The look-ahead runs across shard boundaries, so the VAE does not wait at the start of a shard; but
    batches never span two shards, so a shard is always split into the same batches and an interrupted
    and resumed run (or one split across ranks) writes the same bytes as an uninterrupted one.
    """

    def __init__(self, pool: ThreadPoolExecutor, args, encoder: Encoder, writer: Writer, bar):
        self.pool, self.args, self.encoder, self.writer, self.bar = pool, args, encoder, writer, bar
        self.in_flight = InFlight(in_flight_limit(args.batch_size, args.workers))
        self.window: deque = deque()  # (job, decode future) in shard order; (job, None) closes a shard
        # Decoded images of the oldest shard in the window, by bucket (0 without buckets): (key, image, info)
        self.pending: dict[int, list] = {}
        self.controls = tuple(getattr(args, "control", None) or ())  # conditioning images' names
        self.pairs = bool(getattr(args, "pairs", False))  # preference pairs: each sample's rejected image too

    def add(self, job: ShardJob, sample: sd.data.shards.ShardSample | None) -> None:
        """One sample of ``job`` to decode, or with ``sample`` None the end of the shard."""
        if sample is None:
            self.window.append((job, None))
            return
        while self.in_flight.count >= self.in_flight.limit:
            self.take()
        args = self.args
        self.window.append((job, self.pool.submit(decode_sample, sample, args.resolution, args.max_pixels,
                                                  args.max_aspect, args.bucket_sizes, self.controls,
                                                  self.pairs)))
        self.in_flight.add(1)

    def drain(self) -> None:
        while self.window:
            self.take()

    def take(self) -> None:
        """The oldest decode: skipped and counted, or into its bucket's batch (encoded once full).

        With buckets, images wait in up to one partial batch per bucket; when more than two batches'
        worth wait in all, the fullest partial batch is encoded early. Which depends on the shard's
        own images alone, so a shard is always cut into the same batches (and the waiting images stay
        below ``in_flight.limit``, leaving decodes in the window to take).
        """
        job, future = self.window.popleft()
        if future is None:
            self.close(job)
            return
        key, result = future.result()
        if isinstance(result, str):
            job.skip(result, key)
            self.in_flight.remove(1)
            return
        result, pngs, rejected = result if self.pairs else (*result, None) if self.controls else (result, None, None)
        bucket, image, info = (0, result, None) if self.args.bucket_sizes is None else \
            (result[0], result[1], result[2:])
        self.pending.setdefault(bucket, []).append((key, image, info, pngs, rejected))
        batch_size = self.args.batch_size
        if len(self.pending[bucket]) == batch_size:
            self.encode(job, bucket)
        elif sum(len(waiting) for waiting in self.pending.values()) > 2 * batch_size:
            self.encode(job, max(self.pending, key=lambda b: (len(self.pending[b]), -b)))

    def encode(self, job: ShardJob, bucket: int) -> None:
        batch = self.pending.pop(bucket)
        keys = [key for key, *_ in batch]
        images, masks = split_masks([image for _, image, *_ in batch])
        latents, flipped = self.encoder(images)
        rejected = self.encoder([pixels for *_, pixels in batch])[0] if self.pairs else None
        self.in_flight.remove(len(keys))
        job.keys.extend(keys)
        job.masked += sum(image.shape[-1] == 4 for _, image, *_ in batch)
        if self.args.bucket_sizes is not None:
            job.buckets.setdefault(bucket, []).extend((key, *info) for key, _, info, *_ in batch)
        controls = [pngs for _, _, _, pngs, _ in batch] if self.controls else None
        self.writer.put(job, keys, latents, flipped, None if self.args.bucket_sizes is None else bucket, masks,
                        controls, rejected)
        self.bar.update(len(keys))

    def close(self, job: ShardJob) -> None:
        if job.truncated is not None:
            job.skip("truncated_tar", job.truncated)
        for bucket in sorted(self.pending):
            self.encode(job, bucket)
        if not job.keys:
            job.failed = job.failed or "no_usable_sample"
            log.warning("%s: nothing to encode (%s); the shard is counted under failed_shards in latents.json",
                        job.path, job.failed)
        self.writer.put(job, None, None, None)  # the closing notice: saved once the batches before it are back
        skipped = sum(len(v) for v in job.skipped.values())
        if skipped:
            self.bar.write(f"{job.path.name}: skipped {skipped} "
                           f"({', '.join(f'{r} {len(k)}' for r, k in job.skipped.items())})")


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


def encode_shards(todo: list[Path], args, encoder: Encoder, writer: Writer, desc: str = "encode") -> InFlight:
    """Stream the shards through decoding, the VAE and the writer; returns the in-flight count."""
    from tqdm.auto import tqdm

    bar = tqdm(total=estimated_images(todo), unit="img", desc=desc, dynamic_ncols=True)
    try:  # the bar is closed here also when the run stops on an error, not whenever it is collected
        with ThreadPoolExecutor(args.workers, thread_name_prefix="decode") as pool:
            stream = ShardStream(pool, args, encoder, writer, bar)
            for job, sample in read_ahead(todo, args.prefetch):
                stream.add(job, sample)
            stream.drain()
    finally:
        bar.close()
    return stream.in_flight


def encode_todo(todo: list[Path], out: Path, args, meta: dict, encoder: Encoder, who: str) -> None:
    """The settings (marked incomplete), then the shards of ``todo``; a shard cut off by an error
    leaves no file behind, the shards finished before it are kept."""
    start_folder(out, meta)
    writer = Writer(out, args.flip, args.bucket_sizes)
    try:
        in_flight = encode_shards(todo, args, encoder, writer, f"encode {who}".rstrip(": "))
    finally:
        writer.close()
    log.info("%sat most %d images were decoded ahead of the VAE (limit %d)", who, in_flight.peak, in_flight.limit)


def write_failure(out: Path, error: OSError) -> str:
    """One line for a write that failed: a full disk (or quota) said as such, anything else as it came."""
    kept = "re-run the same command: the shards finished so far are kept, nothing half-written is left"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{out}: the disk is full ({os.strerror(error.errno)}); free some space, then {kept}"
    return f"{out}: could not write ({error}); {kept}"


def encode_folder(paths: list[Path], out: Path, args, meta: dict, encoder: Encoder,
                  place: sd.distributed.Dist | None = None) -> int:
    """This rank's shards not done: settings first (marked incomplete), then the shards, then the totals
    (marked complete) if every input shard of every rank is through."""
    place = place or sd.distributed.Dist.single(encoder.device)
    who = f"rank {place.rank} of {place.world_size}: " if place.world_size > 1 else ""
    out.mkdir(parents=True, exist_ok=True)
    mine = shards_of_rank(paths, place.rank, place.world_size)
    todo = [p for p in mine if not shard_done(out, ShardJob(p).stem, args.flip, args.bucket_sizes is not None)]
    log.info("%s%d shards, %d already encoded, %d to do, on %s in %s", who, len(mine), len(mine) - len(todo),
             len(todo), encoder.device, meta["compute_dtype"])
    try:
        if todo:
            encode_todo(todo, out, args, meta, encoder, who)
        summary = finish_folder(out, meta, paths)
    except RuntimeError as error:
        print(f"encode_latents.py: error: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"encode_latents.py: error: {write_failure(out, error)}", file=sys.stderr)
        return 1
    if summary is None:
        return 0
    examples = summary.get("skipped_examples", {})
    skipped = ", ".join(f"{reason} {n} (e.g. {', '.join(examples.get(reason, [])[:3])})"
                        for reason, n in summary["skipped"].items()) or "none"
    log.info("done: %d latents in %d shards in %s; skipped: %s", summary["count"], summary["shards"], out, skipped)
    for reason, names in summary["failed_shards"].items():
        log.warning("%d shards gave no latent (%s): %s", len(names), reason, ", ".join(names[:20]))
    return nothing_encoded(summary)


def nothing_encoded(summary: dict) -> int:
    """1, with the reasons and their fixes on stderr, when the folder holds no latent from a non-empty input
    (every shard failed, or every sample was skipped): the trainer would find nothing to train on; else 0."""
    if summary["count"]:
        return 0
    reasons = [(f"{len(names)} shards {reason}{sd.data.stages.named(names, len(names))}", reason)
               for reason, names in summary["failed_shards"].items()]
    examples = summary.get("skipped_examples", {})
    reasons += [(f"{n} samples {reason}{sd.data.stages.named(examples.get(reason, []), n)}", reason)
                for reason, n in summary["skipped"].items() if n]
    if not reasons:
        return 0
    said = "; ".join(text + (f": {sd.data.stages.FIXES[reason]}" if reason in sd.data.stages.FIXES else "")
                     for text, reason in reasons)
    print(f"encode_latents.py: error: no latent was encoded: {said}", file=sys.stderr)
    return 1



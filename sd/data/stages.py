"""What the numbered data stages in pipeline/ share: the command line, outputs with done markers,
the end-of-stage summary, downloads and archive safety.

The stage contract:
* Each stage is ``pipeline/NN_verb_noun.py`` with ``main(argv=None)``; it calls
  ``sd.runtime.start_process()`` first and builds its command line on ``StageArgumentParser``
  (``--input`` what it reads, ``--out`` where it writes, ``--workers``, ``--retries``, booleans as
  ``--flag [true|false]``; a bad command line is one line on stderr and exit status 2).
* Per output a stage writes the data (``NNNNN.tar``: webdataset ``key.jpg`` + ``key.txt`` +
  ``key.json``, or ``<name>.parquet``) and then ``<name>_stats.json``, its done marker (the layout
  img2dataset produces). A re-run skips every output whose stats file exists, so stages are
  idempotent and resumable per shard.
* At the end ``Summary`` prints what was kept and dropped and writes ``<stage>_summary.json``.

It is one module (about 500 lines) on purpose: the whole stage contract, read in one place by
whoever writes a new stage.
"""

from __future__ import annotations

import errno
import functools
import http.client
import json
import logging
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from pathlib import Path, PurePosixPath

import numpy as np

import sd.cli
import sd.data.shards
import sd.files

log = logging.getLogger("pipeline")

MAX_EXAMPLES = 20  # keys named per skip reason in a stats file
DEFAULT_WORKERS = min(8, os.cpu_count() or 1)  # image decoding threads, in every stage that has them
DEFAULT_RETRIES = 2  # extra tries of a failed download, in every stage that downloads
# The most bytes one archive member (an image, a prompt table) or one input image file may hold: a
# few-kilobyte zip member can inflate to gigabytes. Such members are skipped as "too_large_member".
MAX_MEMBER_BYTES = 256 << 20


# ---------------------------------------------------------------------------------------------
# Outputs and their done markers
# ---------------------------------------------------------------------------------------------


def disk_full(error: BaseException) -> bool:
    """Whether ``error`` says the disk (or the user's quota) is full: an OSError's errno, or the text of
    a library's own error (pyarrow's and DuckDB's carry no errno)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(error)
    return os.strerror(errno.ENOSPC) in text or os.strerror(errno.EDQUOT) in text


def ends_cleanly_on_a_full_disk(stage: str):
    """A stage's ``main``, ended by a full disk with one line on stderr and exit status 1 instead of a
    traceback (or of every later sample failing in turn). What it finished stays: each output is written
    whole under a temporary name, which is removed, and renamed; the same command then resumes."""
    def wrap(main):
        @functools.wraps(main)
        def guarded(*args, **kwargs):
            try:
                return main(*args, **kwargs)
            except Exception as error:
                if not disk_full(error):
                    raise
                where = f" writing {error.filename}" if getattr(error, "filename", None) else ""
                print(f"{stage}.py: error: the disk is full{where} ({error}); free some space, then run the same "
                      "command again: the finished outputs are kept and it goes on from them", file=sys.stderr)
                return 1
        return guarded
    return wrap


def output_paths(out_dir: Path, name: int | str, suffix: str = ".tar") -> tuple[Path, Path]:
    """An output and its stats file, the done marker: ``NNNNN.tar`` + ``NNNNN_stats.json`` for shard
    number N; ``<name><suffix>`` + ``<name>_stats.json`` for an output named after its input."""
    stem = f"{name:05d}" if isinstance(name, int) else name
    return Path(out_dir) / f"{stem}{suffix}", Path(out_dir) / f"{stem}_stats.json"


def output_done(out_dir: Path, name: int | str, suffix: str = ".tar") -> bool:
    data, stats = output_paths(out_dir, name, suffix)
    return stats.exists() and data.exists()


class ShardStats:
    """Counts of one output: kept samples and skipped ones by reason, with example keys."""

    def __init__(self):
        self.successes = 0
        self.failed: Counter = Counter()
        self.examples: dict[str, list[str]] = {}

    def skip(self, reason: str, name: str) -> None:
        self.failed[reason] += 1
        examples = self.examples.setdefault(reason, [])
        if len(examples) < MAX_EXAMPLES:
            examples.append(name)

    def as_dict(self, **extra) -> dict:
        return {"count": self.successes + sum(self.failed.values()), "successes": self.successes,
                "failed": dict(sorted(self.failed.items())), "examples": self.examples, **extra}


def admit_sample(stats: ShardStats, seen: set, key: str, caption: str) -> bool:
    """A sample with a caption and a key new to its shard (``seen`` then holds it); the rest are counted."""
    if not caption:
        stats.skip("no_caption", key)
        return False
    if key in seen:
        stats.skip("duplicate_key", key)
        return False
    seen.add(key)
    return True


def write_output(out_dir: Path, name: int | str, write, stats: ShardStats, suffix: str = ".tar", **extra) -> dict:
    """Write an output with ``write(tmp_path)`` and then its stats file (the done marker), both atomically."""
    data, stats_path = output_paths(out_dir, name, suffix)
    sd.files.write_atomic(data, write)
    record = stats.as_dict(**extra)
    sd.files.write_json_atomic(stats_path, record)
    return record


def write_shard(out_dir: Path, index: int, samples: list[sd.data.shards.ShardSample], stats: ShardStats, **extra) -> dict:
    """Write image shard ``index`` and then its stats file; every sample given counts as kept but one
    whose key no reader can trust (``sd.data.shards.is_valid_key``), which is left out as ``bad_key``."""
    kept = []
    for sample in samples:
        if sd.data.shards.is_valid_key(sample.key):
            kept.append(sample)
        else:
            stats.skip("bad_key", sample.key)
    stats.successes = len(kept)
    return write_output(out_dir, index, lambda tmp: sd.data.shards.write_tar(tmp, kept), stats, **extra)


class SettingsChanged(ValueError):
    """A re-run asks for other settings than the outputs already in its folder were made with."""


SETTINGS_SUFFIX = ".settings"  # not .json: img2dataset reads every *.json in its folder as a shard's stats


def settings_path(out_dir: Path, stage: str) -> Path:
    return Path(out_dir) / f"{stage}{SETTINGS_SUFFIX}"


def has_outputs(out_dir: Path) -> bool:
    """Whether a stage finished anything in ``out_dir`` (an output's stats file, or a summary)."""
    out_dir = Path(out_dir)
    return out_dir.is_dir() and any(True for pattern in ("*_stats.json", "*_summary.json")
                                    for _ in out_dir.glob(pattern))


def check_settings(out_dir: Path, stage: str, settings: dict, earlier: dict | None = None) -> dict:
    """Refuse settings that differ from those the finished outputs in ``out_dir`` were made with
    (:func:`record_settings` kept them), naming the first that differs; returns those kept ones
    (empty: a folder with no finished output takes any settings). ``earlier``: what a folder from
    before settings were kept records of them (its summary)."""
    if not has_outputs(out_dir):
        return {}
    path = settings_path(out_dir, stage)
    try:
        saved = json.loads(path.read_text()) if path.exists() else dict(earlier or {})
    except (ValueError, OSError) as error:
        raise SettingsChanged(f"{path} is unreadable ({sd.cli.first_line(error)}): the settings of the outputs in "
                              f"{out_dir} are unknown; use another output folder, or delete {out_dir}") from None
    if not isinstance(saved, dict):
        raise SettingsChanged(f"{path} is not a JSON object: use another output folder, or delete {out_dir}")
    for name, value in settings.items():
        if name in saved and saved[name] != value:
            raise SettingsChanged(f"{out_dir} holds outputs made with {name} {saved[name]!r}, not {value!r}: "
                                  f"use another output folder, or delete {out_dir} to make them again")
    return saved


def record_settings(out_dir: Path, stage: str, settings: dict, earlier: dict | None = None) -> None:
    """Keep the settings that shape a stage's outputs beside them (``<stage>.settings``, JSON), before
    any output is written, once :func:`check_settings` has accepted them. A re-run with another value
    of one of them is refused, naming it: its outputs would sit beside ones of another kind, and the
    summary would relabel the old ones."""
    saved = check_settings(out_dir, stage, settings, earlier)
    path = settings_path(out_dir, stage)
    merged = {**saved, **settings}
    if merged != saved or not path.exists():
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        sd.files.write_json_atomic(path, merged)


def keep_settings(args) -> None:
    """Record the output-shaping flags a stage's parser checked (``StageArgumentParser.shapes_outputs``):
    call once the command line is fully checked, before the first output is written."""
    stage, settings = args.output_settings
    record_settings(Path(args.out), stage, settings)


# What to change when every input was skipped for one reason (a stage adds or overrides its own).
FIXES = {
    "too_small": "images below the smallest size kept (a quarter of --resolution): a lower --resolution, or "
                 "--min_size 0 to keep small images",
    "no_caption": "each image needs its caption beside it (photo.txt for photo.jpg), or captions from "
                  "pipeline/03c_caption_images.py",
    "undecodable": "the files are not images Pillow can read",
    "unreadable_tar": "the shards cannot be read: write them again with the stage that made them",
    "truncated_tar": "the shards are cut short: write them again with the stage that made them",
    "empty_tar": "the shards hold no samples: check the stage that wrote them",
    "no_usable_sample": "no sample of the shards has an image and a caption",
    "no_latent": "the captions' keys match no latent: run encode_latents.py on the same shards as stage 04",
}


class Summary:
    """Totals of a stage run, printed at the end and written next to its outputs."""

    def __init__(self, stage: str):
        self.stage = stage
        self.kept = 0
        self.dropped: Counter = Counter()
        self.shards_written = 0
        self.shards_skipped = 0
        self.failed_inputs: dict[str, list] = {}  # reason -> whole inputs (parts, archives) that failed
        self.examples: dict[str, list[str]] = {}  # reason -> the first MAX_EXAMPLES names skipped for it

    def input_failed(self, reason: str, name, error) -> None:
        """A whole input could not be used (a missing part, a corrupt archive): count it and go on."""
        log.warning("%s %s: %s (%s)", self.stage, name, reason, error)
        self.dropped[reason] += 1
        self.note_examples({reason: [str(name)]})
        self.failed_inputs.setdefault(reason, []).append(name)

    def add(self, record: dict) -> None:
        self.kept += record["successes"]
        self.dropped.update(record.get("failed", {}))
        self.note_examples(record.get("examples", {}))
        self.shards_written += 1

    def add_done(self, stats_path: Path) -> None:
        """Count an output finished by an earlier run (read back from its stats file)."""
        record = json.loads(stats_path.read_text())
        self.kept += record.get("successes", 0)
        self.dropped.update(record.get("failed", {}))
        self.note_examples(record.get("examples", {}))
        self.shards_skipped += 1

    def note_examples(self, examples: dict[str, list]) -> None:
        for reason, names in examples.items():
            kept = self.examples.setdefault(reason, [])
            kept.extend(names[: MAX_EXAMPLES - len(kept)])

    def pending(self, out_dir: Path, names: list, suffix: str = ".tar") -> list:
        """The names whose outputs are not done yet, in order; the finished ones are counted."""
        todo = []
        for name in names:
            if output_done(out_dir, name, suffix):
                self.add_done(output_paths(out_dir, name, suffix)[1])
            else:
                todo.append(name)
        return todo

    def path(self, out_dir: Path) -> Path:
        return Path(out_dir) / f"{self.stage}_summary.json"

    def nothing_kept(self, fixes: dict[str, str] | None = None) -> str | None:
        """Why this run kept nothing of a non-empty input (each reason with its count, examples and, from
        ``fixes`` or ``FIXES``, what to change), or None when it kept something or was given nothing."""
        if self.kept or not sum(self.dropped.values()):
            return None
        fixes = {**FIXES, **(fixes or {})}
        reasons = sorted(((n, reason) for reason, n in self.dropped.items() if n), reverse=True)
        said = "; ".join(f"{reason} {n}{named(self.examples.get(reason, []), n)}"
                         + (f": {fixes[reason]}" if reason in fixes else "") for n, reason in reasons)
        return f"kept nothing: {said}"

    def exit_code(self, fixes: dict[str, str] | None = None) -> int:
        """The stage's exit status after ``finish``: 1, with ``nothing_kept``'s line on stderr, when a
        non-empty input gave nothing (the next stage would find nothing to read), else 0."""
        problem = self.nothing_kept(fixes)
        if problem is None:
            return 0
        print(f"{self.stage}.py: error: {problem}", file=sys.stderr)
        return 1

    def finish(self, out_dir: Path, **extra) -> dict:
        """Write ``<stage>_summary.json`` into ``out_dir`` and print the totals in one line."""
        examples = {reason: names for reason, names in sorted(self.examples.items()) if names}
        record = {"stage": self.stage, "kept": self.kept, "dropped": dict(sorted(self.dropped.items())),
                  "shards_written": self.shards_written, "shards_already_done": self.shards_skipped,
                  **({"examples": examples} if examples else {}), **extra}
        sd.files.write_json_atomic(self.path(out_dir), record)
        dropped = ", ".join(f"{reason} {n}{named(self.examples.get(reason, []), n)}"
                            for reason, n in sorted(self.dropped.items()) if n) or "none"
        shards = (f" shards written {self.shards_written}, already done {self.shards_skipped};"
                  if self.shards_written or self.shards_skipped else "")
        print(f"{self.stage}: kept {self.kept}; dropped: {dropped};{shards} output in {out_dir}")
        return record


def named(names: list, count: int, shown: int = 3) -> str:
    """`` (a.png, b.png, ...)``: the first ``shown`` of ``count`` skipped names, for a console line."""
    if not names:
        return ""
    more = ", ..." if count > min(shown, len(names)) else ""
    return f" ({', '.join(str(name) for name in names[:shown])}{more})"


# ---------------------------------------------------------------------------------------------
# Images
# ---------------------------------------------------------------------------------------------


def encode_jpeg(rgb: np.ndarray, quality: int = 95) -> bytes:
    import cv2

    ok, data = cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise sd.data.shards.ImageSkip("undecodable", "JPEG encoding failed")
    return data.tobytes()


def default_min_size(resolution: int) -> int:
    """The smallest width and height an import at ``resolution`` keeps unless told otherwise (01e's
    ``--min_size``): a quarter of it."""
    return resolution // 4


def read_caption(path: Path) -> str | None:
    """A caption file's text, stripped: "" when the file is missing or empty, None when it is not UTF-8
    (replacing the bad bytes would train on a caption nobody wrote)."""
    try:
        return path.read_text(encoding="utf-8").strip() if path.is_file() else ""
    except UnicodeDecodeError:
        return None


def check_import(caption: str | None, size: tuple[int, int] | None = None, *, min_size: int = 0,
                 max_pixels: int = sd.data.shards.DEFAULT_MAX_PIXELS) -> None:
    """Stage 01e's five rules of what it skips, which the studio's Data page shows before an import
    (``sd.studio.data.scan_folder``): ``sd.data.shards.ImageSkip`` with the reason of the first rule that
    refuses the image. Its caption first (None: the caption file is not UTF-8, ``bad_caption_encoding``;
    empty: ``no_caption``), then its ``(width, height)`` read from the header (``too_large``, ``extreme_aspect``,
    ``too_small``: ``sd.data.shards.check_size``). ``size`` None asks the caption's rules alone."""
    if caption is None:
        raise sd.data.shards.ImageSkip("bad_caption_encoding", "the caption file is not UTF-8")
    if not caption:
        raise sd.data.shards.ImageSkip("no_caption", "the caption file is missing or empty")
    if size is not None:
        sd.data.shards.check_size(*size, max_pixels, min_size=min_size)


def image_sample(key: str, data: bytes, ext: str, caption: str, resolution: int, metadata: dict | None = None,
                 max_pixels: int = sd.data.shards.DEFAULT_MAX_PIXELS, keep_aspect: str | None = None,
                 mask: bytes | None = None, controls: dict | None = None) -> sd.data.shards.ShardSample:
    """Decode, resize, re-encode as JPEG. Without ``keep_aspect``: the short side scaled to
    ``resolution`` and the centre square cut out; with ``keep_aspect`` "short" or "long": the whole
    image with that side scaled to ``resolution`` (``sd.data.shards.resize_keep_aspect``).

    ``mask``: the image file of the sample's loss mask (``sd.data.shards.decode_mask``), resized and
    cropped as the image is and written as ``<key>.mask.png``. ``controls``: its conditioning images
    by name, each an image file (``sd.data.shards.decode_control``) or a function ``(width, height) ->
    pixels`` given the decoded image's size that draws one (a COCO subject mask), of that size or
    another of its aspect ratio; each is resized and cropped as the image is and written as
    ``<key>.<name>.png``.

    Raises ``sd.data.shards.ImageSkip`` (with a reason) for an unusable image, mask or conditioning
    image; for the last two its ``member`` names which. The metadata records the original size and the written one.
    """
    rgb = sd.data.shards.decode_image(data, ext.lower().lstrip("."), max_pixels)
    height, width = rgb.shape[:2]
    grey = None if mask is None else companion(sd.data.shards.MASK_NAME, sd.data.shards.decode_mask, mask,
                                               (width, height), max_pixels)
    drawn = {name: companion(name, sd.data.shards.decode_control, source, (width, height), max_pixels)
             for name, source in (controls or {}).items()}

    def resize(pixels):
        if keep_aspect:
            return sd.data.shards.resize_keep_aspect(pixels, resolution, keep_aspect)
        return sd.data.shards.resize_center_crop(pixels, resolution)

    resized = resize(rgb)
    meta = {"key": key, "caption": caption, "original_width": width, "original_height": height,
            "width": resized.shape[1], "height": resized.shape[0], **(metadata or {})}
    return sd.data.shards.ShardSample(key, encode_jpeg(resized), "jpg", caption, json.dumps(meta).encode("utf-8"),
                                      mask=None if grey is None else sd.data.shards.encode_mask(resize(grey)),
                                      controls={name: sd.data.shards.encode_png(resize(pixels))
                                                for name, pixels in drawn.items()})


def companion(name: str, decode, source, size: tuple[int, int], max_pixels: int) -> np.ndarray:
    """An image's loss mask or conditioning image ``name`` at the image's ``size`` ``(width, height)``:
    ``decode(source, size, max_pixels)`` for a file's bytes, ``source(width, height)`` (scaled to ``size``
    when drawn at another of its aspect ratio) for a function that draws it. A failure is an ``ImageSkip``
    with ``member`` set to ``name``."""
    try:
        if callable(source):
            return sd.data.shards.scaled_to_image(source(*size), size, "control_mismatch", "conditioning image")
        return decode(source, size, max_pixels)
    except sd.data.shards.ImageSkip as skip:
        skip.member = name
        raise


def _to_sample(item: tuple, resolution: int, max_pixels: int):
    key, data, ext, caption, metadata, *controls = item
    try:
        return key, image_sample(key, data, ext, caption, resolution, metadata, max_pixels,
                                 controls=controls[0] if controls else None)
    except sd.data.shards.ImageSkip as skip:
        return key, skip


def convert_images(items, stats: ShardStats, pool, resolution: int, max_pixels: int = sd.data.shards.DEFAULT_MAX_PIXELS,
                   read_ahead: int = 32) -> list[sd.data.shards.ShardSample]:
    """``image_sample`` over ``(key, data, ext, caption, metadata)`` items on a thread pool, in order (an item
    may end with its conditioning images, ``image_sample``'s ``controls``).

    At most ``read_ahead`` raw images are held at once (a whole archive would not fit in memory);
    unusable images are counted in ``stats``.
    """
    samples, batch = [], []

    def flush():
        for key, result in pool.map(lambda item: _to_sample(item, resolution, max_pixels), batch):
            if isinstance(result, sd.data.shards.ImageSkip):
                stats.skip(result.reason, key)
            else:
                samples.append(result)
        batch.clear()

    for item in items:
        batch.append(item)
        if len(batch) >= read_ahead:
            flush()
    flush()
    return samples


def image_extension(name: str) -> str | None:
    ext = name.rsplit(".", 1)[-1].lower() if "." in name else ""
    return ext if ext in sd.data.shards.IMAGE_EXTENSIONS else None


# ---------------------------------------------------------------------------------------------
# Archives
# ---------------------------------------------------------------------------------------------


def is_safe_member(name: str) -> bool:
    """An archive member path that stays inside the folder it is extracted to."""
    if not name or name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        return False
    parts = PurePosixPath(name.replace("\\", "/")).parts
    return ".." not in parts


def safe_extract_path(target: Path, name: str) -> Path:
    """Where member ``name`` goes inside ``target``; raises ValueError if it would land outside."""
    if not is_safe_member(name):
        raise ValueError(f"unsafe archive member path {name!r}")
    target = Path(target).resolve()
    path = (target / name).resolve()
    if target != path and target not in path.parents:
        raise ValueError(f"unsafe archive member path {name!r}")
    return path


# ---------------------------------------------------------------------------------------------
# Downloads
# ---------------------------------------------------------------------------------------------


class DownloadError(RuntimeError):
    """A download that failed for good; ``missing`` when the file is not there at all (HTTP 404/410,
    or a local path that does not exist), as opposed to a server or network that kept failing."""

    def __init__(self, message: str, missing: bool = False):
        super().__init__(message)
        self.missing = missing


HUB_HOSTS = ("huggingface.co", "hf.co")


def on_hub(url: str) -> bool:
    """Whether ``url`` is on the Hugging Face hub: huggingface.co, hf.co or ``HF_ENDPOINT``'s host."""
    hosts = set(HUB_HOSTS)
    if os.environ.get("HF_ENDPOINT"):
        hosts.add(urllib.parse.urlsplit(os.environ["HF_ENDPOINT"]).netloc.lower())
    return urllib.parse.urlsplit(url).netloc.lower() in hosts


def hub_token(url: str) -> str | None:
    """``HF_TOKEN`` (read from the environment only) for a URL on the hub, for gated datasets; None for
    any other host."""
    token = os.environ.get("HF_TOKEN", "").strip()
    return token if token and on_hub(url) else None


class _TokenStaysOnItsHost(urllib.request.HTTPRedirectHandler):
    """Follow redirects, but never carry the hub token to another host (the hub redirects downloads
    to a CDN; urllib would forward every header)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlsplit(newurl).netloc != urllib.parse.urlsplit(req.full_url).netloc:
            new.remove_header("Authorization")
        return new


_OPENER = urllib.request.build_opener(_TokenStaysOnItsHost)


def download(url: str, dest: Path, *, retries: int = DEFAULT_RETRIES, backoff: float = 1.0, timeout: float = 60.0) -> Path:
    """Fetch ``url`` to ``dest`` unless it is already there; resume a partial ``.part`` file.

    Transient failures (connection errors, timeouts, HTTP 429 and 5xx) are retried with exponential
    backoff; other HTTP errors (404, 403, ...) fail at once. The file appears under its name only
    once complete: a body shorter than its Content-Length (or Content-Range total) is a failed try,
    and a 206 reply that does not start where the partial file ends fails at once. A local path or
    ``file://`` URL is read directly.
    """
    dest = Path(dest)
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    for attempt in range(retries + 1):
        try:
            _fetch(url, part, timeout)
            os.replace(part, dest)
            return dest
        except urllib.error.HTTPError as error:
            if error.code != 429 and error.code < 500:
                part.unlink(missing_ok=True)
                hint = ""
                if error.code in (401, 403) and on_hub(url):
                    hint = (" (a gated or private file: accept its terms on its page, then export HF_TOKEN=<a read "
                            "token>)" if hub_token(url) is None else " (HF_TOKEN was sent: does it grant this file?)")
                raise DownloadError(f"{url}: HTTP {error.code}{hint}", missing=error.code in (404, 410)) from error
            reason = f"HTTP {error.code}"
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as error:
            if disk_full(error):  # no retry makes room: the stage ends (ends_cleanly_on_a_full_disk)
                raise
            reason = str(error)
        if attempt == retries:
            raise DownloadError(f"{url}: gave up after {retries + 1} tries ({reason})")
        wait = backoff * 2**attempt
        log.warning("%s: %s; retrying in %.1fs", url, reason, wait)
        time.sleep(wait)
    raise AssertionError("unreachable")


def archive_to_shard(args, index: int, name: str, convert, errors: tuple, summary: Summary, missing_reason: str,
                     **extra) -> None:
    """Download ``{args.base_url}/{name}`` and write shard ``index`` from ``convert(path) -> (samples, stats)``.

    A missing or undownloadable archive is counted (``missing_reason`` / ``download_failed``); a corrupt
    one (``convert`` raising one of ``errors``) is counted as ``bad_archive`` and deleted, so a re-run
    fetches it again. The archive is deleted once its shard is written unless ``args.keep_archives``.
    """
    try:
        path = download(f"{args.base_url.rstrip('/')}/{name}", args.download_dir / name, retries=args.retries)
    except DownloadError as error:
        summary.input_failed(missing_reason if error.missing else "download_failed", index, error)
        return
    try:
        samples, stats = convert(path)
    except errors as error:
        path.unlink(missing_ok=True)
        summary.input_failed("bad_archive", index, error)
        return
    summary.add(write_shard(args.out, index, samples, stats, source=path.name, **extra))
    if not args.keep_archives:
        path.unlink(missing_ok=True)


def _fetch(url: str, part: Path, timeout: float) -> None:
    if "://" not in url or url.startswith("file://"):
        source = Path(url[len("file://"):] if url.startswith("file://") else url)
        if not source.exists():
            raise DownloadError(f"{source} does not exist", missing=True)
        sd.files.write_atomic(part, lambda tmp: Path(tmp).write_bytes(source.read_bytes()))
        return
    have = part.stat().st_size if part.exists() else 0
    headers = {"Range": f"bytes={have}-"} if have else {}
    if token := hub_token(url):
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, headers=headers)
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            start, total = _reply_range(url, part, response, have)
            expected = response.headers.get("Content-Length")
            with open(part, "ab" if start else "wb") as handle:
                written = 0
                while chunk := response.read(1 << 20):
                    handle.write(chunk)
                    written += len(chunk)
    except http.client.HTTPException as error:  # IncompleteRead and kin: the body was cut short
        raise ConnectionError(f"connection cut short ({error!r})") from error
    if expected is not None and written != int(expected):
        raise ConnectionError(f"short read: {written} of {expected} bytes")
    if total is not None and part.stat().st_size != total:
        raise ConnectionError(f"short read: {part.stat().st_size} of {total} bytes")


def _reply_range(url: str, part: Path, response, have: int) -> tuple[int, int | None]:
    """``(offset the body starts at, whole size or None)``. A 206 whose Content-Range does not start
    where the partial file ends (a server answering a range nobody asked for) would splice two files:
    it is refused, and the partial file is dropped so the next try starts clean."""
    if response.status != 206:
        return 0, None  # the whole file: any partial one is overwritten
    content_range = response.headers.get("Content-Range") or ""
    match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", content_range.strip())
    if match is None or int(match.group(1)) != have:
        part.unlink(missing_ok=True)
        raise DownloadError(f"{url}: the server sent partial content ({content_range or 'no Content-Range'}) "
                            f"that does not start at byte {have}, where the download stands")
    return have, None if match.group(3) == "*" else int(match.group(3))


# ---------------------------------------------------------------------------------------------
# LAION metadata columns (stages 02 and 03)
# ---------------------------------------------------------------------------------------------


# Column names across LAION releases, most common first; matched case-insensitively.
COLUMN_CANDIDATES = {
    "url": ("URL", "url"),
    "caption": ("TEXT", "caption", "text"),
    "width": ("WIDTH", "width"),
    "height": ("HEIGHT", "height"),
    "aesthetic": ("aesthetic", "AESTHETIC_SCORE", "aesthetic_score", "prediction"),
    "similarity": ("similarity", "clip_similarity", "SIMILARITY"),
    "watermark": ("pwatermark", "watermark"),
    "nsfw": ("punsafe", "NSFW"),
}

class UsageError(Exception):
    """A command-line problem found before any work: the stage exits 2 with this message."""


def shard_stem(path: Path) -> str:
    """A shard's file name without ``.tar``: the name of its outputs."""
    return path.name[: -len(".tar")]


def input_shards(pattern: str) -> dict[str, Path]:
    """The ``.tar`` shards ``pattern`` matches, by stem, in sorted order. None matching, or two sharing a file
    name (their outputs would collide), is a ``UsageError``."""
    import glob

    paths = sorted(Path(p) for p in glob.glob(pattern) if p.endswith(".tar"))
    if not paths:
        raise UsageError(f"no shards match {pattern!r}")
    by_stem = {shard_stem(path): path for path in paths}
    if len(by_stem) != len(paths):
        raise UsageError("two input shards share a file name; their outputs would collide")
    return by_stem


def input_sample_count(paths: list[Path]) -> int | None:
    """The input shards' kept samples from their stats files, for the progress bar (None without them)."""
    total = 0
    for path in paths:
        try:
            stats = path.with_name(f"{shard_stem(path)}_stats.json")
            total += int(json.loads(stats.read_text())["successes"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
    return total


def companion_name(file_name: str, names: tuple[str, ...]) -> str | None:
    """The name of ``names`` whose ``_NAME`` ends the file's stem (the longest, if several do), or None."""
    stem = file_name.rsplit(".", 1)[0]
    found = [name for name in names if stem.endswith(f"_{name}")]
    return max(found, key=len) if found else None


def list_images(src: Path, names: tuple[str, ...] = (sd.data.shards.MASK_NAME,)) -> tuple[list[str], dict[str, list[str]]]:
    """``(images, {name: companion files})``: relative POSIX paths under ``src``, sorted; a companion is an
    image file whose name ends in ``_NAME`` (``photo_mask.png``, ``photo_canny.png``) for one of ``names``,
    and is never an image itself.

    Hidden entries are skipped: macOS ``._photo.jpg`` resource forks and ``.ipynb_checkpoints``
    copies look like images but are not part of the dataset.
    """
    images, companions = [], {name: [] for name in names}
    for folder, subfolders, files in os.walk(src):
        subfolders[:] = [name for name in subfolders if not name.startswith(".")]
        relative = Path(folder).relative_to(src)
        for name in files:
            if not name.startswith(".") and image_extension(name):
                rel = (relative / name).as_posix()
                owner = companion_name(name, names)
                (images if owner is None else companions[owner]).append(rel)
    return sorted(images), {name: sorted(files) for name, files in companions.items()}


def find_column(names: list[str], role: str, given: str | None = None) -> str | None:
    """The column of ``names`` playing ``role``: ``given`` if set (an absent one is a UsageError),
    else the first candidate present, compared case-insensitively; None when there is none."""
    by_lower = {name.lower(): name for name in names}
    if given is not None:
        if given in names:
            return given
        if given.lower() in by_lower:
            return by_lower[given.lower()]
        raise UsageError(f"no column {given!r} (--{role}_col); columns are {', '.join(names)}")
    for candidate in COLUMN_CANDIDATES[role]:
        if candidate.lower() in by_lower:
            return by_lower[candidate.lower()]
    return None


TEXT_ROLES = ("url", "caption")  # every other role is a number (or, for nsfw, a label)


def check_column_types(path: Path, schema, columns: dict) -> None:
    """The detected columns hold what their role needs: text for URL and caption; numbers or text (read
    as numbers, junk failing its filter) for the rest. A list, struct or binary column is a UsageError
    naming the file, the column and its type, before any row is read."""
    import pyarrow as pa

    def is_text(kind):
        return pa.types.is_string(kind) or pa.types.is_large_string(kind) or (
            pa.types.is_dictionary(kind) and is_text(kind.value_type))

    def is_scalar(kind):
        return is_text(kind) or pa.types.is_integer(kind) or pa.types.is_floating(kind) or \
            pa.types.is_decimal(kind) or pa.types.is_null(kind) or pa.types.is_boolean(kind)

    for role, name in columns.items():
        if name is None:
            continue
        kind = schema.field(name).type
        if not (is_text(kind) if role in TEXT_ROLES else is_scalar(kind)):
            wanted = "text" if role in TEXT_ROLES else "numbers"
            raise UsageError(f"{path}: column {name!r} ({role}) holds {kind}, not {wanted}")


def detect_columns(path: Path, names: list[str], overrides: dict) -> dict:
    """role -> column name (or None) for one file; missing required columns are a UsageError."""
    columns = {role: find_column(names, role, overrides.get(role)) for role in COLUMN_CANDIDATES}
    for role in ("url", "caption"):
        if columns[role] is None:
            raise UsageError(f"{path}: no {role} column (looked for {'|'.join(COLUMN_CANDIDATES[role])}; "
                             f"columns are {', '.join(names)}); name it with --{role}_col")
    return columns


def parquet_columns(path: Path, overrides: dict) -> dict:
    """``detect_columns`` and ``check_column_types`` from a parquet file's schema (no row is read);
    an unreadable file is a UsageError naming it."""
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except Exception as error:  # pyarrow raises several types for a damaged file
        raise UsageError(f"{path}: not a readable parquet file ({error})") from error
    columns = detect_columns(path, schema.names, overrides)
    check_column_types(path, schema, columns)
    return columns


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------


class StageArgumentParser(sd.cli.ArgumentParser):
    """The command line of a pipeline stage: sd.cli's conventions, one line on stderr and exit 2 for a
    bad command line, and the flags stages share (``--input``, ``--out``, ``--workers``, ``--retries``,
    ``--resolution``, the download flags) spelled, defaulted and checked in one place.

    ``StageArgumentParser(__file__, __doc__)``: the script's name as prog, its docstring as description.
    """

    def __init__(self, script: str, doc: str | None):
        super().__init__(prog=Path(script).name, description=doc)
        self.required_dests: list[str] = []  # required flags that have an alias: argparse cannot check them
        # (dest, predicate, message) run after parsing; "{value}" in the message is the flag's value
        self.checks: list[tuple[str, object, str]] = []
        self.shaping: tuple[str, ...] = ()  # flags whose values shape the outputs (shapes_outputs)

    def shapes_outputs(self, *dests: str) -> None:
        """These flags shape what is written to ``--out``: a re-run into a folder of finished outputs
        made with other values stops while parsing, naming the flag; the stage records them with
        :func:`keep_settings` before it writes its first output."""
        self.shaping = dests

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        missing = [f"--{dest}" for dest in self.required_dests if getattr(parsed, dest) is None]
        if missing:
            self.error(f"the following arguments are required: {', '.join(missing)}")
        for dest, predicate, message in self.checks:
            if not predicate(getattr(parsed, dest)):
                self.error(message.format(value=getattr(parsed, dest)))
        if self.shaping:
            parsed.output_settings = (Path(self.prog).stem, {f"--{d}": getattr(parsed, d) for d in self.shaping})
            try:
                check_settings(Path(parsed.out), *parsed.output_settings)
            except SettingsChanged as error:
                self.exit(2, f"{self.prog}: {error}\n")
        return parsed

    def add_required(self, flag: str, help: str, *, old: tuple[str, ...] = (), **kwargs) -> None:
        """A required flag; ``old`` spellings keep working as hidden aliases."""
        dest = flag.lstrip("-")
        self.add_argument(flag, required=not old, default=None, help=f"{help} (required)", **kwargs)
        for spelling in old:
            self.add_alias(spelling, dest, **kwargs)
        if old:
            self.required_dests.append(dest)

    def add_input(self, help: str, *, old: tuple[str, ...] = ()) -> None:
        """``--input``: what the stage reads."""
        self.add_required("--input", help, old=old)

    def add_out(self, help: str) -> None:
        """``--out``: the folder the stage writes; an existing file there is refused before any work."""
        self.add_required("--out", help)
        self.checks.append(("out", lambda path: not Path(path).exists() or Path(path).is_dir(),
                            "--out {value} is a file, not a folder"))

    def add_workers(self, help: str = "threads decoding and resizing images") -> None:
        self.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help=help)
        self.checks.append(("workers", lambda n: n >= 1, "--workers must be >= 1"))

    def add_retries(self, help: str = "extra tries of a failed download") -> None:
        self.add_argument("--retries", type=int, default=DEFAULT_RETRIES, help=help)
        self.checks.append(("retries", lambda n: n >= 0, "--retries must be >= 0"))

    def add_resolution(self, help: str = "side of the square output images in pixels") -> None:
        self.add_argument("--resolution", type=int, default=512, help=help)
        self.checks.append(("resolution", lambda n: n >= 8, "--resolution must be >= 8"))

    def add_download_flags(self, archives: str) -> None:
        """The flags every archive-downloading stage shares; ``archives`` names what it downloads."""
        self.add_argument("--download_dir", default=None,
                          help=f"where {archives} are downloaded (default: OUT/_downloads)")
        self.add_bool("--keep_archives",
                      help=f"keep the downloaded {archives} once their shards are written (default: delete them)")
        self.add_workers()
        self.add_retries()

    def number_list(self, text: str, flag: str) -> list[int]:
        """``--flag 1-3,7`` -> ``[1, 2, 3, 7]``; a bad or empty list is a command-line error."""
        try:
            numbers = parse_range(text)
        except ValueError as error:
            self.error(f"{flag}: {error}")
        if not numbers:
            self.error(f"{flag}: no numbers given")
        return numbers


def start_downloads(args, stage: str) -> Summary:
    """What a downloading stage does once its command line is read: logging on, ``args.out`` created and
    ``args.download_dir`` resolved (default ``OUT/_downloads``) as Paths; returns the stage's Summary."""
    setup_logging()
    args.out = Path(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    args.download_dir = Path(args.download_dir) if args.download_dir else args.out / "_downloads"
    return Summary(stage)


def parse_range(text: str) -> list[int]:
    """``"1-3,7"`` -> ``[1, 2, 3, 7]`` (inclusive ranges, sorted, without repeats)."""
    numbers = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not match:
            raise ValueError(f"not a number or a range: {part!r} (use e.g. 1-500 or 1,4,9)")
        low, high = int(match.group(1)), int(match.group(2) or match.group(1))
        if high < low:
            raise ValueError(f"empty range {part!r}")
        numbers.update(range(low, high + 1))
    return sorted(numbers)


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")

"""Training data: latent folders, caption datasets, and the deterministic order of each epoch.

* A latent folder holds either shards written by ``encode_latents.py`` (``NNNNN.npy`` of shape
  ``(N, 4, H/8, W/8)`` float16 + ``NNNNN.keys.txt``, and ``latents.json``) or one ``<key>.npy`` per
  image (the older layout). ``LatentStore`` loads it into RAM with a thread pool, or memory-maps it.
  A folder whose ``latents.json`` says ``"complete": false`` (an encoder run not finished) is refused,
  and a damaged file (a truncated ``.npy``, bad JSON, keys that are not UTF-8) is a ``DataError``
  naming it.
* A caption dataset is a ``datasets`` Arrow folder (``save_to_disk``) with ``train`` and
  ``validation`` splits holding ``key``, ``caption`` and ``input_ids`` (77 CLIP token ids).
* A latent folder encoded with ``encode_latents.py --buckets`` holds, per shard, one array per
  aspect-ratio bucket (``NNNNN.WxH.npy``) and ``NNNNN.buckets.json`` (the buckets in the order of
  ``NNNNN.keys.txt``, whose keys are grouped by bucket, and each sample's original size and crop).
  Such a folder is recognised by those files alone; square and bucketed folders mix in one phase.
* ``epoch_order`` mixes several datasets by weight into one deterministic order per (seed, epoch);
  ``epoch_batches`` cuts it into each rank's micro-batches: ``rank_batches`` (a disjoint slice of the
  order) when every sample has one shape, else ``bucket_batches`` (every batch from one bucket). With ``flip``, ``flip_coins`` draws one
  coin per position of that order, also from (seed, epoch) alone: a sample whose coin is True is
  read from the latents of its mirrored image (``NNNNN.flip.npy``). With caption operations
  (``sd.data.captions``) each sample's tags are shuffled and dropped by a generator seeded from
  (seed, epoch, its position in the order). Nothing else is random, so a resumed run only needs the
  epoch and its position to continue exactly.
* Loss masks (``masked_loss``): ``NNNNN.mask.npy`` (per bucket ``NNNNN.WxH.mask.npy``), float16
  ``(N, 1, H/8, W/8)`` weights in 0..1 beside a shard's latents; a shard without one weighs 1
  everywhere, and a mirrored latent takes its mask mirrored.
* Reflow pairs (``reflow``, ``SD_Reflow.py``): ``NNNNN.noise.npy`` float16, the shape of the latents beside
  it, the noise each latent was drawn from by a flow model's ODE; every shard must have one.
* Preference pairs (``preference.method: dpo``, ``encode_latents.py --pairs``): ``NNNNN[.WxH].rejected.npy``
  float16, the shape of the latents beside it: each row the rejected image of the pair whose preferred image
  is the latents' row, encoded at the same size and crop; every shard must have one.
* Conditioning images (a ControlNet run's ``control``): ``NNNNN[.WxH].<name>.pngs`` (each row's PNG at pixel
  resolution, concatenated) and ``NNNNN[.WxH].<name>.offsets.npy`` beside the latents; every shard must
  have them, and a mirrored latent takes its conditioning image mirrored.
"""

from __future__ import annotations

import copy
import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import sd.cli
import sd.data.buckets
import sd.data.captions
from sd.settings import COUNT, FREE, MATH, NON_NEGATIVE, ORDER, POSITIVE, OnResume, refused, setting
from sd.cli import ConfigError


@dataclass(frozen=True)
class DataConfig:
    """The data's reading: epoch size, threads, memory-mapped latents, mirrored images, loss masks."""

    epoch_size: int = setting("samples per epoch across all datasets; 0 = every sample once", 0,
                              allowed=NON_NEGATIVE, resume=refused(ORDER))
    threads: int = setting("threads that read latent files into the page cache at start", 16, allowed=COUNT)
    mmap_latents: bool = setting("read latent shards from storage on demand instead of reading them all once at "
                                 "start (for latent sets larger than RAM)", False)
    allow_missing_latents: bool = setting("drop captions without a latent (reported) instead of stopping", False,
                                          resume=OnResume(FREE, "a changed number of samples is refused by itself"))
    flip: bool = setting("train each sample on the latents of its mirrored image with probability 1/2 (a coin "
                         "fixed by seed, epoch and position); needs latents from encode_latents.py --flip", False,
                         resume=refused(ORDER))
    masked_loss: bool = setting("weight each sample's loss by its mask (photo_mask.png beside photo.jpg at import, "
                                "NNNNN.mask.npy from encode_latents.py): black pixels teach nothing, white ones in "
                                "full; samples without a mask weigh 1", False, resume=refused(MATH))

    def check(self, config, check_paths: bool = True) -> None:
        """Each ``datasets`` entry: known keys, existing folders (``check_paths``), a finite weight > 0."""
        if check_paths:
            for i, entry in enumerate(config.datasets):
                check_dataset_entry(i, entry)


def check_dataset_entry(i: int, entry) -> None:
    """One ``{dataset: DIR, latents: DIR, weight: W}``: known keys, existing folders, a finite weight > 0."""
    if not isinstance(entry, dict):
        raise ConfigError(f"datasets[{i}]: expected a mapping with dataset, latents, weight")
    unknown = set(entry) - {"dataset", "latents", "weight"}
    if unknown:
        raise ConfigError(f"datasets[{i}]: unknown keys {sorted(unknown)} (allowed: dataset, latents, weight)")
    for key in ("dataset", "latents"):
        if key not in entry:
            raise ConfigError(f"datasets[{i}].{key} is missing")
        if not Path(str(entry[key])).is_dir():
            raise ConfigError(f"datasets[{i}].{key}: folder {entry[key]} does not exist")
    weight = entry.get("weight", 1.0)
    if isinstance(weight, str):  # YAML reads 1e-3 (no dot) as a string
        try:
            weight = float(weight)
        except ValueError:
            pass
    if not POSITIVE.allows(weight):
        raise ConfigError(f"datasets[{i}].weight must be {POSITIVE.describe()}, got {entry.get('weight')!r} "
                          "(the share of each epoch drawn from this dataset, relative to the others)")

class DataError(ValueError):
    """A problem with the user's data, with a message that names the files involved."""


# ---------------------------------------------------------------------------------------------
# Latents
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataSettings:
    """The config fields the training data is built from: the datasets and how their latents are read."""

    datasets: tuple = ()  # {dataset: DIR, latents: DIR, weight: 1.0} each
    data_threads: int = 16
    mmap_latents: bool = False
    allow_missing_latents: bool = False
    flip: bool = False
    masked_loss: bool = False
    reflow: bool = False
    rejected: bool = False  # preference pairs: each latent's rejected image (NNNNN.rejected.npy)
    control: str = ""
    caption_ops: sd.data.captions.CaptionOps = field(default_factory=sd.data.captions.CaptionOps)

    @classmethod
    def from_config(cls, config) -> "DataSettings":
        return sd.cli.view_of(cls, config, datasets=tuple(config.datasets),
                              rejected=config.preference.method == "dpo",
                              caption_ops=sd.cli.view_of(sd.data.captions.CaptionOps, config))


class LatentStore:
    """All latents of one folder, addressable by key.

    Shard files (``NNNNN.npy``) are memory-mapped, never copied into a process: every rank of a node
    reads the same pages of the page cache, so the node holds one copy of the latents however many
    ranks it runs. ``mmap=False`` reads every file once at start so the rows are in the page cache
    before training (``share=(i, n)``: this process reads every n-th file from the i-th, the node's
    ranks splitting the work); ``mmap=True`` reads rows from storage on demand (latent sets larger
    than RAM; the trainer builds batches in a background thread). The older one-file-per-image
    layout is loaded into this process's memory. ``flip=True`` also maps the latents of the mirrored
    images (``encode_latents.py --flip``) into ``flipped``, and stops naming the folder when they are
    not there. ``shapes`` lists the latent shapes held (one unless the folder is bucketed) and
    ``bucket_of_row`` each row's index into it. ``masks=True`` maps the loss masks
    (``NNNNN.mask.npy``) into ``masks``, laid out like ``arrays`` (None for a shard without one).
    ``noise=True`` maps each shard's reflow noise (``NNNNN.noise.npy``) into ``noises``, ``rejected=True``
    each shard's rejected images of preference pairs (``NNNNN.rejected.npy``) into ``rejected``.
    """

    def __init__(self, folder: str | Path, *, threads: int = 16, mmap: bool = False, flip: bool = False,
                 share: tuple[int, int] = (0, 1), masks: bool = False, control: str = "", noise: bool = False,
                 rejected: bool = False):
        self.folder = Path(folder)
        self.warm_share = None if mmap else share
        if not self.folder.is_dir():
            raise DataError(f"latent folder {self.folder} does not exist")
        self.meta = read_latents_meta(self.folder)
        shard_files = sorted(self.folder.glob("*.keys.txt"))
        if shard_files:
            self._load_shards(shard_files, threads)
        else:
            self._load_per_image(sorted(self.folder.glob("*.npy")), threads)
        if not self.keys:
            raise DataError(f"latent folder {self.folder} holds no latents (no *.keys.txt shards, no <key>.npy files)")
        self.flipped = self._load_flipped(shard_files, threads) if flip else None
        self.masks = self._load_masks(threads) if masks else None
        self.noises = self._load_beside("noise", threads) if noise else None
        self.rejected = self._load_beside("rejected", threads) if rejected else None
        self.control = control
        self.controls = self._load_controls(control) if control else None

    # -- loading ------------------------------------------------------------------------------

    def _load_shards(self, key_files: list[Path], threads: int) -> None:
        shards = [part for key_file in key_files for part in shard_parts(key_file)]  # (npy, keys, mmapped array)
        bucketed = any(bucket_layout_path(f).exists() for f in key_files)
        if not bucketed:  # one resolution per folder: a shard of another shape is a mistake, not a bucket
            self._check_shapes([(npy, a.shape[1:]) for npy, _, a in shards])
        self.keys = [k for _, keys, _ in shards for k in keys]
        self.arrays = [a for _, _, a in shards]
        self.paths = [npy for npy, _, _ in shards]
        self.locations = np.concatenate(
            [np.stack([np.full(len(k), i), np.arange(len(k))], 1) for i, (_, k, _) in enumerate(shards)]
        )
        self._index_shapes([tuple(a.shape[1:]) for a in self.arrays], [len(k) for _, k, _ in shards])
        self._warm(self.paths, threads)
        self._index_keys()

    def _index_shapes(self, array_shapes: list[tuple], rows: list[int]) -> None:
        self.shapes = sorted(set(array_shapes), key=lambda s: (sd.data.buckets.aspect(s), s))
        index = {shape: i for i, shape in enumerate(self.shapes)}
        self.bucket_of_row = np.repeat(np.array([index[s] for s in array_shapes], dtype=np.int16), rows)
        self.sample_shape = self.shapes[0] if len(self.shapes) == 1 else None  # None: several buckets

    def _warm(self, files: list[Path], threads: int) -> None:
        """Read this process's share of ``files`` once, into the page cache (no copy is kept)."""
        if self.warm_share is None:
            return
        index, count = self.warm_share
        with ThreadPoolExecutor(max(1, threads)) as pool:
            list(pool.map(read_through, files[index::count]))

    def _load_per_image(self, files: list[Path], threads: int) -> None:
        files = [f for f in files if not f.name.endswith(".flip.npy")]
        self.keys = [f.stem for f in files]
        if not files:
            return
        first = load_npy(files[0])
        self.sample_shape = tuple(first.shape[-3:])
        data = np.empty((len(files), *self.sample_shape), dtype=np.float16)
        bad: list[str] = []

        def copy(i):
            array = load_npy(files[i])
            if array.shape[-3:] != self.sample_shape or array.size != data[i].size:
                bad.append(f"{files[i].name} {array.shape}")
                return
            data[i] = array.reshape(self.sample_shape)

        with ThreadPoolExecutor(max(1, threads)) as pool:
            list(pool.map(copy, range(len(files))))
        if bad:
            raise DataError(
                f"{len(bad)} latent files in {self.folder} do not have the shape {self.sample_shape} of "
                f"{files[0].name}: {', '.join(sorted(bad)[:10])}"
            )
        self.arrays = [data]
        self.locations = np.stack([np.zeros(len(files), dtype=np.int64), np.arange(len(files))], 1)
        self._index_shapes([self.sample_shape], [len(files)])
        self._index_keys()

    def _load_flipped(self, key_files: list[Path], threads: int) -> list[np.ndarray]:
        """The mirrored images' latents, laid out like ``self.arrays`` so ``self.locations`` address them."""
        if key_files:  # beside each shard's (or bucket's) array
            paths = [p.with_name(p.name[: -len(".npy")] + ".flip.npy") for p in self.paths]
        else:  # one file per image
            paths = [self.folder / f"{key}.flip.npy" for key in self.keys]
        missing = [p.name for p in paths if not p.exists()]
        if missing:
            raise DataError(f"data.flip: latent folder {self.folder} has no flipped latents for {len(missing)} of "
                            f"{len(paths)} files (e.g. {missing[:3]}); encode it with encode_latents.py --flip, or "
                            "set data.flip: false")
        arrays = [load_npy(p, mmap=True) for p in paths]  # a damaged file is a DataError naming it
        # (rows, sample shape) of the latents each flipped file mirrors: the shards, already mapped
        expected = ([(len(a), a.shape[1:]) for a in self.arrays] if key_files
                    else [(1, self.sample_shape)] * len(paths))
        bad = [f"{p.name} {a.shape}" for p, a, (n, shape) in zip(paths, arrays, expected)
               if a.size != n * int(np.prod(shape))]
        if bad:
            raise DataError(f"data.flip: {len(bad)} flipped latent files in {self.folder} do not match their latents "
                            f"({', '.join(bad[:10])})")
        arrays = [a.reshape(n, *shape) for a, (n, shape) in zip(arrays, expected)]
        if key_files:
            self._warm(paths, threads)
            return arrays
        data = np.empty((len(self.keys), *self.sample_shape), dtype=np.float16)
        offsets = np.cumsum([0] + [n for n, _ in expected])

        def copy(i):
            data[offsets[i] : offsets[i + 1]] = arrays[i]

        with ThreadPoolExecutor(max(1, threads)) as pool:
            list(pool.map(copy, range(len(arrays))))
        return [data]

    def _load_masks(self, threads: int) -> list[np.ndarray | None]:
        """The loss masks beside each shard's (or bucket's) array, memory-mapped; None where there are none
        (and for the one-file-per-image layout, which has no masks)."""
        if not hasattr(self, "paths"):  # the one-file-per-image layout
            return [None] * len(self.arrays)
        paths = [p.with_name(p.name[: -len(".npy")] + ".mask.npy") for p in self.paths]
        masks = [load_npy(p, mmap=True) if p.exists() else None for p in paths]
        bad = [f"{p.name} {m.shape}" for p, m, a in zip(paths, masks, self.arrays)
               if m is not None and m.shape != (len(a), 1, *a.shape[2:])]
        if bad:
            raise DataError(f"{len(bad)} mask files in {self.folder} do not match their latents (expected (rows, 1, "
                            f"h, w) of the latents beside them): {', '.join(bad[:10])}; re-encode those shards")
        self._warm([p for p, m in zip(paths, masks) if m is not None], threads)
        return masks

    # What lies beside each shard's latents, row for row (``_load_beside``): its file's suffix, what it is, and the
    # way to a folder that has it.
    BESIDE = {"noise": ("noise", "flow.reflow", "train on a folder SD_Reflow.py wrote, or set flow.reflow: "
                        "false", "draw those shards again with SD_Reflow.py"),
              "rejected": ("rejected latents", "preference.method: dpo", "encode the pair shards with "
                           "encode_latents.py --pairs, or unset preference.method", "encode those shards again")}

    def _load_beside(self, suffix: str, threads: int) -> list[np.ndarray]:
        """``NNNNN[.WxH].<suffix>.npy`` beside each shard's array, memory-mapped; a shard without it, or with one
        of another shape than its latents, is a DataError naming it."""
        what, setting, way, again = self.BESIDE[suffix]
        if not hasattr(self, "paths"):
            raise DataError(f"{self.folder} holds one latent file per image, which carries no {what}: {way}")
        paths = [p.with_name(p.name[: -len(".npy")] + f".{suffix}.npy") for p in self.paths]
        missing = [p.name for p in paths if not p.exists()]
        if missing:
            raise DataError(f"{setting}: {len(missing)} latent shards in {self.folder} have no {what} beside them "
                            f"({', '.join(missing[:5])}): {way}")
        arrays = [load_npy(p, mmap=True) for p in paths]
        bad = [f"{p.name} {n.shape}" for p, n, a in zip(paths, arrays, self.arrays) if n.shape != a.shape]
        if bad:
            raise DataError(f"{len(bad)} {what} files in {self.folder} do not match their latents' shape: "
                            f"{', '.join(bad[:10])}; {again}")
        self._warm(paths, threads)
        return arrays

    def gather_noise(self, rows: np.ndarray) -> np.ndarray:
        """The reflow noise of the given rows, ``(B, 4, h, w)`` float16, in order."""
        return self._rows(self.noises, rows)

    def gather_rejected(self, rows: np.ndarray) -> np.ndarray:
        """The rejected latents of the given rows' pairs, ``(B, 4, h, w)`` float16, in order."""
        return self._rows(self.rejected, rows)

    def _load_controls(self, name: str) -> list[tuple[np.ndarray, np.ndarray]]:
        """The conditioning images ``name`` beside each shard's (or bucket's) array: ``(its PNG bytes,
        memory-mapped; their offsets)``. A shard without them, or with offsets that do not match its rows
        or its bytes, is a DataError naming it."""
        if not hasattr(self, "paths"):
            raise DataError(f"{self.folder} holds one latent file per image, which carries no conditioning images: "
                            f"encode the images' shards with encode_latents.py --control {name}")
        import sd.data.encode

        controls, missing, bad = [], [], []
        for path, array in zip(self.paths, self.arrays):
            data_path, offsets_path = sd.data.encode.control_files(path, name)
            if not (data_path.exists() and offsets_path.exists()):
                missing.append(data_path.name)
                continue
            try:
                offsets = np.load(offsets_path, allow_pickle=False)
            except (OSError, ValueError, EOFError):
                offsets = np.zeros(0, dtype=np.int64)  # named below as not matching its data
            size = data_path.stat().st_size
            if offsets.shape != (len(array) + 1,) or offsets[0] != 0 or offsets[-1] != size \
                    or (np.diff(offsets) <= 0).any():
                bad.append(offsets_path.name)
                continue
            controls.append((np.memmap(data_path, dtype=np.uint8, mode="r"), offsets))
        if missing:
            raise DataError(f"{len(missing)} latent shards in {self.folder} lack their conditioning images "
                            f"{name!r} ({', '.join(missing[:5])}): encode the shards with encode_latents.py --control "
                            f"{name} (into a new folder, or after removing those shards' keys files)")
        if bad:
            raise DataError(f"{len(bad)} conditioning-image offset files in {self.folder} do not match their data "
                            f"({', '.join(bad[:5])}); re-encode those shards")
        return controls

    def gather_controls(self, rows: np.ndarray, flipped: np.ndarray | None = None) -> np.ndarray:
        """Conditioning images of the given rows, ``(B, 3, H, W)`` uint8 RGB, in order, mirrored where the
        boolean ``flipped`` is True (the conditioning image of the mirrored image).

        Each PNG is decoded into its place in the batch, a grey one broadcast to three channels and a
        mirrored one read backwards: one copy of each image's pixels (about 1.7 ms a 512 x 512 edge map
        here, nearly all of it the PNG decoding)."""
        import sd.data.shards

        images = None
        for i, (shard, row) in enumerate(self.locations[rows]):
            data, offsets = self.controls[shard]
            try:
                pixels = sd.data.shards.png_pixels(data[offsets[row] : offsets[row + 1]])
            except ValueError as error:
                raise DataError(f"{self.paths[shard].name}: the conditioning image {self.control!r} of row {row} does "
                                f"not decode ({error}); re-encode the shard") from None
            if images is None:
                images = np.empty((len(rows), 3, *pixels.shape[:2]), dtype=np.uint8)
            elif pixels.shape[:2] != images.shape[2:]:
                raise DataError(f"{self.folder}: one batch asked for conditioning images of several sizes "
                                f"{sorted({images.shape[2:], pixels.shape[:2]})}")
            pixels = pixels[:, ::-1] if flipped is not None and flipped[i] else pixels
            images[i] = pixels if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
        return images

    @property
    def has_masks(self) -> bool:
        """Whether masks were loaded and any shard has one."""
        return self.masks is not None and any(m is not None for m in self.masks)

    def _check_shapes(self, shapes: list[tuple[Path, tuple]]) -> None:
        reference = shapes[0][1]
        bad = [f"{path.name} {tuple(shape)}" for path, shape in shapes if tuple(shape) != tuple(reference)]
        if bad:
            raise DataError(
                f"{len(bad)} latent shards in {self.folder} differ from the sample shape {tuple(reference)} of "
                f"{shapes[0][0].name}: {', '.join(bad[:10])}"
            )

    def _index_keys(self) -> None:
        self.row_of = {}
        duplicates = []
        for row, key in enumerate(self.keys):
            if key in self.row_of:
                duplicates.append(key)
            self.row_of[key] = row
        if duplicates:
            raise DataError(f"{len(duplicates)} keys appear twice in {self.folder}, e.g. {duplicates[:5]}")

    # -- access -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.keys)

    def gather(self, rows: np.ndarray, flipped: np.ndarray | None = None) -> np.ndarray:
        """Latents of the given rows, ``(B, 4, h, w)`` float16, in order.

        Where the boolean ``flipped`` is True, those of the mirrored image (needs ``flip=True``).
        """
        latents = self._rows(self.arrays, rows)
        if flipped is not None and flipped.any():
            if self.flipped is None:
                raise DataError(f"flipped latents of {self.folder} were asked for but not loaded (flip=False)")
            latents[flipped] = self._rows(self.flipped, rows[flipped])
        return latents

    def gather_masks(self, rows: np.ndarray, flipped: np.ndarray | None = None) -> np.ndarray:
        """Loss masks of the given rows, ``(B, 1, h, w)`` float16, in order: 1 where a shard has none, and
        mirrored where the boolean ``flipped`` is True (the mask of the mirrored image)."""
        where = self.locations[rows]
        shape = self.arrays[where[0, 0]].shape[2:]
        out = np.ones((len(rows), 1, *shape), dtype=np.float16)
        masked = np.array([self.masks[shard] is not None for shard in where[:, 0]], dtype=bool)
        if masked.any():
            out[masked] = self._rows(self.masks, rows[masked])
        if flipped is not None and flipped.any():
            out[flipped] = out[flipped][..., ::-1]
        return out

    def _rows(self, arrays: list[np.ndarray], rows: np.ndarray) -> np.ndarray:
        """One fancy-indexed read per shard touched (rows sorted within it), scattered back in order."""
        where = self.locations[rows]
        touched = np.unique(where[:, 0])
        shapes = {arrays[shard].shape[1:] for shard in touched}
        if len(shapes) > 1:
            raise DataError(f"{self.folder}: one batch asked for latents of several shapes {sorted(shapes)}")
        out = np.empty((len(rows), *shapes.pop()), dtype=np.float16)
        for shard in touched:
            picked = np.flatnonzero(where[:, 0] == shard)
            order = np.argsort(where[picked, 1], kind="stable")
            out[picked[order]] = arrays[shard][where[picked[order], 1]]
        return out


def bucket_layout_path(key_file: Path) -> Path:
    """``NNNNN.buckets.json`` beside ``NNNNN.keys.txt``: present only in a bucketed folder."""
    return key_file.with_name(key_file.name[: -len(".keys.txt")] + ".buckets.json")


def read_bucket_layout(path: Path, key_count: int) -> list[tuple[str, int]]:
    """``[(bucket name "WxH", rows), ...]`` in the order of the shard's keys; a damaged file is a DataError."""
    try:
        layout = json.loads(path.read_text(encoding="utf-8"))
        groups = [(sd.data.buckets.name(tuple(b["size"])), int(b["count"])) for b in layout["buckets"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(f"{path} is not a readable bucket layout ({error!r}); delete its shard's .keys.txt "
                        "and re-run encode_latents.py to encode it again") from None
    if sum(n for _, n in groups) != key_count:
        raise DataError(f"{path} counts {sum(n for _, n in groups)} samples but its keys file has {key_count}")
    return groups


def shard_parts(key_file: Path) -> list[tuple[Path, list[str], np.ndarray]]:
    """``(npy, keys, memory-mapped latents)`` of one shard: one part, or one per bucket when bucketed."""
    stem = key_file.name[: -len(".keys.txt")]
    keys = read_keys(key_file)
    layout = bucket_layout_path(key_file)
    groups = read_bucket_layout(layout, len(keys)) if layout.exists() else [(None, len(keys))]
    parts, start = [], 0
    for bucket, count in groups:
        npy = key_file.with_name(f"{stem}.npy" if bucket is None else f"{stem}.{bucket}.npy")
        if not npy.exists():
            raise DataError(f"{key_file} has no matching latent file {npy.name}")
        array = load_npy(npy, mmap=True)
        if array.ndim != 4 or array.shape[0] != count:
            raise DataError(f"{npy}: shape {array.shape} does not match its {count} keys in {key_file.name}")
        parts.append((npy, keys[start : start + count], array))
        start += count
    return parts


def read_through(path: Path, chunk: int = 1 << 20) -> int:
    """Read a file once through a reused buffer, leaving its pages in the page cache; returns bytes read."""
    buffer = bytearray(chunk)
    total = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            total += n
    return total


def read_latents_meta(folder: Path) -> dict:
    """``latents.json`` of a latent folder ({} without one); a folder encode_latents.py has not finished
    (``"complete": false``) is refused, as training on it would silently use part of the data."""
    path = Path(folder) / "latents.json"
    if not path.exists():
        return {}
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:  # ValueError: bad JSON or bad UTF-8
        raise DataError(f"{path} is not readable JSON ({error}); re-run encode_latents.py into a fresh folder") from None
    if not isinstance(meta, dict):
        raise DataError(f"{path} is not a JSON object; re-run encode_latents.py into a fresh folder")
    factor = meta.get("scaling_factor")
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))):
        raise DataError(f"{path}: scaling_factor {factor!r} is not a number")
    if meta.get("complete") is False:
        raise DataError(f"latent folder {path.parent} is not completely encoded (latents.json: complete false): "
                        "encode_latents.py was interrupted or is still running; run it again to finish")
    return meta


def resolution_of_latents(meta: dict) -> int | None:
    """The image size of a latent folder's ``latents.json`` (``read_latents_meta``): the side of its
    latents times 8, or with aspect-ratio buckets the side of a square of the largest bucket's pixel
    count (a multiple of 8); None when it records neither a latent shape nor buckets."""
    if meta.get("buckets"):
        return -(-(math.isqrt(max(w * h for w, h in meta["buckets"]) - 1) + 1) // 8) * 8
    if meta.get("latent_shape"):
        return int(meta["latent_shape"][-1]) * 8
    return None


def read_keys(key_file: Path) -> list[str]:
    """One key per line, lines ending at a newline only: ``str.splitlines`` also ends them at U+2028,
    U+0085 and other characters that a key written before they were refused may hold."""
    try:
        text = key_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"{key_file} is not readable UTF-8 text ({error})") from None
    return text.removesuffix("\n").split("\n") if text else []


def load_npy(path: Path, mmap: bool = False) -> np.ndarray:
    """A latent ``.npy`` (memory-mapped if asked); a damaged or truncated file is a DataError naming it."""
    try:
        array = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (OSError, ValueError, EOFError) as error:  # numpy raises these for a bad header or short data
        raise DataError(f"{path} is not a readable latent .npy file ({error}); delete it and re-encode its shard") from None
    if array.dtype.kind != "f":
        raise DataError(f"{path} holds {array.dtype} values, not float latents")
    return array


def latent_keys(folder: str | Path) -> list[str]:
    """The keys a latent folder holds, without loading any latents (finished shards only)."""
    folder = Path(folder)
    read_latents_meta(folder)
    key_files = sorted(folder.glob("*.keys.txt"))
    if key_files:
        return [k for f in key_files if f.with_name(f.name[: -len(".keys.txt")] + ".npy").exists()
                or bucket_layout_path(f).exists() for k in read_keys(f)]
    return [f.stem for f in sorted(folder.glob("*.npy")) if not f.name.endswith(".flip.npy")]


# ---------------------------------------------------------------------------------------------
# Captions joined to latents
# ---------------------------------------------------------------------------------------------


@dataclass
class JoinedSplit:
    """One split of one dataset: for each sample, its latent row and its 77 token ids (and, when the
    loader tokenises captions, its caption text)."""

    name: str
    store: LatentStore
    rows: np.ndarray  # (N,) int64 rows of ``store``
    input_ids: np.ndarray  # (N, 77) int64
    keys: list[str]
    captions: CaptionText | None = None

    def __len__(self) -> int:
        return len(self.rows)


class CaptionText:
    """One split's caption column, left in its memory-mapped Arrow file and read a batch at a time.

    The process holds the Arrow column (its pages are the page cache's, shared by the ranks of a
    machine, and only those of the captions read are touched), not a Python string per sample.
    ``rows``: the split row of each sample (after samples without latents are dropped); None = the same.
    """

    def __init__(self, column, rows: np.ndarray | None = None):
        self.column, self.rows = column, rows  # a pyarrow ChunkedArray of strings
        self.chunks = column.chunks  # built once: each call of ``column.chunks`` wraps every chunk anew
        self.starts = np.cumsum([0] + [len(chunk) for chunk in self.chunks])

    def __len__(self) -> int:
        return len(self.column) if self.rows is None else len(self.rows)

    def count_word(self, word: str) -> int:
        """How many of the split's captions hold ``word`` as a word of its own (any case), counted in
        Arrow over the memory-mapped column: no Python string per caption."""
        import re

        import pyarrow.compute as pc

        pattern = rf"(^|[^\w<>-]){re.escape(word)}($|[^\w<>-])"
        hits = pc.fill_null(pc.match_substring_regex(self.column, pattern, ignore_case=True), False)
        mask = hits.to_numpy(zero_copy_only=False)
        return int(mask.sum() if self.rows is None else mask[self.rows].sum())

    def read(self, local: np.ndarray) -> list[str]:
        """The captions of samples ``local`` (indices into the split), in order."""
        rows = np.asarray(local, dtype=np.int64) if self.rows is None else self.rows[local]
        chunks = np.searchsorted(self.starts, rows, side="right") - 1
        return [self.chunks[c][int(r - self.starts[c])].as_py() or "" for c, r in zip(chunks, rows)]


def load_caption_split(dataset_dir: str | Path, split: str, token_ids: bool = True):
    """``(keys, input_ids)`` of one split of a caption dataset written by ``05_build_hf_dataset.py``:
    keys a list of str, input_ids ``(N, 77)`` int64; without ``token_ids`` (a loader that tokenises the
    caption text itself) ``(N, 0)``: 616 bytes a row not held (800 MB a rank at 1.3M rows).

    Both are converted column by column from the split's memory-mapped Arrow table, with no Python
    work per row (converting row by row cost 88 us a row: ~115 CPU-seconds per rank for 1.3M rows).
    """
    from datasets import DatasetDict, load_from_disk

    dataset_dir = Path(dataset_dir)
    if not dataset_dir.is_dir():
        raise DataError(f"caption dataset {dataset_dir} does not exist")
    try:
        dataset = load_from_disk(str(dataset_dir))
    except Exception as error:  # datasets raises several types for a folder it cannot read
        raise DataError(f"{dataset_dir} is not a datasets folder written by save_to_disk: {error}") from error
    if not isinstance(dataset, DatasetDict):
        raise DataError(f"caption dataset {dataset_dir} is a single table, not train/validation splits; "
                        "build it with 05_build_hf_dataset.py")
    if split not in dataset:
        if split == "train":
            raise DataError(f"caption dataset {dataset_dir} has no '{split}' split (splits: {list(dataset.keys())})")
        return [], np.zeros((0, 77), dtype=np.int64)
    missing = {"key", "input_ids"} - set(dataset[split].column_names)
    if missing:
        raise DataError(f"caption dataset {dataset_dir} split '{split}' lacks columns {sorted(missing)}")
    table = dataset[split].with_format("arrow", columns=["key", "input_ids"])[:]  # a pyarrow.Table, zero-copy
    keys = table.column("key").to_numpy(zero_copy_only=False).tolist()
    if not keys:
        return [], np.zeros((0, 77), dtype=np.int64)
    if not token_ids:
        return keys, np.zeros((len(keys), 0), dtype=np.int64)
    input_ids = token_id_rows(table.column("input_ids"), f"caption dataset {dataset_dir} split '{split}'")
    if input_ids.shape[1] != 77:
        raise DataError(f"caption dataset {dataset_dir}: input_ids have {input_ids.shape[1]} tokens, expected 77")
    return keys, input_ids


def token_id_rows(column, where: str) -> np.ndarray:
    """An Arrow column of equal-length integer lists (fixed-size or not) as an ``(N, L)`` int64 array,
    filled chunk by chunk (no combined copy of the column)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = column.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)) \
            or not pa.types.is_integer(kind.value_type):
        raise DataError(f"{where}: input_ids of type {kind} are not lists of token ids")
    if column.null_count:
        raise DataError(f"{where}: {column.null_count} input_ids rows are empty (null)")
    lengths = pc.list_value_length(column)
    width = pc.min_max(lengths)
    if width["min"].as_py() != width["max"].as_py():
        raise DataError(f"{where}: input_ids rows have {width['min']} to {width['max']} tokens, expected 77 each")
    out = np.empty((len(column), width["min"].as_py()), dtype=np.int64)
    row = 0
    for chunk in column.chunks:
        if len(chunk):
            out[row : row + len(chunk)] = chunk.flatten().to_numpy().reshape(len(chunk), -1)
            row += len(chunk)
    return out


def load_caption_text(dataset_dir: str | Path, split: str) -> CaptionText:
    """The ``caption`` column of one split (as ``load_caption_split`` checked it), memory-mapped.

    The folder is opened again on purpose: this mapping holds only the pages of the captions read,
    not those of every token id that ``load_caption_split`` copied out of its own mapping.
    """
    import pyarrow as pa
    from datasets import load_from_disk

    dataset = load_from_disk(str(dataset_dir))[split]
    if "caption" not in dataset.column_names:
        raise DataError(f"caption dataset {dataset_dir} split '{split}' has no caption column, which caption "
                        "operations (captions.shuffle_tags, captions.tag_dropout) read; rebuild it with "
                        "05_build_hf_dataset.py")
    column = dataset.with_format("arrow", columns=["caption"])[:].column("caption")  # zero-copy
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise DataError(f"caption dataset {dataset_dir} split '{split}': caption holds {column.type}, not text")
    return CaptionText(column)


def join_split(dataset_dir, split: str, store: LatentStore, *, allow_missing: bool = False,
               captions: bool = False) -> JoinedSplit:
    """Join a caption split to a latent store by key; missing latents are an error unless allowed.
    ``captions``: keep the caption text (``CaptionText``) for the loader to tokenise, instead of the
    stored token ids."""
    keys, input_ids = load_caption_split(dataset_dir, split, token_ids=not captions)
    text = load_caption_text(dataset_dir, split) if captions and keys else None
    rows = np.fromiter((store.row_of.get(k, -1) for k in keys), dtype=np.int64, count=len(keys))
    missing = rows < 0
    if missing.any():
        names = [k for k, m in zip(keys, missing) if m]
        message = (
            f"{missing.sum()} of {len(keys)} captions in {dataset_dir} ({split}) have no latent in "
            f"{store.folder}, e.g. {names[:5]}"
        )
        if not allow_missing:
            raise DataError(message + "; re-run encode_latents.py on their shards or set allow_missing_latents: true")
        keep = ~missing
        rows, input_ids, keys = rows[keep], input_ids[keep], [k for k, m in zip(keys, missing) if not m]
        if text is not None:
            text.rows = np.flatnonzero(keep)
    return JoinedSplit(str(dataset_dir), store, rows, input_ids, keys, text)


class MixedData:
    """Several joined datasets and their sampling weights, addressed by one global index.

    ``shapes`` are the latent shapes present (one per aspect-ratio bucket; one in all for square
    folders), ``bucket_of`` each global index's shape, and ``target`` where each shape trains:
    itself, or after ``merge_small`` the bucket a too-small one was merged into. ``masked``: the
    stores were loaded with their loss masks, which ``batch`` then returns as a third tensor.

    ``tokenizer``: the batches' token ids are made in the loader from the caption text (each split
    joined with ``captions=True``), after ``ops`` (``sd.data.captions.CaptionOps``; None = the text as
    written), instead of taken from the dataset's stored ids. The data tokenises with its own copy of
    the tokenizer (one tokenizer is not safe to use from two threads, and the batches are built in a
    background thread), so tokens added to the run's tokenizer later are not seen: add them first.
    """

    def __init__(self, splits: list[JoinedSplit], weights: list[float], *, tokenizer=None,
                 ops: sd.data.captions.CaptionOps | None = None):
        if not splits:
            raise DataError("no datasets")
        self.splits, self.weights = splits, list(weights)
        self.tokenizer, self.ops = (None, None) if tokenizer is None else (copy.deepcopy(tokenizer), ops)
        lacking = [s.name for s in splits if tokenizer is not None and len(s) and s.captions is None]
        if lacking:
            raise DataError(f"{lacking[0]}: the loader tokenises captions but its split was joined without its "
                            "caption text (join_split(..., captions=True))")
        self.sizes = [len(s) for s in splits]
        self.offsets = np.cumsum([0] + self.sizes)
        per_split = [[split.store.shapes[b] for b in np.unique(split.store.bucket_of_row[split.rows])]
                     for split in splits]
        self.shapes = sorted({s for shapes in per_split for s in shapes}, key=lambda s: (sd.data.buckets.aspect(s), s))
        channels = {s[0] for s in self.shapes}
        if len(channels) > 1:
            detail = ", ".join(f"{s.store.folder}: {s.store.shapes}" for s in splits)
            raise DataError(f"latent channels differ between datasets ({detail}); encode them with one VAE")
        index = {shape: i for i, shape in enumerate(self.shapes)}
        self.bucket_of = np.concatenate(
            [np.array([index.get(s, -1) for s in split.store.shapes], dtype=np.int16)[split.store.bucket_of_row[split.rows]]
             for split in splits] or [np.zeros(0, dtype=np.int16)])
        self.target = np.arange(len(self.shapes))
        self.masked = any(split.store.masks is not None for split in splits)
        self.paired = any(split.store.noises is not None for split in splits)
        self.preference = any(split.store.rejected is not None for split in splits)
        self.controlled = any(split.store.controls is not None for split in splits)
        if self.controlled and not all(split.store.controls is not None for split in splits if len(split)):
            raise DataError("conditioning images were loaded for some latent folders and not others")

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def bucket_targets(self, order: np.ndarray) -> np.ndarray | None:
        """The shape index each sample of ``order`` trains at, or None when all train at one shape."""
        targets = self.target[self.bucket_of[order]]
        return None if len(np.unique(targets)) <= 1 else targets

    def merge_small(self, order: np.ndarray, minimum: int) -> list[tuple[tuple, tuple, int]]:
        """Fold the buckets with fewer than ``minimum`` samples in ``order`` (one global batch) into the
        nearest by aspect ratio (``sd.data.buckets.merge_small``); returns ``(shape, into, samples)`` of each."""
        counts = np.bincount(self.bucket_of[order], minlength=len(self.shapes))
        goes = sd.data.buckets.merge_small({s: int(n) for s, n in zip(self.shapes, counts)}, minimum)
        index = {shape: i for i, shape in enumerate(self.shapes)}
        self.target = np.array([index[goes[s]] for s in self.shapes])
        return [(s, goes[s], int(n)) for s, n in zip(self.shapes, counts) if goes[s] != s and n]

    def shape_of(self, indices: np.ndarray) -> tuple:
        """The latent shape the samples ``indices`` train at (one batch: a single shape)."""
        targets = np.unique(self.target[self.bucket_of[indices]])
        if len(targets) != 1:
            raise DataError(f"one batch mixes latent shapes {[self.shapes[t] for t in targets]}; batches are "
                            "drawn from one bucket each (sd.data.training_data.epoch_batches)")
        return self.shapes[targets[0]]

    def batch(self, indices: np.ndarray, flipped: np.ndarray | None = None,
              draws: np.ndarray | None = None) -> tuple[torch.Tensor, ...]:
        """``(latents (B, 4, h, w) float16, input_ids (B, 77) int64)`` for global indices, in order; when
        ``masked``, also their loss masks ``(B, 1, h, w)`` float16 (``masks``); when ``paired``, then their
        reflow noise ``(B, 4, h, w)`` float16 (``noise``); when ``preference``, then their pairs' rejected latents
        ``(B, 4, h, w)`` float16 (``rejected``).

        ``flipped`` (B,) bool: which samples take the latents of their mirrored image (``flip_coins``).
        ``draws`` (B, k): the keys of each sample's caption draws (``epoch_plan``), used when the data
        has a tokenizer; without them a sample's global index is its key.
        Samples of a merged bucket are brought to the shape they train at (``sd.data.buckets.fit_latents``).
        """
        shape = self.shape_of(indices)
        which = np.searchsorted(self.offsets, indices, side="right") - 1
        stored = self.bucket_of[indices]
        latents = np.empty((len(indices), *shape), dtype=np.float16)
        input_ids = np.empty((len(indices), 77), dtype=np.int64)
        stored_ids = self.tokenizer is None  # else made from the caption text below
        for d in np.unique(which):
            split = self.splits[d]
            for b in np.unique(stored[which == d]):
                mask = (which == d) & (stored == b)
                local = indices[mask] - self.offsets[d]
                part = split.store.gather(split.rows[local], None if flipped is None else flipped[mask])
                latents[mask] = part if part.shape[1:] == shape else sd.data.buckets.fit_latents(part, shape)
                if stored_ids:
                    input_ids[mask] = split.input_ids[local]
        if not stored_ids:
            input_ids = self.caption_ids(indices, indices[:, None] if draws is None else draws)
        extra = (self.masks(indices, flipped),) if self.masked else ()
        if self.paired:
            extra = (*extra, self.noise(indices))
        if self.preference:
            extra = (*extra, self.rejected(indices))
        if self.controlled:
            extra = (*extra, self.controls(indices, flipped))
        return torch.from_numpy(latents), torch.from_numpy(input_ids), *extra

    def controls(self, indices: np.ndarray, flipped: np.ndarray | None = None) -> torch.Tensor:
        """Conditioning images ``(B, 3, 8h, 8w)`` uint8 of global indices, in order, as ``batch`` lays out their
        latents: mirrored where ``flipped``, brought to a merged bucket's size by the crop and scaling of
        its latents (``sd.data.buckets.fit_images``)."""
        shape = self.shape_of(indices)
        size = (3, 8 * shape[1], 8 * shape[2])
        which = np.searchsorted(self.offsets, indices, side="right") - 1
        stored = self.bucket_of[indices]
        images = np.empty((len(indices), *size), dtype=np.uint8)
        for d in np.unique(which):
            store = self.splits[d].store
            for b in np.unique(stored[which == d]):
                chosen = (which == d) & (stored == b)
                rows = self.splits[d].rows[indices[chosen] - self.offsets[d]]
                part = store.gather_controls(rows, None if flipped is None else flipped[chosen])
                images[chosen] = part if part.shape[1:] == size else sd.data.buckets.fit_images(part, shape)
        return torch.from_numpy(images)

    def noise(self, indices: np.ndarray) -> torch.Tensor:
        """Reflow noise ``(B, 4, h, w)`` float16 of global indices, in order (every store has it: ``reflow``
        loads it for all; no flip, no merged buckets: a pair is one latent and its noise)."""
        shape = self.shape_of(indices)
        which = np.searchsorted(self.offsets, indices, side="right") - 1
        out = np.empty((len(indices), *shape), dtype=np.float16)
        for d in np.unique(which):
            chosen = which == d
            part = self.splits[d].store.gather_noise(self.splits[d].rows[indices[chosen] - self.offsets[d]])
            if part.shape[1:] != tuple(shape):
                raise DataError(f"flow.reflow: {self.splits[d].store.folder}'s pairs of {part.shape[1:]} were put in "
                                f"a bucket of {tuple(shape)}; keep reflow data in buckets of their own size")
            out[chosen] = part
        return torch.from_numpy(out)

    def rejected(self, indices: np.ndarray) -> torch.Tensor:
        """The rejected latents ``(B, 4, h, w)`` float16 of the pairs at global indices, in order, laid out as
        ``batch`` lays out their preferred latents (brought to a merged bucket's shape the same way)."""
        shape = self.shape_of(indices)
        which = np.searchsorted(self.offsets, indices, side="right") - 1
        stored = self.bucket_of[indices]
        out = np.empty((len(indices), *shape), dtype=np.float16)
        for d in np.unique(which):
            split = self.splits[d]
            for b in np.unique(stored[which == d]):
                chosen = (which == d) & (stored == b)
                part = split.store.gather_rejected(split.rows[indices[chosen] - self.offsets[d]])
                out[chosen] = part if part.shape[1:] == shape else sd.data.buckets.fit_latents(part, shape)
        return torch.from_numpy(out)

    def masks(self, indices: np.ndarray, flipped: np.ndarray | None = None) -> torch.Tensor:
        """Loss masks ``(B, 1, h, w)`` float16 of global indices, in order, as ``batch`` lays out their
        latents: 1 for samples without one, mirrored where ``flipped``, brought to a merged bucket's shape."""
        shape = self.shape_of(indices)
        which = np.searchsorted(self.offsets, indices, side="right") - 1
        stored = self.bucket_of[indices]
        masks = np.ones((len(indices), 1, *shape[1:]), dtype=np.float16)
        for d in np.unique(which):
            store = self.splits[d].store
            if store.masks is None:
                continue
            for b in np.unique(stored[which == d]):
                chosen = (which == d) & (stored == b)
                rows = self.splits[d].rows[indices[chosen] - self.offsets[d]]
                part = store.gather_masks(rows, None if flipped is None else flipped[chosen])
                fits = part.shape[2:] == shape[1:]
                masks[chosen] = part if fits else sd.data.buckets.fit_latents(part, (1, *shape[1:]))
        return torch.from_numpy(masks)

    def caption_ids(self, indices: np.ndarray, draws: np.ndarray) -> np.ndarray:
        """``(B, 77)`` int64: the caption text of global ``indices`` after the operations, tokenised."""
        which = np.searchsorted(self.offsets, indices, side="right") - 1
        captions = [""] * len(indices)
        for d in np.unique(which):
            at = np.flatnonzero(which == d)
            for i, text in zip(at, self.splits[d].captions.read(indices[at] - self.offsets[d])):
                captions[i] = text
        return sd.data.captions.caption_ids(self.ops, self.tokenizer, captions, draws)


# ---------------------------------------------------------------------------------------------
# Epoch order
# ---------------------------------------------------------------------------------------------


def epoch_order(sizes: list[int], weights: list[float], seed: int, epoch: int, epoch_size: int | None = None):
    """Global sample indices of one epoch, mixed by weight, deterministic in ``(seed, epoch)``.

    An epoch has ``epoch_size`` samples (default: all samples once). Dataset ``i`` contributes
    ``round(epoch_size * w_i / sum(w))`` of them, drawn from fresh permutations of it (repeating it
    when it is smaller than its share); the result is shuffled as a whole.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    total = sum(sizes) if epoch_size is None else epoch_size
    weight_sum = sum(w for w, n in zip(weights, sizes) if n)
    offsets = np.cumsum([0] + list(sizes))
    parts = []
    for i, (size, weight) in enumerate(zip(sizes, weights)):
        if size == 0:
            continue
        share = int(round(total * weight / weight_sum)) if len(sizes) > 1 else total
        repeats = -(-share // size)
        local = torch.cat([torch.randperm(size, generator=generator) for _ in range(repeats)])[:share]
        parts.append(local.numpy() + offsets[i])
    order = np.concatenate(parts)
    return order[torch.randperm(len(order), generator=generator).numpy()]


_FLIP_STREAM = 0x666C6970  # "flip": keeps these coins apart from any other stream seeded from (seed, epoch)


def flip_coins(seed: int, epoch: int, size: int) -> np.ndarray:
    """One fair coin per position of an epoch's order, ``(size,)`` bool: True = the mirrored latents.

    A function of ``(seed, epoch)`` only, never of what the process drew before, so a run resumed
    mid-epoch flips the same samples; its own stream, so it is independent of ``epoch_order``'s.
    """
    return np.random.default_rng([seed % 2**63, epoch, _FLIP_STREAM]).random(size) < 0.5


def epoch_batches(data, seed: int, epoch: int, rank: int, world_size: int, batch_size: int,
                  epoch_size: int | None = None, flip: bool = False) -> tuple[list[np.ndarray], list]:
    """This rank's micro-batches of one epoch, ``(global indices per batch, flip coins per batch or None)``
    (``epoch_plan`` without the caption draws)."""
    batches, flips, _ = epoch_plan(data, seed, epoch, rank, world_size, batch_size, epoch_size, flip)
    return batches, flips


def epoch_plan(data, seed: int, epoch: int, rank: int, world_size: int, batch_size: int,
               epoch_size: int | None = None, flip: bool = False) -> tuple[list[np.ndarray], list, list]:
    """This rank's micro-batches of one epoch: ``(global indices, flip coins or None, caption draw keys
    or None)`` per batch; the keys (``sd.data.captions.draw_keys``: seed, epoch, position in the order)
    only when ``data`` tokenises captions in the loader (a ``tokenizer``).

    The order is ``epoch_order``'s; with several latent shapes (aspect-ratio buckets) each batch is
    drawn from one of them (``bucket_batches``), else the order is sliced as it is (``rank_batches``).
    Deterministic in ``(seed, epoch)``: a resumed run cuts the same batches.
    """
    order = epoch_order(data.sizes, data.weights, seed, epoch, epoch_size)
    targets = data.bucket_targets(order)
    if targets is None:
        positions = rank_batches(np.arange(len(order)), rank, world_size, batch_size)
    else:
        positions = bucket_batches(targets, seed, epoch, rank, world_size, batch_size)
    coins = flip_coins(seed, epoch, len(order)) if flip else None
    draws = getattr(data, "tokenizer", None) is not None
    return ([order[p] for p in positions], [coins[p] if flip else None for p in positions],
            [sd.data.captions.draw_keys(seed, epoch, p) if draws else None for p in positions])


_BUCKET_STREAM = 0x6275636B  # "buck": the order of an epoch's bucket batches, apart from the other streams


def bucket_batches(buckets: np.ndarray, seed: int, epoch: int, rank: int, world_size: int,
                   batch_size: int) -> list[np.ndarray]:
    """This rank's micro-batches of positions in an epoch's order, each batch from one bucket.

    ``buckets`` (N,): each position's bucket. The positions of a bucket, in the order's (shuffled)
    sequence, are cut into global batches of ``batch_size x world_size``, and rank r takes every
    world_size-th position of each from the r-th: at every step all ranks train one bucket, each on
    its own samples. A bucket's tail that does not fill a global batch is left out of this epoch
    (a different tail each epoch, as the order is reshuffled). The global batches are then
    shuffled, seeded by ``(seed, epoch)``.
    """
    global_batch = batch_size * world_size
    by_bucket = np.argsort(buckets, kind="stable")  # positions grouped by bucket, in order within each
    bounds = np.flatnonzero(np.diff(buckets[by_bucket])) + 1
    chunks = []
    for positions in np.split(by_bucket, bounds):
        full = len(positions) // global_batch * global_batch
        chunks.extend(positions[:full].reshape(-1, global_batch))
    shuffle = np.random.default_rng([seed % 2**63, epoch, _BUCKET_STREAM]).permutation(len(chunks))
    return [chunks[i][rank::world_size] for i in shuffle]


def bucket_report(data, order: np.ndarray, global_batch: int) -> list[tuple[tuple, int, int]]:
    """``(latent shape, samples, left out)`` per bucket trained in an epoch of ``order``: the tail of
    each bucket that does not fill a global batch is left out of that epoch."""
    targets = data.target[data.bucket_of[order]]
    counts = np.bincount(targets, minlength=len(data.shapes))
    return [(data.shapes[i], int(n), int(n % global_batch)) for i, n in enumerate(counts) if n]


def rank_batches(order: np.ndarray, rank: int, world_size: int, batch_size: int) -> list[np.ndarray]:
    """This rank's micro-batches of an epoch: disjoint across ranks, equal in number on every rank.

    The tail that does not fill a batch on every rank is dropped, so all ranks take the same number
    of steps (a rank with one batch more would hang the others in all-reduce).
    """
    per_rank = len(order) // (world_size * batch_size) * batch_size
    mine = order[rank : per_rank * world_size : world_size]
    return [mine[i : i + batch_size] for i in range(0, per_rank, batch_size)]


def shape_batches(data, indices: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """``indices`` cut into batches of at most ``batch_size``, each of one latent shape (a validation set
    spans every bucket; samples keep their order within a shape)."""
    targets = data.bucket_targets(indices) if len(indices) else None
    groups = [indices] if targets is None else [indices[targets == t] for t in np.unique(targets)]
    return [group[i : i + batch_size] for group in groups for i in range(0, len(group), batch_size)]


def validation_indices(sizes: list[int], weights: list[float], count: int) -> np.ndarray:
    """Up to ``count`` global indices of a mixed validation set, each dataset's share in proportion
    to its weight (capped by its size, the rest shared among the others), spread evenly over each
    dataset. Deterministic: every validation scores the same samples."""
    want = np.zeros(len(sizes), dtype=np.int64)
    open_ = [i for i, n in enumerate(sizes) if n > 0]
    left = min(count, sum(sizes))
    while left > 0 and open_:
        share = np.array([weights[i] for i in open_], dtype=np.float64)
        exact = left * share / share.sum()
        take = np.floor(exact).astype(np.int64)
        for j in np.argsort(-(exact - take), kind="stable")[: left - int(take.sum())]:
            take[j] += 1  # largest remainders
        for j, i in enumerate(open_):
            take[j] = min(take[j], sizes[i] - want[i])
            want[i] += take[j]
        left -= int(take.sum())
        open_ = [i for i in open_ if want[i] < sizes[i]]
    offsets = np.cumsum([0] + list(sizes))
    parts = [offsets[i] + np.linspace(0, sizes[i], want[i], endpoint=False).astype(np.int64)
             for i in range(len(sizes)) if want[i]]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

"""DreamBooth data: a few instance images with one prompt, and class images for prior preservation.

* ``ensure_class_images``: the class folder is filled up to ``num_class_images`` by the base model
  (``class_prompt``, DDIM with the run's ``validation_steps`` and ``validation_cfg``, seeds fixed by
  index), the ranks sharing the work; existing images are kept, so the folder is a cache that a
  rerun or a later run reuses. What they were generated with is recorded beside them
  (``class_images.json``); a run with other settings makes them again, or stops if the folder also
  holds images of the user's (``claim_class_dir``).
* ``DreamBoothData``: the instance and class images as latents (the VAE's posterior mean, encoded
  once and cached in the run folder), with the interface of ``sd.data.training_data.MixedData``. An epoch is
  ``max(instances, class images)`` samples; sample ``i`` pairs instance ``i mod instances`` with
  class image ``i mod class images``, and every micro-batch holds its instance samples followed by
  their class samples, so the loss is instance loss + ``prior_loss_weight`` x class loss
  (``sd.train.objectives.Objective.reduce``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import sd.cli
import sd.data.shards
import sd.data.training_data
import sd.distributed
import sd.files
import sd.model
import sd.runtime
import sd.sampling
from sd.settings import setting, refused, Range, NON_NEGATIVE, MATH, ORDER
from sd.cli import ConfigError

log = logging.getLogger("sd_dreambooth")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
DEFAULT_CLASS_IMAGES = 100  # num_class_images: 0, as diffusers' DreamBooth scripts
GENERATE_BATCH = 8  # class images per sampler call
CLASS_RECORD = "class_images.json"  # in class_dir: the settings its generated images were made with
GENERATED_NAME = re.compile(r"class_\d{5}\.png")  # class_image_name's


@dataclass(frozen=True)
class SubjectConfig:
    """A subject folder (DreamBooth, and a LoRA's, a token's or a fine-tune's): its images and prompt, and prior
    preservation's class images."""

    instance_dir: str = setting("a subject folder (DreamBooth; a LoRA's, a token's, a fine-tune's): images of the new "
                                "subject or style (replaces datasets)", "", resume=refused(ORDER))
    instance_prompt: str = setting("subject folder: the prompt of every instance image, e.g. 'a photo of sks dog'", "",
                                   resume=refused(MATH, subject=True))
    class_dir: str = setting("DreamBooth prior preservation: a folder of class images; the missing ones are generated "
                             "there by the base model from class_prompt", "", resume=refused(ORDER, subject=True))
    class_prompt: str = setting("DreamBooth prior preservation: the prompt of the class images, e.g. 'a photo of dog'",
                                "", resume=refused(MATH, subject=True))
    num_class_images: int = setting("class images to use in all (and generate when class_dir has fewer; the "
                                    "DreamBooth paper's 200 per instance image is a ceiling); 0 = 100", 100,
                                    allowed=NON_NEGATIVE, resume=refused(ORDER, subject=True))
    image_size: int = setting("subject folder: the instance and class images are centre-cropped and resized to this many "
                              "pixels square (a multiple of 8)", 512, allowed=Range(8), resume=refused(MATH, subject=True))
    prior_loss_weight: float = setting("weight of the class images' loss beside the instance loss", 1.0,
                                       allowed=NON_NEGATIVE, resume=refused(MATH, subject=True))

    def check(self, config, check_paths: bool = True) -> None:
        """A subject folder replaces the datasets and takes a prompt; prior preservation needs class images and
        their prompt; what a subject folder cannot give (masks, mirrored latents) is refused."""
        def need(ok, message):
            if not ok:
                raise ConfigError(message)

        if check_paths:
            need(config.datasets or self.instance_dir,
                 "datasets: list at least one {dataset: DIR, latents: DIR, weight: 1.0} (or set "
                 "subject.instance_dir)")
            need(not (config.datasets and self.instance_dir), "subject.instance_dir replaces datasets: set one of "
                                                              "them")
            need(not self.instance_dir or Path(self.instance_dir).is_dir(),
                 f"subject.instance_dir: folder {self.instance_dir} does not exist")
        need(not self.instance_dir or self.instance_prompt.strip(), "subject.instance_dir needs an "
                                                                    "subject.instance_prompt")
        need(self.image_size % 8 == 0, f"subject.image_size must be a multiple of 8, got {self.image_size}")
        need(not (self.instance_dir and config.data.masked_loss), "data.masked_loss needs masks carried by "
             "encode_latents.py (pipeline/01e_import_folder.py reads photo_mask.png beside photo.jpg); "
             "subject.instance_dir has none: set data.masked_loss: false, or import and encode the images as a "
             "dataset")
        need(not (self.instance_dir and config.data.flip), "data.flip needs latents of mirrored images from "
             "encode_latents.py; with subject.instance_dir add mirrored copies to the folder instead")
        need(bool(self.class_dir) == bool(self.class_prompt.strip()),
             "prior preservation needs both subject.class_dir and subject.class_prompt (or neither)")
        need(not self.class_dir or self.instance_dir, "subject.class_dir (prior preservation) needs "
                                                      "subject.instance_dir")
        if self.class_dir:
            classes = sd.sampling.settings_error("ddim", config.validation.steps, config.validation.cfg)
            need(classes is None, f"validation.steps {config.validation.steps} (DDIM steps of the class images of "
                 f"subject.class_dir): {classes}")

@dataclass(frozen=True)
class DreamBoothSettings:
    """The config fields DreamBooth's data reads: its images and prompts, and what the class images are
    generated with (the base model, the validation sampler's steps and guidance, the precision)."""

    instance_dir: str = ""
    instance_prompt: str = ""
    class_dir: str = ""
    class_prompt: str = ""
    num_class_images: int = 0
    prior_loss_weight: float = 1.0
    image_size: int = 512
    seed: int = 0
    out_dir: str = ""
    init_from: str = ""
    unet: str = ""
    vae: str = ""
    text_encoder: str = ""
    tokenizer: str = ""
    prediction_type: str = "epsilon"
    validation_steps: int = 30
    validation_cfg: float = 7.5
    precision: str = "bf16"

    @classmethod
    def from_config(cls, config) -> "DreamBoothSettings":
        return sd.cli.view_of(cls, config)


def class_seed(settings: DreamBoothSettings, index: int) -> int:
    """Class image ``index``'s seed: the image does not depend on the rank or batch that makes it."""
    return settings.seed * 100_003 + index


def image_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith("."))


def class_image_count(settings: DreamBoothSettings) -> int:
    return settings.num_class_images or DEFAULT_CLASS_IMAGES


def class_image_name(index: int) -> str:
    return f"class_{index:05d}.png"


def generation_settings(settings: DreamBoothSettings) -> dict:
    """What the generated class images depend on: the prompt, the base model and the sampler's settings."""
    return {"class_prompt": settings.class_prompt, "init_from": settings.init_from, "unet": settings.unet,
            "vae": settings.vae, "text_encoder": settings.text_encoder,
            "tokenizer": settings.tokenizer or settings.text_encoder, "prediction_type": settings.prediction_type,
            "sampler": "ddim", "steps": settings.validation_steps, "cfg": settings.validation_cfg,
            "size": settings.image_size, "seed": settings.seed}


def recorded_settings(folder: Path) -> dict | None:
    """The settings ``class_images.json`` records (None: there is none; {}: it is unreadable, logged)."""
    path = folder / CLASS_RECORD
    if not path.exists():
        return None
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        log.warning("%s is unreadable (%s): the settings of the class images beside it are unknown", path,
                    sd.cli.first_line(error))
        return {}
    return recorded if isinstance(recorded, dict) else {}


def settings_change(recorded: dict, settings: dict) -> str:
    """The first setting that differs, as ``"class_prompt 'a dog', not 'a cat'"``."""
    name = next(name for name in settings if recorded.get(name) != settings[name])
    return f"{name} {recorded[name]!r}, not {settings[name]!r}" if name in recorded else "unknown settings"


def claim_class_dir(settings: DreamBoothSettings, d) -> None:
    """Make the generated class images of ``class_dir`` (``class_NNNNN.png``) those of this run's
    settings, and record them there (``class_images.json``, written atomically).

    Images generated with other settings (another class_prompt, base model, size, ...) are deleted and
    made again when the folder holds nothing else; beside images of the user's, which are never
    deleted, the run stops instead, naming the change. Generated images with no record (an earlier
    version made them) are taken as this run's. Every rank decides the same from the folder as it was,
    and rank 0 changes it between two barriers.
    """
    folder = Path(settings.class_dir)
    made_with = generation_settings(settings)
    recorded = recorded_settings(folder)
    if recorded == made_with:
        return
    images = image_files(folder) if folder.is_dir() else []
    generated = [p for p in images if GENERATED_NAME.fullmatch(p.name)]
    stale = generated if recorded is not None else []
    if stale:
        theirs = [p for p in images if p not in stale]
        if theirs:
            raise sd.data.training_data.DataError(
                f"subject.class_dir {folder}: its {len(stale)} generated class images (class_*.png) were made with "
                f"{settings_change(recorded, made_with)} ({CLASS_RECORD}), and it holds {len(theirs)} other images "
                f"(e.g. {theirs[0].name}), which are never deleted: use another subject.class_dir, or delete the "
                "class_*.png files to have them made again")
        log.warning("subject.class_dir %s: its %d class images were generated with %s: generating them again", folder,
                    len(stale), settings_change(recorded, made_with))
    elif generated:
        log.warning("subject.class_dir %s: %d generated class images without a record of their settings (%s); taken "
                    "as made with this run's (delete them to have them made again)", folder, len(generated),
                    CLASS_RECORD)
    elif not missing_class_images(settings):
        return  # only the user's images, enough of them: nothing generated to record
    sd.distributed.barrier(d)  # every rank has looked before rank 0 changes the folder
    if d.is_main:
        for path in stale:
            path.unlink()
        folder.mkdir(parents=True, exist_ok=True)
        sd.files.write_json_atomic(folder / CLASS_RECORD, made_with)
    sd.distributed.barrier(d)


def missing_class_images(settings: DreamBoothSettings) -> list[int]:
    """Indices of the generated class images still to make (an image of another name counts too)."""
    folder = Path(settings.class_dir)
    have = image_files(folder) if folder.is_dir() else []
    wanted = class_image_count(settings)
    if len(have) >= wanted:
        return []
    names = {p.name for p in have}
    free = [i for i in range(wanted * 2) if class_image_name(i) not in names]
    return free[: wanted - len(have)]


def ensure_class_images(settings: DreamBoothSettings, d, pipeline) -> int:
    """Generate the missing class images with ``pipeline`` (the base model), once ``claim_class_dir``
    has checked the folder; every rank makes every ``world_size``-th block, then all meet at a barrier.
    Returns how many were made here.

    An image's pixels depend on its index alone: indices are made in fixed blocks of GENERATE_BATCH
    (block b: b * GENERATE_BATCH onwards), each block always whole and in order (those of its images
    already there, or past the count, are made and dropped), so a run stopped and resumed, or run on
    another number of ranks, writes the same files as one run that made them all at once.
    """
    claim_class_dir(settings, d)
    todo = missing_class_images(settings)
    if not todo:
        return 0
    from tqdm.auto import tqdm

    folder = Path(settings.class_dir)
    folder.mkdir(parents=True, exist_ok=True)
    wanted = set(todo)
    blocks = [range(b * GENERATE_BATCH, (b + 1) * GENERATE_BATCH) for b in sorted({i // GENERATE_BATCH for i in todo})]
    blocks = blocks[d.rank :: d.world_size]
    to_make = sum(i in wanted for block in blocks for i in block)
    if d.is_main:
        log.info("generating %d class images of %r in %s (%d ranks; subject.num_class_images %d, %d there already; "
                 "the bar shows the time left, and images finished before a stop are kept)", len(todo),
                 settings.class_prompt, folder, d.world_size, class_image_count(settings),
                 class_image_count(settings) - len(todo))
    pipeline.unet.eval()
    made = 0
    try:
        with sd.runtime.autocast(settings.precision, d.device):
            bar = tqdm(total=to_make, desc="class images", disable=not d.is_main, unit="image")
            started = time.perf_counter()
            for block in blocks:
                images = sd.sampling.generate(pipeline, settings.class_prompt, "", [class_seed(settings, i) for i in block],
                                              steps=settings.validation_steps, cfg=settings.validation_cfg,
                                              sampler=sd.sampling.default_sampler(pipeline.prediction_type),
                                              height=settings.image_size, width=settings.image_size,
                                              batch_size=GENERATE_BATCH, device=d.device)
                for index, image in zip(block, images):
                    if index in wanted:
                        save_png(folder / class_image_name(index), image)
                        made += 1
                        bar.update(1)
                if block is blocks[0] and d.is_main and to_make > made:
                    each = (time.perf_counter() - started) / made
                    log.info("class images: %.1f s each here, about %s for the %d left (subject.num_class_images "
                             "sets the count)", each, sd.cli.duration(each * (to_make - made)), to_make - made)
            bar.close()
    except KeyboardInterrupt:
        log.warning("class images: stopped after %d new ones; they are kept in %s and a re-run makes only the rest",
                    made, folder)
        raise
    finally:
        pipeline.unet.train()
    sd.distributed.barrier(d)
    return made


def save_png(path: Path, image: np.ndarray) -> None:
    from PIL import Image

    sd.files.write_atomic(path, lambda tmp: Image.fromarray(image).save(tmp, format="PNG"))


def read_images(files: list[Path], size: int) -> tuple[list[np.ndarray], list[tuple[str, str]]]:
    """Centre-square crops at ``size`` px, and ``(file, reason)`` of every image that was skipped."""
    images, skipped = [], []
    for path in files:
        try:
            image = sd.data.shards.decode_image(path.read_bytes(), path.suffix.lstrip("."))
        except sd.data.shards.ImageSkip as error:
            skipped.append((str(path), str(error)))
            continue
        images.append(sd.data.shards.resize_center_crop(image, size))
    return images, skipped


@torch.no_grad()
def encode_images(vae, images: list[np.ndarray], device, batch_size: int = 8) -> np.ndarray:
    """The VAE's posterior means ``(N, 4, h, w)`` float16, unscaled (as encode_latents.py stores them)."""
    out = []
    dtype = next(vae.parameters()).dtype
    for start in range(0, len(images), batch_size):
        batch = torch.from_numpy(np.stack(images[start : start + batch_size])).permute(0, 3, 1, 2)
        pixels = (batch.to(device, dtype) / 127.5 - 1.0).contiguous()
        out.append(vae.encode(pixels).latent_dist.mean.to(torch.float16).cpu().numpy())
    # C order: the encoder's output keeps its input's channels-last strides, and safetensors' numpy writer
    # stores an array's buffer as it lies in memory, so a strided array would come back from the cache
    # with its values scrambled (and the first run would train on another memory layout than a resume)
    return np.ascontiguousarray(np.concatenate(out)) if out else np.zeros((0, 4, 1, 1), np.float16)


def latents_of(files: list[Path], size: int, vae, device, cache: Path, what: str, write: bool = True) -> np.ndarray:
    """The latents of ``files``, from ``cache`` when it was made from the same files (names, sizes,
    modification times), image size and VAE; else encoded, and cached (written atomically) when
    ``write`` (one rank writes; the others encode the same latents for themselves)."""
    from safetensors.numpy import load_file, save_file

    vae_id = hashlib.sha256(json.dumps(dict(vae.config), sort_keys=True, default=str).encode()).hexdigest()[:16]
    stamp = hashlib.sha256(json.dumps(
        [size, vae_id] + [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]).encode()).hexdigest()
    if cache.exists():
        try:
            from safetensors import safe_open

            with safe_open(str(cache), framework="np") as handle:
                if (handle.metadata() or {}).get("stamp") == stamp:
                    return load_file(str(cache))["latents"]
        except Exception as error:  # a damaged cache is rebuilt
            log.warning("%s unreadable (%s): encoding again", cache, error)
    images, skipped = read_images(files, size)
    for name, reason in skipped:
        log.warning("%s image skipped: %s (%s)", what, name, reason)
    if not images:
        raise sd.data.training_data.DataError(f"no readable {what} image among {len(files)} files ({skipped[:1]})")
    latents = encode_images(vae, images, device)
    if write:
        sd.files.write_atomic(cache, lambda tmp: save_file({"latents": latents}, str(tmp), metadata={"stamp": stamp}))
    return latents


SUBJECT_CACHE = "subject_latents"  # in the run folder: a subject folder's latents (a LoRA's, a token's, a fine-tune's)


class DreamBoothData:
    """Instance (and class) latents with fixed prompts, addressed like ``sd.data.training_data.MixedData``."""

    def __init__(self, instance: np.ndarray, instance_ids: torch.Tensor, prior: np.ndarray | None = None,
                 prior_ids: torch.Tensor | None = None, instance_prompt: str = ""):
        self.instance, self.instance_ids = instance, instance_ids.reshape(1, -1)
        self.instance_prompt = instance_prompt  # the grid's caption of the training data
        self.prior = prior
        self.prior_ids = None if prior_ids is None else prior_ids.reshape(1, -1)
        self.sizes = [max(len(instance), len(prior) if prior is not None else 0)]
        self.weights = [1.0]
        self.splits = []

    def __len__(self) -> int:
        return self.sizes[0]

    @property
    def shapes(self) -> list[tuple]:
        return [tuple(self.instance.shape[1:])]

    def bucket_targets(self, order: np.ndarray) -> None:
        return None  # one image size: no buckets

    def batch(self, indices: np.ndarray, flipped: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(latents, input_ids)``: the instance samples of ``indices``, then (with prior preservation)
        one class sample each."""
        indices = np.asarray(indices)
        latents = [self.instance[indices % len(self.instance)]]
        ids = [self.instance_ids.expand(len(indices), -1)]
        if self.prior is not None:
            latents.append(self.prior[indices % len(self.prior)])
            ids.append(self.prior_ids.expand(len(indices), -1))
        return torch.from_numpy(np.concatenate(latents)), torch.cat(ids).clone()

    def all_input_ids(self) -> torch.Tensor:
        return torch.cat([self.instance_ids] + ([] if self.prior_ids is None else [self.prior_ids]))


def build_data(settings: DreamBoothSettings, d, vae, tokenizer, make_pipeline) -> DreamBoothData:
    """The run's DreamBooth data; class images generated first where missing (``make_pipeline()``
    gives the base-model pipeline for that)."""
    instances = image_files(settings.instance_dir)
    if not instances:
        raise sd.data.training_data.DataError(f"subject.instance_dir {settings.instance_dir} holds no "
                                              ".png/.jpg/.jpeg/.webp image")
    cache = Path(settings.out_dir) / SUBJECT_CACHE
    instance = latents_of(instances, settings.image_size, vae, d.device, cache / "instance.safetensors",
                          "instance", write=d.is_main)
    prior = prior_ids = None
    if settings.class_dir:
        ensure_class_images(settings, d, make_pipeline())
        classes = image_files(settings.class_dir)[: class_image_count(settings)]
        prior = latents_of(classes, settings.image_size, vae, d.device, cache / "class.safetensors",
                           "class", write=d.is_main)
        prior_ids = sd.model.tokenize(tokenizer, [settings.class_prompt])
        log.info("prior preservation: %d class images of %r, weight %g", len(prior), settings.class_prompt,
                 settings.prior_loss_weight)
    log.info("subject folder %s: %d images of %r at %d px", settings.instance_dir, len(instance),
             settings.instance_prompt, settings.image_size)
    return DreamBoothData(instance, sd.model.tokenize(tokenizer, [settings.instance_prompt]), prior, prior_ids,
                          settings.instance_prompt)

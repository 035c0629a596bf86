"""What the model files we write say about themselves in their safetensors header.

* ``modelspec.*`` (Stability AI's model spec 1.0.1, as sd-scripts writes it): architecture, implementation,
  title, resolution, prediction type, date; ComfyUI, AUTOMATIC1111 and model browsers read them. Every model
  file carries them: exports (single file, LoRA, embedding, ControlNet) and a checkpoint's weight files.
* ``ss_*`` (sd-scripts' training keys) in LoRA files: the network and its settings, the optimizer and
  schedule, the data (folders by their last name, image counts, the most frequent caption tags, buckets),
  steps, epochs and times; AUTOMATIC1111's Lora panel shows them (output name, date, dataset size,
  resolution, training tags). ``sshs_*``: the content hashes sd-scripts precomputes for them.

Values are strings, as the format wants. Nothing comes from the environment, and no local path is
written: a folder or model file appears by its last name only (a hub id as it is).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import sd.cli
import sd.run_folder

SPEC_VERSION = "1.0.1"
ARCHITECTURE = "stable-diffusion-v1"
STABILITY = "https://github.com/Stability-AI/generative-models"  # the original key layout (as sd-scripts names it)
# kind: (suffix of the architecture, implementation: whose key layout the file holds)
KINDS = {"checkpoint": ("", STABILITY), "unet": ("", "diffusers"), "lora": ("/lora", "diffusers"),
         "textual-inversion": ("/textual-inversion", STABILITY), "controlnet": ("/controlnet", STABILITY),
         "controlnet-diffusers": ("/controlnet", "diffusers")}
# ours: the spec's (and ComfyUI's predict_key); "flow" as SimpleTuner's and other flow models' files write it
PREDICTION_KEYS = {"epsilon": "epsilon", "v_prediction": "v", "flow": "flow"}
TAG_CAPTIONS = 100_000  # captions of a dataset whose tags are counted for ss_tag_frequency (the first ones)
TOP_TAGS = 100  # tags per dataset kept in ss_tag_frequency
OPTIMIZER_CLASSES = {"adamw": "torch.optim.adamw.AdamW", "adamw8bit": "bitsandbytes.optim.adamw.AdamW8bit",
                     "prodigy": "prodigyopt.prodigy.Prodigy",
                     "adamw_schedulefree": "schedulefree.adamw_schedulefree.AdamWScheduleFree"}
MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}
SD1_SIDE = 512  # sd-scripts' modelspec resolution of an SD 1.x model given none (determine_resolution)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("sd1-train")
    except PackageNotFoundError:  # a source tree that was not installed
        return "unknown"


def modelspec(kind: str, title: str, prediction_type: str, resolution: tuple[int, int], date: float) -> dict[str, str]:
    """The ``modelspec.*`` keys of a file of ``kind`` (``KINDS``). ``resolution``: (width, height) of the
    training images (``training_resolution``, else ``model_resolution``); ``date``: when the weights were
    trained (a Unix time; the checkpoint's save). Both are written in every file, as sd-scripts does
    (``library/sai_model_spec.py``: ``determine_resolution``'s ``WxH``, the date ISO-8601 to the second; ours
    in UTC with its offset, so the header does not depend on the machine's time zone)."""
    suffix, implementation = KINDS[kind]
    return {"modelspec.sai_model_spec": SPEC_VERSION, "modelspec.architecture": ARCHITECTURE + suffix,
            "modelspec.implementation": implementation, "modelspec.implementation_version": f"sd1-train/{version()}",
            "modelspec.title": title, "modelspec.prediction_type": PREDICTION_KEYS[prediction_type],
            "modelspec.predict_key": PREDICTION_KEYS[prediction_type],
            "modelspec.resolution": f"{resolution[0]}x{resolution[1]}",
            "modelspec.date": datetime.datetime.fromtimestamp(date, datetime.timezone.utc).isoformat(
                timespec="seconds")}


def model_resolution(unet) -> tuple[int, int]:
    """(width, height) a UNet makes by default: its config's ``sample_size`` latents (the VAE's 8x), else
    sd-scripts' ``SD1_SIDE`` square: the resolution of a model whose training images are not known."""
    size = getattr(getattr(unet, "config", None), "sample_size", None)
    if not size:
        return SD1_SIDE, SD1_SIDE
    height, width = (size, size) if isinstance(size, int) else size
    return int(width) * 8, int(height) * 8


def public_name(value) -> str | None:
    """A model or folder as the header may name it: a hub id or preset as it is, a local path by its last name."""
    if not value:
        return None
    text = str(value)
    if not Path(text).exists() and sd.cli.looks_like_hub_id(text):
        return text
    return Path(text).name


# ---------------------------------------------------------------------------------------------
# What a checkpoint of ours records of its training
# ---------------------------------------------------------------------------------------------


@dataclass
class TrainingRecord:
    """A checkpoint's resolved config, its train state (step, epoch, samples), and when its run started
    and it was saved (Unix times; None where the checkpoint predates recording them)."""

    config: dict
    state: dict
    started_at: float | None
    saved_at: float | None
    preference: dict | None = None  # the preference section of a run tuned on preference pairs (Diffusion-DPO)
    distillation: dict | None = None  # a DMD generator's dmd section, with its method

    @classmethod
    def read(cls, folder: str | Path) -> "TrainingRecord":
        folder = Path(folder)
        saved = sd.run_folder.read_saved_config(folder / "config.yaml")
        config = sd.run_folder.flat_view(saved)
        preference = saved.get("preference") if isinstance(saved.get("preference"), dict) else None
        state_file = folder / "train_state.pt"
        state = sd.run_folder.load_torch(state_file) if state_file.exists() else {}
        times = sd.run_folder.read_manifest_times(folder)
        saved_at = times.get("saved_at")
        if saved_at is None and (folder / sd.run_folder.COMPLETE).exists():
            saved_at = (folder / sd.run_folder.COMPLETE).stat().st_mtime
        distill = saved.get("distill") if isinstance(saved.get("distill"), dict) else {}
        dmd = saved.get("dmd") if isinstance(saved.get("dmd"), dict) else {}
        return cls(config, state if isinstance(state, dict) else {}, times.get("started_at"), saved_at,
                   preference if preference and preference.get("method") else None,
                   {"method": "dmd", **dmd} if distill.get("method") == "dmd" else None)



def training_resolution(config: dict) -> tuple[int, int] | None:
    """The training images' size of a run's ``config`` (a mapping): DreamBooth's ``image_size``, else the
    largest of its latent folders' (``latents.json``; a bucketed folder by its largest bucket's area); None
    when none can be read."""
    if config.get("instance_dir"):
        size = int(config.get("image_size") or 512)
        return size, size
    import sd.data.training_data

    sides = []
    for entry in config.get("datasets") or []:
        try:
            side = sd.data.training_data.resolution_of_latents(
                sd.data.training_data.read_latents_meta(Path(entry["latents"])))
        except (OSError, ValueError, KeyError, TypeError):
            side = None
        if side:
            sides.append(side)
    return (max(sides), max(sides)) if sides else None


def kohya_training_keys(record: TrainingRecord, output_name: str) -> dict[str, str]:
    """sd-scripts' ``ss_*`` training keys of a LoRA from ``record`` (the network's own: ``sd.lora.formats``)."""
    config, state = record.config, record.state
    get = config.get
    text_lr = (get("text_encoder_lr") or get("lr")) if get("lora_text_encoder") else None
    world = int(state.get("world_size", 1) or 1)
    per_epoch = steps_per_epoch(config, state)
    max_steps_of_epochs = (get("epochs") or 0) * per_epoch if per_epoch else None
    keys = {
        "ss_output_name": output_name,
        "ss_training_started_at": record.started_at, "ss_training_finished_at": record.saved_at,
        "ss_learning_rate": get("lr"), "ss_unet_lr": get("lr"), "ss_text_encoder_lr": text_lr,
        "ss_num_train_images": state.get("data_samples") or None,
        "ss_num_reg_images": get("num_class_images") if get("class_dir") else 0,
        "ss_num_epochs": num_epochs(config, state), "ss_max_train_steps": get("max_steps") or max_steps_of_epochs,
        "ss_steps": state.get("step"), "ss_epoch": epoch_number(state),
        "ss_gradient_checkpointing": bool(get("grad_checkpointing")),
        "ss_gradient_accumulation_steps": get("grad_accum"),
        "ss_lr_warmup_steps": get("warmup_steps"),
        "ss_lr_scheduler": ("constant_with_warmup" if get("optimizer") == "adamw_schedulefree"
                            else "cosine_with_min_lr" if get("min_lr_ratio") else "cosine"),
        "ss_network_dropout": get("lora_dropout"),
        "ss_mixed_precision": MIXED_PRECISION.get(get("precision"), get("precision")),
        "ss_full_fp16": False, "ss_v2": False, "ss_base_model_version": "sd_v1",
        "ss_clip_skip": get("clip_skip") if (get("clip_skip") or 1) > 1 else None,  # sd-scripts' "None": the last
        "ss_cache_latents": True, "ss_seed": get("seed"), "ss_noise_offset": get("noise_offset"),
        "ss_zero_terminal_snr": bool(get("zero_terminal_snr")),
        "ss_optimizer": optimizer_text(config),
        "ss_max_grad_norm": get("grad_clip"), "ss_caption_dropout_rate": get("cfg_dropout"),
        "ss_caption_tag_dropout_rate": get("tag_dropout"), "ss_prior_loss_weight": get("prior_loss_weight"),
        "ss_min_snr_gamma": get("min_snr_gamma"), "ss_debiased_estimation": bool(get("debiased_estimation")),
        "ss_loss_type": get("loss_type", "l2"), "ss_huber_schedule": get("huber_schedule"),
        "ss_huber_scale": get("huber_scale"), "ss_huber_c": get("huber_c"),
        "ss_batch_size_per_device": get("batch_size"),
        "ss_total_batch_size": (get("batch_size") or 0) * (get("grad_accum") or 1) * world or None,
        "ss_flip_aug": bool(get("flip")), "ss_color_aug": False, "ss_random_crop": False,
        "ss_shuffle_caption": bool(get("shuffle_tags")), "ss_keep_tokens": get("keep_tokens"),
        "ss_sd_model_name": public_name(get("init_from")), "ss_vae_name": public_name(get("vae")),
    }
    resolution = training_resolution(config)
    if resolution:
        keys["ss_resolution"] = f"({resolution[0]}, {resolution[1]})"
    keys.update(dataset_keys(config))
    keys.update(preference_keys(record.preference, get("init_from")))
    keys.update(distillation_keys(record.distillation, get("init_from")))
    return {k: str(v) for k, v in keys.items()}


def preference_keys(preference: dict | None, reference) -> dict[str, str]:
    """What a file tuned on preference pairs says of it: ``ss_training_comment`` (the free text sd-scripts' and
    AUTOMATIC1111's metadata viewers show) and ``sd_preference`` (JSON: method, beta, loss, the reference)."""
    if not preference:
        return {}
    beta, loss = float(preference["beta"]), preference.get("loss", "sigmoid")  # config.yaml holds every field
    name = public_name(reference)
    return {"ss_training_comment": f"Diffusion-DPO on preference pairs (beta {beta:g}, {loss} loss) against "
                                   f"{name or 'its base model'}",
            "sd_preference": json.dumps({"method": preference["method"], "beta": beta, "loss": loss,
                                         "reference": name})}


def distillation_keys(distillation: dict | None, teacher) -> dict[str, str]:
    """What a DMD generator's file says of it: ``ss_training_comment`` (with the sampler settings it draws with),
    ``sd_distilled`` (JSON: method, steps, timesteps, guidance, the teacher), and ``distilled`` /
    ``generator_timesteps``, which ``SD_ImageGen.py --sampler auto`` reads from a single file."""
    if not distillation:
        return {}
    import sd.sampling

    steps = int(distillation.get("steps", 1))
    timesteps = sd.sampling.onestep_timesteps(steps)
    name = public_name(teacher)
    return {"ss_training_comment": f"DMD2 distillation of {name or 'its base model'} into a {steps}-step generator "
                                   f"(timesteps {', '.join(map(str, timesteps))}): sample it with {steps} step"
                                   f"{'s' if steps > 1 else ''} at CFG 1 (ComfyUI: the lcm sampler, sgm_uniform "
                                   "scheduler; ours: --sampler onestep)",
            "sd_distilled": json.dumps({"method": "dmd", "steps": steps, "timesteps": timesteps,
                                        "guidance": float(distillation.get("guidance", 1.75)), "teacher": name}),
            "distilled": "dmd", "generator_timesteps": ",".join(map(str, timesteps))}


def epoch_number(state: dict) -> int | None:
    """``ss_epoch``: the epoch the state's last step trained in, counted from 1, as sd-scripts' train_network.py
    saves it (``save_model(..., epoch + 1)`` at an epoch's end, ``num_train_epochs`` at the end of a run that
    stops in an epoch). Our ``epoch`` counts the epochs completed and ``position`` the micro-batches into the
    next: at an epoch's end the epoch just completed, within one the epoch under way; 0 before any step."""
    if "epoch" not in state:
        return None
    return int(state["epoch"]) + (1 if state.get("position") else 0)


def steps_per_epoch(config: dict, state: dict) -> int | None:
    """The run's optimizer steps per epoch: as its record says (``steps_per_epoch``), else measured over the
    epochs it completed, else counted as the trainer cuts its samples (``rank_batches``: whole batches on every
    rank, whole accumulations); None when none of these is known."""
    if state.get("steps_per_epoch"):
        return int(state["steps_per_epoch"])
    accum = int(config.get("grad_accum") or 1)
    epoch, step = int(state.get("epoch") or 0), int(state.get("step") or 0)
    if epoch:
        return (step - int(state.get("position") or 0) // accum) // epoch or None
    samples = config.get("epoch_size") or state.get("data_samples")
    batch = int(config.get("batch_size") or 0) * int(state.get("world_size") or 1)
    return (int(samples) // batch // accum or None) if samples and batch else None


def num_epochs(config: dict, state: dict) -> int:
    """``ss_num_epochs``, a number as sd-scripts always writes it (train_network.py: ``num_train_epochs =
    ceil(max_train_steps / num_update_steps_per_epoch)``): ``epochs``, or the epochs ``max_steps`` spans
    (a part of one counting whole); the epochs begun so far (at least 1) when the steps per epoch are not known."""
    if not config.get("max_steps"):
        return int(config.get("epochs") or 1)  # the config's default
    per_epoch = steps_per_epoch(config, state)
    if per_epoch:
        return math.ceil(int(config["max_steps"]) / per_epoch)
    return max(1, epoch_number(state) or 0)


def optimizer_text(config: dict) -> str:
    """The optimizer as sd-scripts records it: its class, then its arguments."""
    name = config.get("optimizer", "adamw")
    args = f"weight_decay={config.get('weight_decay')},betas=({config.get('adam_beta1')}, {config.get('adam_beta2')})"
    return f"{OPTIMIZER_CLASSES.get(name, name)}({args})"


def dataset_keys(config: dict) -> dict[str, str]:
    """``ss_dataset_dirs``, ``ss_reg_dataset_dirs``, ``ss_tag_frequency`` and ``ss_bucket_info`` (JSON) of the
    run's data, each folder by its last name; folders that are no longer there are left out."""
    dirs, regs, tags, buckets = {}, {}, {}, Counter()
    if config.get("instance_dir"):
        for folder, into in ((config.get("instance_dir"), dirs), (config.get("class_dir"), regs)):
            count = image_count(folder)
            if count:
                into[unique(Path(folder).name, into)] = {"n_repeats": 1, "img_count": count}
        name = next(iter(dirs), None)
        if name and config.get("instance_prompt"):
            tags[name] = {config["instance_prompt"]: dirs[name]["img_count"]}
    for entry in config.get("datasets") or []:
        try:
            folder = Path(entry["dataset"])
        except (KeyError, TypeError):
            continue
        counted = caption_tags(folder)
        if counted is None:
            continue
        name = unique(folder.name, dirs)
        count, frequent = counted
        dirs[name] = {"n_repeats": 1, "img_count": count}
        tags[name] = frequent
        buckets.update(bucket_counts(Path(entry.get("latents", ""))))
    keys = {"ss_dataset_dirs": json.dumps(dirs), "ss_tag_frequency": json.dumps(tags)}
    if regs:
        keys["ss_reg_dataset_dirs"] = json.dumps(regs)
    if buckets:
        keys["ss_bucket_info"] = json.dumps(
            {"buckets": {str(i): {"resolution": list(size), "count": n}
                         for i, (size, n) in enumerate(sorted(buckets.items()))},
             "mean_img_ar_error": 0.0})
    return keys


def unique(name: str, taken: dict) -> str:
    """``name``, or ``name (2)``, ``name (3)``... when another folder of that name came first (sd-scripts' way)."""
    candidate, n = name, 2
    while candidate in taken:
        candidate, n = f"{name} ({n})", n + 1
    return candidate


def image_count(folder) -> int:
    from sd.data.dreambooth import IMAGE_SUFFIXES

    if not folder or not Path(folder).is_dir():
        return 0
    return sum(1 for p in Path(folder).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith("."))


def caption_tags(dataset_dir: Path) -> tuple[int, dict[str, int]] | None:
    """``(training captions, {tag: count})`` of a caption dataset: its comma-separated tags counted over its
    first ``TAG_CAPTIONS`` training captions (in Arrow), the ``TOP_TAGS`` most frequent kept; None when the
    folder cannot be read."""
    import pyarrow.compute as pc

    import sd.data.training_data

    try:
        text = sd.data.training_data.load_caption_text(dataset_dir, "train")
    except (sd.data.training_data.DataError, OSError, ValueError):
        return None
    column = text.column
    total = len(column)
    head = column.slice(0, min(total, TAG_CAPTIONS))
    pieces = pc.utf8_trim_whitespace(pc.list_flatten(pc.split_pattern(head, ",")))
    counts = pc.value_counts(pc.drop_null(pieces))
    pairs = [(str(v), int(n)) for v, n in zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist())
             if v]
    pairs.sort(key=lambda pair: (-pair[1], pair[0]))
    return total, dict(pairs[:TOP_TAGS])


def bucket_counts(latents: Path) -> Counter:
    """``{(width, height): images}`` over a latent folder's bucketed shards (none for a folder of one shape;
    a layout that cannot be read is passed over: training refuses it, ``read_bucket_layout``)."""
    counts = Counter()
    if not latents.is_dir():
        return counts
    for layout in sorted(latents.glob("*.buckets.json")):
        try:
            for bucket in json.loads(layout.read_text(encoding="utf-8"))["buckets"]:
                counts[tuple(int(x) for x in bucket["size"])] += int(bucket["count"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return counts


def content_hashes(tensors: dict, metadata: dict[str, str]) -> dict[str, str]:
    """sd-scripts' ``sshs_model_hash`` and ``sshs_legacy_hash`` of a LoRA file: SHA-256 of the tensor data
    after the header (what AUTOMATIC1111's additional-networks extension indexes by), and of 64 KiB at 1 MiB
    into the file written with its ``ss_*`` keys alone. The file is serialised in memory: LoRAs only."""
    import safetensors.torch

    data = safetensors.torch.save(tensors, {k: v for k, v in metadata.items() if k.startswith("ss_")})
    header = int.from_bytes(data[:8], "little")
    legacy = hashlib.sha256(data[0x100000:0x110000]).hexdigest()[:8]
    return {"sshs_model_hash": hashlib.sha256(data[8 + header:]).hexdigest(), "sshs_legacy_hash": legacy}


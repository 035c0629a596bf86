"""A run folder's format, as every reader of one sees it: sampling, exports, the ControlNet loader and
the trainer. The trainer writes it (``sd.train.checkpoint``); this module holds what reading it needs.

    out_dir/config.yaml                  the run's resolved config (``read_saved_config``)
    out_dir/checkpoints/step_NNNNNNNN/   one checkpoint: NAME.safetensors (weights), NAME.pt, NAME_rankR.pt,
                                         config.yaml, manifest.json (each file's size and xxh3-128 hash),
                                         COMPLETE (written last: only folders with it count)
    out_dir/best.json                    keep_best: the metric, step, score and checkpoint folder of the best
                                         evaluation (``best_checkpoint``)

``ema.safetensors`` holds the UNet's EMA and, under ``EMA_TEXT_PREFIX``, the text encoder's adapter's or
learned token's (``split_ema``). A folder whose files do not match its manifest is ``Damaged``; ``.pt``
files are read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load_file

from sd.cli import first_line, load_yaml_file

STEP_DIR = re.compile(r"^step_(\d{8})$")
COMPLETE = "COMPLETE"
MANIFEST = "manifest.json"
BEST_FILE = "best.json"  # in a run folder: the checkpoint of the best evaluation (keep_best)
DAMAGED_SUFFIX = ".damaged"
HASH = "xxh3_128"
HASH_CHUNK = 16 << 20  # bytes read at a time while hashing


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or the ranks' weights disagree: the run stops."""


class Damaged(CheckpointError):
    """A checkpoint folder whose files do not match its manifest or cannot be read (names the file)."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_step(folder: str | Path) -> int:
    """The step of a checkpoint folder ``step_NNNNNNNN``; ValueError for any other name."""
    match = STEP_DIR.match(Path(folder).name)
    if not match:
        raise ValueError(f"{folder} is not a checkpoint folder (step_NNNNNNNN)")
    return int(match.group(1))


def complete_checkpoints(checkpoints_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every complete checkpoint, oldest first."""
    folder = Path(checkpoints_dir)
    if not folder.is_dir():
        return []
    found = []
    for child in folder.iterdir():
        match = STEP_DIR.match(child.name)
        if match and (child / COMPLETE).exists():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(checkpoints_dir: str | Path) -> Path | None:
    found = complete_checkpoints(checkpoints_dir)
    return found[-1][1] if found else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder from itself, a run folder, or a run's ``checkpoints/`` folder."""
    path = Path(path)
    if (path / COMPLETE).exists():
        return path
    for candidate in (path / "checkpoints", path):
        latest = latest_checkpoint(candidate)
        if latest is not None:
            return latest
    raise FileNotFoundError(f"{path} is neither a complete checkpoint folder nor a run folder holding one")


# ---------------------------------------------------------------------------------------------
# The manifest
# ---------------------------------------------------------------------------------------------


def file_hash(path: Path) -> str:
    """xxh3-128 of a file's bytes, hashed straight from the page cache through a memory map (no copy
    into a buffer; measured 1.8x faster than reading into one), 16 MiB at a time."""
    import mmap

    import xxhash

    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                view = memoryview(mapped)
                try:
                    for start in range(0, size, HASH_CHUNK):
                        digest.update(view[start : start + HASH_CHUNK])
                finally:
                    view.release()
    return digest.hexdigest()


def describe_files(paths: list[Path], threads: int = 4) -> dict[str, dict]:
    """``{file name: {"size": bytes, "xxh3_128": hex}}``, files hashed in parallel threads."""
    hashes = file_hashes(paths, threads)
    return {path.name: {"size": path.stat().st_size, HASH: digest} for path, digest in zip(paths, hashes)}


def file_hashes(paths: list[Path], threads: int = 4) -> list[str]:
    """``file_hash`` of each path, in order, several files at a time."""
    with ThreadPoolExecutor(max(1, min(threads, len(paths)))) as pool:
        return list(pool.map(file_hash, paths))


def read_manifest(folder: Path) -> dict | None:
    """The manifest's ``files`` entry; None for a folder written without one (not verifiable)."""
    path = folder / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if manifest.get("hash") != HASH or not isinstance(files, dict):
            raise ValueError(f"unknown hash {manifest.get('hash')!r}")
        return files
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise Damaged(f"{path}: unreadable manifest ({first_line(error)})") from error


def best_checkpoint(run: str | Path) -> Path:
    """The checkpoint folder ``BEST_FILE`` of run folder ``run`` names (``keep_best``); FileNotFoundError
    naming what is missing."""
    path = Path(run) / BEST_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the run kept no best checkpoint (train with keep_best: fid "
                                "or clip_score, and eval_every)")
    try:
        best = json.loads(path.read_text())
        folder = Path(run) / best["checkpoint"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise FileNotFoundError(f"{path} is unreadable ({first_line(error)})") from error
    if folder.parent != Path(run) / "checkpoints" or not (folder / COMPLETE).exists():
        raise FileNotFoundError(f"{path} names {best['checkpoint']}, which is no complete checkpoint of the run")
    return folder


def read_manifest_times(folder: Path) -> dict[str, float]:
    """The times a checkpoint's manifest records (``saved_at``: when it was written, ``started_at``: when
    its run first started; Unix times), those it lacks left out; {} without a readable manifest."""
    try:
        manifest = json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return {key: float(manifest[key]) for key in ("saved_at", "started_at")
            if isinstance(manifest, dict) and isinstance(manifest.get(key), (int, float))}


def verify(folder: Path, names: list[str], hash_contents: bool = True) -> bool:
    """Check the files ``names`` of ``folder`` against its manifest: present, the recorded size and
    (with ``hash_contents``) the recorded hash. Raises ``Damaged`` naming the first file that fails;
    returns False for a folder without a manifest (nothing to check against), True when verified.
    """
    files = read_manifest(folder)
    if files is None:
        return False
    for name in names:
        path = folder / name
        if name not in files:
            raise Damaged(f"{path}: not in the checkpoint's manifest")
        if not path.exists():
            raise Damaged(f"{path}: missing")
        size = path.stat().st_size
        if size != files[name]["size"]:
            raise Damaged(f"{path}: {size} bytes where the manifest records {files[name]['size']}")
    if hash_contents:
        paths = [folder / name for name in names]
        for path, digest in zip(paths, file_hashes(paths)):
            if digest != files[path.name][HASH]:
                raise Damaged(f"{path}: contents differ from the manifest's hash (the file was changed or damaged)")
    return True


def intact(folder: Path) -> bool:
    """The cheap check: a manifest whose every file is present at its recorded size."""
    try:
        files = read_manifest(folder)
        return files is not None and verify(folder, sorted(files), hash_contents=False)
    except Damaged:
        return False


def is_split(tensor) -> bool:
    """Whether ``tensor`` is split across the ranks (a DTensor: FSDP2's parameters). Its module is
    imported only where FSDP2 runs (a second of start-up for every other process), and a tensor can be a
    DTensor only once it is."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


@torch.no_grad()
def weights_fingerprint(tensors) -> torch.Tensor:
    """Per-tensor float64 sums ``(n,)``: equal on every rank unless the replicas diverged.

    A tensor split across the ranks (an FSDP parameter, a DTensor) is summed over its slices: every
    rank gets the whole tensor's sum (a collective: every rank calls this together)."""
    tensors = [t.detach() for t in tensors]
    split = [is_split(t) for t in tensors]
    sums = torch.stack([(t.to_local() if s else t).double().sum() for t, s in zip(tensors, split)])
    if any(split):
        mask = torch.tensor(split, device=sums.device)
        parts = torch.where(mask, sums, torch.zeros_like(sums))
        torch.distributed.all_reduce(parts)
        sums = torch.where(mask, parts, sums)
    return sums.cpu()


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def load_torch(path: Path):
    if not path.exists():
        raise FileNotFoundError(f"checkpoint file {path} is missing")
    return torch.load(path, map_location="cpu", weights_only=True)


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    if not path.exists():
        raise FileNotFoundError(f"checkpoint file {path} is missing")
    return load_file(str(path))


# The training config's flat keys before it came in sections (configs and run folders written then): each is the
# field of a section now. A YAML or a saved config.yaml that uses them is read into the sections.
LEGACY_KEYS = {
    "epoch_size": ("data", "epoch_size"), "data_threads": ("data", "threads"),
    "mmap_latents": ("data", "mmap_latents"), "allow_missing_latents": ("data", "allow_missing_latents"),
    "flip": ("data", "flip"), "masked_loss": ("data", "masked_loss"),
    "shuffle_tags": ("captions", "shuffle_tags"), "keep_tokens": ("captions", "keep_tokens"),
    "tag_dropout": ("captions", "tag_dropout"), "tag_separator": ("captions", "tag_separator"),
    "flow_matching": ("flow", "matching"), "reflow": ("flow", "reflow"), "flow_density": ("flow", "density"),
    "flow_logit_mean": ("flow", "logit_mean"), "flow_logit_std": ("flow", "logit_std"),
    "flow_shift": ("flow", "shift"),
    "lora_rank": ("lora", "rank"), "lora_alpha": ("lora", "alpha"), "lora_dropout": ("lora", "dropout"),
    "lora_targets": ("lora", "targets"), "lora_conv_rank": ("lora", "conv_rank"),
    "lora_conv_alpha": ("lora", "conv_alpha"), "lora_text_encoder": ("lora", "text_encoder"),
    "lora_type": ("lora", "type"), "lora_factor": ("lora", "factor"), "dora": ("lora", "dora"),
    "lora_block_dims": ("lora", "block_dims"), "lora_block_alphas": ("lora", "block_alphas"),
    "embedding_token": ("embedding", "token"), "embedding_init": ("embedding", "init"),
    "embedding_vectors": ("embedding", "vectors"), "embedding_lr": ("embedding", "lr"),
    "embedding_train_fraction": ("embedding", "train_fraction"),
    "instance_dir": ("subject", "instance_dir"), "instance_prompt": ("subject", "instance_prompt"),
    "class_dir": ("subject", "class_dir"), "class_prompt": ("subject", "class_prompt"),
    "num_class_images": ("subject", "num_class_images"), "image_size": ("subject", "image_size"),
    "prior_loss_weight": ("subject", "prior_loss_weight"),
    "distill": ("distill", "method"), "lcm_solver_steps": ("distill", "solver_steps"),
    "lcm_guidance_min": ("distill", "guidance_min"), "lcm_guidance_max": ("distill", "guidance_max"),
    "lcm_loss": ("distill", "loss"), "lcm_huber_c": ("distill", "huber_c"),
    "lcm_timestep_scaling": ("distill", "timestep_scaling"), "lcm_target_decay": ("distill", "target_decay"),
    "control": ("controlnet", "control"), "control_dropout": ("controlnet", "dropout"),
    "controlnet_from": ("controlnet", "init_from"), "validation_controls": ("controlnet", "validation_images"),
    "text_encoder_lr": ("optim", "text_encoder_lr"),
    "text_encoder_warmup_steps": ("optim", "text_encoder_warmup_steps"), "down_lr_scale": ("optim", "down_lr_scale"),
    "mid_lr_scale": ("optim", "mid_lr_scale"), "up_lr_scale": ("optim", "up_lr_scale"),
    "min_lr_ratio": ("optim", "min_lr_ratio"), "weight_decay": ("optim", "weight_decay"),
    "adam_beta1": ("optim", "adam_beta1"), "adam_beta2": ("optim", "adam_beta2"), "adam_eps": ("optim", "adam_eps"),
    "optimizer": ("optim", "name"), "bf16_weights": ("optim", "bf16_weights"),
    "noise_offset": ("loss", "noise_offset"), "loss_type": ("loss", "type"),
    "huber_schedule": ("loss", "huber_schedule"), "huber_c": ("loss", "huber_c"),
    "huber_scale": ("loss", "huber_scale"), "debiased_estimation": ("loss", "debiased_estimation"),
    "ema_update_every": ("ema", "update_every"), "posthoc_ema_every": ("ema", "posthoc_every"),
    "ema_warmup": ("ema", "warmup"),
    "validation_data_captions": ("validation", "data_captions"), "validation_samples": ("validation", "samples"),
    "validation_steps": ("validation", "steps"), "validation_cfg": ("validation", "cfg"),
    "validation_sampler": ("validation", "sampler"), "validation_width": ("validation", "width"),
    "validation_height": ("validation", "height"),
    "eval_every": ("eval", "every"), "eval_prompts": ("eval", "prompts"), "eval_n": ("eval", "n"),
    "eval_reference": ("eval", "reference"), "eval_features": ("eval", "features"),
    "eval_clip_model": ("eval", "clip_model"), "eval_batch_size": ("eval", "batch_size"),
}


def read_saved_config(path: str | Path) -> dict:
    """A run's or checkpoint's ``config.yaml`` as written by ``config_yaml``, in sections (a file written before
    the sections, with flat keys, is read into them): the one reader of a saved config. A file that is no YAML
    mapping is a ValueError naming it (OSError when it cannot be read)."""
    saved = load_yaml_file(path)
    if not isinstance(saved, dict):
        raise ValueError(f"{path}: not a mapping of config fields")
    return in_sections(saved)


def in_sections(values: dict) -> dict:
    """``values`` with every flat key of ``LEGACY_KEYS`` moved into its section (a section given as a mapping
    keeps what it says; ``distill: lcm`` is the distill section's method)."""
    nested = {key: dict(value) if isinstance(value, dict) else value for key, value in values.items()
              if key not in LEGACY_KEYS or isinstance(value, dict)}
    for key, value in values.items():
        if key in LEGACY_KEYS and not isinstance(value, dict):
            section, name = LEGACY_KEYS[key]
            nested.setdefault(section, {}).setdefault(name, value)
    return nested


def flat_view(saved: dict) -> dict:
    """A saved config (``read_saved_config``) as one mapping of names: its top-level fields, and each section's
    fields by their flat names of ``LEGACY_KEYS`` (what the readers of a run's records ask by)."""
    view = {key: value for key, value in saved.items() if not isinstance(value, dict)}
    for flat, (section, name) in LEGACY_KEYS.items():
        holder = saved.get(section)
        if isinstance(holder, dict) and name in holder:
            view[flat] = holder[name]
    return view


def saved_value(saved: dict, name: str, default=None):
    """A field of a saved config (``read_saved_config``) by its dotted name (``lora.rank``), or ``default``."""
    section, _, field = name.rpartition(".")
    holder = saved.get(section, {}) if section else saved
    return holder.get(field, default) if isinstance(holder, dict) else default


# ---------------------------------------------------------------------------------------------
# The EMA file
# ---------------------------------------------------------------------------------------------

EMA_TEXT_PREFIX = "text_encoder."  # the text adapter's EMA in ema.safetensors; the UNet's keys never start so


def split_ema(state: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """``ema.safetensors``' tensors as ``(the UNet's, the text adapter's)``, the prefix taken off the latter."""
    unet = {name: tensor for name, tensor in state.items() if not name.startswith(EMA_TEXT_PREFIX)}
    text = {name[len(EMA_TEXT_PREFIX):]: tensor for name, tensor in state.items() if name.startswith(EMA_TEXT_PREFIX)}
    return unet, text

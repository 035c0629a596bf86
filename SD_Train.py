"""Train the SD 1.x UNet for one phase.

    torchrun --nproc_per_node=N SD_Train.py --config configs/phases/p1_laion_broad.yaml [--FIELD VALUE ...]

Reads: parse config -> set up distributed -> build models, data, optimizer -> resume or init ->
loop over optimizer steps (``train_step``) with logging, validation and checkpoints -> tear down.
Re-running the same command resumes from the newest complete checkpoint in ``out_dir``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import logging
import math
import os
import secrets
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before CUDA starts

import numpy as np
import torch
import torch.distributed as dist
import yaml

import SD_Checkpoint as ckpt
import SD_Data
import SD_Model

log = logging.getLogger("sd_train")


# =============================================================================================
# Config
# =============================================================================================


def _doc(text, default=dataclasses.MISSING, default_factory=dataclasses.MISSING):
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata={"help": text})
    return field(default=default, metadata={"help": text})


@dataclass
class TrainConfig:
    # -- data -------------------------------------------------------------------------------
    datasets: list = _doc("[{dataset: DIR, latents: DIR, weight: 1.0}, ...]: caption datasets "
                          "(05_build_hf_dataset.py) joined to latent folders (encode_latents.py), mixed by weight",
                          default_factory=list)
    epoch_size: int = _doc("samples per epoch across all datasets; 0 = every sample once", 0)
    data_threads: int = _doc("threads that load latent files into RAM at start", 16)
    mmap_latents: bool = _doc("memory-map latent shards instead of loading them into RAM", False)
    allow_missing_latents: bool = _doc("drop captions without a latent (reported) instead of stopping", False)
    # -- models -----------------------------------------------------------------------------
    unet: str = _doc("UNet preset: sd1 or tiny", "sd1")
    vae: str = _doc("VAE hub id, local folder or tiny (used for validation images)", SD_Model.DEFAULT_VAE)
    text_encoder: str = _doc("CLIP text encoder hub id, local folder or tiny", SD_Model.DEFAULT_TEXT_ENCODER)
    tokenizer: str = _doc("CLIP tokenizer; empty = the text encoder's", "")
    prediction_type: str = _doc("epsilon or v_prediction", "epsilon")
    init_from: str = _doc("start from these weights (a checkpoint or run folder) with a fresh optimizer "
                          "and schedule; ignored when out_dir already holds a checkpoint to resume", "")
    # -- optimisation -----------------------------------------------------------------------
    batch_size: int = _doc("micro-batch size per GPU", 24)
    grad_accum: int = _doc("micro-batches accumulated per optimizer step", 2)
    max_steps: int = _doc("optimizer steps of the phase; 0 = run `epochs` epochs", 0)
    epochs: int = _doc("epochs of the phase when max_steps is 0", 1)
    lr: float = _doc("peak learning rate", 1e-5)
    warmup_steps: int = _doc("linear warm-up steps from lr * 0.01 to lr", 500)
    min_lr_ratio: float = _doc("cosine decay ends at lr * min_lr_ratio", 0.01)
    weight_decay: float = _doc("AdamW weight decay", 1e-2)
    adam_beta1: float = _doc("AdamW beta1", 0.9)
    adam_beta2: float = _doc("AdamW beta2", 0.999)
    adam_eps: float = _doc("AdamW epsilon", 1e-8)
    grad_clip: float = _doc("clip the global gradient norm to this; 0 = no clipping", 1.0)
    min_snr_gamma: float = _doc("Min-SNR-gamma loss weighting; 0 = plain MSE", 5.0)
    cfg_dropout: float = _doc("fraction of samples trained with the empty prompt (for classifier-free guidance)", 0.05)
    ema_decay: float = _doc("EMA decay; 0 = no EMA", 0.9999)
    ema_device: str = _doc("where the EMA lives: same (the training device) or cpu", "same")
    ema_update_every: int = _doc("update the EMA every N optimizer steps (decay raised to the N-th power)", 1)
    precision: str = _doc("bf16 (autocast), fp16 (autocast + GradScaler) or fp32", "bf16")
    grad_checkpointing: bool = _doc("recompute activations in backward to save memory", True)
    channels_last: bool = _doc("channels_last memory format for the UNet", False)
    compile: bool = _doc("torch.compile the UNet (works with grad_checkpointing)", False)
    max_bad_steps: int = _doc("stop after this many non-finite steps in a row", 10)
    # -- checkpoints and logging ------------------------------------------------------------
    out_dir: str = _doc("run folder: config.yaml, metrics.jsonl, samples/, checkpoints/", "runs/train")
    save_steps: int = _doc("save a checkpoint every N optimizer steps (also at each epoch end and the end)", 1500)
    keep_checkpoints: int = _doc("keep the newest N checkpoints (at least 2)", 3)
    keep_every_steps: int = _doc("also keep every checkpoint whose step is a multiple of this; 0 = none", 0)
    stop_at_step: int = _doc("end after this optimizer step as an interruption would (save, exit 0); 0 = off", 0)
    log_every: int = _doc("log metrics every N optimizer steps", 10)
    validate_every: int = _doc("validation loss and sample grid every N optimizer steps; 0 = never", 1000)
    validation_prompts: list = _doc("prompts of the validation sample grid",
                                    default_factory=lambda: ["a photograph of an astronaut riding a horse"])
    validation_samples: int = _doc("held-out samples used for the validation loss", 256)
    validation_steps: int = _doc("DDIM steps of the validation samples", 50)
    validation_cfg: float = _doc("classifier-free guidance scale of the validation samples", 7.5)
    wandb_project: str = _doc("wandb project name", "sd1-train")
    wandb_mode: str = _doc("wandb: online, offline or disabled (API key from the environment)", "disabled")
    # -- run --------------------------------------------------------------------------------
    seed: int = _doc("seed of the model init, data order and diffusion noise", 0)
    device: str = _doc("auto, cpu, cuda", "auto")

    def validate(self) -> None:
        """Reject bad values before any work, naming the field and the fix."""
        def need(ok, message):
            if not ok:
                raise ConfigError(message)

        need(self.datasets, "datasets: list at least one {dataset: DIR, latents: DIR, weight: 1.0}")
        for i, entry in enumerate(self.datasets):
            need(isinstance(entry, dict), f"datasets[{i}]: expected a mapping with dataset, latents, weight")
            unknown = set(entry) - {"dataset", "latents", "weight"}
            need(not unknown, f"datasets[{i}]: unknown keys {sorted(unknown)} (allowed: dataset, latents, weight)")
            for key in ("dataset", "latents"):
                need(key in entry, f"datasets[{i}].{key} is missing")
                need(Path(entry[key]).is_dir(), f"datasets[{i}].{key}: folder {entry[key]} does not exist")
            weight = entry.get("weight", 1.0)
            need(isinstance(weight, (int, float)) and weight > 0, f"datasets[{i}].weight must be > 0, got {weight}")
        need(self.unet in SD_Model.UNET_PRESETS, f"unet: choose one of {sorted(SD_Model.UNET_PRESETS)}")
        need(self.prediction_type in ("epsilon", "v_prediction"), "prediction_type: epsilon or v_prediction")
        need(self.precision in ("bf16", "fp16", "fp32"), "precision: bf16, fp16 or fp32")
        need(self.ema_device in ("same", "cpu"), "ema_device: same or cpu")
        need(self.wandb_mode in ("online", "offline", "disabled"), "wandb_mode: online, offline or disabled")
        need(self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda"), "device: auto, cpu or cuda")
        for name in ("batch_size", "grad_accum", "data_threads", "save_steps", "log_every", "ema_update_every",
                     "max_bad_steps", "validation_steps"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_steps", "epochs", "warmup_steps", "epoch_size", "stop_at_step", "keep_every_steps",
                     "validate_every", "validation_samples"):
            need(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        need(self.max_steps > 0 or self.epochs > 0, "set max_steps or epochs to a positive number")
        need(self.lr > 0, f"lr must be > 0, got {self.lr}")
        need(0 <= self.min_lr_ratio <= 1, "min_lr_ratio must be in [0, 1]")
        need(0 <= self.cfg_dropout < 1, f"cfg_dropout must be in [0, 1), got {self.cfg_dropout}")
        need(0 <= self.ema_decay < 1, f"ema_decay must be in [0, 1), got {self.ema_decay}")
        need(self.grad_clip >= 0 and self.min_snr_gamma >= 0, "grad_clip and min_snr_gamma must be >= 0")
        need(self.keep_checkpoints >= 2, "keep_checkpoints must be >= 2 (the newest may be mid-write when a run dies)")
        need(not self.init_from or Path(self.init_from).exists() or _looks_like_hub_id(self.init_from),
             f"init_from: {self.init_from} is neither an existing path nor a hub id (owner/name)")


class ConfigError(ValueError):
    pass


def _looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "/"))


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _coerce(name: str, value):
    """Convert a YAML or command-line value to the field's type, or say what was expected."""
    kind = FIELDS[name].type
    if kind == "bool":
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if isinstance(value, bool):
            return value
    elif kind in ("int", "float"):
        if isinstance(value, str):  # YAML reads 1e-6 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if kind == "float":
                return float(value)
            if float(value).is_integer():
                return int(value)
    elif kind == "str":
        return "" if value is None else str(value)
    elif kind == "list":
        if isinstance(value, list):
            return value
        if isinstance(value, str):
            return [value]
    raise ConfigError(f"{name}: expected {kind}, got {value!r}")


def _unknown_field(name: str, where: str) -> ConfigError:
    close = difflib.get_close_matches(name, FIELDS, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"unknown config field '{name}' in {where}{hint}")


def load_config(argv=None) -> TrainConfig:
    """YAML from ``--config``, then ``--field value`` overrides; validated before returning."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="phase YAML; flags override its fields")
    for name, f in FIELDS.items():
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        parser.add_argument(f"--{name}", metavar="VALUE", help=f"{f.metadata['help']} (default: {default!r})")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flag = next((u for u in unknown if u.startswith("--")), unknown[0])
        raise _unknown_field(flag.lstrip("-").split("=")[0], "the command line")
    values = {}
    if args.config:
        path = Path(args.config)
        if not path.exists():
            raise ConfigError(f"--config: {path} does not exist")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping of config fields")
        for name, value in loaded.items():
            if name not in FIELDS:
                raise _unknown_field(name, str(path))
            values[name] = _coerce(name, value)
    for name in FIELDS:
        raw = getattr(args, name)
        if raw is not None:
            values[name] = _coerce(name, yaml.safe_load(raw) if FIELDS[name].type != "str" else raw)
    config = TrainConfig(**values)
    config.validate()
    return config


def config_yaml(config: TrainConfig) -> str:
    return yaml.safe_dump(dataclasses.asdict(config), sort_keys=False)


# Fields that fix the data order and the math: a resume must not change them.
RESUME_FIXED = ("datasets", "epoch_size", "unet", "prediction_type", "batch_size", "grad_accum", "seed",
                "max_steps", "epochs", "lr", "warmup_steps", "min_lr_ratio")


# =============================================================================================
# Distributed set-up
# =============================================================================================


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    is_main: bool


def setup_distributed(device_choice: str) -> Dist:
    """One process per device; world size 1 without torchrun. NCCL on CUDA, gloo on CPU."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = torch.cuda.is_available() if device_choice == "auto" else device_choice.startswith("cuda")
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if world_size > 1:
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
    return Dist(rank, world_size, local_rank, device, rank == 0)


def all_reduce_sum(values: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.world_size > 1:
        dist.all_reduce(values)
    return values


def barrier(d: Dist) -> None:
    if d.world_size > 1:
        dist.barrier()


# =============================================================================================
# Pure pieces: LR schedule, CFG dropout
# =============================================================================================


def lr_at(step: int, peak: float, warmup: int, total: int, min_ratio: float = 0.01) -> float:
    """Learning rate of optimizer step ``step`` (0-based).

    Linear warm-up from ``peak * 0.01`` (as ``LinearLR(start_factor=0.01)``), then a cosine from
    ``peak`` to ``peak * min_ratio`` over the remaining ``total - warmup`` steps.
    """
    if step < warmup:
        return peak * (0.01 + 0.99 * step / warmup)
    decay_steps = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    floor = peak * min_ratio
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def apply_cfg_dropout(hidden: torch.Tensor, empty: torch.Tensor, p: float, generator: torch.Generator):
    """Replace each sample's text embedding by the empty prompt's with probability ``p``.

    ``hidden`` (B, 77, D); ``empty`` (1, 77, D). Returns the new embeddings and the boolean mask.
    """
    drop = torch.rand(hidden.shape[0], generator=generator, device=generator.device) < p
    drop = drop.to(hidden.device)
    return torch.where(drop[:, None, None], empty.to(hidden.dtype), hidden), drop


# =============================================================================================
# Build
# =============================================================================================


@dataclass
class Models:
    unet: torch.nn.Module  # the plain module (weights, EMA, checkpoints)
    model: torch.nn.Module  # what the loop calls: the unet, DDP-wrapped and/or compiled
    text_encoder: torch.nn.Module
    tokenizer: object
    empty_embedding: torch.Tensor  # (1, 77, D)
    ema: SD_Model.EMA | None
    ddp: torch.nn.Module | None = None  # the DDP wrapper, for no_sync()


def autocast(config: TrainConfig, device: torch.device):
    if config.precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if config.precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def build_models(config: TrainConfig, d: Dist) -> Models:
    text_encoder = SD_Model.load_text_encoder(config.text_encoder)
    tokenizer = SD_Model.load_tokenizer(config.tokenizer or config.text_encoder)
    return assemble_models(config, d, text_encoder, tokenizer, SD_Model.tokenize(tokenizer, [""]))


def assemble_models(config: TrainConfig, d: Dist, text_encoder, tokenizer, empty_ids: torch.Tensor) -> Models:
    """A fresh UNet (and its EMA) beside a given text encoder; ``empty_ids`` are the empty prompt's tokens."""
    unet = SD_Model.build_unet(config.unet, seed=config.seed, grad_checkpointing=config.grad_checkpointing,
                               channels_last=config.channels_last).to(d.device)
    unet.train()
    text_encoder = text_encoder.to(d.device)
    with autocast(config, d.device):
        empty = SD_Model.encode_prompt_ids(text_encoder, empty_ids)
    ema = None
    if config.ema_decay > 0:
        ema = SD_Model.EMA(unet, config.ema_decay, device="cpu" if config.ema_device == "cpu" else None,
                           update_every=config.ema_update_every)
    return Models(unet, unet, text_encoder, tokenizer, empty, ema)


def wrap_model(models: Models, config: TrainConfig, d: Dist) -> None:
    """DDP-wrap, then compile (after weights are loaded, so DDP broadcasts the right ones).

    Compiling the DDP module lets the compiler split graphs at bucket boundaries so communication
    overlaps the backward pass.
    """
    model = models.unet
    if d.world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = models.ddp = DistributedDataParallel(
            model, device_ids=[d.device.index] if d.device.type == "cuda" else None, gradient_as_bucket_view=True
        )
    if config.compile:
        model = torch.compile(model)
    models.model = model


def build_optimizer(unet, config: TrainConfig):
    kwargs = dict(lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                  weight_decay=config.weight_decay)
    params = [p for p in unet.parameters() if p.requires_grad]
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, TypeError):  # fused kernels missing for this device or dtype
        return torch.optim.AdamW(params, foreach=True, **kwargs)


def build_data(config: TrainConfig, d: Dist):
    """Train and validation data; every problem found is reported before training starts."""
    stores, train, val, weights = {}, [], [], []
    for entry in config.datasets:
        folder = str(Path(entry["latents"]).resolve())
        if folder not in stores:
            stores[folder] = SD_Data.LatentStore(folder, threads=config.data_threads, mmap=config.mmap_latents)
        store = stores[folder]
        train.append(SD_Data.join_split(entry["dataset"], "train", store, allow_missing=config.allow_missing_latents))
        val.append(SD_Data.join_split(entry["dataset"], "validation", store, allow_missing=True))
        weights.append(float(entry.get("weight", 1.0)))
    train_data = SD_Data.MixedData(train, weights)
    if len(train_data) == 0:
        raise SD_Data.DataError("the training split of every dataset is empty")
    val_data = SD_Data.MixedData(val, weights) if sum(len(v) for v in val) else None
    return train_data, val_data


def scaling_factor_of(config: TrainConfig, data: SD_Data.MixedData, vae) -> float:
    """The latents' scaling factor: from latents.json when present, which must agree with the VAE."""
    factor = float(vae.config.scaling_factor)
    for split in data.splits:
        recorded = split.store.meta.get("scaling_factor")
        if recorded is not None and abs(float(recorded) - factor) > 1e-6:
            raise ConfigError(
                f"vae: {config.vae} has scaling factor {factor} but {split.store.folder}/latents.json records "
                f"{recorded}; use the VAE the latents were encoded with"
            )
    return factor


# =============================================================================================
# The train state
# =============================================================================================


@dataclass
class TrainState:
    """Everything about the loop's position that a resume needs, besides models and optimizer."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0
    position: int = 0  # micro-batches of this epoch already consumed by each rank
    bad_steps: int = 0  # non-finite steps so far
    bad_in_a_row: int = 0
    samples_seen: int = 0  # across all ranks

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for name in dataclasses.asdict(self):
            if name not in state:
                raise KeyError(f"train state lacks '{name}'")
            setattr(self, name, int(state[name]))


@dataclass
class Trainer:
    config: TrainConfig
    d: Dist
    models: Models
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    noise_generator: torch.Generator
    alphas_cumprod: torch.Tensor
    scaling_factor: float
    sample_shape: tuple  # (4, h, w) of the training latents
    steps_per_epoch: int
    total_steps: int  # optimizer steps of the phase: sizes the LR schedule
    state: TrainState = field(default_factory=TrainState)


# =============================================================================================
# One optimizer step
# =============================================================================================


def compute_loss(t: Trainer, latents: torch.Tensor, input_ids: torch.Tensor):
    """Per-sample Min-SNR loss ``(B,)`` and timesteps for one micro-batch."""
    config, device, gen = t.config, t.d.device, t.noise_generator
    latents = SD_Model.scale_latents(latents.to(device, non_blocking=True).float(), t.scaling_factor)
    if config.channels_last:
        latents = latents.contiguous(memory_format=torch.channels_last)
    noise = torch.randn(latents.shape, generator=gen, device=device)
    timesteps = SD_Model.sample_timesteps(latents.shape[0], gen).to(device)
    noisy = SD_Model.add_noise(latents, noise, timesteps, t.alphas_cumprod)
    target = SD_Model.prediction_target(latents, noise, timesteps, t.alphas_cumprod, config.prediction_type)
    with autocast(config, device):
        hidden = SD_Model.encode_prompt_ids(t.models.text_encoder, input_ids)
        hidden, _ = apply_cfg_dropout(hidden, t.models.empty_embedding, config.cfg_dropout, gen)
        pred = t.models.model(noisy, timesteps, encoder_hidden_states=hidden).sample
    loss = SD_Model.diffusion_loss(pred, target, timesteps, t.alphas_cumprod, config.prediction_type,
                                   config.min_snr_gamma)
    return loss, timesteps


def train_step(t: Trainer, micro_batches: list, stop_requested: bool = False) -> dict:
    """Forward/backward over the accumulation, then one optimizer update unless anything is non-finite.

    A non-finite loss or gradient norm on any rank skips the update on every rank: weights,
    optimizer, EMA and LR schedule stay as they were. One all-reduce carries the loss, the bad-step
    flag, the stop request and the per-quartile losses, so every rank takes the same decision.
    """
    config, d = t.config, t.d
    t.optimizer.zero_grad(set_to_none=True)
    stats = torch.zeros(11, dtype=torch.float64, device=d.device)  # loss, bad, stop, q-sums(4), q-counts(4)
    for i, (latents, input_ids) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        sync = contextlib.nullcontext() if last or t.models.ddp is None else t.models.ddp.no_sync()
        with sync:
            loss, timesteps = compute_loss(t, latents, input_ids)
            t.scaler.scale(loss.mean() / len(micro_batches)).backward()
        quartile = (timesteps * 4 // SD_Model.NUM_TRAIN_TIMESTEPS).clamp(max=3)
        stats[0] += loss.detach().mean().double() / len(micro_batches)
        stats[3:7].index_add_(0, quartile, loss.detach().double())
        stats[7:11].index_add_(0, quartile, torch.ones_like(loss, dtype=torch.float64))
    t.scaler.unscale_(t.optimizer)
    params = [p for p in t.models.unet.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, config.grad_clip if config.grad_clip > 0 else float("inf"))
    overflow = config.precision == "fp16" and not torch.isfinite(grad_norm)  # the scaler's business
    stats[1] = float(not torch.isfinite(stats[0]) or (not torch.isfinite(grad_norm) and not overflow))
    stats[2] = float(stop_requested)
    stats = all_reduce_sum(stats, d).cpu()
    bad = bool(stats[1] > 0)
    if bad:
        t.optimizer.zero_grad(set_to_none=True)
        if config.precision == "fp16":
            t.scaler.update()
    else:
        t.scaler.step(t.optimizer)  # skips the update itself on an fp16 overflow
        t.scaler.update()
        if not overflow:
            t.scheduler.step()
            if t.models.ema is not None:
                t.models.ema.update(t.models.unet, t.state.step)
    counts = stats[7:11]
    quartiles = [(stats[3 + q] / counts[q]).item() if counts[q] > 0 else None for q in range(4)]
    return {
        "loss": (stats[0] / d.world_size).item(),
        "grad_norm": grad_norm.item(),
        "bad": bad,
        "overflow": bool(overflow),
        "stop": bool(stats[2] > 0),
        "loss_quartiles": quartiles,
    }


# =============================================================================================
# Validation
# =============================================================================================


@torch.no_grad()
def validation_loss(t: Trainer, data: SD_Data.MixedData) -> float:
    """Mean loss on up to ``validation_samples`` held-out samples with fixed noise and timesteps."""
    config, d = t.config, t.d
    count = min(config.validation_samples, len(data))
    indices = np.arange(count)[d.rank :: d.world_size]
    gen = torch.Generator(device=d.device).manual_seed(1234 + d.rank)  # the same draw at every validation
    saved = t.noise_generator
    t.noise_generator = gen
    totals = torch.zeros(2, dtype=torch.float64, device=d.device)
    t.models.unet.eval()
    try:
        for start in range(0, len(indices), config.batch_size):
            latents, input_ids = data.batch(indices[start : start + config.batch_size])
            plain = dataclasses.replace(t.models, model=t.models.unet)
            loss, _ = compute_loss(dataclasses.replace(t, models=plain), latents, input_ids)
            totals[0] += loss.double().sum()
            totals[1] += loss.numel()
    finally:
        t.noise_generator = saved
        t.models.unet.train()
    totals = all_reduce_sum(totals, d)
    return (totals[0] / totals[1]).item() if totals[1] > 0 else float("nan")


@torch.no_grad()
def sample_grid(t: Trainer, vae, path: Path) -> None:
    """DDIM samples of the validation prompts with the EMA weights, saved as a labelled PNG grid."""
    from PIL import Image, ImageDraw

    config, device = t.config, t.d.device
    prompts = list(config.validation_prompts)
    ids = SD_Model.tokenize(t.models.tokenizer, prompts)
    with autocast(config, device):
        cond = SD_Model.encode_prompt_ids(t.models.text_encoder, ids)
    uncond = t.models.empty_embedding.expand_as(cond)
    shape = (len(prompts), *t.sample_shape)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(config.seed)).to(device)
    swap = t.models.ema.swapped_in(t.models.unet) if t.models.ema is not None else contextlib.nullcontext()
    t.models.unet.eval()
    with swap, autocast(config, device), SD_Model.attention_context(device):
        latents = SD_Model.ddim_sample(t.models.unet, noise, cond.float(), uncond.float(),
                                       steps=config.validation_steps, guidance_scale=config.validation_cfg,
                                       prediction_type=config.prediction_type, alphas_cumprod=t.alphas_cumprod)
        images = vae.decode(SD_Model.unscale_latents(latents, t.scaling_factor).to(vae.dtype)).sample
    t.models.unet.train()
    images = ((images.float().clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).cpu().numpy()
    h, w = images.shape[1:3]
    label = 14
    grid = Image.new("RGB", (w * len(prompts), h + label), "white")
    draw = ImageDraw.Draw(grid)
    for i, (image, prompt) in enumerate(zip(images, prompts)):
        grid.paste(Image.fromarray(image), (i * w, 0))
        draw.text((i * w + 2, h + 1), prompt[: max(4, w // 6)], fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    grid.save(tmp, format="PNG")
    os.replace(tmp, path)


# =============================================================================================
# Checkpoints
# =============================================================================================


def save_checkpoint(t: Trainer, run_dir: Path) -> Path:
    """Write ``checkpoints/step_N`` atomically from every rank (each its RNG), then prune old ones."""
    config, d = t.config, t.d
    checkpoints = run_dir / "checkpoints"
    staging = ckpt.staging_dir(checkpoints, t.state.step)
    final = checkpoints / ckpt.step_dir_name(t.state.step)
    if d.is_main:
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
    barrier(d)
    ckpt.write_rank_state(staging, d.rank, t.noise_generator, t.models.unet)
    if d.is_main:
        ckpt.save_weights(t.models.unet.state_dict(), staging / "unet.safetensors")
        _fault_point("after_unet", t.state.step)
        if t.models.ema is not None:
            ckpt.save_weights(t.models.ema.state_dict(), staging / "ema.safetensors")
        ckpt.save_torch(t.optimizer.state_dict(), staging / "optimizer.pt")
        ckpt.save_torch({"train": t.state.state_dict(), "scheduler": t.scheduler.state_dict(),
                         "scaler": t.scaler.state_dict(), "world_size": d.world_size},
                        staging / "train_state.pt")
        (staging / "config.yaml").write_text(config_yaml(config))
    barrier(d)
    if d.is_main:
        ckpt.finalize(staging, final)
        removed = ckpt.prune(checkpoints, config.keep_checkpoints, config.keep_every_steps)
        log.info("saved %s%s", final, f" (pruned {len(removed)})" if removed else "")
    barrier(d)
    return final


def _fault_point(name: str, step: int) -> None:
    """Fault injection for the tests, off unless ``SD_TRAIN_FAULT=NAME:STEP`` is set.

    ``after_unet:S`` SIGKILLs this process in the middle of writing checkpoint S;
    ``sigterm_parent:S`` sends SIGTERM to the launcher (torchrun) after step S, like a preemption.
    """
    if os.environ.get("SD_TRAIN_FAULT") != f"{name}:{step}":
        return
    if name == "after_unet":
        os.kill(os.getpid(), signal.SIGKILL)
    elif name == "sigterm_parent":
        os.kill(os.getppid(), signal.SIGTERM)


def resume(t: Trainer, folder: Path) -> None:
    """Restore everything from a complete checkpoint; any missing piece is an error."""
    saved = yaml.safe_load((folder / "config.yaml").read_text())
    changed = [name for name in RESUME_FIXED if saved.get(name) != getattr(t.config, name)]
    if changed:
        raise ConfigError(
            f"{folder} was written with different {', '.join(changed)}; resuming would not continue the same run. "
            "Restore those values, or use a new out_dir with init_from to start a new phase from these weights"
        )
    state = ckpt.load_torch(folder / "train_state.pt")
    if state["world_size"] != t.d.world_size:
        raise ConfigError(f"{folder} was written by {state['world_size']} ranks; resume with "
                          f"--nproc_per_node {state['world_size']} (the data order depends on it)")
    t.models.unet.load_state_dict(ckpt.load_weights(folder / "unet.safetensors"))
    if t.models.ema is not None:
        t.models.ema.load_state_dict(ckpt.load_weights(folder / "ema.safetensors"))
    t.optimizer.load_state_dict(ckpt.load_torch(folder / "optimizer.pt"))
    t.scheduler.load_state_dict(state["scheduler"])
    t.scaler.load_state_dict(state["scaler"])
    t.state.load_state_dict(state["train"])
    ckpt.restore_rng(ckpt.load_torch(folder / f"rng_rank{t.d.rank}.pt")["rng"], t.noise_generator)


def init_weights(t: Trainer, source: str) -> None:
    """Start a new phase from other weights; optimizer and schedule stay fresh.

    ``source``: a run or checkpoint folder of ours (its live weights, and its EMA for the EMA), a
    diffusers pipeline folder or hub id, or a single-file SD checkpoint (both for UNet and EMA).
    """
    import SD_Formats

    try:
        loaded = SD_Formats.load_unet_weights(source, t.models.unet, use_ema=False)
    except (OSError, KeyError, ValueError) as error:
        raise ConfigError(f"init_from: {source} is not a run folder, checkpoint, single file or diffusers folder "
                          f"here, and could not be loaded as a hub id ({error})") from error
    if t.models.ema is not None:
        ema_path = None
        if SD_Formats.run_config(source) is not None:
            ema_path = ckpt.resolve_checkpoint(source) / "ema.safetensors"
        if ema_path is not None and ema_path.exists():
            t.models.ema.load_state_dict(ckpt.load_weights(ema_path))
        else:
            t.models.ema.load_state_dict(t.models.unet.state_dict())
    log.info("initialised weights from %s", loaded)


# =============================================================================================
# Logging
# =============================================================================================


class MetricsLog:
    """``metrics.jsonl`` (the source of truth) and, when enabled, wandb, on rank 0."""

    def __init__(self, run_dir: Path, config: TrainConfig, resume_step: int):
        self.path = run_dir / "metrics.jsonl"
        self._truncate_after(resume_step)
        self.wandb = None
        if config.wandb_mode != "disabled":
            import wandb

            id_file = run_dir / "wandb_id.txt"
            run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
            id_file.write_text(run_id)
            self.wandb = wandb.init(project=config.wandb_project, mode=config.wandb_mode, id=run_id,
                                    resume="allow", dir=str(run_dir), config=dataclasses.asdict(config))

    def _truncate_after(self, step: int) -> None:
        """Drop records past the checkpoint being resumed (they will be logged again)."""
        if not self.path.exists():
            return
        lines = [line for line in self.path.read_text().splitlines() if line.strip()]
        kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
        if len(kept) != len(lines):
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.path)

    def write(self, record: dict, image: Path | None = None) -> None:
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            payload = {k: v for k, v in record.items() if isinstance(v, (int, float)) and v is not None}
            if image is not None:
                import wandb

                payload["samples"] = wandb.Image(str(image))
            self.wandb.log(payload, step=record["step"])

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def plot_metrics(metrics_path: Path, out: Path) -> None:
    """Loss curve (and validation loss) from metrics.jsonl as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not metrics_path.exists():  # a run shorter than log_every logged nothing
        return
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    if not records:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train loss", lw=0.8)
    val = [r for r in records if r.get("val_loss") is not None]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="val loss")
    if any(r.get("val_loss_ema") is not None for r in val):
        ax.plot([r["step"] for r in val], [r["val_loss_ema"] for r in val], "s-", label="val loss (EMA)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("Min-SNR loss")
    ax.legend()
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp")
    fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    os.replace(tmp, out)


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


# =============================================================================================
# Main
# =============================================================================================


class StopSignal:
    """SIGTERM / SIGINT: finish the current optimizer step, save, exit with 128 + signal."""

    def __init__(self):
        self.signum = 0
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame):
        self.signum = signum

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def total_steps(config: TrainConfig, steps_per_epoch: int) -> int:
    return config.max_steps if config.max_steps > 0 else config.epochs * steps_per_epoch


def main(argv=None) -> int:
    try:
        config = load_config(argv)
    except ConfigError as error:
        print(f"SD_Train.py: config error: {error}", file=sys.stderr)
        return 2
    d = setup_distributed(config.device)
    logging.basicConfig(level=logging.INFO if d.is_main else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        return train(config, d)
    except (ConfigError, SD_Data.DataError, FileNotFoundError) as error:
        print(f"SD_Train.py: error (rank {d.rank}): {error}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def build_trainer(config: TrainConfig, d: Dist):
    """Models, data, optimizer and schedule, resumed or initialised: ``(trainer, train, val, vae)``."""
    run_dir = Path(config.out_dir)
    train_data, val_data = build_data(config, d)
    models = build_models(config, d)
    vae = SD_Model.load_vae(config.vae).to(d.device)
    scaling = scaling_factor_of(config, train_data, vae)
    steps_per_epoch = len(SD_Data.rank_batches(
        SD_Data.epoch_order(train_data.sizes, train_data.weights, config.seed, 0, config.epoch_size or None),
        d.rank, d.world_size, config.batch_size)) // config.grad_accum
    if steps_per_epoch == 0:
        raise ConfigError(f"an epoch of {len(train_data)} samples is less than one optimizer step of "
                          f"{config.batch_size} x {config.grad_accum} x {d.world_size} ranks; lower batch_size")
    t = make_trainer(config, d, models, scaling, train_data.sample_shape, steps_per_epoch)
    latest = ckpt.latest_checkpoint(run_dir / "checkpoints")
    if latest is not None:
        resume(t, latest)
    elif config.init_from:
        init_weights(t, config.init_from)
    wrap_model(models, config, d)
    return t, train_data, val_data, vae


def make_trainer(config: TrainConfig, d: Dist, models: Models, scaling_factor: float, sample_shape: tuple,
                 steps_per_epoch: int) -> Trainer:
    """Optimizer, LR schedule, loss scaler and noise generator around built models, at step 0."""
    total = total_steps(config, steps_per_epoch)
    optimizer = build_optimizer(models.unet, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_at(s, config.lr, config.warmup_steps, total, config.min_lr_ratio) / config.lr)
    noise_generator = torch.Generator(device=d.device).manual_seed(config.seed * 7919 + d.rank + 1)
    return Trainer(config, d, models, optimizer, scheduler,
                   torch.amp.GradScaler(d.device.type, enabled=config.precision == "fp16"), noise_generator,
                   SD_Model.ddpm_alphas_cumprod().to(d.device), scaling_factor, tuple(sample_shape), steps_per_epoch,
                   total)


def train(config: TrainConfig, d: Dist) -> int:
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    run_dir = Path(config.out_dir)
    t, train_data, val_data, vae = build_trainer(config, d)
    metrics = None
    if d.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(config_yaml(config))
        metrics = MetricsLog(run_dir, config, t.state.step)
        log.info("%d training samples in %d dataset(s), latents %s; %d steps/epoch, %d steps in all; "
                 "%d images per optimizer step", len(train_data), len(train_data.splits), train_data.sample_shape,
                 t.steps_per_epoch, t.total_steps, config.batch_size * config.grad_accum * d.world_size)
        if t.state.step:
            log.info("resumed at step %d (epoch %d, micro-batch %d of the epoch)", t.state.step, t.state.epoch,
                     t.state.position)
    barrier(d)

    # -- loop -----------------------------------------------------------------------------------
    stopper = StopSignal()
    try:
        code = loop(t, train_data, val_data, vae, run_dir, stopper, metrics)
    finally:
        stopper.restore()
    if d.is_main:
        plot_metrics(run_dir / "metrics.jsonl", run_dir / "loss.png")
        metrics.close()
    return code


def loop(t, train_data, val_data, vae, run_dir, stopper, metrics) -> int:
    from tqdm.auto import tqdm

    config, d, state, total = t.config, t.d, t.state, t.total_steps
    images_per_step = config.batch_size * config.grad_accum * d.world_size
    bar = tqdm(total=total, initial=state.step, disable=not d.is_main, desc="train", unit="step")
    tick, window_images = time.perf_counter(), 0
    while state.step < total:
        order = SD_Data.epoch_order(train_data.sizes, train_data.weights, config.seed, state.epoch,
                                    config.epoch_size or None)
        batches = SD_Data.rank_batches(order, d.rank, d.world_size, config.batch_size)
        usable = len(batches) // config.grad_accum * config.grad_accum
        while state.position < usable and state.step < total:
            micro = [train_data.batch(b) for b in batches[state.position : state.position + config.grad_accum]]
            lr = t.scheduler.get_last_lr()[0]  # the rate this step uses
            with SD_Model.attention_context(d.device):
                result = train_step(t, micro, stop_requested=stopper.signum != 0)
            epoch_done = advance(state, result, config.grad_accum, usable, images_per_step)
            window_images += images_per_step
            record = image = None
            if state.step % config.log_every == 0 or result["bad"]:
                now = time.perf_counter()
                record = step_record(t, result, lr, images_per_s=window_images / (now - tick))
                tick, window_images = now, 0
            if config.validate_every and state.step % config.validate_every == 0:
                record = record or step_record(t, result, lr)
                image = validate(t, val_data, vae, run_dir, record)
            if d.is_main:
                if record is not None:
                    metrics.write(record, image)
                bar.update(1)
                bar.set_postfix(loss=f"{result['loss']:.4f}", lr=f"{lr:.2e}")
                _fault_point("sigterm_parent", state.step)
            code = stop_code(t, result, stopper)
            if code is not None or epoch_done or state.step % config.save_steps == 0 or state.step == total:
                save_checkpoint(t, run_dir)
            if code is not None:
                bar.close()
                return code
            if epoch_done:
                break  # the next epoch has its own order
    bar.close()
    log.info("finished: %d steps, %d images", state.step, state.samples_seen)
    return 0


def advance(state: TrainState, result: dict, grad_accum: int, usable: int, images_per_step: int) -> bool:
    """Move the train state past one optimizer step; True when that ended the epoch."""
    state.position += grad_accum
    state.samples_seen += images_per_step
    state.step += 1
    state.bad_in_a_row = state.bad_in_a_row + 1 if result["bad"] else 0
    state.bad_steps += int(result["bad"])
    if state.position < usable:
        return False
    state.epoch, state.position = state.epoch + 1, 0
    return True


def step_record(t: Trainer, result: dict, lr: float, images_per_s: float | None = None) -> dict:
    record = {"step": t.state.step, "epoch": t.state.epoch, "loss": result["loss"], "lr": lr,
              "grad_norm": result["grad_norm"], "loss_by_quartile": result["loss_quartiles"],
              "peak_memory_gb": peak_memory_gb(t.d.device), "bad_steps": t.state.bad_steps, "skipped": result["bad"]}
    if images_per_s is not None:
        record["images_per_s"] = images_per_s
    return record


def stop_code(t: Trainer, result: dict, stopper: StopSignal) -> int | None:
    """The exit code if the run ends after this step (its checkpoint is saved first), else None."""
    state, config = t.state, t.config
    if result["bad"]:
        log.warning("step %d: non-finite loss or gradient norm; update skipped (%d in a row)", state.step,
                    state.bad_in_a_row)
    if state.bad_in_a_row >= config.max_bad_steps:
        log.error("step %d: %d non-finite steps in a row; stopped (raise max_bad_steps, lower lr, or check the data)",
                  state.step, state.bad_in_a_row)
        return 3
    if result["stop"]:
        signum = stopper.signum or signal.SIGTERM
        log.info("stopped by signal %d after step %d; re-run the same command to resume", signum, state.step)
        return 128 + signum
    if state.step == config.stop_at_step:
        log.info("stop_at_step %d reached; re-run without it to continue", state.step)
        return 0
    return None


def validate(t: Trainer, val_data, vae, run_dir: Path, record: dict) -> Path | None:
    """Validation loss with live and EMA weights, and the EMA sample grid (rank 0)."""
    if val_data is not None:
        record["val_loss"] = validation_loss(t, val_data)
        if t.models.ema is not None:
            with t.models.ema.swapped_in(t.models.unet):
                record["val_loss_ema"] = validation_loss(t, val_data)
    path = None
    if t.d.is_main and t.config.validation_prompts:
        path = run_dir / "samples" / f"step_{t.state.step:08d}.png"
        sample_grid(t, vae, path)
    barrier(t.d)
    return path


if __name__ == "__main__":
    sys.exit(main())

"""Train the SD 1.x UNet for one phase.

    torchrun --nproc_per_node=N SD_Train.py --config configs/phases/p1_laion_broad.yaml [--FIELD VALUE ...]

Reads: parse config -> set up distributed -> build data, models and the step -> resume or init ->
loop over optimizer steps (``SD_TrainStep.train_step``) with logging, validation and checkpoints ->
tear down. Re-running the same command resumes from the newest complete checkpoint in ``out_dir``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError

import SD_Buckets
import SD_Checkpoint as ckpt
import SD_Data
import SD_Distributed
import SD_DreamBooth
import SD_Eval
import SD_Faults
import SD_Files
import SD_Formats
import SD_Lora
import SD_Metrics
import SD_Model
import SD_Runtime
import SD_Sampling
import SD_TrainStep
from SD_Distributed import Dist
from SD_TrainConfig import (AUTO_BATCH, RESUME_FIXED, ConfigError, TrainConfig, config_yaml, estimate_flags,
                            field_default, load_config)

log = logging.getLogger("sd_train")


@dataclass
class TrainState:
    """The loop's position: everything a resume needs besides weights, optimizer and RNGs."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0
    position: int = 0  # micro-batches of this epoch already consumed by each rank
    bad_steps: int = 0  # skipped steps so far
    bad_in_a_row: int = 0
    samples_seen: int = 0  # across all ranks
    world_size: int = 1  # the data order depends on it

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for name in dataclasses.asdict(self):
            if name not in state:
                raise KeyError(f"train state lacks '{name}'")
            setattr(self, name, int(state[name]))


@dataclass
class Run:
    """What the loop works with."""

    config: TrainConfig
    d: Dist
    step: SD_TrainStep.Step
    state: TrainState
    train_data: SD_Data.MixedData
    val_data: SD_Data.MixedData | None
    sampler: SD_Sampling.Pipeline  # the frozen parts of the validation grid, around step.unet
    rng: ckpt.RankRNG  # this rank's RNGs, applied when the loop starts
    steps_per_epoch: int
    total_steps: int  # optimizer steps of the phase: sizes the LR schedule
    run_dir: Path
    base_fingerprint: torch.Tensor | None = None  # a LoRA run's base weights as loaded (see BaseFingerprint)
    evaluation: SD_Eval.TrainingEval | None = None  # FID / CLIP score every eval_every steps


def resumable(run: Run) -> dict:
    """Every piece of state a resume restores, by name (one file each; see SD_Checkpoint).

    A LoRA run saves its adapters (``adapter``) and a fingerprint of the base weights they were
    trained on (``lora_base``, checked by ``resume``) instead of the UNet: the base comes from
    ``init_from`` at every start.
    """
    if run.config.lora_rank:
        states = {"lora_base": ckpt.Weights(BaseFingerprint(run.base_fingerprint)),
                  "adapter": ckpt.Weights(SD_Lora.AdapterWeights(unet=run.step.unet,
                                                                 text_encoder=run.step.text_encoder))}
    else:
        states = {"unet": ckpt.Weights(run.step.unet)}
    if run.step.ema is not None:
        states["ema"] = ckpt.Weights(run.step.ema)
    states.update(optimizer=run.step.optimizer, scaler=run.step.scaler, train_state=run.state,
                  rng=ckpt.PerRank(run.rng))
    return states


class BaseFingerprint:
    """A LoRA run's base weights in one small tensor, taken as loaded (before any cast to bf16):
    saved with every checkpoint and compared by ``resume`` before anything is loaded."""

    def __init__(self, fingerprint: torch.Tensor):
        self.fingerprint = fingerprint

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"fingerprint": self.fingerprint}

    def load_state_dict(self, state) -> None:  # checked by resume, where a mismatch is a config error
        pass


# =============================================================================================
# Build
# =============================================================================================


def build_data(config: TrainConfig, d: Dist | None = None):
    """Train and validation data; every problem found is reported before training starts.

    The latent files are memory-mapped: the ranks of a machine share one copy in its page cache, and
    each reads its share of the files once at start (unless ``mmap_latents``: read on demand).
    """
    share = (d.local_rank, d.local_world_size) if d is not None else (0, 1)
    stores, train, val, weights = {}, [], [], []
    for entry in config.datasets:
        folder = str(Path(entry["latents"]).resolve())
        if folder not in stores:
            stores[folder] = SD_Data.LatentStore(folder, threads=config.data_threads, mmap=config.mmap_latents,
                                                 flip=config.flip, share=share)
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
            raise ConfigError(f"vae: {config.vae} has scaling factor {factor} but {split.store.folder}/latents.json "
                              f"records {recorded}; use the VAE the latents were encoded with")
    return factor


def plan_buckets(config: TrainConfig, data: SD_Data.MixedData, d: Dist) -> None:
    """Aspect-ratio buckets: fold those too small to fill one global batch into their nearest, then
    report what an epoch trains (rank 0 logs; every rank computes the same plan)."""
    global_batch = config.batch_size * d.world_size
    order = SD_Data.epoch_order(data.sizes, data.weights, config.seed, 0, config.epoch_size or None)
    merged = data.merge_small(order, global_batch)
    if not d.is_main:
        return
    for shape, into, count in merged:
        log.warning("bucket %s: %d samples, fewer than one global batch of %d; merged into bucket %s (their "
                    "latents cropped and resized to it)", pixel_size(shape), count, global_batch,
                    pixel_size(into))
    report = SD_Data.bucket_report(data, order, global_batch)
    log.info("%d aspect-ratio buckets (an epoch's samples, left out as the tail of a batch): %s", len(report),
             ", ".join(f"{pixel_size(s)} {n} ({left})" for s, n, left in report))
    log.info("left out of each epoch: %d of %d samples (a different tail each epoch)",
             sum(left for *_, left in report), len(order))


def pixel_size(shape: tuple) -> str:
    """``"WxH"`` in pixels of a latent shape ``(C, h, w)`` (the SD VAE's 8x)."""
    return f"{shape[-1] * 8}x{shape[-2] * 8}"


def steps_per_epoch_of(config: TrainConfig, data: SD_Data.MixedData, d: Dist) -> int:
    """Optimizer steps in an epoch (the first's: with buckets and weighted mixing, later epochs can
    differ by a few batches, as each bucket's tail left out varies)."""
    batches, _ = SD_Data.epoch_batches(data, config.seed, 0, d.rank, d.world_size, config.batch_size,
                                       config.epoch_size or None)
    steps = len(batches) // config.grad_accum
    if steps == 0:
        raise ConfigError(f"an epoch of {len(data)} samples is less than one optimizer step of "
                          f"{config.batch_size} x {config.grad_accum} x {d.world_size} ranks; lower batch_size")
    return steps


def build(config: TrainConfig, d: Dist) -> Run:
    """Data, models and the step, resumed from ``out_dir`` or initialised from ``init_from``.

    A LoRA or DreamBooth run loads its base weights first (DreamBooth's class images are generated by
    the base model); a LoRA run then adds the adapters, which alone train.
    """
    text_encoder = SD_Model.load_text_encoder(config.text_encoder)
    tokenizer = SD_Model.load_tokenizer(config.tokenizer or config.text_encoder)
    vae = SD_Model.load_vae(config.vae).to(d.device)
    unet = SD_Model.build_unet(config.unet, seed=config.seed, grad_checkpointing=config.grad_checkpointing,
                               channels_last=config.channels_last).to(d.device).train()
    if config.init_from and (config.lora_rank or config.instance_dir):
        load_base(config.init_from, unet)
    if config.instance_dir:
        make_pipeline = lambda: SD_Sampling.Pipeline(unet, vae, text_encoder.to(d.device), tokenizer,  # noqa: E731
                                                     config.prediction_type)
        train_data, val_data = SD_DreamBooth.build_data(config, d, vae, tokenizer, make_pipeline), None
    else:
        train_data, val_data = build_data(config, d)
    scaling = scaling_factor_of(config, train_data, vae)
    if len(train_data.shapes) > 1:
        plan_buckets(config, train_data, d)
    base_fingerprint = ckpt.weights_fingerprint(unet.parameters()) if config.lora_rank else None
    try:
        SD_Lora.apply_config(config, unet, text_encoder)
    except SD_Lora.LoraError as error:
        raise ConfigError(str(error)) from error
    step = SD_TrainStep.build_step(config, d, unet, text_encoder, SD_Model.tokenize(tokenizer, [""]), scaling)
    if config.lora_rank:
        log.info("LoRA rank %d (alpha %g) on %d UNet layers%s: %d trainable parameters", config.lora_rank,
                 config.lora_alpha or config.lora_rank, len(unet.lora_settings["modules"]),
                 " and the text encoder" if config.lora_text_encoder else "",
                 sum(p.numel() for p in step.trainable))
    if config.cache_text_embeddings:
        cache_text_embeddings(step, config, train_data, val_data)
    steps_per_epoch = steps_per_epoch_of(config, train_data, d)
    total = config.max_steps if config.max_steps > 0 else config.epochs * steps_per_epoch
    sampler = SD_Sampling.Pipeline(unet, vae, step.text_encoder, tokenizer, config.prediction_type,
                                   zero_terminal_snr=config.zero_terminal_snr)
    run = Run(config, d, step, TrainState(world_size=d.world_size), train_data, val_data, sampler,
              ckpt.RankRNG(step.noise_generator, unet), steps_per_epoch, total, Path(config.out_dir), base_fingerprint)
    if config.eval_every:
        try:
            run.evaluation = SD_Eval.TrainingEval.build(config, d, *validation_size(config, train_data))
        except SD_Eval.EvalError as error:
            raise ConfigError(f"eval_every: {error}") from error
    resumed = resume_newest_usable(run)  # damaged newer checkpoints are set aside: the latest is the one resumed
    inherited = False
    if not resumed and config.init_from and not config.lora_rank:
        inherited = init_weights(run, config.init_from)
    resumed_from = ckpt.latest_checkpoint(run.run_dir / "checkpoints") if resumed else None
    config.ema_warmup = ema_warmup_of(config, resumed_from, inherited)
    if step.ema is not None:
        step.ema.warmup = config.ema_warmup == "restart"
    SD_TrainStep.wrap_model(step, config.compile, len(train_data.shapes))
    return run


def load_base(source: str, unet) -> None:
    """The weights a LoRA or DreamBooth run starts from (an EMA of ours where there is one)."""
    try:
        loaded = SD_Formats.load_unet_weights(source, unet, use_ema=True)
    except (OSError, KeyError, ValueError) as error:  # the message names the file
        raise ConfigError(f"init_from: cannot load {source}: {SD_Formats.first_line(error)}") from error
    log.info("base weights from %s", loaded)


def cache_text_embeddings(step: SD_TrainStep.Step, config: TrainConfig, train_data, val_data) -> None:
    """Encode every distinct prompt of the run once; the text encoder then waits on the CPU (it is
    still used there for the validation grid's prompts)."""
    if isinstance(train_data, SD_DreamBooth.DreamBoothData):
        ids = train_data.all_input_ids()
    else:
        ids = np.concatenate([split.input_ids for data in (train_data, val_data) if data is not None
                              for split in data.splits])
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:  # every rank of a machine holds its own copy: at most a quarter of the memory between them
        step.text_cache = SD_TrainStep.TextCache.build(step.text_encoder, ids, config.precision, step.d.device,
                                                       max_bytes=host / 4 / step.d.local_world_size)
    except MemoryError as error:
        raise ConfigError(f"cache_text_embeddings: {error}; turn the cache off for a dataset this varied") from error
    step.text_encoder.to("cpu")
    log.info("cached the embeddings of %d distinct prompts (%.1f MB host memory); the text encoder stays on the CPU",
             len(step.text_cache.embeddings), step.text_cache.nbytes / 1e6)


def resume_newest_usable(run: Run) -> bool:
    """Resume from the newest complete checkpoint that verifies; False when the run has none yet.

    A checkpoint that fails (a file that does not match the manifest, cannot be read, or loads weights
    that do not match their fingerprint) is named in one log line, renamed ``step_N.damaged``, and the
    next older one is tried. If every checkpoint is damaged the run stops rather than start over.
    """
    checkpoints = run.run_dir / "checkpoints"
    damaged = []
    for _, folder in reversed(ckpt.complete_checkpoints(checkpoints)):
        try:
            agreed(run.d, lambda: verify_checkpoint(run, folder))
            agreed(run.d, lambda: resume(run, folder))
            return True
        except ckpt.Damaged as error:
            log.warning("checkpoint %s is damaged, skipped: %s", folder, error)
        damaged.append(folder)
        if run.d.is_main:
            ckpt.set_aside(folder)
        SD_Distributed.barrier(run.d)
    damaged = damaged or sorted(checkpoints.glob(f"step_*{ckpt.DAMAGED_SUFFIX}*"))
    if damaged:
        raise ckpt.CheckpointError(
            f"no usable checkpoint in {checkpoints}: {', '.join(f.name for f in damaged)} damaged (set aside as "
            f"*{ckpt.DAMAGED_SUFFIX}); restore a good copy there, or move them away to start the run over")
    return False


def agreed(d: Dist, attempt) -> None:
    """Run ``attempt`` on every rank and raise the same error on all of them if it failed on any:
    ``ckpt.Damaged`` before ``ConfigError`` (no rank is left waiting in a collective)."""
    try:
        attempt()
        outcome = None
    except ckpt.Damaged as error:
        outcome = ("damaged", f"rank {d.rank}: {error}" if d.world_size > 1 else str(error))
    except ConfigError as error:
        outcome = ("config", str(error))
    outcomes = [o for o in SD_Distributed.all_gather_objects(outcome, d) if o]
    for kind, error_type in (("damaged", ckpt.Damaged), ("config", ConfigError)):
        for found, message in outcomes:
            if found == kind:
                raise error_type(message)


def verify_checkpoint(run: Run, folder: Path) -> None:
    """Check the files this rank reads against the manifest (rank 0 the shared ones and the config,
    each rank its own); raises ``ckpt.Damaged`` naming the first that fails."""
    mine = [ckpt.file_name(name, obj, run.d.rank) for name, obj in resumable(run).items()
            if run.d.is_main or isinstance(obj, ckpt.PerRank)]
    if not ckpt.verify(folder, mine + (["config.yaml"] if run.d.is_main else [])):
        log.warning("%s has no manifest (written by an older version): its files are not verified", folder)


def resume(run: Run, folder: Path) -> None:
    """Restore everything from a complete, verified checkpoint of the same run.

    An unreadable file raises ``ckpt.Damaged``; a checkpoint of another configuration or world size
    is a ``ConfigError``.
    """
    import yaml

    try:
        saved = yaml.safe_load((folder / "config.yaml").read_text())
        written_by = ckpt.load_torch(folder / "train_state.pt")["world_size"]
        if not isinstance(saved, dict):
            raise TypeError("config.yaml is not a mapping")
    except (OSError, yaml.YAMLError, RuntimeError, KeyError, TypeError) as error:
        raise ckpt.Damaged(f"{folder}: {ckpt.first_line(error)}") from error
    changed = [name for name in RESUME_FIXED if saved.get(name, field_default(name)) != getattr(run.config, name)]
    if changed:
        raise ConfigError(
            f"{folder} was written with different {', '.join(changed)}; resuming would not continue the same run. "
            "Restore those values, or use a new out_dir with init_from to start a new phase from these weights")
    if written_by != run.d.world_size:
        raise ConfigError(f"{folder} was written by {written_by} ranks; resume with --nproc_per_node {written_by} "
                          "(the data order depends on it)")
    if run.config.lora_rank:
        check_lora_base(run, folder)
    ckpt.load(folder, resumable(run), run.d.rank)
    log.info("verified and loaded %s", folder)


def check_lora_base(run: Run, folder: Path) -> None:
    """The base weights loaded now must be those the checkpoint's adapter was trained on."""
    try:
        saved = ckpt.load_weights(folder / "lora_base.safetensors")["fingerprint"]
    except (OSError, KeyError, RuntimeError, SafetensorError) as error:
        raise ckpt.Damaged(f"{folder / 'lora_base.safetensors'}: {ckpt.first_line(error)}") from error
    now = run.base_fingerprint
    if saved.shape != now.shape or not torch.allclose(saved, now, rtol=1e-9, atol=1e-9):
        raise ConfigError(f"init_from {run.config.init_from} is not the base model the adapter in {folder} was "
                          "trained on; restore that base, or start a new out_dir")


def init_weights(run: Run, source: str) -> bool:
    """Start a new phase from other weights; optimizer and schedule stay fresh.

    ``source``: a run or checkpoint folder of ours (its live weights, and its EMA for the EMA), a
    diffusers pipeline folder or hub id, or a single-file SD checkpoint (both for UNet and EMA).
    Returns whether the EMA came from ``source``'s own EMA (else it starts as the live weights).
    """
    unet, ema, ema_state = run.step.unet, run.step.ema, None
    try:
        loaded = SD_Formats.load_unet_weights(source, unet, use_ema=False)
        if ema is not None:
            ema_state = SD_Formats.run_ema_weights(source, unet)
            ema.load_state_dict(unet.state_dict() if ema_state is None else ema_state)
    except (OSError, KeyError, ValueError) as error:  # the message names the file
        if Path(source).exists():
            raise ConfigError(f"init_from: cannot load {source}: {SD_Formats.first_line(error)}") from error
        raise ConfigError(f"init_from: {source} is no local file or folder, and could not be loaded as a hub id "
                          f"({SD_Formats.first_line(error)})") from error
    log.info("initialised weights from %s%s", loaded, " and its EMA" if ema_state is not None else "")
    return ema_state is not None


def ema_warmup_of(config: TrainConfig, resumed_from: Path | None, inherited: bool) -> str:
    """``ema_warmup`` made concrete (restart or off), as config.yaml and every checkpoint record it.

    An EMA inherited from the previous phase under a restarted warm-up, whose decay is 0.1 at step
    0, weighs ~1e-5 after 10 steps: the phase's EMA would be its live weights. ``auto`` is
    therefore off when ``init_from`` brought an EMA of ours (``inherited``), and restart for an EMA
    that starts as the live weights. A resume keeps the choice its checkpoint recorded (restart when it predates
    the field: what it was trained with).
    """
    if config.ema_warmup != "auto":
        return config.ema_warmup
    if resumed_from is not None:
        import yaml

        recorded = yaml.safe_load((resumed_from / "config.yaml").read_text()).get("ema_warmup")
        return recorded if recorded in ("restart", "off") else "restart"
    return "off" if inherited else "restart"


# =============================================================================================
# Main and the loop
# =============================================================================================


def main(argv=None) -> int:
    SD_Runtime.start_process()
    try:
        estimate, gpu_memory_gb, resolution = estimate_flags(argv)
        config = load_config(argv, description=__doc__, check_paths=not estimate)
    except ConfigError as error:
        print(f"SD_Train.py: config error: {error}", file=sys.stderr)
        return 2
    if estimate:
        return estimate_memory(config, gpu_memory_gb, resolution)
    d = SD_Distributed.setup(config.device)
    logging.basicConfig(level=logging.INFO if d.is_main else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        return train(config, d)
    except (ConfigError, SD_Data.DataError, SD_Metrics.MetricsError, FileNotFoundError,
            ckpt.CheckpointError) as error:
        print(f"SD_Train.py: error (rank {d.rank}): {error}", file=sys.stderr)
        return 2
    finally:
        SD_Distributed.teardown()


def estimate_memory(config: TrainConfig, gpu_memory_gb: float | None, resolution: int | None) -> int:
    """``--estimate_memory``: the prediction, without data, weights or a GPU (``SD_Memory``)."""
    import json

    import SD_Memory

    if gpu_memory_gb is None:
        gpu_memory_gb = (torch.cuda.get_device_properties(0).total_memory / 1e9 if torch.cuda.is_available()
                         else 24 * 2**30 / 1e9)
    resolution = resolution or resolution_of(config)
    print(json.dumps(SD_Memory.report(config, resolution, gpu_memory_gb)))
    return 0


def auto_batch_size(config: TrainConfig, d: Dist, gpu_memory_gb: float | None = None) -> int:
    """``batch_size: auto``: the run folder's own choice when it has one (a resume keeps its batch),
    else the largest micro-batch whose predicted peak fits the smallest GPU of the run."""
    import SD_Memory

    saved = Path(config.out_dir) / "config.yaml"
    if saved.exists():
        import yaml

        chosen = (yaml.safe_load(saved.read_text()) or {}).get("batch_size")
        if isinstance(chosen, int) and chosen > 0:
            log.info("batch_size: auto -> %d, as this run chose before (%s)", chosen, saved)
            return chosen
    if gpu_memory_gb is None:
        if d.device.type != "cuda":
            raise ConfigError("batch_size: auto sizes the batch to a CUDA device's memory; on the CPU give a number")
        gpu_memory_gb = torch.cuda.get_device_properties(d.device).total_memory / 1e9
    gpu_memory_gb = min(SD_Distributed.all_gather_objects(gpu_memory_gb, d))
    resolution = resolution_of(config)
    batch, estimate = SD_Memory.max_batch(config, gpu_memory_gb, resolution)
    if batch == 0:
        raise ConfigError(f"batch_size: auto: not even one {resolution} px image fits {gpu_memory_gb:.1f} GB with "
                          "these settings (SD_Train.py --estimate_memory shows where the memory goes)")
    log.info("batch_size: auto -> %d (predicted peak %.2f of %.2f GB)", batch, estimate.peak_gb, gpu_memory_gb)
    return batch


def resolution_of(config: TrainConfig) -> int:
    """The image size of the first dataset's latents (``latents.json``), else 512. With aspect-ratio
    buckets, the side of a square of the largest bucket's pixel count (the step's memory grows with
    the pixels)."""
    for entry in config.datasets[:1]:
        try:
            meta = SD_Data.read_latents_meta(Path(str(entry["latents"])))
            if meta.get("buckets"):
                return -(-(math.isqrt(max(w * h for w, h in meta["buckets"]) - 1) + 1) // 8) * 8
            return int(meta["latent_shape"][-1]) * 8
        except Exception:  # no folder yet, or no settings in it: the default
            pass
    return 512


def train(config: TrainConfig, d: Dist) -> int:
    lock = lock_run_folder(Path(config.out_dir), d)
    try:
        return train_locked(config, d)
    finally:
        lock.release()


def lock_run_folder(run_dir: Path, d: Dist) -> SD_Files.FolderLock:
    """One trainer per run folder: rank 0 takes ``out_dir/.lock``; every rank stops if it could not."""
    lock, refusal = SD_Files.FolderLock(run_dir), None
    if d.is_main:
        try:
            lock.acquire()
        except SD_Files.FolderLocked as error:
            refusal = str(error)
    refusal = SD_Distributed.all_gather_objects(refusal, d)[0]
    if refusal:
        raise ConfigError(refusal)
    return lock


def train_locked(config: TrainConfig, d: Dist) -> int:
    if config.batch_size == AUTO_BATCH:
        config.batch_size = auto_batch_size(config, d)
    run = build(config, d)
    if config.stop_at_step and run.state.step >= config.stop_at_step:
        log.info("the run is at step %d, at or past stop_at_step %d: nothing to do", run.state.step,
                 config.stop_at_step)
        return 0
    metrics = open_metrics(run)
    if d.is_main:
        (run.run_dir / "config.yaml").write_text(config_yaml(config))
        log.info("%d training samples in %d dataset(s), latents %s; %d steps/epoch, %d steps in all; "
                 "%d images per optimizer step", len(run.train_data), len(run.train_data.splits),
                 " ".join(str(s) for s in run.train_data.shapes), run.steps_per_epoch, run.total_steps,
                 config.batch_size * config.grad_accum * d.world_size)
        if run.state.step:
            log.info("resumed at step %d (epoch %d, micro-batch %d of the epoch)", run.state.step, run.state.epoch,
                     run.state.position)
    SD_Distributed.barrier(d)
    stopper = StopSignal()
    run.rng.start(config.seed, d.rank)
    try:
        code = loop(run, stopper, metrics)
    finally:
        stopper.restore()
    if d.is_main:
        SD_Metrics.plot_metrics(run.run_dir / "metrics.jsonl", run.run_dir / "loss.png")
        metrics.close()
    return code


def open_metrics(run: Run) -> SD_Metrics.MetricsLog | None:
    """Rank 0 opens ``metrics.jsonl`` at the resumed step; every rank stops if it could not."""
    metrics, refusal = None, None
    if run.d.is_main:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            metrics = SD_Metrics.MetricsLog(run.run_dir, run.config, run.state.step)
        except SD_Metrics.MetricsError as error:
            refusal = str(error)
    refusal = SD_Distributed.all_gather_objects(refusal, run.d)[0]
    if refusal:
        raise SD_Metrics.MetricsError(refusal)
    return metrics


def loop(run: Run, stopper: "StopSignal", metrics) -> int:
    from tqdm.auto import tqdm

    state, total = run.state, run.total_steps
    bar = tqdm(total=total, initial=state.step, disable=not run.d.is_main, desc="train", unit="step")
    prefetch = Prefetcher(run.train_data, pin=run.d.device.type == "cuda")
    try:
        return epochs(run, stopper, metrics, bar, prefetch)
    finally:
        prefetch.close()
        bar.close()


def epochs(run: Run, stopper: "StopSignal", metrics, bar, prefetch: "Prefetcher") -> int:
    config, d, state, total = run.config, run.d, run.state, run.total_steps
    images_per_step = config.batch_size * config.grad_accum * d.world_size
    tick, window_images = time.perf_counter(), 0
    while state.step < total:
        batches, flips = SD_Data.epoch_batches(run.train_data, config.seed, state.epoch, d.rank, d.world_size,
                                               config.batch_size, config.epoch_size or None, config.flip)
        usable = len(batches) // config.grad_accum * config.grad_accum
        while state.position < usable and state.step < total:
            position, accum = state.position, config.grad_accum
            micro = prefetch.take((state.epoch, position), batches[position : position + accum],
                                  flips[position : position + accum])
            if position + accum < usable and state.step + 1 < total:  # the next step's batch, built meanwhile
                prefetch.ahead((state.epoch, position + accum), batches[position + accum : position + 2 * accum],
                               flips[position + accum : position + 2 * accum])
            lr = SD_TrainStep.lr_at(state.step, config.lr, config.warmup_steps, total, config.min_lr_ratio)
            SD_TrainStep.set_lr(run.step.optimizer, lr)
            with SD_Model.attention_context(d.device):
                result = SD_TrainStep.train_step(run.step, micro, state.step, stop_requested=stopper.signum != 0)
            epoch_done = advance(state, result, config.grad_accum, usable, images_per_step)
            window_images += images_per_step
            record = image = None
            if state.step % config.log_every == 0 or result["bad"]:
                now = time.perf_counter()
                record = step_record(run, result, lr, images_per_s=window_images / (now - tick))
                tick, window_images = now, 0
            if config.validate_every and state.step % config.validate_every == 0:
                record = record or step_record(run, result, lr)
                image = validate(run, record)
            if config.eval_every and state.step % config.eval_every == 0:
                record = record or step_record(run, result, lr)
                record.update(evaluate(run))
            if d.is_main:
                if record is not None:
                    metrics.write(record, image)
                bar.update(1)
                bar.set_postfix(loss=f"{result['loss']:.4f}", lr=f"{lr:.2e}")
                SD_Faults.point("sigterm_parent", state.step)
            code = stop_code(run, result, stopper)
            if code is not None or epoch_done or state.step % config.save_steps == 0 or state.step == total:
                save(run)
            if code is not None:
                return code
            if epoch_done:
                break  # the next epoch has its own order
    log.info("finished: %d steps, %d images", state.step, state.samples_seen)
    return 0


class Prefetcher:
    """Builds the next optimizer step's micro-batches in a background thread while the current step
    runs, into pinned memory on a CUDA run (so the copy to the device is asynchronous).

    A batch depends only on its key ``(epoch, position)``, never on when it was built, so resuming
    is unaffected: a batch read ahead and not used is dropped.
    """

    def __init__(self, data: SD_Data.MixedData, pin: bool):
        from concurrent.futures import ThreadPoolExecutor

        self.data, self.pin = data, pin
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch")
        self.pending = None  # (key, future)

    def build(self, batches: list, flips: list | None = None) -> list:
        micro = [self.data.batch(rows, flipped) for rows, flipped in zip(batches, flips or [None] * len(batches))]
        if self.pin:
            micro = [tuple(t.pin_memory() for t in pair) for pair in micro]
        return micro

    def ahead(self, key, batches: list, flips: list | None = None) -> None:
        self.pending = (key, self.pool.submit(self.build, batches, flips))

    def take(self, key, batches: list, flips: list | None = None) -> list:
        pending, self.pending = self.pending, None
        if pending is not None and pending[0] == key:
            return pending[1].result()
        if pending is not None:
            pending[1].cancel()
        return self.build(batches, flips)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


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


def step_record(run: Run, result: dict, lr: float, images_per_s: float | None = None) -> dict:
    record = {"step": run.state.step, "epoch": run.state.epoch, "loss": result["loss"], "lr": lr,
              "grad_norm": result["grad_norm"], "loss_by_quartile": result["loss_quartiles"],
              "peak_memory_gb": SD_Metrics.peak_memory_gb(run.d.device), "bad_steps": run.state.bad_steps,
              "skipped": result["bad"] or result["overflow"]}
    if images_per_s is not None:
        record["images_per_s"] = images_per_s
    return record


def stop_code(run: Run, result: dict, stopper: "StopSignal") -> int | None:
    """The exit code if the run ends after this step (its checkpoint is saved first), else None."""
    state, config = run.state, run.config
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


def save(run: Run) -> None:
    checkpoints = run.run_dir / "checkpoints"
    ckpt.check_ranks_agree(run.step.unet, run.d, run.state.step)
    final = ckpt.save(checkpoints, run.state.step, resumable(run), run.d, config_yaml(run.config))
    if run.d.is_main:
        removed = ckpt.prune(checkpoints, run.config.keep_checkpoints, run.config.keep_every_steps)
        log.info("saved %s%s", final, f" (pruned {len(removed)})" if removed else "")


# =============================================================================================
# Validation
# =============================================================================================


def validate(run: Run, record: dict) -> Path | None:
    """Validation loss with live and EMA weights, and the EMA sample grid; every rank takes part."""
    step, config = run.step, run.config
    if run.val_data is not None:
        record["val_loss"] = SD_TrainStep.validation_loss(step, run.val_data, config.validation_samples,
                                                          config.batch_size)
        if step.ema is not None:
            with step.ema.swapped_in(step.unet):
                record["val_loss_ema"] = SD_TrainStep.validation_loss(step, run.val_data, config.validation_samples,
                                                                      config.batch_size)
    if not config.validation_prompts:
        return None
    path = run.run_dir / "samples" / f"step_{run.state.step:08d}.png"
    sample_grid(run, path)
    return path


@contextlib.contextmanager
def ema_sampling(run: Run):
    """The UNet in eval mode with the EMA weights swapped in (when there is an EMA), under the run's autocast."""
    unet = run.step.unet
    swap = run.step.ema.swapped_in(unet) if run.step.ema is not None else contextlib.nullcontext()
    unet.eval()
    try:
        with swap, SD_Runtime.autocast(run.config.precision, run.d.device):
            yield
    finally:
        unet.train()


@torch.no_grad()
def evaluate(run: Run) -> dict:
    """``eval_fid``, ``eval_clip_score``, ``eval_n`` of the EMA weights (SD_Eval.py); every rank takes part.

    The images are those of ``SD_Eval.py --ckpt <this step's checkpoint> --prompts eval_prompts --n eval_n
    --steps validation_steps --cfg validation_cfg --seed seed`` at the validation size, so the logged
    numbers can be reproduced from the checkpoint.
    """
    with ema_sampling(run):
        scores = run.evaluation(run.sampler, run.d)
    log.info("step %d: FID %.4f%s", run.state.step, scores["eval_fid"],
             f", CLIP score {scores['eval_clip_score']:.3f}" if "eval_clip_score" in scores else "")
    return scores


@torch.no_grad()
def sample_grid(run: Run, path: Path) -> None:
    """One image per validation prompt, seed ``config.seed``, with the EMA weights: a labelled grid.

    The prompts are shared out across the ranks (no rank waits in a collective while another
    samples alone) and rank 0 writes the grid. Each image is made by ``SD_Sampling.generate`` at
    batch 1, the path of ``SD_ImageGen.py``: ``SD_ImageGen.py --ckpt <the checkpoint of this step>
    --prompt P --seed SEED --n 1 --steps validation_steps --cfg validation_cfg`` at the same precision
    draws the same image.
    """
    config, d = run.config, run.d
    width, height = validation_size(config, run.train_data)
    mine = list(enumerate(config.validation_prompts))[d.rank :: d.world_size]
    with ema_sampling(run):
        made = [(i, prompt, SD_Sampling.generate(run.sampler, prompt, "", [config.seed], steps=config.validation_steps,
                                                 cfg=config.validation_cfg, height=height, width=width, batch_size=1,
                                                 device=d.device))
                for i, prompt in mine]
    rows = sorted(row for part in SD_Distributed.all_gather_objects(made, d) for row in part)
    if d.is_main:
        SD_Sampling.save_grid(path, [(prompt, images) for _, prompt, images in rows])


def validation_size(config: TrainConfig, data) -> tuple[int, int]:
    """``(width, height)`` of the validation samples: the config's, else the training latents' size
    (with buckets, the one nearest square; between equals, the one with more samples)."""
    if config.validation_width:
        return config.validation_width, config.validation_height
    counts = np.bincount(data.bucket_of, minlength=len(data.shapes)) if hasattr(data, "bucket_of") else [1]
    best = min(range(len(data.shapes)),
               key=lambda i: (abs(np.log(SD_Buckets.aspect(data.shapes[i]))), -counts[i]))
    _, h, w = data.shapes[best]
    return w * 8, h * 8


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


if __name__ == "__main__":
    sys.exit(main())

"""Building a training run from a config (``build``: data, models, its mode and the step, as
``sd.train.state.Run``), and the loop's small pieces (a metrics record, when to stop)."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import numpy as np

import sd.data.captions
import sd.data.dreambooth
import sd.data.training_data
import sd.distributed
import sd.files
import sd.formats
import sd.model
import sd.run_folder
import sd.runtime
import sd.sampling
import sd.train.checkpoint as ckpt
import sd.train.recovery
import sd.train.metrics
import sd.training_mode
import sd.train.modes
import sd.train.objectives
import sd.train.step
import sd.train.validation
from sd.train.state import Run, TrainState
from sd.distributed import Dist
from sd.evaluation import EvalError, EvalSettings, TrainingEval
from sd.train.config import ConfigError, TrainConfig, check_models

log = logging.getLogger("sd_train")


def build_data(settings: sd.data.training_data.DataSettings, d: Dist | None = None, tokenizer=None,
               retokenises: bool = False):
    """Train and validation data; every problem found is reported before training starts.

    The latent files are memory-mapped: the ranks of a machine share one copy in its page cache, and
    each reads its share of the files once at start (unless ``mmap_latents``: read on demand).
    ``tokenizer``: the training batches' token ids are made in the loader from the caption text, with
    the settings' caption operations (``shuffle_tags``, ``tag_dropout``); validation keeps the stored ids,
    but for a mode that ``retokenises`` (a learned token the stored ids lack): its validation captions are
    tokenised as written, by the tokenizer that knows the token.
    """
    ops = settings.caption_ops if tokenizer is not None else None
    val_tokenizer = tokenizer if retokenises else None
    share = (d.local_rank, d.local_world_size) if d is not None else (0, 1)
    stores, train, val, weights = {}, [], [], []
    for entry in settings.datasets:
        folder = str(Path(entry["latents"]).resolve())
        if folder not in stores:
            stores[folder] = sd.data.training_data.LatentStore(
                folder, threads=settings.data_threads, mmap=settings.mmap_latents, flip=settings.flip, share=share,
                masks=settings.masked_loss, control=settings.control, noise=settings.reflow,
                rejected=settings.rejected)
        store = stores[folder]
        train.append(sd.data.training_data.join_split(entry["dataset"], "train", store,
                                                      allow_missing=settings.allow_missing_latents,
                                                      captions=tokenizer is not None))
        val.append(sd.data.training_data.join_split(entry["dataset"], "validation", store, allow_missing=True,
                                                    captions=val_tokenizer is not None))
        weights.append(float(entry.get("weight", 1.0)))
    if settings.masked_loss:
        check_masks(stores, d is None or d.is_main)
    train_data = sd.data.training_data.MixedData(train, weights, tokenizer=tokenizer, ops=ops)
    if len(train_data) == 0:
        raise sd.data.training_data.DataError("the training split of every dataset is empty")
    val_data = (sd.data.training_data.MixedData(val, weights, tokenizer=val_tokenizer)
                if sum(len(v) for v in val) else None)
    return train_data, val_data


def check_masks(stores: dict, report: bool) -> None:
    """``masked_loss`` needs at least one latent folder with masks; the folders without any are named
    (their samples weigh 1 everywhere)."""
    unmasked = [folder for folder, store in stores.items() if not store.has_masks]
    if len(unmasked) == len(stores):
        raise ConfigError("data.masked_loss: true but no latent folder holds masks (NNNNN.mask.npy) "
                          f"({', '.join(unmasked)}): put photo_mask.png beside photo.jpg, import with "
                          "pipeline/01e_import_folder.py and encode with encode_latents.py, or set "
                          "data.masked_loss: false")
    if unmasked and report:
        log.info("data.masked_loss: %d latent folders have no masks, their samples weigh 1 everywhere: %s",
                 len(unmasked), ", ".join(unmasked))


def scaling_factor_of(config: TrainConfig, data: sd.data.training_data.MixedData, vae) -> float:
    """The latents' scaling factor: from latents.json when present, which must agree with the VAE."""
    factor = float(vae.config.scaling_factor)
    for split in data.splits:
        recorded = split.store.meta.get("scaling_factor")
        if recorded is not None and abs(float(recorded) - factor) > 1e-6:
            raise ConfigError(f"vae: {config.vae} has scaling factor {factor} but {split.store.folder}/latents.json "
                              f"records {recorded}; use the VAE the latents were encoded with")
    return factor


def plan_buckets(config: TrainConfig, data: sd.data.training_data.MixedData, d: Dist) -> None:
    """Aspect-ratio buckets: fold those too small to fill one global batch into their nearest, then
    report what an epoch trains (rank 0 logs; every rank computes the same plan)."""
    global_batch = config.batch_size * d.world_size
    order = sd.data.training_data.epoch_order(data.sizes, data.weights, config.seed, 0, config.data.epoch_size or None)
    merged = data.merge_small(order, global_batch)
    if not d.is_main:
        return
    for shape, into, count in merged:
        log.warning("bucket %s: %d samples, fewer than one global batch of %d; merged into bucket %s (their "
                    "latents cropped and resized to it)", pixel_size(shape), count, global_batch,
                    pixel_size(into))
    report = sd.data.training_data.bucket_report(data, order, global_batch)
    log.info("%d aspect-ratio buckets (an epoch's samples, left out as the tail of a batch): %s", len(report),
             ", ".join(f"{pixel_size(s)} {n} ({left})" for s, n, left in report))
    log.info("left out of each epoch: %d of %d samples (a different tail each epoch)",
             sum(left for *_, left in report), len(order))


def pixel_size(shape: tuple) -> str:
    """``"WxH"`` in pixels of a latent shape ``(C, h, w)`` (the SD VAE's 8x)."""
    return f"{shape[-1] * 8}x{shape[-2] * 8}"


def steps_per_epoch_of(config: TrainConfig, data: sd.data.training_data.MixedData, d: Dist) -> int:
    """Optimizer steps in an epoch (the first's: with buckets and weighted mixing, later epochs can
    differ by a few batches, as each bucket's tail left out varies)."""
    batches, _ = sd.data.training_data.epoch_batches(data, config.seed, 0, d.rank, d.world_size, config.batch_size,
                                       config.data.epoch_size or None)
    steps = len(batches) // config.grad_accum
    if steps == 0:
        raise ConfigError(f"an epoch of {len(data)} samples is less than one optimizer step of "
                          f"{config.batch_size} x {config.grad_accum} x {d.world_size} ranks; lower batch_size")
    return steps


def build(config: TrainConfig, d: Dist) -> Run:
    """Data, models and the step, as a new run starts them (``sd.train.recovery.resume_or_init``
    then resumes or initialises the weights).

    A run whose mode trains beside frozen weights (``Mode.frozen_base``), a DreamBooth or a distillation
    run loads its base weights first (DreamBooth's class images are generated by the base model; a
    distillation's teacher is the base); the mode then attaches what it trains (``Mode.attach``) once
    the data is built.
    """
    mode = sd.train.modes.mode_of(config)
    text_encoder, tokenizer, vae = load_frozen_parts(config, d)
    parts_fingerprint = {name: sd.run_folder.weights_fingerprint(list(model.parameters()))
                         for name, model in (("text_encoder", text_encoder), ("vae", vae))}
    if not config.subject.instance_dir:  # a DreamBooth run encodes its own images with its VAE
        check_latents_vae(config, sd.model.encoder_digest(vae))
    vae = vae.to(d.device)
    unet = sd.model.build_unet(config.unet, seed=config.seed, grad_checkpointing=config.grad_checkpointing,
                               channels_last=config.channels_last).to(d.device).train()
    check_models(config, unet, text_encoder)
    frozen_base = mode.frozen_base or sd.train.objectives.objective_of(config).uses_base  # trained on, or from
    base_fingerprint = None
    if config.init_from and frozen_base:
        sd.train.recovery.load_base(config.init_from, unet)
        base_fingerprint = sd.run_folder.weights_fingerprint(mode.fingerprinted(unet, text_encoder))  # as loaded
    mode.before_data(unet, text_encoder, tokenizer)
    if config.subject.instance_dir:  # DreamBooth: the class images are drawn by the base, which a fine-tune starts from
        if config.init_from and not frozen_base:
            sd.train.recovery.load_base(config.init_from, unet)
        make_pipeline = lambda: sd.sampling.Pipeline(unet, vae, text_encoder.to(d.device), tokenizer,  # noqa: E731
                                                     config.prediction_type,
                                                     zero_terminal_snr=base_zero_terminal_snr(config),
                                                     flow_shift=config.flow.shift)
        dreambooth = sd.data.dreambooth.DreamBoothSettings.from_config(config)
        train_data, val_data = sd.data.dreambooth.build_data(dreambooth, d, vae, tokenizer, make_pipeline), None
    else:
        data = sd.data.training_data.DataSettings.from_config(config)
        retokenise = data.caption_ops.active or mode.retokenises
        train_data, val_data = build_data(data, d, tokenizer if retokenise else None, mode.retokenises)
    mode.check_data(train_data)
    scaling = scaling_factor_of(config, train_data, vae)
    if len(train_data.shapes) > 1:
        plan_buckets(config, train_data, d)
    unet = mode.attach(unet, text_encoder)
    step = sd.train.step.build_step(config, d, unet, text_encoder, sd.model.tokenize(tokenizer, [""]), scaling,
                                    mode)
    for described in (step.objective.describe(config), mode.describe(step),
                      sd.train.step.describe_groups(step.optimizer)):
        if described:
            log.info("%s", described)
    if config.cache_text_embeddings:
        cache_text_embeddings(step, config, train_data, val_data)
    steps_per_epoch = steps_per_epoch_of(config, train_data, d)
    total = config.max_steps if config.max_steps > 0 else config.epochs * steps_per_epoch
    sampler = sd.sampling.Pipeline(unet, vae, step.text_encoder, tokenizer, config.prediction_type,
                                   zero_terminal_snr=config.zero_terminal_snr, flow_shift=config.flow.shift,
                                   flow_matching=config.flow.matching)
    state = TrainState(world_size=d.world_size, data_samples=len(train_data))
    run = Run(config, d, step, state, train_data, val_data, sampler,
              ckpt.RankRNG(step.noise_generator, unet), steps_per_epoch, total, Path(config.out_dir), mode,
              base_fingerprint, parts_fingerprint)
    if config.eval.every:
        try:
            run.evaluation = TrainingEval.build(EvalSettings.from_config(config), d,
                                                *sd.train.validation.validation_size(config, train_data))
        except EvalError as error:
            raise ConfigError(f"eval.every: {error}") from error
    return run


def load_frozen_parts(config: TrainConfig, d: Dist):
    """The text encoder, tokenizer and VAE the config names (a single file ``init_from`` names itself for the
    parts it holds: ``sd.train.config_loading.inherit_from_file``), each one's source in the log."""
    init_file = bool(config.init_from) and Path(config.init_from).is_file()
    try:
        held = sd.model.open_file(config.init_from).parts if init_file else []
    except sd.model.LoadError as error:  # the message names the file
        raise ConfigError(f"init_from: cannot load {config.init_from}: {error}") from error
    text_encoder = sd.model.load_text_encoder(config.text_encoder)
    try:
        sd.model.set_clip_skip(text_encoder, config.clip_skip)
    except ValueError as error:
        raise ConfigError(f"{error} ({config.text_encoder})") from error
    tokenizer = sd.model.load_tokenizer(config.tokenizer or config.text_encoder)
    vae = sd.model.load_vae(config.vae)
    if d.is_main:
        for field, model, what in (("text_encoder", text_encoder, "text encoder"), ("vae", vae, "VAE")):
            lacking = f" (init_from {config.init_from} holds no {what})" if init_file and field not in held else ""
            log.info("%s from %s%s", what, sd.model.loaded_from(model), lacking)
        if config.clip_skip > 1:
            log.info("CLIP skip %d: the text condition is the hidden state %d layers from the end", config.clip_skip,
                     config.clip_skip)
    return text_encoder, tokenizer, vae


def check_latents_vae(config: TrainConfig, digest: str) -> None:
    """Latents encoded by a VAE whose encoder differs from the run's are a ConfigError with both ways out
    (folders written before ``vae_encoder`` was recorded are not checked)."""
    for entry in config.datasets:
        folder = Path(str(entry["latents"]))
        try:
            meta = sd.data.training_data.read_latents_meta(folder)
        except sd.data.training_data.DataError:
            continue  # building the data names the folder
        encoded = meta.get("vae_encoder")
        if encoded and encoded != digest:
            raise ConfigError(f"vae: the latents in {folder} were encoded with another VAE encoder ({meta.get('vae')}) "
                              f"than this run's ({config.vae}); name that one (vae: {meta.get('vae')}) or encode the "
                              f"images again with encode_latents.py --vae {config.vae}")


def base_zero_terminal_snr(config: TrainConfig) -> bool:
    """The schedule the base model samples on (DreamBooth's class images are its own images): what
    init_from records, else the run's."""
    if not config.init_from:
        return config.zero_terminal_snr
    try:
        return sd.formats.recorded_zero_terminal_snr(config.init_from)
    except (OSError, ValueError):  # a hub id or file that records nothing: the run's own schedule
        return config.zero_terminal_snr


def cache_text_embeddings(step: sd.train.step.Step, config: TrainConfig, train_data, val_data) -> None:
    """Encode every distinct prompt of the run once; the text encoder then waits on the CPU (it is
    still used there for the validation grid's prompts)."""
    if isinstance(train_data, sd.data.dreambooth.DreamBoothData):
        ids = train_data.all_input_ids()
    else:
        ids = np.concatenate([split.input_ids for data in (train_data, val_data) if data is not None
                              for split in data.splits])
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:  # every rank of a machine holds its own copy: at most a quarter of the memory between them
        step.text_cache = sd.train.step.TextCache.build(step.text_encoder, ids, config.precision, step.d.device,
                                                       max_bytes=host / 4 / step.d.local_world_size)
    except MemoryError as error:
        raise ConfigError(f"cache_text_embeddings: {error}; turn the cache off for a dataset this varied") from error
    step.text_encoder.to("cpu")
    log.info("cached the embeddings of %d distinct prompts (%.1f MB host memory); the text encoder stays on the CPU",
             len(step.text_cache.embeddings), step.text_cache.nbytes / 1e6)


def lock_run_folder(run_dir: Path, d: Dist) -> sd.files.FolderLock:
    """One trainer per run folder: rank 0 takes ``out_dir/.lock``; every rank stops if it could not."""
    lock, refusal = sd.files.FolderLock(run_dir), None
    if d.is_main:
        try:
            lock.acquire()
        except sd.files.FolderLocked as error:
            refusal = str(error)
    refusal = sd.distributed.all_gather_objects(refusal, d)[0]
    if refusal:
        raise ConfigError(refusal)
    try:
        check_shared_folder(run_dir, d)
    except ConfigError:
        lock.release()
        raise
    return lock


def check_shared_folder(run_dir: Path, d: Dist, wait_s: float | None = None) -> None:
    """Every rank sees the files rank 0 writes into ``run_dir``, or every rank stops with a config error.

    A checkpoint holds each rank's random state, written by that rank and read back on resume, and rank 0
    writes the rest: an ``out_dir`` local to each node (the same path on another disk) would leave every
    node a part of each checkpoint. Rank 0 writes a file of a name new to this start (so no rank has it
    cached as absent), the others look for it for up to ``wait_s`` (``SD_SHARED_FOLDER_WAIT_S``, else 60 s:
    a network filesystem may show it late), and rank 0 removes it."""
    if d.world_size == 1:
        return
    if wait_s is None:
        wait_s = float(os.environ.get("SD_SHARED_FOLDER_WAIT_S", 60))
    import socket
    import uuid

    name = sd.distributed.all_gather_objects(f".shared-{uuid.uuid4().hex}" if d.is_main else None, d)[0]
    marker = run_dir / name
    if d.is_main:
        sd.files.write_text_atomic(marker, socket.gethostname() + "\n")
    sd.distributed.barrier(d)
    deadline, seen = time.monotonic() + wait_s, d.is_main
    while not seen and time.monotonic() < deadline:
        seen = marker.exists()
        if not seen:
            time.sleep(0.5)
    views = sd.distributed.all_gather_objects((seen, socket.gethostname()), d)
    if d.is_main:
        marker.unlink(missing_ok=True)
    blind = [(rank, host) for rank, (ok, host) in enumerate(views) if not ok]
    if blind:
        rank, host = blind[0]
        raise ConfigError(f"out_dir {run_dir} is not one folder for all ranks: rank {rank} on {host} does not see the "
                          f"file rank 0 ({views[0][1]}) wrote there; give every node the same out_dir on a shared "
                          "filesystem (each rank writes its part of every checkpoint and reads it back on resume)")


def open_metrics(run: Run) -> sd.train.metrics.MetricsLog | None:
    """Rank 0 opens ``metrics.jsonl`` at the resumed step; every rank stops if it could not."""
    metrics, refusal = None, None
    if run.d.is_main:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            metrics = sd.train.metrics.MetricsLog(run.run_dir, run.config, run.state.step)
        except sd.train.metrics.MetricsError as error:
            refusal = str(error)
    refusal = sd.distributed.all_gather_objects(refusal, run.d)[0]
    if refusal:
        raise sd.train.metrics.MetricsError(refusal)
    return metrics


def step_record(run: Run, result, lr: dict[str, float], step: int | None = None, epoch: int | None = None) -> dict:
    """The metrics record of optimizer step ``step`` (default: the step just taken). ``lr``: each parameter
    group's learning rate (``sd.train.step.lrs_at``); ``lr`` is the UNet's, ``lr_text_encoder`` the text
    encoder's when it trains (its adapter, or a token trained alone), ``lr_embedding`` a pivotal run's token."""
    record = {"step": run.state.step if step is None else step, "epoch": run.state.epoch if epoch is None else epoch,
              "loss": result["loss"], "lr": lr["unet"], "grad_norm": result["grad_norm"],
              "loss_by_quartile": result["loss_quartiles"],
              "peak_memory_gb": sd.train.metrics.peak_memory_gb(run.d.device), "bad_steps": run.state.bad_steps,
              "skipped": result["bad"] or result["overflow"], **result["measured"]}
    if run.step.text_trains and any(g.get("name") == "text_encoder" for g in run.step.optimizer.param_groups):
        record["lr_text_encoder"] = lr["text_encoder"]
    if "embedding" in lr:  # pivotal tuning: the learned token's, 0 once it stopped training
        record["lr_embedding"] = lr["embedding"]
    return record


def take_results(run: Run, window: list) -> tuple[list[dict], int | None]:
    """Count the read steps of ``window`` (``(step, epoch, lrs, result)`` in order) into the state: the
    metrics records of its log steps and skipped steps, and exit code 3 when ``max_bad_steps``
    non-finite steps in a row were reached (else None)."""
    records, code, config = [], None, run.config
    for step, epoch, lr, result in window:
        run.state.count(result["bad"])
        if result["bad"]:
            log.warning("step %d: non-finite loss or gradient norm; update skipped (%d in a row)", step,
                        run.state.bad_in_a_row)
        if step % config.log_every == 0 or result["bad"]:
            records.append(step_record(run, result, lr, step, epoch))
        if code is None and run.state.bad_in_a_row >= config.max_bad_steps:
            log.error("step %d: %d non-finite steps in a row; stopped (raise max_bad_steps, lower lr, or check the "
                      "data)", step, run.state.bad_in_a_row)
            code = 3
    return records, code


def stop_code(run: Run, stopper: sd.runtime.StopSignal) -> int:
    """The exit code of a run that stops on a signal (to this rank or another), logged."""
    if stopper.signum:
        log.info("stopped by signal %d after step %d; re-run the same command to resume", stopper.signum,
                 run.state.step)
    else:  # the ranks agreed on a stop that another one was sent
        log.info("stopped after step %d by a signal to another rank; re-run the same command to resume", run.state.step)
    return 128 + (stopper.signum or signal.SIGTERM)

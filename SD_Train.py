"""Train the SD 1.x UNet for one phase.

    torchrun --nproc_per_node=N SD_Train.py --config configs/phases/p1_laion_broad.yaml [--FIELD VALUE ...]

Reads top to bottom: parse config -> set up distributed -> build data, models and the step -> resume
or init -> loop over optimizer steps (``sd.train.step.train_step``) with logging, validation and
checkpoints -> tear down. Re-running the same command resumes from the newest complete checkpoint in
``out_dir``. The pieces live in ``sd/train/``: ``run`` (building a run, its state), ``recovery``
(what to resume, when to save, what to prune), ``validation``, ``memory`` (``batch_size: auto``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

import sd.data.training_data
import sd.distributed
import sd.faults
import sd.model
import sd.run_folder
import sd.runtime
import sd.train.power_ema
import sd.train.recovery
import sd.train.config
import sd.train.config_loading
import sd.train.memory
import sd.train.metrics
import sd.train.run
import sd.train.step
import sd.train.validation
from sd.data.prefetch import Prefetcher
from sd.distributed import Dist
from sd.runtime import StopSignal
from sd.train.config import AUTO_BATCH, ConfigError, TrainConfig, config_yaml
from sd.train.config_loading import estimate_flags, load_config
from sd.train.run import step_record, stop_code
from sd.train.state import Run

log = logging.getLogger("sd_train")


def main(argv=None) -> int:
    sd.runtime.start_process()
    try:
        estimate, gpu_memory_gb, resolution, world_size = estimate_flags(argv)
        config = load_config(argv, description=__doc__, check_paths=not estimate)
    except ConfigError as error:
        print(f"SD_Train.py: config error: {error}", file=sys.stderr)
        return 2
    if estimate:
        return estimate_memory(config, gpu_memory_gb, resolution, world_size)
    d = sd.distributed.setup(config.device)
    logging.basicConfig(level=logging.INFO if d.is_main else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    if config.flat_keys:
        log.info("config: read %s into their sections (%s); docs/config.md names each field both ways",
                 ", ".join(config.flat_keys), ", ".join(sd.train.config.canonical(k) for k in config.flat_keys))
    try:
        with sd.runtime.interrupting_signals():
            return train(config, d)
    except (ConfigError, sd.data.training_data.DataError, sd.train.metrics.MetricsError, FileNotFoundError,
            sd.run_folder.CheckpointError, sd.model.LoadError) as error:
        hint = ""
        if isinstance(error, sd.model.LoadError) and config.init_from and not Path(config.init_from).exists():
            hint = f" (init_from {config.init_from} is no file or folder here, so it was read as a hub id)"
        print(f"SD_Train.py: error (rank {d.rank}): {error}{hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as error:  # outside the loop's own handler: loading, class images
        signum = getattr(error, "signum", signal.SIGINT)
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        if d.is_main:
            print(f"SD_Train.py: interrupted ({what}) outside a training step; what was finished is kept "
                  "(checkpoints, class images): re-run the same command to go on", file=sys.stderr)
        return 128 + signum
    finally:
        sd.distributed.teardown()


def estimate_memory(config: TrainConfig, gpu_memory_gb: float | None, resolution: int | None,
                    world_size: int = 1) -> int:
    """``--estimate_memory``: the prediction, without data, weights or a GPU (``sd.train.memory``)."""
    if gpu_memory_gb is None:
        gpu_memory_gb = (torch.cuda.get_device_properties(0).total_memory / 1e9 if torch.cuda.is_available()
                         else 24 * 2**30 / 1e9)
    try:
        resolution = resolution or sd.train.memory.resolution_of(config)
        print(json.dumps(sd.train.memory.report(config, resolution, gpu_memory_gb, world_size)))
    except ConfigError as error:
        print(f"SD_Train.py: config error: {error}", file=sys.stderr)
        return 2
    return 0


def train(config: TrainConfig, d: Dist) -> int:
    """One trainer per run folder: the lock is held from before anything is read until the end."""
    lock = sd.train.run.lock_run_folder(Path(config.out_dir), d)
    try:
        return train_locked(config, d)
    finally:
        lock.release()


def build(config: TrainConfig, d: Dist) -> Run:
    """The run's data, models and step, resumed from its newest usable checkpoint or initialised from
    ``init_from``; its config is final from here on."""
    if config.batch_size == AUTO_BATCH:
        config = dataclasses.replace(config, batch_size=sd.train.memory.auto_batch_size(config, d))
    config = sd.train.config_loading.resolve_global_batch(config, d.world_size)
    run = sd.train.run.build(config, d)
    sd.train.recovery.resume_or_init(run)
    sd.train.step.wrap_model(run.step, run.config.compile, len(run.train_data.shapes), run.config.compile_mode)
    return run


def train_locked(config: TrainConfig, d: Dist) -> int:
    run = build(config, d)
    config, state = run.config, run.state
    if config.stop_at_step and state.step >= config.stop_at_step:
        log.info("the run is at step %d, at or past stop_at_step %d: nothing to do", state.step, config.stop_at_step)
        return 0
    metrics = sd.train.run.open_metrics(run)
    if d.is_main:
        (run.run_dir / "config.yaml").write_text(config_yaml(config))
        source = (f"{len(run.train_data.splits)} dataset(s)" if run.train_data.splits
                  else f"instance_dir {config.subject.instance_dir}")
        log.info("%d training samples in %s, latents %s; %d steps/epoch, %d steps in all; "
                 "%d %s per optimizer step (batch_size %d x %d GPU(s) x grad_accum %d%s)", len(run.train_data),
                 source, " ".join(str(s) for s in run.train_data.shapes), run.steps_per_epoch,
                 run.total_steps, config.batch_size * config.grad_accum * d.world_size,
                 run.step.objective.batch_unit, config.batch_size,
                 d.world_size, config.grad_accum,
                 f", set by global_batch {config.global_batch}" if config.global_batch else
                 "; global_batch keeps it on any number of GPUs")
        if state.step:
            log.info("resumed at step %d (epoch %d, micro-batch %d of the epoch)", state.step, state.epoch,
                     state.position)
    sd.distributed.barrier(d)
    stopper = StopSignal()
    run.rng.start(config.seed, d.rank)
    bar = tqdm(total=run.total_steps, initial=state.step, disable=not d.is_main, desc="train", unit="step")
    prefetch = Prefetcher(run.train_data, pin=d.device.type == "cuda")
    try:
        with logging_redirect_tqdm():  # log lines (a stop, a validation) print above the bar, not on it
            code = loop(run, stopper, metrics, bar, prefetch)
    finally:
        prefetch.close()
        bar.close()
        stopper.restore()
        if metrics is not None:
            metrics.close()
    if d.is_main:
        sd.train.metrics.plot_metrics(run.run_dir / "metrics.jsonl", run.run_dir / "loss.png")
    return code


def loop(run: Run, stopper: StopSignal, metrics, bar, prefetch: Prefetcher) -> int:
    """Optimizer steps until the phase's last (or a stop): each epoch in its own order, the next step's
    micro-batches built while this one runs; logging, validation, evaluation and saves between steps.

    The host does not wait for the device between steps: each step's statistics stay on the device
    until a step that needs them (a log record, validation, a save, the last step; see ``read_due``),
    and one read then takes every step's since the last one.
    """
    config, d, state, total = run.config, run.d, run.state, run.total_steps
    images_per_step = config.batch_size * config.grad_accum * d.world_size
    tick, window_images = time.perf_counter(), 0
    unread = []  # (step, epoch, lr, result) of the steps taken since the last read
    while state.step < total:
        batches, flips, draws = sd.data.training_data.epoch_plan(run.train_data, config.seed, state.epoch, d.rank,
                                                                d.world_size, config.batch_size,
                                                                config.data.epoch_size or None, config.data.flip)
        usable = len(batches) // config.grad_accum * config.grad_accum
        while state.position < usable and state.step < total:
            position, accum = state.position, config.grad_accum
            micro = prefetch.take((state.epoch, position), batches[position : position + accum],
                                  flips[position : position + accum], draws[position : position + accum])
            if position + accum < usable and state.step + 1 < total:  # the next step's batch, built meanwhile
                nxt = slice(position + accum, position + 2 * accum)
                prefetch.ahead((state.epoch, position + accum), batches[nxt], flips[nxt], draws[nxt])
            lr = sd.train.step.lrs_at(config, state.step, total)  # each parameter group's
            sd.train.step.set_lr(run.step.optimizer, lr)
            with sd.model.attention_context(d.device, config.attention):
                result = sd.train.step.train_step(run.step, micro, state.step, stop_requested=stopper.requested())
            epoch_done = state.advance(config.grad_accum, usable, images_per_step)
            if run.step.posthoc and d.is_main and (state.step % config.ema.posthoc_every == 0
                                                   or state.step == total):
                sd.train.power_ema.write_snapshot(run.run_dir, state.step, run.step.posthoc, run.step.posthoc_text)
            unread.append((state.step, state.epoch, lr, result))
            window_images += images_per_step
            if d.is_main:
                bar.update(1)
                sd.faults.point("sigterm_parent", state.step)
            if read_due(run, epoch_done, stopper):
                sd.train.step.read_results([r for *_, r in unread])
                records, code = sd.train.run.take_results(run, unread)
                if any(r["stop"] for *_, r in unread):  # every rank agreed to stop after this step
                    code = stop_code(run, stopper) if code is None else code
                unread = []
                if records and records[-1]["step"] == state.step:
                    now = time.perf_counter()
                    records[-1]["images_per_s"] = window_images / (now - tick)
                    tick, window_images = now, 0
                image, best = None, False
                if sd.train.validation.due(config, state.step, total):
                    if not records or records[-1]["step"] != state.step:
                        records.append(step_record(run, result, lr))
                    if code is not None:  # stopping: save now
                        log.info("step %d: validation/evaluation skipped: stopping", state.step)
                    else:  # a stop signal during them cuts them short on every rank, and the run stops here
                        image, interrupted = sd.train.validation.check(run, records[-1], stopper.requested)
                        if interrupted:
                            code = stop_code(run, stopper)
                        else:
                            best = sd.train.recovery.track_best(run, records[-1])
                if code is None and state.step == config.stop_at_step:
                    log.info("stop_at_step %d reached; re-run without it to continue", state.step)
                    code = 0
                if d.is_main:
                    for i, record in enumerate(records):
                        metrics.write(record, image if i == len(records) - 1 else None)
                    bar.set_postfix(loss=f"{result['loss']:.4f}", lr=f"{lr['unet']:.2e}")
                if best or sd.train.recovery.due(run, epoch_done, stopping=code is not None):
                    sd.train.recovery.save(run)
                if code is not None:
                    return code
            if epoch_done:
                break  # the next epoch has its own order
    log.info("finished: %d steps, %d images", state.step, state.samples_seen)
    return 0


def read_due(run: Run, epoch_done: bool, stopper: StopSignal) -> bool:
    """Whether the statistics of the steps since the last read are read after this step: for a log
    record, validation, a save, stop_at_step or the last step; with one rank also at once on a stop
    signal (with several, the ranks learn of one at their next read, at most ``log_every`` steps on)."""
    config, step = run.config, run.state.step
    return (step % config.log_every == 0 or step == run.total_steps or step == config.stop_at_step
            or sd.train.validation.due(config, step, run.total_steps)
            or sd.train.recovery.due(run, epoch_done, stopping=False)
            or (run.d.world_size == 1 and stopper.requested()))


if __name__ == "__main__":
    sys.exit(main())

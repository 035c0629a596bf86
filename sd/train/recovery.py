"""A run's checkpoint policy: what is saved (``resumable``), when, what is pruned, which checkpoint a
re-run resumes (the newest that verifies; damaged ones are set aside), what a new phase starts from
(``init_from``) and what a LoRA run's base is. The files themselves are ``sd.train.checkpoint``'s.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path

import torch
from safetensors import SafetensorError

import sd.cli
import sd.distributed
import sd.files
import sd.formats
import sd.lora.adapters
import sd.metadata
import sd.run_folder
import sd.train.checkpoint as ckpt
import sd.train.ema
import sd.train.optimizers
import sd.train.power_ema
import sd.train.sharding
from sd.distributed import Dist
from sd.run_folder import read_saved_config
from sd.train.config import ConfigError, TrainConfig, config_yaml, resume_changes
from sd.train.state import Run

log = logging.getLogger("sd_train")


def resume_or_init(run: Run) -> None:
    """Resume from the newest usable checkpoint in ``out_dir`` (damaged newer ones are set aside), else
    start a new phase from ``init_from``. The run's config is final after this: ``ema_warmup`` made
    concrete, as config.yaml and every checkpoint record it."""
    resumed = resume_newest_usable(run)
    inherited = False
    if not resumed and run.step.objective.uses_base and not run.mode.frozen_base:
        log.info("%s", run.step.objective.starts_from_base)
    elif not resumed and run.config.init_from and run.config.subject.instance_dir and not run.mode.frozen_base:
        # full DreamBooth: the run trains on from the weights sd.train.run.build loaded, init_from's EMA where
        # it has one: the weights that drew the class images, and those its users sample
        log.info("DreamBooth fine-tune: training starts from the base weights that drew the class images (init_from's "
                 "EMA where it has one); the EMA starts from them too")
    elif not resumed and run.config.init_from and not run.mode.frozen_base:
        inherited = init_weights(run, run.config.init_from)
    resumed_from = sd.run_folder.latest_checkpoint(run.run_dir / "checkpoints") if resumed else None
    run.config = dataclasses.replace(run.config, **{"ema.warmup": ema_warmup_of(run.config, resumed_from, inherited)})
    for ema, _ in run.step.emas():
        ema.warmup = run.config.ema.warmup == "restart"


def due(run: Run, epoch_done: bool, stopping: bool) -> bool:
    """Whether the step just taken ends with a save: every ``save_steps``, at the end of the phase,
    before the run stops, and at an epoch's end when ``save_every_epoch`` asks for it."""
    step = run.state.step
    return (stopping or (epoch_done and run.config.save_every_epoch) or step % run.config.save_steps == 0
            or step == run.total_steps)


def resumable(run: Run) -> dict:
    """Every piece of state a resume restores, by name (one file each; see sd.train.checkpoint).

    The mode's trained weights come first (``Mode.trained_weights``): the UNet, or a LoRA's adapters
    (``adapter``), a learned token's vectors (``embedding``: the file AUTOMATIC1111 and ComfyUI load),
    a ControlNet (``controlnet``: diffusers' names). A mode that trains beside frozen weights saves their
    fingerprint instead of them (``lora_base``, checked by ``resume``: the base comes from ``init_from`` at
    every start), as a distillation run does of its teacher; the objective adds its own entries (a
    distillation's target network, ``lcm_target``). ``ema`` holds the UNet's EMA and the text encoder's
    (its adapter or learned token) when that trains (``sd.train.ema.EMAWeights``).
    The weight files hold the weights to evaluate, which a Schedule-Free optimizer keeps apart from
    those it trains at (``sd.train.optimizers``: those go in ``optimizer``, loaded after the weight files).
    """
    step = run.step
    states = {name: ckpt.Weights(sd.train.optimizers.EvaluationWeights(weights, step.optimizer))
              for name, weights in run.mode.trained_weights(step).items()}
    if run.base_fingerprint is not None:  # the frozen base, or a distillation's teacher: checked on resume
        states["lora_base"] = ckpt.Weights(BaseFingerprint(run.base_fingerprint))
    if run.parts_fingerprint:  # the text encoder and VAE as loaded at the start: checked on resume and sampling
        states[FROZEN_PARTS] = ckpt.Weights(BaseFingerprint(**run.parts_fingerprint))
    if step.ema is not None or step.text_ema is not None:
        states["ema"] = ckpt.Weights(sd.train.ema.EMAWeights(step.ema, step.text_ema))
    if step.posthoc:  # posthoc_ema_every: the two power-function EMAs (their snapshots: sd.train.power_ema)
        states["posthoc_ema"] = ckpt.Weights(sd.train.power_ema.PosthocWeights(step.posthoc, step.posthoc_text))
    states.update({name: ckpt.Weights(entry) for name, entry in step.objective.entries().items()})
    states.update(optimizer=sd.train.optimizers.OptimizerState(step.optimizer), scaler=step.scaler,
                  train_state=run.state, rng=ckpt.PerRank(run.rng))
    return sd.train.sharding.whole_states(states, step)


FROZEN_PARTS = sd.formats.FROZEN_PARTS_FILE.removesuffix(".safetensors")  # {"text_encoder", "vae"} fingerprints


class BaseFingerprint:
    """Weights the run does not save, each in one small tensor taken as loaded (before any cast to bf16): a
    LoRA run's base (``fingerprint``), the frozen text encoder and VAE (``text_encoder``, ``vae``); saved with
    every checkpoint and compared by ``resume`` before anything is loaded."""

    def __init__(self, fingerprint: torch.Tensor | None = None, **parts: torch.Tensor):
        self.tensors = {"fingerprint": fingerprint} if fingerprint is not None else {}
        self.tensors.update(parts)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    def load_state_dict(self, state) -> None:  # checked by resume, where a mismatch is a config error
        pass


def save(run: Run) -> None:
    checkpoints = run.run_dir / "checkpoints"
    ckpt.check_ranks_agree(run.step.unet, run.d, run.state.step)
    states = resumable(run)
    final = ckpt.save(checkpoints, run.state.step, states, run.d, config_yaml(run.config),
                      headers=weight_headers(run, states), times={"started_at": run.started_at})
    if run.d.is_main:
        best = run.state.best_step if run.config.keep_best and run.state.best_metric == run.config.keep_best else 0
        if best:
            write_best(run)
        removed = ckpt.prune(checkpoints, run.config.keep_checkpoints, run.config.keep_every_steps,
                             keep=(best,) if best else ())
        log.info("saved %s%s", final, f" (pruned {len(removed)})" if removed else "")


def track_best(run: Run, record: dict) -> bool:
    """Whether this step's evaluation in ``record`` is the best so far by ``keep_best`` (then its checkpoint is
    saved now, and kept). The same on every rank: each holds the same scores."""
    metric = run.config.keep_best
    value = record.get(f"eval_{metric}") if metric else None
    if not isinstance(value, (int, float)) or not math.isfinite(value) or not run.state.improves(metric, value):
        return False
    log.info("step %d: the best %s so far (%.4f): its checkpoint is kept (%s)", run.state.step, metric, value,
             sd.run_folder.BEST_FILE)
    return True


def write_best(run: Run) -> None:
    """``OUT_DIR/best.json``: the metric, step, score and checkpoint folder of the best evaluation (atomically)."""
    state = run.state
    sd.files.write_text_atomic(run.run_dir / sd.run_folder.BEST_FILE, json.dumps({
        "metric": state.best_metric, "step": state.best_step, "value": state.best_value,
        "checkpoint": f"checkpoints/{sd.run_folder.step_dir_name(state.best_step)}"}, indent=1) + "\n")


# The checkpoint entries that hold a model (the header says which kind: sd.metadata.KINDS); ``ema`` holds the
# EMA of whichever of them the mode trains, which comes first in ``resumable``.
MODEL_ENTRIES = {"unet": "unet", "lcm_target": "unet", "adapter": "lora", "embedding": "textual-inversion",
                 "controlnet": "controlnet-diffusers"}


def weight_headers(run: Run, states: dict) -> dict[str, dict[str, str]]:
    """The ``modelspec`` header of each model file of a checkpoint (``sd.metadata``), titled by the run
    folder's name and the step."""
    kinds = {name: MODEL_ENTRIES[name] for name in states if name in MODEL_ENTRIES}
    if not kinds:
        return {}
    if "ema" in states:
        kinds["ema"] = next(iter(kinds.values()))
    title = f"{run.run_dir.name} step {run.state.step}"
    # flat: a DreamBooth run's instance_dir and image_size are fields of its subject section
    resolution = (sd.metadata.training_resolution(sd.run_folder.flat_view(dataclasses.asdict(run.config)))
                  or sd.metadata.model_resolution(run.step.unet))
    return {name: sd.metadata.modelspec(kind, title, run.config.prediction_type, resolution, time.time())
            for name, kind in kinds.items()}


def resume_newest_usable(run: Run) -> bool:
    """Resume from the newest complete checkpoint that verifies; False when the run has none yet.

    The checkpoint's settings are compared with the run's first (``check_settings``): a change is a
    ConfigError or a warning, never damage. A checkpoint that fails then (a file that does not match
    the manifest, cannot be read, or loads weights that do not match their fingerprint) is named in
    one log line, renamed ``step_N.damaged``, and the next older one is tried. If every checkpoint is
    damaged the run stops rather than start over.
    """
    checkpoints = run.run_dir / "checkpoints"
    damaged = []
    for _, folder in reversed(sd.run_folder.complete_checkpoints(checkpoints)):
        try:
            saved = {}
            agreed(run.d, lambda: saved.update(check_settings(run, folder)))
            parts = parts_to_load(run, saved)
            agreed(run.d, lambda: verify_checkpoint(run, folder, parts))
            agreed(run.d, lambda: resume(run, folder, parts))
            return True
        except sd.run_folder.Damaged as error:
            log.warning("checkpoint %s is damaged, skipped: %s", folder, error)
        damaged.append(folder)
        if run.d.is_main:
            ckpt.set_aside(folder)
        sd.distributed.barrier(run.d)
    damaged = damaged or sorted(checkpoints.glob(f"step_*{sd.run_folder.DAMAGED_SUFFIX}*"))
    if damaged:
        raise sd.run_folder.CheckpointError(
            f"no usable checkpoint in {checkpoints}: {', '.join(f.name for f in damaged)} damaged (set aside as "
            f"*{sd.run_folder.DAMAGED_SUFFIX}); restore a good copy there, or move them away to start the run over")
    return False


def agreed(d: Dist, attempt) -> None:
    """Run ``attempt`` on every rank and raise the same error on all of them if it failed on any:
    ``sd.run_folder.Damaged`` before ``ConfigError`` (no rank is left waiting in a collective)."""
    try:
        attempt()
        outcome = None
    except sd.run_folder.Damaged as error:
        outcome = ("damaged", f"rank {d.rank}: {error}" if d.world_size > 1 else str(error))
    except ConfigError as error:
        outcome = ("config", str(error))
    outcomes = [o for o in sd.distributed.all_gather_objects(outcome, d) if o]
    for kind, error_type in (("damaged", sd.run_folder.Damaged), ("config", ConfigError)):
        for found, message in outcomes:
            if found == kind:
                raise error_type(message)


SETTINGS_FILES = ("config.yaml", "train_state.pt")


def check_settings(run: Run, folder: Path) -> dict:
    """Compare the run's settings with those ``folder`` was written with; returns its saved config.

    Its config and train state are verified and read first (damage there is ``sd.run_folder.Damaged``). A field
    whose change would not continue the same run (``sd.train.config.ON_RESUME``), another world size or
    another number of training samples is a ConfigError naming the old and new values; an accepted
    change is logged with what the resumed run does.
    """
    try:
        sd.run_folder.verify(folder, list(SETTINGS_FILES))
        saved = read_saved_config(folder / "config.yaml")
        state = sd.run_folder.load_torch(folder / "train_state.pt")
        written_by, samples = int(state["world_size"]), int(state.get("data_samples", 0))
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as error:
        raise sd.run_folder.Damaged(f"{folder}: {sd.cli.first_line(error)}") from error
    refused, warned = resume_changes(saved, run.config)
    if written_by != run.d.world_size:
        refused.append(f"world size: {written_by} -> {run.d.world_size} rank(s) (it fixes the data order and each "
                       f"rank's random state: resume with --nproc_per_node {written_by})")
    if samples and samples != len(run.train_data):
        refused.append(f"training samples: {samples} -> {len(run.train_data)} (they fix the data order)")
    if refused:
        raise ConfigError(f"{folder} was written with other settings: {'; '.join(refused)}. Resume with the "
                          "checkpoint's values, or start a new phase from these weights: a new out_dir with "
                          f"init_from {folder}")
    if run.d.is_main:
        for change in warned:
            log.warning("resuming %s with a changed setting, %s", folder, change)
    return saved


def parts_to_load(run: Run, saved: dict) -> dict:
    """The resumable state a checkpoint written with the ``saved`` config has for this run: an EMA
    turned on since starts from the resumed weights, and a loss scaler new with fp16 starts afresh."""
    parts = resumable(run)
    parts.pop(FROZEN_PARTS, None)  # compared by resume, where a checkpoint of before it was recorded has none
    if "ema" in parts and not saved.get("ema_decay"):
        del parts["ema"]
    if run.config.precision == "fp16" and saved.get("precision") != "fp16":
        del parts["scaler"]
    return parts


def verify_checkpoint(run: Run, folder: Path, parts: dict) -> None:
    """Check the files this rank reads against the manifest (rank 0 the shared ones, each rank its
    own); raises ``sd.run_folder.Damaged`` naming the first that fails."""
    mine = [ckpt.file_name(name, obj, run.d.rank) for name, obj in parts.items()
            if run.d.is_main or isinstance(obj, ckpt.PerRank)]
    if not sd.run_folder.verify(folder, mine):
        log.warning("%s has no manifest (written by an older version): its files are not verified", folder)


def resume(run: Run, folder: Path, parts: dict) -> None:
    """Restore ``parts`` from a complete, verified checkpoint whose settings ``check_settings`` accepted.

    An unreadable file raises ``sd.run_folder.Damaged``; a LoRA base other than the adapter's is a ConfigError.
    """
    if run.base_fingerprint is not None:
        check_lora_base(run, folder)
    check_frozen_parts(run, folder)
    ckpt.load(folder, parts, run.d.rank)
    run.started_at = sd.run_folder.read_manifest_times(folder).get("started_at", run.started_at)
    if run.step.posthoc and run.d.is_main:  # snapshots of the steps this run takes again are written again
        removed = sd.train.power_ema.remove_after(run.run_dir, run.state.step)
        if removed:
            log.info("removed %d post-hoc EMA snapshots after step %d (of steps taken again)", len(removed),
                     run.state.step)
    emas = run.step.emas()
    if "ema" not in parts:
        emas_to_start = emas
    elif getattr(parts["ema"].obj, "text_missing", False):  # written before the text adapter had an EMA
        emas_to_start = [(ema, model) for ema, model in emas if ema is run.step.text_ema]
    else:
        emas_to_start = []
    with sd.train.optimizers.evaluation_weights(run.step.optimizer), \
            sd.train.optimizers.full_weights(run.step.optimizer):  # an EMA averages the weights evaluated
        for ema, model in emas_to_start:
            ema.load_state_dict(dict(zip(ema.names, ema.parameters(model))))
    if emas_to_start:
        log.info("the EMA of the %s starts from the weights of %s",
                 " and ".join("text encoder's adapter" if model is run.step.text_encoder else "UNet"
                              for _, model in emas_to_start), folder)
    log.info("verified and loaded %s", folder)


def check_lora_base(run: Run, folder: Path) -> None:
    """The base weights loaded now must be those the checkpoint's adapter was trained on."""
    try:
        saved = sd.run_folder.load_weights(folder / "lora_base.safetensors")["fingerprint"]
    except (OSError, KeyError, RuntimeError, SafetensorError) as error:
        raise sd.run_folder.Damaged(f"{folder / 'lora_base.safetensors'}: {sd.cli.first_line(error)}") from error
    now = run.base_fingerprint
    if not sd.lora.adapters.same_base(saved, now):
        what = run.step.objective.what or run.mode.what
        raise ConfigError(f"init_from {run.config.init_from} is not the base model the {what} in {folder} was "
                          "trained on; restore that base, or start a new out_dir")


def check_frozen_parts(run: Run, folder: Path) -> None:
    """The text encoder and VAE loaded now must be those the checkpoint's run started with (the files its
    config names may have changed since); a checkpoint of before they were recorded is not checked."""
    path = folder / f"{FROZEN_PARTS}.safetensors"
    if not path.is_file():
        return
    try:
        saved = sd.run_folder.load_weights(path)
    except (OSError, RuntimeError, ValueError, SafetensorError) as error:
        raise sd.run_folder.Damaged(f"{path}: {sd.cli.first_line(error)}") from error
    for field, now in run.parts_fingerprint.items():
        if field in saved and not sd.lora.adapters.same_base(saved[field], now):
            what = "text encoder" if field == "text_encoder" else "VAE"
            raise ConfigError(f"{field}: the {what} loaded from {getattr(run.config, field)} is not the one this run "
                              f"was trained with (its weights differ from those {path} records); restore that "
                              "file, or start a new out_dir")


def load_base(source: str, unet) -> None:
    """The weights a LoRA or DreamBooth run starts from (an EMA of ours where there is one)."""
    try:
        loaded = sd.formats.load_unet_weights(source, unet, use_ema=True)
    except (OSError, KeyError, ValueError) as error:  # the message names the file
        raise ConfigError(f"init_from: cannot load {source}: {sd.cli.first_line(error)}") from error
    log.info("base weights from %s", loaded)


def init_weights(run: Run, source: str) -> bool:
    """Start a new phase from other weights; optimizer and schedule stay fresh.

    ``source``: a run or checkpoint folder of ours (its live weights, and its EMA for the EMA), a
    diffusers pipeline folder or hub id, or a single-file SD checkpoint (both for UNet and EMA).
    Returns whether the EMA came from ``source``'s own EMA (else it starts as the live weights).
    """
    unet, ema, ema_state = run.step.unet, run.step.ema, None
    try:
        with sd.train.optimizers.full_weights(run.step.optimizer):  # bf16_weights: into the fp32 masters
            loaded = sd.formats.load_unet_weights(source, unet, use_ema=False)
            if ema is not None:
                ema_state = sd.formats.run_ema_weights(source, unet)
                ema.load_state_dict(unet.state_dict() if ema_state is None else ema_state)
    except (OSError, KeyError, ValueError) as error:  # the message names the file
        if Path(source).exists():
            raise ConfigError(f"init_from: cannot load {source}: {sd.cli.first_line(error)}") from error
        raise ConfigError(f"init_from: {source} is no local file or folder, and could not be loaded as a hub id "
                          f"({sd.cli.first_line(error)})") from error
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
    if config.ema.warmup != "auto":
        return config.ema.warmup
    if resumed_from is not None:
        recorded = sd.run_folder.saved_value(read_saved_config(resumed_from / "config.yaml"), "ema.warmup")
        return recorded if recorded in ("restart", "off") else "restart"
    return "off" if inherited else "restart"

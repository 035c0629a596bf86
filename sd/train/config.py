"""The training config: the top-level fields of a run, and one section for each component that reads its own
settings (``lora:``, ``optim:``, ``eval:``, ...), declared beside that component (``sd.lora.mode.LoraConfig``),
with the checks that span them and the resume rule of each field.

A top-level field is ``--field value`` on the command line, a section's ``--section.field value``; the flat names
the config had before its sections (``lora_rank: 8``, ``--lora_rank 8``: ``sd.run_folder.LEGACY_KEYS``) still read,
into the sections, in YAMLs, flags and code alike. ``sd.train.config_loading`` reads YAMLs and flags into a
``TrainConfig``; a mistake stops before any work with a message naming the field and the fix.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

import sd.cli
import sd.model
import sd.sampling
import sd.train.modes
import sd.train.objectives
import sd.train.sharding
import sd.training_mode
from sd.cli import ConfigError
from sd.controlnet.mode import ControlNetConfig
from sd.data.captions import CaptionsConfig
from sd.data.dreambooth import SubjectConfig
from sd.data.training_data import DataConfig
from sd.embedding.mode import EmbeddingConfig
from sd.evaluation import EvalConfig, ValidationConfig
from sd.lora.mode import LoraConfig
from sd.run_folder import LEGACY_KEYS, saved_value
from sd.settings import (BELOW_ONE, COUNT, FREE, MATH, NON_NEGATIVE, ORDER, POSITIVE, REFUSE, SCHEDULE, OnResume, Range,
                         default_of, refused, setting, warned)
from sd.train.ema import EmaConfig
from sd.train.objectives.diffusion import LossConfig
from sd.train.objectives.flow import FlowConfig
from sd.train.objectives.dmd import DMDConfig
from sd.train.objectives.lcm import DistillConfig
from sd.train.objectives.preference import PreferenceConfig
from sd.train.optimizers import OptimConfig


# The sections whose checks run before the modes' and objectives' (the others, and ema's, after them).
BEFORE_MODES = ("data", "subject", "loss", "optim")


def section(cls):
    """A TrainConfig field that holds one component's section (``SECTIONS``)."""
    return dataclasses.field(default_factory=cls, metadata={"section": True})


@dataclass(frozen=True, init=False)
class TrainConfig:
    """One phase's settings. Frozen: what resolves later (``batch_size: auto``, ``ema.warmup: auto``) is a new
    config made with ``dataclasses.replace``, so no part of the run sees a value change.

    Made from keyword values: top-level fields by name, a section as its object or a mapping of its fields, a
    section's field by its dotted name (``**{"lora.rank": 8}``) or its flat one (``lora_rank=8``); a field given
    alone overrides its section's. ``config.lora_rank`` reads ``config.lora.rank``."""

    # -- data and models -------------------------------------------------------------------------------------------
    datasets: list = setting("[{dataset: DIR, latents: DIR, weight: 1.0}, ...]: caption datasets "
                             "(05_build_hf_dataset.py) joined to latent folders (encode_latents.py), mixed by weight",
                             default_factory=list, resume=refused(ORDER))
    unet: str = setting("UNet preset: sd1, demo or tiny (with init_from a run of ours: that run's)", "sd1",
                        resume=refused("the model"))
    vae: str = setting("VAE hub id, local folder or tiny (used for validation images; with init_from a run of "
                       "ours: that run's)", sd.model.DEFAULT_VAE, resume=refused("the instance latents", subject=True))
    text_encoder: str = setting("CLIP text encoder hub id, local folder or tiny (with init_from a run of ours: that "
                                "run's)", sd.model.DEFAULT_TEXT_ENCODER, resume=refused("the text conditioning"))
    tokenizer: str = setting("CLIP tokenizer; empty = the text encoder's (with init_from a run of ours: that run's)",
                             "", resume=refused("the text conditioning"))
    clip_skip: int = setting("CLIP skip: the text condition is the text encoder's hidden state this many layers from "
                             "the end, through its final layer norm (1: the last layer; 2: what NovelAI-descended "
                             "anime models are trained and sampled with), as AUTOMATIC1111, ComfyUI and sd-scripts "
                             "compute it", 1, allowed=Range(1), resume=refused("the text conditioning"))
    prediction_type: str = setting("epsilon, v_prediction or flow (rectified flow: the UNet predicts the velocity "
                                   "noise - image of the straight path between them; see docs/training.md)", "epsilon",
                                   resume=refused(MATH))
    init_from: str = setting("start from these weights (a checkpoint or run folder) with a fresh optimizer "
                             "and schedule; ignored when out_dir already holds a checkpoint to resume", "",
                             resume=OnResume(FREE, "a resume loads its checkpoint (a LoRA run's base is checked by its fingerprint)"))
    cache_text_embeddings: bool = setting("encode every distinct prompt of the run once at start (host memory: 77 x "
                                          "768 floats each) and keep the text encoder off the device; not with "
                                          "lora_text_encoder", False)
    # -- optimisation ----------------------------------------------------------------------------------------------
    batch_size: int = setting("micro-batch size per GPU; auto (or 0): the largest that the GPU's memory holds, as "
                              "--estimate_memory predicts it (CUDA only; fixed for the run once chosen)", 24,
                              allowed=NON_NEGATIVE, resume=refused(ORDER))
    grad_accum: int = setting("micro-batches accumulated per optimizer step (replaced when global_batch is set)", 2,
                              allowed=COUNT, resume=refused(ORDER))
    global_batch: int = setting("images per optimizer step across every GPU, kept whatever the number of GPUs: "
                                "grad_accum becomes global_batch / (batch_size x GPUs), and a batch that cannot make "
                                "it exactly stops with the settings that can; 0 = batch_size x grad_accum x GPUs", 0,
                                allowed=NON_NEGATIVE, resume=refused(ORDER))
    max_steps: int = setting("optimizer steps of the phase; 0 = run `epochs` epochs", 0, allowed=NON_NEGATIVE,
                             resume=refused(SCHEDULE))
    epochs: int = setting("epochs of the phase when max_steps is 0", 1, allowed=NON_NEGATIVE, resume=refused(SCHEDULE))
    lr: float = setting("peak learning rate", 1e-5, allowed=POSITIVE, resume=refused(SCHEDULE))
    warmup_steps: int = setting("linear warm-up steps from lr * 0.01 to lr (adamw_schedulefree: from lr / warmup_steps)",
                                500, allowed=NON_NEGATIVE, resume=refused(SCHEDULE))
    zero_terminal_snr: bool = setting("rescale the noise schedule so the last timestep is pure noise (needs "
                                      "prediction_type v_prediction); samplers then space timesteps 'trailing'", False,
                                      resume=refused(MATH))
    grad_clip: float = setting("clip the global gradient norm to this; 0 = no clipping", 1.0,
                               allowed=NON_NEGATIVE, resume=refused(MATH))
    min_snr_gamma: float = setting("Min-SNR-gamma loss weighting; 0 = none", 5.0, allowed=NON_NEGATIVE,
                                   resume=refused(MATH))
    cfg_dropout: float = setting("fraction of samples trained with the empty prompt (for classifier-free guidance)", 0.05,
                                 allowed=BELOW_ONE, resume=refused(MATH))
    ema_decay: float = setting("EMA decay; 0 = no EMA", 0.9999, allowed=BELOW_ONE,
                               resume=warned("the EMA goes on with the new decay; turned on, it starts from the resumed weights; turned off, the checkpoints' EMA is not carried on"))
    ema_device: str = setting("where the EMA lives: same (the training device) or cpu", "same")
    precision: str = setting("bf16 (autocast), fp16 (autocast + GradScaler) or fp32", "bf16",
                             resume=warned("the resumed steps compute in the new precision (an fp16 loss scale starts afresh when fp16 is new)"))
    grad_checkpointing: bool = setting("recompute activations in backward to save memory", True)
    channels_last: bool = setting("channels_last memory format for the UNet", False)
    compile: bool = setting("torch.compile the UNet (works with grad_checkpointing)", False)
    compile_mode: str = setting("torch.compile mode with compile: default, max-autotune-no-cudagraphs (searches "
                                "kernel choices at start), reduce-overhead (CUDA graphs: replays each micro-batch's "
                                "kernels without launching them one by one) or max-autotune (both); "
                                "bench/train_throughput.py --compile_modes measures them on a GPU", "default")
    attention: str = setting("attention kernels of the training step on a GPU: auto (flash, else memory-efficient), "
                             "cudnn (cuDNN's fused attention first, then as auto), flash, efficient, or math (the full "
                             "attention matrix: slow, for checks); ignored on a CPU", "auto")
    max_bad_steps: int = setting("stop after this many non-finite steps in a row", 10, allowed=COUNT)
    sharding: str = setting("how a full fine-tune spreads over several GPUs: none (DDP: every GPU holds the weights, "
                            "gradients and optimizer state), zero1 (DDP, the AdamW state split across the GPUs) or "
                            "fsdp (FSDP2: weights, gradients, AdamW state and EMA split); not with lora_rank", "none",
                            resume=OnResume(FREE, "checkpoints hold whole tensors whatever the sharding"))
    fsdp_reduce_each_micro_batch: bool = setting("sharding: fsdp with grad_accum above 1: reduce-scatter the gradients "
                                                 "after every micro-batch, so they accumulate split across the GPUs "
                                                 "(at SD 1.x size 3.44 GB less per GPU than whole gradients kept until "
                                                 "the last micro-batch), for a reduce-scatter per micro-batch instead "
                                                 "of one per step", False)
    # -- checkpoints and logging -----------------------------------------------------------------------------------
    out_dir: str = setting("run folder: config.yaml, metrics.jsonl, samples/, checkpoints/", "runs/train")
    save_steps: int = setting("save a checkpoint every N optimizer steps (and at the end of the run)", 1500,
                              allowed=COUNT)
    save_every_epoch: bool = setting("also save at the end of each epoch", False)
    keep_checkpoints: int = setting("keep the newest N checkpoints (at least 2: the newest may be mid-write when a "
                                    "run dies)", 3, allowed=Range(2))
    keep_every_steps: int = setting("also keep every checkpoint whose step is a multiple of this; 0 = none", 0,
                                    allowed=NON_NEGATIVE)
    keep_best: str = setting("with eval_every: fid (lowest) or clip_score (highest): each evaluation that beats the "
                             "best so far saves its step's checkpoint, which pruning then keeps until a better one "
                             "comes; OUT_DIR/best.json names it (SD_ImageGen.py --ckpt OUT_DIR --best); empty = off", "",
                             resume=warned("the best checkpoint is chosen by the new metric from the next evaluation on"))
    stop_at_step: int = setting("end after this optimizer step as an interruption would (save, exit 0); 0 = off", 0,
                                allowed=NON_NEGATIVE)
    log_every: int = setting("log metrics every N optimizer steps (the step statistics are read from the device then, not every step)", 10, allowed=COUNT)
    validate_every: int = setting("validation loss and sample grid every N optimizer steps and at the last; 0 = never",
                                  1000, allowed=NON_NEGATIVE)
    validation_prompts: list = setting("prompts of the validation sample grid",
                                       default_factory=lambda: ["a photograph of an astronaut riding a horse"])
    wandb_project: str = setting("wandb project name", "sd1-train")
    wandb_mode: str = setting("wandb: online, offline or disabled (API key from the environment)", "disabled")
    tensorboard: str = setting("the metrics and sample grids as TensorBoard events in OUT_DIR/tensorboard (view with "
                               "tensorboard --logdir OUT_DIR): auto (when wandb_mode is disabled), true or false", "auto")
    # -- run -------------------------------------------------------------------------------------------------------
    seed: int = setting("seed of the model init, data order and diffusion noise", 0,
                        allowed=Range(0, 2**32 - 1, high_open=False), resume=refused(ORDER))
    device: str = setting("auto, cpu, cuda", "auto")

    data: DataConfig = section(DataConfig)
    captions: CaptionsConfig = section(CaptionsConfig)
    subject: SubjectConfig = section(SubjectConfig)
    lora: LoraConfig = section(LoraConfig)
    embedding: EmbeddingConfig = section(EmbeddingConfig)
    controlnet: ControlNetConfig = section(ControlNetConfig)
    flow: FlowConfig = section(FlowConfig)
    distill: DistillConfig = section(DistillConfig)
    dmd: DMDConfig = section(DMDConfig)
    preference: PreferenceConfig = section(PreferenceConfig)
    loss: LossConfig = section(LossConfig)
    optim: OptimConfig = section(OptimConfig)
    ema: EmaConfig = section(EmaConfig)
    validation: ValidationConfig = section(ValidationConfig)
    eval: EvalConfig = section(EvalConfig)

    def __init__(self, **values):
        tops, parts, flat = split_values(values)
        for f in dataclasses.fields(self):
            if f.name in SECTIONS:
                base = tops.get(f.name, SECTIONS[f.name]())
                if isinstance(base, dict):
                    base = SECTIONS[f.name](**base)
                value = dataclasses.replace(base, **parts.get(f.name, {}))
            else:
                value = tops.get(f.name, default_of(f))
            object.__setattr__(self, f.name, value)
        object.__setattr__(self, "flat_keys", tuple(flat))  # the flat names it was given (SD_Train.py names them)

    def __getattr__(self, name: str):
        """A section's field by its flat name (``config.lora_rank``: ``config.lora.rank``)."""
        if name in LEGACY_KEYS and not name.startswith("__"):
            where, field = LEGACY_KEYS[name]
            return getattr(object.__getattribute__(self, where), field)
        raise AttributeError(f"{type(self).__name__} has no field {name!r}")

    @property
    def sampler(self) -> str:
        """``validation.sampler`` with ``auto`` resolved."""
        if self.validation.sampler != "auto":
            return self.validation.sampler
        if self.distill.method == "dmd":  # a DMD generator draws in its own steps
            return "onestep"
        return sd.sampling.default_sampler(self.prediction_type, self.flow.matching)

    @property
    def mode(self) -> sd.training_mode.Mode:
        """What trains (``sd.train.modes.mode_of``): the section checks ask it instead of importing the modes."""
        return sd.train.modes.mode_of(self)

    @property
    def objective(self) -> type[sd.train.objectives.Objective]:
        """What the loss is (``sd.train.objectives.objective_of``)."""
        return sd.train.objectives.objective_of(self)

    def validate(self, check_paths: bool = True) -> None:
        """Reject bad values before any work, naming the field, the value and what is allowed: the top-level
        fields here, each section by its own ``check``, the modes' and objectives' rules by theirs.
        ``check_paths=False`` leaves the data folders and ``init_from`` unchecked (a memory estimate reads neither)."""
        def need(ok, message):
            if not ok:
                raise ConfigError(message)

        for name, f in FIELDS.items():
            check_type_and_range(name, value_of(self, name), f)
        need(self.unet in sd.model.UNET_PRESETS, f"unet: choose one of {sorted(sd.model.UNET_PRESETS)}")
        need(self.prediction_type in sd.model.PREDICTION_TYPES,
             f"prediction_type: one of {', '.join(sd.model.PREDICTION_TYPES)}")
        need(self.precision in ("bf16", "fp16", "fp32"), "precision: bf16, fp16 or fp32")
        need(self.compile_mode in COMPILE_MODES, f"compile_mode: one of {', '.join(COMPILE_MODES)}")
        need(self.attention in sd.model.ATTENTION_CHOICES, f"attention: one of {', '.join(sd.model.ATTENTION_CHOICES)}")
        need(self.wandb_mode in ("online", "offline", "disabled"), "wandb_mode: online, offline or disabled")
        need(self.tensorboard.lower() in ("auto", "true", "false"), "tensorboard: auto, true or false")
        need(self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda"), "device: auto, cpu or cuda")
        for name in ("vae", "text_encoder", "out_dir"):
            need(getattr(self, name).strip(), f"{name} must not be empty")
        need(all(isinstance(p, str) for p in self.validation_prompts), "validation_prompts: a list of strings")
        need(self.max_steps > 0 or self.epochs > 0, "set max_steps or epochs to a positive number")
        for name in BEFORE_MODES:
            getattr(self, name).check(self, check_paths)
        sd.train.modes.check(self, check_paths)
        sd.train.sharding.check(self)
        self.ema.check(self, check_paths)
        need(not (self.cache_text_embeddings and self.mode.text_encoder_trains),
             "cache_text_embeddings needs a frozen text encoder: turn off lora.text_encoder or the cache")
        sd.train.objectives.check(self, check_paths)
        for name in SECTIONS:  # the others after the modes and objectives, whose sections those check
            part = getattr(self, name)
            if name not in (*BEFORE_MODES, "ema") and callable(getattr(part, "check", None)):
                part.check(self, check_paths)
        conflict = sd.model.schedule_conflict(self.prediction_type, self.zero_terminal_snr)
        need(conflict is None, f"zero_terminal_snr: {conflict}; set prediction_type: v_prediction")
        need(not check_paths or not self.init_from or Path(self.init_from).exists()
             or sd.cli.looks_like_hub_id(self.init_from),
             f"init_from: {self.init_from} is neither an existing path nor a hub id (owner/name)")


# The sections, each the settings of one component, in the order docs/config.md and config.yaml show them.
SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(TrainConfig) if f.metadata.get("section")}
TOP = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name not in SECTIONS)
FIELDS = {**{f.name: f for f in dataclasses.fields(TrainConfig) if f.name in TOP},
          **{f"{name}.{f.name}": f for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}}
FLAT_NAMES = {f"{where}.{field}": flat for flat, (where, field) in LEGACY_KEYS.items()}  # dotted -> flat

AUTO_BATCH = 0  # batch_size: auto
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")
AUTO_COUNTS = ("batch_size", "ema.update_every")  # counts whose 0 is spelled auto
TYPES = {"int": int, "float": (int, float), "bool": bool, "str": str, "list": list}


def canonical(name: str) -> str:
    """A field's name as FIELDS has it: a flat name becomes its dotted one (``lora_rank``: ``lora.rank``)."""
    if name in LEGACY_KEYS and name not in FIELDS:
        where, field = LEGACY_KEYS[name]
        return f"{where}.{field}"
    return name


def value_of(config: TrainConfig, name: str):
    """A field of ``config`` by its name in FIELDS (``lr``, ``lora.rank``)."""
    where, _, field = name.rpartition(".")
    return getattr(getattr(config, where) if where else config, field)


def kind_of(f: dataclasses.Field) -> str:
    """A field's type as its annotation names it: int, float, bool, str or list."""
    return f.type if isinstance(f.type, str) else f.type.__name__


def split_values(values: dict) -> tuple[dict, dict, list]:
    """``TrainConfig``'s keyword values as ``(top-level fields and whole sections, {section: {field: value}} of
    the fields given alone, the flat names among them)``. An unknown name is a TypeError, as a dataclass's."""
    tops, parts, flat = {}, {}, []
    for name, value in values.items():
        if name in SECTIONS and not (name in LEGACY_KEYS and not isinstance(value, (dict, SECTIONS[name]))):
            tops[name] = value
        elif name in TOP:
            tops[name] = value
        elif canonical(name) in FIELDS and "." in canonical(name):
            where, _, field = canonical(name).partition(".")
            parts.setdefault(where, {})[field] = value
            if name != canonical(name):
                flat.append(name)
        else:
            raise TypeError(f"TrainConfig has no field {name!r}")
    return tops, parts, flat


def check_type_and_range(name: str, value, f: dataclasses.Field) -> None:
    """A field's value has the field's type and, for a number, lies in its ``allowed`` range."""
    kind = kind_of(f)
    if isinstance(value, bool) and kind != "bool" or not isinstance(value, TYPES[kind]):
        raise ConfigError(f"{name}: expected {kind}, got {value!r}")
    allowed = f.metadata["allowed"]
    if allowed is not None and not allowed.allows(value):
        raise ConfigError(f"{name} must be {allowed.describe(kind)}, got {value!r} ({f.metadata['help']})")


def check_models(config: TrainConfig, unet, text_encoder) -> None:
    """The models fit together and the config before any work: the text encoder's width is the UNet's
    cross-attention width, and the mode's own checks (``Mode.check_models``: every LoRA target selects a
    layer). A ConfigError names both."""
    width, wanted = text_encoder.config.hidden_size, unet.config.cross_attention_dim
    if width != wanted:
        raise ConfigError(f"text_encoder {config.text_encoder} gives {width}-wide embeddings, but unet {config.unet} "
                          f"attends to {wanted}-wide ones; use a text encoder of width {wanted} (SD 1.x: CLIP "
                          "ViT-L/14, 768) or the UNet made for this one")
    config.mode.check_models(unet, text_encoder)


def config_yaml(config: TrainConfig) -> str:
    """``config`` as a run's config.yaml holds it: the top-level fields, then each section as a mapping."""
    return yaml.safe_dump(dataclasses.asdict(config), sort_keys=False)


def resume_changes(saved: dict, config: TrainConfig) -> tuple[list[str], list[str]]:
    """The fields of ``config`` that differ from a checkpoint's ``saved`` config (``read_saved_config``), by each
    field's ``OnResume`` rule: ``(refused, warned)``, each as ``"name: old -> new (...)"``. A field newer than the
    saved config compares with its default."""
    refused_changes, warned_changes = [], []
    for name, f in FIELDS.items():
        rule = f.metadata["resume"]
        old, new = saved_value(saved, name, default_of(f)), value_of(config, name)
        if old == new or rule.action == FREE or (rule.subject and not config.subject.instance_dir):
            continue
        if rule.action == REFUSE:
            refused_changes.append(f"{name}: {old!r} -> {new!r} (it fixes {rule.then})")
        else:
            warned_changes.append(f"{name}: {old!r} -> {new!r}: {rule.then}")
    return refused_changes, warned_changes

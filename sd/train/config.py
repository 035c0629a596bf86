"""The training config: the top-level fields of a run, and one section for each component that reads its own
settings (``lora:``, ``optim:``, ``eval:``, ...), declared beside that component (``sd.lora.mode.LoraConfig``).

A YAML is loaded and then overridden by flags: a top-level field by ``--field value``, a section's by
``--section.field value``. A YAML may name a base file with ``extends: base.yaml`` (relative to itself); its
fields are read first and the YAML's own override them, so the phase recipes share one base. The flat names the
config had before its sections (``lora_rank: 8``, ``--lora_rank 8``: ``sd.run_folder.LEGACY_KEYS``) are read into
the sections, in YAMLs, flags and code alike. Values are converted to the field's type; unknown fields,
abbreviated flags and bad values stop before any work with a message naming the field and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
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
from sd.cli import ConfigError, load_yaml
from sd.controlnet.mode import ControlNetConfig
from sd.data.captions import CaptionsConfig
from sd.data.dreambooth import SubjectConfig
from sd.data.training_data import DataConfig
from sd.embedding.mode import EmbeddingConfig
from sd.evaluation import EvalConfig, ValidationConfig
from sd.lora.mode import LoraConfig
from sd.run_folder import LEGACY_KEYS, read_saved_config, saved_value
from sd.settings import (BELOW_ONE, COUNT, FREE, MATH, NON_NEGATIVE, ORDER, POSITIVE, REFUSE, SCHEDULE, OnResume, Range,
                         default_of, refused, setting, warned)
from sd.train.ema import EmaConfig
from sd.train.objectives.diffusion import LossConfig
from sd.train.objectives.flow import FlowConfig
from sd.train.objectives.lcm import DistillConfig
from sd.train.optimizers import OptimConfig

# The sections, each the settings of one component, in the order docs/config.md and config.yaml show them.
SECTIONS = {"data": DataConfig, "captions": CaptionsConfig, "subject": SubjectConfig, "lora": LoraConfig,
            "embedding": EmbeddingConfig, "controlnet": ControlNetConfig, "flow": FlowConfig,
            "distill": DistillConfig, "loss": LossConfig, "optim": OptimConfig, "ema": EmaConfig,
            "validation": ValidationConfig, "eval": EvalConfig}


def section(cls):
    return dataclasses.field(default_factory=cls, metadata={"section": True})


@dataclass(frozen=True, init=False)
class TrainConfig:
    """One phase's settings. Frozen: what resolves later (``batch_size: auto``, ``ema.warmup: auto``) is a new
    config made with ``dataclasses.replace``, so no part of the run sees a value change.

    Made from keyword values: top-level fields by name, a section as its object or a mapping of its fields, a
    section's field by its dotted name (``**{"lora.rank": 8}``) or its flat one (``lora_rank=8``); a field given
    alone overrides its section's. ``config.lora.rank`` reads ``config.lora.rank``."""

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
        """A section's field by its flat name (``config.lora.rank``: ``config.lora.rank``)."""
        if name in LEGACY_KEYS and not name.startswith("__"):
            where, field = LEGACY_KEYS[name]
            return getattr(object.__getattribute__(self, where), field)
        raise AttributeError(f"{type(self).__name__} has no field {name!r}")

    @property
    def sampler(self) -> str:
        """``validation.sampler`` with ``auto`` resolved."""
        if self.validation.sampler != "auto":
            return self.validation.sampler
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
        for part in (self.data, self.subject, self.loss, self.optim):
            part.check(self, check_paths)
        sd.train.modes.check(self, check_paths)
        sd.train.sharding.check(self)
        self.ema.check(self, check_paths)
        need(not (self.cache_text_embeddings and self.mode.text_encoder_trains),
             "cache_text_embeddings needs a frozen text encoder: turn off lora_text_encoder or the cache")
        sd.train.objectives.check(self, check_paths)
        for part in (self.validation, self.captions, self.eval):
            part.check(self, check_paths)
        conflict = sd.model.schedule_conflict(self.prediction_type, self.zero_terminal_snr)
        need(conflict is None, f"zero_terminal_snr: {conflict}; set prediction_type: v_prediction")
        need(not check_paths or not self.init_from or Path(self.init_from).exists()
             or sd.cli.looks_like_hub_id(self.init_from),
             f"init_from: {self.init_from} is neither an existing path nor a hub id (owner/name)")


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


def coerce(name: str, value):
    """Convert a YAML or command-line value to the type of the field ``name`` (as FIELDS has it), or say what was
    expected."""
    kind = kind_of(FIELDS[name])
    if name in AUTO_COUNTS and isinstance(value, str) and value.strip().lower() == "auto":
        return AUTO_BATCH
    if kind == "bool":
        try:
            return sd.cli.parse_bool(value)
        except Exception:
            pass
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
        if isinstance(value, str):
            try:
                value = load_yaml(value)
            except ValueError as error:
                raise ConfigError(f"{name}: {error}") from None
        if isinstance(value, list):
            return value
        if isinstance(value, (str, dict)):
            return [value]
    raise ConfigError(f"{name}: expected {kind}, got {value!r}")


def unknown_field(name: str, where: str) -> ConfigError:
    close = difflib.get_close_matches(name, [*FIELDS, *LEGACY_KEYS], n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"unknown config field '{name}' in {where}{hint}")


def read_values(given: dict, where: str, flat: list | None = None) -> dict:
    """``{field: value}`` as FIELDS names them, each of its field's type, from what a YAML or the command line
    gives: top-level fields, sections as mappings, a section's fields by dotted or flat name. The flat names found
    are added to ``flat``; an unknown name is a ConfigError naming ``where``."""
    values, spelled = {}, {}

    def put(field: str, spelling: str, value) -> None:
        if field in spelled:  # which of the two wins would be a guess
            raise ConfigError(f"{where}: {spelled[field]} and {spelling} are one field ({field}): keep one")
        spelled[field] = spelling
        values[field] = coerce(field, value)

    for name, value in given.items():
        if name in SECTIONS and isinstance(value, dict):
            for field, inner in value.items():
                dotted = f"{name}.{field}"
                if dotted not in FIELDS:
                    raise unknown_field(dotted, where)
                put(dotted, f"{name}: {{{field}: ...}}", inner)
            continue
        if canonical(name) not in FIELDS:
            raise unknown_field(name, where)
        if name != canonical(name) and flat is not None:
            flat.append(name)
        put(canonical(name), name, value)
    return values


class Parser(sd.cli.ArgumentParser):
    """Unknown or malformed flags become ConfigErrors, reported like every other config mistake."""

    def error(self, message):
        raise ConfigError(message)


def build_parser(description: str = "") -> sd.cli.ArgumentParser:
    """``--config`` plus one flag per field (``--lr``, ``--lora.rank``; the flat names work too, unlisted); a bool
    field also works as a bare flag (``--compile``)."""
    parser = Parser(description=description)
    parser.add_argument("--config", action="append", metavar="YAML",
                        help="phase YAML; flags override its fields. Given again, each later file overrides the "
                             "earlier ones' fields (a card's recipe over a phase: --config "
                             "configs/phases/p1_laion_broad.yaml --config configs/hardware/24gb.yaml)")
    for name, f in FIELDS.items():
        kind = kind_of(f)
        extra = {"nargs": "?", "const": "true"} if kind == "bool" else {}
        allowed = f"; allowed: {f.metadata['allowed'].describe(kind)}" if f.metadata["allowed"] else ""
        parser.add_argument(f"--{name}", metavar="VALUE",
                            help=f"{f.metadata['help']} (default: {default_of(f)!r}{allowed})", **extra)
        if name in FLAT_NAMES:
            parser.add_argument(f"--{FLAT_NAMES[name]}", metavar="VALUE", help=argparse.SUPPRESS, **extra)
    estimate = parser.add_argument_group("memory estimate (no training, no data, no GPU needed)")
    estimate.add_argument("--estimate_memory", nargs="?", const="true", default="false", metavar="BOOL",
                          help="print the predicted peak device memory of one training step of this config, "
                               "broken down, and the largest micro-batch that fits --gpu_memory_gb; ends with "
                               "one JSON line (peak_gb, max_batch, ...)")
    estimate.add_argument("--gpu_memory_gb", type=float, default=None, metavar="GB",
                          help="the card's memory in GB (1e9 bytes) for --estimate_memory (default: this "
                               "machine's CUDA device, else 24 GiB = 25.77)")
    estimate.add_argument("--resolution", type=int, default=None, metavar="PX",
                          help="image size for --estimate_memory (default: the first dataset's latents, else 512)")
    estimate.add_argument("--world_size", default=None, metavar="N",
                          help="GPUs of the run for --estimate_memory: above 1, each GPU's step in DDP (the "
                               "gradients in DDP's buckets, global_batch split over N GPUs) (default: the "
                               "WORLD_SIZE environment variable as torchrun sets it, else 1)")
    return parser


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


def read_yaml(path: Path, seen: tuple = (), flat: list | None = None) -> dict:
    """A config YAML's fields as FIELDS names them (``read_values``), its ``extends`` chain resolved (the file's
    own fields win)."""
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if path.resolve() in seen:
        raise ConfigError(f"{path}: 'extends' loops back to itself")
    try:
        loaded = load_yaml(path.read_text()) or {}
    except ValueError as error:
        raise ConfigError(f"{path}: {error}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: expected a mapping of config fields")
    values = {}
    base = loaded.pop("extends", None)
    if base is not None:
        values.update(read_yaml(path.parent / str(base), seen + (path.resolve(),), flat))
    values.update(read_values(loaded, str(path), flat))
    return values


def load_config(argv=None, description: str = "", check_paths: bool = True) -> TrainConfig:
    """YAML from ``--config`` (each with its ``extends``; several: later over earlier), then ``--field value``
    overrides; validated (``check_paths``: see ``TrainConfig.validate``)."""
    args, unknown = build_parser(description).parse_known_args(argv)
    if unknown:
        flag = next((u for u in unknown if u.startswith("--")), unknown[0])
        raise unknown_field(flag.lstrip("-").split("=")[0], "the command line")
    given = {name: value for name, value in vars(args).items()
             if value is not None and (name in FIELDS or name in LEGACY_KEYS)}
    flat: list = []
    values = config_values(args.config or [], given, flat=flat)
    return make_config(values, check_paths, flat)


def config_values(configs: list, overrides: dict, where: str = "the command line", flat: list | None = None) -> dict:
    """The fields of the YAML files ``configs`` (later over earlier), then ``overrides`` (field -> value as
    written after ``--field``), each as its field's type and by its name in FIELDS: what ``load_config`` reads,
    for a caller that holds the parts rather than a command line (the studio). An unknown field is a ConfigError
    naming ``where``; the flat names read are added to ``flat``."""
    values = {}
    for path in configs:
        values.update(read_yaml(Path(path), flat=flat))
    values.update(read_values(overrides, where, flat))
    return values


def make_config(values: dict, check_paths: bool = True, flat: list | tuple = ()) -> TrainConfig:
    """The validated config of ``values`` (``config_values``), with what ``init_from``'s run was built with;
    ``flat``: the flat names the values were given by (``TrainConfig.flat_keys``)."""
    config = TrainConfig(**inherit_model(values))
    object.__setattr__(config, "flat_keys", tuple(dict.fromkeys(flat)))
    config.validate(check_paths)
    return config


# What a run's weights were built with: a run started from them (init_from) takes these from its
# config.yaml unless its own config names them.
INHERITED = ("unet", "vae", "text_encoder", "tokenizer")


def inherit_model(values: dict) -> dict:
    """``values`` with the INHERITED fields that ``init_from``'s config.yaml (a run or checkpoint folder
    of ours) has and ``values`` does not name. A named one that differs from the saved one is a
    ConfigError naming both: the weights would not fit, or would meet other latents or text. An
    unreadable config.yaml is left to the loading of ``init_from``, which names the damaged file."""
    source = values.get("init_from")
    saved_path = Path(source) / "config.yaml" if source else None
    if saved_path is None or not saved_path.is_file():
        return values
    try:
        saved = read_saved_config(saved_path)
    except (OSError, ValueError):  # damaged: loading init_from names it, as for any damaged file there
        return values
    values = dict(values)
    for name in INHERITED:
        if name not in saved:
            continue
        if name not in values:
            values[name] = saved[name]
        elif values[name] != saved[name]:
            raise ConfigError(f"{name}: this config names {values[name]!r}, but init_from {source} was trained with "
                              f"{saved[name]!r} ({saved_path}); leave {name} out to take the run's, or set it to "
                              f"{saved[name]!r}")
    return values
def estimate_flags(argv=None) -> tuple[bool, float | None, int | None, int]:
    """``--estimate_memory``, ``--gpu_memory_gb``, ``--resolution``, ``--world_size`` of a command line."""
    args, _ = build_parser().parse_known_args(argv)
    try:
        estimate = sd.cli.parse_bool(args.estimate_memory)
    except Exception:
        raise ConfigError(f"--estimate_memory: expected true or false, got {args.estimate_memory!r}") from None
    if args.gpu_memory_gb is not None and not args.gpu_memory_gb > 0:
        raise ConfigError(f"--gpu_memory_gb must be > 0, got {args.gpu_memory_gb}")
    if args.resolution is not None and (args.resolution <= 0 or args.resolution % 8):
        raise ConfigError(f"--resolution must be a positive multiple of 8, got {args.resolution}")
    return estimate, args.gpu_memory_gb, args.resolution, world_size_flag(args.world_size)


def world_size_flag(value: str | None) -> int:
    """``--world_size``: a positive whole number; without it torchrun's ``WORLD_SIZE``, else 1."""
    source = "--world_size"
    if value is None:
        value, source = os.environ.get("WORLD_SIZE"), "the WORLD_SIZE environment variable"
        if value is None:
            return 1
    try:
        world_size = int(str(value).strip())
    except ValueError:
        world_size = 0
    if world_size < 1:
        raise ConfigError(f"{source} must be a positive whole number of GPUs, got {value!r}")
    return world_size


def largest_batch_for(global_batch: int, world_size: int, at_most: int) -> int:
    """The largest micro-batch up to ``at_most`` that makes ``global_batch`` on ``world_size`` GPUs in
    whole accumulation steps; 0 when none does."""
    return next((b for b in range(at_most, 0, -1) if global_batch % (b * world_size) == 0), 0)


def resolve_global_batch(config: TrainConfig, world_size: int) -> TrainConfig:
    """``global_batch`` set: the config with ``grad_accum`` that makes it on ``world_size`` GPUs; a
    batch that cannot make it exactly is a ConfigError naming the settings that can."""
    if not config.global_batch:
        return config
    per_step = config.batch_size * world_size
    if config.global_batch % per_step == 0:
        return dataclasses.replace(config, grad_accum=config.global_batch // per_step)
    options = []
    smaller = largest_batch_for(config.global_batch, world_size, config.batch_size)
    if smaller:
        options.append(f"batch_size {smaller} (grad_accum {config.global_batch // (smaller * world_size)})")
    bigger = -(-config.global_batch // per_step) * per_step
    options.append(f"global_batch {bigger} with lr {config.lr * bigger / config.global_batch:.3g} (the linear "
                   f"scaling rule; the recipe's lr is for {config.global_batch})")
    raise ConfigError(f"global_batch {config.global_batch} is not a whole number of steps of batch_size "
                      f"{config.batch_size} on {world_size} GPU(s) ({per_step} images each): use "
                      + " or ".join(options))


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

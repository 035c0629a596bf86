"""Checkpoint formats the SD ecosystem reads: diffusers folders and the original single file.

* ``export_diffusers``: a complete ``StableDiffusionPipeline`` folder (safetensors).
* ``single_file_state_dict`` / ``save_single_file``: one file in the original SD 1.x key layout
  (``model.diffusion_model.*``, ``first_stage_model.*``, ``cond_stage_model.transformer.text_model.*``)
  that AUTOMATIC1111, ComfyUI and diffusers' ``from_single_file`` load.
* ``load_pipeline``: UNet, VAE, text encoder and tokenizer from any of the sources below, with the
  prediction type, noise schedule (zero terminal SNR or not) and CLIP skip the source records; a run's
  text encoder and VAE checked against the fingerprints its checkpoint records (``check_frozen_parts``).
* ``load_unet_weights``: UNet weights from any of: a training checkpoint or run folder of ours (EMA or
  live), a diffusers pipeline folder or hub id, or a single ``.safetensors`` / ``.ckpt`` file.
* LoRA runs of ours (``adapter.safetensors`` instead of ``unet.safetensors``): ``load_lora_run`` loads
  the base from the run's ``init_from`` and the adapter on top, as PEFT layers.
  (LoRA files for other tools are ``sd.lora.formats``.)

Single files as other tools write them (the key maps, a ``.ckpt``'s EMA, VAE-only files) are read by
``sd.original_layout``, each model of the architecture its tensors have (``sd.model.model_from_file``).
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch

import sd.cli
import sd.embedding.tokens
import sd.files
import sd.flow
import sd.lora.adapters
import sd.model
import sd.original_layout as original
import sd.run_folder
import sd.sampling
from sd.cli import first_line
from sd.original_layout import text_key_map, unet_key_map, vae_key_map
from sd.run_folder import read_saved_config

log = logging.getLogger("sd_formats")

# What a single file in the original layout holds: (UNet preset, VAE config, text encoder config).
SINGLE_FILE_ARCHS = {name: (name, sd.model.FILE_CONFIGS["vae"][name], sd.model.FILE_CONFIGS["text_encoder"][name])
                     for name in ("sd1", "tiny")}

PREDICTION_TYPES = sd.model.PREDICTION_TYPES

# ---------------------------------------------------------------------------------------------
# Single file
# ---------------------------------------------------------------------------------------------


def single_file_state_dict(unet, vae, text_encoder, half: bool = False) -> dict[str, torch.Tensor]:
    """The three models' tensors under the original single file's names (fp16 with ``half``)."""
    return {**original.to_original(unet, unet_key_map(unet), half), **original.to_original(vae, vae_key_map(vae), half),
            **original.to_original(text_encoder, text_key_map(text_encoder), half)}


def save_single_file(path: Path, unet, vae, text_encoder, half: bool = False, metadata: dict | None = None) -> None:
    from safetensors.torch import save_file

    tensors = single_file_state_dict(unet, vae, text_encoder, half)
    meta = {k: str(v) for k, v in (metadata or {}).items()}
    sd.files.write_atomic(Path(path), lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def load_into(model, state: dict[str, torch.Tensor], source) -> None:
    """``model.load_state_dict(state)``, strict; weights that do not fit, or hold NaN or inf, are one line
    naming ``source`` (such weights would sample black images)."""
    check_fits(model, state, source)
    bad = next((name for name, tensor in state.items() if tensor.is_floating_point()
                and not bool(torch.isfinite(tensor).all())), None)
    if bad is not None:
        raise ValueError(f"{source}: {bad} holds non-finite values (NaN or inf); the file is damaged, use an "
                         "earlier checkpoint or another copy")
    model.load_state_dict(state)


def check_fits(model, state: dict[str, torch.Tensor], source) -> None:
    """``state`` has exactly ``model``'s tensor names and shapes, or a ValueError names ``source``."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    misshaped = sorted(k for k in set(own) & set(state) if tuple(own[k].shape) != tuple(state[k].shape))
    if missing or unexpected or misshaped:
        raise ValueError(f"{source}: its weights do not fit this {type(model).__name__} ({len(missing)} missing, "
                         f"{len(unexpected)} unexpected, {len(misshaped)} of another shape, e.g. "
                         f"{(missing + unexpected + misshaped)[:2]}); damaged, or another architecture")


# ---------------------------------------------------------------------------------------------
# Diffusers folders
# ---------------------------------------------------------------------------------------------


def export_diffusers(folder: Path, unet, vae, text_encoder, tokenizer, prediction_type: str = "epsilon",
                     zero_terminal_snr: bool = False, flow_shift: float = 1.0, distilled: str = "") -> None:
    """Write a StableDiffusionPipeline folder in safetensors (no safety checker), atomically.

    ``zero_terminal_snr``: the scheduler config says ``rescale_betas_zero_snr`` and trailing spacing. A flow
    model's scheduler is a ``FlowMatchEulerDiscreteScheduler`` at ``flow_shift`` (``model_index.json`` names
    it, which is what ``from_pretrained`` builds); diffusers' ``StableDiffusionPipeline`` then needs
    ``pipe.scheduler.init_noise_sigma = 1.0``, an attribute that scheduler lacks (docs/training.md). A DMD
    generator (``distilled: dmd``) of an epsilon or v model gets diffusers' ``LCMScheduler``, whose first timestep
    is 999 at any step count: one step there is the generator's one step (docs/sampling.md).
    """
    from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler, LCMScheduler, StableDiffusionPipeline

    folder = Path(folder)
    if prediction_type == "flow":
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=sd.model.NUM_TRAIN_TIMESTEPS, shift=flow_shift)
    else:
        scheduler = sd.model.build_noise_scheduler(prediction_type, LCMScheduler if distilled == "dmd" else DDIMScheduler,
                                                   zero_terminal_snr)
    pipeline = StableDiffusionPipeline(
        unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)

    def write(staging: Path) -> None:
        pipeline.save_pretrained(str(staging), safe_serialization=True)
        prefix_text_encoder_keys(staging / "text_encoder")
        write_vocabulary_files(staging / "tokenizer", tokenizer)

    sd.files.write_folder_atomic(folder, write)


def prefix_text_encoder_keys(folder: Path) -> None:
    """Give the saved CLIP text encoder's keys the ``text_model.`` prefix.

    transformers 5 saves ``CLIPTextModel`` without it; transformers 4 (which then initialises a
    random text encoder, with only a warning) and ComfyUI's diffusers loader (which then finds none of
    the keys) need it, and transformers 5 loads either layout.
    """
    from safetensors.torch import load_file, save_file

    for path in sorted(folder.glob("*.safetensors")):
        state = load_file(str(path))
        if all(key.startswith("text_model.") for key in state):
            continue
        renamed = {key if key.startswith("text_model.") else f"text_model.{key}": tensor for key, tensor in state.items()}
        save_file(renamed, str(path), metadata={"format": "pt"})


def write_vocabulary_files(folder: Path, tokenizer) -> None:
    """Give the saved tokenizer folder ``vocab.json``, ``merges.txt`` and ``special_tokens_map.json``, as
    the SD 1.x repositories ship it.

    transformers 5 saves only ``tokenizer.json`` and ``tokenizer_config.json``; transformers 4's
    ``CLIPTokenizer`` (the class diffusers' ``model_index.json`` names) reads the vocabulary and merges
    from their own files and fails without them. A tokenizer that wrote them itself is left as it is.
    """
    if not ((folder / "vocab.json").exists() and (folder / "merges.txt").exists()):
        tokenizer.backend_tokenizer.model.save(str(folder))  # the BPE model's vocab.json and merges.txt
    special = {name: str(token) for name, token in tokenizer.special_tokens_map.items()}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n", encoding="utf-8")


def pretrained(load, source: str, **kwargs):
    """``load(source, **kwargs)``, a diffusers ``from_pretrained`` or ``load_config``, with the hub's options
    (while the hub cannot be reached, the local cache alone: seconds, not minutes of retries). A source that
    is no folder here and no hub id that loads is one line saying both."""
    options = sd.model.hub_options(source)
    try:
        return load(source, **kwargs, **options)
    except OSError as error:
        if Path(source).exists():
            raise
        why = ("the hub cannot be reached and the local cache lacks it" if options.get("local_files_only")
               else first_line(error))
        raise FileNotFoundError(f"{source}: no such folder here, and as a hub id it cannot be loaded ({why}); "
                                "check the path (a run folder exists once its run has started), or fetch the "
                                "model where there is internet") from None


def is_diffusers_folder(path: Path) -> bool:
    return (path / "model_index.json").exists() or (path / "unet" / "config.json").exists()


# ---------------------------------------------------------------------------------------------
# Loading UNet weights from anywhere
# ---------------------------------------------------------------------------------------------


def load_unet_weights(source: str, unet, *, use_ema: bool = True, keep_adapter: bool = False) -> str:
    """Load ``source``'s UNet weights into ``unet`` (same architecture). Returns what was loaded.

    ``source``: a training checkpoint or run folder of ours (EMA weights unless ``use_ema=False``),
    a ``.safetensors`` / ``.ckpt`` single file in the original layout, or a diffusers pipeline folder
    or hub id (its ``unet/``). A LoRA run of ours gives its base with its adapter (see ``load_lora_run``),
    merged into the weights, or with ``keep_adapter`` left in ``unet`` as PEFT layers.
    """
    path = Path(source)
    if path.is_file():
        file = sd.model.open_file(path, use_ema)
        if "unet" not in file.parts:
            raise ValueError(f"{path}: holds no UNet (it holds the {' and '.join(file.parts) or 'no SD 1.x model'})")
        unet.load_state_dict(file.state_for(unet, unet_key_map(unet), "UNet"))
        return file.describe("unet")
    if path.is_dir() and not is_diffusers_folder(path):
        folder = sd.run_folder.resolve_checkpoint(path)
        if is_lora_checkpoint(folder):
            trainable, training = {n: p.requires_grad for n, p in unet.named_parameters()}, unet.training
            loaded = load_lora_run(folder, unet, use_ema=use_ema)
            if not keep_adapter:  # the plain model it was: add_lora froze it and put it in eval mode
                sd.lora.adapters.merge(unet).train(training)
                for name, param in unet.named_parameters():
                    param.requires_grad_(trainable[name])
            return loaded
        weights = folder / ("ema.safetensors" if use_ema else "unet.safetensors")
        if use_ema and not weights.exists():
            weights = folder / "unet.safetensors"
        load_into(unet, sd.files.read_weights(verified(weights)), weights)
        return f"{weights}"
    from diffusers import UNet2DConditionModel

    loaded = pretrained(UNet2DConditionModel.from_pretrained, source, subfolder="unet")
    load_into(unet, loaded.state_dict(), f"{source} unet")
    return f"diffusers {source}"


def run_ema_weights(source: str, unet) -> dict[str, torch.Tensor] | None:
    """The EMA weights of one of our checkpoints or run folders, checked to fit ``unet``, or of a single file
    that keeps one beside its live weights (``model_ema.*``); None for other sources, or a checkpoint saved
    without an EMA. A LoRA run's: its base with the EMA adapter merged."""
    if Path(source).is_file():
        file = sd.model.open_file(source, use_ema=True)
        if not any(part == "unet" and "EMA" in note for part, note in file.notes):
            return None
        return file.state_for(unet, unet_key_map(unet), "UNet")
    if run_config(source) is None:
        return None
    folder = sd.run_folder.resolve_checkpoint(source)
    path = folder / "ema.safetensors"
    if not path.exists():
        return None
    if is_lora_checkpoint(folder):
        import copy

        merged = copy.deepcopy(unet)
        load_unet_weights(str(folder), merged, use_ema=True)
        return merged.state_dict()
    state = sd.files.read_weights(verified(path))
    check_fits(unet, state, path)
    return state


def verified(path: Path) -> Path:
    """A file of one of our checkpoints, checked against the checkpoint's manifest (size and content
    hash) when it has one: a damaged file is a ValueError naming it. Returns ``path``."""
    if path.is_file():
        try:
            sd.run_folder.verify(path.parent, [path.name])
        except sd.run_folder.Damaged as error:
            raise ValueError(str(error)) from error
    return path


def run_config(source: str) -> dict | None:
    """The resolved training config of one of our checkpoints or run folders, by flat names
    (``sd.run_folder.flat_view``); None for other sources.

    A folder that is no diffusers folder is taken for ours: without a complete checkpoint, or with a
    missing or unreadable ``config.yaml``, it is an error naming it.
    """
    path = Path(source)
    if not path.is_dir() or is_diffusers_folder(path):
        return None
    config_file = sd.run_folder.resolve_checkpoint(path) / "config.yaml"
    if not config_file.is_file():
        raise FileNotFoundError(f"checkpoint file {config_file} is missing")
    config = sd.run_folder.flat_view(read_saved_config(verified(config_file)))
    missing = [key for key in ("unet", "vae", "text_encoder", "prediction_type") if key not in config]
    if missing:
        raise ValueError(f"{config_file}: not a training config (lacks {', '.join(missing)})")
    return config


def diffusers_prediction_type(source: str) -> str:
    """The prediction type in a diffusers folder's (or hub id's) scheduler config; epsilon if it names none.

    ``model_index.json`` names only the scheduler's class: the type lives in ``scheduler_config.json``, and a
    flow-matching scheduler's (``FlowMatchEulerDiscreteScheduler``, which has no such field) is flow.
    """
    config, where = diffusers_scheduler_config(source)
    if is_flow_scheduler(config):
        return "flow"
    return checked_prediction_type(config.get("prediction_type", "epsilon"), where)


def is_flow_scheduler(config: dict) -> bool:
    return str(config.get("_class_name", "")).startswith("FlowMatch")


def diffusers_scheduler_config(source: str) -> tuple[dict, str]:
    """A diffusers folder's (or hub id's) scheduler config, ``{}`` if the folder has none, and its name."""
    path = Path(source)
    if path.is_dir():
        config_file = path / "scheduler" / "scheduler_config.json"
        if not config_file.exists():
            return {}, str(config_file)
        try:
            return json.loads(config_file.read_text()), str(config_file)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{config_file}: not valid JSON ({error})") from error
    from diffusers import DDIMScheduler

    return (pretrained(DDIMScheduler.load_config, source, subfolder="scheduler"),
            f"{source} scheduler_config.json")


def recorded_prediction_type(source: str) -> str:
    """The prediction type ``source`` records (``load_pipeline``'s), epsilon when it records none."""
    config = run_config(source)
    if config is not None:
        return checked_prediction_type(config["prediction_type"], f"{source} config.yaml")
    if Path(source).is_file():
        return single_file_prediction_type(Path(source)) or "epsilon"
    return diffusers_prediction_type(source)


def recorded_clip_skip(source: str) -> int:
    """The CLIP skip ``source`` was trained with: a run's ``clip_skip``, a single file's ``clip_skip`` or
    ``ss_clip_skip`` metadata; 1 when it records none (a diffusers folder records none)."""
    config = run_config(source)
    if config is not None:
        value, where = config.get("clip_skip", 1), f"{source} config.yaml"
    elif Path(source).is_file():
        metadata = single_file_metadata(Path(source))
        value, where = metadata.get("clip_skip", metadata.get("ss_clip_skip", "1")), str(source)
        value = 1 if value in ("None", "") else value
    else:
        return 1
    try:
        skip = int(value)
    except (TypeError, ValueError):
        skip = 0
    if isinstance(value, bool) or skip < 1:
        raise ValueError(f"{where}: clip_skip {value!r} is no whole number >= 1")
    return skip


def single_file_prediction_type(path: Path) -> str | None:
    """The ``prediction_type`` a ``.safetensors`` single file records in its metadata (as
    ``save_single_file`` writes it), or None when it records none (other tools' files, a ``.ckpt``)."""
    value = single_file_metadata(path).get("prediction_type")
    return None if value is None else checked_prediction_type(value, path)


def single_file_metadata(path: Path) -> dict[str, str]:
    """The text metadata of a ``.safetensors`` file (``{}`` for none, and for a ``.ckpt``)."""
    if Path(path).suffix != ".safetensors":
        return {}
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return handle.metadata() or {}
    except SafetensorError as error:
        raise ValueError(f"{path}: not a readable safetensors file ({error})") from error


# ---------------------------------------------------------------------------------------------
# The noise schedule a source records: SD's, or rescaled to zero terminal SNR
# ---------------------------------------------------------------------------------------------


def recorded_zero_terminal_snr(source: str) -> bool:
    """Whether ``source`` was trained on the zero-terminal-SNR schedule, as it records it: our training
    config's ``zero_terminal_snr``, a single file's ``zero_terminal_snr`` metadata (as ``save_single_file``
    is given it), a diffusers scheduler config's ``rescale_betas_zero_snr``. False when it records none."""
    config = run_config(source)
    if config is not None:
        return checked_flag(config.get("zero_terminal_snr", False), "zero_terminal_snr", f"{source} config.yaml")
    if Path(source).is_file():
        value = single_file_metadata(Path(source)).get("zero_terminal_snr", "false")
        return checked_flag({"true": True, "false": False}.get(value.lower(), value), "zero_terminal_snr", source)
    config, where = diffusers_scheduler_config(source)
    return checked_flag(config.get("rescale_betas_zero_snr", False), "rescale_betas_zero_snr", where)


def recorded_flow(source: str) -> tuple[float, bool]:
    """The flow settings ``source`` records: the samplers' shift (``flow_shift`` of our training config and
    of a single file's metadata, ``shift`` of a diffusers flow scheduler; 1 when it records none) and whether
    an epsilon or v model was trained as a flow (``flow_matching``)."""
    config = run_config(source)
    if config is not None:
        where = f"{source} config.yaml"
        return (checked_shift(config.get("flow_shift", 1.0), where),
                checked_flag(config.get("flow_matching", False), "flow_matching", where))
    if Path(source).is_file():
        metadata = single_file_metadata(Path(source))
        value = metadata.get("flow_matching", "false")
        return (checked_shift(metadata.get("flow_shift", "1.0"), source),
                checked_flag({"true": True, "false": False}.get(value.lower(), value), "flow_matching", source))
    config, where = diffusers_scheduler_config(source)
    return checked_shift(config.get("shift", 1.0) if is_flow_scheduler(config) else 1.0, where), False


def checked_shift(value, where) -> float:
    return sd.flow.check_shift(value, where)


def checked_flag(value, name: str, where) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {name} {value!r} is neither true nor false")
    return value


def checked_prediction_type(value, where) -> str:
    if value not in PREDICTION_TYPES:
        raise ValueError(f"{where}: prediction_type {value!r} is not one of {', '.join(PREDICTION_TYPES)}")
    return value


# ---------------------------------------------------------------------------------------------
# Loading a whole pipeline (UNet, VAE, text encoder, tokenizer) from any source
# ---------------------------------------------------------------------------------------------


def load_pipeline(source: str, *, use_ema: bool = True, vae: str | None = None, text_encoder: str | None = None,
                  tokenizer: str | None = None, arch: str = "auto", prediction_type: str | None = None,
                  zero_terminal_snr: bool | None = None, check_base: bool = True,
                  flow_shift: float | None = None, clip_skip: int | None = None) -> "sd.sampling.Pipeline":
    """UNet, VAE, text encoder and tokenizer from any checkpoint kind; the keywords override the parts.

    The prediction type and the schedule (zero terminal SNR or not) are the source's own (the training
    config, a single file's metadata, a diffusers scheduler config) unless ``prediction_type`` /
    ``zero_terminal_snr`` say otherwise. Zero terminal SNR with epsilon is refused: it cannot be sampled.
    So are the flow samplers' shift and whether a model was trained as a flow (``recorded_flow``), unless
    ``flow_shift`` is given. So is the CLIP skip (``recorded_clip_skip``) unless ``clip_skip`` is given.
    A LoRA run's adapter on a base it was not trained on is a ``BaseMismatch`` unless ``check_base`` is False.
    """
    pipeline = _load_pipeline(source, use_ema, vae, text_encoder, tokenizer, arch, check_base)
    sd.model.set_clip_skip(pipeline.text_encoder, recorded_clip_skip(source) if clip_skip is None else clip_skip)
    recorded_shift, pipeline.flow_matching = recorded_flow(source)
    pipeline.flow_shift = recorded_shift if flow_shift is None else checked_shift(flow_shift, "flow_shift")
    if prediction_type is not None:
        pipeline.prediction_type = checked_prediction_type(prediction_type, "prediction_type")
    pipeline.zero_terminal_snr = recorded_zero_terminal_snr(source) if zero_terminal_snr is None else zero_terminal_snr
    conflict = sd.model.schedule_conflict(pipeline.prediction_type, pipeline.zero_terminal_snr)
    if conflict:
        raise ValueError(f"{source}: {conflict}; say --prediction_type v_prediction or --zero_terminal_snr false")
    pipeline.distilled = recorded_distillation(source)
    pipeline.generator_steps = recorded_generator_steps(source) if pipeline.distilled == "dmd" else 0
    pipeline.trained_size = recorded_trained_size(source, pipeline.unet)
    return pipeline


def recorded_distillation(source: str) -> str:
    """``lcm`` for a run of ours distilled to a latent consistency model (``distill: lcm``), ``dmd`` for a DMD
    generator (a run of ours, or a single file whose metadata says ``distilled: dmd``), else empty."""
    config = run_config(source)
    if config is not None:
        return str(config.get("distill") or "")
    if Path(source).is_file():
        return "dmd" if single_file_metadata(Path(source)).get("distilled") == "dmd" else ""
    return ""


def sampling_defaults(source: str, sampler: str, steps: int | None, cfg: float | None, default_steps: int,
                      default_cfg: float) -> tuple[int, float]:
    """``sd.sampling.sampler_defaults`` for ``source``: ``onestep`` without steps takes the steps the DMD generator
    records (``recorded_generator_steps``)."""
    if sampler == "onestep" and steps is None and source:
        default_steps = recorded_generator_steps(source)
    return sd.sampling.sampler_defaults(sampler, steps, cfg, default_steps, default_cfg)


def recorded_generator_steps(source: str) -> int:
    """A DMD generator's steps: ``dmd.steps`` of our training config, or the count of a single file's
    ``generator_timesteps``; 1 when it records none."""
    config = run_config(source)
    if config is not None:
        saved = read_saved_config(sd.run_folder.resolve_checkpoint(Path(source)) / "config.yaml")
        steps = sd.run_folder.saved_value(saved, "dmd.steps", 1)
    elif Path(source).is_file():
        steps = len(single_file_metadata(Path(source)).get("generator_timesteps", "999").split(","))
    else:
        steps = 1
    if not isinstance(steps, int) or not 1 <= steps <= sd.sampling.ONESTEP_MAX:
        raise ValueError(f"{source}: a DMD generator of {steps!r} steps (1 to {sd.sampling.ONESTEP_MAX})")
    return steps


def recorded_default_sampler(source: str, prediction_type: str = "auto") -> str:
    """The sampler of ``--sampler auto`` for ``source`` read from its records before it is loaded (the
    ``Pipeline.default_sampler`` of what would load): lcm for a latent consistency model of ours, flow_euler
    for a model trained as a flow, else ddim; ddim when its records cannot be read (loading names why)."""
    from safetensors import SafetensorError

    try:
        distilled = recorded_distillation(source)
        if distilled in sd.sampling.DISTILLED_SAMPLERS:
            return sd.sampling.DISTILLED_SAMPLERS[distilled]
        kind = recorded_prediction_type(source) if prediction_type == "auto" else prediction_type
        return sd.sampling.default_sampler(kind, recorded_flow(source)[1])
    except (KeyError, ValueError, OSError, SafetensorError):
        return "ddim"


def recorded_trained_size(source: str, unet) -> tuple[int, str]:
    """The square side a model was trained at, and where it comes from: a subject-folder run's ``image_size``,
    a run's latents (the square of its largest bucket's pixels), else what its UNet config says
    (``sample_size`` latents, diffusers' own default)."""
    import sd.data.training_data

    config = run_config(source)
    if config and config.get("instance_dir"):
        return int(config["image_size"]), "the run's DreamBooth image_size"
    if config and config.get("datasets"):
        latents = Path(str(config["datasets"][0]["latents"]))
        try:
            side = sd.data.training_data.resolution_of_latents(sd.data.training_data.read_latents_meta(latents))
        except (OSError, ValueError):  # unreadable or unfinished: the size is not known from there
            side = None
        if side:
            return side, f"the latents in {latents}"
    return int(unet.config.sample_size) * 8, "the UNet's sample_size"


def _load_pipeline(source: str, use_ema: bool, vae: str | None, text_encoder: str | None, tokenizer: str | None,
                   arch: str, check_base: bool) -> "sd.sampling.Pipeline":
    config = run_config(source)
    path = Path(source)
    if config is not None:  # ours: the parts named in the training config
        unet = sd.model.build_unet(config["unet"], from_scratch=False)
        parts = (config["vae"], config["text_encoder"], config.get("tokenizer") or config["text_encoder"])
        prediction_type = checked_prediction_type(config["prediction_type"], f"{source} config.yaml")
    elif path.is_file():  # a single file holds all three models
        return _load_single_file(path, arch, vae, text_encoder, tokenizer, use_ema)
    else:  # a diffusers folder or hub id
        from diffusers import UNet2DConditionModel

        if not path.exists() and not sd.cli.looks_like_hub_id(source):
            raise FileNotFoundError(f"{source}: no such file or folder (nor a hub id, which reads owner/name)")
        unet = pretrained(UNet2DConditionModel.from_pretrained, source, subfolder="unet")
        sd.model.use_sdpa_attention(unet)
        parts = (source, source, source)
        prediction_type = diffusers_prediction_type(source)
    encoder = sd.model.load_text_encoder(text_encoder or parts[1])
    tokenizer_model = sd.model.load_tokenizer(tokenizer or parts[2])
    vae_model = sd.model.load_vae(vae or parts[0])
    if config is not None and check_base:  # as loaded: before a learned token or an adapter joins them
        check_frozen_parts(sd.run_folder.resolve_checkpoint(source),
                           {"text_encoder": None if text_encoder else encoder, "vae": None if vae else vae_model},
                           {"text_encoder": parts[1], "vae": parts[0]})
    if config is None:
        loaded = f"diffusers {source}"
    elif config.get("embedding_token"):
        folder = sd.run_folder.resolve_checkpoint(source)
        loaded = load_embedding_run(folder, unet, encoder, tokenizer_model, use_ema=use_ema, check_base=check_base)
        if is_lora_checkpoint(folder):  # pivotal tuning: a LoRA learned with the token, on the base just checked
            adapters = load_run_adapters(folder, lora_run_settings(str(folder)), unet, encoder, use_ema=use_ema)
            loaded += f" + LoRA {adapters}"
    elif is_lora_checkpoint(sd.run_folder.resolve_checkpoint(source)):  # the adapters stay PEFT layers (sd.lora.adapters.merge)
        loaded = load_lora_run(sd.run_folder.resolve_checkpoint(source), unet, encoder, use_ema=use_ema,
                               check_base=check_base)
    else:
        loaded = load_unet_weights(source, unet, use_ema=use_ema)
    return sd.sampling.Pipeline(unet.eval(), vae_model, encoder.eval(), tokenizer_model, prediction_type, loaded)


FROZEN_PARTS_FILE = "frozen_parts.safetensors"  # the text encoder's and VAE's fingerprints as a run loaded them


def check_frozen_parts(folder: Path, models: dict, sources: dict) -> None:
    """``models`` (``text_encoder``, ``vae``; None: named by the user, not checked), just loaded from ``sources``,
    must be those the run of ``folder`` trained with: the fingerprints its checkpoint records. A checkpoint of
    before they were recorded is not checked."""
    path = folder / FROZEN_PARTS_FILE
    if not path.is_file():
        return
    saved = sd.files.read_weights(verified(path))
    for field, model in models.items():
        if model is None or field not in saved:
            continue
        now = sd.run_folder.weights_fingerprint(list(model.parameters()))
        if not sd.lora.adapters.same_base(saved[field], now):
            what = "text encoder" if field == "text_encoder" else "VAE"
            raise BaseMismatch(f"{sources[field]} is not the {what} the run in {folder} was trained with (its "
                               f"weights differ from those {FROZEN_PARTS_FILE} records); restore it, or name "
                               f"another with --{field} to sample with that one anyway")


def _load_single_file(path: Path, arch: str, vae: str | None, text_encoder: str | None, tokenizer: str | None,
                      use_ema: bool) -> "sd.sampling.Pipeline":
    """The UNet, VAE and CLIP text encoder of an original-layout file, each of the architecture its tensors
    have (``arch`` ``auto``, or the one named); ``vae`` / ``text_encoder`` name others. A file without a VAE
    or text encoder (a UNet-only file) takes SD 1.x's defaults, said in the log."""
    file = sd.model.open_file(path, use_ema)
    preset = None if arch == "auto" else arch
    unet = sd.model.model_from_file(file, "unet", preset=preset)
    sd.model.use_sdpa_attention(unet)
    parts = {}
    for part, named, default in (("vae", vae, sd.model.DEFAULT_VAE),
                                 ("text_encoder", text_encoder, sd.model.DEFAULT_TEXT_ENCODER)):
        if named:
            parts[part] = (sd.model.load_vae if part == "vae" else sd.model.load_text_encoder)(named)
        elif part in file.parts:
            parts[part] = sd.model.frozen(sd.model.model_from_file(file, part, preset=preset))
        else:
            log.info("%s holds no %s: taking %s", path, original.PART_NAMES[part], default)
            parts[part] = (sd.model.load_vae if part == "vae" else sd.model.load_text_encoder)(default)
    for part, model in (("UNet", unet), ("VAE", parts["vae"]), ("text encoder", parts["text_encoder"])):
        log.info("%s from %s", part, sd.model.loaded_from(model))
    prediction_type = single_file_prediction_type(path)
    if prediction_type is None:
        log.info("%s records no prediction_type: sampling as epsilon (say otherwise with --prediction_type)", path)
    return sd.sampling.Pipeline(unet.eval(), parts["vae"], parts["text_encoder"],
                                sd.model.load_tokenizer(tokenizer or str(path)), prediction_type or "epsilon",
                                file.describe("unet"))


# ---------------------------------------------------------------------------------------------
# LoRA runs: a base model (init_from) and an adapter
# ---------------------------------------------------------------------------------------------

# A LoRA run's checkpoint holds this instead of unet.safetensors: unet.<PEFT parameter name> and, with
# a text-encoder adapter, text_encoder.<...> (sd.lora.adapters.AdapterWeights); its ema.safetensors is the UNet
# adapter's EMA under the bare PEFT names and the text adapter's under text_encoder.<...>
# (sd.train.ema.EMAWeights; older checkpoints hold the UNet's alone).
RUN_ADAPTER_FILE = "adapter.safetensors"
RUN_BASE_FILE = "lora_base.safetensors"  # the fingerprint of the base weights the adapter was trained on


class BaseMismatch(ValueError):
    """A LoRA run's adapter, a learned token or a ControlNet run about to be applied to base weights it was not
    trained on."""


def is_lora_checkpoint(folder: Path) -> bool:
    """A checkpoint folder of a run that trained a LoRA adapter (its adapter file, or lora_rank in its config)."""
    folder = Path(folder)
    if (folder / RUN_ADAPTER_FILE).exists():
        return True
    return (folder / "config.yaml").is_file() and lora_run_settings(str(folder)) is not None


def lora_run_settings(source: str) -> dict | None:
    """The adapter of a LoRA run or checkpoint of ours as its config records it: ``rank``, ``alpha``
    (the config's 0 made the rank), ``targets``, ``conv_rank`` / ``conv_alpha`` (the larger-than-1x1
    convolutions'), ``text_encoder`` (bool) and ``init_from`` (the base);
    None for any other source. A value that cannot be a LoRA run's is an error naming the config."""
    config = run_config(source)
    if config is None or not config.get("lora_rank"):
        return None
    where = sd.run_folder.resolve_checkpoint(source) / "config.yaml"
    rank, alpha = config["lora_rank"], config.get("lora_alpha") or 0
    targets = config.get("lora_targets") or ["attention"]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: lora_rank {rank!r} is no positive integer")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha < 0:
        raise ValueError(f"{where}: lora_alpha {alpha!r} is no number >= 0")
    if not isinstance(targets, list) or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"{where}: lora_targets {targets!r} is no list of groups or module-name suffixes")
    if not config.get("init_from"):
        raise ValueError(f"{where}: a LoRA run (lora_rank {rank}) that names no init_from, the base its adapter "
                         "was trained on")
    conv_rank, conv_alpha = config.get("lora_conv_rank") or 0, config.get("lora_conv_alpha") or 0
    if isinstance(conv_rank, bool) or not isinstance(conv_rank, int) or conv_rank < 0:
        raise ValueError(f"{where}: lora_conv_rank {conv_rank!r} is no integer >= 0")
    if isinstance(conv_alpha, bool) or not isinstance(conv_alpha, (int, float)) or conv_alpha < 0:
        raise ValueError(f"{where}: lora_conv_alpha {conv_alpha!r} is no number >= 0")
    conv_rank, conv_alpha = sd.lora.adapters.conv_settings(rank, alpha, conv_rank, conv_alpha)
    kind, factor = config.get("lora_type") or "lora", config.get("lora_factor", -1)
    if kind not in sd.lora.adapters.LORA_TYPES or isinstance(factor, bool) or not isinstance(factor, int):
        raise ValueError(f"{where}: lora_type {kind!r} / lora_factor {factor!r} name no adapter of ours")
    return {"rank": rank, "alpha": sd.lora.adapters.effective_alpha(rank, alpha), "targets": list(targets),
            "conv_rank": conv_rank, "conv_alpha": conv_alpha, "init_from": str(config["init_from"]),
            "text_encoder": bool(config.get("lora_text_encoder", False)), "kind": kind, "factor": factor,
            "dora": bool(config.get("dora", False)), "block_dims": list(config.get("lora_block_dims") or []),
            "block_alphas": list(config.get("lora_block_alphas") or [])}


def load_lora_run(folder: Path, unet, text_encoder=None, *, use_ema: bool = True, check_base: bool = True) -> str:
    """Load a LoRA checkpoint: the base UNet from its ``init_from``, then the adapter as PEFT layers in
    ``unet`` (the EMA adapter of ``ema.safetensors`` unless ``use_ema=False`` or there is none) and, when
    the run trained one and ``text_encoder`` is given, in ``text_encoder``. Returns what was loaded.

    The base is ``init_from``'s EMA weights when it is a run of ours, as ``sd.train.recovery.load_base`` loads
    it: the weights the adapter was trained on. Base weights that differ from those (``init_from`` now
    holds another model) are a ``BaseMismatch`` unless ``check_base`` is False. Non-finite adapter
    weights are a ValueError naming the tensor and the file.
    """
    folder = Path(folder)
    settings = lora_run_settings(str(folder))
    if settings is None:
        raise ValueError(f"{folder}: holds {RUN_ADAPTER_FILE}, but its config.yaml sets no lora_rank")
    base = load_unet_weights(settings["init_from"], unet, use_ema=True)
    if check_base:
        check_trained_base(folder, settings["init_from"], unet)
    return f"{base} + LoRA {load_run_adapters(folder, settings, unet, text_encoder, use_ema=use_ema)}"


def load_run_adapters(folder: Path, settings: dict, unet, text_encoder=None, *, use_ema: bool = True) -> Path:
    """The adapters of the LoRA run ``folder`` (``lora_run_settings``) as PEFT layers in ``unet`` and, when it
    trained one and ``text_encoder`` is given, in ``text_encoder``: the EMA's unless ``use_ema=False`` or
    there is none. Returns the file they came from."""
    models = {"unet": add_run_lora(unet, settings["targets"], settings)}
    if text_encoder is not None and settings["text_encoder"]:
        models["text_encoder"] = add_run_lora(text_encoder, sd.lora.adapters.TEXT_TARGETS, settings)
    adapter_path = verified(folder / RUN_ADAPTER_FILE)
    state = sd.files.read_weights(adapter_path)
    if text_encoder is None:  # the UNet alone
        state = {k: v for k, v in state.items() if not k.startswith("text_encoder.")}
    loaded = adapter_path
    with _naming(adapter_path):
        sd.lora.adapters.AdapterWeights(**models).load_state_dict(state)
    ema_path = folder / "ema.safetensors"
    if use_ema and ema_path.exists():
        unet_ema, text_ema = sd.run_folder.split_ema(sd.files.read_weights(verified(ema_path)))
        text_ema = {k: v for k, v in text_ema.items() if sd.lora.adapters.is_adapter_name(k)}  # not a learned token
        with _naming(ema_path):
            sd.lora.adapters.load_adapter_state(unet, unet_ema, "the EMA adapter")
            if text_ema and "text_encoder" in models:
                sd.lora.adapters.load_adapter_state(models["text_encoder"], text_ema, "the text encoder's EMA adapter")
        loaded = ema_path
    return loaded


def check_trained_base(folder: Path, init_from: str, unet, text_encoder=None, what: str | None = None) -> None:
    """``unet``'s weights, just loaded from ``init_from``, must be the base the adapter in ``folder`` was
    trained on: the fingerprint the trainer saved in ``lora_base.safetensors`` (what its resume checks).
    A checkpoint without that file (an older version's) is not checked."""
    path = folder / RUN_BASE_FILE
    if not path.is_file():
        log.warning("%s records no fingerprint of its base weights: %s is not checked", folder, init_from)
        return
    saved = sd.files.read_weights(verified(path)).get("fingerprint")
    if saved is None:
        raise ValueError(f"{path}: holds no fingerprint tensor")
    models = [unet] + ([text_encoder] if text_encoder is not None else [])  # a learned token's: both
    now = sd.run_folder.weights_fingerprint([p for model in models for p in model.parameters()])
    if not sd.lora.adapters.same_base(saved, now):
        what = what or ("learned token" if text_encoder is not None else "adapter")
        raise BaseMismatch(f"{init_from} is not the base model the {what} in {folder} was trained on (its weights "
                           f"differ from those {RUN_BASE_FILE} records); restore that base")


# ---------------------------------------------------------------------------------------------
# Textual-inversion runs: a base model (init_from) and a learned token
# ---------------------------------------------------------------------------------------------

RUN_EMBEDDING_FILE = "embedding.safetensors"  # {"emb_params": (N, D)}: AUTOMATIC1111's and ComfyUI's layout


def load_embedding_run(folder: Path, unet, text_encoder, tokenizer, *, use_ema: bool = True,
                       check_base: bool = True) -> str:
    """Load a textual-inversion checkpoint: the base UNet from its ``init_from``, then its token into
    ``tokenizer`` and ``text_encoder`` (the EMA's vectors unless ``use_ema=False`` or there is none).
    The UNet and text encoder must be those the token was learned for (the fingerprint the trainer
    saved), unless ``check_base`` is False. Returns what was loaded."""
    folder = Path(folder)
    config = run_config(str(folder)) or {}
    token, init_from = str(config.get("embedding_token", "")), str(config.get("init_from") or "")
    if not init_from:
        raise ValueError(f"{folder / 'config.yaml'}: a textual-inversion run (embedding_token {token}) that names no "
                         "init_from, the base its token was learned for")
    base = load_unet_weights(init_from, unet, use_ema=True)
    if check_base:
        check_trained_base(folder, init_from, unet, text_encoder)
    path = verified(folder / RUN_EMBEDDING_FILE)
    vectors = sd.files.read_weights(path).get("emb_params")
    if vectors is None:
        raise ValueError(f"{path}: holds no emb_params tensor")
    ema_path = folder / "ema.safetensors"
    if use_ema and ema_path.exists():
        ema = sd.files.read_weights(verified(ema_path))
        found = [v for k, v in ema.items() if k.endswith("token_embedding.vectors")]
        if len(found) != 1:
            raise ValueError(f"{ema_path}: holds no EMA of the learned token's vectors")
        vectors, path = found[0], ema_path
    with _naming(path):
        sd.embedding.tokens.add_token(tokenizer, text_encoder, token, vectors)
    return f"{base} + token {token} from {path}"


@contextlib.contextmanager
def _naming(path: Path):
    """Re-raise an adapter's KeyError / ValueError as one ValueError that names ``path``."""
    try:
        yield
    except (KeyError, ValueError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error  # KeyError quotes its str()
        raise ValueError(f"{path}: {message}") from error


def add_run_lora(model, targets, settings: dict):
    """``model`` with an adapter of ``settings``' rank and alpha on the layers ``targets`` selects."""
    modules, ranks = sd.lora.adapters.resolve_targets(model, targets), {}
    if settings.get("block_dims") and hasattr(model.config, "block_out_channels"):  # the UNet's blocks
        modules, ranks = sd.lora.adapters.block_layout(model, modules, settings["alpha"], settings["block_dims"],
                                                       settings.get("block_alphas"))
    sd.lora.adapters.add_lora(model, modules, settings["rank"], settings["alpha"],
                              conv_rank=settings.get("conv_rank", 0), conv_alpha=settings.get("conv_alpha", 0.0),
                              kind=settings.get("kind", "lora"), factor=settings.get("factor", -1),
                              dora=settings.get("dora", False), module_ranks=ranks)
    model.lora_settings["targets"] = list(targets)
    model.eval()
    return model

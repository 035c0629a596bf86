"""One optimizer step of the UNet, and the pure pieces it is made of.

``build_step`` assembles what a step uses (the UNet and its callable wrapper, the frozen text
encoder, optimizer, loss scaler, EMA, the dedicated noise generator and the loss settings);
``train_step`` runs forward/backward over the micro-batches of one accumulation and applies the
update unless anything was non-finite. The trainer's loop and the benchmarks call the same code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from dataclasses import dataclass

import numpy as np
import torch

import sd.cli
import sd.data.training_data
import sd.distributed
import sd.embedding.tokens
import sd.faults
import sd.model
import sd.original_layout
import sd.posthoc_ema
import sd.runtime
import sd.train.ema
import sd.train.optimizers
import sd.train.power_ema
import sd.training_mode
import sd.train.modes
import sd.train.objectives
import sd.train.sharding
from sd.distributed import Dist
from sd.train.objectives import LossContext, LossSettings

log = logging.getLogger("sd_train")


@dataclass
class Step:
    """Everything one optimizer step uses, and nothing else."""

    unet: torch.nn.Module  # the plain module: parameters, clipping, EMA, checkpoints
    model: torch.nn.Module  # what the step calls: the unet, DDP-wrapped and/or compiled
    text_encoder: torch.nn.Module  # on the device, or on the CPU when text_cache serves the prompts
    empty_embedding: torch.Tensor  # (1, 77, D): the empty prompt, for CFG dropout
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    ema: sd.train.ema.EMA | None  # of the UNet's trainable parameters (a LoRA run: its adapter)
    noise_generator: torch.Generator  # noise, timesteps and CFG dropout; saved per rank
    alphas_cumprod: torch.Tensor
    scaling_factor: float
    loss: LossSettings
    d: Dist
    ddp: torch.nn.Module | None = None  # the DDP wrapper, for no_sync()
    trainable: list = dataclasses.field(default_factory=list)  # what the optimizer updates (UNet, text adapter)
    text_trains: bool = False  # a text-encoder adapter trains: prompts are encoded with gradients
    text_cache: "TextCache | None" = None  # prompt embeddings computed once (a frozen text encoder)
    empty_ids: torch.Tensor | None = None  # (1, 77): the empty prompt's ids, on the device
    cuda_graphs: bool = False  # the compiled model replays CUDA graphs (compile_mode reduce-overhead)
    sharding: str = "none"  # none, zero1 or fsdp (sd.train.sharding); fsdp applies at wrap_model
    reduce_each_micro_batch: bool = False  # fsdp_reduce_each_micro_batch: no micro-batch accumulates unsynced
    held_optimizer_state: dict | None = None  # fsdp: a resume's AdamW state in host memory until shard_unet splits it
    text_ema: sd.train.ema.EMA | None = None  # of the text encoder's adapter, when it trains and there is an EMA
    posthoc: list = dataclasses.field(default_factory=list)  # posthoc_ema_every: PowerEMAs of the UNet
    posthoc_text: list = dataclasses.field(default_factory=list)  # and of what trains in the text encoder
    objective: sd.train.objectives.Objective = dataclasses.field(default_factory=sd.train.objectives.Diffusion)
    mode: sd.training_mode.Mode = dataclasses.field(default_factory=lambda: sd.training_mode.Mode(None))  # what trains

    def emas(self) -> list[tuple[sd.train.ema.EMA, torch.nn.Module]]:
        """Each EMA with the model it averages: the UNet's, then the text adapter's."""
        pairs = [(self.ema, self.unet), (self.text_ema, self.text_encoder)]
        return [(ema, model) for ema, model in pairs if ema is not None]


# ---------------------------------------------------------------------------------------------
# Pure pieces
# ---------------------------------------------------------------------------------------------


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


def schedule_free_lr_at(step: int, peak: float, warmup: int) -> float:
    """Learning rate of step ``step`` (0-based) for ``optimizer: adamw_schedulefree``: its linear warm-up
    ``peak * (step + 1) / warmup`` (the schedulefree package's own formula), then ``peak`` to the end.
    No decay follows: the optimizer's running average of the weights takes the place of one (Defazio
    et al. 2024, "The Road Less Scheduled"), and a cosine on top would undo what it averages."""
    return peak * ((step + 1) / warmup) if step < warmup else peak


GROUPS = ("unet", "unet_down", "unet_mid", "unet_up", "text_encoder", "embedding")  # the optimizer's groups, in order
UNET_BLOCKS = {"down_blocks": "unet_down", "mid_block": "unet_mid", "up_blocks": "unet_up"}  # module: its group
BLOCK_SCALES = {"unet_down": "down_lr_scale", "unet_mid": "mid_lr_scale", "unet_up": "up_lr_scale"}  # group: field


def block_scales(config) -> dict[str, float]:
    """The learning-rate multipliers of the UNet's blocks by group name: the 25 of ``optim.block_lr_weights``
    (``unet_IN00`` ... ``unet_OUT11``), else the down, middle and up blocks', or none when each is 1: the blocks
    then train in the UNet's one group."""
    if config.optim.block_lr_weights:
        return {f"unet_{block}": float(weight)
                for block, weight in zip(sd.original_layout.BLOCKS, config.optim.block_lr_weights)}
    scales = {name: getattr(config.optim, field) for name, field in BLOCK_SCALES.items()}
    return scales if any(scale != 1 for scale in scales.values()) else {}


def pivotal(config) -> bool:
    """A LoRA and a learned token train together (pivotal tuning): the token in a group of its own."""
    return bool(config.embedding.token) and config.lora.rank > 0


def group_schedules(config) -> dict[str, tuple[float, int]]:
    """Each parameter group's peak learning rate and warm-up steps: the UNet's ``lr`` / ``warmup_steps``,
    its blocks' ``lr`` times their scales (``block_scales``); the text encoder's adapter its own
    ``text_encoder_lr`` / ``text_encoder_warmup_steps`` (0 / -1: the UNet's); in pivotal tuning the
    learned token ``embedding_lr`` (0: ``lr``) with the UNet's warm-up."""
    text_lr = config.optim.text_encoder_lr or config.lr
    text_warmup = config.optim.text_encoder_warmup_steps
    blocks = {name: (config.lr * scale, config.warmup_steps) for name, scale in block_scales(config).items()}
    token = {"embedding": (config.embedding.lr or config.lr, config.warmup_steps)} if pivotal(config) else {}
    return {"unet": (config.lr, config.warmup_steps), **blocks,
            "text_encoder": (text_lr, config.warmup_steps if text_warmup < 0 else text_warmup), **token}


def token_steps(config, total: int) -> int:
    """The optimizer steps in which a pivotal run's token trains: ``embedding_train_fraction`` of ``total``,
    rounded, at least one."""
    return max(1, round(config.embedding.train_fraction * total))


def lrs_at(config, step: int, total: int) -> dict[str, float]:
    """The learning rate of every parameter group at optimizer step ``step`` (0-based) of ``total``:
    ``lr_at``'s warm-up and cosine, or for ``adamw_schedulefree`` ``schedule_free_lr_at``'s warm-up alone.
    Prodigy takes the same schedule as AdamW: its step is its own estimate times this (``lr`` 1.0
    at the peak), so the warm-up and the cosine scale the estimate. The learned token of pivotal tuning has
    rate 0 from ``token_steps`` on (``set_lr`` then freezes it)."""
    schedule_free = config.optim.name == "adamw_schedulefree"
    lrs = {name: schedule_free_lr_at(step, peak, warmup) if schedule_free
           else lr_at(step, peak, warmup, total, config.optim.min_lr_ratio)
           for name, (peak, warmup) in group_schedules(config).items()}
    if "embedding" in lrs and step >= token_steps(config, total):
        lrs["embedding"] = 0.0
    return lrs


def set_lr(optimizer: torch.optim.Optimizer, lr: float | dict[str, float]) -> None:
    """Set the learning rate of every parameter group: ``lr``, or ``lr[name]`` by the group's name (a group
    without one is the UNet's). The learned token of pivotal tuning trains while its rate is above 0: at 0
    it needs no gradient, and the text encoder's backward pass is left out when nothing else of it trains."""
    for group in optimizer.param_groups:
        group["lr"] = lr[group.get("name", "unet")] if isinstance(lr, dict) else lr
        if group.get("name") == "embedding":
            for p in group["params"]:
                p.requires_grad_(group["lr"] > 0)


def apply_cfg_dropout(hidden: torch.Tensor, empty: torch.Tensor, p: float, generator: torch.Generator):
    """Replace each sample's text embedding by the empty prompt's with probability ``p``.

    ``hidden`` (B, 77, D); ``empty`` (1, 77, D). Returns the new embeddings and the boolean mask.
    """
    drop = torch.rand(hidden.shape[0], generator=generator, device=generator.device) < p
    drop = drop.to(hidden.device)
    return torch.where(drop[:, None, None], empty.to(hidden.dtype), hidden), drop


# ---------------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------------


def param_groups(config, unet, text_encoder) -> list[dict]:
    """The optimizer's parameter groups: what trains in the UNet (with ``block_scales``, its down, middle
    and up blocks each in a group of their own after the rest), then in the text encoder (its LoRA
    adapter; a learned token, in pivotal tuning, in a group of its own after it), each named (``GROUPS``)
    and starting at its peak learning rate; a group with nothing to train is left out."""
    peaks = group_schedules(config)
    members = {name: [] for name in GROUPS[:1] + tuple(block_scales(config)) + GROUPS[1:]}
    block_of = sd.original_layout.unet_blocks(unet.config) if config.optim.block_lr_weights else None
    for name, p in unet.named_parameters():
        if p.requires_grad:
            block = f"unet_{block_of(name)}" if block_of else UNET_BLOCKS.get(name.split(".", 1)[0], "unet")
            members[block if block in peaks else "unet"].append(p)
    token = {id(layer.vectors) for layer in sd.embedding.tokens.added_embeddings(text_encoder)} \
        if "embedding" in peaks else set()
    for p in text_encoder.parameters():
        if p.requires_grad:
            members["embedding" if id(p) in token else "text_encoder"].append(p)
    return [{"name": name, "lr": peaks[name][0], "params": params} for name, params in members.items() if params]


def describe_groups(optimizer) -> str | None:
    """A line for the log naming each parameter group's size and peak learning rate, when there are several."""
    groups = optimizer.param_groups
    if len(groups) < 2:
        return None
    return "parameter groups: " + ", ".join(
        f"{group.get('name', i)} {sum(p.numel() for p in group['params']):,} at lr {group['lr']:g}"
        for i, group in enumerate(groups))


def build_optimizer(params: list, config, zero: bool = False):
    """The configured optimizer over ``params`` (tensors, or ``param_groups``' named groups).

    ``adamw``: torch's AdamW, fused where the device has the kernels, the foreach version otherwise.
    ``adamw8bit``: bitsandbytes' 8-bit AdamW (block-wise quantised moments: 2 bytes a parameter
    instead of 8). ``prodigy``: Prodigy (Mishchenko & Defazio 2024) with the settings its authors give
    for diffusion models (bias correction, the warm-up safeguard). ``adamw_schedulefree``:
    Schedule-Free AdamW (Defazio et al. 2024) in train mode, its own warm-up off (``set_lr`` applies
    it, ``schedule_free_lr_at``). ``zero``: the AdamW state split across the ranks (``sharding: zero1``).
    """
    kwargs = dict(lr=config.lr, betas=(config.optim.adam_beta1, config.optim.adam_beta2), eps=config.optim.adam_eps,
                  weight_decay=config.optim.weight_decay)
    if config.optim.name == "adamw8bit":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params, **kwargs)
    if config.optim.name == "prodigy":
        import io

        from prodigyopt import Prodigy

        with contextlib.redirect_stdout(io.StringIO()):  # it prints a line on every rank when it decays weights
            return Prodigy(params, use_bias_correction=True, safeguard_warmup=True, **kwargs)
    if config.optim.name == "adamw_schedulefree":
        from schedulefree import AdamWScheduleFree

        optimizer = AdamWScheduleFree(params, warmup_steps=0, **kwargs)
        optimizer.train()
        return optimizer
    make = sd.train.sharding.zero_optimizer if zero else torch.optim.AdamW
    try:
        return make(params, fused=True, **kwargs)
    except (RuntimeError, TypeError) as error:  # fused kernels missing for this device or dtype
        log_foreach_fallback(params, error)
        return make(params, foreach=True, **kwargs)


FUSED_FALLBACK_LOGGED = False


def log_foreach_fallback(params: list, error: Exception) -> None:
    """Say once per process (on rank 0: the others log warnings only) why AdamW is not fused, and what
    the foreach version costs."""
    global FUSED_FALLBACK_LOGGED
    if FUSED_FALLBACK_LOGGED:
        return
    FUSED_FALLBACK_LOGGED = True
    tensors = [p for item in params for p in (item["params"] if isinstance(item, dict) else [item])]
    where = sorted({f"{p.device.type} {str(p.dtype).removeprefix('torch.')}" for p in tensors})
    log.info("AdamW runs its foreach version, not the fused kernel (%s: %s): about ten passes over the weights "
             "and moments per step where the fused kernel makes one (slower updates, more memory traffic), and the "
             "host waits for the device at every step to read whether to skip it", ", ".join(where),
             sd.cli.first_line(error))


def ema_update_every(config, device: torch.device, part: bool) -> int:
    """``ema_update_every``, with auto resolved: every 10th step for a whole UNet's EMA in host memory of a
    GPU run, where each update copies the weights off the GPU and waits for them (3.4 GB at SD 1.x,
    0.1-0.6 s), every step otherwise (an EMA on the device, of a ``part`` of the model: an adapter, a
    ControlNet; a CPU run)."""
    if config.ema.update_every:
        return config.ema.update_every
    return 10 if config.ema_device == "cpu" and device.type == "cuda" and not part else 1


def build_step(config, d: Dist, unet, text_encoder, empty_ids: torch.Tensor, scaling_factor: float,
               mode: sd.training_mode.Mode | None = None) -> Step:
    """A step around a built UNet (on ``d.device``) and text encoder, at step 0, for ``mode`` (default: the
    one ``config`` asks for) attached to them already.

    ``empty_ids``: the empty prompt's token ids ``(1, 77)``. What trains is what requires a gradient:
    the whole UNet, or what the mode trains (a LoRA's adapters of the UNet and text encoder, a learned
    token, a ControlNet; the mode froze the rest), in one named parameter group each (``param_groups``);
    the EMAs then average what trains only. The UNet is not wrapped yet: call ``wrap_model`` after loading
    weights, so DDP broadcasts the right ones.
    """
    mode = mode or sd.train.modes.mode_of(config)
    text_encoder = text_encoder.to(d.device)
    with sd.runtime.autocast(config.precision, d.device):
        empty = sd.model.encode_prompt_ids(text_encoder, empty_ids)
    text_trains = any(p.requires_grad for p in text_encoder.parameters())
    ema = text_ema = None
    if config.ema_decay > 0:
        settings = dict(device="cpu" if config.ema_device == "cpu" else None,
                        update_every=ema_update_every(config, d.device, not mode.whole_unet),
                        trainable_only=not mode.whole_unet)
        if mode.unet_trains:  # a frozen UNet's EMA would be a copy of it
            ema = sd.train.ema.EMA(unet, config.ema_decay, **settings)
        if text_trains:
            text_ema = sd.train.ema.EMA(text_encoder, config.ema_decay, **{**settings, "trainable_only": True})
    posthoc, posthoc_text = [], []
    if config.ema.posthoc_every and mode.unet_trains:
        where = "cpu" if config.ema_device == "cpu" else None
        posthoc = [sd.train.power_ema.PowerEMA(unet, sigma_rel, device=where, trainable_only=not mode.whole_unet)
                   for sigma_rel in sd.posthoc_ema.PROFILES]
        if text_trains:  # a text adapter, a pivotal run's token: their EMAs rebuilt with the UNet's
            posthoc_text = [sd.train.power_ema.PowerEMA(text_encoder, sigma_rel, device=where, trainable_only=True)
                            for sigma_rel in sd.posthoc_ema.PROFILES]
    groups = param_groups(config, unet, text_encoder)
    master = None
    if config.optim.bf16_weights:  # every group is the UNet's (config.check_bf16_weights)
        master = sd.train.optimizers.MasterWeights([p for group in groups for p in group["params"]])
        masters = iter(master.master)
        for group in groups:
            group["params"] = [next(masters) for _ in group["params"]]
    noise_generator = torch.Generator(device=d.device).manual_seed(config.seed * 7919 + d.rank + 1)
    sharding = config.sharding if d.world_size > 1 else "none"
    objective = sd.train.objectives.objective_of(config).build(config, unet)
    objective.attach(d)
    optimizer = build_optimizer(groups, config, zero=sharding == "zero1")
    optimizer.master_weights = master
    return Step(unet, unet, text_encoder, empty, optimizer,
                torch.amp.GradScaler(d.device.type, enabled=config.precision == "fp16"), ema, noise_generator,
                sd.model.ddpm_alphas_cumprod(zero_terminal_snr=config.zero_terminal_snr).to(d.device), scaling_factor,
                LossSettings.from_config(config), d, trainable=[p for group in groups for p in group["params"]],
                text_trains=text_trains, empty_ids=empty_ids.to(d.device), sharding=sharding, text_ema=text_ema,
                objective=objective, mode=mode, posthoc=posthoc, posthoc_text=posthoc_text,
                reduce_each_micro_batch=sharding == "fsdp" and config.fsdp_reduce_each_micro_batch)


def wrap_model(step: Step, compile: bool, shapes: int = 1, mode: str = "default") -> None:
    """DDP-wrap, then compile (after weights are loaded, so DDP broadcasts the right ones).

    Compiling the DDP module lets the compiler split graphs at bucket boundaries so communication
    overlaps the backward pass. ``shapes``: the latent shapes the run trains (aspect-ratio buckets);
    ``mode``: ``compile_mode``.
    """
    if step.sharding == "fsdp":
        model = sd.train.sharding.shard_unet(step)
    else:
        model = wrap_ddp(step) if step.d.world_size > 1 else step.unet
    if compile:
        model = torch.compile(model, **compile_options(shapes, mode))
        step.cuda_graphs = mode in ("reduce-overhead", "max-autotune") and step.d.device.type == "cuda"
    step.model = model


def wrap_ddp(step: Step) -> torch.nn.Module:
    """The UNet in DistributedDataParallel, its gradients kept as views of DDP's buckets for the whole run.

    The buckets hold one copy of the gradients, which DDP all-reduces. A gradient created outside
    them (autograd's, when ``.grad`` is None, as in a ``no_sync`` micro-batch after
    ``zero_grad(set_to_none=True)``) would be a second full copy beside them until the synchronised
    backward copies it in: 3.4 GB at SD 1.x size. So each gradient exists before wrapping (DDP then
    binds it to its bucket), and ``train_step`` zeroes gradients in place instead of freeing them.
    """
    from torch.nn.parallel import DistributedDataParallel

    with torch.no_grad():
        for p in step.unet.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    device_ids = [step.d.device.index] if step.d.device.type == "cuda" else None
    step.ddp = DistributedDataParallel(step.unet, device_ids=device_ids, gradient_as_bucket_view=True,
                                       process_group=step.d.group)
    return step.ddp


def compile_options(shapes: int, mode: str = "default") -> dict:
    """``torch.compile`` options for a run over ``shapes`` latent shapes in ``mode`` (``compile_mode``).

    Several shapes (aspect-ratio buckets): one static graph per shape, compiled the first time it
    comes. The default (``dynamic=None``) recompiles with symbolic sizes at the first shape change,
    which fails for this UNet once both sides change (torch 2.13 on the CPU: "cannot determine truth
    value of Relational", pytorch/pytorch#185510) and took minutes on an H100; and dynamo's default
    limit of 8 recompiles per function would send the rest of SD 1.x's 17 default buckets to eager.
    """
    options = {} if mode == "default" else {"mode": mode}
    if shapes <= 1:
        return options
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):  # the newer and the older name of one limit
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), 2 * shapes + 8))
    if hasattr(dynamo_config, "accumulated_recompile_limit"):
        dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 64 * shapes)
    return {**options, "dynamic": False}


# ---------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------


def compute_loss(step: Step, model, latents: torch.Tensor, input_ids: torch.Tensor, generator: torch.Generator,
                 mask: torch.Tensor | None = None, **inputs: torch.Tensor):
    """Per-sample loss ``(B,)`` and timesteps of one micro-batch through ``model``, by the step's objective
    (``sd.train.objectives``); ``mask`` ``(B, 1, h, w)``: the loss weights of ``masked_loss``; ``inputs``: the
    micro-batch's other tensors by name (the objective's and the mode's ``batch_inputs``)."""
    return step.objective.loss(loss_context(step), model, latents, input_ids, generator, mask, inputs)


def loss_context(step: Step) -> LossContext:
    """The pieces of ``step`` its objective's loss reads."""
    return LossContext(step.d.device, step.loss, step.scaling_factor, step.alphas_cumprod, step.unet,
                       step.empty_embedding, lambda ids, generator: prompt_embeddings(step, ids, generator),
                       step.mode.model_inputs)


def batch_extras(step: Step, extra: list) -> dict:
    """A micro-batch's tensors after the latents and token ids, by ``compute_loss``'s names: the loss mask
    (``masked_loss``), then the objective's (``Objective.batch_inputs``: reflow's noise), then the mode's
    (``Mode.batch_inputs``: a ControlNet run's conditioning images)."""
    names = (*step.objective.batch_inputs, *step.mode.batch_inputs)
    if len(extra) < len(names):
        lacking = "; ".join(part.missing_inputs for part in (step.objective, step.mode) if part.batch_inputs)
        raise ValueError(f"this run's micro-batch needs {lacking}")
    own = extra[: len(extra) - len(names)]
    named = dict(zip(names, extra[len(own):]))
    if own:
        named["mask"] = own[0]
    return named


def prompt_embeddings(step: Step, input_ids: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """The UNet's context for a micro-batch: from the text cache, the frozen text encoder, or, when its
    adapter trains, the encoder run with gradients. With ``generator``, CFG dropout drawn from it (the
    dropped samples of a training encoder get the empty prompt's ids, so their embedding follows the
    adapter too); without, the prompts as written (a distillation learns the guided teacher)."""
    device, dropout = step.d.device, step.loss.cfg_dropout if generator is not None else 0.0
    if step.text_trains:
        ids = input_ids.to(device, non_blocking=True)
        if generator is not None:
            drop = torch.rand(ids.shape[0], generator=generator, device=generator.device) < dropout
            ids = torch.where(drop.to(device)[:, None], step.empty_ids.to(device), ids)
        return sd.model.text_condition(step.text_encoder, ids)
    if step.text_cache is not None:
        hidden = step.text_cache.lookup(input_ids).to(device, non_blocking=True)
    else:
        hidden = sd.model.encode_prompt_ids(step.text_encoder, input_ids)
    if generator is not None:
        hidden, _ = apply_cfg_dropout(hidden, step.empty_embedding, dropout, generator)
    return hidden


class TextCache:
    """Prompt embeddings computed once by a frozen text encoder, looked up by token ids.

    Holds one ``(77, D)`` float32 embedding per distinct prompt in host memory (pinned for a CUDA
    run), so the encoder need not stay on the device or run at every step.
    """

    def __init__(self, ids: np.ndarray, embeddings: torch.Tensor):
        self.index = {row.tobytes(): i for i, row in enumerate(np.asarray(ids, dtype=np.int64))}
        self.embeddings = embeddings

    @classmethod
    @torch.no_grad()
    def build(cls, text_encoder, input_ids, precision: str, device, batch_size: int = 64,
              max_bytes: float = float("inf")):
        """``input_ids``: ``(N, 77)`` token ids (array or tensor), repeats allowed. A cache larger than
        ``max_bytes`` is refused (``MemoryError``) before any prompt is encoded."""
        ids = input_ids.cpu().numpy() if isinstance(input_ids, torch.Tensor) else input_ids
        unique = np.unique(np.asarray(ids, dtype=np.int64), axis=0)
        need = unique.shape[0] * unique.shape[1] * text_encoder.config.hidden_size * 4
        if need > max_bytes:
            raise MemoryError(f"{len(unique)} distinct prompts need {need / 1e9:.1f} GB of cached embeddings, more "
                              f"than the {max_bytes / 1e9:.1f} GB allowed")
        parts = []
        for start in range(0, len(unique), batch_size):
            chunk = torch.from_numpy(unique[start : start + batch_size])
            with sd.runtime.autocast(precision, device):
                parts.append(sd.model.encode_prompt_ids(text_encoder, chunk).float().cpu())
        embeddings = torch.cat(parts)
        if device.type == "cuda":
            embeddings = embeddings.pin_memory()
        return cls(unique, embeddings)

    def lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        try:
            rows = [self.index[row.tobytes()] for row in input_ids.cpu().numpy().astype(np.int64)]
        except KeyError:
            raise KeyError("a prompt of this batch is not in the text-embedding cache") from None
        found = self.embeddings[rows]
        return found.pin_memory() if self.embeddings.is_pinned() else found  # an asynchronous copy to the device

    @property
    def nbytes(self) -> int:
        return self.embeddings.numel() * self.embeddings.element_size()


class Slot:
    """Where each statistic of a step sits in the one tensor all-reduced across the ranks."""

    LOSS, BAD, STOP = 0, 1, 2  # the reduced loss; any non-finite loss or gradient; a stop request
    QUARTILE_SUMS, QUARTILE_COUNTS = slice(3, 7), slice(7, 11)  # per timestep quartile: loss sums, samples
    GRAD_NORM, OVERFLOW = 11, 12  # the gradient norm; fp16's non-finite gradients (the scaler's overflow)
    COUNT = 13




def train_step(step: Step, micro_batches: list, step_index: int, stop_requested: bool = False) -> "StepResult":
    """Forward/backward over the accumulation, then one optimizer update unless anything is non-finite.

    ``micro_batches``: ``[(latents (B, 4, h, w), input_ids (B, 77)[, loss mask (B, 1, h, w)][, control
    (B, 3, 8h, 8w)]), ...]`` (``MixedData.batch``: the mask with ``masked_loss``, the conditioning images in a
    ControlNet run); ``step_index``: the
    0-based optimizer step (the EMA's warm-up). The learning rate is set by the caller. A non-finite
    loss or gradient norm on any rank skips the update on every rank: weights, optimizer and EMA stay
    as they were. One all-reduce carries the loss, the bad-step flag, the stop request, the
    per-quartile losses and the gradient norm, so every rank takes the same decision.

    The host does not wait for the device: the decision is applied on the device (fused AdamW skips
    itself on its ``found_inf`` flag, the EMA's weight is zero), and the statistics stay there in the
    returned ``StepResult`` until read (``read_results`` reads many steps' at once). Optimizers
    without the flag (the foreach fallback, bitsandbytes' 8-bit AdamW) and an EMA in host memory read
    the decision at the step.
    """
    settings, d = step.loss, step.d
    fp16 = settings.precision == "fp16"
    keep_grads = step.ddp is not None  # DDP's bucket views: zeroed in place (see wrap_ddp)
    master = getattr(step.optimizer, "master_weights", None)  # bf16_weights
    (master or step.optimizer).zero_grad(set_to_none=not keep_grads)
    stats = torch.zeros(Slot.COUNT, dtype=torch.float64, device=d.device)
    step.objective.measured(d.device)  # what a validation loss or an earlier step left is not this step's
    for i, (latents, input_ids, *extra) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        sync = contextlib.nullcontext() if last or step.reduce_each_micro_batch else sd.train.sharding.no_sync(step)
        if step.cuda_graphs:  # each micro-batch's forward and backward is a new replay of the graphs
            torch.compiler.cudagraph_mark_step_begin()
        with sync:
            loss, timesteps = compute_loss(step, step.model, latents, input_ids, step.noise_generator,
                                           **batch_extras(step, extra))
            value = step.objective.reduce(loss, settings)
            step.scaler.scale(value / len(micro_batches)).backward()
        quartile = (timesteps * 4 // sd.model.NUM_TRAIN_TIMESTEPS).clamp(max=3)
        stats[Slot.LOSS] += value.detach().double() / len(micro_batches)
        stats[Slot.QUARTILE_SUMS].index_add_(0, quartile, loss.detach().double())
        stats[Slot.QUARTILE_COUNTS].index_add_(0, quartile, torch.ones_like(loss, dtype=torch.float64))
    if step.text_trains and d.world_size > 1:
        average_text_gradients(step)
    if master is not None:
        master.take_gradients()
    step.scaler.unscale_(step.optimizer)
    params = [p for p in step.trainable if p.grad is not None]
    clip = settings.grad_clip if settings.grad_clip > 0 else float("inf")
    grad_norm = sd.train.sharding.whole(torch.nn.utils.clip_grad_norm_(params, clip))  # fsdp: a DTensor
    grads_finite = torch.isfinite(grad_norm)
    bad = ~torch.isfinite(stats[Slot.LOSS])
    if not fp16:  # with fp16, non-finite gradients are an overflow: the scaler skips the step and backs off
        bad = bad | ~grads_finite
    stats[Slot.BAD] = bad
    stats[Slot.STOP].fill_(float(stop_requested))
    stats[Slot.GRAD_NORM] = grad_norm.double()
    stats[Slot.OVERFLOW] = ~grads_finite
    stats = torch.cat([stats, step.objective.measured(d.device)])  # the objective's sums and their count
    stats = sd.distributed.all_reduce_sum(stats, d)
    skip = stats[Slot.BAD] > 0
    if fp16:
        skip = skip | (stats[Slot.OVERFLOW] > 0)
    apply_update(step, skip, step_index)
    if master is not None:  # unchanged where the step was skipped: the same rounding again
        master.put_weights()
    return StepResult(stats, d.world_size, fp16, step.objective.statistics)


def skips_on_device(optimizer) -> bool:
    """Whether ``optimizer.step`` skips itself on the device when ``optimizer.found_inf`` is 1: torch's
    fused AdamW (its kernel, and the undoing of its step count, read the flag)."""
    return bool(getattr(optimizer, "defaults", {}).get("fused")) and isinstance(optimizer, torch.optim.AdamW)


def apply_update(step: Step, skip: torch.Tensor, step_index: int) -> None:
    """The optimizer, loss-scaler and EMA update of a step, none of it where ``skip`` (a device bool).

    ``sharding: zero1``: ZeRO steps its local fused AdamW, which reads the flag set on it, then
    broadcasts each rank's parameters (unchanged where skipped). ``fsdp``: the flag is a plain tensor
    beside the DTensor parameters, which the fused kernel accepts."""
    local = sd.train.sharding.local_optimizer(step.optimizer)
    if skips_on_device(local):
        local.found_inf = skip.float()
        local.grad_scale = None  # fp16: the gradients were unscaled already
        step.optimizer.step()
        step.scaler.update()  # fp16: backs off on its own overflow flag, else grows
        view = sd.train.optimizers.evaluation_view(step.optimizer)  # bf16_weights: the fp32 masters
        for ema, model in step.emas():
            ema.update(model, step_index, skip=skip, view=view)
        sd.train.power_ema.update_all(step.posthoc, step.unet, step_index, skip=skip, view=view)
        sd.train.power_ema.update_all(step.posthoc_text, step.text_encoder, step_index, skip=skip, view=view)
        step.objective.update(step.unet, step_index, skip=skip)
        return
    # A read of the device: these optimizers cannot skip on their own (the foreach AdamW, bitsandbytes'
    # 8-bit AdamW, Prodigy, which reads its statistics on the host anyway, and Schedule-Free AdamW).
    if bool(skip):
        step.scaler.update()
        return
    step.scaler.step(step.optimizer)
    step.scaler.update()
    evaluated = sd.train.optimizers.evaluation_view(step.optimizer)  # Schedule-Free: the EMAs average x, not y
    for ema, model in step.emas():
        ema.update(model, step_index, view=evaluated)
    sd.train.power_ema.update_all(step.posthoc, step.unet, step_index, view=evaluated)
    sd.train.power_ema.update_all(step.posthoc_text, step.text_encoder, step_index, view=evaluated)
    step.objective.update(step.unet, step_index, view=evaluated)


class StepResult:
    """A step's statistics, all-reduced, on the device until first read.

    ``result["loss"]`` (and ``grad_norm``, ``bad``, ``overflow``, ``stop``, ``loss_quartiles``) reads
    them, one device-to-host copy; ``read_results`` reads a window of steps with one copy.
    """

    def __init__(self, stats: torch.Tensor, world_size: int, fp16: bool, statistics: tuple[str, ...] = ()):
        self.stats, self.world_size, self.fp16, self.statistics = stats, world_size, fp16, statistics
        self.values: dict | None = None

    def __getitem__(self, key: str):
        if self.values is None:
            read_results([self])
        return self.values[key]

    def fill(self, values: list[float]) -> None:
        sums, counts = values[Slot.QUARTILE_SUMS], values[Slot.QUARTILE_COUNTS]
        self.values = {
            "loss": values[Slot.LOSS] / self.world_size,
            "grad_norm": values[Slot.GRAD_NORM] / self.world_size,
            "bad": values[Slot.BAD] > 0,
            "overflow": self.fp16 and values[Slot.OVERFLOW] > 0,
            "stop": values[Slot.STOP] > 0,
            "loss_quartiles": [sums[q] / counts[q] if counts[q] > 0 else None for q in range(4)],
            "measured": {},  # the objective's statistics: means over the step's samples on every rank
        }
        if self.statistics:
            own = values[Slot.COUNT:]
            count = own[len(self.statistics)]
            self.values["measured"] = {name: own[i] / count if count > 0 else None
                                       for i, name in enumerate(self.statistics)}
        self.stats = None


def read_results(results: list[StepResult]) -> list[StepResult]:
    """Read the statistics of ``results`` not read yet to the host: one device-to-host copy for all."""
    unread = [r for r in results if r.values is None]
    if unread:
        for result, values in zip(unread, torch.stack([r.stats for r in unread]).tolist()):
            result.fill(values)
    return results


def average_text_gradients(step: Step) -> None:
    """The text adapter's gradients averaged over the ranks (DDP wraps the UNet only): one flat
    all-reduce, a few MB at most."""
    params = [p for p in step.text_encoder.parameters() if p.requires_grad and p.grad is not None]
    if not params:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    flat = sd.distributed.all_reduce_sum(flat, step.d) / step.d.world_size
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
        offset += p.numel()


@torch.no_grad()
def validation_loss(step: Step, data, count: int, batch_size: int, stop=None) -> float:
    """Mean loss of the plain UNet on up to ``count`` held-out samples, with fixed noise and timesteps.

    Every dataset of a mixed phase contributes in proportion to its weight (``sd.data.training_data.validation_indices``).
    The samples are split across ranks and drawn with a generator seeded the same at every
    validation, so values at different steps are comparable. ``stop``: asked before each batch; a True
    answer on any rank ends every rank's share there and raises ``sd.distributed.Stopped`` on all of them
    after the one all-reduce. An error in a rank's share is told at the same all-reduce: that rank raises
    it, every other ``sd.distributed.Failed`` naming it.
    """
    d = step.d
    stop = stop or (lambda: False)
    indices = sd.data.training_data.validation_indices(data.sizes, data.weights, count)[d.rank :: d.world_size]
    generator = torch.Generator(device=d.device).manual_seed(1234 + d.rank)
    totals = torch.zeros(4, dtype=torch.float64, device=d.device)  # loss sum, count, stop, failed
    error = None
    step.unet.eval()
    try:
        for batch in sd.data.training_data.shape_batches(data, indices, batch_size):
            if stop():
                break
            sd.faults.point("fail_validation_loss", d.rank)
            latents, input_ids, *extra = data.batch(batch)
            loss, _ = compute_loss(step, step.unet, latents, input_ids, generator, **batch_extras(step, extra))
            totals[0] += loss.double().sum()
            totals[1] += loss.numel()
    except Exception as failed:  # noqa: BLE001 - told to every rank at the all-reduce, then raised here
        if d.world_size == 1:
            raise
        error = failed
    finally:
        step.unet.train()
    totals[2], totals[3] = float(stop()), float(error is not None)
    loss_sum, n, stopping, failures = sd.distributed.all_reduce_sum(totals, d).tolist()
    if stopping:
        raise sd.distributed.Stopped
    if failures:  # every rank knows; the texts come in one more collective, which every rank joins
        told = sd.distributed.all_gather_objects(error and sd.distributed.failure_text(error, d.rank), d)
        sd.distributed.raise_failures(told, error)
    return loss_sum / n if n > 0 else float("nan")

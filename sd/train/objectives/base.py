"""The contract between a training step and its objective: what the step minimises.

A run trains by one objective (``sd.train.objectives.OBJECTIVES``: the first whose ``wanted(config)`` holds),
combined with any training mode (``sd.mode``): the mode says what trains, the objective what it is trained to
do. The step asks the objective, in its own module, at a few points:

* ``check(config, check_paths)`` (a class method, asked of every objective): its settings, and the settings it
  cannot train with, each a ``ConfigError`` naming the field and the way out;
* ``wanted(config)`` (a class method): whether the config asks for it;
* ``build(config, unet)`` -> the objective of a run, around its UNet as loaded (before a resume);
* ``batch_inputs`` / ``missing_inputs``: the tensors it reads at the end of a micro-batch, after the loss mask
  and before the mode's (reflow's noise; a preference objective's second image of each pair), and what a batch
  without them lacks;
* ``loss(context, model, latents, input_ids, generator, mask, inputs)`` -> per-sample loss ``(B,)`` and each
  sample's integer timestep ``(B,)`` (the per-quartile statistics); ``inputs``: the micro-batch's named tensors
  (its own ``batch_inputs`` and the mode's, which ``context.model_inputs`` turns into the model's call);
* ``reduce(loss, settings)`` -> the scalar a micro-batch minimises (the mean; with prior preservation the
  instance half's mean plus ``prior_loss_weight`` times the class half's);
* ``update(unet, step_index, skip, view)``: after each optimizer step (a target network's EMA);
* ``attach(d)``: the run's ranks, once the step is built (DMD's fake score averages its own gradients over them:
  it trains by an optimizer of its own, inside ``loss``, its state among its ``entries``);
* ``entries()``: its checkpoint entries by name (objects with ``state_dict`` / ``load_state_dict``);
  ``held_tensors()``: what it holds in memory besides the step's model (a memory estimate counts them, as
  ``held_as``); ``estimate_inputs(images, resolution)``: stand-ins of its ``batch_inputs`` for a memory estimate;
* ``statistics``: the names of what it measures per sample besides the loss (DPO's implicit reward accuracy),
  logged as means over a step's samples; ``measured(device)`` -> their sums over the training micro-batches
  since it was last asked, then the samples counted (a float64 tensor on the device, all-reduced with the
  step's own statistics; zeros where none were counted);
* ``what`` (a checkpoint's kind in messages, None: the mode's), ``uses_base`` (``init_from`` is its reference:
  loaded first, fingerprinted, checked on resume), ``describe(config)`` (its line in the log, or None).

A new objective is one module here (an ``Objective`` subclass, its config section beside it) and one line in
``OBJECTIVES`` (ARCHITECTURE.md, "Where to add", lists the other lines).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import sd.cli
import sd.model


@dataclass(frozen=True)
class LossSettings:
    """The config fields every objective's loss and the step's update read."""

    prediction_type: str = "epsilon"
    min_snr_gamma: float = 5.0
    loss_type: str = "l2"
    huber_schedule: str = "snr"
    huber_c: float = 0.1
    huber_scale: float = 1.0
    debiased_estimation: bool = False
    cfg_dropout: float = 0.05
    precision: str = "bf16"
    channels_last: bool = False
    grad_clip: float = 1.0
    noise_offset: float = 0.0
    prior_loss_weight: float = 1.0
    prior_preservation: bool = False  # every micro-batch: instance samples, then as many class samples

    @classmethod
    def from_config(cls, config) -> "LossSettings":
        return sd.cli.view_of(cls, config, prior_preservation=bool(config.subject.class_dir))


@dataclass(frozen=True)
class LossContext:
    """The pieces of a step that an objective's loss reads: never the optimizer, the EMA or the data."""

    device: torch.device
    settings: LossSettings
    scaling_factor: float
    alphas_cumprod: torch.Tensor
    unet: torch.nn.Module  # the plain module (what the loss's ``model`` wraps)
    empty_embedding: torch.Tensor  # (1, 77, D)
    # (input_ids, generator or None) -> the UNet's context; with a generator, CFG dropout drawn from it
    prompts: Callable[[torch.Tensor, torch.Generator | None], torch.Tensor]
    # (the micro-batch's named tensors, device, generator) -> the UNet's extra keyword arguments (the mode's)
    model_inputs: Callable[[dict, torch.device, torch.Generator], dict]


class Objective:
    """What every objective shares (override what differs); see the module's docstring for the contract."""

    what: str | None = None
    uses_base = False
    starts_from_base = ""  # uses_base, a whole-UNet run's first start: the log's line on where it starts
    batch_unit = "images"  # what batch_size counts, in messages
    batch_inputs: tuple[str, ...] = ()
    missing_inputs = ""
    statistics: tuple[str, ...] = ()
    held_as = "distillation"  # what held_tensors are, in a memory estimate's breakdown

    @classmethod
    def wanted(cls, config) -> bool:
        return False

    @classmethod
    def check(cls, config, check_paths: bool = True) -> None:
        pass

    @classmethod
    def build(cls, config, unet) -> "Objective":
        return cls()

    def loss(self, context: LossContext, model, latents, input_ids, generator, mask, inputs: dict):
        raise NotImplementedError

    def mode_inputs(self, inputs: dict) -> dict:
        """The micro-batch's tensors that are the mode's (``inputs`` less this objective's own)."""
        return {name: tensor for name, tensor in inputs.items() if name not in self.batch_inputs}

    def reduce(self, loss: torch.Tensor, settings: LossSettings) -> torch.Tensor:
        """The mean per-sample loss, or with prior preservation the instance half's mean plus
        ``prior_loss_weight`` times the class half's mean (``sd.data.dreambooth``'s micro-batches)."""
        if not settings.prior_preservation:
            return loss.mean()
        instance, prior = loss.chunk(2)
        return instance.mean() + settings.prior_loss_weight * prior.mean()

    def attach(self, d) -> None:
        """Told the run's ranks (``sd.distributed.Dist``) once the step is built: an objective that trains a network
        of its own averages its gradients over them."""

    def update(self, unet, step_index: int, skip: torch.Tensor | None = None, view=None) -> None:
        pass

    def entries(self) -> dict:
        return {}

    def held_tensors(self) -> list:
        return []

    def estimate_inputs(self, images: int, resolution: int) -> tuple:
        return ()

    def measured(self, device) -> torch.Tensor:
        return torch.zeros(len(self.statistics) + 1 if self.statistics else 0, dtype=torch.float64, device=device)

    def describe(self, config) -> str | None:
        return None


def scaled_latents(context: LossContext, latents: torch.Tensor) -> torch.Tensor:
    """A micro-batch's stored latents on the device, scaled for the UNet (``(B, 4, h, w)`` float32)."""
    latents = sd.model.scale_latents(latents.to(context.device, non_blocking=True).float(), context.scaling_factor)
    if context.settings.channels_last:
        latents = latents.contiguous(memory_format=torch.channels_last)
    return latents

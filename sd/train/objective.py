"""What an objective reads of a training step: its loss settings and the pieces of the step a loss uses.

An objective (``sd.train.step.Diffusion``, ``sd.train.distill.Distiller``) is asked for the loss of a
micro-batch with a ``LossContext``: the device, the settings, the noise schedule, the plain UNet (a
distillation's teacher and target call it), the empty prompt's embedding, the prompts' embeddings and the
mode's model inputs. It never sees the optimizer, the EMA or the data, so an objective combines with any
mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import sd.cli


@dataclass(frozen=True)
class LossSettings:
    """The config fields the loss and the update read."""

    prediction_type: str = "epsilon"
    flow_matching: bool = False  # an epsilon or v model trained as a flow (sd.flow's bridge)
    flow_density: str = "logit_normal"
    flow_logit_mean: float = 0.0
    flow_logit_std: float = 1.0
    flow_shift: float = 1.0
    reflow: bool = False  # a batch carries each latent's noise (sd.data.training_data's reflow pairs)
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

    @property
    def flow(self) -> bool:
        return self.prediction_type == "flow" or self.flow_matching

    @classmethod
    def from_config(cls, config) -> "LossSettings":
        return sd.cli.view_of(cls, config, prior_preservation=bool(getattr(config, "class_dir", "")))


@dataclass(frozen=True)
class LossContext:
    """The pieces of a step that an objective's loss reads."""

    device: torch.device
    settings: LossSettings
    scaling_factor: float
    alphas_cumprod: torch.Tensor
    unet: torch.nn.Module  # the plain module (what the loss's ``model`` wraps)
    empty_embedding: torch.Tensor  # (1, 77, D)
    # (input_ids, generator or None) -> the UNet's context; with a generator, CFG dropout drawn from it
    prompts: Callable[[torch.Tensor, torch.Generator | None], torch.Tensor]
    # (the mode's micro-batch tensors, device, generator) -> the UNet's extra keyword arguments
    model_inputs: Callable[[dict, torch.device, torch.Generator], dict]

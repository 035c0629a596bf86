"""The objective of an epsilon or v-prediction diffusion model: the weighted error of its prediction of the
noise (or of v) on latents noised at timesteps drawn uniformly (``sd.model.diffusion_loss``: Min-SNR, the
loss types, debiased estimation); the noise offset shifts each sample's noise per channel."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import sd.model
import sd.runtime
from sd.train.objectives.base import LossContext, Objective, scaled_latents
from sd.settings import setting, refused, Range, POSITIVE, NON_NEGATIVE, MATH
from sd.cli import ConfigError


@dataclass(frozen=True)
class LossConfig:
    """The diffusion loss: its kind (L2, Huber), weighting and noise offset."""

    noise_offset: float = setting("add noise_offset * N(0, 1) per sample and channel to the training noise (lets "
                                  "the model learn very dark and very bright images); 0 = off", 0.0,
                                  allowed=NON_NEGATIVE, resume=refused(MATH))
    type: str = setting("the loss of each latent element: l2 (squared error), l1, huber (pseudo-Huber: about "
                        "l2 for small errors, linear for large ones) or smooth_l1 (the same without the factor c), "
                        "as kohya's sd-scripts --loss_type", "l2", resume=refused(MATH))
    huber_schedule: str = setting("huber and smooth_l1: how c follows the timestep: snr (near 1 at low noise, "
                                  "huber_c at high noise), exponential (huber_scale at t=0 to huber_c x huber_scale at "
                                  "t=1000) or constant (huber_c x huber_scale)", "snr", resume=refused(MATH))
    huber_c: float = setting("huber and smooth_l1: the c of the schedule", 0.1, allowed=Range(0, 1, low_open=True),
                             resume=refused(MATH))
    huber_scale: float = setting("huber and smooth_l1: the scale of the exponential and constant schedules", 1.0,
                                 allowed=POSITIVE, resume=refused(MATH))
    debiased_estimation: bool = setting("weight each sample's loss by 1/sqrt(SNR) (1/(SNR+1) predicting v), debiased "
                                        "estimation as kohya's sd-scripts applies it, after Min-SNR", False,
                                        resume=refused(MATH))

    def check(self, config, check_paths: bool = True) -> None:
        if self.type not in sd.model.LOSS_TYPES:
            raise ConfigError(f"loss.type: one of {', '.join(sd.model.LOSS_TYPES)}")
        if self.huber_schedule not in sd.model.HUBER_SCHEDULES:
            raise ConfigError(f"loss.huber_schedule: one of {', '.join(sd.model.HUBER_SCHEDULES)}")

def drawn_noise(context: LossContext, latents: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Unit noise the shape of ``latents``, plus ``noise_offset`` times a per-sample, per-channel shift (the mean
    brightness becomes learnable), both drawn from ``generator`` in that order."""
    noise = torch.randn(latents.shape, generator=generator, device=context.device)
    offset = context.settings.noise_offset
    if offset:
        noise = noise + offset * torch.randn((*latents.shape[:2], 1, 1), generator=generator, device=context.device)
    return noise


class Diffusion(Objective):
    """Epsilon or v-prediction training (the default objective)."""

    @classmethod
    def wanted(cls, config) -> bool:
        return True

    def loss(self, context: LossContext, model, latents, input_ids, generator, mask, inputs: dict):
        """Draws the noise (and its offset), the timesteps, the mode's random inputs (a blank control image) and
        the CFG dropout from ``generator``, in that order."""
        settings, device, alphas = context.settings, context.device, context.alphas_cumprod
        latents = scaled_latents(context, latents)
        noise = drawn_noise(context, latents, generator)
        timesteps = sd.model.sample_timesteps(latents.shape[0], generator).to(device)
        noisy = sd.model.add_noise(latents, noise, timesteps, alphas)
        target = sd.model.prediction_target(latents, noise, timesteps, alphas, settings.prediction_type)
        inputs = self.mode_inputs(inputs)
        conditioning = context.model_inputs(inputs, device, generator) if inputs else {}
        with sd.runtime.autocast(settings.precision, device):
            hidden = context.prompts(input_ids, generator)
            pred = model(noisy, timesteps, encoder_hidden_states=hidden, **conditioning).sample
        if mask is not None:
            mask = mask.to(device, non_blocking=True)
        huber_c = None
        if settings.loss_type in ("huber", "smooth_l1"):
            huber_c = sd.model.huber_thresholds(timesteps, alphas, settings.huber_schedule, settings.huber_c,
                                                settings.huber_scale)
        loss = sd.model.diffusion_loss(pred, target, timesteps, alphas, settings.prediction_type,
                                       settings.min_snr_gamma, mask, settings.loss_type, huber_c,
                                       settings.debiased_estimation)
        return loss, timesteps

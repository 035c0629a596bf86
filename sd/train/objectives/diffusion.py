"""The objective of an epsilon or v-prediction diffusion model: the weighted error of its prediction of the
noise (or of v) on latents noised at timesteps drawn uniformly (``sd.model.diffusion_loss``: Min-SNR, the
loss types, debiased estimation); the noise offset shifts each sample's noise per channel."""

from __future__ import annotations

import torch

import sd.model
import sd.runtime
from sd.train.objectives.base import LossContext, Objective, scaled_latents


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

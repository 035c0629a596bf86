"""Flow matching (``sd.flow``): the velocity ``noise - latents`` of the straight path between them, learned at
sigmas drawn by ``flow_density`` and ``flow_shift``, unweighted. A ``prediction_type: flow`` UNet is given the
point on the path and ``sigma * 1000``; an epsilon or v UNet trained as a flow (``flow_matching``) its DDPM
point and continuous timestep through the diff2flow bridge, its output turned into the velocity. ``Reflow``
trains on SD_Reflow.py's pairs: each latent with the noise a flow model's ODE drew it from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import sd.flow
import sd.model
import sd.runtime
import sd.sampling
from sd.cli import ConfigError
from sd.train.objectives.base import LossContext, Objective, scaled_latents
from sd.train.objectives.diffusion import drawn_noise
from sd.settings import setting, refused, Range, MATH

SHAPING = ("density", "logit_mean", "logit_std", "shift")  # what shapes the training sigmas


@dataclass(frozen=True)
class FlowConfig:
    """Flow matching: an epsilon or v model trained as a flow, reflow, and the training sigmas."""

    matching: bool = setting("train an epsilon or v_prediction model (init_from) as a flow through the diff2flow "
                             "mapping: the first step starts from all it knows, and its files stay epsilon or v "
                             "models; sampled with flow_euler by default", False, resume=refused(MATH))
    reflow: bool = setting("a flow model (prediction_type: flow, or flow_matching: true): train on the (noise, image) "
                           "pairs of SD_Reflow.py (each latent with "
                           "the noise it was drawn from: its folder's NNNNN.noise.npy) instead of fresh noise, which "
                           "straightens the model's paths for 1-2 step sampling", False, resume=refused(MATH))
    density: str = setting("flow: how the training sigmas (noise fractions) are drawn: logit_normal "
                           "(sigmoid of N(flow_logit_mean, flow_logit_std), SD3's) or uniform", "logit_normal",
                           resume=refused(MATH))
    logit_mean: float = setting("flow, logit_normal: the mean (below 0: more training at low noise)", 0.0,
                                allowed=Range(-10, 10, high_open=False), resume=refused(MATH))
    logit_std: float = setting("flow, logit_normal: the standard deviation", 1.0, allowed=Range(0, 10, low_open=True,
                               high_open=False),
                               resume=refused(MATH))
    shift: float = setting("flow: SD3's time shift of the training sigmas, shift s / (1 + (shift - 1) s) (above 1: "
                           "more at high noise), and the flow samplers' default; recorded in the files", 1.0,
                           allowed=Range(*sd.flow.SHIFT_RANGE, high_open=False), resume=refused(MATH))


@dataclass(frozen=True)
class FlowSettings:
    """The config fields of a flow's training sigmas."""

    density: str = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float = 1.0

    @classmethod
    def from_config(cls, config) -> "FlowSettings":
        flow = config.flow
        return cls(flow.density, flow.logit_mean, flow.logit_std, flow.shift)


def is_flow(config) -> bool:
    """Trained as a flow: a flow model, or an epsilon or v model through the diff2flow bridge."""
    return config.prediction_type == "flow" or config.flow.matching


class Flow(Objective):
    """A flow model, or an epsilon or v model trained as one through the bridge."""

    def __init__(self, settings: FlowSettings = FlowSettings()):
        self.settings = settings

    @classmethod
    def wanted(cls, config) -> bool:
        return is_flow(config)

    @classmethod
    def build(cls, config, unet) -> "Flow":
        return cls(FlowSettings.from_config(config))

    @classmethod
    def check(cls, config, check_paths: bool = True) -> None:
        """Flow matching's settings, and the settings of the other objectives it cannot take."""
        flow = config.flow
        if flow.density not in sd.flow.DENSITIES:
            raise ConfigError(f"flow.density: one of {', '.join(sd.flow.DENSITIES)}, got {flow.density!r}")
        if not is_flow(config):
            default = FlowConfig()
            changed = [f"flow.{name}" for name in SHAPING if getattr(flow, name) != getattr(default, name)]
            if changed:
                raise ConfigError(f"{', '.join(changed)} shape{'s' if len(changed) == 1 else ''} flow matching's "
                                  "training: set prediction_type: flow or flow.matching: true, or leave them at "
                                  "their defaults")
            return
        if config.flow.matching and config.prediction_type == "flow":
            raise ConfigError("flow.matching trains an epsilon or v_prediction model as a flow; a prediction_type: "
                              "flow model is one already: set flow.matching: false")
        what = "prediction_type: flow" if config.prediction_type == "flow" else "flow.matching"
        refused = [(config.zero_terminal_snr, "zero_terminal_snr", "a flow's path reaches pure noise by itself"
                    if config.prediction_type == "flow" else "the bridge needs a finite log-SNR at every timestep"),
                   (config.min_snr_gamma != 0, "min_snr_gamma", "Min-SNR weights the epsilon and v losses; set "
                    "min_snr_gamma: 0"),
                   (config.loss.debiased_estimation, "loss.debiased_estimation",
                    "its weights are the epsilon and v losses'"),
                   (config.loss.type in ("huber", "smooth_l1") and config.loss.huber_schedule == "snr",
                    "loss.huber_schedule: snr", "its thresholds follow the DDPM schedule; use constant or exponential"),
                   (config.distill.method == "lcm", "distill.method: lcm", "consistency distillation samples a DDPM teacher"),
                   (bool(config.controlnet.control), "controlnet.control", "a ControlNet trains beside an epsilon or v model")]
        for bad, name, why in refused:
            if bad:
                raise ConfigError(f"{what} does not train with {name}: {why}")
        if config.prediction_type == "flow" and config.sampler not in sd.sampling.FLOW_SAMPLERS + sd.sampling.ANY_MODEL:
            raise ConfigError(f"validation.sampler {config.validation.sampler}: a flow model is sampled with "
                              f"{' or '.join(sd.sampling.FLOW_SAMPLERS)} (or auto)")

    def loss(self, context: LossContext, model, latents, input_ids, generator, mask, inputs: dict):
        """Draws the noise (and its offset), the sigmas, the mode's random inputs and the CFG dropout from
        ``generator``, in that order."""
        latents = scaled_latents(context, latents)
        return self.path_loss(context, model, latents, self.noise(context, latents, generator, inputs), input_ids,
                              generator, mask, self.mode_inputs(inputs))

    def noise(self, context: LossContext, latents: torch.Tensor, generator, inputs: dict) -> torch.Tensor:
        return drawn_noise(context, latents, generator)

    def path_loss(self, context: LossContext, model, latents, noise, input_ids, generator, mask, inputs: dict):
        """The squared error (or ``loss_type``'s) of the velocity ``noise - latents`` at the drawn sigmas, with no
        per-sample weight: the loss ``(B,)`` and the nearest integer time ``(B,)`` of each sample."""
        settings, flow, device = context.settings, self.settings, context.device
        sigmas = sd.flow.sample_sigmas(latents.shape[0], generator, flow.density, flow.logit_mean, flow.logit_std,
                                       flow.shift).to(device)
        bridged = settings.prediction_type != "flow"
        if bridged:
            sigmas = sd.flow.clamped(sigmas, context.alphas_cumprod)
        noisy = sd.flow.noised(latents, noise, sigmas)
        if bridged:
            noisy, timesteps = sd.flow.bridge_inputs(noisy, sigmas, context.alphas_cumprod)
        else:
            timesteps = sd.flow.model_timesteps(sigmas)
        conditioning = context.model_inputs(inputs, device, generator) if inputs else {}
        with sd.runtime.autocast(settings.precision, device):
            hidden = context.prompts(input_ids, generator)
            pred = model(noisy, timesteps, encoder_hidden_states=hidden, **conditioning).sample
        if bridged:
            pred = sd.flow.bridge_velocity(pred, noisy, sigmas, settings.prediction_type)
        step_times = (sigmas * sd.model.NUM_TRAIN_TIMESTEPS).long().clamp(0, sd.model.NUM_TRAIN_TIMESTEPS - 1)
        huber_c = None
        if settings.loss_type in ("huber", "smooth_l1"):  # constant or exponential (check), by sigma * 1000
            huber_c = sd.model.huber_thresholds(step_times, context.alphas_cumprod, settings.huber_schedule,
                                                settings.huber_c, settings.huber_scale)
        loss = sd.model.elementwise_loss(pred, sd.flow.velocity(latents, noise), settings.loss_type, huber_c)
        if mask is not None:
            loss = loss * mask.to(device, non_blocking=True).to(dtype=torch.float32)
        return loss.mean(dim=tuple(range(1, loss.ndim))), step_times


class Reflow(Flow):
    """Reflow (Liu et al. 2022; InstaFlow's 2-rectified flow): the flow loss on SD_Reflow.py's (noise, image)
    pairs, each latent with its own noise, which straightens the model's paths for 1-2 step sampling."""

    batch_inputs = ("noise",)  # (B, 4, h, w) float16: the noise each latent was drawn from
    missing_inputs = "each latent's noise (MixedData loaded with noise)"

    @classmethod
    def wanted(cls, config) -> bool:
        return bool(config.flow.reflow)

    @classmethod
    def check(cls, config, check_paths: bool = True) -> None:
        if not config.flow.reflow:
            return
        refused = [(not is_flow(config), "a flow model, prediction_type: flow or flow.matching: true (the pairs are "
                                          "a flow model's)"),
                   (config.data.flip, "data.flip: false (a pair is one image and its noise)"),
                   (config.loss.noise_offset != 0, "loss.noise_offset: 0 (the noise is the pair's)"),
                   (bool(config.subject.instance_dir), "no subject.instance_dir (the pairs are SD_Reflow.py's latent folders)")]
        for bad, need in refused:
            if bad:
                raise ConfigError(f"flow.reflow needs {need}")

    def noise(self, context: LossContext, latents: torch.Tensor, generator, inputs: dict) -> torch.Tensor:
        return inputs["noise"].to(context.device, non_blocking=True).float()

    def estimate_inputs(self, images: int, resolution: int) -> tuple:
        return (torch.zeros(images, 4, resolution // 8, resolution // 8, dtype=torch.float16),)

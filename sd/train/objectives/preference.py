"""Diffusion-DPO (``preference.method: dpo``), an objective: a trained model tuned towards the preferred image of
each pair of a prompt and away from the rejected one, against a frozen reference.

Diffusion-DPO (Wallace et al. 2023, "Diffusion Model Alignment Using Direct Preference Optimization",
arXiv:2311.12908). A micro-batch holds B pairs: the preferred latents ``x_w`` (the data's latents) and the
rejected ``x_l`` (``rejected``, the same rows of ``NNNNN.rejected.npy``), one prompt per pair. Both images of a
pair are noised with the same noise at the same timestep, and the model (what trains) and the reference (the
frozen base) predict the noise (or v) of all 2B. With ``e(x) = |pred - target|^2`` averaged over each image:

    logits = (e_ref(x_w) - e_ref(x_l)) - (e(x_w) - e(x_l))
    loss   = -log sigmoid(beta * logits)         (sigmoid; the paper's loss, its beta T / 2 folded into beta)
             relu(1 - beta * logits)              (hinge)
             (logits - 1 / (2 beta))^2            (ipo)

per pair, averaged over the pairs: the model's error on the preferred image falls relative to the rejected one,
as measured against where the reference stood. ``beta`` 2500 is diffusers' default for SD 1.5
(``train_diffusion_dpo.py``: ``-logsigmoid(beta_dpo * (ref_diff - model_diff))``), which is the authors' 5000 with
their factor 1/2. The implicit reward of a pair is ``beta * logits``: its accuracy (above 0: the model prefers
the preferred image more than the reference did; 0 counts half) and mean (the margin) are logged per step.

The reference: with an adapter (LoRA, LoHa, LoKr, DoRA) the same UNet with its adapters switched off, so no
second copy is held; a whole-UNet run keeps a frozen copy of the base in the autocast type (a memory estimate
counts it). A step runs the UNet on 2B images twice: with gradients (the model) and without (the reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import sd.lora.adapters
import sd.model
import sd.runtime
from sd.cli import ConfigError
from sd.settings import MATH, POSITIVE, refused, setting
from sd.train.objectives.base import LossContext, Objective, scaled_latents
from sd.train.objectives.diffusion import drawn_noise
from sd.train.objectives.lcm import adapters_off, frozen_copy

METHODS = ("", "dpo")
LOSSES = ("sigmoid", "hinge", "ipo")
DEFAULT_BETA = 2500.0


@dataclass(frozen=True)
class PreferenceConfig:
    """Preference tuning of init_from (the reference) on pairs of a preferred and a rejected image: Diffusion-DPO."""

    method: str = setting("dpo: Diffusion-DPO on preference pairs (a latent folder encoded with encode_latents.py "
                          "--pairs), of the whole UNet or of an adapter (lora.rank), against init_from as the frozen "
                          "reference; batch_size counts pairs; empty = the usual diffusion loss", "",
                          resume=refused(MATH))
    beta: float = setting("dpo: how strongly the model is held to the reference (larger: closer); 2500 for SD 1.5 "
                          "(diffusers' default, the paper's 5000 with its factor 1/2)", DEFAULT_BETA,
                          allowed=POSITIVE, resume=refused(MATH))
    loss: str = setting("dpo: sigmoid (the paper's -log sigmoid), hinge or ipo, as diffusers' --loss_type", "sigmoid",
                        resume=refused(MATH))


@dataclass(frozen=True)
class PreferenceSettings:
    """The config fields of a DPO step."""

    beta: float = DEFAULT_BETA
    loss: str = "sigmoid"

    @classmethod
    def from_config(cls, config) -> "PreferenceSettings":
        return cls(config.preference.beta, config.preference.loss)


def pair_loss(logits: torch.Tensor, beta: float, kind: str = "sigmoid") -> torch.Tensor:
    """Each pair's loss ``(B,)`` from its ``logits`` ``(B,)`` (the reference's error difference minus the model's)."""
    if kind == "sigmoid":
        return -torch.nn.functional.logsigmoid(beta * logits)
    if kind == "hinge":
        return torch.relu(1 - beta * logits)
    if kind == "ipo":
        return (logits - 1 / (2 * beta)).square()
    raise ValueError(f"preference.loss must be one of {LOSSES}, got {kind!r}")


def image_errors(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean squared error of each image ``(N,)``, in float32."""
    return (prediction.float() - target.float()).square().flatten(1).mean(1)


def preference_logits(model_errors: torch.Tensor, reference_errors: torch.Tensor) -> torch.Tensor:
    """``(B,)`` logits of B pairs from the errors ``(2B,)`` of the preferred images, then the rejected ones."""
    model_w, model_l = model_errors.chunk(2)
    reference_w, reference_l = reference_errors.chunk(2)
    return (reference_w - reference_l) - (model_w - model_l)


def implicit_accuracy(logits: torch.Tensor) -> torch.Tensor:
    """Per pair: 1 where the implicit reward prefers the preferred image, 0.5 at a tie, else 0."""
    return (logits > 0).float() + 0.5 * (logits == 0).float()


class DirectPreference(Objective):
    """Diffusion-DPO against the frozen base: ``reference`` is its frozen copy (a whole-UNet run), or None: the
    trained UNet with its adapters switched off."""

    uses_base = True  # init_from is the reference: loaded first, fingerprinted, checked on resume
    starts_from_base = ("Diffusion-DPO: the model starts as its reference, init_from (its EMA where it has one); "
                        "the EMA starts from it too")
    batch_inputs = ("rejected",)  # (B, 4, h, w) float16: each pair's rejected latents
    missing_inputs = "each pair's rejected latents (a latent folder encoded with encode_latents.py --pairs)"
    statistics = ("reward_accuracy", "reward_margin", "model_mse", "reference_mse")
    held_as = "reference"
    batch_unit = "pairs"  # batch_size counts pairs: twice the images go through the UNet, with and without gradients

    def __init__(self, settings: PreferenceSettings, reference=None):
        self.settings = settings
        self.reference = reference
        self.tally: torch.Tensor | None = None  # the sums of ``statistics`` and the pairs counted, on the device

    @classmethod
    def wanted(cls, config) -> bool:
        return config.preference.method == "dpo"

    @classmethod
    def check(cls, config, check_paths: bool = True) -> None:
        """DPO's settings, and what it does not train with."""
        preference = config.preference
        if preference.method not in METHODS:
            raise ConfigError(f"preference.method: dpo, or empty for the usual diffusion loss; got {preference.method!r}")
        if preference.loss not in LOSSES:
            raise ConfigError(f"preference.loss: one of {', '.join(LOSSES)}, got {preference.loss!r}")
        if not preference.method:
            return
        if check_paths and not config.init_from:
            raise ConfigError("preference.method: dpo tunes a trained model against itself: set init_from (the "
                              "reference: a run of ours, a diffusers folder or hub id, or a single file)")
        refused_settings = [
            (config.prediction_type == "flow" or config.flow.matching, "prediction_type: flow / flow.matching",
             "DPO here compares epsilon or v errors"),
            (bool(config.distill.method), "distill.method", "a distillation is an objective of its own"),
            (config.min_snr_gamma != 0, f"min_snr_gamma {config.min_snr_gamma:g}",
             "the DPO loss weighs every timestep alike; set min_snr_gamma: 0"),
            (config.loss.type != "l2" or config.loss.debiased_estimation, "loss.type / loss.debiased_estimation",
             "its errors are squared errors; set loss.type: l2 and loss.debiased_estimation: false"),
            (config.data.flip, "data.flip", "a pair's two latents are stored unmirrored; set data.flip: false"),
            (config.data.masked_loss, "data.masked_loss", "a loss mask is one image's, a pair has two"),
            (bool(config.subject.instance_dir), "subject.instance_dir", "DreamBooth folders hold no pairs"),
            (bool(config.embedding.token), "embedding.token", "the reference's prompts must be the model's"),
            (config.lora.text_encoder, "lora.text_encoder", "the reference's prompts must be the model's"),
            (bool(config.controlnet.control), "controlnet.control", "a ControlNet trains beside the UNet"),
            (config.sharding != "none", f"sharding: {config.sharding}",
             "it runs on DDP; set sharding: none"),
        ]
        for bad, name, why in refused_settings:
            if bad:
                raise ConfigError(f"preference.method: dpo does not train with {name}: {why}")

    @classmethod
    def build(cls, config, unet) -> "DirectPreference":
        """For a run's UNet as loaded from ``init_from``, its adapters attached (before its weights are resumed)."""
        settings = PreferenceSettings.from_config(config)
        if sd.lora.adapters.has_lora(unet):
            return cls(settings)
        return cls(settings, frozen_copy(unet, sd.runtime.dtype_of(config.precision)))

    def reference_output(self, unet, noisy, timesteps, hidden):
        """The reference's prediction (no gradients)."""
        if self.reference is not None:
            return self.reference(noisy, timesteps, encoder_hidden_states=hidden).sample
        with adapters_off(unet):
            return unet(noisy, timesteps, encoder_hidden_states=hidden).sample

    def loss(self, context: LossContext, model, latents, input_ids, generator, mask, inputs: dict):
        """Each pair's DPO loss ``(B,)`` and timestep ``(B,)``. Draws from ``generator``, in order: one noise per
        pair (and its offset), one timestep per pair, and the CFG dropout (per pair: both images share the prompt)."""
        settings, device, alphas = context.settings, context.device, context.alphas_cumprod
        preferred = scaled_latents(context, latents)
        rejected = scaled_latents(context, inputs["rejected"])
        noise = drawn_noise(context, preferred, generator).repeat(2, 1, 1, 1)
        timesteps = sd.model.sample_timesteps(preferred.shape[0], generator).to(device)
        both, timesteps2 = torch.cat([preferred, rejected]), timesteps.repeat(2)
        noisy = sd.model.add_noise(both, noise, timesteps2, alphas)
        target = sd.model.prediction_target(both, noise, timesteps2, alphas, settings.prediction_type)
        with sd.runtime.autocast(settings.precision, device):
            hidden = context.prompts(input_ids, generator).repeat(2, 1, 1)
            prediction = model(noisy, timesteps2, encoder_hidden_states=hidden).sample
            with torch.no_grad():
                reference = self.reference_output(context.unet, noisy, timesteps2, hidden)
        model_errors, reference_errors = image_errors(prediction, target), image_errors(reference, target)
        logits = preference_logits(model_errors, reference_errors)
        if torch.is_grad_enabled():  # a training micro-batch (not a validation loss)
            self.count(logits.detach(), model_errors.detach(), reference_errors.detach())
        return pair_loss(logits, self.settings.beta, self.settings.loss), timesteps

    def count(self, logits, model_errors, reference_errors) -> None:
        """Add a micro-batch's pairs to the step's statistics (on the device: nothing is read to the host)."""
        sums = torch.stack([implicit_accuracy(logits).sum(), (self.settings.beta * logits).sum(),
                            0.5 * model_errors.sum(), 0.5 * reference_errors.sum(),
                            torch.ones_like(logits).sum()]).double()
        self.tally = sums if self.tally is None else self.tally + sums

    def measured(self, device) -> torch.Tensor:
        tally, self.tally = self.tally, None
        return tally if tally is not None else torch.zeros(len(self.statistics) + 1, dtype=torch.float64,
                                                           device=device)

    def estimate_inputs(self, images: int, resolution: int) -> tuple:
        return (torch.zeros(images, 4, resolution // 8, resolution // 8, dtype=torch.float16),)

    def held_tensors(self) -> list:
        """The whole-UNet run's frozen reference copy (none with an adapter)."""
        return [*self.reference.parameters(), *self.reference.buffers()] if self.reference is not None else []

    def describe(self, config) -> str:
        return (f"preference: Diffusion-DPO, beta {self.settings.beta:g}, {self.settings.loss} loss, against "
                f"{config.init_from} ({'a frozen copy' if self.reference is not None else 'the base, adapters off'})")

"""Distribution matching distillation (``distill.method: dmd``), an objective: a trained model (the teacher)
distilled into a generator that draws an image in one step (or 2-4), from prompts alone.

DMD2 (Yin et al. 2024, "Improved Distribution Matching Distillation for Fast Image Synthesis",
arXiv:2405.14867; the authors' code: github.com/tianweiy/DMD2, ``main/sd_guidance.py``). Three networks:

- the **generator** G (what trains: the UNet with an adapter, or the whole UNet, starting as the teacher): from
  pure noise at the timestep 999 (or, with ``dmd.steps`` > 1, from its own earlier step's image noised again,
  DMD2's backward simulation) it predicts the clean latents ``x0 = G(x_t, t)`` in the teacher's parametrisation;
- the **real score**: the frozen teacher, with classifier-free guidance ``dmd.guidance`` folded in;
- the **fake score**: a diffusion model of the generator's own images, starting as the teacher and trained on
  them with the teacher's own loss, ``dmd.fake_updates`` times per generator update (the two-time-scale rule).

The generator's loss: its image ``x0`` is noised at a timestep drawn in ``[min_step, max_step]``; both scores
predict the clean latents there (``x0_real``, ``x0_fake``, without gradients); the distribution-matching gradient
``g = (x0_fake - x0_real) / mean|x0 - x0_real|`` (per image, as DMD2 normalises it) is applied to ``x0`` through
the loss ``0.5 * mean((x0 - sg(x0 - g))^2)``, whose gradient is ``g`` (scaled by the mean). With
``dmd.gan_weight`` > 0, a critic (a small head on the fake score's middle-block features, DMD2's
``cls_pred_branch``) tells the training data's latents from the generator's: the generator adds
``gan_weight * softplus(-logit)`` and the fake score's update ``critic_weight * (softplus(logit_fake) +
softplus(-logit_real))``. With 0 the distillation is data-free: only the prompts (and the latents' size) are read.

One card: with an adapter (LoRA, LoHa, LoKr, DoRA) the teacher is the UNet with its adapters off, and the fake
score is the same UNet with a second set of adapter weights put in the generator's place for its passes
(``torch.func.functional_call``): one UNet and two adapters in memory. A whole-UNet generator keeps a frozen
teacher copy in the autocast type and the fake score as a full set of float32 weights with its own optimizer.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import sd.distributed
import sd.flow
import sd.lora.adapters
import sd.model
import sd.runtime
import sd.sampling
from sd.cli import ConfigError
from sd.settings import MATH, NON_NEGATIVE, POSITIVE, Range, refused, setting
from sd.train.objectives.base import LossContext, Objective, scaled_latents
from sd.train.objectives.lcm import adapters_off, frozen_copy

MAX_STEPS = sd.sampling.ONESTEP_MAX


@dataclass(frozen=True)
class DMDConfig:
    """Distribution matching distillation (distill.method: dmd) of init_from into a 1-4 step generator (DMD2)."""

    steps: int = setting("dmd: the generator's steps (1: one step from noise; 2-4 with DMD2's backward simulation, "
                         "sampled at 999, 749, 499, 249 for 4); SD_ImageGen.py --sampler onestep draws this many",
                         1, allowed=Range(1, MAX_STEPS, high_open=False), resume=refused(MATH))
    guidance: float = setting("dmd: the classifier-free guidance folded into the real score (the teacher); 1.75 as "
                              "DMD2 for SD 1.5", 1.75, allowed=Range(1, 30, high_open=False), resume=refused(MATH))
    fake_updates: int = setting("dmd: fake-score updates per generator update, each on new noise for a micro-batch's "
                                "prompts (the two-time-scale rule; DMD2 uses 10 for SD 1.5)", 10,
                                allowed=Range(1, 100, high_open=False), resume=refused(MATH))
    fake_lr: float = setting("dmd: the fake score's learning rate (constant); 0 = lr", 0.0, allowed=NON_NEGATIVE,
                             resume=refused(MATH))
    gan_weight: float = setting("dmd: the weight of the generator's GAN term from a critic on the fake score's "
                                "features, trained against the data's latents (DMD2: 1e-3); 0 = data-free, only the "
                                "prompts are read", 0.0, allowed=NON_NEGATIVE, resume=refused(MATH))
    critic_weight: float = setting("dmd: the weight of the critic's loss in the fake score's update, with gan_weight "
                                   "(DMD2: 1e-2)", 0.01, allowed=POSITIVE, resume=refused(MATH))
    min_step: int = setting("dmd: the lowest timestep the distribution-matching loss noises the generator's image "
                            "at (DMD2: 2% of 1000)", 20, allowed=Range(0, 999, high_open=False), resume=refused(MATH))
    max_step: int = setting("dmd: the highest such timestep (DMD2: 98%)", 980, allowed=Range(0, 999, high_open=False),
                            resume=refused(MATH))


@dataclass(frozen=True)
class DMDSettings:
    """The config fields of a DMD step."""

    steps: int = 1
    guidance: float = 1.75
    fake_updates: int = 10
    fake_lr: float = 1e-5
    gan_weight: float = 0.0
    critic_weight: float = 0.01
    min_step: int = 20
    max_step: int = 980
    grad_clip: float = 1.0
    seed: int = 0  # the critic's initialisation

    @classmethod
    def from_config(cls, config) -> "DMDSettings":
        dmd = config.dmd
        return cls(dmd.steps, dmd.guidance, dmd.fake_updates, dmd.fake_lr or config.lr, dmd.gan_weight,
                   dmd.critic_weight, dmd.min_step, dmd.max_step, config.grad_clip, config.seed)


# ---------------------------------------------------------------------------------------------
# Pure pieces
# ---------------------------------------------------------------------------------------------


class Path:
    """The teacher's noising path and parametrisation at integer timesteps ``t`` in 0..999: the DDPM schedule
    (epsilon or v), or a flow model's straight path at ``sigma = (t + 1) / 1000`` (velocity ``eps - x0``)."""

    def __init__(self, alphas_cumprod: torch.Tensor, prediction_type: str):
        self.alphas, self.prediction_type = alphas_cumprod, prediction_type
        self.flow = prediction_type == "flow"

    def sigmas(self, t: torch.Tensor) -> torch.Tensor:
        return (t.float() + 1) / sd.model.NUM_TRAIN_TIMESTEPS

    def noised(self, x0, noise, t):
        return sd.flow.noised(x0, noise, self.sigmas(t)) if self.flow else sd.model.add_noise(x0, noise, t, self.alphas)

    def clean(self, output, x_t, t):
        """The clean latents a model's ``output`` at ``x_t`` implies (float32)."""
        if self.flow:
            return x_t.float() - self.sigmas(t).reshape(-1, 1, 1, 1) * output.float()
        return sd.model.predicted_x0(x_t, output, t, self.alphas, self.prediction_type)

    def target(self, x0, noise, t):
        """What the model predicts at ``noised(x0, noise, t)``: the noise, v, or the velocity."""
        if self.flow:
            return sd.flow.velocity(x0, noise)
        return sd.model.prediction_target(x0, noise, t, self.alphas, self.prediction_type)

    def model_time(self, t: torch.Tensor) -> torch.Tensor:
        return sd.flow.model_timesteps(self.sigmas(t)) if self.flow else t


def matching_gradient(x0: torch.Tensor, real_x0: torch.Tensor, fake_x0: torch.Tensor) -> torch.Tensor:
    """DMD's gradient on the generator's images ``(B, C, h, w)``: ``(p_real - p_fake) / mean|p_real|`` per image,
    with ``p = x0 - x0_score`` (the authors' ``compute_distribution_matching_loss``); non-finite values become 0."""
    p_real, p_fake = x0 - real_x0, x0 - fake_x0
    return torch.nan_to_num((p_real - p_fake) / p_real.abs().mean(dim=(1, 2, 3), keepdim=True))


def matching_loss(x0: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
    """Per image ``(B,)``: ``0.5 * mean((x0 - sg(x0 - g))^2)``, whose gradient in ``x0`` is ``g`` over the
    elements (the batch's mean of it is DMD2's ``loss_dm``)."""
    return 0.5 * (x0.float() - (x0 - gradient).detach().float()).square().flatten(1).mean(1)


def fake_score_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The fake score's diffusion loss: the mean squared error of its prediction over the batch (DMD2's
    ``loss_fake_mean``, whose target is the noise; here the teacher's own target: the noise, v or the velocity)."""
    return (output.float() - target.float()).square().mean()


def generator_gan_loss(logits: torch.Tensor) -> torch.Tensor:
    """The generator's GAN term per image: ``softplus(-logit)`` of the critic on its images."""
    return F.softplus(-logits.float()).reshape(-1)


def critic_loss(fake_logits: torch.Tensor, real_logits: torch.Tensor) -> torch.Tensor:
    """The critic's loss: ``softplus(fake).mean() + softplus(-real).mean()`` (DMD2's ``guidance_cls_loss``)."""
    return F.softplus(fake_logits.float()).mean() + F.softplus(-real_logits.float()).mean()


class Critic(torch.nn.Module):
    """DMD2's SD 1.5 critic head on the UNet's middle-block features (``C`` channels, 8x8 at 512 px): two strided
    convolutions to 1x1, each with a group norm and SiLU, and a 1x1 convolution to one logit. Features of another
    size are resized to 8x8 first."""

    SIDE = 8

    def __init__(self, channels: int):
        super().__init__()
        groups = math.gcd(32, channels)
        self.head = torch.nn.Sequential(
            torch.nn.Conv2d(channels, channels, 4, stride=2, padding=1), torch.nn.GroupNorm(groups, channels),
            torch.nn.SiLU(),
            torch.nn.Conv2d(channels, channels, 4, stride=4, padding=0), torch.nn.GroupNorm(groups, channels),
            torch.nn.SiLU(),
            torch.nn.Conv2d(channels, 1, 1))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        features = features.float()
        if features.shape[-2:] != (self.SIDE, self.SIDE):
            features = F.interpolate(features, size=(self.SIDE, self.SIDE), mode="bilinear", align_corners=False,
                                     antialias=features.shape[-1] > self.SIDE)
        return self.head(features).flatten(1)  # (B, 1)


class _Reached(Exception):
    """Ends a UNet's forward pass at its middle block (the critic reads nothing after it)."""


def middle_features(unet, x_t, t, hidden) -> torch.Tensor:
    """The UNet's middle-block output for ``x_t`` (the down blocks and the middle block only)."""
    found = []

    def hook(module, args, output):
        found.append(output)
        raise _Reached

    handle = unet.mid_block.register_forward_hook(hook)
    try:
        unet(x_t, t, encoder_hidden_states=hidden)
    except _Reached:
        pass
    finally:
        handle.remove()
    return found[0]


@contextlib.contextmanager
def checkpointing_off(unet):
    """Run the body without the UNet's gradient checkpointing: a pass through weights put in place only for the
    pass (``functional_call``) must keep its activations, a recomputation in the backward pass would see the
    module's own weights."""
    modules = [m for m in unet.modules() if getattr(m, "gradient_checkpointing", False)]
    for module in modules:
        module.gradient_checkpointing = False
    try:
        yield
    finally:
        for module in modules:
            module.gradient_checkpointing = True


def reparametrized(unet, weights: dict):
    """The UNet with ``weights`` in place of its own parameters of those names for the body (forward and backward:
    a checkpointed block recomputes inside it)."""
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(unet, weights, strict=False)


# ---------------------------------------------------------------------------------------------
# The objective
# ---------------------------------------------------------------------------------------------


class DistributionMatching(Objective):
    """The teacher, fake score, its optimizer and critic of a DMD run around its generator UNet.

    ``teacher``: a frozen copy of the base (a whole-UNet generator), or None: the UNet with its adapters off.
    ``fake``: the fake score's weights by parameter name (the adapter's, or the whole UNet's), float32 leaves
    trained by ``optimizer`` (AdamW with the run's betas, eps and weight decay, whatever ``optim.name``, at
    ``fake_lr``, constant); ``critic`` with them when
    ``gan_weight`` > 0.
    """

    what = "distilled model"
    uses_base = True  # init_from is the teacher: loaded first, fingerprinted, checked on resume
    starts_from_base = ("distillation: the generator starts as the teacher (init_from's EMA where it has one); the "
                        "EMA and the fake score start from it too")
    statistics = ("dm_loss", "gan_loss", "fake_loss", "critic_loss")

    def __init__(self, settings: DMDSettings, unet, teacher=None, make_optimizer=None):
        self.settings = settings
        self.teacher = teacher
        trained = {name: p for name, p in unet.named_parameters() if p.requires_grad}
        self.fake = {name: p.detach().float().clone().requires_grad_(True) for name, p in trained.items()}
        channels = unet.config.block_out_channels[-1]
        device = next(unet.parameters()).device
        with sd.model._seeded(settings.seed):  # built before the run seeds its RNGs: drawn from its own seed
            self.critic = Critic(channels).to(device) if settings.gan_weight > 0 else None
        params = list(self.fake.values()) + (list(self.critic.parameters()) if self.critic is not None else [])
        make_optimizer = make_optimizer or (lambda groups: torch.optim.AdamW(groups))
        self.optimizer = make_optimizer([{"name": "fake_score", "lr": settings.fake_lr, "params": params}])
        self.timesteps = torch.tensor(sd.sampling.onestep_timesteps(settings.steps), device=device)
        self.d = None  # the run's ranks (attach): the fake score's gradients are averaged over them
        self.tally: torch.Tensor | None = None

    @classmethod
    def wanted(cls, config) -> bool:
        return config.distill.method == "dmd"

    @classmethod
    def check(cls, config, check_paths: bool = True) -> None:
        """DMD's settings, and the modes it cannot be combined with."""
        if config.distill.method != "dmd":
            return
        if check_paths and not config.init_from:
            raise ConfigError("distill.method: dmd learns from a trained model: set init_from (the teacher: a run "
                              "of ours, a diffusers folder or hub id, or a single file)")
        dmd = config.dmd
        if dmd.max_step <= dmd.min_step:
            raise ConfigError(f"dmd.max_step ({dmd.max_step}) must be above dmd.min_step ({dmd.min_step})")
        refused_settings = [
            (config.precision == "fp16", "precision: fp16", "its two optimizers take no loss scaling; use bf16 or fp32"),
            (config.flow.matching, "flow.matching", "the generator learns the teacher's own parametrisation; set "
             "flow.matching: false"),
            (config.loss.type != "l2" or config.loss.debiased_estimation or config.min_snr_gamma != 0,
             "loss.type / loss.debiased_estimation / min_snr_gamma", "the fake score learns by the plain squared "
             "error; set loss.type: l2, loss.debiased_estimation: false and min_snr_gamma: 0"),
            (config.data.masked_loss, "data.masked_loss", "the generator's images have no masks"),
            (bool(config.subject.instance_dir), "subject.instance_dir", "a DreamBooth folder"),
            (bool(config.embedding.token), "embedding.token", "the teacher's prompts must be the generator's"),
            (config.lora.text_encoder, "lora.text_encoder", "the teacher's prompts must be the generator's"),
            (config.captions.shuffle_tags or bool(config.captions.tag_dropout), "captions.shuffle_tags / tag_dropout",
             "caption operations"),
            (bool(config.controlnet.control), "controlnet.control", "a ControlNet trains beside the UNet"),
            (config.sharding != "none", f"sharding: {config.sharding}", "it runs on DDP; set sharding: none"),
            (config.optim.bf16_weights, "optim.bf16_weights", "the fake score keeps float32 weights"),
        ]
        for bad, name, why in refused_settings:
            if bad:
                raise ConfigError(f"distill.method: dmd does not train with {name}: {why}")

    @classmethod
    def build(cls, config, unet) -> "DistributionMatching":
        """For a run's UNet as loaded from ``init_from``, its adapters attached (before its weights are resumed)."""
        settings = DMDSettings.from_config(config)
        optim = config.optim

        def make_optimizer(groups):  # AdamW whatever optim.name: its state is saved as flat tensors
            kwargs = dict(betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps, weight_decay=optim.weight_decay)
            try:
                return torch.optim.AdamW(groups, fused=True, **kwargs)
            except (RuntimeError, TypeError):  # no fused kernel for this device or dtype
                return torch.optim.AdamW(groups, foreach=True, **kwargs)

        if sd.lora.adapters.has_lora(unet):
            return cls(settings, unet, make_optimizer=make_optimizer)
        return cls(settings, unet, frozen_copy(unet, sd.runtime.dtype_of(config.precision)), make_optimizer)

    def attach(self, d) -> None:
        self.d = d

    # -- the networks ------------------------------------------------------------------------

    def teacher_output(self, unet, x_t, t, hidden, uncond):
        """The real score: the teacher's guided prediction (no gradients)."""
        guidance = self.settings.guidance
        both = guidance != 1.0
        x_in, t_in = (torch.cat([x_t, x_t]), torch.cat([t, t])) if both else (x_t, t)
        h_in = torch.cat([uncond, hidden]) if both else hidden
        if self.teacher is not None:
            output = self.teacher(x_in, t_in, encoder_hidden_states=h_in).sample
        else:
            with adapters_off(unet):
                output = unet(x_in, t_in, encoder_hidden_states=h_in).sample
        if not both:
            return output
        unconditional, conditional = output.float().chunk(2)
        return unconditional + guidance * (conditional - unconditional)

    def fake_weights(self, detached: bool) -> dict:
        return {name: p.detach() for name, p in self.fake.items()} if detached else self.fake

    def fake_output(self, unet, x_t, t, hidden):
        """The fake score's prediction without gradients."""
        return torch.func.functional_call(unet, self.fake_weights(True), (x_t, t), {"encoder_hidden_states": hidden},
                                          strict=False).sample

    def generate(self, context: LossContext, model, hidden, shape, generator) -> torch.Tensor:
        """The generator's clean latents ``(B, C, h, w)`` float32 from new noise, through ``model`` (gradients where
        enabled). With several steps, each image's step is drawn (uniformly) and the steps before it run without
        gradients, each image noised again to the next timestep (DMD2's backward simulation)."""
        path, device = Path(context.alphas_cumprod, context.settings.prediction_type), context.device
        batch = shape[0]
        x_t = torch.randn(shape, generator=generator, device=device)
        t = self.timesteps[:1].expand(batch)
        if len(self.timesteps) > 1:
            index = torch.randint(0, len(self.timesteps), (batch,), generator=generator, device=generator.device)
            index = index.to(device)
            with torch.no_grad(), sd.runtime.autocast(context.settings.precision, device):
                for k in range(len(self.timesteps) - 1):
                    now, following = self.timesteps[k].expand(batch), self.timesteps[k + 1].expand(batch)
                    x0 = path.clean(context.unet(x_t, path.model_time(now), encoder_hidden_states=hidden).sample,
                                    x_t, now)
                    renoised = path.noised(x0, torch.randn(shape, generator=generator, device=device), following)
                    x_t = torch.where((index > k).reshape(-1, 1, 1, 1), renoised, x_t)
            t = self.timesteps[index]
        with sd.runtime.autocast(context.settings.precision, device):
            output = model(x_t, path.model_time(t), encoder_hidden_states=hidden).sample
        return path.clean(output, x_t, t)

    def critic_logits(self, context: LossContext, x0, hidden, generator, detached: bool) -> torch.Tensor:
        """The critic's logits ``(B, 1)`` on clean latents ``x0``, noised at a timestep drawn in 0..999 (DMD2's
        diffusion GAN), through the fake score's middle block (``detached``: neither trains by them)."""
        unet, device = context.unet, context.device
        path = Path(context.alphas_cumprod, context.settings.prediction_type)
        t = torch.randint(0, sd.model.NUM_TRAIN_TIMESTEPS, (x0.shape[0],), generator=generator,
                          device=generator.device).to(device)
        noisy = path.noised(x0, torch.randn(x0.shape, generator=generator, device=device), t)
        with reparametrized(unet, self.fake_weights(detached)), \
                sd.runtime.autocast(context.settings.precision, device):
            features = middle_features(unet, noisy, path.model_time(t), hidden)
        if not detached:
            return self.critic(features)
        weights = {name: p.detach() for name, p in self.critic.named_parameters()}
        return torch.func.functional_call(self.critic, weights, (features,))

    # -- the losses --------------------------------------------------------------------------

    def loss(self, context: LossContext, model, latents, input_ids, generator, mask, inputs: dict):
        """The generator's loss per image ``(B,)`` and the timesteps its images were noised at. A training
        micro-batch first trains the fake score ``fake_updates`` times on new images for its prompts. Draws from
        ``generator``, in order: the fake updates' draws, the generator's noise (and steps), the
        distribution-matching timesteps and noise, then the GAN term's."""
        settings, device = self.settings, context.device
        path = Path(context.alphas_cumprod, context.settings.prediction_type)
        real = scaled_latents(context, latents)
        with sd.runtime.autocast(context.settings.precision, device):
            hidden = context.prompts(input_ids, None)  # the prompts as written: the teacher's guidance needs them
        uncond = context.empty_embedding.to(hidden.dtype).expand_as(hidden)
        training = torch.is_grad_enabled()
        if training:
            for _ in range(settings.fake_updates):
                self.update_fake(context, hidden.detach(), real, generator)
        x0 = self.generate(context, model, hidden, real.shape, generator)
        batch = x0.shape[0]
        t = torch.randint(settings.min_step, settings.max_step + 1, (batch,), generator=generator,
                          device=generator.device).to(device)
        noisy = path.noised(x0.detach(), torch.randn(x0.shape, generator=generator, device=device), t)
        with torch.no_grad(), sd.runtime.autocast(context.settings.precision, device):
            fake_x0 = path.clean(self.fake_output(context.unet, noisy, path.model_time(t), hidden), noisy, t)
            real_x0 = path.clean(self.teacher_output(context.unet, noisy, path.model_time(t), hidden, uncond),
                                 noisy, t)
        dm = matching_loss(x0, matching_gradient(x0.detach(), real_x0, fake_x0))
        gan = torch.zeros_like(dm)
        if self.critic is not None:
            with checkpointing_off(context.unet):
                gan = generator_gan_loss(self.critic_logits(context, x0, hidden, generator, True))
        if training:
            self.count(dm=dm.detach().sum(), gan=gan.detach().sum(), images=batch)
        return dm + settings.gan_weight * gan, t

    def update_fake(self, context: LossContext, hidden, real, generator) -> None:
        """One update of the fake score (and the critic) on the generator's images for ``hidden``'s prompts, drawn
        without gradients: the teacher's loss (the squared error of its prediction target) at a timestep in
        0..999, plus the critic's against ``real``. Its gradients are averaged over the ranks and clipped at the
        run's grad_clip; a non-finite one skips the update."""
        device, unet = context.device, context.unet
        path = Path(context.alphas_cumprod, context.settings.prediction_type)
        with torch.no_grad():
            x0 = self.generate(context, unet, hidden, real.shape, generator)
        t = torch.randint(0, sd.model.NUM_TRAIN_TIMESTEPS, (x0.shape[0],), generator=generator,
                          device=generator.device).to(device)
        noise = torch.randn(x0.shape, generator=generator, device=device)
        noisy = path.noised(x0, noise, t)
        with reparametrized(unet, self.fake):
            with sd.runtime.autocast(context.settings.precision, device):
                output = unet(noisy, path.model_time(t), encoder_hidden_states=hidden).sample
            fake_loss = fake_score_loss(output, path.target(x0, noise, t))
            total, critic = fake_loss, torch.zeros_like(fake_loss)
            if self.critic is not None:
                critic = critic_loss(self.critic_logits(context, x0, hidden, generator, False),
                                     self.critic_logits(context, real, hidden, generator, False))
                total = total + self.settings.critic_weight * critic
            total.backward()
        self.step_fake(device)
        self.count(fake=fake_loss.detach(), critic=critic.detach(), updates=1)

    def step_fake(self, device) -> None:
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        if self.d is not None and self.d.world_size > 1:
            flat = sd.distributed.all_reduce_sum(torch.cat([p.grad.reshape(-1) for p in params]), self.d)
            flat = flat / self.d.world_size
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        clip = self.settings.grad_clip if self.settings.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
        skip = ~torch.isfinite(norm)
        if self.optimizer.defaults.get("fused"):  # torch's fused AdamW skips itself on found_inf, on the device
            self.optimizer.found_inf = skip.float()
            self.optimizer.step()
        elif not bool(skip):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def count(self, dm=None, gan=None, images: int = 0, fake=None, critic=None, updates: int = 0) -> None:
        """Add to the step's sums: the generator's terms over its images, the fake score's over its updates."""
        zero = torch.zeros((), dtype=torch.float64)
        parts = [dm, gan, fake, critic]
        device = next(p for p in parts if p is not None).device
        sums = torch.stack([(p.double() if p is not None else zero.to(device)) for p in parts]
                           + [torch.tensor(float(images), dtype=torch.float64, device=device),
                              torch.tensor(float(updates), dtype=torch.float64, device=device)])
        self.tally = sums if self.tally is None else self.tally + sums

    def measured(self, device) -> torch.Tensor:
        """The sums of ``statistics`` and one count: the generator's terms are per image, the fake score's per
        update, so each is scaled here to a per-image mean (fake terms times images per update)."""
        tally, self.tally = self.tally, None
        if tally is None:
            return torch.zeros(len(self.statistics) + 1, dtype=torch.float64, device=device)
        images, updates = tally[4], tally[5]
        per_image = torch.where(updates > 0, images / updates.clamp(min=1), torch.zeros_like(images))
        return torch.cat([tally[:2], tally[2:4] * per_image, images.reshape(1)])

    # -- the contract's rest -----------------------------------------------------------------

    def entries(self) -> dict:
        """The fake score (and the critic) and its optimizer's state, both as flat tensors."""
        return {"dmd_fake": FakeScore(self), "dmd_fake_optimizer": FlatOptimizer(self.optimizer)}

    def held_tensors(self) -> list:
        teacher = [*self.teacher.parameters(), *self.teacher.buffers()] if self.teacher is not None else []
        critic = list(self.critic.parameters()) if self.critic is not None else []
        moments = [t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
        return teacher + list(self.fake.values()) + critic + moments

    def describe(self, config) -> str:
        s = self.settings
        return (f"distill: dmd from {config.init_from}, {s.steps} step{'s' if s.steps > 1 else ''} (timesteps "
                f"{', '.join(map(str, sd.sampling.onestep_timesteps(s.steps)))}), guidance {s.guidance:g}, {s.fake_updates} "
                f"fake-score updates per micro-batch at lr {s.fake_lr:g} (teacher: "
                f"{'a frozen copy' if self.teacher is not None else 'the base, adapters off'}; fake score: "
                f"{'a whole float32 copy' if self.teacher is not None else 'a second adapter'}); "
                + (f"GAN weight {s.gan_weight:g}" if s.gan_weight else "data-free (prompts only)"))


class FakeScore:
    """The fake score's weights (``fake.<name>``) and the critic's (``critic.<name>``) as a checkpoint entry."""

    def __init__(self, objective: DistributionMatching):
        self.objective = objective

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {f"fake.{name}": p.detach() for name, p in self.objective.fake.items()}
        if self.objective.critic is not None:
            state.update({f"critic.{name}": p.detach() for name, p in self.objective.critic.state_dict().items()})
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        own = self.state_dict()
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise KeyError(f"the fake score does not match this run's: missing {missing[:3]}, unexpected "
                           f"{unexpected[:3]} (another generator kind, adapter or dmd.gan_weight)")
        for name, tensor in own.items():
            tensor.copy_(state[name])


class FlatOptimizer:
    """An AdamW's state as flat tensors (``<i>.step``, ``<i>.exp_avg``, ``<i>.exp_avg_sq`` of its i-th parameter):
    a safetensors checkpoint entry."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def params(self) -> list:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {}
        for i, p in enumerate(self.params()):
            for key, value in self.optimizer.state.get(p, {}).items():
                if torch.is_tensor(value):
                    state[f"{i}.{key}"] = value.detach()
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        params = self.params()
        self.optimizer.state.clear()
        for name, tensor in state.items():
            index, _, key = name.partition(".")
            if not index.isdigit() or int(index) >= len(params):
                raise KeyError(f"the fake score's optimizer state names parameter {index}; it has {len(params)}")
            p = params[int(index)]
            on_device = tensor.dim() or self.optimizer.defaults.get("fused") or self.optimizer.defaults.get("capturable")
            self.optimizer.state.setdefault(p, {})[key] = tensor.to(p.device if on_device else "cpu", copy=True)

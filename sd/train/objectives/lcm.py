"""Latent consistency distillation (``distill: lcm``), an objective: a model that samples in 1-8 steps, learned
from a trained one.

LCM (Luo et al. 2023, "Latent Consistency Models", arXiv:2310.04378) and LCM-LoRA (Luo et al. 2023,
arXiv:2311.05556). Three networks take part in a step:

- the **teacher**: the trained model (``init_from``), frozen; its classifier-free-guided prediction at a
  guidance scale drawn per sample takes one DDIM step of the solver from ``t_n`` to ``t_{n-k}``;
- the **student**: what trains (the UNet with a LoRA adapter, or a whole copy); from ``x_{t_n}`` it
  predicts the clean latents through the consistency parametrisation
  ``f(x, t) = c_skip(t) x + c_out(t) x0_pred(x, t)``;
- the **target**: an EMA of the student (``lcm_target_decay``), evaluated at the solver's ``x_{t_{n-k}}``
  without gradients. The loss pulls ``f_student(x_{t_n})`` towards ``f_target(x_{t_{n-k}})``.

With a LoRA student the teacher is the same UNet with its adapters switched off, and the target is the
same UNet called with the target's adapter weights in place of its own: one UNet in memory. A whole-UNet student
keeps a frozen teacher copy (in the autocast type) and the target as a full fp32 shadow beside it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

import sd.lora.adapters
import sd.model
import sd.runtime
import sd.sampling
import sd.train.ema
from sd.cli import ConfigError
from sd.train.objectives.base import LossContext, Objective, scaled_latents
from sd.settings import setting, refused, Range, POSITIVE, BELOW_ONE, MATH

MODES = ("", "lcm", "dmd")  # dmd: sd.train.objectives.dmd
LOSSES = ("huber", "l2")


@dataclass(frozen=True)
class DistillConfig:
    """Distillation of init_from (the teacher) into a few-step model: latent consistency (lcm)."""

    method: str = setting("lcm: latent consistency distillation of init_from (the teacher) into a model that samples "
                          "in 1-8 steps (SD_ImageGen.py --sampler lcm); dmd: distribution matching distillation "
                          "(DMD2, the dmd section) into a 1-4 step generator (--sampler onestep); with lora.rank an "
                          "adapter, else the whole UNet; empty = the usual diffusion loss", "", resume=refused(MATH))
    solver_steps: int = setting("distill: DDIM solver steps over the teacher's 1000 timesteps (each a skip of 1000 / "
                                "this)", 50, allowed=Range(1, 1000, high_open=False), resume=refused(MATH))
    guidance_min: float = setting("distill: lowest classifier-free guidance scale of the teacher (drawn per sample "
                                  "between min and max; LCM's w is this - 1)", 3.0, allowed=Range(1, 30, high_open=False),
                                  resume=refused(MATH))
    guidance_max: float = setting("distill: highest guidance scale of the teacher; = lcm_guidance_min for a fixed "
                                  "scale", 15.0, allowed=Range(1, 30, high_open=False), resume=refused(MATH))
    loss: str = setting("distill: huber (pseudo-Huber, as LCM) or l2", "huber", resume=refused(MATH))
    huber_c: float = setting("distill: the pseudo-Huber loss's c", 0.001, allowed=POSITIVE, resume=refused(MATH))
    timestep_scaling: float = setting("distill: the boundary condition's timestep scaling (c_skip, c_out at 10 t)", 10.0,
                                      allowed=POSITIVE, resume=refused(MATH))
    target_decay: float = setting("distill: EMA decay of the target network; 0 = the student itself (diffusers' "
                                  "LCM-LoRA script)", 0.95, allowed=BELOW_ONE, resume=refused("the target network"))


@dataclass(frozen=True)
class LCMSettings:
    """The config fields of a consistency-distillation step."""

    solver_steps: int = 50  # DDIM solver steps over the teacher's 1000: the skip k is 1000 // 50 = 20
    guidance_min: float = 3.0  # the teacher's CFG scale s (uncond + s (cond - uncond)) is drawn in this range
    guidance_max: float = 15.0
    loss: str = "huber"
    huber_c: float = 0.001
    timestep_scaling: float = 10.0
    target_decay: float = 0.95

    @classmethod
    def from_config(cls, config) -> "LCMSettings":
        distill = config.distill
        return cls(distill.solver_steps, distill.guidance_min, distill.guidance_max, distill.loss, distill.huber_c,
                   distill.timestep_scaling, distill.target_decay)


# ---------------------------------------------------------------------------------------------
# Pure pieces
# ---------------------------------------------------------------------------------------------


def solver_timesteps(solver_steps: int, num_train_timesteps: int = sd.model.NUM_TRAIN_TIMESTEPS) -> torch.Tensor:
    """The DDIM solver's timesteps, lowest first ``(N,)``: ``k - 1, 2k - 1, ..., T - 1`` with skip
    ``k = T // N`` (e.g. 19, 39, ..., 999 for 50 steps)."""
    skip = num_train_timesteps // solver_steps
    return torch.arange(1, solver_steps + 1, dtype=torch.long) * skip - 1


def x0_and_noise(output: torch.Tensor, x_t: torch.Tensor, timesteps: torch.Tensor, alphas_cumprod: torch.Tensor,
                 prediction_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The clean latents and the noise that a model's ``output`` at ``x_t`` (``(B, 4, h, w)``) implies."""
    return (sd.model.predicted_x0(x_t, output, timesteps, alphas_cumprod, prediction_type),
            sd.model.predicted_noise(x_t, output, timesteps, alphas_cumprod, prediction_type))


def consistency(output, x_t, timesteps, alphas_cumprod, prediction_type: str, timestep_scaling: float):
    """``f(x_t, t) = c_skip(t) x_t + c_out(t) x0_pred``: the consistency function's clean latents, with
    the boundary scalings the LCM sampler uses (``sd.sampling.lcm_boundary_scalings``)."""
    c_skip, c_out = sd.sampling.lcm_boundary_scalings(timesteps.reshape(-1, 1, 1, 1), timestep_scaling)
    x0 = sd.model.predicted_x0(x_t, output, timesteps, alphas_cumprod, prediction_type)
    return c_skip * x_t.float() + c_out * x0


def ddim_solver_step(x0: torch.Tensor, noise: torch.Tensor, alpha_prev: torch.Tensor) -> torch.Tensor:
    """One deterministic DDIM step to the timestep whose alpha-bar is ``alpha_prev`` ``(B,)``:
    ``sqrt(a_prev) x0 + sqrt(1 - a_prev) eps``."""
    a = alpha_prev.float().reshape(-1, 1, 1, 1)
    return a.sqrt() * x0 + (1 - a).sqrt() * noise


def guided(cond: torch.Tensor, uncond: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Classifier-free guidance with a scale per sample ``(B,)``: ``uncond + s (cond - uncond)``
    (LCM's w is s - 1)."""
    return uncond + scale.reshape(-1, 1, 1, 1) * (cond - uncond)


def distance(prediction: torch.Tensor, target: torch.Tensor, loss: str, huber_c: float) -> torch.Tensor:
    """Per-sample distance ``(B,)``: the mean squared error, or the pseudo-Huber loss
    ``sqrt(d^2 + c^2) - c`` (Song & Dhariwal 2023, "Improved techniques for training consistency
    models"), which is quadratic near 0 and linear for outliers."""
    diff = prediction.float() - target.float()
    if loss == "l2":
        per_element = diff.square()
    elif loss == "huber":
        per_element = (diff.square() + huber_c**2).sqrt() - huber_c
    else:
        raise ValueError(f"lcm_loss must be one of {LOSSES}, got {loss!r}")
    return per_element.flatten(1).mean(1)


# ---------------------------------------------------------------------------------------------
# The teacher and the target
# ---------------------------------------------------------------------------------------------


class LatentConsistency(Objective):
    """The teacher and target of a consistency-distillation run around its student UNet.

    ``teacher``: a frozen copy of the base (a whole-UNet student), or None: the student's own UNet with
    its LoRA adapters switched off. ``target``: an EMA of what trains (``lcm_target_decay``; 0: the
    student itself, as diffusers' LCM-LoRA script does), kept on the device: its forward pass is the
    student's module called with the target's tensors (``torch.func.functional_call``), no copy made.
    """

    what = "distilled model"  # in messages
    uses_base = True  # init_from is the teacher: loaded first, fingerprinted, checked on resume
    starts_from_base = ("distillation: the student starts as the teacher (init_from's EMA where it has one); the EMA "
                        "and the target network start from it too")

    def __init__(self, settings: LCMSettings, unet, teacher=None):
        self.settings = settings
        self.teacher = teacher
        lora = sd.lora.adapters.has_lora(unet)
        self.target = (sd.train.ema.EMA(unet, settings.target_decay, warmup=False, trainable_only=lora)
                       if settings.target_decay > 0 else None)
        self.solver = solver_timesteps(settings.solver_steps).to(next(unet.parameters()).device)  # no copy per step

    @classmethod
    def wanted(cls, config) -> bool:
        return config.distill.method == "lcm"

    @classmethod
    def check(cls, config, check_paths: bool = True) -> None:
        """Consistency distillation's settings, and the modes it cannot be combined with."""
        method = config.distill.method
        if method not in MODES:
            raise ConfigError(f"distill.method: lcm, dmd, or empty for the usual diffusion loss; got {method!r}")
        if method != "lcm":
            return
        if check_paths and not config.init_from:
            raise ConfigError("distill.method: lcm learns from a trained model: set init_from (the teacher: a run "
                              "of ours, a diffusers folder or hub id, or a single file)")
        if config.distill.loss not in LOSSES:
            raise ConfigError(f"distill.loss: huber or l2, got {config.distill.loss!r}")
        if config.distill.guidance_max < config.distill.guidance_min:
            raise ConfigError(f"distill.guidance_max ({config.distill.guidance_max:g}) is below distill.guidance_min "
                              f"({config.distill.guidance_min:g}): set max >= min (equal for a fixed scale)")
        if sd.model.NUM_TRAIN_TIMESTEPS % config.distill.solver_steps:
            raise ConfigError(f"distill.solver_steps: a divisor of {sd.model.NUM_TRAIN_TIMESTEPS} (e.g. 50: a skip "
                              f"of 20), got {config.distill.solver_steps}")
        if config.loss.type != "l2" or config.loss.debiased_estimation:
            raise ConfigError("loss.type and loss.debiased_estimation are the diffusion loss's; a distill run has "
                              "distill.loss: set loss.type: l2 and loss.debiased_estimation: false")
        refused = {"subject.instance_dir": "a DreamBooth folder", "embedding.token": "textual inversion",
                   "lora.text_encoder": "a text-encoder adapter (the teacher's prompts are its own)",
                   "data.masked_loss": "loss masks", "captions.shuffle_tags": "caption operations",
                   "captions.tag_dropout": "caption operations"}
        for name, what in refused.items():
            where, _, field = name.partition(".")
            if getattr(getattr(config, where), field):
                raise ConfigError(f"distill.method: lcm does not train with {what}; unset {name}, or distill in a "
                                  "run of its own")
        if config.sharding != "none":
            raise ConfigError(f"distill.method: lcm runs on DDP; set sharding: none (got {config.sharding})")

    @classmethod
    def build(cls, config, unet) -> "LatentConsistency":
        """For a run's UNet as loaded from ``init_from`` (before its weights are resumed)."""
        settings = LCMSettings.from_config(config)
        if sd.lora.adapters.has_lora(unet):
            return cls(settings, unet)
        return cls(settings, unet, frozen_copy(unet, sd.runtime.dtype_of(config.precision)))

    def teacher_output(self, unet, x_t, timesteps, hidden):
        """The teacher's prediction (no gradients)."""
        if self.teacher is not None:
            return self.teacher(x_t, timesteps, encoder_hidden_states=hidden).sample
        with adapters_off(unet):
            return unet(x_t, timesteps, encoder_hidden_states=hidden).sample

    def target_output(self, unet, x_t, timesteps, hidden):
        """The target network's prediction (no gradients): the student's UNet called with the target's
        tensors in place of its trained parameters, which are left untouched."""
        if self.target is None:
            return unet(x_t, timesteps, encoder_hidden_states=hidden).sample
        weights = self.target.state_dict()
        return torch.func.functional_call(unet, weights, (x_t, timesteps), {"encoder_hidden_states": hidden},
                                          strict=False).sample

    def update(self, unet, step_index: int, skip: torch.Tensor | None = None, view=None) -> None:
        """Fold the student in after an optimizer step (none where ``skip``)."""
        if self.target is not None:
            self.target.update(unet, step_index, skip=skip, view=view)

    def loss(self, context: LossContext, model, latents, input_ids, generator, mask, inputs: dict):
        """The consistency-distillation loss (``lcm_loss``; a distillation takes no loss mask or mode inputs)."""
        return lcm_loss(self, context, model, latents, input_ids, generator)

    def entries(self) -> dict:
        """The checkpoint's entries: the target network, when there is one."""
        return {"lcm_target": self} if self.target is not None else {}

    def held_tensors(self) -> list:
        """What it holds besides the student: the teacher's frozen copy (a whole-UNet student) and the target."""
        teacher = [*self.teacher.parameters(), *self.teacher.buffers()] if self.teacher is not None else []
        return teacher + (list(self.target.shadow) if self.target is not None else [])

    def describe(self, config) -> str:
        decay = config.distill.target_decay
        return (f"distill: {config.distill.method} from {config.init_from} (teacher: "
                f"{'a frozen copy' if self.teacher is not None else 'the base, adapters off'}; target: "
                f"{f'EMA {decay:g} of the student' if decay else 'the student'})")

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.target.state_dict() if self.target is not None else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.target is not None:
            self.target.load_state_dict(state)


def frozen_copy(unet, dtype: torch.dtype):
    """A frozen copy of ``unet`` with its weights in ``dtype`` (the autocast type, which computes in it anyway):
    built on the meta device and given copies of the weights, so no random init runs for it."""
    with torch.device("meta"):
        copy = type(unet).from_config(unet.config)
    weights = {name: tensor.detach().to(dtype if tensor.is_floating_point() else tensor.dtype, copy=True)
               for name, tensor in unet.state_dict().items()}
    copy.load_state_dict(weights, assign=True)
    return copy.requires_grad_(False).eval()


@contextlib.contextmanager
def adapters_off(unet):
    """Run the body with every LoRA adapter of ``unet`` bypassed: the base model's output, bit for bit.

    PEFT's own ``enable_adapters(False)`` also turns the adapters' ``requires_grad`` off (and back on for
    all of them), which would change what the optimizer trains; its layers' ``_disable_adapters`` flag
    alone is what their forward reads.
    """
    layers = [layer for _, layer in sd.lora.adapters.lora_layers(unet)]
    before = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield unet
    finally:
        for layer, was in zip(layers, before):
            layer._disable_adapters = was


# ---------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------


def lcm_loss(distiller: LatentConsistency, context: LossContext, model, latents: torch.Tensor,
             input_ids: torch.Tensor, generator: torch.Generator):
    """Per-sample consistency-distillation loss ``(B,)`` of one micro-batch and its timesteps ``t_n``.

    Draws from ``generator``, in order: the noise, the solver index n and the guidance scale. The
    student runs through ``model`` (DDP-wrapped, compiled); teacher and target through the plain UNet
    without gradients. The prompts are taken as written: the guided teacher needs them (no CFG dropout).
    """
    settings, loss, device, alphas = distiller.settings, context.settings, context.device, context.alphas_cumprod
    x0 = scaled_latents(context, latents)
    batch = x0.shape[0]
    noise = torch.randn(x0.shape, generator=generator, device=device)
    index = torch.randint(0, settings.solver_steps, (batch,), generator=generator, device=generator.device)
    scale = torch.rand(batch, generator=generator, device=generator.device)
    scale = (settings.guidance_min + (settings.guidance_max - settings.guidance_min) * scale).to(device)
    start = distiller.solver[index.to(device)]
    end = (start - (len(alphas) // settings.solver_steps)).clamp(min=0)  # t_{n-k}; below t_0 the boundary
    x_start = sd.model.add_noise(x0, noise, start, alphas)
    with sd.runtime.autocast(loss.precision, device):
        hidden = context.prompts(input_ids, None)
        student = model(x_start, start, encoder_hidden_states=hidden).sample
        with torch.no_grad():
            x_end = teacher_solver_step(distiller, context, x_start, start, end, hidden, scale)
            target_out = distiller.target_output(context.unet, x_end, end, hidden)
    prediction = consistency(student, x_start, start, alphas, loss.prediction_type, settings.timestep_scaling)
    target = consistency(target_out, x_end, end, alphas, loss.prediction_type, settings.timestep_scaling)
    return distance(prediction, target, settings.loss, settings.huber_c), start


def teacher_solver_step(distiller: LatentConsistency, context: LossContext, x_start, start, end, hidden, scale) -> torch.Tensor:
    """``x_{t_{n-k}}``: one DDIM step of the teacher's guided prediction from ``x_{t_n}`` (cond and
    uncond in one batch of 2B)."""
    alphas, prediction_type = context.alphas_cumprod, context.settings.prediction_type
    uncond = context.empty_embedding.to(hidden.dtype).expand_as(hidden)
    both = distiller.teacher_output(context.unet, torch.cat([x_start, x_start]), torch.cat([start, start]),
                                    torch.cat([hidden, uncond]))
    x0_c, eps_c = x0_and_noise(both[: len(start)], x_start, start, alphas, prediction_type)
    x0_u, eps_u = x0_and_noise(both[len(start):], x_start, start, alphas, prediction_type)
    alpha_prev = alphas.to(end.device)[end]
    return ddim_solver_step(guided(x0_c, x0_u, scale), guided(eps_c, eps_u, scale), alpha_prev)

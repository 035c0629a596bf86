"""Sampling: one loop for every sampler, used by SD_ImageGen.py and by the trainer's validation grid.

* ``sample_latents``: DDIM (ours, "leading" spacing as SD), DPM-Solver++ 2M or Euler (diffusers'
  schedulers), or LCM (ours, for latent consistency models: 1-8 steps) on the training schedule,
  with classifier-free guidance against a real negative-prompt embedding. The predicted x0 is never
  clamped. A model trained on the zero-terminal-SNR schedule (``zero_terminal_snr``) is sampled on
  that schedule with "trailing" spacing, which starts at the last timestep, pure noise (Lin et al.
  2023, arXiv:2305.08891).
* ``generate``: images for one prompt from a list of seeds; ``generate_batch``: one image per
  (prompt, seed) pair, the evaluation's path (``SD_Eval.py``). Image i's noise comes from a CPU
  generator seeded with ``seeds[i]``, so the same seed gives the same image on any device and at any
  batch size; the training grid and ``SD_ImageGen.py --seed`` therefore make the same picture. LCM's
  fresh noise at each step comes from the same generator, after the initial noise.

Each of them takes ``stop``, a function asked before every denoising step: once it answers True the
batch is abandoned (``Interrupted``), so a stop signal never waits for a whole batch to finish.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import sd.files
import sd.flow
import sd.model

SAMPLERS = ("ddim", "dpm++", "euler", "lcm", "onestep", "flow_euler", "flow_heun")
ANY_MODEL = ("onestep",)  # samplers of epsilon, v and flow models alike
FLOW_SAMPLERS = ("flow_euler", "flow_heun")


class Interrupted(Exception):
    """``stop()`` answered True between two denoising steps: the batch was left unfinished."""


@dataclass
class Pipeline:
    """Everything sampling needs: the UNet (live or EMA weights), the frozen parts, and what the model is, as its
    loader read it from the model's records (``sd.formats.load_pipeline``): sampling and the exports ask these
    instead of deriving them again."""

    unet: torch.nn.Module
    vae: torch.nn.Module
    text_encoder: torch.nn.Module
    tokenizer: object
    prediction_type: str
    source: str = ""
    zero_terminal_snr: bool = False  # trained on the rescaled schedule: sample it with trailing spacing
    flow_shift: float = 1.0  # the flow samplers' time shift (sd.flow.shifted)
    flow_matching: bool = False  # an epsilon or v model trained as a flow (sd.flow): sampled as one by default
    distilled: str = ""  # "lcm": a latent consistency model, "dmd": a DMD generator (a run of ours with distill: ...)
    generator_steps: int = 0  # a DMD generator's steps (dmd.steps), what --sampler onestep draws by default
    trained_size: tuple[int, str] | None = None  # the square side it was trained at, and where that is recorded

    @property
    def flow(self) -> bool:
        """Sampled as a flow: a flow model, or one trained as a flow through the diff2flow bridge."""
        return self.prediction_type == "flow" or self.flow_matching

    @property
    def default_sampler(self) -> str:
        """The sampler of ``--sampler auto``: lcm for a latent consistency model, onestep for a DMD generator, else
        ``default_sampler``."""
        if self.distilled in DISTILLED_SAMPLERS:
            return DISTILLED_SAMPLERS[self.distilled]
        return default_sampler(self.prediction_type, self.flow_matching)

    def sampler_error(self, sampler: str) -> str | None:
        """Why ``sampler`` cannot sample this model (None: it can)."""
        if self.prediction_type == "flow" and sampler not in FLOW_SAMPLERS + ANY_MODEL:
            return f"a flow model: sample it with --sampler {' or '.join(FLOW_SAMPLERS)} (or auto), not {sampler}"
        return None

    @property
    def learned_tokens(self) -> dict:
        """The tokens its text encoder learned or was given (a textual-inversion or pivotal run's), by token: their
        vectors ``(vectors, D)``."""
        import sd.embedding.tokens

        return {layer.tokens[0]: layer.vectors for layer in sd.embedding.tokens.added_embeddings(self.text_encoder)}

    @property
    def has_adapter(self) -> bool:
        """Whether it carries a LoRA run's adapter (on the UNet or the text encoder), not merged yet."""
        import sd.lora.adapters

        return sd.lora.adapters.has_lora(self.unet) or sd.lora.adapters.has_lora(self.text_encoder)

    def describe(self) -> str:
        """``epsilon``, ``v_prediction, zero terminal SNR``, ``epsilon, trained as a flow, flow shift 3``."""
        return ", ".join([self.prediction_type, *(["zero terminal SNR"] if self.zero_terminal_snr else []),
                          *(["trained as a flow"] if self.flow_matching else []),
                          *([f"flow shift {self.flow_shift:g}"] if self.flow else []),
                          *([f"clip skip {sd.model.clip_skip_of(self.text_encoder)}"]
                            if sd.model.clip_skip_of(self.text_encoder) > 1 else [])])

    def file_metadata(self) -> dict[str, str]:
        """What a single file records of the model, read back by ``sd.formats.load_pipeline``."""
        metadata = {"prediction_type": self.prediction_type, "zero_terminal_snr": str(self.zero_terminal_snr).lower()}
        if self.flow:
            metadata.update(flow_shift=f"{self.flow_shift:g}", flow_matching=str(self.flow_matching).lower())
        if self.distilled == "dmd":  # a DMD generator: its sampler and timesteps
            metadata.update(distilled="dmd", generator_timesteps=",".join(map(str, onestep_timesteps(
                self.generator_steps or 1))))
        if sd.model.clip_skip_of(self.text_encoder) > 1:
            metadata["clip_skip"] = str(sd.model.clip_skip_of(self.text_encoder))
        return metadata

    def to(self, device: torch.device, dtype: torch.dtype) -> "Pipeline":
        """The UNet, VAE and text encoder on ``device`` in ``dtype``."""
        for part in (self.unet, self.vae, self.text_encoder):
            sd.model.moved(part, device, dtype)
        return self


# ---------------------------------------------------------------------------------------------
# DDIM
# ---------------------------------------------------------------------------------------------


SPACINGS = ("leading", "trailing")


def ddim_timesteps(num_steps: int, num_train_timesteps: int = sd.model.NUM_TRAIN_TIMESTEPS,
                   spacing: str = "leading") -> list[int]:
    """Timesteps, highest first, spaced as diffusers names it.

    "leading" (SD's, offset 1): e.g. 50 steps -> 981, 961, ..., 1; it never visits the last timestep.
    "trailing": counted down from the last timestep, e.g. 50 steps -> 999, 979, ..., 19, and 30 steps
    -> 999, 966, 932, ... (round(T - i * T / n) - 1, halves to even), as diffusers spaces them.
    """
    if not 1 <= num_steps <= num_train_timesteps:
        raise ValueError(f"steps must be in 1..{num_train_timesteps}, got {num_steps}")
    if spacing == "leading":
        stride = num_train_timesteps // num_steps
        return [i * stride + 1 for i in reversed(range(num_steps))]
    if spacing == "trailing":
        # NumPy's arange (which diffusers uses) steps by its first difference, not by T / n: the same
        # arithmetic here makes the halves that round to even fall where diffusers' do. For some n
        # (61, 103, 121, ...) that arange also yields an (n+1)-th value, and diffusers a last timestep -1
        # (alpha-bar[-1], pure noise, as the final step); that one is not copied.
        delta = (num_train_timesteps - num_train_timesteps / num_steps) - num_train_timesteps
        return [round(num_train_timesteps + i * delta) - 1 for i in range(num_steps)]
    raise ValueError(f"spacing must be one of {SPACINGS}, got {spacing!r}")


def ddim_step(sample, model_output, timestep: int, prev_timestep: int, alphas_cumprod, prediction_type: str):
    """One deterministic DDIM step (eta = 0) from ``timestep`` to ``prev_timestep``.

    The predicted x0 is used as it is: SD latents have a standard deviation near 4 before scaling
    and reach beyond +-1 after it, so clamping x0 to [-1, 1] (pixel-space DDPM practice) ruins them.
    ``prev_timestep < 0`` means the final step, towards alpha-bar_0 of the schedule (SD's
    ``set_alpha_to_one=False``).
    """
    a_t = alphas_cumprod[timestep].item()
    a_prev = alphas_cumprod[prev_timestep].item() if prev_timestep >= 0 else alphas_cumprod[0].item()
    x_t, out = sample.float(), model_output.float()
    if prediction_type == "epsilon":
        eps = out
        x0 = (x_t - math.sqrt(1 - a_t) * eps) / math.sqrt(a_t)
    elif prediction_type == "v_prediction":
        x0 = math.sqrt(a_t) * x_t - math.sqrt(1 - a_t) * out
        eps = math.sqrt(a_t) * out + math.sqrt(1 - a_t) * x_t
    else:
        raise ValueError(f"prediction_type must be 'epsilon' or 'v_prediction', got {prediction_type!r}")
    return math.sqrt(a_prev) * x0 + math.sqrt(1 - a_prev) * eps


class DDIM:
    """Our DDIM behind the three calls of a diffusers scheduler that ``sample_latents`` makes.

    Each step goes to the next timestep of the list (the last one to alpha-bar_0). With "leading"
    spacing, and "trailing" with a step count that divides the 1000 timesteps, that is where diffusers'
    DDIM goes (``t - 1000 // steps``); for other counts diffusers' trailing DDIM sometimes lands one
    timestep above the one it evaluates next, and this one does not.
    """

    init_noise_sigma = 1.0

    def __init__(self, steps: int, alphas_cumprod: torch.Tensor, prediction_type: str, spacing: str = "leading"):
        self.timesteps = ddim_timesteps(steps, len(alphas_cumprod), spacing)
        self.previous = dict(zip(self.timesteps, self.timesteps[1:] + [-1]))
        self.alphas_cumprod = alphas_cumprod
        self.prediction_type = prediction_type

    def scale_model_input(self, latents, timestep):
        return latents

    def step(self, prediction, timestep, latents):
        t = int(timestep)
        return ddim_step(latents, prediction, t, self.previous[t], self.alphas_cumprod, self.prediction_type)


def default_sampler(prediction_type: str, flow_matching: bool = False) -> str:
    """The sampler of a model when none is named: flow_euler for one trained as a flow, ddim otherwise."""
    return "flow_euler" if prediction_type == "flow" or flow_matching else "ddim"


def settings_error(sampler: str, steps: int, cfg: float) -> str | None:
    """Why ``sampler`` cannot sample at ``steps`` steps and guidance ``cfg`` (None: it can): the check a
    command makes before any work, so that a setting never fails at its first use hours later."""
    if sampler not in SAMPLERS:
        return f"sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}"
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        return f"steps must be a whole number of at least 1, got {steps!r}"
    most = {"lcm": LCM_ORIGINAL_STEPS, "onestep": ONESTEP_MAX}.get(sampler, sd.model.NUM_TRAIN_TIMESTEPS)
    if steps > most:
        why = {"lcm": f"the {LCM_ORIGINAL_STEPS}-step schedule a latent consistency model is distilled on",
               "onestep": "a DMD generator draws in 1 to 4 steps"}.get(sampler, "the model's timesteps")
        return f"{sampler} takes at most {most} steps ({why}), got {steps}"
    if not math.isfinite(cfg) or cfg < 0:
        return f"the guidance scale must be a finite number of at least 0, got {cfg!r}"
    return None


def make_scheduler(sampler: str, steps: int, prediction_type: str, alphas_cumprod=None, device=None,
                   zero_terminal_snr: bool = False, generators: list[torch.Generator] | None = None,
                   flow_shift: float = 1.0):
    """A scheduler with ``timesteps``, ``init_noise_sigma``, ``scale_model_input`` and ``step``.

    ``zero_terminal_snr``: the rescaled schedule with "trailing" spacing (``alphas_cumprod``, when
    given, is DDIM's and LCM's schedule either way; LCM's timesteps start at the last one on both).
    ``generators``: LCM's per-step noise, one CPU generator per image (see ``image_noise``).
    ``flow_shift``: the flow samplers' time shift. A flow model takes only those; an epsilon or v model
    takes them through the diff2flow bridge (``sd.flow``).
    """
    if prediction_type == "flow" and sampler not in FLOW_SAMPLERS + ANY_MODEL:
        raise ValueError(f"a flow model is sampled with {' or '.join(FLOW_SAMPLERS)}, not {sampler}")
    if sampler == "onestep":
        if alphas_cumprod is None:
            alphas_cumprod = sd.model.ddpm_alphas_cumprod(zero_terminal_snr=zero_terminal_snr)
        return OneStep(steps, alphas_cumprod, prediction_type, generators)
    if sampler in FLOW_SAMPLERS:
        if zero_terminal_snr:
            raise ValueError(f"{sampler} does not sample a zero-terminal-SNR model; use ddim, euler or dpm++")
        bridge = None if prediction_type == "flow" else (
            sd.model.ddpm_alphas_cumprod() if alphas_cumprod is None else alphas_cumprod, prediction_type)
        return Flow(steps, flow_shift, heun=sampler == "flow_heun", bridge=bridge)
    conflict = sd.model.schedule_conflict(prediction_type, zero_terminal_snr)
    if conflict:
        raise ValueError(f"zero_terminal_snr: {conflict}; sample a v_prediction model, or this one with "
                         "zero_terminal_snr off")
    if alphas_cumprod is None and sampler in ("ddim", "lcm"):
        alphas_cumprod = sd.model.ddpm_alphas_cumprod(zero_terminal_snr=zero_terminal_snr)
    if sampler == "ddim":
        return DDIM(steps, alphas_cumprod, prediction_type, "trailing" if zero_terminal_snr else "leading")
    if sampler == "lcm":
        return LCM(steps, alphas_cumprod, prediction_type, generators)
    from diffusers import DPMSolverMultistepScheduler, EulerDiscreteScheduler

    config = sd.model.noise_schedule_config(prediction_type, zero_terminal_snr)
    if sampler == "dpm++":
        scheduler = DPMSolverMultistepScheduler.from_config({**config, "algorithm_type": "dpmsolver++",
                                                             "solver_order": 2})
    elif sampler == "euler":
        scheduler = EulerDiscreteScheduler.from_config(config)
    else:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    scheduler.set_timesteps(steps, device=device)
    step = scheduler.step
    scheduler.step = lambda prediction, t, latents: step(prediction, t, latents).prev_sample
    return scheduler


# ---------------------------------------------------------------------------------------------
# Flow matching: Euler and Heun on the flow ODE (sd.flow)
# ---------------------------------------------------------------------------------------------


class Flow:
    """Euler or Heun steps on ``dx / dsigma = v`` behind the calls ``sample_latents`` makes.

    Euler equals diffusers' ``FlowMatchEulerDiscreteScheduler`` step by step at the same ``shift``, and
    Heun its ``FlowMatchHeunDiscreteScheduler`` (two evaluations a step but the last, which is Euler's).
    ``timesteps`` are the sigmas evaluated at, in order (Heun's interior ones twice); ``model_time``
    gives the UNet's time input for one. ``bridge``: ``(alphas_cumprod, prediction_type)`` of an epsilon
    or v model, sampled as a flow through the diff2flow mapping (``sd.flow.bridge_inputs``): its steps
    span its own sigmas, and it starts from unit-variance noise at its noisiest timestep, as DDIM does
    (Euler from ``schedule_sigmas`` at DDIM's timesteps is DDIM). ``sigmas``: an own grid, ending at 0.
    """

    def __init__(self, steps: int, shift: float = 1.0, heun: bool = False, bridge=None,
                 sigmas: list[float] | None = None):
        self.bridge = bridge
        span = None if bridge is None else sd.flow.bridge_range(bridge[0])
        self.sigmas = sigmas if sigmas is not None else sd.flow.euler_sigmas(steps, shift, span)
        self.heun = heun
        self.plan = []  # (sigma index, whether the evaluation starts a step) of each evaluation, in order
        for i in range(len(self.sigmas) - 1):
            self.plan.append((i, True))  # Euler's step from sigma i (Heun's predictor)
            if heun and self.sigmas[i + 1] != 0:
                self.plan.append((i + 1, False))  # Heun's corrector, at the predicted point
        self.timesteps = [self.sigmas[i] for i, _ in self.plan]
        self.position = 0
        self.start = self.slope = None  # a Heun step's starting point and its first velocity
        self.init_noise_sigma = 1.0
        if bridge is not None:
            a, b = sd.flow.coefficients(torch.tensor([self.sigmas[0]]))
            self.init_noise_sigma = float(1 / (a + b))

    def _sigmas(self, sigma: float, latents: torch.Tensor) -> torch.Tensor:
        return torch.full((latents.shape[0],), sigma, device=latents.device)

    def model_time(self, sigma: float) -> float:
        if self.bridge is None:
            return sigma * sd.flow.TIMESTEP_MULTIPLIER
        return float(sd.flow.continuous_timesteps(torch.tensor([sigma]), self.bridge[0]))

    def scale_model_input(self, latents, sigma):
        if self.bridge is None:
            return latents
        return sd.flow.bridge_inputs(latents, self._sigmas(float(sigma), latents), self.bridge[0])[0]

    def velocity(self, prediction, sigma: float, latents):
        if self.bridge is None:
            return prediction.float()
        return sd.flow.bridge_velocity(prediction, self.scale_model_input(latents, sigma),
                                       self._sigmas(sigma, latents), self.bridge[1])

    def step(self, prediction, sigma, latents):
        i, first = self.plan[self.position]
        self.position += 1
        v = self.velocity(prediction, float(sigma), latents)
        if first:
            dt = self.sigmas[i + 1] - self.sigmas[i]
            if self.heun and self.sigmas[i + 1] != 0:  # the corrector evaluates at the predicted point
                self.start, self.slope = latents.float(), v
            return latents.float() + dt * v
        dt = self.sigmas[i] - self.sigmas[i - 1]
        return self.start + dt * 0.5 * (self.slope + v)


# ---------------------------------------------------------------------------------------------
# LCM: latent consistency models (Luo et al. 2023, arXiv:2310.04378)
# ---------------------------------------------------------------------------------------------

LCM_ORIGINAL_STEPS = 50  # the DDIM-solver schedule a latent consistency model is distilled on (k = 20)
LCM_DEFAULT_STEPS = 4
# SD_ImageGen.py's steps when none are given: 100 for the first-order samplers (fewer proved too few for
# faces with DDIM), 25 for DPM++ 2M, whose second order converges in a quarter of them; on the flow ODE,
# whose paths are straighter, 50 for Euler and 25 for Heun (49 evaluations)
SAMPLER_STEPS = {"ddim": 100, "euler": 100, "dpm++": 25, "lcm": LCM_DEFAULT_STEPS, "onestep": 1, "flow_euler": 50,
                 "flow_heun": 25}
LCM_DEFAULT_CFG = 1.0  # the distillation folds guidance into the model (the paper's w); 1 runs one branch


def lcm_timesteps(num_steps: int, num_train_timesteps: int = sd.model.NUM_TRAIN_TIMESTEPS,
                  original_steps: int = LCM_ORIGINAL_STEPS) -> list[int]:
    """Timesteps, highest first: ``num_steps`` evenly spaced by index over the distillation schedule
    ``k - 1, 2k - 1, ..., T - 1`` (``k = T // original_steps``), e.g. 4 steps -> 999, 759, 499, 259.

    The model is consistent only on that schedule's points, so the first is always the last timestep,
    whatever the model's spacing (diffusers' LCMScheduler ignores ``timestep_spacing`` the same way).
    """
    if not 1 <= num_steps <= original_steps:
        raise ValueError(f"lcm steps must be in 1..{original_steps} (the {original_steps}-step schedule a latent "
                         f"consistency model is distilled on), got {num_steps}")
    k = num_train_timesteps // original_steps
    return [(original_steps - i * original_steps // num_steps) * k - 1 for i in range(num_steps)]


def lcm_boundary_scalings(timesteps: torch.Tensor, timestep_scaling: float = 10.0, sigma_data: float = 0.5):
    """``(c_skip, c_out)``, float32 tensors shaped like ``timesteps``, for the consistency function
    ``f(x_t, t) = c_skip(t) * x_t + c_out(t) * x0_hat``.

    The boundary condition f(x, 0) = x (Song et al. 2023, arXiv:2303.01469, section 3; LCM's section
    4.1) holds through c_skip(0) = 1 and c_out(0) = 0. t is scaled by 10, as the released LCM models and
    diffusers' LCMScheduler do, so that from t = 19 on c_skip < 1e-5: f is then essentially the x0.
    """
    scaled = timesteps.float() * timestep_scaling
    c_skip = sigma_data**2 / (scaled**2 + sigma_data**2)
    c_out = scaled / (scaled**2 + sigma_data**2) ** 0.5
    return c_skip, c_out


def sampler_defaults(sampler: str, steps: int | None, cfg: float | None, default_steps: int,
                     default_cfg: float) -> tuple[int, float]:
    """``steps`` and ``cfg`` as a command line gave them, or, left out (None), the sampler's defaults:
    LCM's 4 steps at guidance 1 (a consistency model makes its image in 1-8 steps, and its distillation
    already applied guidance: it is sampled at 1 to 2), the caller's own for the others."""
    if sampler == "lcm":
        default_steps, default_cfg = LCM_DEFAULT_STEPS, LCM_DEFAULT_CFG
    elif sampler == "onestep":  # a DMD generator: guidance is folded in; its own steps come from its records
        default_cfg = LCM_DEFAULT_CFG
    return (default_steps if steps is None else steps, default_cfg if cfg is None else cfg)


class LCM:
    """Multistep latent consistency sampling (Luo et al. 2023, Algorithm 1): at each timestep the
    consistency function maps x_t to a clean estimate; every step but the last diffuses it again to the
    next timestep with fresh noise, image i's drawn from ``generators[i]`` (torch's global generator
    when None). Equal to diffusers' ``LCMScheduler`` with ``original_inference_steps=50``.
    """

    init_noise_sigma = 1.0

    def __init__(self, steps: int, alphas_cumprod: torch.Tensor, prediction_type: str,
                 generators: list[torch.Generator] | None = None):
        self.timesteps = lcm_timesteps(steps, len(alphas_cumprod))
        self.following = dict(zip(self.timesteps, self.timesteps[1:] + [None]))
        # float32 before it goes to the device (MPS has no float64): the same values predicted_x0 and
        # add_noise would take from float64, as they cast after indexing.
        self.alphas_cumprod = alphas_cumprod.float()
        self.prediction_type = prediction_type
        self.generators = generators

    def scale_model_input(self, latents, timestep):
        return latents

    def step(self, prediction, timestep, latents):
        t = torch.full((latents.shape[0],), int(timestep), device=latents.device)
        x0 = sd.model.predicted_x0(latents, prediction, t, self.alphas_cumprod, self.prediction_type)
        c_skip, c_out = lcm_boundary_scalings(t.view(-1, 1, 1, 1))
        denoised = c_out * x0 + c_skip * latents.float()
        following = self.following[int(timestep)]
        if following is None:
            return denoised
        noise = image_noise(self.generators, latents.shape[1:], len(latents)).to(latents.device)
        return sd.model.add_noise(denoised, noise, torch.full_like(t, following), self.alphas_cumprod)


# ---------------------------------------------------------------------------------------------
# onestep: DMD generators (Yin et al. 2024, arXiv:2405.14867)
# ---------------------------------------------------------------------------------------------

ONESTEP_MAX = 4
DISTILLED_SAMPLERS = {"lcm": "lcm", "dmd": "onestep"}  # Pipeline.distilled: its sampler of --sampler auto


def onestep_timesteps(steps: int, num_train_timesteps: int = sd.model.NUM_TRAIN_TIMESTEPS) -> list[int]:
    """A DMD generator's timesteps, highest first: 999 for one step; 999, 749, 499, 249 for four (DMD2's
    ``denoising_step_list``, what ``sd.train.objectives.dmd`` trains on)."""
    if not 1 <= steps <= ONESTEP_MAX:
        raise ValueError(f"onestep takes 1 to {ONESTEP_MAX} steps (a DMD generator's), got {steps}")
    return list(range(num_train_timesteps - 1, 0, -(num_train_timesteps // steps)))[:steps]


class OneStep:
    """A DMD generator's sampling: from pure noise at 999 its prediction is taken as the clean image; with several
    steps every one but the last noises that image again to the next timestep with fresh noise (image i's from
    ``generators[i]``), as the generator was trained. A flow model's timestep t is ``sigma = (t + 1) / 1000``.
    In ComfyUI: the LCM sampler with the sgm_uniform scheduler at CFG 1 (docs/sampling.md)."""

    init_noise_sigma = 1.0

    def __init__(self, steps: int, alphas_cumprod: torch.Tensor, prediction_type: str,
                 generators: list[torch.Generator] | None = None):
        self.timesteps = onestep_timesteps(steps, len(alphas_cumprod))
        self.following = dict(zip(self.timesteps, self.timesteps[1:] + [None]))
        self.alphas_cumprod = alphas_cumprod.float()
        self.prediction_type = prediction_type
        self.generators = generators

    def sigma(self, timestep: int) -> float:
        return (int(timestep) + 1) / len(self.alphas_cumprod)

    def model_time(self, timestep) -> int | float:
        return self.sigma(timestep) * sd.flow.TIMESTEP_MULTIPLIER if self.prediction_type == "flow" else int(timestep)

    def scale_model_input(self, latents, timestep):
        return latents

    def step(self, prediction, timestep, latents):
        t = torch.full((latents.shape[0],), int(timestep), device=latents.device)
        if self.prediction_type == "flow":
            x0 = latents.float() - self.sigma(timestep) * prediction.float()
        else:
            x0 = sd.model.predicted_x0(latents, prediction, t, self.alphas_cumprod, self.prediction_type)
        following = self.following[int(timestep)]
        if following is None:
            return x0
        noise = image_noise(self.generators, latents.shape[1:], len(latents)).to(latents.device)
        if self.prediction_type == "flow":
            return sd.flow.noised(x0, noise, torch.full_like(t, following).float().add(1) / len(self.alphas_cumprod))
        return sd.model.add_noise(x0, noise, torch.full_like(t, following), self.alphas_cumprod)


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


def guided_prediction(unet, latents, timestep: int | float, cond, uncond, guidance_scale: float):
    """Classifier-free guidance: ``uncond + s * (cond - uncond)``.

    ``uncond`` is the negative prompt's embedding (the empty prompt's when there is none). At scale 1
    the unconditional branch is not run at all: the result is the conditional prediction exactly.
    ``timestep``: an integer DDPM timestep, or a float (a flow model's ``sigma * 1000``, a bridged
    model's continuous timestep).
    """
    dtype = next(unet.parameters()).dtype
    kind = torch.float32 if isinstance(timestep, float) else torch.long
    t = torch.full((latents.shape[0],), timestep, device=latents.device, dtype=kind)
    if guidance_scale == 1.0:
        return unet(latents.to(dtype), t, encoder_hidden_states=cond.to(dtype)).sample.float()
    both = unet(
        torch.cat([latents, latents]).to(dtype),
        torch.cat([t, t]),
        encoder_hidden_states=torch.cat([uncond, cond]).to(dtype),
    ).sample.float()
    pred_uncond, pred_cond = both.chunk(2)
    return pred_uncond + guidance_scale * (pred_cond - pred_uncond)


@torch.no_grad()
def sample_latents(unet, noise: torch.Tensor, cond: torch.Tensor, uncond: torch.Tensor, *, sampler: str = "ddim",
                   steps: int = 100, cfg: float = 7.5, prediction_type: str = "epsilon", alphas_cumprod=None,
                   progress: bool = False, zero_terminal_snr: bool = False,
                   stop: Callable[[], bool] | None = None,
                   generators: list[torch.Generator] | None = None, flow_shift: float = 1.0) -> torch.Tensor:
    """Denoise unit-variance ``noise`` ``(B, 4, H/8, W/8)`` into scaled latents.

    ``cond`` / ``uncond``: ``(B, 77, D)`` prompt and negative-prompt embeddings. ``zero_terminal_snr``:
    the model was trained on that schedule (see ``make_scheduler``). ``stop``: asked before each step;
    True raises ``Interrupted``. ``generators``: the images' own, which drew ``noise`` (LCM's later noise).
    ``flow_shift``: the flow samplers' time shift.
    """
    scheduler = make_scheduler(sampler, steps, prediction_type, alphas_cumprod, noise.device, zero_terminal_snr,
                               generators, flow_shift)
    latents = noise.float() * scheduler.init_noise_sigma
    timesteps = scheduler.timesteps
    if progress:
        from tqdm.auto import tqdm

        timesteps = tqdm(timesteps, desc=sampler, leave=False)
    for t in timesteps:
        if stop is not None and stop():
            raise Interrupted
        model_input = scheduler.scale_model_input(latents, t)
        time = scheduler.model_time(t) if isinstance(scheduler, (Flow, OneStep)) else int(t)
        prediction = guided_prediction(unet, model_input, time, cond, uncond, cfg)
        latents = scheduler.step(prediction, t, latents)
    return latents


def seed_generators(seeds: list[int]) -> list[torch.Generator]:
    """One CPU generator per image, seeded with its seed."""
    return [torch.Generator().manual_seed(s) for s in seeds]


def image_noise(generators: list[torch.Generator] | None, shape: tuple[int, ...], batch: int) -> torch.Tensor:
    """CPU noise ``(batch, *shape)``, image i's drawn from ``generators[i]``: it depends on the image's
    seed and how much was drawn before, not on the device or the batch (as diffusers' pipelines draw
    with a list of generators). None: all of it from torch's global generator."""
    if generators is None:
        return torch.randn((batch, *shape))
    if len(generators) != batch:
        raise ValueError(f"{len(generators)} generators for a batch of {batch} images: give one per image")
    return torch.stack([torch.randn(shape, generator=g) for g in generators])


def initial_noise(seeds: list[int], shape: tuple[int, int, int]) -> torch.Tensor:
    """One CPU generator per image: the same seed gives the same noise on any device and batch size."""
    return image_noise(seed_generators(seeds), shape, len(seeds))


@torch.no_grad()
def generate(pipe: Pipeline, prompt: str, negative: str, seeds: list[int], *, steps: int, cfg: float,
             sampler: str = "ddim", height: int, width: int, batch_size: int = 4,
             device: torch.device | None = None, stop: Callable[[], bool] | None = None,
             control: torch.Tensor | None = None, control_scale: float = 1.0) -> list[np.ndarray]:
    """RGB uint8 images ``(H, W, 3)`` of ``prompt``, one per seed, decoded by the pipeline's VAE.

    ``control``: ``(1, 3, height, width)`` in [0, 1], the conditioning image of every one of them, when
    ``pipe.unet`` is a ``sd.controlnet.model.ControlledUNet``; ``control_scale`` scales its residuals."""
    device = device or next(pipe.unet.parameters()).device
    ids = sd.model.tokenize(pipe.tokenizer, [prompt, negative])
    embeddings = sd.model.encode_prompt_ids(pipe.text_encoder, ids).float().to(device)  # the encoder may wait on the CPU
    cond, uncond = embeddings[:1], embeddings[1:]
    images = []
    for start in range(0, len(seeds), batch_size):
        chunk = seeds[start : start + batch_size]
        images += decode_samples(pipe, cond.expand(len(chunk), -1, -1), uncond.expand(len(chunk), -1, -1), chunk,
                                 steps=steps, cfg=cfg, sampler=sampler, height=height, width=width, device=device,
                                 stop=stop, control=control, control_scale=control_scale)
    return images


@torch.no_grad()
def generate_batch(pipe: Pipeline, prompts: list[str], negative: str, seeds: list[int], *, steps: int, cfg: float,
                   sampler: str = "ddim", height: int, width: int, device: torch.device | None = None,
                   stop: Callable[[], bool] | None = None) -> list[np.ndarray]:
    """One image per ``(prompt, seed)`` pair, all in one batch (an evaluation's prompt set).

    Image i's noise depends on ``seeds[i]`` alone (as in ``generate``); the batch itself is part of the
    arithmetic, so a caller that wants the same pixels every time keeps its batches the same.
    """
    device = device or next(pipe.unet.parameters()).device
    ids = sd.model.tokenize(pipe.tokenizer, [*prompts, negative])
    embeddings = sd.model.encode_prompt_ids(pipe.text_encoder, ids).float().to(device)
    cond, uncond = embeddings[:-1], embeddings[-1:].expand(len(prompts), -1, -1)
    return decode_samples(pipe, cond, uncond, seeds, steps=steps, cfg=cfg, sampler=sampler, height=height,
                          width=width, device=device, stop=stop)


def decode_samples(pipe: Pipeline, cond: torch.Tensor, uncond: torch.Tensor, seeds: list[int], *, steps: int,
                   cfg: float, sampler: str, height: int, width: int, device: torch.device,
                   stop: Callable[[], bool] | None = None, control: torch.Tensor | None = None,
                   control_scale: float = 1.0) -> list[np.ndarray]:
    """Sample one batch (``cond`` / ``uncond``: ``(B, 77, D)``, one seed each) and decode it to uint8 RGB;
    ``control``: see ``generate``."""
    factor = float(pipe.vae.config.scaling_factor)
    vae_dtype = next(pipe.vae.parameters()).dtype
    generators = seed_generators(seeds)
    noise = image_noise(generators, (pipe.unet.config.in_channels, height // 8, width // 8), len(seeds)).to(device)
    if control is not None and tuple(control.shape[-2:]) != (height, width):
        raise ValueError(f"a control image of {control.shape[-1]}x{control.shape[-2]} for samples of {width}x{height}")
    controlling = pipe.unet.controlling(control.to(device), control_scale) if control is not None \
        else contextlib.nullcontext()
    with sd.model.attention_context(device), controlling:
        latents = sample_latents(pipe.unet, noise, cond, uncond, sampler=sampler, steps=steps, cfg=cfg,
                                 prediction_type=pipe.prediction_type, zero_terminal_snr=pipe.zero_terminal_snr,
                                 stop=stop, generators=generators, flow_shift=pipe.flow_shift)
        pixels = pipe.vae.decode(sd.model.unscale_latents(latents, factor).to(vae_dtype)).sample
    pixels = ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return list(pixels.permute(0, 2, 3, 1).cpu().numpy())


def grid_label(prompt: str, width_px: int) -> list[str]:
    """A prompt's lines above its row of a grid: wrapped to the row's width (the default font is about
    6 px a character), at most GRID_LABEL_LINES of them, the last ending in "..." when cut."""
    import textwrap

    lines = textwrap.wrap(prompt, max(8, width_px // 6)) or [""]
    if len(lines) > GRID_LABEL_LINES:
        lines = lines[:GRID_LABEL_LINES]
        lines[-1] = lines[-1][: max(0, max(8, width_px // 6) - 3)] + "..."
    return lines


def save_grid(path, rows: list[tuple[str, list[np.ndarray]]]) -> None:
    """Each prompt's images side by side under its whole text (wrapped); a grid of one image per prompt
    (the validation grid) packs the prompts about as many across as down. Images narrower than
    GRID_MIN_CELL_PX are scaled up by a whole factor (each pixel a square block), so that a caption
    fits above them. Written atomically as PNG; ``grid_cell`` reads an image back."""
    from PIL import Image, ImageDraw

    height, width = rows[0][1][0].shape[:2]
    layout = GridLayout.of([prompt for prompt, _ in rows], max(len(images) for _, images in rows), height, width)
    grid = Image.new("RGB", layout.size, "white")
    draw = ImageDraw.Draw(grid)
    for r, (prompt, images) in enumerate(rows):
        left, top = layout.block(r)
        for i, line in enumerate(grid_label(prompt, layout.block_width)):
            draw.text((left + 2, top + 2 + i * GRID_LABEL_PX), line, fill="black")
        for c, image in enumerate(images):
            big = np.repeat(np.repeat(image, layout.scale, axis=0), layout.scale, axis=1)
            grid.paste(Image.fromarray(big), layout.cell(r, c))
    sd.files.save_png_atomic(path, grid)


GRID_LABEL_PX = 16  # the text strip above each row of a grid: one line of text
GRID_LABEL_LINES = 6
GRID_MIN_CELL_PX = 128  # narrower images are scaled up: a caption above a 64 px picture is unreadable


@dataclass(frozen=True)
class GridLayout:
    """Where ``save_grid`` puts things: ``per_row`` blocks (a prompt's text over its ``images`` images) in
    each row of blocks, each image ``scale`` times its size."""

    prompts: int
    images: int
    height: int
    width: int
    scale: int
    per_row: int
    label: int  # the text strip's height above every block

    @classmethod
    def of(cls, prompts: list[str], images: int, height: int, width: int) -> "GridLayout":
        scale = max(1, -(-GRID_MIN_CELL_PX // width))
        per_row = math.ceil(math.sqrt(len(prompts))) if images == 1 else 1
        label = GRID_LABEL_PX * max(len(grid_label(p, images * width * scale)) for p in prompts)
        return cls(len(prompts), images, height, width, scale, per_row, label)

    @property
    def block_width(self) -> int:
        return self.images * self.width * self.scale

    @property
    def size(self) -> tuple[int, int]:
        rows = math.ceil(self.prompts / self.per_row)
        return self.per_row * self.block_width, rows * (self.label + self.height * self.scale)

    def block(self, prompt: int) -> tuple[int, int]:
        """The top-left corner of prompt ``prompt``'s block (its text)."""
        row, column = divmod(prompt, self.per_row)
        return column * self.block_width, row * (self.label + self.height * self.scale)

    def cell(self, prompt: int, image: int) -> tuple[int, int]:
        """The top-left corner of image ``image`` of prompt ``prompt``."""
        left, top = self.block(prompt)
        return left + image * self.width * self.scale, top + self.label


def grid_cell(grid: np.ndarray, row: int, column: int, height: int, width: int, prompts: list[str],
              images: int = 1) -> np.ndarray:
    """Image ``column`` of prompt ``row`` of a grid of ``prompts`` with ``images`` images each written by
    ``save_grid``, at its own size."""
    layout = GridLayout.of(prompts, images, height, width)
    left, top = layout.cell(row, column)
    cell = grid[top : top + height * layout.scale, left : left + width * layout.scale]
    return cell[:: layout.scale, :: layout.scale]


# ---------------------------------------------------------------------------------------------
# Compiling and writing images
# ---------------------------------------------------------------------------------------------

COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune")


def compile_unet(unet, mode: str):
    """``unet`` compiled with a ``torch.compile`` mode from COMPILE_MODES; ``"off"`` returns it as it is."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {COMPILE_MODES}, got {mode!r}")
    return unet if mode == "off" else torch.compile(unet, mode=None if mode == "default" else mode)


def parameters_text(prompt: str, negative: str, seed: int, settings, source: str, clip_skip: int = 1) -> str:
    """The A1111-style ``parameters`` chunk: prompt, negative prompt, then the settings on one line
    (``settings``: ``steps``, ``sampler``, ``cfg``, ``width``, ``height``); ``Clip skip: N`` above 1, as
    AUTOMATIC1111 writes it."""
    skip = f", Clip skip: {clip_skip}" if clip_skip > 1 else ""
    return (f"{prompt}\nNegative prompt: {negative}\nSteps: {settings.steps}, Sampler: {settings.sampler}, "
            f"CFG scale: {settings.cfg}, Seed: {seed}, Size: {settings.width}x{settings.height}, Model: {source}{skip}")


def save_png(path: Path, image: np.ndarray, parameters: str) -> None:
    """``image`` (uint8 RGB) as a PNG with its ``parameters`` text chunk, written atomically."""
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("parameters", parameters)
    sd.files.write_atomic(path, lambda tmp: Image.fromarray(image).save(tmp, format="PNG", pnginfo=info))


def read_parameters(path: Path) -> str:
    """The ``parameters`` text chunk of a PNG written by ``save_png``."""
    from PIL import Image

    with Image.open(path) as image:
        return image.text["parameters"]

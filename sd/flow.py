"""Flow matching (rectified flow) for SD 1.x: the straight path between image and noise.

Conventions are diffusers' and ComfyUI's (``FlowMatchEulerDiscreteScheduler``, ``ModelSamplingSD3``):
sigma in [0, 1] is the fraction of noise, ``x_sigma = (1 - sigma) x0 + sigma eps``, the model predicts the
velocity ``v = eps - x0`` (so ``dx / dsigma = v``), its time input is ``sigma * 1000``, and a sampler
integrates sigma from 1 down to 0. Two ways to train it:

* ``prediction_type: flow``: the UNet itself is a flow model (its input is x_sigma unscaled, its output
  the velocity). A file of it samples in diffusers through ``FlowMatchEulerDiscreteScheduler`` and in
  ComfyUI behind a ``ModelSamplingSD3`` node.
* ``flow_matching: true`` on an epsilon or v_prediction model (the diff2flow mapping, Schusterbauer et
  al. 2025, arXiv:2506.02221): the UNet keeps its parametrisation, time input and input scale; the flow
  model is that UNet seen through ``bridge_inputs`` and ``bridge_velocity``. At every DDPM timestep the
  flow sigma is ``sqrt(1 - abar) / (sqrt(abar) + sqrt(1 - abar))``, and the DDPM point is the flow point
  times ``sqrt(abar) + sqrt(1 - abar)``; so the first step of a fine-tune starts from all the base knows,
  and its files stay epsilon or v models any tool samples (DDIM at timestep T is Euler on the flow at
  sigma(T)). The sigmas it covers are its schedule's: 0.028 to 0.936 for SD 1.x.

Every function takes tensors and returns float32 tensors, with no host reads (``sd.train.memory``
builds the training step on fake tensors).
"""

from __future__ import annotations

import math

import torch

import sd.model

TIMESTEP_MULTIPLIER = sd.model.NUM_TRAIN_TIMESTEPS  # the UNet's time input is sigma * 1000
DENSITIES = ("logit_normal", "uniform")
SHIFT_RANGE = (0.1, 10.0)  # the time shifts trained and sampled (both ends in): beyond, every step lands at one end


def check_shift(value, where: str) -> float:
    """``value`` as a time shift, or a ``ValueError`` naming ``where`` and ``SHIFT_RANGE`` (the one rule for
    the training config, the samplers' flag and the shift a file records)."""
    try:
        shift = float(value)
    except (TypeError, ValueError):
        shift = math.nan
    low, high = SHIFT_RANGE
    if isinstance(value, bool) or not low <= shift <= high:
        raise ValueError(f"{where}: flow shift {value!r} is outside [{low:g}, {high:g}] (1 = no shift; SD3 samples at 3)")
    return shift


SIGMA_MIN = 1 / TIMESTEP_MULTIPLIER  # the smallest sigma diffusers' Euler visits before 0 (shift 1)


def shifted(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3's time shift ``shift * s / (1 + (shift - 1) s)`` (diffusers' ``shift``, ComfyUI's
    ``time_snr_shift``): above 1, more of the steps and of the training at high noise."""
    if shift == 1.0:
        return sigmas
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def unshifted(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """``shifted``'s inverse."""
    if shift == 1.0:
        return sigmas
    return sigmas / (shift - (shift - 1) * sigmas)


def sample_sigmas(batch_size: int, generator: torch.Generator, density: str = "logit_normal", mean: float = 0.0,
                  std: float = 1.0, shift: float = 1.0) -> torch.Tensor:
    """Training sigmas ``(B,)`` float32 drawn from ``generator``: ``logit_normal`` ``sigmoid(N(mean, std))``
    (SD3's default), ``uniform`` on [0, 1); then ``shifted``."""
    device = generator.device
    if density == "logit_normal":
        u = torch.sigmoid(mean + std * torch.randn((batch_size,), generator=generator, device=device))
    elif density == "uniform":
        u = torch.rand((batch_size,), generator=generator, device=device)
    else:
        raise ValueError(f"flow_density must be one of {', '.join(DENSITIES)}, got {density!r}")
    return shifted(u, shift)


def _per_sample(sigmas: torch.Tensor, ndim: int) -> torch.Tensor:
    return sigmas.float().reshape(-1, *([1] * (ndim - 1)))


def noised(latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """The point at ``sigmas`` ``(B,)`` on each straight path: ``(1 - sigma) x0 + sigma eps``."""
    s = _per_sample(sigmas, latents.ndim)
    return (1 - s) * latents.float() + s * noise.float()


def velocity(latents: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The target: ``eps - x0``, the same at every point of the path."""
    return noise.float() - latents.float()


def model_timesteps(sigmas: torch.Tensor) -> torch.Tensor:
    """A flow UNet's time input: ``sigma * 1000`` (float), as diffusers and ComfyUI give it."""
    return sigmas.float() * TIMESTEP_MULTIPLIER


# ---------------------------------------------------------------------------------------------
# The diff2flow bridge: an epsilon or v_prediction UNet as a flow model
# ---------------------------------------------------------------------------------------------


def schedule_sigmas(alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """The flow sigma of each DDPM timestep, float64 ``(T,)``, increasing:
    ``sqrt(1 - abar) / (sqrt(abar) + sqrt(1 - abar))``."""
    a, b = alphas_cumprod.double().sqrt(), (1 - alphas_cumprod.double()).sqrt()
    return b / (a + b)


def bridge_range(alphas_cumprod: torch.Tensor) -> tuple[float, float]:
    """The sigmas a bridged model covers: its first and last timesteps' (0.028 and 0.936 for SD 1.x)."""
    sigmas = schedule_sigmas(alphas_cumprod)
    return float(sigmas[0]), float(sigmas[-1])


def clamped(sigmas: torch.Tensor, alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """``sigmas`` held inside the bridged model's range (``bridge_range``), float32."""
    table = schedule_sigmas(alphas_cumprod).to(sigmas.device)
    return sigmas.float().clamp(table[0].float(), table[-1].float())


def bridge_inputs(sample: torch.Tensor, sigmas: torch.Tensor, alphas_cumprod: torch.Tensor):
    """What a bridged UNet is given for the flow point ``sample`` at ``sigmas`` ``(B,)`` (inside
    ``bridge_range``): the DDPM point ``(sqrt(abar) + sqrt(1 - abar)) x`` and its continuous timestep.

    abar is the sigma's own (``sigma / (1 - sigma) = sqrt((1 - abar) / abar)``); the timestep is where the
    schedule's log-SNR equals it, interpolated linearly between the two timesteps around it, so that at
    ``schedule_sigmas``' values it is that timestep exactly.
    """
    a, b = coefficients(sigmas)
    x = (a + b).reshape(-1, *([1] * (sample.ndim - 1))) * sample.float()
    return x, continuous_timesteps(sigmas, alphas_cumprod)


def continuous_timesteps(sigmas: torch.Tensor, alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """The DDPM timestep (float32, 0 to T - 1) whose log-SNR is that of each flow sigma."""
    table = alphas_cumprod.to(sigmas.device, torch.float64)
    log_snr = (table / (1 - table)).log()  # decreasing in t
    s = sigmas.double()
    wanted = 2 * ((1 - s) / s).log()
    last = len(table) - 1
    above = torch.searchsorted(-log_snr, -wanted).clamp(1, last)  # first t whose log-SNR is <= wanted
    lo, hi = log_snr[above - 1], log_snr[above]
    t = (above - 1).double() + ((lo - wanted) / (lo - hi)).clamp(0, 1)
    return t.float()


def coefficients(sigmas: torch.Tensor):
    """sqrt(abar) and sqrt(1 - abar) of a flow sigma, float32 ``(B,)``."""
    s = sigmas.double()
    ratio = s / (1 - s)  # sqrt((1 - abar) / abar)
    a = (1 + ratio.square()).rsqrt()
    return a.float(), (ratio * a).float()


def bridge_velocity(output: torch.Tensor, model_input: torch.Tensor, sigmas: torch.Tensor,
                    prediction_type: str) -> torch.Tensor:
    """The flow velocity ``eps - x0`` a bridged UNet's ``output`` implies at its DDPM input ``model_input``."""
    a, b = (_per_sample(c, output.ndim) for c in coefficients(sigmas))
    x, out = model_input.float(), output.float()
    if prediction_type == "epsilon":
        eps, x0 = out, (x - b * out) / a
    elif prediction_type == "v_prediction":
        eps, x0 = a * out + b * x, a * x - b * out
    else:
        raise ValueError(f"the flow bridge takes an epsilon or v_prediction model, got {prediction_type!r}")
    return eps - x0


# ---------------------------------------------------------------------------------------------
# Sampling: Euler and Heun on the flow ODE
# ---------------------------------------------------------------------------------------------


def euler_sigmas(steps: int, shift: float = 1.0, bridge: tuple[float, float] | None = None) -> list[float]:
    """The ``steps + 1`` sigmas of an ``steps``-step sampler, from the noisiest to 0.

    A flow model: diffusers' ``FlowMatchEulerDiscreteScheduler.set_timesteps`` exactly, evenly spaced
    from 1 to the shifted ``SIGMA_MIN`` and then shifted (so that end is shifted twice, as there). A
    bridged model (``bridge``: its range): evenly spaced in unshifted sigma between its ends, then
    shifted, so the steps span the sigmas the model knows.
    """
    if bridge is None:
        top, bottom = 1.0, float(shifted(torch.tensor(SIGMA_MIN, dtype=torch.float64), shift))
    else:
        top, bottom = (float(unshifted(torch.tensor(s, dtype=torch.float64), shift)) for s in reversed(bridge))
    spaced = torch.linspace(top * TIMESTEP_MULTIPLIER, bottom * TIMESTEP_MULTIPLIER, steps,
                            dtype=torch.float64) / TIMESTEP_MULTIPLIER
    sigmas = shifted(spaced, shift).float()  # float32 as diffusers keeps them
    if bridge is not None:
        sigmas = sigmas.clamp(bridge[0], bridge[1])
    return sigmas.tolist() + [0.0]

"""Post-hoc EMA (Karras et al. 2024, "Analyzing and Improving the Training Dynamics of Diffusion Models",
section 3): an EMA of any length chosen after training, from snapshots of two EMAs kept during it.

Each kept EMA has a power-function profile: after optimizer step t (1-based) it folds the weights in with
decay (1 - 1/t)^(gamma + 1), so it averages the whole run with weights growing as t'^gamma. Its length is
``sigma_rel``, the standard deviation of that profile relative to the run's length; ``PROFILES`` keeps
0.05 and 0.10. What trains in the text encoder (a LoRA's text adapter, a pivotal run's token) has its two
EMAs beside the UNet's, under ``text_encoder.`` + its name. Every ``posthoc_ema_every`` steps all are
written to ``OUT_DIR/posthoc_ema/`` (fp16, a file a snapshot). Any profile (``sigma_rel``, at any
snapshot's step) is, to a good approximation, a linear combination of the stored ones: the coefficients solve the least-squares problem of the profiles'
inner products in closed form (``coefficients``), and ``reconstruct`` sums the snapshots with them,
tensor by tensor (memory: one tensor of each snapshot at a time).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

import sd.files
import sd.train.ema
from sd.run_folder import EMA_TEXT_PREFIX

PROFILES = (0.05, 0.10)  # sigma_rel of the two EMAs kept during training
FOLDER = "posthoc_ema"  # in the run folder
SNAPSHOT = re.compile(r"^step_(\d{8})\.safetensors$")


def gamma_of(sigma_rel: float) -> float:
    """The exponent of the power-function profile of relative width ``sigma_rel``: the root of
    sigma_rel^2 = (gamma + 1) / ((gamma + 2)^2 (gamma + 3))."""
    if not 0 < sigma_rel < 12 ** -0.5:  # gamma -> -1 as sigma_rel -> 1/sqrt(12) (a flat profile)
        raise ValueError(f"sigma_rel must be in (0, {12 ** -0.5:.4f}), got {sigma_rel}")
    t = sigma_rel ** -2
    return float(np.roots([1.0, 7.0, 16.0 - t, 12.0 - t]).real.max())


def key(sigma_rel: float, name: str) -> str:
    """A kept EMA's tensor in a checkpoint or snapshot file."""
    return f"sigma_rel_{sigma_rel:g}/{name}"


class PowerEMA(sd.train.ema.EMA):
    """An EMA whose decay after step t (1-based) is (1 - 1/t)^(gamma + 1): a power-function profile."""

    def __init__(self, model, sigma_rel: float, device=None, trainable_only: bool = False):
        super().__init__(model, 0.0, device=device, trainable_only=trainable_only)
        self.sigma_rel, self.gamma = sigma_rel, gamma_of(sigma_rel)

    def weight_at(self, step: int) -> float:
        return 1.0 - (1.0 - 1.0 / (step + 1)) ** (self.gamma + 1.0)


def update_all(emas: list[PowerEMA], model, step: int, skip: torch.Tensor | None = None, view=None) -> None:
    """Every kept EMA after step ``step``, from one copy of the live weights (in host memory, one copy off
    the GPU a step, not one per EMA)."""
    if not emas:
        return
    params = emas[0].parameters(model)
    live = emas[0]._live_weights(view(params) if view is not None else [p.detach() for p in params])
    for ema in emas:
        ema.fold(live, ema.weight_at(step), skip)


class PosthocWeights:
    """The kept EMAs as one checkpoint entry (``posthoc_ema.safetensors``), each under ``key``: the UNet's
    (``emas``) by their names, the text encoder's (``text_emas``) by ``text_encoder.`` + their names."""

    def __init__(self, emas: list[PowerEMA], text_emas: list[PowerEMA] = ()):
        self.parts = [(ema, "") for ema in emas] + [(ema, EMA_TEXT_PREFIX) for ema in text_emas]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {key(ema.sigma_rel, part + name): tensor for ema, part in self.parts
                for name, tensor in ema.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for ema, part in self.parts:
            prefix = key(ema.sigma_rel, part)
            ema.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)
                                 and (part or not k[len(prefix):].startswith(EMA_TEXT_PREFIX))})


# ---------------------------------------------------------------------------------------------
# Snapshots
# ---------------------------------------------------------------------------------------------


def snapshot_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / FOLDER / f"step_{step:08d}.safetensors"


def write_snapshot(run_dir: Path, step: int, emas: list[PowerEMA], text_emas: list[PowerEMA] = ()) -> Path:
    """The kept EMAs at ``step`` (``PosthocWeights``' tensors), in fp16, atomically (rank 0)."""
    from safetensors.torch import save_file

    path = snapshot_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float16).contiguous()
               for k, v in PosthocWeights(emas, text_emas).state_dict().items()}
    header = {"step": str(step), "profiles": json.dumps({f"{e.sigma_rel:g}": e.gamma for e in emas})}
    sd.files.write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=header))
    return path


def snapshots(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, file)`` of every snapshot of a run, in step order."""
    folder = Path(run_dir) / FOLDER
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := SNAPSHOT.match(p.name))] if folder.is_dir() else []
    return sorted(found)


def remove_after(run_dir: Path, step: int) -> list[Path]:
    """Delete the snapshots of steps after ``step`` (a resume from ``step``: they belong to steps the
    resumed run takes again, and would be written again)."""
    removed = [path for s, path in snapshots(run_dir) if s > step]
    for path in removed:
        path.unlink()
    return removed


# ---------------------------------------------------------------------------------------------
# Reconstruction
# ---------------------------------------------------------------------------------------------


def profile_dot(t_a, gamma_a, t_b, gamma_b):
    """The inner product of the power-function profiles (gamma_a at time t_a) and (gamma_b at t_b), each
    (gamma + 1) t^gamma / T^(gamma + 1) on [0, T]: the integral over [0, min(t_a, t_b)] of their product,
    written with the ratio t_a / t_b so that large times stay exact."""
    t_a, t_b, gamma_a, gamma_b = (np.asarray(x, dtype=np.float64) for x in (t_a, t_b, gamma_a, gamma_b))
    exponent = np.where(t_a < t_b, gamma_b, -gamma_a)
    return (gamma_a + 1) * (gamma_b + 1) * (t_a / t_b) ** exponent / ((gamma_a + gamma_b + 1) * np.maximum(t_a, t_b))


def coefficients(steps: list[int], gammas: list[float], target_step: int, target_gamma: float) -> np.ndarray:
    """The weights of the stored profiles (``steps[i]``, ``gammas[i]``) whose sum is nearest the target
    profile in L2: the least-squares solution of A x = b, A their inner products, b theirs with the
    target."""
    t, g = np.asarray(steps, dtype=np.float64), np.asarray(gammas, dtype=np.float64)
    a = profile_dot(t[:, None], g[:, None], t[None, :], g[None, :])
    b = profile_dot(t, g, float(target_step), float(target_gamma))
    return np.linalg.lstsq(a, b, rcond=None)[0]


def reconstruct(run_dir: Path, sigma_rel: float, step: int | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """The EMA of length ``sigma_rel`` at snapshot ``step`` (default: the last), fp32, by parameter name (the
    text encoder's under ``text_encoder.``), from the run's snapshots up to that step; returns it and the
    step."""
    from safetensors import safe_open

    found = snapshots(run_dir)
    if not found:
        raise FileNotFoundError(f"{Path(run_dir) / FOLDER}: no post-hoc EMA snapshots (train with posthoc_ema_every)")
    step = found[-1][0] if step is None else step
    used = [(s, p) for s, p in found if s <= step]
    if not used or used[-1][0] != step:
        raise FileNotFoundError(f"{Path(run_dir) / FOLDER}: no snapshot of step {step} "
                                f"(snapshots: {', '.join(str(s) for s, _ in found)})")
    handles = [safe_open(str(p), framework="pt") for _, p in used]
    rows = [(s, h, float(sigma), float(gamma)) for (s, _), h in zip(used, handles)
            for sigma, gamma in json.loads(h.metadata()["profiles"]).items()]
    weights = coefficients([r[0] for r in rows], [r[3] for r in rows], step, gamma_of(sigma_rel))
    names = sorted({k.split("/", 1)[1] for k in handles[-1].keys()})
    out = {}
    for name in names:
        total = None
        for (_, handle, sigma, _), weight in zip(rows, weights):
            tensor = handle.get_tensor(key(sigma, name)).to(torch.float64) * float(weight)
            total = tensor if total is None else total + tensor
        out[name] = total.to(torch.float32)
    return out, step

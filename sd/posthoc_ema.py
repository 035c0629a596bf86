"""Post-hoc EMA snapshots in a run folder (Karras et al. 2024, "Analyzing and Improving the Training
Dynamics of Diffusion Models", section 3): reading them and rebuilding an EMA of any length from them.

A run trained with ``posthoc_ema_every`` keeps two EMAs with power-function profiles (``sd.train.power_ema``
keeps and writes them): after optimizer step t (1-based) each folds the weights in with decay
(1 - 1/t)^(gamma + 1), so it averages the whole run with weights growing as t'^gamma. Its length is
``sigma_rel``, the standard deviation of that profile relative to the run's length (``gamma_of``). Every
snapshot ``OUT_DIR/posthoc_ema/step_NNNNNNNN.safetensors`` holds both (fp16), each tensor under ``key``; what
trains in the text encoder under ``text_encoder.`` + its name. Any profile (``sigma_rel``, at any snapshot's
step) is, to a good approximation, a linear combination of the stored ones: the coefficients solve the
least-squares problem of the profiles' inner products in closed form, scaled to sum to 1 (``coefficients``,
the paper's Algorithm 3), and ``reconstruct`` sums the snapshots with them, tensor by tensor (memory: one
tensor of each snapshot at a time). A snapshot that cannot be read is named and passed over.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

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


def snapshot_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / FOLDER / f"step_{step:08d}.safetensors"


def snapshots(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, file)`` of every snapshot of a run, in step order."""
    folder = Path(run_dir) / FOLDER
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := SNAPSHOT.match(p.name))] if folder.is_dir() else []
    return sorted(found)


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
    target, divided by its sum.

    Every profile integrates to 1 (an average of the weights), and so must their combination: the raw
    solution sums to less where the stored profiles cannot reach the target (0.87 for sigma_rel 0.25 from
    five snapshots), and would scale every rebuilt weight by that sum. The paper's Algorithm 3 (NVlabs/edm2,
    ``solve_posthoc_coefficients``) normalises the same way."""
    t, g = np.asarray(steps, dtype=np.float64), np.asarray(gammas, dtype=np.float64)
    a = profile_dot(t[:, None], g[:, None], t[None, :], g[None, :])
    b = profile_dot(t, g, float(target_step), float(target_gamma))
    x = np.linalg.lstsq(a, b, rcond=None)[0]
    return x / x.sum()


class DamagedSnapshot(ValueError):
    """A snapshot file that cannot be read; the message names it."""


def open_snapshot(path: Path):
    """A snapshot's safetensors handle and its profiles (``{sigma_rel: gamma}``), or ``ValueError`` naming
    the file when it cannot be read (cut short by a full disk, or not a snapshot): ``DamagedSnapshot``."""
    from safetensors import safe_open

    try:
        handle = safe_open(str(path), framework="pt")
        profiles = {float(s): float(g) for s, g in json.loads((handle.metadata() or {})["profiles"]).items()}
    except Exception as error:  # noqa: BLE001 - safetensors' own error types differ between versions
        raise DamagedSnapshot(f"{path} is damaged and cannot be read ({str(error).splitlines()[0] or type(error).__name__})")
    return handle, profiles


def reconstruct(run_dir: Path, sigma_rel: float, step: int | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """The EMA of length ``sigma_rel`` at snapshot ``step`` (default: the last), fp32, by parameter name (the
    text encoder's under ``text_encoder.``), from the run's snapshots up to that step; returns it and the
    step. A damaged snapshot before ``step`` is named in a warning and passed over (the others still span
    the profiles); a damaged one at ``step`` is a ``DamagedSnapshot`` naming it."""
    found = snapshots(run_dir)
    if not found:
        raise FileNotFoundError(f"{Path(run_dir) / FOLDER}: no post-hoc EMA snapshots (train with posthoc_ema_every)")
    step = found[-1][0] if step is None else step
    used = [(s, p) for s, p in found if s <= step]
    if not used or used[-1][0] != step:
        raise FileNotFoundError(f"{Path(run_dir) / FOLDER}: no snapshot of step {step} "
                                f"(snapshots: {', '.join(str(s) for s, _ in found)})")
    rows = []  # (step, file, handle, sigma_rel, gamma): one row a stored profile
    for snapshot_step, path in used:
        try:
            handle, profiles = open_snapshot(path)
        except DamagedSnapshot as error:
            if snapshot_step == step:
                raise
            log.warning("%s; passed over", error)
            continue
        rows += [(snapshot_step, path, handle, sigma, gamma) for sigma, gamma in profiles.items()]
    weights = coefficients([r[0] for r in rows], [r[4] for r in rows], step, gamma_of(sigma_rel))
    names = sorted({k.split("/", 1)[1] for k in rows[-1][2].keys()})
    out = {}
    for name in names:
        total = None
        for (_, path, handle, sigma, _), weight in zip(rows, weights):
            try:
                tensor = handle.get_tensor(key(sigma, name)).to(torch.float64) * float(weight)
            except Exception as error:  # noqa: BLE001 - a tensor missing from a snapshot written by another version
                raise ValueError(f"{path}: {key(sigma, name)} cannot be read ({error})") from None
            total = tensor if total is None else total + tensor
        out[name] = total.to(torch.float32)
    return out, step

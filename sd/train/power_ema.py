"""Post-hoc EMA in training (Karras et al. 2024, section 3; the snapshots and their reconstruction:
``sd.posthoc_ema``): the two EMAs with power-function profiles of ``PROFILES``, kept of what trains (the
UNet's, and the text encoder's beside them), resumed with the checkpoint and written every
``posthoc_ema_every`` steps to ``OUT_DIR/posthoc_ema/`` (fp16, a file a snapshot).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import sd.files
import sd.train.ema
from sd.posthoc_ema import gamma_of, key, snapshot_path, snapshots
from sd.run_folder import EMA_TEXT_PREFIX

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


def remove_after(run_dir: Path, step: int) -> list[Path]:
    """Delete the snapshots of steps after ``step`` (a resume from ``step``: they belong to steps the
    resumed run takes again, and would be written again)."""
    removed = [path for s, path in snapshots(run_dir) if s > step]
    for path in removed:
        path.unlink()
    return removed

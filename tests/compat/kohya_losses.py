"""Our loss_type, huber_schedule and debiased_estimation against kohya's sd-scripts' own functions.

    python tests/compat/kohya_losses.py PATH/TO/sd-scripts

Run by hand (a checkout of sd-scripts is not part of the suite): reads ``conditional_loss`` and
``get_huber_threshold_if_needed`` from its library/train_util.py, ``apply_debiased_estimation`` and
``prepare_scheduler_for_custom_training`` from library/custom_train_functions.py (each function's own source,
run in a namespace with torch and math, so the rest of sd-scripts need not import here), then computes the
per-sample loss of the same predictions, targets and timesteps both ways, on diffusers' DDPMScheduler with
SD 1.x's schedule, for every loss type and schedule, epsilon and v, with and without debiasing. Prints the
largest relative difference of each and exits 1 if one is over 1e-5 (float32 rounding: their SNR is
(sqrt(abar) / sqrt(1 - abar))^2, ours abar / (1 - abar); 6e-7 without debiasing, 3e-6 with it, measured).
"""

from __future__ import annotations

import ast
import math
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch
from diffusers import DDPMScheduler

import sd.model


def functions(path: Path, names: set[str]) -> dict:
    """The named top-level functions of a Python file, each defined from its own source."""
    source = path.read_text()
    namespace = {"torch": torch, "math": math, "Optional": Optional, "DDPMScheduler": DDPMScheduler,
                 "Number": float}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            exec(compile(ast.Module([node], type_ignores=[]), str(path), "exec"), namespace)
    missing = names - namespace.keys()
    if missing:
        raise SystemExit(f"{path}: no function {sorted(missing)}")
    return namespace


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    root = Path(argv[0])
    theirs = {**functions(root / "library" / "train_util.py", {"conditional_loss", "get_huber_threshold_if_needed"}),
              **functions(root / "library" / "custom_train_functions.py",
                          {"apply_debiased_estimation", "prepare_scheduler_for_custom_training"})}
    scheduler = sd.model.build_noise_scheduler("epsilon", DDPMScheduler)
    theirs["prepare_scheduler_for_custom_training"](scheduler, "cpu")
    alphas = sd.model.ddpm_alphas_cumprod()
    generator = torch.Generator().manual_seed(0)
    pred = torch.randn(8, 4, 8, 8, generator=generator)
    target = torch.randn(8, 4, 8, 8, generator=generator) * 2
    timesteps = torch.tensor([0, 1, 10, 100, 400, 700, 950, 999])
    worst = 0.0
    for loss_type in sd.model.LOSS_TYPES:
        for schedule in sd.model.HUBER_SCHEDULES if loss_type in ("huber", "smooth_l1") else ["-"]:
            for c, scale in ((0.1, 1.0), (0.3, 2.0)):
                args = SimpleNamespace(loss_type=loss_type, huber_schedule=schedule, huber_c=c, huber_scale=scale)
                kohya_c = theirs["get_huber_threshold_if_needed"](args, timesteps, scheduler)
                kohya = theirs["conditional_loss"](pred, target, loss_type, "none", kohya_c).mean(dim=(1, 2, 3))
                ours_c = (sd.model.huber_thresholds(timesteps, alphas, schedule, c, scale)
                          if loss_type in ("huber", "smooth_l1") else None)
                for prediction in ("epsilon", "v_prediction"):
                    for debiased in (False, True):
                        expected = kohya
                        if debiased:
                            expected = theirs["apply_debiased_estimation"](kohya, timesteps, scheduler,
                                                                           prediction == "v_prediction")
                        ours = sd.model.diffusion_loss(pred, target, timesteps, alphas, prediction, None, None,
                                                       loss_type, ours_c, debiased)
                        error = ((ours - expected).abs() / expected.abs().clamp(min=1e-12)).max().item()
                        worst = max(worst, error)
                        print(f"{loss_type:9} {schedule:11} c={c} scale={scale} {prediction:12} "
                              f"debiased={debiased!s:5}: largest relative difference {error:.2e}")
    print(f"largest: {worst:.2e}")
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

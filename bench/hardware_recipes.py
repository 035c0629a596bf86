"""Benchmark: each card recipe of configs/hardware/ layered over a phase, its predicted peak against the card.

    python bench/hardware_recipes.py                                  # every recipe over phase 1, DDP on 2 GPUs
    python bench/hardware_recipes.py --world_size 1 --recipes 12gb    # one recipe, one GPU

For each recipe: the phase config with the recipe over it (``--config PHASE --config RECIPE``, as a user
runs it), then ``sd.train.memory.estimate`` of one GPU's step at the recipe's micro-batch and 512 px on
CUDA (fake tensors, no GPU needed; about a minute each on a 2-core CPU), against the card's memory: a
"24 GB" card holds 24 GiB. ``peak_gb`` adds the estimator's allowances (allocator x1.10, CUDA context
0.55 GB) to the predicted allocated bytes; ``headroom_gb`` is what is left of the card after it.
Prints one row per recipe and one JSON line.
"""

from __future__ import annotations

import sys
from pathlib import Path

import sd.cli
import sd.train.memory
from sd.train.config_loading import load_config, resolve_global_batch

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("12gb", "16gb", "24gb", "48gb", "80gb")


def card_gb(recipe: str) -> float:
    """The card's memory in GB (1e9 bytes) of a recipe named for its GiB."""
    return int(recipe.removesuffix("gb")) * 2**30 / 1e9


def predict(phase: str, recipe: str, world_size: int, resolution: int = 512) -> dict:
    config = load_config(["--config", phase, "--config", str(ROOT / "configs" / "hardware" / f"{recipe}.yaml")],
                         check_paths=False)
    config = resolve_global_batch(config, world_size)
    estimate = sd.train.memory.estimate(config, resolution=resolution, world_size=world_size)
    card = card_gb(recipe)
    return {"recipe": recipe, "card_gb": round(card, 2), "batch_size": config.batch_size,
            "grad_accum": config.grad_accum, "grad_checkpointing": config.grad_checkpointing,
            "ema_device": config.ema_device, "optimizer": config.optim.name, "world_size": world_size,
            "allocated_gb": round(estimate.allocated / 1e9, 2), "peak_gb": round(estimate.peak_gb, 2),
            "headroom_gb": round(card - estimate.peak_gb, 2), "fits": estimate.peak_gb <= card}


def main(argv=None) -> int:
    parser = sd.cli.ArgumentParser(description=__doc__)
    parser.add_argument("--phase", default=str(ROOT / "configs" / "phases" / "p1_laion_broad.yaml"),
                        help="the phase config under the recipes (default: phase 1)")
    parser.add_argument("--recipes", default=",".join(RECIPES), help="which recipes (default: %(default)s)")
    parser.add_argument("--world_size", type=int, default=2, help="GPUs of the run (default: 2, the reference run's)")
    parser.add_argument("--json", default="", help="also write the result JSON to this file")
    args = parser.parse_args(argv)
    from bench import harness

    rows = []
    print(f"{'recipe':<8}{'card GB':>9}{'batch':>7}{'accum':>7}{'allocated':>11}{'peak':>8}{'headroom':>10}")
    for recipe in [r.strip() for r in args.recipes.split(",") if r.strip()]:
        row = predict(args.phase, recipe, args.world_size)
        rows.append(row)
        print(f"{recipe:<8}{row['card_gb']:>9.2f}{row['batch_size']:>7}{row['grad_accum']:>7}"
              f"{row['allocated_gb']:>11.2f}{row['peak_gb']:>8.2f}{row['headroom_gb']:>10.2f}", flush=True)
    harness.emit({"phase": args.phase, "world_size": args.world_size, "recipes": rows}, args.json)
    return 0 if all(row["fits"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

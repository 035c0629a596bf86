"""Run metrics: ``metrics.jsonl`` (the source of truth), wandb when enabled, and the loss plot.

Rank 0 writes one JSON object per logged optimizer step; wandb and ``loss.png`` are built from the
same records.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from pathlib import Path

import torch

import SD_Files


class MetricsLog:
    """``metrics.jsonl`` (the source of truth) and, when enabled, wandb, on rank 0."""

    def __init__(self, run_dir: Path, config, resume_step: int):
        self.path = run_dir / "metrics.jsonl"
        self._truncate_after(resume_step)
        self.wandb = None
        if config.wandb_mode != "disabled":
            import wandb

            id_file = run_dir / "wandb_id.txt"
            run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
            id_file.write_text(run_id)
            self.wandb = wandb.init(project=config.wandb_project, mode=config.wandb_mode, id=run_id,
                                    resume="allow", dir=str(run_dir), config=dataclasses.asdict(config))

    def _truncate_after(self, step: int) -> None:
        """Drop records past the checkpoint being resumed (they will be logged again)."""
        if not self.path.exists():
            return
        lines = [line for line in self.path.read_text().splitlines() if line.strip()]
        kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
        if len(kept) != len(lines):
            SD_Files.write_text_atomic(self.path, "".join(line + "\n" for line in kept))

    def write(self, record: dict, image: Path | None = None) -> None:
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            payload = {k: v for k, v in record.items() if isinstance(v, (int, float)) and v is not None}
            if image is not None:
                import wandb

                payload["samples"] = wandb.Image(str(image))
            self.wandb.log(payload, step=record["step"])

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def plot_metrics(metrics_path: Path, out: Path) -> None:
    """Loss curve (and validation loss) from metrics.jsonl as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not metrics_path.exists():  # a run shorter than log_every logged nothing
        return
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    if not records:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train loss", lw=0.8)
    val = [r for r in records if r.get("val_loss") is not None]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="val loss")
    if any(r.get("val_loss_ema") is not None for r in val):
        ax.plot([r["step"] for r in val], [r["val_loss_ema"] for r in val], "s-", label="val loss (EMA)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("Min-SNR loss")
    ax.legend()
    fig.tight_layout()
    SD_Files.write_atomic(out, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux

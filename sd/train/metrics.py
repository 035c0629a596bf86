"""Run metrics: ``metrics.jsonl`` (the source of truth), wandb or TensorBoard, and the loss plot.

Rank 0 writes one JSON object per logged optimizer step; wandb, TensorBoard and ``loss.png`` are built
from the same records. TensorBoard's events hide those past a resumed step (``purge_step``), as the
resume drops them from ``metrics.jsonl``. A crash while a record is being written can leave a torn last line: a resume drops it
(and the records past the resumed step) and rewrites the file atomically. Any other line that is no
record is an error naming the file and the line.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
from pathlib import Path

import torch

import sd.files

log = logging.getLogger("sd_metrics")


class MetricsError(ValueError):
    """``metrics.jsonl`` holds a line that is no record (other than a torn last line)."""


def read_records(path: Path) -> tuple[list[tuple[str, dict]], str | None]:
    """``(line, record)`` for every record of a ``metrics.jsonl``, and its torn last line or None.

    The last line alone may be cut short (a crash mid-write): it is returned apart, not as a record.
    """
    numbered = [(n, line) for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if line.strip()]
    records = []
    for number, line in numbered:  # numbered as an editor shows the file
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number == numbered[-1][0]:
                return records, line
            raise MetricsError(f"{path}: line {number} is not JSON ({error.msg}); only the last line may be torn "
                               "by a crash: repair or delete that line") from error
        if not isinstance(record, dict) or type(record.get("step")) is not int:
            raise MetricsError(f"{path}: line {number} is not a metrics record (a JSON object with an integer "
                               "step): repair or delete that line")
        records.append((line, record))
    return records, None


TENSORBOARD_DIR = "tensorboard"


def tensorboard_on(config) -> bool:
    """``tensorboard: auto`` writes events when wandb is off; ``true`` / ``false`` decide alone."""
    setting = config.tensorboard.lower()
    return setting == "true" or (setting == "auto" and config.wandb_mode == "disabled")


def scalars(record: dict) -> dict[str, float]:
    """The numbers of a record by name; a list (``loss_by_quartile``) as ``name/0``, ``name/1``, ..."""
    out = {}
    for key, value in record.items():
        if key == "step":
            continue
        values = value if isinstance(value, list) else [value]
        for i, item in enumerate(values):
            if isinstance(item, (int, float)):
                out[f"{key}/{i}" if isinstance(value, list) else key] = float(item)
    return out


class MetricsLog:
    """``metrics.jsonl`` (the source of truth) and, when enabled, wandb and TensorBoard, on rank 0."""

    def __init__(self, run_dir: Path, config, resume_step: int):
        self.path = run_dir / "metrics.jsonl"
        self._truncate_after(resume_step)
        self.tensorboard = None
        if tensorboard_on(config):
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(run_dir / TENSORBOARD_DIR),
                                             purge_step=resume_step + 1 if resume_step else None)
        self.wandb = None
        if config.wandb_mode != "disabled":
            import wandb

            id_file = run_dir / "wandb_id.txt"
            run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
            id_file.write_text(run_id)
            self.wandb = wandb.init(project=config.wandb_project, mode=config.wandb_mode, id=run_id,
                                    resume="allow", dir=str(run_dir), config=dataclasses.asdict(config))

    def _truncate_after(self, step: int) -> None:
        """Drop records past the checkpoint being resumed (they will be logged again) and a torn last line."""
        if not self.path.exists():
            return
        records, torn = read_records(self.path)
        kept = [line for line, record in records if record["step"] <= step]
        if torn is not None:
            log.warning("%s: dropped its torn last line (a crash while writing it): %.80r", self.path, torn)
        if torn is not None or len(kept) != len(records):
            sd.files.write_text_atomic(self.path, "".join(line + "\n" for line in kept))

    def write(self, record: dict, image: Path | None = None) -> None:
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            payload = {k: v for k, v in record.items() if isinstance(v, (int, float)) and v is not None}
            if image is not None:
                import wandb

                payload["samples"] = wandb.Image(str(image))
            self.wandb.log(payload, step=record["step"])
        if self.tensorboard is not None:
            for key, value in scalars(record).items():
                self.tensorboard.add_scalar(key, value, record["step"])
            if image is not None:
                import numpy as np
                from PIL import Image

                with Image.open(image) as grid:
                    pixels = np.asarray(grid.convert("RGB"))
                self.tensorboard.add_image("samples", pixels, record["step"], dataformats="HWC")

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def plot_metrics(metrics_path: Path, out: Path) -> None:
    """Loss curve (and validation loss) from metrics.jsonl as a PNG; with ``eval_every``, the FID and
    CLIP score in a panel beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not metrics_path.exists():  # a run shorter than log_every logged nothing
        return
    records = [record for _, record in read_records(metrics_path)[0]]  # without a torn last line
    if not records:
        return
    evals = [r for r in records if r.get("eval_fid") is not None]
    fig, axes = plt.subplots(1, 2 if evals else 1, figsize=(12 if evals else 7, 4), squeeze=False)
    plot_loss(axes[0][0], records)
    if evals:
        plot_eval(axes[0][1], evals)
    fig.tight_layout()
    sd.files.write_atomic(out, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)


def plot_loss(ax, records: list[dict]) -> None:
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="train loss", lw=0.8)
    val = [r for r in records if r.get("val_loss") is not None]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="val loss")
    if any(r.get("val_loss_ema") is not None for r in val):
        ax.plot([r["step"] for r in val], [r["val_loss_ema"] for r in val], "s-", label="val loss (EMA)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("Min-SNR loss")
    ax.legend()


def plot_eval(ax, evals: list[dict]) -> None:
    """FID (left axis) and, when logged, CLIP score (right axis) of the EMA weights."""
    steps = [r["step"] for r in evals]
    ax.plot(steps, [r["eval_fid"] for r in evals], "o-", color="tab:red", label="FID (EMA)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("FID", color="tab:red")
    clip = [r for r in evals if r.get("eval_clip_score") is not None]
    if clip:
        twin = ax.twinx()
        twin.plot([r["step"] for r in clip], [r["eval_clip_score"] for r in clip], "s--", color="tab:blue",
                  label="CLIP score (EMA)")
        twin.set_ylabel("CLIP score", color="tab:blue")


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux

"""A training run's state: its position (``TrainState``: what a resume needs besides weights,
optimizer and RNGs) and what the loop works with (``Run``, which ``sd.train.run.build`` makes)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import sd.data.training_data
import sd.sampling
import sd.train.checkpoint as ckpt
import sd.training_mode
import sd.train.step
from sd.distributed import Dist
from sd.evaluation import TrainingEval
from sd.train.config import TrainConfig


@dataclass
class TrainState:
    """The loop's position: everything a resume needs besides weights, optimizer and RNGs."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0
    position: int = 0  # micro-batches of this epoch already consumed by each rank
    bad_steps: int = 0  # skipped steps so far
    bad_in_a_row: int = 0
    samples_seen: int = 0  # across all ranks
    world_size: int = 1  # the data order depends on it
    data_samples: int = 0  # training samples (it depends on them too); 0 in checkpoints that predate it
    best_metric: str = ""  # keep_best: the metric of the best evaluation so far ("" = none yet)
    best_step: int = 0  # its step, whose checkpoint is kept
    best_value: float = 0.0  # its score

    OPTIONAL = ("data_samples", "best_metric", "best_step", "best_value")  # absent from older checkpoints
    TYPES = {"best_metric": str, "best_value": float}  # the rest are counts

    def state_dict(self) -> dict:
        """Every field; the best's only once there is one (a run without keep_best writes what it always did)."""
        state = dataclasses.asdict(self)
        return state if self.best_metric else {k: v for k, v in state.items() if not k.startswith("best_")}

    def load_state_dict(self, state: dict) -> None:
        defaults = dataclasses.asdict(TrainState())
        for name in defaults:
            if name not in state and name not in self.OPTIONAL:
                raise KeyError(f"train state lacks '{name}'")
            setattr(self, name, self.TYPES.get(name, int)(state.get(name, defaults[name])))

    def improves(self, metric: str, value: float) -> bool:
        """Whether ``value`` of ``metric`` (``fid``: lower is better; ``clip_score``: higher) beats the best so
        far, which it then becomes; a best of another metric (keep_best changed on resume) is beaten by any."""
        better = (self.best_metric != metric or (value < self.best_value if metric == "fid"
                                                  else value > self.best_value))
        if better:
            self.best_metric, self.best_step, self.best_value = metric, self.step, float(value)
        return better

    def advance(self, grad_accum: int, usable: int, images_per_step: int) -> bool:
        """Move past one optimizer step; True when that ended the epoch (``usable``: the epoch's
        micro-batches that make whole steps). Whether its update was skipped is counted when its
        statistics are read (``count``)."""
        self.position += grad_accum
        self.samples_seen += images_per_step
        self.step += 1
        if self.position < usable:
            return False
        self.epoch, self.position = self.epoch + 1, 0
        return True

    def count(self, bad: bool) -> None:
        """Count a step whose statistics were read (``bad``: its update was skipped), in step order."""
        self.bad_in_a_row = self.bad_in_a_row + 1 if bad else 0
        self.bad_steps += int(bad)


@dataclass
class Run:
    """What the loop works with."""

    config: TrainConfig
    d: Dist
    step: sd.train.step.Step
    state: TrainState
    train_data: sd.data.training_data.MixedData
    val_data: sd.data.training_data.MixedData | None
    sampler: sd.sampling.Pipeline  # the frozen parts of the validation grid, around step.unet
    rng: ckpt.RankRNG  # this rank's RNGs, applied when the loop starts
    steps_per_epoch: int
    total_steps: int  # optimizer steps of the phase: sizes the LR schedule
    run_dir: Path
    mode: sd.training_mode.Mode  # what trains (sd.train.modes)
    base_fingerprint: torch.Tensor | None = None  # a LoRA run's base weights as loaded (see BaseFingerprint)
    parts_fingerprint: dict[str, torch.Tensor] = field(default_factory=dict)  # the frozen text encoder's and VAE's
    evaluation: TrainingEval | None = None  # FID / CLIP score every eval_every steps
    started_at: float = field(default_factory=time.time)  # when the run first started (a resume's: its checkpoint's)

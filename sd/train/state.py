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
import sd.train.mode
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

    OPTIONAL = ("data_samples",)  # absent from older checkpoints

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for name in dataclasses.asdict(self):
            if name not in state and name not in self.OPTIONAL:
                raise KeyError(f"train state lacks '{name}'")
            setattr(self, name, int(state.get(name, 0)))

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
    mode: sd.train.mode.Mode  # what trains (sd.train.modes)
    base_fingerprint: torch.Tensor | None = None  # a LoRA run's base weights as loaded (see BaseFingerprint)
    evaluation: TrainingEval | None = None  # FID / CLIP score every eval_every steps
    started_at: float = field(default_factory=time.time)  # when the run first started (a resume's: its checkpoint's)

"""Training checkpoints: one save and one load over a dict of named state objects.

The trainer hands ``save`` / ``load`` a dict ``{name: object}``; every object has ``state_dict()``
and ``load_state_dict()``, and each becomes one file of ``run_dir/checkpoints/step_NNNNNNNN/``:

    Weights(obj)  -> NAME.safetensors     written by rank 0 (unet, ema): any safetensors reader loads it
    PerRank(obj)  -> NAME_rank{R}.pt      written by every rank R (its RNGs and a weight fingerprint)
    anything else -> NAME.pt              written by rank 0 (optimizer, scaler, train_state)
    config.yaml, COMPLETE                 the resolved config; COMPLETE last

Adding a piece of resumable state is one more entry in that dict. The folder is assembled in
``.tmp_step_NNNNNNNN`` and renamed, so a crash while saving never leaves a folder that looks done;
only folders with ``COMPLETE`` count. ``.pt`` files are read with ``torch.load(weights_only=True)``:
nothing is unpickled beyond tensors and plain containers. A missing file on resume is an error.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

import SD_Distributed
import SD_Faults
import SD_Files

STEP_DIR = re.compile(r"^step_(\d{8})$")
COMPLETE = "COMPLETE"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(checkpoints_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every complete checkpoint, oldest first."""
    folder = Path(checkpoints_dir)
    if not folder.is_dir():
        return []
    found = []
    for child in folder.iterdir():
        match = STEP_DIR.match(child.name)
        if match and (child / COMPLETE).exists():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(checkpoints_dir: str | Path) -> Path | None:
    found = complete_checkpoints(checkpoints_dir)
    return found[-1][1] if found else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder from itself, a run folder, or a run's ``checkpoints/`` folder."""
    path = Path(path)
    if (path / COMPLETE).exists():
        return path
    for candidate in (path / "checkpoints", path):
        latest = latest_checkpoint(candidate)
        if latest is not None:
            return latest
    raise FileNotFoundError(f"{path} is neither a complete checkpoint folder nor a run folder holding one")


# ---------------------------------------------------------------------------------------------
# The state dict of a run: named objects, one file each
# ---------------------------------------------------------------------------------------------


class _Entry:
    """Marks how a state object is stored; passes ``state_dict`` / ``load_state_dict`` through."""

    def __init__(self, obj):
        self.obj = obj

    def state_dict(self):
        return self.obj.state_dict()

    def load_state_dict(self, state):
        self.obj.load_state_dict(state)


class Weights(_Entry):
    """An object whose state is a flat dict of tensors (a module, the EMA): saved as safetensors."""


class PerRank(_Entry):
    """State that differs between ranks: every rank writes and reads its own file."""


class RankRNG:
    """This rank's RNGs (torch, CUDA, numpy, python, the noise generator) and a fingerprint of its
    weights (DDP ranks must hold identical ones)."""

    def __init__(self, noise_generator: torch.Generator, model):
        self.noise_generator, self.model = noise_generator, model

    def state_dict(self) -> dict:
        return {"rng": capture_rng(self.noise_generator), "fingerprint": weights_fingerprint(self.model.parameters())}

    def load_state_dict(self, state: dict) -> None:
        restore_rng(state["rng"], self.noise_generator)


def file_name(name: str, obj, rank: int) -> str:
    if isinstance(obj, PerRank):
        return f"{name}_rank{rank}.pt"
    if isinstance(obj, Weights):
        return f"{name}.safetensors"
    return f"{name}.pt"


def save(checkpoints_dir: Path, step: int, states: dict, d, config_text: str) -> Path:
    """Write ``checkpoints_dir/step_N`` from every rank, atomically, then prune old checkpoints.

    Collective: every rank calls it. Rank 0 writes the shared entries in the dict's order (a fault
    point ``after_NAME:STEP`` follows each file), every rank its ``PerRank`` entries.
    """
    staging = staging_dir(checkpoints_dir, step)
    final = checkpoints_dir / step_dir_name(step)
    if d.is_main:
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
    SD_Distributed.barrier(d)
    for name, obj in states.items():
        if isinstance(obj, PerRank) or d.is_main:
            write_entry(staging / file_name(name, obj, d.rank), obj)
            SD_Faults.point(f"after_{name}", step)
    if d.is_main:
        (staging / "config.yaml").write_text(config_text)
    SD_Distributed.barrier(d)
    if d.is_main:
        finalize(staging, final)
    SD_Distributed.barrier(d)
    return final


def write_entry(path: Path, obj) -> None:
    if isinstance(obj, Weights):
        save_weights(obj.state_dict(), path)
    else:
        save_torch(obj.state_dict(), path)


def load(folder: Path, states: dict, rank: int) -> None:
    """Restore every entry of ``states`` from ``folder``; a missing file is an error."""
    for name, obj in states.items():
        path = folder / file_name(name, obj, rank)
        if isinstance(obj, Weights):
            obj.load_state_dict(load_weights(path))
        else:
            obj.load_state_dict(load_torch(path))


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def staging_dir(checkpoints_dir: Path, step: int) -> Path:
    return checkpoints_dir / f".tmp_{step_dir_name(step)}"


def save_weights(state_dict: dict[str, torch.Tensor], path: Path) -> None:
    tensors = {name: t.detach().contiguous().cpu() for name, t in state_dict.items()}
    save_file(tensors, str(path))


def save_torch(obj, path: Path) -> None:
    torch.save(obj, path)


@torch.no_grad()
def weights_fingerprint(tensors) -> torch.Tensor:
    """Per-tensor float64 sums ``(n,)``: equal on every rank unless the replicas diverged."""
    return torch.stack([t.detach().double().sum() for t in tensors]).cpu()


def finalize(staging: Path, final: Path) -> None:
    """Mark a fully written staging folder complete and move it into place (rank 0 only)."""
    SD_Files.fsync_tree(staging)
    (staging / COMPLETE).write_text("ok\n")
    if final.exists():  # an earlier complete save of the same step (a re-run): replace it
        shutil.rmtree(final)
    os.replace(staging, final)


def prune(checkpoints_dir: Path, keep_last: int, keep_every: int = 0) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep_last``, sparing every ``keep_every``-th
    step, and leftover staging folders. Called only after a newer checkpoint is complete."""
    found = complete_checkpoints(checkpoints_dir)
    removed = []
    for step, folder in found[:-keep_last] if keep_last else found:
        if keep_every and step % keep_every == 0:
            continue
        shutil.rmtree(folder)
        removed.append(folder)
    for leftover in checkpoints_dir.glob(".tmp_step_*"):
        shutil.rmtree(leftover, ignore_errors=True)
        removed.append(leftover)
    return removed


# ---------------------------------------------------------------------------------------------
# RNG state
# ---------------------------------------------------------------------------------------------


def capture_rng(noise_generator: torch.Generator) -> dict:
    """Every RNG of this process as tensors and plain values (``weights_only``-loadable)."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [np_name, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_has_gauss, np_gauss],
        "python": [py_version, list(py_state), py_gauss],
        "noise": noise_generator.get_state(),
    }


def restore_rng(state: dict, noise_generator: torch.Generator) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    noise_generator.set_state(state["noise"])


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def load_torch(path: Path):
    if not path.exists():
        raise FileNotFoundError(f"checkpoint file {path} is missing")
    return torch.load(path, map_location="cpu", weights_only=True)


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    if not path.exists():
        raise FileNotFoundError(f"checkpoint file {path} is missing")
    return load_file(str(path))

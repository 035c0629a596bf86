"""Training checkpoints: atomic folders, rotation, and safe loading.

A checkpoint is ``run_dir/checkpoints/step_NNNNNNNN/`` holding

    unet.safetensors, ema.safetensors   weights (live and EMA), loadable by any safetensors reader
    optimizer.pt, train_state.pt         optimizer, LR schedule, grad scaler, step, epoch, data position
    rng_rank{R}.pt                       every RNG of rank R (torch, CUDA, numpy, python, the noise generator)
    config.yaml                          the resolved config
    COMPLETE                             written last

It is assembled in ``.tmp_step_NNNNNNNN`` and renamed, so a crash while saving never leaves a folder
that looks done; only folders with ``COMPLETE`` count. ``.pt`` files are read with
``torch.load(weights_only=True)``: nothing is unpickled beyond tensors and plain containers.
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
# Writing
# ---------------------------------------------------------------------------------------------


def staging_dir(checkpoints_dir: Path, step: int) -> Path:
    return checkpoints_dir / f".tmp_{step_dir_name(step)}"


def _fsync_tree(folder: Path) -> None:
    for path in folder.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())


def save_weights(state_dict: dict[str, torch.Tensor], path: Path) -> None:
    tensors = {name: t.detach().contiguous().cpu() for name, t in state_dict.items()}
    save_file(tensors, str(path))


def save_torch(obj, path: Path) -> None:
    torch.save(obj, path)


def write_rank_state(folder: Path, rank: int, noise_generator: torch.Generator, model) -> None:
    """This rank's RNGs, and a fingerprint of its weights: DDP ranks must hold identical ones."""
    state = {"rng": capture_rng(noise_generator), "fingerprint": weights_fingerprint(model.parameters())}
    save_torch(state, folder / f"rng_rank{rank}.pt")


@torch.no_grad()
def weights_fingerprint(tensors) -> torch.Tensor:
    """Per-tensor float64 sums ``(n,)``: equal on every rank unless the replicas diverged."""
    return torch.stack([t.detach().double().sum() for t in tensors]).cpu()


def finalize(staging: Path, final: Path) -> None:
    """Mark a fully written staging folder complete and move it into place (rank 0 only)."""
    _fsync_tree(staging)
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


def rank_count(folder: Path) -> int:
    return len(list(folder.glob("rng_rank*.pt")))

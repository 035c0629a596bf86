"""Training checkpoints: one save and one load over a dict of named state objects.

The trainer hands ``save`` / ``load`` a dict ``{name: object}``; every object has ``state_dict()``
and ``load_state_dict()``, and each becomes one file of ``run_dir/checkpoints/step_NNNNNNNN/``:

    Weights(obj)  -> NAME.safetensors     written by rank 0 (unet, ema): any safetensors reader loads it
                                          (a model's file with its modelspec header, sd.metadata)
    PerRank(obj)  -> NAME_rank{R}.pt      written by every rank R (its RNGs and a weight fingerprint)
    anything else -> NAME.pt              written by rank 0 (optimizer, scaler, train_state)
    config.yaml                           the resolved config
    manifest.json                         every other file's size and xxh3-128 content hash; when it was
                                          saved and its run started
    COMPLETE                              written last

Adding a piece of resumable state is one more entry in that dict. State split across the ranks
(``sharding: zero1 | fsdp``, ``sd.train.sharding``) is an object with a ``gather()`` as well: every
rank calls it before rank 0 writes, so the files hold whole tensors whatever the sharding.

The folder is assembled in ``.tmp_step_NNNNNNNN`` and renamed, so a crash while saving never leaves
a folder that looks done; only folders with ``COMPLETE`` count. Before a save the ranks compare
fingerprints of their weights (replicas that diverged stop the run). ``verify`` checks a folder against its manifest before
anything in it is read; a folder that fails is ``Damaged``. ``.pt`` files are read with
``torch.load(weights_only=True)``: nothing is unpickled beyond tensors and plain containers.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

import sd.distributed
import sd.faults
import sd.files
from sd.cli import first_line
from sd.run_folder import (COMPLETE, DAMAGED_SUFFIX, HASH, MANIFEST, CheckpointError, Damaged, complete_checkpoints,
                           describe_files, intact, load_torch, load_weights, step_dir_name, weights_fingerprint)

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
    weights.

    Loading checks the fingerprint against the weights loaded before it (the ``unet`` entry comes
    first): a mismatch means the weights file is not the one this rank saved. Only the trained
    weights are compared (those that require a gradient; they are kept in fp32): a frozen base comes
    from ``init_from`` at every start, stored in the run's precision, which a resume may change, and
    is checked against its own fingerprint taken as loaded (``lora_base``). The file still holds the
    sum of every weight, as it always did. The RNG states are
    applied by ``start`` when the loop begins, not at load: whatever draws from the global RNGs while
    the run is being built (model construction, wrappers, libraries) cannot shift them, and a run
    that did not resume seeds them there from the run's seed, so an interrupted and an uninterrupted
    run hold equal RNG states at every step.
    """

    def __init__(self, noise_generator: torch.Generator, model):
        self.noise_generator, self.model = noise_generator, model
        self.pending: dict | None = None

    def state_dict(self) -> dict:
        return {"rng": capture_rng(self.noise_generator), "fingerprint": weights_fingerprint(self.model.parameters())}

    def load_state_dict(self, state: dict) -> None:
        params = list(self.model.parameters())
        loaded, saved = weights_fingerprint(params), state["fingerprint"]
        trained = torch.tensor([p.requires_grad for p in params], dtype=torch.bool)
        if saved.shape != loaded.shape or not torch.allclose(saved[trained], loaded[trained], rtol=1e-9, atol=1e-9):
            raise Damaged("the loaded weights do not match the fingerprint saved with them")
        self.pending = state["rng"]

    def start(self, seed: int, rank: int) -> None:
        """Set every RNG of this process for the loop: the loaded states, or seeded from ``seed`` and
        ``rank`` (the noise generator keeps the seed it was built with)."""
        if self.pending is not None:
            restore_rng(self.pending, self.noise_generator)
            self.pending = None
            return
        base = seed * 1_000_003 + rank
        torch.manual_seed(base)  # also seeds every CUDA device
        np.random.seed(base % 2**32)
        random.seed(base)


def file_name(name: str, obj, rank: int) -> str:
    if isinstance(obj, PerRank):
        return f"{name}_rank{rank}.pt"
    if isinstance(obj, Weights):
        return f"{name}.safetensors"
    return f"{name}.pt"


def save(checkpoints_dir: Path, step: int, states: dict, d, config_text: str, headers: dict | None = None,
         times: dict | None = None) -> Path:
    """Write ``checkpoints_dir/step_N`` from every rank, atomically; returns the folder. ``headers``: the
    safetensors header of weight entries, by name (``sd.metadata``); ``times``: recorded in the manifest
    (``started_at``, Unix time), beside ``saved_at``.

    Collective: every rank calls it. Rank 0 writes the shared entries in the dict's order (a fault
    point ``after_NAME:STEP`` follows each file), every rank its ``PerRank`` entries, and each rank
    hashes what it wrote; rank 0 writes the manifest and completes the folder. A write that fails on
    any rank (a full disk) removes the staging folder and raises ``CheckpointError`` on every rank,
    naming the file and the error; earlier checkpoints are untouched.
    """
    staging = staging_dir(checkpoints_dir, step)
    final = checkpoints_dir / step_dir_name(step)
    if d.is_main:
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
    sd.distributed.barrier(d)
    for obj in states.values():  # state split across the ranks is gathered for rank 0: a collective
        gather = getattr(getattr(obj, "obj", obj), "gather", None)
        if gather is not None:
            gather()
    written, failure, path = [], None, staging
    try:
        for name, obj in states.items():
            if isinstance(obj, PerRank) or d.is_main:
                path = staging / file_name(name, obj, d.rank)
                write_entry(path, obj, (headers or {}).get(name))
                written.append(path)
                sd.faults.point(f"after_{name}", step)
        if d.is_main:
            path = staging / "config.yaml"
            path.write_text(config_text)
            written.append(path)
        entries = describe_files(written)
    except (OSError, RuntimeError) as error:  # torch and safetensors wrap the OSError of a failed write
        failure, entries = f"could not write {path}: {write_error_text(error)}", {}
    gathered = sd.distributed.all_gather_objects((entries, failure), d)
    failures = [f for _, f in gathered if f]
    if failures:
        if d.is_main:
            shutil.rmtree(staging, ignore_errors=True)
        sd.distributed.barrier(d)
        raise CheckpointError(f"{failures[0]}; the unfinished {staging.name} was removed and earlier checkpoints "
                              "are untouched")
    if d.is_main:
        manifest = {"hash": HASH, "files": {name: entry for part, _ in gathered for name, entry in part.items()},
                    **(times or {}), "saved_at": time.time()}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        finalize(staging, final)
    sd.distributed.barrier(d)
    return final


def write_entry(path: Path, obj, header: dict[str, str] | None = None) -> None:
    if isinstance(obj, Weights):
        save_weights(obj.state_dict(), path, header)
    else:
        save_torch(obj.state_dict(), path)


def write_error_text(error: BaseException) -> str:
    """``[ENOSPC] No space left on device`` from the OSError inside a library's write error."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return f"[{errno.errorcode.get(seen.errno, seen.errno)}] {os.strerror(seen.errno)}"
        seen = seen.__cause__ or seen.__context__
    found = re.search(r"os error (\d+)", str(error))
    if found:
        code = int(found.group(1))
        return f"[{errno.errorcode.get(code, code)}] {os.strerror(code)}"
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def load(folder: Path, states: dict, rank: int) -> None:
    """Restore every entry of ``states`` from ``folder``.

    Raises ``Damaged`` naming the file for a missing or unreadable one (verify the folder first).
    """
    for name, obj in states.items():
        path = folder / file_name(name, obj, rank)
        try:
            if isinstance(obj, Weights):
                obj.load_state_dict(load_weights(path))
            else:
                obj.load_state_dict(load_torch(path))
        except Damaged as error:
            raise Damaged(f"{path}: {error}") from error
        except (OSError, RuntimeError, KeyError, ValueError, EOFError, pickle.UnpicklingError, SafetensorError) as error:
            raise Damaged(f"{path}: {first_line(error)}") from error


def set_aside(folder: Path) -> Path:
    """Rename a damaged checkpoint out of the way (kept for inspection, never counted or pruned)."""
    target = folder.with_name(folder.name + DAMAGED_SUFFIX)
    n = 1
    while target.exists():
        target, n = folder.with_name(f"{folder.name}{DAMAGED_SUFFIX}{n}"), n + 1
    os.replace(folder, target)
    return target


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def staging_dir(checkpoints_dir: Path, step: int) -> Path:
    return checkpoints_dir / f".tmp_{step_dir_name(step)}"


def save_weights(state_dict: dict[str, torch.Tensor], path: Path, header: dict[str, str] | None = None) -> None:
    tensors = {name: t.detach().contiguous().cpu() for name, t in state_dict.items()}
    save_file(tensors, str(path), metadata=header)


def save_torch(obj, path: Path) -> None:
    with open(path, "wb") as f:  # a Python file object: a failed write keeps its OSError (errno) in the chain
        torch.save(obj, f)


def check_ranks_agree(model, d, step: int) -> None:
    """Compare every rank's weight fingerprint with rank 0's (collective); raise naming the ranks
    whose weights differ. DDP keeps replicas equal; a difference means they silently diverged."""
    mine = weights_fingerprint(model.parameters())
    gathered = sd.distributed.all_gather_objects(mine, d)
    differ = [rank for rank, theirs in enumerate(gathered) if not torch.equal(theirs, gathered[0])]
    if differ:
        names = [name for name, _ in model.named_parameters()]
        first = next(i for i in range(len(names)) if any(g[i] != gathered[0][i] for g in gathered))
        raise CheckpointError(
            f"step {step}: the weights of rank(s) {', '.join(map(str, differ))} differ from rank 0's (first in "
            f"{names[first]}): the replicas diverged; nothing was saved. Resume from the last checkpoint")


def finalize(staging: Path, final: Path) -> None:
    """Mark a fully written staging folder complete and move it into place (rank 0 only)."""
    sd.files.normal_permissions(staging)
    sd.files.fsync_tree(staging)
    (staging / COMPLETE).write_text("ok\n")
    if final.exists():  # an earlier complete save of the same step (a re-run): replace it
        shutil.rmtree(final)
    os.replace(staging, final)


def prune(checkpoints_dir: Path, keep_last: int, keep_every: int = 0, keep: tuple[int, ...] = ()) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep_last`` intact ones, sparing every
    ``keep_every``-th step and the steps ``keep`` (the best: ``keep_best``), and leftover staging folders.
    A checkpoint that fails the cheap check (manifest sizes) neither counts nor is deleted, so the newest
    good one is never removed."""
    found = complete_checkpoints(checkpoints_dir)
    good = [(step, folder) for step, folder in found if intact(folder)]
    removed = []
    for step, folder in good[:-keep_last] if keep_last else good:
        if (keep_every and step % keep_every == 0) or step in keep:
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

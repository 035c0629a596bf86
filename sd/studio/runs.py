"""Run folders as the studio lists them, and the folders it may show.

``run_state`` says whether a run is training now (its lock is held: the holder's host and pid), finished
(``max_steps`` reached) or stopped (a checkpoint to resume from), without taking the lock. ``Roots`` confines
every path the studio shows or is given to the folders it was started with; ``folder_name`` is what a run or
dataset may be called (one folder).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

import sd.files
from sd.cli import load_yaml, looks_like_hub_id

METRICS = "metrics.jsonl"


class OutsideRoots(ValueError):
    """A path outside the folders the studio was started with."""


class Roots:
    """The folders the studio may read and write under; every path it is given is checked against them."""

    def __init__(self, folders: list[str | Path]):
        self.folders = [Path(folder).resolve() for folder in folders]

    def check(self, path: str | Path) -> Path:
        """``path`` resolved (relative to the first root), or ``OutsideRoots`` naming the roots."""
        candidate = Path(path).expanduser()
        if not candidate.is_absolute():
            candidate = self.folders[0] / candidate
        resolved = candidate.resolve()
        if not any(resolved == root or root in resolved.parents for root in self.folders):
            raise OutsideRoots(f"{path} is outside the folders this studio was started with "
                               f"({', '.join(str(root) for root in self.folders)}); start it with --root for more")
        return resolved

    def source(self, value: str, presets: tuple[str, ...] = ("tiny",)) -> str:
        """What a command reads that may also be a model hub id: ``value`` itself when it is one of ``presets`` or
        a hub id (``owner/name`` where the first root, in which the commands run, has no ``owner``: nothing there
        that the command could read instead), else the path it names, resolved and checked (``check``)."""
        text = str(value)
        if text in presets:
            return text
        owner = text.split("/")[0]
        if (looks_like_hub_id(text) and not text.startswith("~") and ".." not in text.split("/")
                and not os.path.lexists(self.folders[0] / owner)):
            return text
        return str(self.check(text))


NAME = re.compile(r"(?!\.)[\w.-]{1,200}")  # one folder: letters, digits, '-', '_', '.'; not hidden


def folder_name(name: str, what: str = "run name") -> str:
    """``name`` when it names one folder (a run under runs/, a dataset under data/), else a one-line ValueError."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"{what} {name!r}: one folder name of letters, digits, '-', '_' and '.', not starting "
                         "with '.' (e.g. my_run)")
    return name


def lock_holder(folder: Path) -> dict | None:
    """``{"host", "pid"}`` of the process holding ``folder``'s lock (``sd.files.FolderLock``), or None when it
    is free; read without taking it (a shared lock tried and let go at once when the holder is elsewhere)."""
    path = Path(folder) / sd.files.FolderLock.NAME
    try:
        holder = json.loads(path.read_text() or "{}")
    except (FileNotFoundError, ValueError):
        return None
    if not isinstance(holder, dict):
        return None
    pid = holder.get("pid")
    if holder.get("host") == socket.gethostname() and isinstance(pid, int):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return holder
    try:  # another host's holder: the kernel's (or NFS's) lock says
        with open(path) as handle:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(handle, fcntl.LOCK_UN)
        return None
    except OSError:
        return holder


@dataclass
class RunInfo:
    name: str
    path: Path
    state: str  # training (pid N on host), finished, stopped at step N, not started
    step: int | None
    max_steps: int | None
    loss: float | None

    def row(self) -> list:
        return [self.name, self.state, self.step if self.step is not None else "",
                self.max_steps if self.max_steps is not None else "",
                f"{self.loss:.4f}" if self.loss is not None else "", str(self.path)]


def last_metrics(path: Path, tail_bytes: int = 1 << 16) -> dict | None:
    """The last whole JSON line of ``metrics.jsonl`` (its end read, not the whole file)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, os.fstat(handle.fileno()).st_size - tail_bytes))
            lines = handle.read().split(b"\n")
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            return row
    return None


def run_info(folder: Path) -> RunInfo:
    folder = Path(folder)
    try:
        config = load_yaml((folder / "config.yaml").read_text()) or {}
    except (OSError, ValueError):
        config = {}
    max_steps = config.get("max_steps") if isinstance(config, dict) else None
    metrics = last_metrics(folder / METRICS) or {}
    step, loss = metrics.get("step"), metrics.get("loss")
    holder = lock_holder(folder)
    if holder is not None:
        state = f"training (pid {holder.get('pid', '?')} on {holder.get('host', '?')})"
    elif isinstance(max_steps, int) and isinstance(step, int) and step >= max_steps:
        state = "finished"
    elif any((folder / "checkpoints").glob("step_*/COMPLETE")):
        state = "stopped: the same command resumes it"
    else:
        state = "not started" if step is None else "stopped before its first checkpoint"
    return RunInfo(folder.name, folder, state, step if isinstance(step, int) else None,
                   max_steps if isinstance(max_steps, int) else None,
                   float(loss) if isinstance(loss, (int, float)) else None)


def list_runs(root: Path) -> list[RunInfo]:
    """Every run folder (one holding ``config.yaml`` or ``metrics.jsonl``) directly under ``root``, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    folders = [p for p in root.iterdir() if p.is_dir() and ((p / "config.yaml").exists() or (p / METRICS).exists())]
    folders.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    return [run_info(folder) for folder in folders]

"""The commands the studio runs, each the very command line a user would type, and how their output is read.

A command is an argument list (never a shell line; ``shown`` is how a user would paste it); ``sd.studio.queue``
runs it. ``LogTail`` and ``JsonlTail`` read a growing file from where they left off, holding at most a bounded
number of lines or points, so the studio's memory stays flat while a run writes for days.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections import deque
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]


def python_command(script: str, *args) -> list[str]:
    """``python REPOSITORY/SCRIPT ARGS`` with this interpreter, every argument its own word (the script by its
    full path: jobs run in the user's folder, which need not be the repository)."""
    return [sys.executable, str(REPOSITORY / script), *(str(arg) for arg in args)]


def shown(command: list[str]) -> str:
    """The command as a user would paste it into a shell or a job script (``python``, not the full path)."""
    words = ["python" if i == 0 and word == sys.executable else word for i, word in enumerate(command)]
    return shlex.join(words)


def last_lines(path: Path, count: int, window: int = 1 << 20) -> list[str]:
    """The last ``count`` lines of a text file, from its last ``window`` bytes only (a run's log can be gigabytes);
    of a progress bar's carriage returns only the latest state."""
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            handle.seek(max(0, size - window))
            text = handle.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return []
    lines = [line.rsplit("\r", 1)[-1] for line in text.split("\n")]
    if size > window:
        lines = lines[1:]  # cut by the window
    while lines and not lines[-1]:
        lines.pop()
    return lines[-count:] if count else []


class LogTail:
    """The last ``lines`` lines of a growing text file, read from where the previous call stopped. A progress
    bar's carriage returns keep only its latest state."""

    def __init__(self, path: Path, lines: int = 200, chunk: int = 1 << 20):
        self.path, self.chunk = Path(path), chunk
        self.offset = 0
        self.lines: deque[str] = deque(maxlen=lines)
        self.partial = ""

    def read(self) -> str:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                while data := handle.read(self.chunk):
                    self.offset += len(data)
                    text = self.partial + data.decode("utf-8", errors="replace")
                    *complete, self.partial = text.split("\n")
                    self.lines.extend(line.rsplit("\r", 1)[-1] for line in complete)
        except FileNotFoundError:
            pass
        current = self.partial.rsplit("\r", 1)[-1]
        return "\n".join([*self.lines, current] if current else self.lines)


class JsonlTail:
    """The objects of a growing JSON-lines file (``metrics.jsonl``), read incrementally. At most ``points``
    are kept: when full, every second one is dropped and only every second new one kept from then on, so a
    run of any length is shown at an even spacing in bounded memory."""

    def __init__(self, path: Path, points: int = 2000, chunk: int = 1 << 20):
        self.path, self.points, self.chunk = Path(path), points, chunk
        self.offset = 0
        self.partial = b""
        self.rows: list[dict] = []
        self.stride, self.seen = 1, 0
        self.last: dict | None = None
        self.evaluations: dict[str, tuple] = {}  # eval_* key -> (step, value) of its latest record, kept apart
        # from the thinned points: an evaluation every few thousand steps is never dropped
        self.evaluation_rows: list[dict] = []  # {"step", eval_*...} of every evaluation (thinned past ``points``)

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                while data := handle.read(self.chunk):
                    self.offset += len(data)
                    *complete, self.partial = (self.partial + data).split(b"\n")
                    for line in complete:
                        self.add(line)
        except FileNotFoundError:
            pass
        return self.rows

    def add(self, line: bytes) -> None:
        try:
            row = json.loads(line)
        except ValueError:
            return  # a line cut by a crash, or not JSON: passed over
        if not isinstance(row, dict):
            return
        self.last = row
        evaluated = {key: value for key, value in row.items() if key.startswith("eval_")}
        for key, value in evaluated.items():
            self.evaluations[key] = (row.get("step"), value)
        if evaluated:
            self.evaluation_rows.append({"step": row.get("step"), **evaluated})
            if len(self.evaluation_rows) > self.points:
                self.evaluation_rows = self.evaluation_rows[::2]
        if self.seen % self.stride == 0:
            self.rows.append(row)
            if len(self.rows) > self.points:
                self.rows = self.rows[::2]
                self.stride *= 2
        self.seen += 1

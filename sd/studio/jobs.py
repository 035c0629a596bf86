"""The commands the studio runs, each the very command line a user would type.

A ``Job`` is one child process started from an argument list (never through a shell), in a process group of
its own, its output appended to a log file. ``stop`` sends SIGTERM, on which ``SD_Train.py`` and every stage
save what they finished and exit; ``LogTail`` and ``JsonlTail`` read a growing file from where they left off,
holding at most a bounded number of lines or points, so the studio's memory stays flat while a run writes
for days.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
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


@dataclass
class Job:
    name: str
    command: list[str]
    log: Path
    process: subprocess.Popen | None = None
    started: float = field(default_factory=time.time)
    stopped: bool = False

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def state(self) -> str:
        if self.process is None:
            return "not started"
        code = self.process.poll()
        if code is None:
            return "stopping" if self.stopped else "running"
        if code == 0:
            return "finished"
        return f"stopped (exit {code})" if self.stopped else f"failed (exit {code})"

    def stop(self) -> None:
        """SIGTERM to the job's process group: a trainer checkpoints and exits, a stage keeps its finished parts."""
        if self.running:
            self.stopped = True
            os.killpg(self.process.pid, signal.SIGTERM)

    def wait(self, timeout: float | None = None) -> int | None:
        return None if self.process is None else self.process.wait(timeout)


class Jobs:
    """The studio's jobs by name; starting a name that is running is refused."""

    def __init__(self, log_dir: Path, cwd: Path = REPOSITORY):
        self.log_dir, self.cwd = Path(log_dir), Path(cwd)
        self.jobs: dict[str, Job] = {}

    def start(self, name: str, command: list[str], env: dict | None = None) -> Job:
        current = self.jobs.get(name)
        if current is not None and current.running:
            raise RuntimeError(f"{name} is still running (pid {current.process.pid}): stop it first")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        with open(log, "w", encoding="utf-8") as handle:
            handle.write(f"$ {shown(command)}\n")
            handle.flush()
            process = subprocess.Popen(command, cwd=self.cwd, stdout=handle, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        job = Job(name, command, log, process)
        self.jobs[name] = job
        return job

    def get(self, name: str) -> Job | None:
        return self.jobs.get(name)

    def stop_all(self) -> None:
        for job in self.jobs.values():
            job.stop()


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

"""The studio's jobs, kept on disk so that they outlive the page and the studio: a queue in SQLite.

Every command the pages or the HTTP API build becomes a row of ``ROOT/.studio/jobs.sqlite3`` (each change one
SQLite transaction: a crash leaves the row as it was or as it became, never half-written) and a folder
``ROOT/.studio/jobs/ID/`` with its log. A job that waits (training, data preparation) runs when it is the
first in the queue of its GPU set and nothing else of that set runs; one that does not wait (a memory
estimate, a sample, an export) starts at once. Each is run by ``sd.studio.runner`` in a process group of its
own, so it goes on when the studio stops; the studio started again finds it by its lock (held while any of
its processes lives) and follows it, and one that ended meanwhile by its ``exit.json`` (none: it died, and is
marked ``lost`` with its last log lines). A failed or lost job holds its set's queue until ``resume`` unless
it was queued with ``keep_going``. Only one studio schedules a root at a time (``ROOT/.studio/studio.lock``).

Memory and time per call do not grow with the jobs on disk: the scheduler reads the running jobs and the
first queued one of each set (an index on state, set and position), and listings are pages of the table.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import sd.files
from sd.studio.jobs import REPOSITORY, last_lines, shown
from sd.studio.runner import EXIT, JOB, LOCK, LOG

WAITING, LIVE = ("queued",), ("running", "stopping")
ENDED = ("finished", "failed", "stopped", "cancelled", "lost")
HOLDS_THE_QUEUE = ("failed", "lost")  # a job ending so stops its set's queue unless it was queued keep_going
LOG_LINES_KEPT = 20  # of a job that died unseen, kept in its row's detail
SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,            -- what the pages follow it by: train_RUN, estimate_RUN, data, sample, export
    kind TEXT NOT NULL,            -- train, estimate, data, sample, export, tool, prefer
    commands TEXT NOT NULL,        -- JSON: the argument lists run one after another
    state TEXT NOT NULL,           -- queued, running, stopping, finished, failed, stopped, cancelled, lost
    waits INTEGER NOT NULL,        -- 1: waits its turn in its GPU set's queue; 0: started at once
    gpu_set INTEGER NOT NULL,
    position REAL NOT NULL,        -- order among the queued
    keep_going INTEGER NOT NULL,   -- 1: its failure does not stop the queue
    webhook TEXT,
    run TEXT,                      -- the run folder it trains (validation grids are reported from it)
    created REAL NOT NULL, started REAL, ended REAL,
    pid INTEGER, host TEXT, exit_code INTEGER,
    grid_time REAL NOT NULL DEFAULT 0,  -- the newest validation grid already reported
    detail TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state, gpu_set, position);
CREATE INDEX IF NOT EXISTS jobs_by_name ON jobs (name, id);
CREATE INDEX IF NOT EXISTS jobs_by_name_state ON jobs (name, state);
CREATE INDEX IF NOT EXISTS jobs_by_state_id ON jobs (state, id);
CREATE TABLE IF NOT EXISTS held (gpu_set INTEGER PRIMARY KEY, reason TEXT NOT NULL);
"""


class QueueError(ValueError):
    """A request the queue refuses (an unknown job, a move of a job that is not queued...): nothing changed."""


class StudioBusy(RuntimeError):
    """The queue cannot be opened here: another studio schedules this root's jobs, or its table is damaged."""


@dataclass
class JobRecord:
    id: int
    name: str
    kind: str
    commands: list
    state: str
    waits: bool
    gpu_set: int
    position: float
    keep_going: bool
    webhook: str | None
    run: str | None
    created: float
    started: float | None
    ended: float | None
    pid: int | None
    host: str | None
    exit_code: int | None
    grid_time: float
    detail: str

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> JobRecord:
        values = dict(row)
        values["commands"] = json.loads(values["commands"])
        values["waits"], values["keep_going"] = bool(values["waits"]), bool(values["keep_going"])
        return cls(**values)

    @property
    def shown(self) -> str:
        return "\n".join(shown(command) for command in self.commands)

    def public(self) -> dict:
        """The job as the API shows it: every field but the argument lists, and the command as typed."""
        fields = asdict(self)
        del fields["commands"], fields["grid_time"]
        return {**fields, "command": self.shown}


class Queue:
    """The jobs of one studio root. ``gpu_sets``: the ``CUDA_VISIBLE_DEVICES`` of each set (``[None]``: one set,
    the environment's own). ``notify(event, job, **details)`` is told of every start and end and of each new
    validation grid (the webhooks); it must not block."""

    def __init__(self, folder: Path, cwd: Path, gpu_sets: list[str | None] | None = None, notify=None):
        self.folder, self.cwd = Path(folder), Path(cwd)
        self.gpu_sets = list(gpu_sets or [None])
        self.notify = notify or (lambda event, job, **details: None)
        (self.folder / "jobs").mkdir(parents=True, exist_ok=True)
        self.studio_lock = None
        self.lock = threading.RLock()
        path = self.folder / "jobs.sqlite3"
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.row_factory = sqlite3.Row
        try:
            self.db.execute("PRAGMA busy_timeout = 10000")
            self.db.executescript(SCHEMA)
        except sqlite3.DatabaseError as error:
            self.db.close()
            raise StudioBusy(f"{path} is not a readable job table ({error}): move it aside to start with an empty "
                             f"queue (the jobs' logs stay in {self.folder / 'jobs'})") from None
        self.children: dict[int, subprocess.Popen] = {}  # runners this studio started, reaped when they end
        self.host = socket.gethostname()
        self.thread: threading.Thread | None = None
        self.closing = threading.Event()

    # -- the table -----------------------------------------------------------------------------------------------
    def write(self, sql: str, values=()) -> sqlite3.Cursor:
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                cursor = self.db.execute(sql, values)
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            return cursor

    def update(self, job_id: int, **values) -> None:
        columns = ", ".join(f"{key} = ?" for key in values)
        self.write(f"UPDATE jobs SET {columns} WHERE id = ?", (*values.values(), job_id))

    def rows(self, sql: str, values=()) -> list[JobRecord]:
        with self.lock:
            return [JobRecord.from_row(row) for row in self.db.execute(sql, values)]

    def get(self, job_id: int) -> JobRecord:
        found = self.rows("SELECT * FROM jobs WHERE id = ?", (int(job_id),))
        if not found:
            raise QueueError(f"no job {job_id}")
        return found[0]

    def latest(self, name: str) -> JobRecord | None:
        found = self.rows("SELECT * FROM jobs WHERE name = ? ORDER BY id DESC LIMIT 1", (name,))
        return found[0] if found else None

    def list(self, states: tuple[str, ...] = (), limit: int = 50, before: int | None = None) -> list[JobRecord]:
        """Newest first, at most ``limit``; ``before`` an id: the page after the one that ended there. Each state
        is read by its (state, id) index, ``limit`` rows at most, and merged: the time does not grow with the
        jobs on disk."""
        below = int(before) if before is not None else None
        if not states:
            clause, values = ("WHERE id < ?", (below,)) if below is not None else ("", ())
            return self.rows(f"SELECT * FROM jobs {clause} ORDER BY id DESC LIMIT ?", (*values, int(limit)))
        found = []
        for state in dict.fromkeys(states):
            clause, values = ("AND id < ?", (below,)) if below is not None else ("", ())
            found += self.rows(f"SELECT * FROM jobs WHERE state = ? {clause} ORDER BY id DESC LIMIT ?",
                               (state, *values, int(limit)))
        return sorted(found, key=lambda job: job.id, reverse=True)[:int(limit)]

    def ahead(self, job: JobRecord) -> int:
        """The queued jobs of the job's set that run before it (counted on the index, not read)."""
        with self.lock:
            return self.db.execute(
                "SELECT COUNT(*) FROM jobs WHERE state = 'queued' AND gpu_set = ? AND waits = 1 AND "
                "(position < ? OR (position = ? AND id < ?))",
                (job.gpu_set, job.position, job.position, job.id)).fetchone()[0]

    def waiting(self, gpu_set: int) -> list[JobRecord]:
        """The queued jobs of a set in the order they will run."""
        return self.rows("SELECT * FROM jobs WHERE state = 'queued' AND gpu_set = ? ORDER BY position, id",
                         (gpu_set,))

    def held(self) -> dict[int, str]:
        with self.lock:
            return {row["gpu_set"]: row["reason"] for row in self.db.execute("SELECT * FROM held")}

    def folder_of(self, job: JobRecord | int) -> Path:
        return self.folder / "jobs" / str(job if isinstance(job, int) else job.id)

    def log(self, job: JobRecord) -> Path:
        return self.folder_of(job) / LOG

    # -- what a client asks ------------------------------------------------------------------------------------------
    def submit(self, name: str, kind: str, commands: list[list[str]], *, waits: bool = True, gpu_set: int = 0,
               keep_going: bool = False, webhook: str | None = None, run: str | None = None,
               env: dict | None = None) -> JobRecord:
        """A new job: queued (``waits``) or started at once. Refused while a job of the same name is queued or
        running (a run trained twice at once, or a second export over the first)."""
        if not 0 <= int(gpu_set) < len(self.gpu_sets):
            raise QueueError(f"gpu_set {gpu_set}: this studio has {len(self.gpu_sets)} GPU set(s), numbered from 0 "
                             "(SD_Studio.py --gpus gives more)")
        commands = [[str(word) for word in command] for command in commands]
        with self.lock:
            self.follow_once()
            busy = self.rows("SELECT * FROM jobs WHERE name = ? AND state IN ('queued', 'running', 'stopping') "
                             "LIMIT 1", (name,))
            if busy:
                raise QueueError(f"{name} is {busy[0].state} already (job {busy[0].id}): stop or cancel it first")
            created = time.time()
            cursor = self.write(
                "INSERT INTO jobs (name, kind, commands, state, waits, gpu_set, position, keep_going, webhook, "
                "run, created) VALUES (?, ?, ?, 'queued', ?, ?, ?, ?, ?, ?, ?)",
                (name, kind, json.dumps(commands), int(waits), int(gpu_set), created, int(keep_going), webhook,
                 run, created))
            job = self.get(cursor.lastrowid)
            self.prepare(job, env or {})
            if not waits:
                self.start(job)
            self.follow_once()
            return self.get(job.id)

    def prepare(self, job: JobRecord, env: dict) -> None:
        folder = self.folder_of(job)
        folder.mkdir(parents=True, exist_ok=True)
        sd.files.write_json_atomic(folder / JOB, {"commands": job.commands, "shown": [shown(c) for c in job.commands],
                                                  "cwd": str(self.cwd), "env": env})
        sd.files.write_text_atomic(folder / LOG, f"$ {job.shown}\n" if len(job.commands) == 1 else "")

    def stop(self, job_id: int) -> JobRecord:
        """A queued job cancelled; a running one sent SIGTERM (the trainer checkpoints and exits)."""
        with self.lock:
            job = self.get(job_id)
            if job.state == "queued":
                self.update(job.id, state="cancelled", ended=time.time())
                self.notify("cancelled", self.get(job.id))
            elif job.state in LIVE and self.alive(job):
                if job.host == self.host:
                    try:
                        os.killpg(job.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
                self.update(job.id, state="stopping")
            return self.get(job.id)

    def retry(self, job_id: int) -> JobRecord:
        """A job that ended, queued again as a new job with the same commands (a run resumes from its checkpoint)."""
        job = self.get(job_id)
        if job.state not in ENDED:
            raise QueueError(f"job {job.id} is {job.state}: only a job that ended can be retried")
        env = json.loads((self.folder_of(job) / JOB).read_text()).get("env", {})
        return self.submit(job.name, job.kind, job.commands, waits=job.waits, gpu_set=job.gpu_set,
                           keep_going=job.keep_going, webhook=job.webhook, run=job.run, env=env)

    def move(self, job_id: int, where: str) -> JobRecord:
        """A queued job moved ``top``, ``up``, ``down`` or to the ``bottom`` of its set's queue."""
        with self.lock:
            job = self.get(job_id)
            if job.state != "queued" or not job.waits:
                raise QueueError(f"job {job.id} is {job.state}: only a queued job can be moved")
            order = [other.id for other in self.waiting(job.gpu_set)]
            index = order.index(job.id)
            target = {"top": 0, "up": index - 1, "down": index + 1, "bottom": len(order) - 1}.get(where)
            if target is None:
                raise QueueError(f"where: top, up, down or bottom, got {where!r}")
            order.insert(max(0, min(len(order) - 1, target)), order.pop(index))
            for position, other in enumerate(order):
                self.update(other, position=float(position))
            return self.get(job.id)

    def resume(self, gpu_set: int = 0) -> None:
        """The set's queue goes on after a failure held it."""
        self.write("DELETE FROM held WHERE gpu_set = ?", (int(gpu_set),))
        self.follow_once()

    # -- running -------------------------------------------------------------------------------------------------
    def start(self, job: JobRecord) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY),
                                                                          os.environ.get("PYTHONPATH")]))}
        devices = self.gpu_sets[job.gpu_set]
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices
        folder = self.folder_of(job)
        (folder / EXIT).unlink(missing_ok=True)
        process = subprocess.Popen([sys.executable, "-m", "sd.studio.runner", str(folder)], cwd=self.cwd, env=env,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True)
        self.children[process.pid] = process
        self.update(job.id, state="running", started=time.time(), pid=process.pid, host=self.host)
        self.wait_for_lock(job.id, process)
        self.notify("started", self.get(job.id))

    def wait_for_lock(self, job_id: int, process: subprocess.Popen, seconds: float = 30.0) -> None:
        """Until the runner holds the job's lock (a few tens of milliseconds), so the job is never taken for
        ended before it has begun; a runner that ends first has said so in exit.json or is found lost."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and process.poll() is None and not self.alive(self.get(job_id)):
            time.sleep(0.01)

    def alive(self, job: JobRecord) -> bool:
        """Whether any process of the job lives: its lock is held (the kernel's lock, released by the last)."""
        path = self.folder_of(job) / LOCK
        try:
            with open(path, "a+") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(handle, fcntl.LOCK_UN)
            return False
        except OSError:
            return True

    def ended(self, job: JobRecord) -> None:
        """A job whose processes are gone: finished, failed or stopped by its ``exit.json``, else lost."""
        try:
            outcome = json.loads((self.folder_of(job) / EXIT).read_text())
        except (FileNotFoundError, ValueError):
            outcome = None
        if outcome is None:
            state, code = "lost", None
            tail = last_lines(self.log(job), LOG_LINES_KEPT)
            detail = "it ended while the studio was not following it, without an exit status (killed?); its " \
                     "last log lines:\n" + "\n".join(tail)
        else:
            code = int(outcome.get("exit", 1))
            state = "finished" if code == 0 else ("stopped" if job.state == "stopping" or outcome.get("signalled")
                                                  else "failed")
            detail = job.detail
        self.update(job.id, state=state, exit_code=code, ended=time.time(), detail=detail)
        if state in HOLDS_THE_QUEUE and job.waits and not job.keep_going:
            self.write("INSERT OR REPLACE INTO held (gpu_set, reason) VALUES (?, ?)",
                       (job.gpu_set, f"job {job.id} ({job.name}) {state}"))
        self.notify(state, self.get(job.id))

    def follow_once(self) -> None:
        """One look: running jobs checked (ended ones recorded, new grids reported), then each free set's next."""
        with self.lock:
            for pid, process in list(self.children.items()):
                if process.poll() is not None:
                    del self.children[pid]
            for job in self.rows("SELECT * FROM jobs WHERE state IN ('running', 'stopping')"):
                self.report_grids(job)
                if job.host in (None, self.host) and not self.alive(job):
                    self.ended(job)
            held = self.held()
            busy = {job.gpu_set for job in self.rows("SELECT * FROM jobs WHERE waits = 1 AND state IN "
                                                     "('running', 'stopping')")}
            for gpu_set in range(len(self.gpu_sets)):
                if gpu_set in held or gpu_set in busy:
                    continue
                first = self.rows("SELECT * FROM jobs WHERE state = 'queued' AND waits = 1 AND gpu_set = ? "
                                  "ORDER BY position, id LIMIT 1", (gpu_set,))
                if first:
                    self.start(first[0])

    def report_grids(self, job: JobRecord, at_most: int = 8) -> None:
        """Validation grids the run wrote since the last report (``samples/**.png`` newer than ``grid_time``)."""
        if not job.run or job.kind != "train":
            return
        samples = Path(job.run) / "samples"
        if not samples.is_dir():
            return
        since = max(job.grid_time, job.started or 0)
        newer = sorted(found for found in ((path.stat().st_mtime, str(path)) for path in samples.glob("**/*.png"))
                       if found[0] > since)
        for mtime, path in newer[-at_most:]:
            self.notify("grid", job, grid=path)
        if newer:
            self.update(job.id, grid_time=newer[-1][0])

    # -- the studio's life ---------------------------------------------------------------------------------------
    def claim(self) -> None:
        """This studio's hold on the root's queue (``studio.lock``, kept until ``close``): StudioBusy when another
        studio holds it."""
        handle = open(self.folder / "studio.lock", "a+")  # noqa: SIM115 - held while the studio lives
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            raise StudioBusy(f"another studio schedules the jobs of {self.cwd} (it holds "
                             f"{self.folder / 'studio.lock'}): stop it first, or start this one with another "
                             "first --root") from None
        self.studio_lock = handle

    def follow(self, every: float = 1.0) -> None:
        """Claim the queue, then look every ``every`` seconds from a thread of its own until ``close``."""
        self.claim()

        def loop():
            while not self.closing.wait(every):
                try:
                    self.follow_once()
                except Exception as error:  # noqa: BLE001 - the studio's pages go on; said on its console
                    print(f"studio queue: {error}", file=sys.stderr, flush=True)

        self.thread = threading.Thread(target=loop, name="studio-queue", daemon=True)
        self.thread.start()

    def stop_all(self) -> None:
        for job in self.rows("SELECT * FROM jobs WHERE state IN ('running', 'stopping')"):
            self.stop(job.id)

    def close(self) -> None:
        """The thread stopped, the database and the studio's lock let go (again: nothing)."""
        if self.closing.is_set():
            return
        self.closing.set()
        if self.thread is not None:
            self.thread.join(timeout=10)
        with self.lock:
            self.db.close()
        if self.studio_lock is not None:
            self.studio_lock.close()

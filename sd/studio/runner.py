"""One queued job of the studio, run apart from the studio: ``python -m sd.studio.runner JOB_FOLDER``.

The folder (``ROOT/.studio/jobs/ID/``, written by ``sd.studio.queue``) holds ``job.json`` (the argument lists to
run one after another, the folder they run in, the environment to add) and ``log.txt``. The runner holds an
exclusive lock on ``lock`` for as long as the job lives, and hands that open file to the commands it starts, so
the lock stays held while any of them runs even if the runner itself is killed: a studio started again finds a
job by its lock, whatever became of the studio that started it. When the last command ends, ``exit.json`` says
how (written atomically, then the lock is let go). SIGTERM and SIGINT reach the whole process group (the
trainer saves a checkpoint and exits); the runner only notes them and starts no further command.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import sd.files

JOB, LOCK, EXIT, LOG = "job.json", "lock", "exit.json", "log.txt"
BUSY = 75  # the job's lock is held already: another runner has it


def run(folder: Path) -> int:
    folder = Path(folder)
    job = json.loads((folder / JOB).read_text())
    lock = open(folder / LOCK, "a+")  # noqa: SIM115 - held open for the job's whole life, by its commands too
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return BUSY
    signalled = []
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(number, lambda received, frame: signalled.append(received))  # a handler, not SIG_IGN:
        # an ignored signal would stay ignored in the commands started after it
    code, commands = 0, job["commands"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **job.get("env", {})}
    with open(folder / LOG, "a", encoding="utf-8") as log:
        for index, command in enumerate(commands):
            if signalled:
                break
            if len(commands) > 1:
                log.write(f"$ {job['shown'][index]}\n")
                log.flush()
            code = subprocess.call(command, cwd=job["cwd"], stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=env, pass_fds=(lock.fileno(),))
            if code:
                break
    sd.files.write_json_atomic(folder / EXIT, {"exit": code, "signalled": bool(signalled), "ended": time.time()})
    return 0


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1])))

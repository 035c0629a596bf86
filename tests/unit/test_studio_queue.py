"""sd.studio.queue and sd.studio.runner: jobs kept in SQLite that wait their turn per GPU set, hold the queue on a
failure, are cancelled, moved and retried, and outlive the studio: a queue opened again follows a job that runs
(its lock) and finds one that ended meanwhile by its exit status, or marks it lost with its last log lines.
sd.studio.webhooks: the events reach a loopback receiver, retried after a failure, never holding the caller."""

import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sd.studio.queue import ENDED, Queue, QueueError, StudioBusy
from sd.studio.webhooks import Webhooks

SLEEP = [sys.executable, "-c", "import time; print('begun', flush=True); time.sleep(120)"]


def quick(text="done", code=0):
    return [sys.executable, "-c", f"print({text!r}); raise SystemExit({code})"]


def settle(queue, job_id, states=ENDED, seconds=60.0):
    """The job's record once its state is one of ``states`` (the queue looked at as the studio's thread does)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        queue.follow_once()
        job = queue.get(job_id)
        if job.state in states:
            return job
        time.sleep(0.02)
    raise AssertionError(f"job {job_id} still {queue.get(job_id).state}")


@pytest.fixture
def queue(tmp_path):
    events = []
    opened = Queue(tmp_path / ".studio", tmp_path, notify=lambda event, job, **details: events.append((event, job.id)))
    opened.events = events
    yield opened
    opened.close()
    cleaner = Queue(tmp_path / ".studio", tmp_path)  # the test may have closed its own: what still runs is killed
    for job in cleaner.list(("running", "stopping")):
        if cleaner.alive(job):
            os.killpg(job.pid, signal.SIGKILL)
    cleaner.close()


def test_a_waiting_job_starts_when_the_one_before_it_ends(queue):
    first = queue.submit("train_a", "train", [SLEEP])
    second = queue.submit("train_b", "train", [quick()])
    assert (first.state, second.state) == ("running", "queued")
    queue.follow_once()
    assert queue.get(second.id).state == "queued"  # one at a time in a set
    estimate = queue.submit("estimate_a", "estimate", [quick("estimated")], waits=False)
    assert estimate.state == "running"  # a job that does not wait starts beside it
    assert settle(queue, estimate.id).state == "finished"
    queue.stop(first.id)
    assert settle(queue, first.id).state == "stopped"
    done = settle(queue, second.id)
    assert done.state == "finished" and done.started >= queue.get(first.id).ended
    assert queue.log(done).read_text().splitlines()[-1] == "done"
    assert [e for e in queue.events if e[1] == first.id] == [("started", first.id), ("stopped", first.id)]


def test_a_job_runs_its_argument_list_without_a_shell_and_logs_it(queue):
    command = [sys.executable, "-c", "import sys; print('hello', sys.argv[1:])", "a b", "$HOME;", "'"]
    done = settle(queue, queue.submit("export", "export", [command], waits=False).id)
    log = queue.log(done).read_text()
    assert done.state == "finished"
    assert log.splitlines()[0] == """$ python -c 'import sys; print('"'"'hello'"'"', sys.argv[1:])' 'a b' '$HOME;' ''"'"''"""
    assert "hello ['a b', '$HOME;', \"'\"]" in log  # no shell: every word arrives as written


def test_each_gpu_set_runs_its_own_queue_on_its_own_devices(tmp_path):
    show = [sys.executable, "-c", "import os, time; print(os.environ['CUDA_VISIBLE_DEVICES']); time.sleep(0.5)"]
    queue = Queue(tmp_path / ".studio", tmp_path, gpu_sets=["0,1", "2"])
    try:
        jobs = [queue.submit(f"train_{n}", "train", [show], gpu_set=n % 2) for n in range(4)]
        assert [job.state for job in jobs] == ["running", "running", "queued", "queued"]  # one per set at a time
        done = [settle(queue, job.id) for job in jobs]
        assert [queue.log(job).read_text().splitlines()[-1] for job in done] == ["0,1", "2", "0,1", "2"]
        assert done[2].started >= done[0].ended and done[3].started >= done[1].ended
    finally:
        queue.close()


def test_the_same_job_is_not_queued_twice_and_a_set_must_exist(queue):
    queue.submit("train_a", "train", [SLEEP])
    with pytest.raises(QueueError, match="train_a is running already"):
        queue.submit("train_a", "train", [quick()])
    with pytest.raises(QueueError, match="gpu_set 3"):
        queue.submit("train_b", "train", [quick()], gpu_set=3)


def test_a_failure_holds_the_queue_until_resumed_unless_keep_going(queue):
    failing = queue.submit("train_a", "train", [quick("bad", 3)])
    waiting = queue.submit("train_b", "train", [quick()])
    assert settle(queue, failing.id).state == "failed" and queue.get(failing.id).exit_code == 3
    queue.follow_once()
    assert queue.get(waiting.id).state == "queued" and "train_a" in queue.held()[0]
    queue.resume(0)
    assert settle(queue, waiting.id).state == "finished"
    tolerated = queue.submit("train_c", "train", [quick("bad", 1)], keep_going=True)
    after = queue.submit("train_d", "train", [quick()])
    assert settle(queue, tolerated.id).state == "failed"
    assert settle(queue, after.id).state == "finished" and queue.held() == {}


def test_queued_jobs_are_moved_cancelled_and_retried(queue):
    running = queue.submit("train_a", "train", [SLEEP])
    b, c, d = (queue.submit(f"train_{n}", "train", [quick(n)]) for n in "bcd")
    queue.move(d.id, "top")
    queue.move(b.id, "bottom")
    assert [job.id for job in queue.waiting(0)] == [d.id, c.id, b.id]
    queue.move(c.id, "up")
    assert [job.id for job in queue.waiting(0)] == [c.id, d.id, b.id]
    with pytest.raises(QueueError, match="only a queued job"):
        queue.move(running.id, "top")
    with pytest.raises(QueueError, match="where"):
        queue.move(c.id, "sideways")
    assert queue.stop(d.id).state == "cancelled"
    with pytest.raises(QueueError, match="only a job that ended"):
        queue.retry(c.id)
    again = queue.retry(d.id)
    assert again.id != d.id and again.state == "queued" and again.commands == d.commands
    queue.stop(running.id)
    order = [settle(queue, job.id) for job in (c, b, again)]  # a job queued again joins the end of the queue
    assert [job.state for job in order] == ["finished"] * 3
    assert order[0].started < order[1].started < order[2].started


def test_a_queue_opened_again_follows_a_running_job_and_finds_what_ended_meanwhile(tmp_path, queue):
    running = queue.submit("train_a", "train", [SLEEP])
    ends = queue.submit("export", "export", [[sys.executable, "-c", "import time; time.sleep(1); print('written')"]],
                        waits=False)
    queue.close()  # the studio stops; its jobs go on in their own sessions
    time.sleep(1.5)
    again = Queue(tmp_path / ".studio", tmp_path)
    again.claim()
    try:
        again.follow_once()
        assert again.get(running.id).state == "running"  # its lock is held: found and followed
        assert again.get(ends.id).state == "finished"  # ended meanwhile: its exit.json says how
        os.killpg(running.pid, signal.SIGKILL)  # the runner and its command die without a word
        lost = settle(again, running.id)
        assert lost.state == "lost" and "begun" in lost.detail and 0 in again.held()
    finally:
        again.close()


def test_a_job_started_by_an_earlier_studio_is_stopped_by_a_later_one(tmp_path, queue):
    trainer = ("import signal, sys, time\n"
               "signal.signal(signal.SIGTERM, lambda *a: (print('saved', flush=True), sys.exit(0)))\n"
               "print('begun', flush=True)\ntime.sleep(120)")
    job = queue.submit("train_a", "train", [[sys.executable, "-c", trainer]])
    deadline = time.monotonic() + 30
    while "begun" not in queue.log(job).read_text().splitlines()[1:] and time.monotonic() < deadline:
        time.sleep(0.02)
    queue.close()
    later = Queue(tmp_path / ".studio", tmp_path)
    try:
        assert later.stop(job.id).state == "stopping"
        done = settle(later, job.id)
        assert done.state == "finished" and later.log(done).read_text().splitlines()[-1] == "saved"
    finally:
        later.close()


def test_one_studio_schedules_a_root(tmp_path, queue):
    queue.claim()
    other = Queue(tmp_path / ".studio", tmp_path)
    with pytest.raises(StudioBusy, match="another studio"):
        other.claim()
    other.close()


def test_a_chain_of_commands_stops_at_the_first_failure_and_shows_each(queue):
    job = queue.submit("data", "data", [quick("one"), quick("two", 2), quick("three")])
    done = settle(queue, job.id)
    log = queue.log(done).read_text()
    assert done.state == "failed" and done.exit_code == 2 and "two" in log and "three" not in log
    assert log.count("$ python -c") == 2


class Receiver:
    """A loopback webhook receiver: its first ``failures`` POSTs are answered 500, the rest kept."""

    def __init__(self, failures: int = 0):
        self.bodies, self.failures = [], failures
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if receiver.failures > 0:
                    receiver.failures -= 1
                    self.send_response(500)
                else:
                    receiver.bodies.append((json.loads(body), self.headers.get("X-SD-Signature")))
                    self.send_response(204)
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_webhooks_reach_a_receiver_after_failures_and_are_signed(tmp_path, monkeypatch):
    monkeypatch.setenv("SD_STUDIO_WEBHOOK_SECRET", "s3cret")
    receiver = Receiver(failures=2)
    hooks = Webhooks(first_delay=0.01)
    queue = Queue(tmp_path / ".studio", tmp_path, notify=hooks)
    try:
        job = queue.submit("train_a", "train", [quick()], webhook=receiver.url)
        settle(queue, job.id)
        grid = tmp_path / "runs" / "a" / "samples" / "step_10.png"
        grid.parent.mkdir(parents=True)
        grid.write_bytes(b"png")
        deadline = time.monotonic() + 30
        while len(receiver.bodies) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        hooks.close()
        queue.close()
    assert [body["event"] for body, _ in receiver.bodies] == ["started", "finished"]
    assert all(body["job"]["id"] == job.id and "command" in body["job"] for body, _ in receiver.bodies)
    assert all(signature.startswith("sha256=") and len(signature) == 71 for _, signature in receiver.bodies)


def test_a_dead_receiver_never_holds_the_studio(tmp_path):
    hooks = Webhooks("http://127.0.0.1:9/nothing-listens", tries=3, first_delay=0.5)
    job = type("Job", (), {"webhook": None, "public": lambda self: {"id": 1}})()
    started = time.monotonic()
    for _ in range(50):
        hooks("finished", job)
    assert time.monotonic() - started < 1.0  # queued, not sent by the caller
    hooks.close(wait=0.1)


def test_a_run_reports_each_new_validation_grid_once(tmp_path):
    events = []
    queue = Queue(tmp_path / ".studio", tmp_path, notify=lambda event, job, **details: events.append((event, details)))
    run = tmp_path / "runs" / "a"
    try:
        job = queue.submit("train_a", "train", [SLEEP], run=str(run))
        (run / "samples").mkdir(parents=True)
        for step in (10, 20):
            (run / "samples" / f"step_{step}.png").write_bytes(b"png")
            time.sleep(0.02)
            queue.follow_once()
        queue.follow_once()
        grids = [details["grid"] for event, details in events if event == "grid"]
        assert grids == [str(run / "samples" / "step_10.png"), str(run / "samples" / "step_20.png")]
        queue.stop(job.id)
        settle(queue, job.id)
    finally:
        queue.close()


def test_a_damaged_job_table_is_named_with_the_fix(tmp_path):
    (tmp_path / ".studio").mkdir()
    (tmp_path / ".studio" / "jobs.sqlite3").write_bytes(b"not a database" * 100)
    with pytest.raises(StudioBusy, match=r"jobs.sqlite3 is not a readable job table .*move it aside"):
        Queue(tmp_path / ".studio", tmp_path)

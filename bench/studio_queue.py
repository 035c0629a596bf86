"""Benchmark: the studio's job queue and its HTTP API against the number of jobs on disk (neither time nor memory
may follow them).

    python bench/studio_queue.py                                   # about a minute on a 2-core CPU
    python bench/studio_queue.py --jobs 100 1000 10000 --out queue.json

Each ``--jobs`` size N is measured in a process of its own (its resident memory is then its own), in a fresh
studio root holding N finished jobs: rows written straight into ``jobs.sqlite3``, 1,000 a transaction, with
commands of about 300 bytes of JSON and names as the pages give them (sample, export, data, train_RUN,
estimate_RUN in turn).
1. The queue's overhead per job: wall time from ``Queue.submit`` of ``python -c pass`` (a job that waits its
   turn) to its row being ``finished``, looking with ``follow_once`` every 10 ms (the studio's thread looks every
   second), against the peer: the same command run by ``subprocess.run``, no queue; ``--repeats`` jobs one after
   another, each beside a peer run and a run of the job's runner alone (``python -m sd.studio.runner FOLDER``:
   what is left is the queue's bookkeeping). Then ``follow_once`` alone with the N jobs on disk.
2. The API's latency through ``fastapi.testclient`` (Host 127.0.0.1), ``--calls`` calls an endpoint: the list,
   the list of finished jobs, a job in the middle with its log's last 50 lines, the queue, and POST /jobs of a
   memory estimate and of a sample with the queue's ``start`` replaced by marking the row finished (nothing
   runs; the page's checks, the recipe's parse and the queue's insert do).
3. Memory: the Python heap's peak rise (tracemalloc) over follow_once and over each endpoint's calls, and the
   process's resident memory before the N jobs were written and after every measurement.
Prints the machine, a table per part, the growth of each time against the smallest N, and one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

TRIVIAL = [sys.executable, "-c", "pass"]
POLL_S = 0.01  # follow_once every 10 ms while a queued job runs
HEAP_CALLS = 3  # calls an endpoint makes under tracemalloc (it slows Python down: not the timed calls)
LOG_LINES = 200  # the log of the job GET /jobs/ID shows
INSERT = ("INSERT INTO jobs (name, kind, commands, state, waits, gpu_set, position, keep_going, webhook, run, "
          "created, started, ended, pid, host, exit_code, grid_time, detail) "
          "VALUES (?, ?, ?, 'finished', ?, 0, ?, 0, NULL, ?, ?, ?, ?, ?, ?, 0, 0, '')")
ESTIMATE = {"kind": "estimate", "recipe": "configs/quickstart/from_scratch.yaml", "run": "bench"}
SAMPLE = {"kind": "sample", "model": "someone/some-model", "prompt": "a photo of a cat"}  # a hub id: nothing read


def median_p90_ms(seconds: list[float]) -> tuple[float, float]:
    """Median and 90th percentile (nearest rank) in milliseconds."""
    ordered = sorted(seconds)
    return 1e3 * statistics.median(ordered), 1e3 * ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def rss_mb() -> float:
    """This process's resident memory now (not its peak)."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def heap_rise_mb(call, times: int) -> float:
    """The Python heap's peak during ``times`` calls, above what it held before them (tracemalloc)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(times):
            call()
        return (tracemalloc.get_traced_memory()[1] - before) / 2**20
    finally:
        tracemalloc.stop()


# -- a studio root holding N finished jobs ---------------------------------------------------------------------------
def finished_row(i: int, root: Path, repository: Path, host: str) -> tuple:
    """The ``i``-th job as the pages would have left it: a name, kind and command line of one of theirs."""
    python, run = sys.executable, root / "runs" / f"from_scratch_lr2e-3_bs32_{i // 5:05d}"
    recipe = repository / "configs/quickstart/from_scratch.yaml"
    train = [python, str(repository / "SD_Train.py"), "--config", str(recipe), "--out_dir", str(run), "--max_steps",
             "1500", "--lr", "0.002", "--batch_size", "32", "--save_steps", "250"]
    name, kind, command = {
        0: ("sample", "sample", [python, str(repository / "SD_ImageGen.py"), "--ckpt", str(run), "--prompt",
                                 f"a photo of a cat on a wooden table, number {i}", "--negative", "blurry",
                                 "--sampler", "auto", "--seed", str(i), "--n", "4", "--out",
                                 str(root / "samples" / run.name)]),
        1: ("export", "export", [python, str(repository / "SD_ImageGen.py"), "--ckpt", str(run), "--export_lora",
                                 str(root / "exports" / run.name / "lora.safetensors")]),
        2: ("data", "data", [python, str(repository / "pipeline/01e_import_folder.py"), "--input",
                             str(root / "photos/holiday_2026"), "--out", str(root / "data/mine/shards"),
                             "--resolution", "64", "--layout", "flat"]),
        3: (f"train_{run.name}", "train", train),
        4: (f"estimate_{run.name}", "estimate", train + ["--estimate_memory", "true", "--world_size", "1"]),
    }[i % 5]
    created = 1.7e9 + 60.0 * i
    return (name, kind, json.dumps([command]), int(kind in ("train", "data")), created,
            str(run) if kind == "train" else None, created, created + 1, created + 30, 10000 + i, host)


def fill(queue, n: int, repository: Path) -> float:
    """``n`` finished jobs written into the queue's table, 1,000 a transaction; the mean commands JSON in bytes."""
    root, sizes = queue.cwd, []
    with queue.lock:
        for first in range(0, n, 1000):
            rows = [finished_row(i, root, repository, queue.host) for i in range(first, min(n, first + 1000))]
            sizes += [len(row[2]) for row in rows]
            queue.db.execute("BEGIN IMMEDIATE")
            queue.db.executemany(INSERT, rows)
            queue.db.execute("COMMIT")
    return statistics.mean(sizes) if sizes else 0.0


def write_log(queue, job_id: int) -> None:
    """The folder and log of the job that GET /jobs/ID shows (the list reads no log: no other job has one)."""
    folder = queue.folder_of(job_id)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "log.txt").write_text("".join(f"step {step} loss 0.{step:04d} lr 0.002 images/s 12.5\n"
                                            for step in range(LOG_LINES)))


# -- 1. the queue's overhead per job ---------------------------------------------------------------------------------
def run_queued(queue, seconds: float = 60.0) -> float:
    """Seconds from submit to ``finished`` of one trivial job that waits its turn."""
    start = time.perf_counter()
    job = queue.submit("bench", "tool", [TRIVIAL], waits=True)
    while job.state in ("queued", "running", "stopping"):
        if time.perf_counter() - start > seconds:
            raise RuntimeError(f"job {job.id} still {job.state} after {seconds} s")
        time.sleep(POLL_S)
        queue.follow_once()
        job = queue.get(job.id)
    if job.state != "finished":
        raise RuntimeError(f"job {job.id} {job.state}: {job.detail}")
    return time.perf_counter() - start


def runner_alone(folder: Path) -> tuple[list[str], str]:
    """The runner of a job folder holding the trivial command, started as ``Queue.start`` starts it: where the
    queue's overhead splits into the runner's own process and the queue's bookkeeping (rows, locks, polls)."""
    from sd.studio.jobs import REPOSITORY, shown

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "job.json").write_text(json.dumps({"commands": [TRIVIAL], "shown": [shown(TRIVIAL)], "cwd": str(folder),
                                                 "env": {}}))
    return [sys.executable, "-m", "sd.studio.runner", str(folder)], str(REPOSITORY)


def overhead(queue, repeats: int) -> dict:
    """The queued job against ``subprocess.run`` of the same command and of its runner alone, taken in turn so
    that all three see the same load."""
    runner, repository = runner_alone(queue.folder / "runner_alone")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repository, os.environ.get("PYTHONPATH")]))}
    seconds = {"direct": [], "runner": [], "queued": []}
    for _ in range(repeats):
        for what, command in (("direct", TRIVIAL), ("runner", runner)):
            start = time.perf_counter()
            subprocess.run(command, check=True, env=env)
            seconds[what].append(time.perf_counter() - start)
        seconds["queued"].append(run_queued(queue))
    row = {}
    for what, values in seconds.items():
        row[f"{what}_ms"], row[f"{what}_p90_ms"] = median_p90_ms(values)
    return {**row, "ratio": row["queued_ms"] / row["direct_ms"], "overhead_ms": row["queued_ms"] - row["direct_ms"],
            "bookkeeping_ms": row["queued_ms"] - row["runner_ms"]}


def timed(call, calls: int) -> tuple[float, float]:
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return median_p90_ms(seconds)


# -- 2. the API ------------------------------------------------------------------------------------------------------
def endpoints(client, middle: int) -> list[tuple[str, object]]:
    """(label, call) of each measured route; a call asserts its status, so a refusal is never timed as an answer."""
    def call(method: str, url: str, status: int, body=None):
        def once():
            response = client.request(method, url, json=body)
            assert response.status_code == status, (url, response.status_code, response.text[:500])
        return once
    return [("GET /jobs?limit=50", call("GET", "/jobs?limit=50", 200)),
            ("GET /jobs?state=finished&limit=50", call("GET", "/jobs?state=finished&limit=50", 200)),
            ("GET /jobs/MIDDLE?lines=50", call("GET", f"/jobs/{middle}?lines=50", 200)),
            ("GET /queue", call("GET", "/queue", 200)),
            ("POST /jobs estimate (start: no-op)", call("POST", "/jobs", 201, ESTIMATE)),
            ("POST /jobs sample (start: no-op)", call("POST", "/jobs", 201, SAMPLE))]


def no_start(queue):
    """The queue's ``start`` as marking the row finished at once: a POST is timed without a process started, and
    the next POST of the same name is not refused as busy."""
    def start(job):
        now = time.time()
        queue.update(job.id, state="finished", started=now, ended=now, exit_code=0)
    return start


def api_rows(studio, calls: int, middle: int) -> list[dict]:
    import sd.studio.api
    from fastapi.testclient import TestClient

    client = TestClient(sd.studio.api.create(studio, token=None), headers={"Host": "127.0.0.1"})
    real_start, studio.queue.start = studio.queue.start, no_start(studio.queue)
    try:
        rows = []
        for label, call in endpoints(client, middle):
            call()  # the route's first call (its models, a lazy import) is not counted
            median_ms, p90_ms = timed(call, calls)
            rows.append({"endpoint": label, "median_ms": median_ms, "p90_ms": p90_ms,
                         "heap_mb": heap_rise_mb(call, HEAP_CALLS)})
        return rows
    finally:
        studio.queue.start = real_start
        client.close()


# -- one size, in a process of its own -------------------------------------------------------------------------------
def warm_up(repository: Path) -> None:
    """Every measured path once in a root of its own, so that imports and first-call caches are not counted."""
    from sd.studio.handlers import Studio
    from sd.studio.runs import Roots

    with tempfile.TemporaryDirectory() as tmp:
        studio = Studio(Roots([tmp]), repository)
        try:
            fill(studio.queue, 10, repository)
            write_log(studio.queue, 5)
            overhead(studio.queue, 1)
            api_rows(studio, 1, 5)
        finally:
            studio.queue.close()


def measure_size(n: int, repeats: int, calls: int) -> dict:
    from sd.studio.handlers import Studio
    from sd.studio.jobs import REPOSITORY
    from sd.studio.runs import Roots

    warm_up(REPOSITORY)
    with tempfile.TemporaryDirectory() as tmp:
        rss = {"start": rss_mb()}
        studio = Studio(Roots([tmp]), REPOSITORY)
        try:
            start = time.perf_counter()
            command_bytes = fill(studio.queue, n, REPOSITORY)
            fill_s = time.perf_counter() - start
            middle = n // 2 + 1
            write_log(studio.queue, middle)
            rss["filled"] = rss_mb()
            row = {"jobs": n, "fill_s": fill_s, "command_bytes": command_bytes, **overhead(studio.queue, repeats)}
            row["follow_ms"], row["follow_p90_ms"] = timed(studio.queue.follow_once, calls)
            row["follow_heap_mb"] = heap_rise_mb(studio.queue.follow_once, HEAP_CALLS)
            row["api"] = api_rows(studio, calls, middle)
            rss["api"] = rss_mb()
            row["db_mb"] = (studio.queue.folder / "jobs.sqlite3").stat().st_size / 2**20
        finally:
            studio.queue.close()
    return {**row, "rss_start_mb": rss["start"], "rss_filled_mb": rss["filled"], "rss_end_mb": rss["api"],
            "rss_growth_mb": rss["api"] - rss["start"], "rss_calls_growth_mb": rss["api"] - rss["filled"]}


def in_own_process(n: int, repeats: int, calls: int) -> dict:
    result = subprocess.run([sys.executable, __file__, "--one", str(n), "--repeats", str(repeats), "--calls",
                             str(calls)], capture_output=True, text=True, timeout=1800)
    if result.returncode:
        raise RuntimeError(f"--jobs {n} failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# -- the report ------------------------------------------------------------------------------------------------------
def machine() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "unknown")
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join([Path(sys.executable).name, *sys.argv]), "cpus": os.cpu_count(),
            "cpu_model": model, "load_average": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(), "sqlite": sqlite3.sqlite_version, "platform": platform.platform()}


def print_header(info: dict) -> None:
    print(f"# studio_queue  {info['date']}")
    print(f"# command: {info['command']}")
    print(f"# machine: {info['cpus']} CPUs ({info['cpu_model']}), load {info['load_average']}, python "
          f"{info['python']}, sqlite {info['sqlite']}, {info['platform']}")


def print_overhead(rows: list[dict], repeats: int) -> None:
    print(f"\n1. queue overhead per job: submit -> finished (follow_once every {POLL_S * 1e3:.0f} ms) against "
          f"subprocess.run, {repeats} jobs each, ms")
    print("   runner: sd.studio.runner run on the job's folder by subprocess.run (no queue); bookkeeping: queued - "
          "runner; follow_once: one look with the jobs on disk and nothing running")
    print(f"{'jobs':>7} {'direct':>7} {'p90':>7} {'runner':>7} {'p90':>7} {'queued':>7} {'p90':>7} {'ratio':>6} "
          f"{'overhead':>9} {'bookkeeping':>12} {'follow_once':>12} {'p90':>7} {'fill s':>7} {'db MB':>6}")
    for r in rows:
        print(f"{r['jobs']:>7} {r['direct_ms']:>7.1f} {r['direct_p90_ms']:>7.1f} {r['runner_ms']:>7.1f} "
              f"{r['runner_p90_ms']:>7.1f} {r['queued_ms']:>7.1f} {r['queued_p90_ms']:>7.1f} {r['ratio']:>6.2f} "
              f"{r['overhead_ms']:>9.1f} {r['bookkeeping_ms']:>12.1f} {r['follow_ms']:>12.3f} "
              f"{r['follow_p90_ms']:>7.3f} {r['fill_s']:>7.2f} {r['db_mb']:>6.2f}")


def print_api(rows: list[dict], calls: int) -> None:
    print(f"\n2. API latency (TestClient, Host 127.0.0.1), {calls} calls each, ms; heap: tracemalloc peak rise over "
          f"{HEAP_CALLS} calls, MB")
    print("   POST: the queue's start replaced by marking the row finished (no process runs)")
    print(f"{'endpoint':36} {'jobs':>7} {'median':>8} {'p90':>8} {'heap MB':>8}")
    for label in [api["endpoint"] for api in rows[0]["api"]]:
        for r in rows:
            api = next(a for a in r["api"] if a["endpoint"] == label)
            print(f"{label:36} {r['jobs']:>7} {api['median_ms']:>8.2f} {api['p90_ms']:>8.2f} {api['heap_mb']:>8.3f}")


def print_memory(rows: list[dict]) -> None:
    print("\n3. memory: heap = tracemalloc peak rise (MB); RSS of the size's own process (MB)")
    print(f"{'jobs':>7} {'follow heap':>12} {'API heap max':>13} {'RSS start':>10} {'filled':>8} {'end':>8} "
          f"{'growth':>8} {'in calls':>9}")
    for r in rows:
        print(f"{r['jobs']:>7} {r['follow_heap_mb']:>12.3f} {max(a['heap_mb'] for a in r['api']):>13.3f} "
              f"{r['rss_start_mb']:>10.1f} {r['rss_filled_mb']:>8.1f} {r['rss_end_mb']:>8.1f} "
              f"{r['rss_growth_mb']:>8.1f} {r['rss_calls_growth_mb']:>9.1f}")


def growth(rows: list[dict]) -> dict:
    """Each median time at every size over the same at the smallest size (1.0: flat in the number of jobs)."""
    first, ratios = rows[0], {}
    for r in rows[1:]:
        key = f"{r['jobs']}/{first['jobs']}"
        ratios[key] = {"queued": r["queued_ms"] / first["queued_ms"],
                       "follow_once": r["follow_ms"] / first["follow_ms"],
                       **{a["endpoint"]: a["median_ms"] / b["median_ms"] for a, b in zip(r["api"], first["api"])}}
    return ratios


def print_ratios(rows: list[dict], ratios: dict) -> None:
    print()
    for r in rows:
        print(f"ratio queued/direct at {r['jobs']} jobs = {r['ratio']:.2f}x (overhead {r['overhead_ms']:.1f} ms a job, "
              f"of which {r['bookkeeping_ms']:.1f} ms beyond the runner's own process)")
    for key, values in ratios.items():
        print(f"growth {key} jobs (median time): " + ", ".join(f"{label} {v:.2f}x" for label, v in values.items()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, nargs="+", default=[100, 1000],
                        help="finished jobs on disk, one measurement each (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=20, help="trivial jobs run queued and direct (default: 20)")
    parser.add_argument("--calls", type=int, default=50, help="timed calls an endpoint and of follow_once "
                                                              "(default: 50)")
    parser.add_argument("--out", default="", help="also write the result JSON to this file")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a size, in its own process
    args = parser.parse_args(argv)
    if min(args.jobs) < 2 or args.repeats < 1 or args.calls < 1:
        parser.error("--jobs at least 2 each, --repeats and --calls at least 1")
    if args.one is not None:
        print(json.dumps(measure_size(args.one, args.repeats, args.calls)))
        return 0
    info = machine()
    print_header(info)
    rows = []
    for n in args.jobs:
        rows.append(in_own_process(n, args.repeats, args.calls))
        print(f"# {n} jobs measured", flush=True)
    print_overhead(rows, args.repeats)
    print_api(rows, args.calls)
    print_memory(rows)
    ratios = growth(rows)
    print_ratios(rows, ratios)
    result = {"bench": "studio_queue", **info, "repeats": args.repeats, "calls": args.calls, "rows": rows,
              "growth": ratios}
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

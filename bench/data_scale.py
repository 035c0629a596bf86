"""Benchmark: a data stage at growing input sizes, beside its peers, projected to LAION-2B-en.

    python bench/data_scale.py --stage 02                                # 250k and 1M rows: about a minute
    python bench/data_scale.py --stage 02 --sizes 1000000,4000000,16000000

For each size the stage's synthetic inputs are built once, then ours and each peer run in their own
process on them; ``os.wait4`` gives each process's CPU time (user + system, all threads) and peak
resident memory (the inputs are built in yet another process, so that the measuring process stays
small: a child's peak starts from its parent's). Printed per run: wall time, CPU time, input rows per
CPU-second and peak RSS; then, per implementation, the growth from the smallest to the largest size,
the marginal rate (extra rows over extra CPU time, so start-up cancels out), a projection to
LAION-2B-en (2.3 billion rows in 128 parquet files) and the ratio ours/peer; and one JSON line
(``--json FILE`` writes it too).

One function per stage (``stage_02``) builds its inputs and returns its measurements; the command
line, the process measurement and the printing are shared, so another stage adds one function to
STAGES.

Stage 02 (``pipeline/02_filter_metadata.py``, phase 1 thresholds): inputs are LAION-shaped metadata
(URL, TEXT, WIDTH, HEIGHT, similarity, hash, punsafe, pwatermark, aesthetic with laion2B-en-aesthetic's
types; about 8% of rows pass the filters, 3% repeat an earlier URL, 2% share stock captions and
sizes, 0.1% lack a URL) split over ``--files`` files. Peers: the previous stage (pandas + Python sets, taken
from git at PREVIOUS_02) and one plain DuckDB query (the same filters; first row per URL and per
caption+size, a looser rule than the stage's; no counts per reason; one output file).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import SD_Cli  # noqa: E402

LAION_ROWS = 2_300_000_000  # LAION-2B-en
LAION_FILES = 128
PREVIOUS_02 = "cc5a5d7"  # the last commit with the pandas version of stage 02


# ---------------------------------------------------------------------------------------------
# Shared: running a command in its own process and reading what it cost
# ---------------------------------------------------------------------------------------------


def measure(command: list[str], *, env: dict | None = None, log: Path) -> dict:
    """Run ``command`` to its end; its wall time, CPU time (user + system, every thread) and peak RSS."""
    with open(log, "w") as output:
        start = time.perf_counter()
        process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=output,
                                   stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])} ... exited {process.returncode}:\n{log.read_text()[-2000:]}")
    # ru_maxrss is in KiB on Linux
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss_gb": usage.ru_maxrss / 2**20}


def build_in_another_process(function: str, *arguments) -> None:
    """Call ``function(*arguments)`` of this module in a child process. The inputs are built there, not
    here, because a child's ru_maxrss starts from this process's peak (Python starts children with
    vfork, and at exec Linux counts the memory the child leaves, the parent's, in the child's peak):
    gigabytes of inputs built here would show in every measured run."""
    call = f"{function}(*{[str(argument) if isinstance(argument, Path) else argument for argument in arguments]!r})"
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from data_scale import *; {call}"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def growth(rows: list[dict]) -> list[dict]:
    """Per implementation: smallest and largest size, how CPU time and memory grew, the marginal rate
    and the projection to LAION-2B-en: CPU-hours, and peak RSS extrapolated linearly in rows per file,
    capped, for a run with a ``memory_limit_gb``, at that limit plus what the process held at the
    smallest size."""
    summary = []
    for impl in dict.fromkeys(row["impl"] for row in rows):
        runs = sorted((row for row in rows if row["impl"] == impl), key=lambda row: row["rows"])
        small, large = runs[0], runs[-1]
        extra_cpu = large["cpu_s"] - small["cpu_s"]
        marginal = (large["rows"] - small["rows"]) / extra_cpu if len(runs) > 1 and extra_cpu > 0 else None
        rate = marginal or large["rows_per_cpu_s"]
        per_file = (large["rows_per_file"] - small["rows_per_file"]) or 1
        rss_slope = (large["peak_rss_gb"] - small["peak_rss_gb"]) / per_file
        laion_rss = large["peak_rss_gb"] + max(0.0, rss_slope) * (LAION_ROWS / LAION_FILES - large["rows_per_file"])
        if large.get("memory_limit_gb"):
            laion_rss = min(laion_rss, large["memory_limit_gb"] + small["peak_rss_gb"])
        summary.append({
            "impl": impl, "rows": [small["rows"], large["rows"]],
            "rows_x": large["rows"] / small["rows"], "cpu_x": large["cpu_s"] / small["cpu_s"],
            "rss_x": large["peak_rss_gb"] / small["peak_rss_gb"], "marginal_rows_per_cpu_s": marginal,
            "rate_rows_per_cpu_s": rate,
            "laion_cpu_hours": LAION_ROWS / rate / 3600,
            "laion_peak_rss_gb": laion_rss,
        })
    return summary


def print_results(rows: list[dict], summary: list[dict]) -> None:
    print(f"{'impl':<12}{'rows':>12}{'files':>6}{'wall s':>9}{'CPU s':>9}{'rows/CPU-s':>12}{'peak RSS GB':>13}")
    for row in rows:
        print(f"{row['impl']:<12}{row['rows']:>12,}{row['files']:>6}{row['wall_s']:>9.2f}{row['cpu_s']:>9.2f}"
              f"{row['rows_per_cpu_s']:>12,.0f}{row['peak_rss_gb']:>13.2f}")
    print(f"\ngrowth from the smallest to the largest size, and LAION-2B-en ({LAION_ROWS:,} rows, "
          f"{LAION_FILES} files) projected:")
    for item in summary:
        marginal = "-" if item["marginal_rows_per_cpu_s"] is None else f"{item['marginal_rows_per_cpu_s']:,.0f}"
        print(f"  {item['impl']:<11} rows x{item['rows_x']:.0f}: CPU x{item['cpu_x']:.1f}, peak RSS "
              f"x{item['rss_x']:.2f}; marginal {marginal} rows/CPU-s; LAION: {item['laion_cpu_hours']:,.1f} "
              f"CPU-hours, peak RSS ~{item['laion_peak_rss_gb']:.1f} GB")
    ours = next(item for item in summary if item["impl"] == "ours")
    for item in summary:
        if item is not ours:
            ratio = ours["rate_rows_per_cpu_s"] / item["rate_rows_per_cpu_s"]
            print(f"ratio ours/{item['impl']} (rows per CPU-second, marginal) = {ratio:.2f}x")


def size_gb(text: str) -> float | None:
    """``4GB`` / ``500MB`` / ``2GiB`` -> GB (2**30 bytes); None for a share of RAM (``50%``)."""
    units = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
             "TIB": 2**40}
    number = text.strip().upper().rstrip("BKMGTI% ")
    unit = text.strip().upper()[len(number):].strip()
    return float(number) * units[unit] / 2**30 if unit in units else None


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown") if Path("/proc/cpuinfo").exists() else "unknown"
    return {"cpus": os.cpu_count(), "cpu_model": model, "load_average": list(os.getloadavg())}


# ---------------------------------------------------------------------------------------------
# Stage 02: filtering LAION metadata
# ---------------------------------------------------------------------------------------------

WORDS = ("a the of photo cat dog red blue house garden woman man portrait landscape vintage modern wooden table "
         "chair lamp sunset beach mountain city street car bike flower tree river sky black white green small "
         "large old new design art print poster canvas wall decor").split()
SIZES_PX = np.array([256, 512, 600, 640, 768, 800, 1024, 1200, 1920])


def laion_metadata(rows: int, first_id: int, seed: int):
    """One file of LAION-shaped metadata (laion2B-en-aesthetic's columns and types)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    rng = np.random.default_rng(seed)
    ids = np.arange(first_id, first_id + rows, dtype=np.int64)
    url_ids = np.where(rng.random(rows) < 0.03, rng.integers(0, first_id + rows, rows), ids)  # repeated URLs

    def text(numbers):
        return pc.cast(pa.array(numbers), pa.string())

    url = pc.binary_join_element_wise("https://cdn", text(url_ids % 97), ".example.com/images/", text(url_ids),
                                      "/photo-", text((url_ids * 7919) % 1_000_003), ".jpg", "")
    url = pc.if_else(pa.array(rng.random(rows) < 0.001), pa.nulls(rows, pa.string()), url)
    words, length = pa.array(WORDS), rng.integers(3, 13, rows)
    caption = pc.binary_join_element_wise(
        *[pc.if_else(pa.array(length > k), words.take(pa.array(rng.integers(0, len(WORDS), rows))),
                     pa.nulls(rows, pa.string())) for k in range(12)], " ", null_handling="skip")
    stock = rng.random(rows) < 0.02  # "stock photo N" at 600 x 600 from many URLs
    caption = pc.if_else(pa.array(stock), pc.binary_join_element_wise("stock photo ", text(rng.integers(0, 1000, rows)),
                                                                      ""), caption)
    return pa.table({
        "URL": url, "TEXT": caption,
        "WIDTH": np.where(stock, 600, rng.choice(SIZES_PX, rows)).astype(np.int64),
        "HEIGHT": np.where(stock, 600, rng.choice(SIZES_PX, rows)).astype(np.int64),
        "similarity": rng.normal(0.31, 0.035, rows), "hash": rng.integers(-2**62, 2**62, rows),
        "punsafe": rng.beta(1, 12, rows).astype(np.float32), "pwatermark": rng.beta(1, 6, rows).astype(np.float32),
        "aesthetic": rng.normal(5.6, 0.8, rows).astype(np.float32)})


def write_laion_files(folder: str, rows: int, files: int) -> None:
    import pyarrow.parquet as pq

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    per_file = rows // files
    for index in range(files):
        pq.write_table(laion_metadata(per_file, index * per_file, seed=index), folder / f"part-{index:05d}.parquet")


DUCKDB_PEER = """
import sys, duckdb
inputs, out, memory_limit, threads = sys.argv[1:]
con = duckdb.connect(config={"memory_limit": memory_limit, "threads": int(threads), "temp_directory": out + ".tmp"})
con.execute(f'''COPY (
    SELECT * EXCLUDE (filename, file_row_number, first_of_url, first_of_key) FROM (
        SELECT *,
            row_number() OVER (PARTITION BY trim(URL) ORDER BY filename, file_row_number) AS first_of_url,
            row_number() OVER (PARTITION BY trim(TEXT), WIDTH, HEIGHT ORDER BY filename, file_row_number)
                AS first_of_key
        FROM read_parquet('{inputs}', filename = true, file_row_number = true)
        WHERE trim(URL) <> '' AND trim(TEXT) <> '' AND aesthetic >= 6.5 AND similarity >= 0.28
          AND WIDTH >= 512 AND HEIGHT >= 512 AND pwatermark < 0.5 AND punsafe < 0.5)
    WHERE first_of_url = 1 AND first_of_key = 1) TO '{out}' (FORMAT parquet)''')
"""


def previous_stage_02(work: Path) -> Path | None:
    """The pandas version of the stage, from git; None where there is no git history."""
    script = work / "previous_02_filter_metadata.py"
    result = subprocess.run(["git", "show", f"{PREVIOUS_02}:pipeline/02_filter_metadata.py"], cwd=ROOT,
                            capture_output=True, text=True)
    if result.returncode != 0:
        print(f"previous stage 02 not measured: git show {PREVIOUS_02} failed ({result.stderr.strip()})")
        return None
    script.write_text(result.stdout)
    return script


def stage_02(args, size: int, work: Path) -> list[dict]:
    inputs = work / f"laion_{size}"
    started = time.perf_counter()
    build_in_another_process("write_laion_files", inputs, size, args.files)
    print(f"{size:,} rows in {args.files} files built in {time.perf_counter() - started:.1f} s", flush=True)
    pattern = str(inputs / "*.parquet")
    stage = [str(ROOT / "pipeline" / "02_filter_metadata.py"), "--input", pattern]
    runs = {"ours": ([sys.executable, *stage, "--out", str(work / "ours"), "--memory_limit", args.memory_limit,
                      "--threads", str(args.threads)], None),
            "duckdb-sql": ([sys.executable, "-c", DUCKDB_PEER, pattern, str(work / "duckdb.parquet"),
                            args.memory_limit, str(args.threads)], None)}
    previous = previous_stage_02(work)
    if previous is not None:
        runs["previous"] = ([sys.executable, str(previous), "--input", pattern, "--out", str(work / "previous")],
                            {"PYTHONPATH": str(ROOT)})
    rows = []
    for impl, (command, env) in runs.items():
        result = measure(command, env=env, log=work / f"{impl}.log")
        rows.append({"stage": "02", "impl": impl, "rows": size // args.files * args.files, "files": args.files,
                     "rows_per_file": size // args.files, **result,
                     "memory_limit_gb": None if impl == "previous" else size_gb(args.memory_limit)})
        rows[-1]["rows_per_cpu_s"] = rows[-1]["rows"] / result["cpu_s"]
    kept = {impl: json.loads((work / impl / "02_filter_metadata_summary.json").read_text())
            for impl in ("ours", "previous") if (work / impl).exists()}
    if len(kept) == 2:
        same = all(kept["ours"][key] == kept["previous"][key] for key in ("kept", "dropped"))
        print(f"  kept {kept['ours']['kept']:,}; same rows and counts per reason as the previous stage: {same}")
        for row in rows:
            row["same_as_previous"] = same
    for path in (inputs, work / "ours", work / "previous", work / "duckdb.parquet"):
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    return rows


STAGES = {"02": stage_02}


def main(argv=None) -> int:
    parser = SD_Cli.ArgumentParser(description=__doc__)
    parser.add_argument("--stage", choices=sorted(STAGES), required=True, help="the stage to measure")
    parser.add_argument("--sizes", default="250000,1000000", help="input rows, comma-separated")
    parser.add_argument("--files", type=int, default=4, help="input files each size is split over")
    parser.add_argument("--memory_limit", default="4GB", help="the stage's --memory_limit (and the DuckDB peer's)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the stage's --threads")
    parser.add_argument("--work_dir", default=None, help="where inputs and outputs go (default: a temporary folder)")
    parser.add_argument("--json", default="", help="also write the result JSON to this file")
    args = parser.parse_args(argv)
    sizes = sorted(int(size) for size in args.sizes.split(",") if size.strip())
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="data_scale_"))
    work.mkdir(parents=True, exist_ok=True)
    info = machine()
    print(f"machine: {info['cpus']} CPUs ({info['cpu_model']}), load average {info['load_average'][0]:.1f}")
    try:
        rows = [row for size in sizes for row in STAGES[args.stage](args, size, work / str(size))]
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    summary = growth(rows)
    print_results(rows, summary)
    result = {"stage": args.stage, "machine": {**info, "load_average_end": list(os.getloadavg())},
              "memory_limit": args.memory_limit, "threads": args.threads, "rows": rows, "growth": summary}
    line = json.dumps(result)
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

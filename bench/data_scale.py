"""Benchmark: every data stage at growing input sizes, beside its peers, projected to the real scale.

    python bench/data_scale.py --stage all                               # each stage at its default sizes
    python bench/data_scale.py --stage 02 --sizes 1000000,4000000,16000000
    python bench/data_scale.py --stage latents --sizes 50000,200000 --ranks 8

Stages (default sizes in brackets) and what is measured at each size:
* ``02`` (250k, 1M metadata rows): pipeline/02_filter_metadata.py, the previous pandas stage and one
  plain DuckDB query, each in its own process: wall and CPU time (``os.wait4``: user + system, every
  thread), rows per CPU-second, peak RSS; projected to LAION-2B-en (2.3 billion rows in 128 files).
* ``04`` (1k, 4k samples a shard of 77 kB images): stage 04's caption read from the img2dataset
  parquet and from the tar header by header, against the previous whole-tar read: seconds from a cold
  page cache, MB read (bench/caption_scale.py).
* ``captions`` (100k, 400k rows): the trainer's caption load (``sd.data.training_data.load_caption_split``, every
  rank at every start) through Arrow against the previous per-row load, one fresh process each:
  seconds, rows/s, memory the load added (bench/caption_scale.py).
* ``latents`` (10k, 40k latents of 4x64x64): the trainer's latent store on ``--ranks`` ranks started
  at once, against a private copy per rank: load seconds, random-batch samples/s, memory of the
  ranks' own (bench/latent_store.py).
* ``encode`` (1k, 10k images a shard): encode_latents.py with the tiny VAE at 64 px on the CPU:
  seconds, images/s and the process's peak RSS (bench/encode_scale.py).
Per stage: a table, the growth from the smallest to the largest size, the ratio against the previous
implementation, and the projection to the reference curriculum (LAION-2B-en metadata; 1.3M images,
captions and latents per phase; 10k-image shards); then one JSON line (``--json FILE`` writes it too).

Stage 02 is measured here; the others run their own benchmark as a child and put its results in one
form. Inputs of stage 02 are built in another process so that the measuring process stays small (a
child's peak starts from its parent's): LAION-shaped metadata (URL, TEXT, WIDTH, HEIGHT, similarity,
hash, punsafe, pwatermark, aesthetic with laion2B-en-aesthetic's types; about 8% of rows pass phase
1's filters, 3% repeat an earlier URL, 2% share stock captions and sizes, 0.1% lack a URL) split over
``--files`` files. Its peers: the previous stage (pandas + Python sets, from git at PREVIOUS_02) and
one DuckDB query (the same filters; first row per URL and per caption+size, a looser rule than the
stage's; no counts per reason; one output file).
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

import sd.cli

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
    code = f"from bench.data_scale import *; {call}"
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
    """The pandas version of the stage: its commit's whole tree from git (it imports the flat modules of
    its time), or None where there is no git history."""
    tree = work / "previous_tree"
    archive = subprocess.run(["git", "archive", "--format=tar", PREVIOUS_02], cwd=ROOT, capture_output=True)
    if archive.returncode != 0:
        print(f"previous stage 02 not measured: git archive {PREVIOUS_02} failed ({archive.stderr.decode().strip()})")
        return None
    tree.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree / "pipeline" / "02_filter_metadata.py"


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
                            {"PYTHONPATH": str(previous.parents[1])})
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


# ---------------------------------------------------------------------------------------------
# The other stages: their own benchmarks (each measures what its stage is about), run as a child,
# their results put in one form: per implementation and size, seconds, a rate and memory
# ---------------------------------------------------------------------------------------------

IMAGES_PER_PHASE = 1_300_000  # images (latents, captions) the reference curriculum trains on per phase
SHARD_IMAGES = 10_000  # stage 03's images per shard


def run_bench(script: str, arguments: list[str], work: Path) -> dict:
    """``bench/<script>`` with ``arguments`` in a child process; its ``--json`` result."""
    result = work / f"{Path(script).stem}.json"
    command = [sys.executable, str(Path(__file__).with_name(script)), *arguments, "--json", str(result)]
    print(f"$ python bench/{script} {' '.join(arguments)}", flush=True)
    completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(f"bench/{script} exited {completed.returncode}:\n{completed.stdout[-2000:]}"
                           f"{completed.stderr[-2000:]}")
    return json.loads(result.read_text())


def uniform(stage: str, impl: str, size: int, seconds: float, rate: float, memory_mb: float, **extra) -> dict:
    return {"stage": stage, "impl": impl, "size": size, "seconds": seconds, "rate": rate, "memory_mb": memory_mb,
            **extra}


def project(rows: list[dict], target: int) -> list[tuple[str, float, float]]:
    """Per implementation: seconds and memory at ``target``, linear from its smallest and largest size
    (the marginal cost of the extra size, never below the largest measured), or proportional to the
    size where there is one."""
    projected = []
    for impl in dict.fromkeys(row["impl"] for row in rows):
        runs = sorted((row for row in rows if row["impl"] == impl), key=lambda row: row["size"])
        small, large = runs[0], runs[-1]

        def at(key):
            if large["size"] == small["size"]:
                return large[key] * target / large["size"]
            slope = (large[key] - small[key]) / (large["size"] - small["size"])
            return large[key] + max(0.0, slope) * (target - large["size"])

        projected.append((impl, at("seconds"), at("memory_mb")))
    return projected


def duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def stage_captions(args, sizes: list[int], work: Path) -> tuple[list[dict], list[str]]:
    """The trainer's caption load (every rank, every start): Arrow against the previous per-row load.
    Memory: what the load added to the process."""
    result = run_bench("caption_scale.py", ["--sizes", ",".join(map(str, sizes)), "--shard_sizes", "100"], work)
    names = {"arrow": "ours", "per_row": "previous"}
    rows = [uniform("captions", names[r["way"]], r["rows"], r["seconds"], r["rows_per_s"], r["rss_growth_mb"],
                    peak_rss_mb=r["peak_rss_mb"]) for r in result["caption_load"]]
    return rows, [f"{impl}: {IMAGES_PER_PHASE:,} captions load in ~{duration(seconds)}, adding ~{memory / 1024:.2f} GB"
                  for impl, seconds, memory in project(rows, IMAGES_PER_PHASE)]


def stage_04(args, sizes: list[int], work: Path) -> tuple[list[dict], list[str]]:
    """Stage 04's caption read, one shard of each size (77 kB images): the img2dataset parquet and the
    tar walked header by header against the previous whole-tar read. Seconds: the read from a cold page
    cache; memory: the bytes read calls returned."""
    result = run_bench("caption_scale.py", ["--sizes", "1000", "--shard_sizes", ",".join(map(str, sizes))], work)
    names = {"previous: whole tar": "previous", "tar, headers only": "ours (tar)", "img2dataset parquet": "ours (parquet)"}
    rows = [uniform("04", names.get(r["way"], r["way"]), r["samples"], r["cold_read_s"],
                    r["samples"] / r["cold_read_s"], r["read_mb"], tar_mb=r["tar_mb"]) for r in result["stage04"]]
    return rows, [f"{impl}: {IMAGES_PER_PHASE:,} captions read in ~{duration(seconds)} from a cold disk, "
                  f"{read_mb / 1024:.2f} GB read" for impl, seconds, read_mb in project(rows, IMAGES_PER_PHASE)]


def stage_latents(args, sizes: list[int], work: Path) -> tuple[list[dict], list[str]]:
    """The trainer's latent store on ``--ranks`` ranks of one machine: the memory of their own (all
    ranks together), the load and the random-batch rate, against a private copy per rank."""
    result = run_bench("latent_store.py", ["--sizes", ",".join(map(str, sizes)), "--ranks", str(args.ranks)], work)
    rows = []
    for r in result["rows"]:
        for impl, key in (("ours", "ours"), ("previous", "peer")):
            rows.append(uniform("latents", impl, r["latents"], r[f"{key}_load_s"], r[f"{key}_samples_per_s"],
                                r[f"{key}_rss_anon_mb"], data_mb=r["data_mb"], ranks=r["ranks"]))
    data_gb = result["projected"]["data_gb"]
    own = ", ".join(f"{impl} {memory / 1024 * 8 / args.ranks:.1f} GB" for impl, _, memory in project(rows, IMAGES_PER_PHASE))
    return rows, [f"{IMAGES_PER_PHASE:,} latents at 512 px are {data_gb:.1f} GB; on an 8-rank machine the previous "
                  f"store holds {8 * data_gb:.0f} GB of process memory, ours {data_gb:.1f} GB of page cache that "
                  f"the ranks share (memory of their own, 8 ranks: {own})"]


def stage_encode(args, sizes: list[int], work: Path) -> tuple[list[dict], list[str]]:
    """encode_latents.py on one shard of each size (tiny VAE, 64 px, CPU): the process's peak RSS."""
    result = run_bench("encode_scale.py", ["--sizes", ",".join(map(str, sizes))], work)
    rows = [uniform("encode", "ours", r["images_per_shard"], r["seconds"], r["images_per_shard"] / r["seconds"],
                    r["peak_rss_mb"], tar_mb=r["tar_mb_per_shard"]) for r in result["rows"]]
    small, large = rows[0], rows[-1]
    per_image_kb = (large["memory_mb"] - small["memory_mb"]) * 1024 / max(1, large["size"] - small["size"])
    at_shard = small["memory_mb"] + max(0.0, per_image_kb) * (SHARD_IMAGES - small["size"]) / 1024
    grows = f"{per_image_kb:.2f} KB more per image of a shard" if per_image_kb > 0 else \
        f"no growth with the shard ({per_image_kb:.2f} KB per image: noise)"
    return rows, [f"ours: {grows}; a {SHARD_IMAGES:,}-image shard peaks at "
                  f"~{at_shard:.0f} MB per process, and shards are encoded one after another, so "
                  f"{IMAGES_PER_PHASE:,} images need no more (the VAE's rate is a GPU figure: bench/encode_throughput.py)"]


def print_uniform(stage: str, rows: list[dict], lines: list[str], units: tuple[str, str, str]) -> None:
    size_unit, rate_unit, memory_unit = units
    print(f"\nstage {stage}:")
    print(f"  {'impl':<16}{size_unit:>14}{'seconds':>10}{rate_unit:>14}{memory_unit:>20}")
    for row in rows:
        print(f"  {row['impl']:<16}{row['size']:>14,}{row['seconds']:>10.3f}{row['rate']:>14,.0f}"
              f"{row['memory_mb']:>20,.1f}")
    impls = list(dict.fromkeys(row["impl"] for row in rows))
    for impl in impls:
        runs = sorted((row for row in rows if row["impl"] == impl), key=lambda row: row["size"])
        if len(runs) > 1 and runs[0]["seconds"] > 0 and runs[0]["memory_mb"] > 0:
            print(f"  growth {impl}: size x{runs[-1]['size'] / runs[0]['size']:.0f} -> seconds "
                  f"x{runs[-1]['seconds'] / runs[0]['seconds']:.1f}, {memory_unit.strip()} "
                  f"x{runs[-1]['memory_mb'] / runs[0]['memory_mb']:.2f}")
    largest = max(row["size"] for row in rows)
    at_largest = {row["impl"]: row for row in rows if row["size"] == largest}
    if "previous" in at_largest:
        peer = at_largest["previous"]
        for impl, row in at_largest.items():
            if impl != "previous":
                print(f"  ratio {impl}/previous at {largest:,}: rate {row['rate'] / peer['rate']:.2f}x, "
                      f"{memory_unit.strip()} {row['memory_mb'] / max(peer['memory_mb'], 1e-9):.3f}x")
    for line in lines:
        print(f"  projected: {line}")


OTHER_STAGES = {  # name: (function, default sizes, (size, rate, memory) column names)
    "04": (stage_04, "1000,4000", ("shard samples", "samples/s", "MB read")),
    "captions": (stage_captions, "100000,400000", ("rows", "rows/s", "RSS growth MB")),
    "latents": (stage_latents, "10000,40000", ("latents", "samples/s", "own MB, all ranks")),
    "encode": (stage_encode, "1000,10000", ("shard images", "images/s", "peak RSS MB")),
}
STAGES = {"02": stage_02, **{name: function for name, (function, _, _) in OTHER_STAGES.items()}}
DEFAULT_SIZES = {"02": "250000,1000000", **{name: sizes for name, (_, sizes, _) in OTHER_STAGES.items()}}


def main(argv=None) -> int:
    parser = sd.cli.ArgumentParser(description=__doc__)
    parser.add_argument("--stage", choices=[*STAGES, "all"], required=True,
                        help="the stage to measure, or all of them at their default sizes")
    parser.add_argument("--sizes", default="", help="input sizes, comma-separated (default: the stage's, see above)")
    parser.add_argument("--files", type=int, default=4, help="stage 02: input files each size is split over")
    parser.add_argument("--memory_limit", default="4GB", help="stage 02: its --memory_limit (and the DuckDB peer's)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="stage 02: its --threads")
    parser.add_argument("--ranks", type=int, default=2, help="latents: ranks of one machine loading the store")
    parser.add_argument("--work_dir", default=None, help="where inputs and outputs go (default: a temporary folder)")
    parser.add_argument("--json", default="", help="also write the result JSON to this file")
    args = parser.parse_args(argv)
    stages = list(STAGES) if args.stage == "all" else [args.stage]
    if args.sizes and len(stages) > 1:
        parser.error("--sizes is one stage's; give --stage NAME with it")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="data_scale_"))
    work.mkdir(parents=True, exist_ok=True)
    info = machine()
    print(f"machine: {info['cpus']} CPUs ({info['cpu_model']}), load average {info['load_average'][0]:.1f}")
    results = {}
    try:
        for stage in stages:
            sizes = sorted(int(size) for size in (args.sizes or DEFAULT_SIZES[stage]).split(",") if size.strip())
            folder = work / f"stage_{stage}"
            folder.mkdir(parents=True, exist_ok=True)
            if stage == "02":
                rows = [row for size in sizes for row in stage_02(args, size, folder / str(size))]
                summary = growth(rows)
                print("\nstage 02:")
                print_results(rows, summary)
                results[stage] = {"memory_limit": args.memory_limit, "threads": args.threads, "rows": rows,
                                  "growth": summary}
            else:
                function, _, units = OTHER_STAGES[stage]
                rows, lines = function(args, sizes, folder)
                print_uniform(stage, rows, lines, units)
                results[stage] = {"rows": rows, "projected": lines}
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    result = {"stages": results, "machine": {**info, "load_average_end": list(os.getloadavg())}}
    line = json.dumps(result)
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

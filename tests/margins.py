"""What the tests of learning measure, against their bounds, on every CPU the suite may meet.

A test of learning (marker ``learned``) asserts a measured quantity (an accuracy, a loss ratio) against a
bound through ``at_least`` / ``at_most``. With ``SD_TEST_MARGINS=FILE`` set, each check also appends one
JSON line to FILE: the test, the quantity, its value, the bound, the kernels ATen dispatches to and the
configuration's name (``SD_TEST_CONFIG``).

    python tests/margins.py [--out DIR] [--configs NAME,...] [PYTEST ARGS]     # make test-margins

runs the learned tests once per configuration and prints, for each check, its value in each and its
smallest margin. The configurations are what a CI machine may be: this CPU's own kernels and AVX2's
(ATen, oneDNN and MKL each capped by its environment variable; a CPU without AVX-512 runs AVX2 natively),
with one thread in each of make test's two xdist workers and with two threads in one process. Float sums
split differently in each, so a model trained in each is a different draw: a check that passes in all
four with room to spare does not depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

# Environment variables that cap the kernels at AVX2: ATen's dispatch, oneDNN's convolutions, MKL's GEMMs.
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
# name -> (kernel caps, pytest-xdist workers, threads per process)
CONFIGS = {
    "native-xdist": ({}, 2, 1),
    "native-2threads": ({}, 0, 2),
    "avx2-xdist": (AVX2, 2, 1),
    "avx2-2threads": (AVX2, 0, 2),
}
ROOT = Path(__file__).resolve().parents[1]


def record(what: str, value: float, bound: float, kind: str) -> None:
    path = os.environ.get("SD_TEST_MARGINS")
    if not path:
        return
    line = {"test": os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0], "what": what, "value": float(value),
            "bound": float(bound), "kind": kind, "config": os.environ.get("SD_TEST_CONFIG", ""),
            "kernels": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}
    with open(path, "a") as file:  # one short line a write: workers appending at once do not interleave
        file.write(json.dumps(line) + "\n")


def at_least(what: str, value: float, bound: float, context=None) -> None:
    """Assert ``value >= bound`` (``what`` names the quantity), recording both."""
    record(what, value, bound, "at_least")
    assert value >= bound, f"{what}: {value:.4g} < {bound:.4g}" + (f" ({context})" if context is not None else "")


def at_most(what: str, value: float, bound: float, context=None) -> None:
    """Assert ``value <= bound``, recording both."""
    record(what, value, bound, "at_most")
    assert value <= bound, f"{what}: {value:.4g} > {bound:.4g}" + (f" ({context})" if context is not None else "")


def margin(row: dict) -> float:
    return row["value"] - row["bound"] if row["kind"] == "at_least" else row["bound"] - row["value"]


def table(rows: list[dict]) -> str:
    """One line per check: its value in each configuration and the smallest margin (value beyond bound)."""
    configs = sorted({row["config"] for row in rows})
    checks: dict[tuple, dict] = {}
    for row in rows:
        checks.setdefault((row["test"].split("::")[-1], row["what"]), {})[row["config"]] = row
    lines = ["| test | check | bound | " + " | ".join(configs) + " | smallest margin |",
             "|---" * (len(configs) + 4) + "|"]
    for (test, what), by_config in sorted(checks.items()):
        some = next(iter(by_config.values()))
        sign = ">=" if some["kind"] == "at_least" else "<="
        values = [f"{by_config[c]['value']:.3g}" if c in by_config else "-" for c in configs]
        worst = min(margin(row) for row in by_config.values())
        lines.append(f"| {test} | {what} | {sign} {some['bound']:.3g} | " + " | ".join(values) + f" | {worst:+.3g} |")
    return "\n".join(lines)


def avx512() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return " avx512f " in flags.replace("\n", " ")


def run(name: str, out: Path, pytest_args: list[str]) -> int:
    caps, workers, threads = CONFIGS[name]
    env = {**os.environ, **caps, "SD_TEST_MARGINS": str(out / f"{name}.jsonl"), "SD_TEST_CONFIG": name,
           "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    xdist = ["-n", str(workers), "--dist", "loadfile", "--no-loadscope-reorder"] if workers else []
    command = [sys.executable, "-m", "pytest", "-m", "learned", *xdist, *pytest_args]
    print(f"== {name}: {' '.join(f'{k}={v}' for k, v in caps.items())} {' '.join(command[1:])}", flush=True)
    return subprocess.run(command, cwd=ROOT, env=env).returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "runs" / "test_margins"), help="folder for the JSON lines")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"which of {', '.join(CONFIGS)}")
    args, pytest_args = parser.parse_known_args(argv)
    out = Path(args.out).resolve()  # the tests change directory
    out.mkdir(parents=True, exist_ok=True)
    names = [name for name in args.configs.split(",") if name]
    unknown = [name for name in names if name not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; choose from {', '.join(CONFIGS)}")
    if not avx512():  # the native kernels are AVX2 already: the capped runs would repeat them
        names = [name for name in names if not name.startswith("avx2")]
        print("this CPU has no AVX-512: its own kernels are AVX2's; run this on an AVX-512 machine for both")
    failed = []
    rows = []
    for name in names:
        (out / f"{name}.jsonl").unlink(missing_ok=True)
        if run(name, out, pytest_args) != 0:
            failed.append(name)
        path = out / f"{name}.jsonl"
        rows += [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    print(table(rows))
    if failed:
        print(f"failed in: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

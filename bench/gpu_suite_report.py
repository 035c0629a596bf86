"""What bench/gpu_suite.sh calls between its commands: the ``batch_size: auto`` batch, and a command's
output turned into a Markdown section.

    python bench/gpu_suite_report.py auto_batch --arch sd1 --resolution 512 --precision bf16
    python bench/gpu_suite_report.py section --title T --command C --log FILE --rc 0 --seconds 12 --timeout 600

``section`` prints: the heading, the command, how it ended (exit status, seconds, or the timeout), a
Markdown table for each list of records in the JSON line the benchmark ends with (``rows``,
``ratios``, ...) and one of its single values, a table of the counts of a pytest summary line, and
the printed output itself (the benchmark's own tables) in a text block.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import sd.cli

PYTEST_OUTCOMES = ("passed", "failed", "skipped", "errors", "error", "deselected", "xfailed", "xpassed")
SHOWN_LINES = 200  # of a command's output, the last


def auto_batch(args) -> int:
    """The micro-batch ``batch_size: auto`` picks (sd.train.memory.max_batch) for bench/train_throughput.py's step
    of ``--arch`` at ``--resolution``: the device's memory, or ``--gpu_gb`` (the smoke run on a CPU)."""
    import torch

    import sd.train.memory
    from bench import harness
    from sd.train.config import TrainConfig

    gpu_gb = args.gpu_gb or torch.cuda.get_device_properties(0).total_memory / 1e9
    frozen = "tiny" if args.arch == "tiny" else "sd1"
    config = TrainConfig(unet=harness.unet_preset(args.arch), text_encoder=frozen, vae=frozen, grad_accum=1,
                         precision=args.precision, grad_checkpointing=False, channels_last=False, compile=False)
    batch, _ = sd.train.memory.max_batch(config, gpu_gb, args.resolution, limit=args.limit)
    return batch


def json_result(text: str) -> dict | None:
    """The last line of ``text`` that is a JSON object (every benchmark ends with one)."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "/")


def table(records: list[dict]) -> list[str]:
    """A Markdown table of ``records``: a column per key holding a single value in any of them."""
    columns = []
    for record in records:
        columns += [k for k, v in record.items() if k not in columns and not isinstance(v, (dict, list))]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(record.get(k)) for k in columns) + " |" for record in records]
    return lines


def result_tables(result: dict) -> list[str]:
    lines = []
    for key, value in result.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            lines += [f"`{key}`:", "", *table(value), ""]
    single = {k: v for k, v in result.items() if not isinstance(v, (dict, list))}
    if single:
        lines += [*table([single]), ""]
    return lines


def pytest_counts(text: str) -> dict | None:
    """The counts of pytest's last summary line (``3 passed, 2 skipped in 4.1s``), or None."""
    for line in reversed(text.splitlines()):
        pattern = r"(\d+) (" + "|".join(PYTEST_OUTCOMES) + r")\b"
        found = {outcome: int(n) for n, outcome in re.findall(pattern, line)}
        if found and " in " in line:
            return {outcome: found.get(outcome, 0) for outcome in ("passed", "failed", "skipped", "errors")} | {
                "errors": found.get("errors", 0) + found.get("error", 0)}
    return None


def section(args) -> str:
    text = Path(args.log).read_text(errors="replace") if Path(args.log).exists() else ""
    if args.rc in (124, 137):
        ended = f"**timed out** after {args.timeout} s (what it printed before is below)"
    elif args.rc:
        ended = f"**failed**: exit status {args.rc} after {args.seconds} s"
    else:
        ended = f"exit status 0 after {args.seconds} s"
    lines = [f"## {args.title}", "", f"    {args.command}", "", ended, ""]
    result = json_result(text)
    if result is not None:
        lines += result_tables(result)
    counts = pytest_counts(text)
    if counts is not None:
        lines += table([counts]) + [""]
    printed = [line for line in text.splitlines() if not line.startswith("{")][-SHOWN_LINES:]
    lines += ["```text", *printed, "```", ""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = sd.cli.ArgumentParser(description=__doc__)
    commands = parser.add_subparsers(dest="what", required=True)
    auto = commands.add_parser("auto_batch", help="print the batch batch_size: auto picks")
    auto.add_argument("--arch", choices=["sd1", "tiny"], default="sd1")
    auto.add_argument("--resolution", type=int, default=512)
    auto.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    auto.add_argument("--gpu_gb", type=float, default=0.0, help="memory to fit (default: the CUDA device's)")
    auto.add_argument("--limit", type=int, default=1024, help="the largest batch considered")
    part = commands.add_parser("section", help="print a command's Markdown section")
    for name in ("--title", "--command", "--log"):
        part.add_argument(name, required=True)
    part.add_argument("--rc", type=int, required=True, help="the command's exit status (124 or 137: timed out)")
    part.add_argument("--seconds", type=int, default=0)
    part.add_argument("--timeout", type=int, default=0)
    args = parser.parse_args(argv)
    if args.what == "auto_batch":
        print(auto_batch(args))
    else:
        sys.stdout.write(section(args))


if __name__ == "__main__":
    main()

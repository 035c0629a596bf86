"""bench/gpu_suite.sh --smoke runs every piece of the GPU suite at the tiniest size on the CPU and
collects each one's tables into one Markdown file."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PIECES = ("Training step, 64 px, eager", "Ours vs diffusers' train_text_to_image.py step", "DDP on 2 CPU processes",
          "Peak memory, measured", "Memory estimate", "Sampling", "Latent encoding", "pytest -m gpu")


def sections(markdown: str) -> dict[str, str]:
    parts = re.split(r"^## ", markdown, flags=re.MULTILINE)
    return {part.splitlines()[0]: part for part in parts[1:]}


def table_rows(section: str) -> list[list[str]]:
    """The body rows of the section's Markdown tables (not headings or separators)."""
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    rows, previous = [], ""
    for line in lines:
        if not previous.startswith("| ") or line.startswith("|---"):
            previous = line
            continue
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
        previous = line
    return [row for row in rows if row and not set("".join(row)) <= set("-")]


@pytest.mark.slow
def test_the_smoke_run_writes_every_piece_with_its_table(tmp_path):
    out = tmp_path / "suite.md"
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(["bash", str(ROOT / "bench" / "gpu_suite.sh"), "--smoke", "--out", str(out)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not out.with_name("suite.partial.md").exists()
    markdown = out.read_text()
    found = sections(markdown)
    summary = markdown.split("## ")[0]
    for piece in PIECES:
        [title] = [t for t in found if t.startswith(piece)]
        assert f"| {title} | ok |" in summary, title
        assert "exit status 0" in found[title], found[title][:2000]
        assert table_rows(found[title]), f"{title}: no table row"
    train = found[next(t for t in found if t.startswith("Training step, 64 px, eager"))]
    auto = int(re.search(r"auto \((\d+)\)", train).group(1))
    batches = {row[2] for row in table_rows(train) if row[0] == "ours"}
    assert batches == {"2", str(auto)}  # the listed batch and the one batch_size: auto picks
    tests = table_rows(found["pytest -m gpu"])
    assert tests[-1][:2] == ["0", "0"]  # none passed or failed: the GPU tests skip on a CPU

"""bench/gpu_suite.sh --smoke runs every piece of the GPU suite at the tiniest size on the CPU and
collects each one's tables into one Markdown file; its Python pieces run through bench/preload.py."""

import os
import re
import signal
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
    assert "Its Python pieces ran in children of one interpreter" in summary  # bench/preload.py started
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


SCRIPT = """import os, sys, time
print("argv", sys.argv[1:], __name__, os.path.isabs(__file__))
print("to stderr", file=sys.stderr)
if sys.argv[1] == "sleep":
    open(sys.argv[2], "w").write(str(os.getpid()))
    time.sleep(120)
if sys.argv[1] == "raise":
    raise ValueError("raised in the script")
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def preload_server(tmp_path):
    """bench/preload.py's server (preloading only json), and the command line of its ``run``."""
    import time

    socket_path = tmp_path / "preload.sock"
    server = subprocess.Popen([sys.executable, str(ROOT / "bench" / "preload.py"), "serve", str(socket_path), "json"],
                              cwd=tmp_path)
    deadline = time.monotonic() + 60
    while not socket_path.exists():
        assert server.poll() is None and time.monotonic() < deadline, "the server never listened"
        time.sleep(0.05)
    (tmp_path / "script.py").write_text(SCRIPT)
    yield [sys.executable, str(ROOT / "bench" / "preload.py"), "run", str(socket_path), "script.py"]
    server.terminate()
    server.wait(timeout=30)


def test_a_preloaded_run_is_the_script_as_python_runs_it_with_its_exit_status(preload_server, tmp_path):
    result = subprocess.run([*preload_server, "3"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (3, "argv ['3'] __main__ True\n", "to stderr\n")
    result = subprocess.run([*preload_server, "raise"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stderr.rstrip().endswith("ValueError: raised in the script")
    result = subprocess.run([*preload_server, "0"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0  # the server still serves after a failed script


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_or_killed_preloaded_run_takes_its_script_with_it(preload_server, tmp_path, signum):
    """timeout's SIGTERM goes on to the script; a run killed outright has the server kill it."""
    import time

    pid_file = tmp_path / "pid"
    run = subprocess.Popen([*preload_server, "sleep", str(pid_file)], cwd=tmp_path, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert run.poll() is None and time.monotonic() < deadline, "the script never started"
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    run.send_signal(signum)
    assert run.wait(timeout=30) == (128 + signal.SIGTERM if signum == signal.SIGTERM else -signal.SIGKILL)
    while time.monotonic() < deadline:  # the server reaps it
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the script (pid {pid}) outlived its run")

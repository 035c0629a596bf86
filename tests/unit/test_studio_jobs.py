"""sd.studio.jobs: logs and metrics read incrementally in bounded memory."""

import json
import tracemalloc

import pytest

from sd.studio import jobs


def test_log_tail_reads_only_what_is_new_and_keeps_the_last_lines(tmp_path):
    path = tmp_path / "log"
    path.write_text("a\nb\nprogress 1%\rprogress 2%")
    tail = jobs.LogTail(path, lines=3)
    assert tail.read() == "a\nb\nprogress 2%"
    with open(path, "a") as handle:
        handle.write("\rprogress 100%\nc\nd\n")
    assert tail.read() == "progress 100%\nc\nd" and tail.offset == path.stat().st_size
    assert jobs.LogTail(tmp_path / "missing").read() == ""


def test_metrics_tail_stays_bounded_and_evenly_spaced(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = jobs.JsonlTail(path, points=100)
    with open(path, "w") as handle:
        for step in range(1, 1001):
            handle.write(json.dumps({"step": step, "loss": 1 / step}) + "\n")
        handle.write('{"step": 1001, "lo')  # a line being written
    rows = tail.read()
    steps = [row["step"] for row in rows]
    assert len(rows) <= 100 and steps[0] == 1 and len(set(b - a for a, b in zip(steps, steps[1:]))) == 1
    assert tail.last == {"step": 1000, "loss": 0.001}
    with open(path, "a") as handle:
        handle.write('ss": 0.5}\nnot json\n{"step": 1001, "eval_fid": 31.5}\n')
        for step in range(1002, 1400):
            handle.write(json.dumps({"step": step, "loss": 0.1}) + "\n")
    tail.read()
    assert tail.last == {"step": 1399, "loss": 0.1}
    assert tail.evaluations == {"eval_fid": (1001, 31.5)}  # kept whatever the thinning drops


@pytest.mark.slow
def test_metrics_tail_memory_is_flat_over_a_long_run(tmp_path):
    """A run of 150,000 logged steps (23 MB of metrics) read by the studio: a few MB held at most."""
    path = tmp_path / "metrics.jsonl"
    line = json.dumps({"step": 0, "loss": 0.1234567, "lr": 1e-4, "grad_norm": 0.5, "images_per_s": 12.5,
                       "note": "x" * 60})
    with open(path, "w") as handle:
        for step in range(150_000):
            handle.write(line.replace('"step": 0', f'"step": {step}') + "\n")
    tracemalloc.start()
    try:
        tail = jobs.JsonlTail(path, points=2000, chunk=1 << 18)
        rows = tail.read()
        peak_mb = tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()
    assert path.stat().st_size > 20 * 2**20
    assert len(rows) <= 2000 and tail.last["step"] == 149_999
    assert peak_mb < 8, peak_mb  # a chunk, its lines and 2,000 rows: not the file


def test_the_last_lines_come_from_the_end_of_a_large_log(tmp_path):
    path = tmp_path / "log.txt"
    with open(path, "w") as handle:
        for i in range(200_000):
            handle.write(f"line {i}\n")
        handle.write("step 1/9\rstep 9/9\n")
    assert jobs.last_lines(path, 3, window=4096) == ["line 199998", "line 199999", "step 9/9"]
    assert jobs.last_lines(path, 0) == [] and jobs.last_lines(tmp_path / "missing", 5) == []
    tracemalloc.start()
    jobs.last_lines(path, 50)
    assert tracemalloc.get_traced_memory()[1] < 8 << 20  # the window, not the 2.5 MB file plus its lines
    tracemalloc.stop()

"""bench/studio_queue.py at a tiny size: it runs, prints its three tables and its ratios, and writes the JSON it
prints. No timing is asserted: machines differ."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENDPOINTS = ["GET /jobs?limit=50", "GET /jobs?state=finished&limit=50", "GET /jobs/MIDDLE?lines=50", "GET /queue",
             "POST /jobs estimate (start: no-op)", "POST /jobs sample (start: no-op)"]


@pytest.mark.slow
def test_studio_queue_bench_prints_each_table_and_the_ratios(tmp_path):
    out = tmp_path / "queue.json"
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "studio_queue.py"), "--jobs", "20", "40",
                             "--repeats", "3", "--calls", "5", "--out", str(out)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout
    for header in ("# command: ", "# machine: ", "1. queue overhead per job",
                   " direct     p90  runner     p90  queued     p90  ratio  overhead  bookkeeping  follow_once",
                   "2. API latency", "endpoint                                jobs   median      p90  heap MB",
                   "3. memory", "follow heap  API heap max  RSS start   filled      end   growth  in calls"):
        assert header in printed, header
    assert "ratio queued/direct at 20 jobs = " in printed and "ratio queued/direct at 40 jobs = " in printed
    assert "growth 40/20 jobs (median time): queued " in printed
    for endpoint in ENDPOINTS:
        assert sum(line.startswith(endpoint + " ") for line in printed.splitlines()) == 2, endpoint  # one a size

    written = json.loads(out.read_text())
    assert written == json.loads(printed.splitlines()[-1])
    assert [row["jobs"] for row in written["rows"]] == [20, 40]
    for row in written["rows"]:
        assert [api["endpoint"] for api in row["api"]] == ENDPOINTS
        assert 200 < row["command_bytes"] < 400  # the rows it wrote are the size the pages write
        assert row["ratio"] == pytest.approx(row["queued_ms"] / row["direct_ms"])
        assert row["rss_end_mb"] > 0 and all(api["heap_mb"] > 0 for api in row["api"])
    assert set(written["growth"]["40/20"]) == {"queued", "follow_once", *ENDPOINTS}

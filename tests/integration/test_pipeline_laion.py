"""The LAION stages: 01 metadata download/copy, 02 metadata filter, 03 img2dataset image download."""

import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import sd.data.shards

from http_server import LoopbackServer
from shard_factory import image_bytes, random_image

ROOT = Path(__file__).resolve().parents[2]
stage01 = importlib.import_module("pipeline.01_download_metadata")
stage02 = importlib.import_module("pipeline.02_filter_metadata")
stage03 = importlib.import_module("pipeline.03_download_images")


def laion_row(url, text, width=600, height=700, aesthetic=7.0, similarity=0.31, pwatermark=0.1, punsafe=0.1):
    """One row with the column names of laion/laion2B-en-aesthetic."""
    return {"URL": url, "TEXT": text, "WIDTH": width, "HEIGHT": height, "similarity": similarity,
            "hash": 123, "punsafe": punsafe, "pwatermark": pwatermark, "aesthetic": aesthetic}


def write_parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


# Each drop reason occurs a known number of times; comments name the first failing check.
LAION_FILE_0 = [
    laion_row("http://x/1", "a cat"),                                      # kept
    laion_row("http://x/2", "a dog"),                                      # kept
    laion_row(None, "no url"),                                             # missing_url_or_caption
    laion_row("http://x/4", "   "),                                        # missing_url_or_caption
    laion_row("http://x/5", "ugly", aesthetic=6.4, similarity=0.1),        # low_aesthetic (first of two)
    laion_row("http://x/6", "unscored", aesthetic=None),                   # low_aesthetic (a null fails)
    laion_row("http://x/7", "off topic", similarity=0.27),                 # low_similarity
    laion_row("http://x/8", "narrow", width=511),                          # too_small
    laion_row("http://x/9", "flat", height=300, pwatermark=0.9),           # too_small (before watermark)
    laion_row("http://x/10", "stock", pwatermark=0.5),                     # watermark (keep only < 0.5)
    laion_row("http://x/11", "unsafe", punsafe=0.5),                       # nsfw (keep only < 0.5)
    laion_row("http://x/1", "same url, other caption"),                    # duplicate_url
    laion_row("http://x/13", "a dog"),                                     # duplicate_caption_size (600x700)
    laion_row("http://x/14", "a dog", width=800),                          # kept: same caption, other size
    laion_row("http://x/5", "the url of a dropped row"),                   # kept: row 5 was not kept
    laion_row("http://x/16", "edge", 512, 512, 6.5, 0.28, 0.49, 0.49),     # kept: every threshold's edge
]
LAION_FILE_1 = [
    laion_row("http://x/2", "a dog again"),                                # duplicate_url (across files)
    laion_row("http://x/20", "a cat"),                                     # duplicate_caption_size (across files)
    laion_row("http://x/21", "a bird"),                                    # kept
    laion_row("http://x/22", "nsfw", punsafe=0.9),                         # nsfw
    laion_row("http://x/23", "a fish", aesthetic=8.0),                     # kept
]
PHASE1_DROPPED = {"missing_url_or_caption": 2, "low_aesthetic": 2, "low_similarity": 1, "too_small": 2,
                  "watermark": 1, "nsfw": 2, "duplicate_url": 2, "duplicate_caption_size": 2}


def laion_inputs(tmp_path: Path) -> Path:
    folder = tmp_path / "meta"
    write_parquet(folder / "part-00000.parquet", LAION_FILE_0)
    write_parquet(folder / "part-00001.parquet", LAION_FILE_1)
    return folder


def run02(tmp_path: Path, inputs: Path, out: Path, *extra) -> dict:
    assert stage02.main(["--input", str(inputs / "*.parquet"), "--out", str(out), *extra]) == 0
    return json.loads((out / "02_filter_metadata_summary.json").read_text())


def mtimes(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.stat().st_mtime_ns for p in folder.rglob("*")
            if p.is_file() and not p.name.endswith("_summary.json")}


# ---------------------------------------------------------------------------------------------
# 02_filter_metadata
# ---------------------------------------------------------------------------------------------


def test_filter_drops_each_reason_in_order_across_files(tmp_path):
    out = tmp_path / "filtered"
    summary = run02(tmp_path, laion_inputs(tmp_path), out)
    assert summary["kept"] == 7 and summary["dropped"] == PHASE1_DROPPED
    kept0 = pq.read_table(out / "part-00000.parquet")
    assert kept0.column("URL").to_pylist() == ["http://x/1", "http://x/2", "http://x/14", "http://x/5", "http://x/16"]
    assert kept0.schema == pq.read_schema(tmp_path / "meta" / "part-00000.parquet")  # all columns, same types
    assert pq.read_table(out / "part-00001.parquet").column("URL").to_pylist() == ["http://x/21", "http://x/23"]
    stats1 = json.loads((out / "part-00001_stats.json").read_text())
    assert (stats1["count"], stats1["successes"]) == (5, 2)
    assert stats1["failed"] == {"nsfw": 1, "duplicate_url": 1, "duplicate_caption_size": 1}
    assert stats1["examples"]["duplicate_url"] == ["http://x/2"]
    assert stats1["columns"] == {"url": "URL", "caption": "TEXT", "width": "WIDTH", "height": "HEIGHT",
                                 "aesthetic": "aesthetic", "similarity": "similarity", "watermark": "pwatermark",
                                 "nsfw": "punsafe"}


def test_filter_rerun_is_a_noop_and_resume_reseeds_duplicates(tmp_path):
    inputs, out = laion_inputs(tmp_path), tmp_path / "filtered"
    first = run02(tmp_path, inputs, out)
    before = mtimes(out)
    second = run02(tmp_path, inputs, out)
    assert mtimes(out) == before
    assert (second["kept"], second["dropped"]) == (first["kept"], first["dropped"])
    assert (second["shards_written"], second["shards_already_done"]) == (0, 2)
    # Lose the second file's outputs: its cross-file duplicates must still be found from file 0's kept rows.
    (out / "part-00001_stats.json").unlink()
    (out / "part-00001.parquet").unlink()
    third = run02(tmp_path, inputs, out)
    assert (third["kept"], third["dropped"]) == (first["kept"], first["dropped"])
    assert (third["shards_written"], third["shards_already_done"]) == (1, 1)
    assert (out / "part-00000.parquet").stat().st_mtime_ns == before["part-00000.parquet"]
    assert json.loads((out / "part-00001_stats.json").read_text())["failed"]["duplicate_url"] == 1
    # Other thresholds into the same folder would mix two phases: refused before any work.
    done = mtimes(out)
    assert stage02.main(["--input", str(inputs / "*.parquet"), "--out", str(out), "--min_aesthetic", "7.5"]) == 2
    assert mtimes(out) == done


def variant_rows():
    """Another LAION release's names (lower-case, prediction, clip_similarity, NSFW labels)."""
    def row(url, caption, prediction=8.0, clip_similarity=0.35, watermark=0.1, nsfw="UNLIKELY"):
        return {"url": url, "Caption": caption, "width": 1024, "height": 768, "prediction": prediction,
                "clip_similarity": clip_similarity, "watermark": watermark, "NSFW": nsfw}
    return [
        row("u/a", "edge of phase 2", 7.5, 0.30, 0.14),   # kept in both phases
        row("u/b", "b", prediction=7.4),                  # phase 2: low_aesthetic
        row("u/c", "c", clip_similarity=0.29),            # phase 2: low_similarity
        row("u/d", "d", watermark=0.15),                  # phase 2: watermark
        row("u/e", "e", watermark=0.2),                   # phase 2: watermark
        row("u/f", "f", nsfw="UNSURE"),                   # nsfw
        row("u/g", "g", nsfw="NSFW"),                     # nsfw
        row("u/h", "h", nsfw=None),                       # nsfw (no label is not UNLIKELY)
    ]


def test_filter_detects_variant_columns_and_phase2_thresholds(tmp_path):
    write_parquet(tmp_path / "v" / "variant.parquet", variant_rows())
    phase1 = run02(tmp_path, tmp_path / "v", tmp_path / "p1")
    assert phase1["kept"] == 5 and phase1["dropped"] == {"nsfw": 3}
    stats = json.loads((tmp_path / "p1" / "variant_stats.json").read_text())
    assert stats["columns"] == {"url": "url", "caption": "Caption", "width": "width", "height": "height",
                                "aesthetic": "prediction", "similarity": "clip_similarity",
                                "watermark": "watermark", "nsfw": "NSFW"}
    phase2 = run02(tmp_path, tmp_path / "v", tmp_path / "p2",
                   "--min_aesthetic", "7.5", "--max_watermark", "0.15", "--min_similarity", "0.30")
    assert phase2["kept"] == 1
    assert phase2["dropped"] == {"low_aesthetic": 1, "low_similarity": 1, "watermark": 2, "nsfw": 3}
    assert phase2["thresholds"]["min_aesthetic"] == 7.5
    assert pq.read_table(tmp_path / "p2" / "variant.parquet").column("url").to_pylist() == ["u/a"]


def test_filter_skips_filters_whose_column_is_absent_with_a_warning(tmp_path, caplog):
    rows = [{"URL": "u/1", "TEXT": "same", "aesthetic": 7.0}, {"URL": "u/2", "TEXT": "same", "aesthetic": 6.0},
            {"URL": "u/3", "TEXT": "same", "aesthetic": 9.0}]
    write_parquet(tmp_path / "m" / "few.parquet", rows)
    summary = run02(tmp_path, tmp_path / "m", tmp_path / "out")
    # No size columns: same captions are not duplicates (a caption alone is too weak a key).
    assert summary["kept"] == 2 and summary["dropped"] == {"low_aesthetic": 1}
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    for role in ("similarity", "width", "height", "watermark", "nsfw"):
        assert f"no {role} column" in warned
    assert "no aesthetic column" not in warned


def test_filter_bad_command_lines_exit_2_before_any_work(tmp_path, capsys):
    write_parquet(tmp_path / "m" / "nocaption.parquet", [{"URL": "u/1", "aesthetic": 7.0}])
    out = tmp_path / "out"
    assert stage02.main(["--input", str(tmp_path / "m" / "*.parquet"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no caption column" in err and "TEXT|caption|text" in err and len(err.splitlines()) == 1
    write_parquet(tmp_path / "m2" / "ok.parquet", [laion_row("u/1", "x")])
    assert stage02.main(["--input", str(tmp_path / "m2" / "*.parquet"), "--out", str(out),
                         "--aesthetic_col", "score"]) == 2
    assert "no column 'score' (--aesthetic_col)" in capsys.readouterr().err
    assert stage02.main(["--input", str(tmp_path / "none" / "*.parquet"), "--out", str(out)]) == 2
    assert "no parquet files match" in capsys.readouterr().err
    assert not out.exists()


def reference_filter(files: list[list[dict]], limits: dict) -> tuple[list[list[int]], list[dict], list[dict]]:
    """The stage's rules as plain loops over rows: per file the ids kept (in order), the rows dropped per
    reason and the first URLs of each reason. LAION column names; every file has every column."""
    def text(value):
        return "" if value is None else str(value).strip()

    def number(value):
        try:
            return float(value)
        except (TypeError, ValueError):
            return float("nan")  # NaN fails every comparison, as NULL and junk do in the stage

    def first_failure(row):
        if not text(row["URL"]) or not text(row["TEXT"]):
            return "missing_url_or_caption"
        big_enough = [number(row[side]) >= limits["min_size"] for side in ("WIDTH", "HEIGHT")]
        checks = [("low_aesthetic", number(row["aesthetic"]) >= limits["min_aesthetic"]),
                  ("low_similarity", number(row["similarity"]) >= limits["min_similarity"]),
                  ("too_small", all(big_enough)),
                  ("watermark", number(row["pwatermark"]) < limits["max_watermark"]),
                  ("nsfw", number(row["punsafe"]) < limits["max_nsfw"])]
        return next((reason for reason, passes in checks if not passes), None)

    seen_urls, seen_keys, kept, counts, examples = set(), set(), [], [], []
    for rows in files:
        kept.append([])
        counts.append({})
        examples.append({})
        for row in rows:
            url, key = text(row["URL"]), (text(row["TEXT"]), number(row["WIDTH"]), number(row["HEIGHT"]))
            reason = first_failure(row)
            if reason is None and url in seen_urls:
                reason = "duplicate_url"
            elif reason is None and key in seen_keys:
                reason = "duplicate_caption_size"
            if reason is None:
                kept[-1].append(row["id"])
                seen_urls.add(url)
                seen_keys.add(key)
            else:
                counts[-1][reason] = counts[-1].get(reason, 0) + 1
                examples[-1].setdefault(reason, [])
                if len(examples[-1][reason]) < 20:
                    examples[-1][reason].append(url)
    return kept, counts, examples


def random_laion_files(seed: int, n_files: int = 3, rows: int = 300) -> list[list[dict]]:
    """Rows drawn from small pools, so URLs and caption+size keys repeat within and across files and
    form chains (A and B share a caption, B and C a URL, ...) that take the stage several rounds. Each
    filter fails on about one row in twenty: NULL, NaN, text of whitespace, values at the thresholds."""
    rng = np.random.default_rng(seed)

    def pick(passing, failing):
        values = failing if rng.random() < 0.05 else passing
        return values[rng.integers(len(values))]

    files, next_id = [], 0
    for _ in range(n_files):
        rows_of_file = []
        for _ in range(rows):
            width, height = pick([(600, 700), (512, 512), (800, 600)], [(511, 900), (None, 700), (float("nan"), 600), (600, float("nan"))])
            rows_of_file.append({
                "id": next_id, "URL": pick([f"http://x/{rng.integers(150)}", f" http://x/{rng.integers(150)}\u3000"],
                                          [None, "", " \t"]),
                "TEXT": pick([f"caption {rng.integers(40)}", f"\u00a0caption {rng.integers(40)} "], [None, "\u2003"]),
                "WIDTH": width, "HEIGHT": height,
                "aesthetic": pick([7.0, 6.5, float("inf")], [6.4, None, float("nan")]),
                "similarity": pick([0.31, 0.28], [0.27, None]), "pwatermark": pick([0.1, 0.49], [0.5, 0.9]),
                "punsafe": pick([0.1, 0.49], [0.5, None, float("nan")])})
            next_id += 1
        files.append(rows_of_file)
    return files


def test_filter_matches_a_plain_python_reference_on_random_duplicates(tmp_path, monkeypatch):
    files = random_laion_files(seed=4)
    for number, rows in enumerate(files):
        write_parquet(tmp_path / "meta" / f"part-{number}.parquet", rows)
    # One file's aesthetic scores as text: read as numbers, junk failing the filter.
    files[2] = [{**row, "aesthetic": None if row["aesthetic"] is None else str(row["aesthetic"])} for row in files[2]]
    files[2][0]["aesthetic"] = "junk"
    write_parquet(tmp_path / "meta" / "part-2.parquet", files[2])
    limits = {"min_aesthetic": 6.5, "min_similarity": 0.28, "min_size": 512, "max_watermark": 0.5, "max_nsfw": 0.5}
    kept, counts, examples = reference_filter(files, limits)
    rounds, deduplicate = [], stage02.deduplicate
    monkeypatch.setattr(stage02, "deduplicate", lambda con: rounds.append(deduplicate(con)) or rounds[-1])
    summary = run02(tmp_path, tmp_path / "meta", tmp_path / "out", "--threads", "2")
    for number in range(len(files)):
        assert pq.read_table(tmp_path / "out" / f"part-{number}.parquet").column("id").to_pylist() == kept[number]
        stats = json.loads((tmp_path / "out" / f"part-{number}_stats.json").read_text())
        assert (stats["successes"], stats["failed"], stats["examples"]) == (len(kept[number]), counts[number],
                                                                            examples[number])
    assert set(summary["dropped"]) == set(stage02.REASONS)  # every reason is hit
    assert summary["dropped"]["duplicate_url"] > 100 and summary["dropped"]["duplicate_caption_size"] > 100
    assert max(rounds) >= 3  # chains of duplicates that the sequential rule resolves one link at a time


def test_filter_in_two_steps_keeps_the_rows_of_one_run(tmp_path):
    """The cluster recipe: the filters alone per group of files (--dedup false), then one run over
    their outputs drops the duplicates: the same rows as one run over everything."""
    files = random_laion_files(seed=5, n_files=4, rows=150)
    for number, rows in enumerate(files):
        write_parquet(tmp_path / "meta" / f"part-{number}.parquet", rows)
    run02(tmp_path, tmp_path / "meta", tmp_path / "one")
    for group, pattern in (("0", "part-[01].parquet"), ("1", "part-[23].parquet")):
        assert stage02.main(["--input", str(tmp_path / "meta" / pattern), "--out", str(tmp_path / "groups" / group),
                             "--dedup", "false"]) == 0
    filtered = json.loads((tmp_path / "groups" / "0" / "part-0_stats.json").read_text())
    assert filtered["dedup"] is False and "duplicate_url" not in filtered["failed"]
    second = stage02.main(["--input", str(tmp_path / "groups" / "*" / "*.parquet"), "--out", str(tmp_path / "two")])
    assert second == 0
    for number in range(4):
        one, two = (pq.read_table(tmp_path / run / f"part-{number}.parquet") for run in ("one", "two"))
        assert one.column("id").to_pylist() == two.column("id").to_pylist()
    # Mixing the two modes in one folder is refused before any work.
    assert stage02.main(["--input", str(tmp_path / "meta" / "*.parquet"), "--out", str(tmp_path / "one"),
                         "--dedup", "false"]) == 2


def test_filter_spills_to_disk_under_a_memory_limit_smaller_than_its_data(tmp_path, monkeypatch, capsys):
    # 2 files x 20,000 rows carrying 3 kB each (an EXIF dump): 120 MB of rows to hold, against 64 MB.
    (tmp_path / "meta").mkdir()
    rows = 20_000
    noise = np.random.default_rng(0)  # incompressible EXIF: DuckDB 2 compresses what it spills
    for number in range(2):
        exif = noise.bytes(1_500 * rows).hex()
        table = pa.table({"URL": [f"u/{(row + number * rows) % 30_000}" for row in range(rows)],
                          "TEXT": [f"caption {row % 5_000}" for row in range(rows)], "WIDTH": [600] * rows,
                          "HEIGHT": [700] * rows, "EXIF": [exif[row * 3_000 : (row + 1) * 3_000] for row in range(rows)]})
        pq.write_table(table, tmp_path / "meta" / f"p{number}.parquet", row_group_size=2_000)
    spilled, settings = [], []
    deduplicate = stage02.deduplicate

    def spy(con):  # what DuckDB holds once the file's rows that pass the filters are loaded
        settings.append(con.execute("SELECT current_setting('memory_limit'), current_setting('temp_directory')")
                        .fetchall()[0])
        spilled.append(con.execute("SELECT coalesce(sum(size), 0) FROM duckdb_temporary_files()").fetchall()[0][0])
        return deduplicate(con)

    monkeypatch.setattr(stage02, "deduplicate", spy)
    summary = run02(tmp_path, tmp_path / "meta", tmp_path / "out", "--memory_limit", "64MB", "--threads", "1")
    # Captions repeat every 5,000 rows at one size: file 0 keeps rows 0-4,999. File 1's rows 10,000-19,999
    # repeat the URLs of file 0's rows 0-9,999, of which only the first 5,000 were kept.
    assert summary["kept"] == 5_000
    assert summary["dropped"] == {"duplicate_url": 5_000, "duplicate_caption_size": 30_000}
    assert settings[0] == ("61.0 MiB", str(tmp_path / "out" / ".duckdb_tmp"))
    assert min(spilled) > 10 << 20  # the candidates did not fit and went to disk
    assert not (tmp_path / "out" / ".duckdb_tmp").exists()
    # Below what DuckDB needs to work at all: one line naming the flag.
    code = stage02.main(["--input", str(tmp_path / "meta" / "*.parquet"), "--out", str(tmp_path / "tiny"),
                         "--memory_limit", "8MB", "--threads", "1"])
    err = [line for line in capsys.readouterr().err.splitlines() if "02_filter_metadata.py:" in line]  # beside tqdm's
    assert code == 2 and len(err) == 1 and "more memory needed than --memory_limit 8MB allows" in err[0]


# ---------------------------------------------------------------------------------------------
# 01_download_metadata
# ---------------------------------------------------------------------------------------------


def test_metadata_local_copy_counts_rows_and_skips_done_files(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    write_parquet(src / "part-00000.parquet", [laion_row(f"u/{i}", "x") for i in range(3)])
    write_parquet(src / "sub" / "part-00001.parquet", [laion_row(f"u/{i}", "x") for i in range(5)])
    (src / "README.md").write_text("not matched")
    (src / "broken.parquet").write_bytes(b"PAR1 not really")
    assert stage01.main(["--out", str(out), "--local_dir", str(src)]) == 0
    summary = json.loads((out / "01_download_metadata_summary.json").read_text())
    assert summary["rows"] == 8 and summary["kept"] == 8 and summary["dropped"] == {"unreadable_parquet": 1}
    assert [(f["file"], f["rows"]) for f in summary["files"]] == [
        ("broken.parquet", None), ("part-00000.parquet", 3), ("sub/part-00001.parquet", 5)]
    assert (summary["shards_written"], summary["shards_already_done"]) == (3, 0)
    assert not (out / "README.md").exists()
    before = mtimes(out)
    (out / "sub" / "part-00001.parquet").write_bytes(b"cut off")  # an interrupted copy elsewhere
    again = stage01.main(["--out", str(out), "--local_dir", str(src)])
    summary = json.loads((out / "01_download_metadata_summary.json").read_text())
    assert again == 0 and summary["rows"] == 8 and (summary["shards_written"], summary["shards_already_done"]) == (1, 2)
    after = mtimes(out)
    assert after.pop("sub/part-00001.parquet") != before.pop("sub/part-00001.parquet") and after == before
    assert (out / "sub" / "part-00001.parquet").read_bytes() == (src / "sub" / "part-00001.parquet").read_bytes()


def test_metadata_hub_download_arguments(tmp_path, monkeypatch):
    import huggingface_hub

    real_signature = inspect.signature(huggingface_hub.snapshot_download)
    calls = []

    def fake_snapshot_download(**kwargs):
        real_signature.bind(**kwargs)  # the installed huggingface_hub accepts these arguments
        calls.append(kwargs)
        local = Path(kwargs["local_dir"])
        write_parquet(local / "data" / "part-00000.parquet", [laion_row(f"u/{i}", "x") for i in range(4)])
        write_parquet(local / ".cache" / "huggingface" / "stale.parquet", [laion_row("u/x", "x")])
        return str(local)

    # huggingface_hub resolves its attributes lazily; put the fake straight into the module's namespace.
    monkeypatch.setitem(vars(huggingface_hub), "snapshot_download", fake_snapshot_download)
    out = tmp_path / "out"
    assert stage01.main(["--out", str(out), "--revision", "abc123"]) == 0
    assert calls == [{"repo_id": "laion/laion2B-en-aesthetic", "repo_type": "dataset", "revision": "abc123",
                      "allow_patterns": ["*.parquet"], "local_dir": str(out)}]
    summary = json.loads((out / "01_download_metadata_summary.json").read_text())
    assert summary["rows"] == 4 and [f["file"] for f in summary["files"]] == ["data/part-00000.parquet"]
    assert summary["source"] == "hf://datasets/laion/laion2B-en-aesthetic@abc123"


def test_metadata_missing_local_dir_exits_2(tmp_path, capsys):
    assert stage01.main(["--out", str(tmp_path / "out"), "--local_dir", str(tmp_path / "nope")]) == 2
    assert "is not a folder" in capsys.readouterr().err and not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# 03_download_images
# ---------------------------------------------------------------------------------------------


IMAGE_SIZES = [(80, 120, "JPEG"), (200, 100, "PNG"), (64, 64, "JPEG"), (40, 30, "PNG"), (300, 90, "JPEG"),
               (90, 90, "PNG")]
STATUS = {"HTTP Error 404: Not Found": 1, "Image decoding error": 1,
          "Use of image disallowed by X-Robots-Tag directive": 1}


class NoAIServer:
    """Serves one image with ``X-Robots-Tag: noai`` (LoopbackServer sends no custom headers)."""

    def __init__(self, body: bytes):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.send_response(200)
                self.send_header("X-Robots-Tag", "noai")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def image_metadata(server_url: str, noai_url: str) -> list[dict]:
    """6 good images, then a URL that serves an image it forbids for AI use, a 404 and corrupt bytes."""
    urls = [f"{server_url}/img{i}" for i in range(len(IMAGE_SIZES))]
    urls += [f"{noai_url}/forbidden", f"{server_url}/missing", f"{server_url}/corrupt"]
    return [laion_row(url, f"caption {i}", aesthetic=7.0 + i / 10) for i, url in enumerate(urls)]


def image_routes() -> dict:
    rng = np.random.default_rng(0)
    routes = {f"/img{i}": image_bytes(random_image(rng, h, w), fmt) for i, (h, w, fmt) in enumerate(IMAGE_SIZES)}
    routes["/corrupt"] = b"\xff\xd8\xff\xe0 this is not a jpeg"
    return routes


def start03(inputs: Path, out: Path, *extra) -> subprocess.Popen:
    command = [sys.executable, "pipeline/03_download_images.py", "--input", str(inputs), "--out", str(out),
               "--resolution", "64", "--processes", "1", "--threads", "4", "--shard_size", "2", "--retries", "1",
               *extra]
    env = {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1", "no_proxy": "127.0.0.1,localhost"}
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish03(process: subprocess.Popen, out: Path) -> dict:
    try:
        stdout, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0, stdout[-2000:] + stderr[-3000:]
    return json.loads((out / "03_download_images_summary.json").read_text())


def run03(inputs: Path, out: Path, *extra) -> dict:
    return finish03(start03(inputs, out, *extra), out)


def read_samples(out: Path) -> dict:
    samples = {}
    for tar in sorted(out.glob("*.tar")):
        read, truncated = sd.data.shards.read_shard(tar.read_bytes())
        assert truncated is None
        samples.update((sample.key, sample) for sample in read)
    return samples


def check_samples(out: Path, metadata: list[dict]) -> None:
    samples = read_samples(out)
    assert len(samples) == 6
    by_url = {row["URL"]: row for row in metadata}
    for sample in samples.values():
        meta = json.loads(sample.metadata)
        assert sd.data.shards.decode_image(sample.image, sample.image_ext).shape == (64, 64, 3)
        assert sample.caption == by_url[meta["url"]]["TEXT"]
        assert meta["aesthetic"] == pytest.approx(by_url[meta["url"]]["aesthetic"])
        assert meta["punsafe"] == pytest.approx(0.1) and {"similarity", "pwatermark"} <= meta.keys()
    assert sorted(json.loads(s.metadata)["original_width"] for s in samples.values()) == [30, 64, 90, 90, 100, 120]


@pytest.mark.slow
def test_download_images_with_img2dataset(tmp_path):
    forbidden = image_bytes(random_image(np.random.default_rng(1), 64, 64), "PNG")
    with LoopbackServer(image_routes()) as server, NoAIServer(forbidden) as noai:
        metadata = image_metadata(server.url, noai.url)
        write_parquet(tmp_path / "meta" / "part-00000.parquet", metadata)
        filtered, out = tmp_path / "filtered", tmp_path / "shards"
        run02(tmp_path, tmp_path / "meta", filtered)  # 02's folder (with its stats JSONs) is 03's input
        summary = run03(filtered, out)
        assert (summary["kept"], summary["dropped"]) == (6, STATUS)
        assert (summary["failed_to_download"], summary["failed_to_resize"]) == (2, 1)
        assert (summary["shards_written"], summary["shards_already_done"]) == (5, 0)
        assert sorted(p.name for p in out.glob("*.tar")) == [f"0000{i}.tar" for i in range(5)]
        check_samples(out, metadata)
        hits = dict(server.hits)
        assert hits["/missing"] == 2 and all(hits[f"/img{i}"] == 1 for i in range(6))  # 404: 1 + 1 retry
        rerun = run03(filtered, out)
        assert server.hits == hits
        assert (rerun["kept"], rerun["dropped"], rerun["shards_already_done"]) == (6, STATUS, 5)
        # An unfinished shard 3 (rows 6-7) is fetched again, and only it. The summary JSON left by the last
        # run must not pass for shard 3's done marker: img2dataset reads any "03_*.json" as one.
        (out / "00003_stats.json").unlink()
        resumed = run03(filtered, out)
        assert server.hits == {**hits, "/missing": 4}
        assert (resumed["kept"], resumed["dropped"], resumed["shards_written"]) == (6, STATUS, 1)
        check_samples(out, metadata)
    # Stage 04 reads the captions of img2dataset's shards from the parquet beside each: the tars' samples.
    stage04 = importlib.import_module("pipeline.04_preprocess_to_cache")
    for tar in sorted(out.glob("*.tar")):
        from_parquet, (from_tar, cut) = stage04.img2dataset_samples(tar), stage04.tar_samples(tar)
        assert from_parquet is not None and cut is None
        assert [(s.key, s.caption, s.problem) for s in from_parquet] == [(s.key, s.caption, s.problem) for s in from_tar]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["pyspark", "ray"])
def test_the_distributed_engines_download_what_multiprocessing_does(tmp_path, engine):
    """img2dataset's pyspark (a local[1] Spark session) and ray (a local Ray instance) distributors against
    the loopback server: the shards of the single-process path. Both are the engines extra, which make
    setup installs (not requirements.txt: ~500 MB and, for Spark, a Java runtime)."""
    importlib.import_module(engine)  # installed by make setup: a missing engine fails here, never skips
    forbidden = image_bytes(random_image(np.random.default_rng(1), 64, 64), "PNG")
    with LoopbackServer(image_routes()) as server, NoAIServer(forbidden) as noai:
        metadata = image_metadata(server.url, noai.url)
        write_parquet(tmp_path / "meta" / "part-00000.parquet", metadata)
        run02(tmp_path, tmp_path / "meta", tmp_path / "filtered")
        # Side by side (each spends most of its time starting up).
        runs = {name: start03(tmp_path / "filtered", tmp_path / name, "--distributor", name)
                for name in ("multiprocessing", engine)}
        summaries = {name: finish03(process, tmp_path / name) for name, process in runs.items()}
    assert {(s["kept"], json.dumps(s["dropped"])) for s in summaries.values()} == {(6, json.dumps(STATUS))}
    by_process, by_engine = read_samples(tmp_path / "multiprocessing"), read_samples(tmp_path / engine)
    assert sorted(by_engine) == sorted(by_process) and len(by_process) == 6
    for key, sample in by_process.items():
        assert (by_engine[key].caption, by_engine[key].image) == (sample.caption, sample.image)
    check_samples(tmp_path / engine, metadata)


def banded(height: int, width: int) -> np.ndarray:
    """Red, green, blue vertical bands over the first quarter, the middle half and the last quarter."""
    image = np.zeros((height, width, 3), np.uint8)
    image[:, : width // 4] = (255, 0, 0)
    image[:, width // 4 : 3 * width // 4] = (0, 255, 0)
    image[:, 3 * width // 4 :] = (0, 0, 255)
    return image


@pytest.mark.slow
def test_download_images_keep_aspect_keeps_the_whole_image(tmp_path):
    # (height, width) -> written (height, width) with the short side at 64; None: dropped at 20:1.
    sizes = {(100, 200): (64, 128), (120, 60): (128, 64), (20, 40): (64, 128), (10, 200): None}
    routes = {f"/img{i}": image_bytes(banded(*size), "PNG") for i, size in enumerate(sizes)}
    with LoopbackServer(routes) as server:
        rows = [laion_row(f"{server.url}/img{i}", f"caption {i}") for i in range(len(sizes))]
        write_parquet(tmp_path / "filtered" / "part-00000.parquet", rows)
        summary = run03(tmp_path / "filtered", tmp_path / "shards", "--keep_aspect")
    assert (summary["kept"], summary["dropped"]) == (3, {"aspect ratio too large": 1})
    assert (summary["resolution"], summary["keep_aspect"]) == (64, "short")
    written = {}
    for sample in read_samples(tmp_path / "shards").values():
        meta = json.loads(sample.metadata)
        image = sd.data.shards.decode_image(sample.image, sample.image_ext)
        assert (meta["height"], meta["width"]) == image.shape[:2]
        written[meta["original_height"], meta["original_width"]] = image
    assert {original: image.shape[:2] for original, image in written.items()} == {
        original: size for original, size in sizes.items() if size}
    wide = written[100, 200].astype(int)  # nothing cropped: the outer red and blue bands are there
    assert np.abs(wide[:, 4:28] - (255, 0, 0)).max() < 40 and np.abs(wide[:, 100:124] - (0, 0, 255)).max() < 40


def test_keep_aspect_picks_img2dataset_resize_mode(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setitem(sys.modules, "img2dataset", types.SimpleNamespace(download=lambda **kw: calls.append(kw)))
    write_parquet(tmp_path / "in" / "a.parquet", [laion_row("http://127.0.0.1:9/x", "a cat")])
    for name, flags in (("square", []), ("short", ["--keep_aspect"]), ("long", ["--keep_aspect", "long"])):
        # The fake downloads nothing: shard 0 stays unfinished (exit 1) and the summary is still written.
        assert stage03.main(["--input", str(tmp_path / "in"), "--out", str(tmp_path / name), *flags]) == 1
        assert json.loads((tmp_path / name / "03_download_images_summary.json").read_text())["keep_aspect"] == (
            None if name == "square" else name)
    assert [(call["resize_mode"], call["image_size"], call["max_aspect_ratio"]) for call in calls] == [
        ("center_crop", 512, 8.0), ("keep_ratio", 512, 8.0), ("keep_ratio_largest", 512, 8.0)]


def test_download_images_bad_command_lines_exit_2(tmp_path, capsys, monkeypatch):
    assert stage03.main(["--input", str(tmp_path / "nothing"), "--out", str(tmp_path / "out")]) == 2
    assert "no parquet files" in capsys.readouterr().err
    write_parquet(tmp_path / "in" / "a.parquet", [{"URL": "u/1", "aesthetic": 7.0}])
    assert stage03.main(["--input", str(tmp_path / "in"), "--out", str(tmp_path / "out")]) == 2
    assert "no caption column" in capsys.readouterr().err
    assert stage03.main(["--input", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--caption_col", "alt"]) == 2
    assert "no column 'alt' (--caption_col)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        stage03.main(["--input", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--spark_master", "spark://h:7077"])
    assert exit_info.value.code == 2 and "--spark_master needs --distributor pyspark" in capsys.readouterr().err
    monkeypatch.setattr(stage03.importlib.util, "find_spec", lambda name: None)  # as where ray is not installed
    with pytest.raises(SystemExit) as exit_info:
        stage03.main(["--input", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--distributor", "ray"])
    assert exit_info.value.code == 2 and "--distributor ray needs ray: pip install ray" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


FLAGS = {
    "01_download_metadata": ["--out", "--repo_id", "--revision", "--patterns", "--local_dir"],
    "02_filter_metadata": ["--input", "--out", "--min_aesthetic", "--min_similarity", "--min_size",
                           "--max_watermark", "--max_nsfw", "--url_col", "--caption_col", "--width_col",
                           "--height_col", "--aesthetic_col", "--similarity_col", "--watermark_col", "--nsfw_col",
                           "--memory_limit", "--threads", "--dedup"],
    "03_download_images": ["--input", "--out", "--resolution", "--keep_aspect", "--processes", "--threads",
                           "--distributor", "--spark_master", "--url_col", "--caption_col", "--shard_size", "--timeout",
                           "--retries"],
}


@pytest.mark.parametrize("stage", sorted(FLAGS))
def test_help_names_every_flag_with_its_default(stage, capsys):
    module = {"01_download_metadata": stage01, "02_filter_metadata": stage02, "03_download_images": stage03}[stage]
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    options = capsys.readouterr().out.split("options:")[1]
    entries = {entry.split()[0].rstrip(","): " ".join(entry.split())
               for entry in re.split(r"\n  (?=-)", options) if entry.strip()}
    assert sorted(entries) == sorted(["-h", *FLAGS[stage]])
    assert all(("(required)" if flag in ("--input", "--out") else "(default: ") in text
               for flag, text in entries.items() if flag != "-h")
    if stage == "02_filter_metadata":
        assert entries["--min_aesthetic"].endswith("keep rows with aesthetic score >= this (default: 6.5)")

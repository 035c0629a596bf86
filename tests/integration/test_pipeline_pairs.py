"""pipeline/01f_import_pairs.py: Pick-a-Pic parquet files -> preference pair shards (preferred + rejected image)."""

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import sd.data.shards
import sd.data.stages

ROOT = Path(__file__).resolve().parents[2]
STAGE = "01f_import_pairs"
COLOURS = {"red": (255, 0, 0), "blue": (0, 0, 255), "green": (0, 255, 0), "yellow": (255, 255, 0)}


def square(colour: str, width: int = 32, height: int = 32, png: bool = False) -> bytes:
    pixels = np.full((height, width, 3), COLOURS[colour], np.uint8)
    return sd.data.shards.encode_png(pixels) if png else sd.data.stages.encode_jpeg(pixels)


def colour_of(data: bytes) -> str:
    mean = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), np.float64).mean(axis=(0, 1))
    return min(COLOURS, key=lambda name: np.abs(mean - COLOURS[name]).sum())


def pair_row(caption, first, second, label, **extra) -> dict:
    """A Pick-a-Pic row; ``first`` / ``second`` are colour names or raw bytes."""
    images = [square(image) if isinstance(image, str) else image for image in (first, second)]
    return {"caption": caption, "jpg_0": images[0], "jpg_1": images[1], "label_0": label, "has_label": True,
            "are_different": True, "image_0_uid": f"uid-{caption}-0", "image_1_uid": f"uid-{caption}-1",
            "model_0": "model-a", "model_1": "model-b", "ranking_id": 7, "user_id": 42, **extra}


SCHEMA = pa.schema([("caption", pa.string()), ("jpg_0", pa.binary()), ("jpg_1", pa.binary()),
                    ("label_0", pa.float64()), ("has_label", pa.bool_()), ("are_different", pa.bool_()),
                    ("image_0_uid", pa.string()), ("image_1_uid", pa.string()), ("model_0", pa.string()),
                    ("model_1", pa.string()), ("ranking_id", pa.int64()), ("user_id", pa.int64())])


def write_parquet(path: Path, rows: list[dict], row_group_size: int = 3) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([field for field in SCHEMA if field.name in rows[0]])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=row_group_size)


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, f"pipeline/{STAGE}.py", *map(str, argv)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def read_pairs(out: Path) -> dict[str, dict]:
    """key -> the colours of its preferred and rejected images, the extensions, caption and metadata."""
    pairs = {}
    for tar in sorted(out.glob("*.tar")):
        samples, truncated = sd.data.shards.read_shard(tar.read_bytes())
        assert truncated is None
        for sample in samples:
            pairs[sample.key] = {"preferred": colour_of(sample.image), "rejected": colour_of(sample.rejected),
                                 "ext": (sample.image_ext, sample.rejected_ext), "caption": sample.caption,
                                 "meta": json.loads(sample.metadata), "image": sample.image,
                                 "rejected_image": sample.rejected, "shard": tar.name}
    return pairs


def stats(out: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(out.glob("*_stats.json"))]


def files_of(out: Path) -> dict[str, tuple[bytes, int]]:
    return {path.name: (path.read_bytes(), path.stat().st_mtime_ns) for path in sorted(out.iterdir())
            if path.suffix in (".tar", ".json") and not path.name.endswith("_summary.json")}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """Two files, 9 rows in row groups of 3: two pairs each way, a tie, one row of each skip reason."""
    root = tmp_path_factory.mktemp("pickapic") / "data"
    write_parquet(root / "train-00000.parquet", [
        pair_row("red over blue", "red", "blue", 1.0),
        pair_row("blue over red", "red", "blue", 0.0),
        pair_row("a tie", "green", "yellow", 0.5),
        pair_row("corrupt", "red", b"not an image at all", 1.0),
        pair_row("   ", "red", "blue", 1.0),
        pair_row("unlabelled", "red", "blue", 1.0, has_label=False),
        pair_row("one image twice", "red", "red", 1.0),
    ])
    write_parquet(root / "train-00001.parquet", [
        pair_row("green over yellow", square("yellow", png=True), square("green", png=True), 0.0),
        pair_row("no number", "red", "blue", float("nan")),
    ])
    return root


@pytest.fixture(scope="module")
def imported(dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("pairs") / "shards"
    argv = ["--input", dataset, "--out", out, "--shard_size", "4"]
    result = run(*argv)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, argv, result


def test_the_preferred_image_follows_label_0_in_both_directions(imported, dataset):
    out, _, _ = imported
    pairs = read_pairs(out)
    assert sorted(pairs) == ["train-00000-000000", "train-00000-000001", "train-00001-000000"]
    assert [(p["preferred"], p["rejected"], p["caption"]) for p in pairs.values()] == [
        ("red", "blue", "red over blue"), ("blue", "red", "blue over red"), ("green", "yellow", "green over yellow")]
    source = pq.read_table(dataset / "train-00000.parquet").to_pylist()
    first, second = pairs["train-00000-000000"], pairs["train-00000-000001"]
    # no --resolution: the files' bytes, unchanged, with the extension their bytes say
    assert (first["image"], first["rejected_image"]) == (source[0]["jpg_0"], source[0]["jpg_1"])
    assert (second["image"], second["rejected_image"]) == (source[1]["jpg_1"], source[1]["jpg_0"])
    assert first["ext"] == ("jpg", "jpg")
    png = pairs["train-00001-000000"]
    assert png["ext"] == ("png", "png") and png["image"] == square("green", png=True)
    assert second["meta"] == {
        "key": "train-00000-000001", "source": "train-00000.parquet", "row": 1, "has_label": True,
        "are_different": True, "image_0_uid": "uid-blue over red-0", "image_1_uid": "uid-blue over red-1",
        "model_0": "model-a", "model_1": "model-b", "ranking_id": 7, "user_id": 42, "label_0": 0.0,
        "preferred": 1, "tie": False, "width": 32, "height": 32, "rejected_width": 32, "rejected_height": 32}
    assert first["meta"]["preferred"] == 0 and first["meta"]["label_0"] == 1.0


def test_ties_are_dropped_and_bad_rows_skipped_counted_and_named(imported):
    out, _, result = imported
    # 9 rows in shards of 4: the second shard spans both files, the third holds the last row
    records = stats(out)
    assert [r["sources"] for r in records] == [[["train-00000.parquet", 0, 4]],
                                               [["train-00000.parquet", 4, 7], ["train-00001.parquet", 0, 1]],
                                               [["train-00001.parquet", 1, 2]]]
    assert [(r["successes"], r["failed"]) for r in records] == [
        (2, {"tie": 1, "undecodable": 1}), (1, {"no_caption": 1, "no_label": 1, "same_image": 1}),
        (0, {"no_label": 1})]
    assert records[0]["examples"] == {"tie": ["train-00000-000002"], "undecodable": ["train-00000-000003 (jpg_1)"]}
    assert records[1]["examples"]["no_caption"] == ["train-00000-000004"]
    summary = json.loads((out / f"{STAGE}_summary.json").read_text())
    assert (summary["pairs"], summary["ties"], summary["ties_dropped"], summary["input_rows"]) == (3, "drop", 1, 9)
    assert summary["dropped"] == {"no_caption": 1, "no_label": 2, "same_image": 1, "tie": 1, "undecodable": 1}
    assert f"{STAGE}: 3 pairs written; ties: dropped 1 (--ties drop)" in result.stdout


def test_ties_both_writes_a_tie_once_in_each_order(dataset, tmp_path):
    out = tmp_path / "both"
    result = run("--input", dataset / "train-00000.parquet", "--out", out, "--ties", "both")
    assert result.returncode == 0, result.stderr[-3000:]
    pairs = read_pairs(out)
    assert [key for key in pairs if "tie" in key] == ["train-00000-000002-tie0", "train-00000-000002-tie1"]
    tie0, tie1 = pairs["train-00000-000002-tie0"], pairs["train-00000-000002-tie1"]
    assert (tie0["preferred"], tie0["rejected"], tie1["preferred"], tie1["rejected"]) == ("green", "yellow", "yellow", "green")
    assert (tie0["meta"]["preferred"], tie1["meta"]["preferred"]) == (0, 1)
    assert tie0["meta"]["tie"] and tie0["meta"]["label_0"] == 0.5 and tie0["caption"] == "a tie"
    summary = json.loads((out / f"{STAGE}_summary.json").read_text())
    assert (summary["pairs"], summary["ties"], summary["ties_written_both_ways"]) == (4, "both", 1)
    assert "tie" not in summary["dropped"] and len(pairs) == 4


def test_a_rerun_writes_nothing_and_a_trial_then_a_full_run_gives_the_same_shards(imported, dataset, tmp_path):
    out, argv, _ = imported
    before = files_of(out)
    again = run(*argv)
    assert again.returncode == 0, again.stderr[-3000:]
    assert files_of(out) == before  # not one file rewritten
    summary = json.loads((out / f"{STAGE}_summary.json").read_text())
    assert (summary["shards_written"], summary["shards_already_done"], summary["pairs"]) == (0, 3, 3)
    trial = tmp_path / "trial"
    assert run("--input", dataset, "--out", trial, "--shard_size", "4", "--max_pairs", "2").returncode == 0
    assert [r["sources"] for r in stats(trial)] == [[["train-00000.parquet", 0, 2]]]
    (trial / "00001.tar").write_bytes(b"left by a crash, no done marker")
    result = run("--input", dataset, "--out", trial, "--shard_size", "4")  # the cut-short shard is written whole
    assert result.returncode == 0, result.stderr[-3000:]
    assert {name: data for name, (data, _) in files_of(trial).items()} == {
        name: data for name, (data, _) in before.items()}


def test_a_changed_setting_on_a_rerun_is_refused_naming_it(imported, dataset):
    out, argv, _ = imported
    before = files_of(out)
    for flag, value, recorded in [("--ties", "both", "'drop'"), ("--resolution", "64", "0")]:
        result = run(*argv, flag, value)
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
        assert f"holds outputs made with {flag} {recorded}, not" in result.stderr
    other = run("--input", dataset / "train-00001.parquet", "--out", out, "--shard_size", "4")
    assert other.returncode == 2 and "shard 00000" in other.stderr and "other input rows" in other.stderr
    assert files_of(out) == before


@pytest.mark.parametrize("given", ["missing_folder", "missing/train-*.parquet"])
def test_a_missing_input_says_how_to_download_the_dataset(tmp_path, given):
    result = run("--input", tmp_path / given, "--out", tmp_path / "out")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "huggingface-cli download yuvalkirstain/pickapic_v2 --repo-type dataset" in result.stderr
    assert str(tmp_path / given) in result.stderr and not (tmp_path / "out").exists()


def test_a_file_without_the_columns_used_is_refused_in_one_line(tmp_path):
    write_parquet(tmp_path / "in" / "a.parquet", [{"caption": "x", "jpg_0": square("red")}])
    result = run("--input", tmp_path / "in", "--out", tmp_path / "out")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "a.parquet: no jpg_1, label_0 column" in result.stderr and not (tmp_path / "out").exists()


def test_resolution_scales_both_images_by_their_short_side(tmp_path):
    write_parquet(tmp_path / "in" / "train.parquet", [pair_row("sizes", square("red", 48, 32), square("blue", 64, 40), 0.0)])
    out = tmp_path / "out"
    result = run("--input", tmp_path / "in", "--out", out, "--resolution", "16")
    assert result.returncode == 0, result.stderr[-3000:]
    (pair,) = read_pairs(out).values()
    sizes = [Image.open(io.BytesIO(pair[name])).size for name in ("image", "rejected_image")]
    assert sizes == [(26, 16), (24, 16)]  # blue 64x40 -> 25.6 rounds to 26; red 48x32 -> 24
    assert (pair["preferred"], pair["rejected"], pair["ext"]) == ("blue", "red", ("jpg", "jpg"))
    meta = pair["meta"]
    assert (meta["width"], meta["height"], meta["rejected_width"], meta["rejected_height"]) == (26, 16, 24, 16)


def test_nothing_kept_fails_with_the_fix_and_the_fixed_command_runs_in_the_same_folder(tmp_path):
    write_parquet(tmp_path / "in" / "ties.parquet", [pair_row("a tie", "green", "yellow", 0.5)])
    out = tmp_path / "out"
    result = run("--input", tmp_path / "in", "--out", out)
    assert result.returncode == 1 and "kept nothing: tie 1" in result.stderr and "--ties both" in result.stderr
    assert not list(out.glob("*.tar")) and not list(out.glob("*_stats.json"))
    fixed = run("--input", tmp_path / "in", "--out", out, "--ties", "both")
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert sorted(read_pairs(out)) == ["ties-000000-tie0", "ties-000000-tie1"]

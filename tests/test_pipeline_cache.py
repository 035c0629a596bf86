"""Stages 04 (captions -> token ids) and 05 (captions + latents -> the trainer's dataset)."""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import SD_Data
import SD_Model
import SD_Shards
from data_factory import make_latents
from shard_factory import image_bytes, random_image

ROOT = Path(__file__).resolve().parents[1]
stage04 = importlib.import_module("pipeline.04_preprocess_to_cache")
stage05 = importlib.import_module("pipeline.05_build_hf_dataset")


def make_shards(folder: Path) -> None:
    rng = np.random.default_rng(0)
    png = image_bytes(random_image(rng, 16, 16), "PNG")
    SD_Shards.write_shard(folder / "00000.tar", [
        SD_Shards.ShardSample("k0", png, "png", "a photo of a cat"),
        SD_Shards.ShardSample("k1", png, "png", "A Photo, of THE café!! " + "long " * 100),
        SD_Shards.ShardSample("k2", png, "png", None),  # no caption
    ])
    SD_Shards.write_shard(folder / "00001.tar", [
        SD_Shards.ShardSample("k3", png, "png", "a red circle"),
        SD_Shards.ShardSample("k4", None, "", "a caption without an image"),
    ])


@pytest.fixture()
def captions(tmp_path):
    make_shards(tmp_path / "shards")
    code = stage04.main(["--input", str(tmp_path / "shards" / "*.tar"), "--out", str(tmp_path / "captions"),
                         "--tokenizer", "tiny"])
    assert code == 0
    return tmp_path


def test_04_writes_keys_captions_and_77_token_ids(captions):
    out = captions / "captions"
    table = pq.read_table(out / "00000.parquet")
    assert table.column("key").to_pylist() == ["k0", "k1"]
    ids = np.array(table.column("input_ids").to_pylist())
    id_type = table.schema.field("input_ids").type
    assert ids.shape == (2, 77) and id_type.list_size == 77 and str(id_type.value_type) == "int32"
    assert ids[0, :7].tolist() == [49406, 320, 1125, 539, 320, 2368, 49407]
    assert (ids[0, 7:] == 49407).all()
    assert ids[1, -1] == 49407  # a long caption is truncated and still closed
    expected = SD_Model.tokenize(SD_Model.load_tokenizer("tiny"), [table.column("caption").to_pylist()[1]])
    assert ids[1].tolist() == expected[0].tolist()
    stats = json.loads((out / "00000_stats.json").read_text())
    assert (stats["successes"], stats["failed"]) == (2, {"no_caption": 1})
    assert json.loads((out / "00001_stats.json").read_text())["failed"] == {"no_image": 1}
    summary = json.loads((out / "04_preprocess_to_cache_summary.json").read_text())
    assert (summary["kept"], summary["dropped"]) == (3, {"no_caption": 1, "no_image": 1})


def test_04_rerun_is_a_no_op(captions):
    out = captions / "captions"
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("0000*")}
    # DESIGN.md's spelling --shards, an alias of --input: the same run, so nothing is redone.
    assert stage04.main(["--shards", str(captions / "shards" / "*.tar"), "--out", str(out), "--tokenizer", "tiny"]) == 0
    assert len(before) == 4 and {p.name: p.stat().st_mtime_ns for p in out.glob("0000*")} == before
    assert json.loads((out / "04_preprocess_to_cache_summary.json").read_text())["shards_already_done"] == 2


def test_05_joins_to_latents_splits_by_hash_and_the_trainer_reads_it(captions, capsys):
    make_latents(captions / "latents", ["k0", "k3", "orphan"], np.zeros((3, 4, 8, 8)))
    out = captions / "dataset"
    args = ["--captions", str(captions / "captions"), "--latents", str(captions / "latents"), "--out", str(out),
            "--val_fraction", "0.5"]
    assert stage05.main(args) == 0
    stats = json.loads((out / "05_build_hf_dataset_summary.json").read_text())
    assert stats["dropped"] == {"no_latent": 1, "duplicate_key": 0} and stats["examples"] == {"no_latent": ["k1"]}
    assert stats["latents_without_caption"] == 1
    assert "no latent for: k1" in capsys.readouterr().out
    expected_val = [k for k in ("k0", "k3") if stage05.is_validation(k, 0.5)]
    assert stats["train"] + stats["validation"] == 2 and stats["validation"] == len(expected_val)
    store = SD_Data.LatentStore(captions / "latents")
    joined = {}
    for split in ("train", "validation"):
        part = SD_Data.join_split(out, split, store)
        joined.update({k: ids for k, ids in zip(part.keys, part.input_ids)})
        assert part.input_ids.shape == (1, 77)  # k0 is drawn for validation, k3 for training
    assert sorted(joined) == ["k0", "k3"]
    assert joined["k0"][:7].tolist() == [49406, 320, 1125, 539, 320, 2368, 49407]
    # Unchanged inputs: nothing is rebuilt.
    mtime = (out / "05_build_hf_dataset_summary.json").stat().st_mtime_ns
    assert stage05.main(args) == 0 and (out / "05_build_hf_dataset_summary.json").stat().st_mtime_ns == mtime
    assert "up to date" in capsys.readouterr().out


def test_05_hash_split_is_stable_and_close_to_the_fraction():
    keys = [f"key{i}" for i in range(20000)]
    chosen = [k for k in keys if stage05.is_validation(k, 0.01)]
    assert abs(len(chosen) - 200) < 5 * np.sqrt(200)
    # Pinned: the split must not change between runs or machines (Python's hash() would, per process).
    assert len(chosen) == 215 and chosen[:4] == ["key78", "key83", "key94", "key122"]
    assert set(chosen) <= {k for k in keys if stage05.is_validation(k, 0.05)}  # growing the fraction only adds


def test_05_missing_inputs_exit_2(tmp_path, capsys):
    assert stage05.main(["--captions", str(tmp_path / "nope"), "--latents", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "--captions folder" in capsys.readouterr().err


@pytest.mark.parametrize("script, flags", [
    ("04_preprocess_to_cache.py", ["--input", "--out", "--tokenizer", "--batch_size"]),
    ("05_build_hf_dataset.py", ["--captions", "--latents", "--out", "--val_fraction"]),
])
def test_help_lists_every_flag(script, flags):
    result = subprocess.run([sys.executable, str(ROOT / "pipeline" / script), "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and all(flag in result.stdout for flag in flags)

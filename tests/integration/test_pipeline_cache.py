"""Stages 04 (captions -> token ids) and 05 (captions + latents -> the trainer's dataset)."""

import importlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import sd.data.shards
import sd.data.training_data
import sd.model

from data_factory import make_latents
from shard_factory import image_bytes, random_image, sparse_tar

stage04 = importlib.import_module("pipeline.04_preprocess_to_cache")
stage05 = importlib.import_module("pipeline.05_build_hf_dataset")


def make_shards(folder: Path) -> None:
    rng = np.random.default_rng(0)
    png = image_bytes(random_image(rng, 16, 16), "PNG")
    sd.data.shards.write_shard(folder / "00000.tar", [
        sd.data.shards.ShardSample("k0", png, "png", "a photo of a cat"),
        sd.data.shards.ShardSample("k1", png, "png", "A Photo, of THE café!! " + "long " * 100),
        sd.data.shards.ShardSample("k2", png, "png", None),  # no caption
    ])
    sd.data.shards.write_shard(folder / "00001.tar", [
        sd.data.shards.ShardSample("k3", png, "png", "a red circle"),
        sd.data.shards.ShardSample("k4", None, "", "a caption without an image"),
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
    expected = sd.model.tokenize(sd.model.load_tokenizer("tiny"), [table.column("caption").to_pylist()[1]])
    assert ids[1].tolist() == expected[0].tolist()
    stats = json.loads((out / "00000_stats.json").read_text())
    assert (stats["successes"], stats["failed"]) == (2, {"no_caption": 1})
    assert json.loads((out / "00001_stats.json").read_text())["failed"] == {"no_image": 1}
    summary = json.loads((out / "04_preprocess_to_cache_summary.json").read_text())
    assert (summary["kept"], summary["dropped"]) == (3, {"no_caption": 1, "no_image": 1})


def test_04_rerun_is_a_no_op(captions):
    out = captions / "captions"
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("0000*")}
    # --shards, the earlier spelling of --input (docs/data.md): the same run, so nothing is redone.
    assert stage04.main(["--shards", str(captions / "shards" / "*.tar"), "--out", str(out), "--tokenizer", "tiny"]) == 0
    assert len(before) == 4 and {p.name: p.stat().st_mtime_ns for p in out.glob("0000*")} == before
    assert json.loads((out / "04_preprocess_to_cache_summary.json").read_text())["shards_already_done"] == 2


def test_04_with_a_tokenizer_it_cannot_load_stops_before_any_output(tmp_path, capsys, monkeypatch):
    """Offline, a hub id gives transformers' empty tokenizer: every caption would become [BOS, UNK, ...]."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    make_shards(tmp_path / "shards")
    code = stage04.main(["--input", str(tmp_path / "shards" / "*.tar"), "--out", str(tmp_path / "captions")])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"tokenizer {sd.model.DEFAULT_TEXT_ENCODER}: no vocabulary found" in err and "--tokenizer tiny" in err
    assert "HF_HUB_OFFLINE" in err
    assert not (tmp_path / "captions").exists()


def test_04_rerun_with_another_tokenizer_is_refused_and_keeps_the_outputs(captions, capsys, tmp_path):
    out = captions / "captions"
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    local = tmp_path / "my_tokenizer"
    sd.model.load_tokenizer("tiny").save_pretrained(local)
    code = stage04.main(["--input", str(captions / "shards" / "*.tar"), "--out", str(out), "--tokenizer", str(local)])
    assert code == 2
    err = capsys.readouterr().err
    assert f"holds outputs made with tokenizer 'tiny', not '{local}'" in err and "another output folder" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # summary included: nothing relabelled


def test_04_folder_from_before_settings_were_kept_is_checked_against_its_summary(captions, capsys, tmp_path):
    out = captions / "captions"
    (out / "04_preprocess_to_cache.settings").unlink()
    local = tmp_path / "my_tokenizer"
    sd.model.load_tokenizer("tiny").save_pretrained(local)
    assert stage04.main(["--input", str(captions / "shards" / "*.tar"), "--out", str(out),
                         "--tokenizer", str(local)]) == 2
    assert "made with tokenizer 'tiny'" in capsys.readouterr().err
    assert stage04.main(["--input", str(captions / "shards" / "*.tar"), "--out", str(out),
                         "--tokenizer", "tiny"]) == 0
    assert json.loads((out / "04_preprocess_to_cache.settings").read_text()) == {"tokenizer": "tiny"}


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
    store = sd.data.training_data.LatentStore(captions / "latents")
    joined = {}
    for split in ("train", "validation"):
        part = sd.data.training_data.join_split(out, split, store)
        joined.update({k: ids for k, ids in zip(part.keys, part.input_ids)})
        assert part.input_ids.shape == (1, 77)  # k0 is drawn for validation, k3 for training
    assert sorted(joined) == ["k0", "k3"]
    assert joined["k0"][:7].tolist() == [49406, 320, 1125, 539, 320, 2368, 49407]
    # Unchanged inputs: nothing is rebuilt.
    mtime = (out / "05_build_hf_dataset_summary.json").stat().st_mtime_ns
    assert stage05.main(args) == 0 and (out / "05_build_hf_dataset_summary.json").stat().st_mtime_ns == mtime
    assert "up to date" in capsys.readouterr().out


def test_05_says_when_no_sample_fell_into_the_validation_split(captions, capsys):
    make_latents(captions / "latents", ["k0", "k3"], np.zeros((2, 4, 8, 8)))
    assert not any(stage05.is_validation(k, 0.01) for k in ("k0", "k3"))
    assert stage05.main(["--captions", str(captions / "captions"), "--latents", str(captions / "latents"),
                         "--out", str(captions / "dataset"), "--val_fraction", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "no sample fell into the validation split (2 samples at --val_fraction 0.01" in out
    assert "raise --val_fraction" in out


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


@pytest.mark.parametrize("stage, flags", [
    (stage04, ["--input", "--out", "--tokenizer", "--batch_size"]),
    (stage05, ["--captions", "--latents", "--out", "--val_fraction"]),
])
def test_help_lists_every_flag(stage, flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        stage.main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and all(flag in out for flag in flags)


# ---------------------------------------------------------------------------------------------
# 04 reads captions without the images
# ---------------------------------------------------------------------------------------------


def sample_view(samples):
    """What stage 04 uses of read samples: key, caption, whether there is an image, the problem."""
    return [(s.key, s.caption, s.image is not None, s.problem) for s in samples]


def test_04_tar_reader_matches_read_shard_at_every_cut(tmp_path):
    rng = np.random.default_rng(0)
    png = image_bytes(random_image(rng, 24, 24), "PNG")
    sd.data.shards.write_shard(tmp_path / "full.tar", [
        sd.data.shards.ShardSample("k0", png, "png", "first", b"{}"),
        sd.data.shards.ShardSample("k1", png, "png", "", b"{}"),
        sd.data.shards.ShardSample("k2", None, "", "no image"),
        sd.data.shards.ShardSample("k3", png * 3, "png", "third", b"{}"),
    ])
    data = (tmp_path / "full.tar").read_bytes()
    cuts = sorted({*range(0, len(data), 512), *range(100, len(data), 700), len(data)})
    for cut in cuts:  # every header, payload and padding boundary, and points inside them
        (tmp_path / "cut.tar").write_bytes(data[:cut])
        expected, expected_cut = sd.data.shards.read_shard(data[:cut])
        samples, truncated_key = stage04.tar_samples(tmp_path / "cut.tar")
        assert (sample_view(samples), truncated_key) == (sample_view(expected), expected_cut), cut
    assert sample_view(stage04.tar_samples(tmp_path / "full.tar")[0])[0] == ("k0", "first", True, None)




def test_04_reads_no_image_bytes_and_skips_oversized_captions(tmp_path, monkeypatch):
    import tracemalloc

    monkeypatch.setattr(stage04.sd.data.stages, "MAX_MEMBER_BYTES", 1 << 20)
    image = 256 << 20  # 256 MB of image bytes per sample, on disk only as holes
    sparse_tar(tmp_path / "00000.tar", [
        ("a.jpg", image), ("a.txt", b"a huge image"), ("a.json", image),
        ("b.jpg", image), ("b.txt", 2 << 20),  # a 2 MB caption: over the (patched) member cap
        ("c.jpg", image), ("c.txt", b"  a third caption \n"),
    ])
    tokenizer = sd.model.load_tokenizer("tiny")
    sparse_tar(tmp_path / "warm.tar", [("w.jpg", 8), ("w.txt", b"first call: imports")])
    stage04.process_shard(tmp_path / "warm.tar", tmp_path / "out", tokenizer, 64)
    io_before = Path("/proc/self/io").read_text() if Path("/proc/self/io").exists() else None
    tracemalloc.start()
    record = stage04.process_shard(tmp_path / "00000.tar", tmp_path / "out", tokenizer, 64)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 << 20, peak  # reading one image would allocate 256 MB
    if io_before is not None:  # bytes that read() calls returned; headers and captions are a few kB
        rchar = {k: int(v) for k, v in (line.split(": ") for line in io_before.splitlines())}["rchar"]
        now = {k: int(v) for k, v in (line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())}
        assert now["rchar"] - rchar < 4 << 20, now["rchar"] - rchar
    assert (record["successes"], record["failed"]) == (2, {"too_large_member": 1})
    table = pq.read_table(tmp_path / "out" / "00000.parquet")
    assert table.column("caption").to_pylist() == ["a huge image", "a third caption"]


def img2dataset_shard(folder: Path) -> None:
    """A shard as img2dataset writes it: the tar holds the successes (caption "" for a null one), the
    parquet every row with its status, in download order."""
    rng = np.random.default_rng(1)
    jpg = image_bytes(random_image(rng, 16, 16), "JPEG")
    rows = [("000000000", "a cat ", "success"), ("000000001", "lost", "failed_to_download"),
            ("000000002", None, "success"), ("000000003", "   ", "success"), ("000000004", "x", "failed_to_resize"),
            ("000000005", "a dog\n", "success"), ("000000005", "again", "success"), ("000000007", "café", "success")]
    samples = [sd.data.shards.ShardSample(k, jpg, "jpg", "" if c is None else c, b"{}") for k, c, s in rows if s == "success"]
    folder.mkdir(parents=True)
    sd.data.shards.write_shard(folder / "00000.tar", samples)
    schema = pa.schema([("url", pa.string()), ("caption", pa.string()), ("key", pa.string()), ("status", pa.string()),
                        ("width", pa.int32())])
    pq.write_table(pa.table({"url": [f"http://x/{i}" for i in range(len(rows))], "caption": [c for _, c, _ in rows],
                             "key": [k for k, _, _ in rows], "status": [s for _, _, s in rows],
                             "width": [16] * len(rows)}, schema=schema), folder / "00000.parquet")


def run04(shards: Path, out: Path) -> tuple:
    assert stage04.main(["--input", str(shards / "*.tar"), "--out", str(out), "--tokenizer", "tiny"]) == 0
    return pq.read_table(out / "00000.parquet"), json.loads((out / "00000_stats.json").read_text())


def test_04_img2dataset_parquet_gives_the_tar_output_without_reading_the_tar(tmp_path, monkeypatch):
    shards = tmp_path / "shards"
    img2dataset_shard(shards)
    with monkeypatch.context() as patch:
        patch.setattr(stage04, "tar_samples", lambda path: pytest.fail("the tar was read"))
        from_parquet = run04(shards, tmp_path / "from_parquet")
    (shards / "00000.parquet").rename(tmp_path / "aside.parquet")
    from_tar = run04(shards, tmp_path / "from_tar")
    assert from_parquet[0].equals(from_tar[0]) and from_parquet[1] == from_tar[1]
    assert from_tar[0].column("key").to_pylist() == ["000000000", "000000007"]
    assert from_tar[1]["failed"] == {"duplicate_key": 1, "no_caption": 2}
    # A tar cut short, or a parquet that is not img2dataset's: the tar is read, as before.
    (tmp_path / "aside.parquet").rename(shards / "00000.parquet")
    assert stage04.img2dataset_samples(shards / "00000.tar") is not None
    data = (shards / "00000.tar").read_bytes()
    (shards / "00000.tar").write_bytes(data[: len(data) // 2])
    assert stage04.img2dataset_samples(shards / "00000.tar") is None
    (shards / "00000.tar").write_bytes(data)
    pq.write_table(pq.read_table(shards / "00000.parquet").drop_columns(["status"]), shards / "00000.parquet")
    assert stage04.img2dataset_samples(shards / "00000.tar") is None

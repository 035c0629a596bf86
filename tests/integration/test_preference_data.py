"""The Diffusion-DPO data chain on the tiny presets: Pick-a-Pic parquet -> pipeline/01f_import_pairs.py ->
encode_latents.py --pairs (aspect-ratio buckets and squares) -> stages 04 and 05 -> SD_Train.py with
preference.method: dpo; the samples --pairs skips and the runs it refuses; and a DPO LoRA trained on two ranks."""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

import encode_latents
import sd.data.shards
import sd.model
import sd.run_folder
import SD_Train

from data_factory import BASE, WORDS, make_base_pipeline, make_pairs

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
DPO = dict(BASE, preference={"method": "dpo", "beta": 500.0}, min_snr_gamma=0.0, cfg_dropout=0.0, lr=1e-3,
           warmup_steps=0, batch_size=2, grad_accum=1, ema_decay=0.0, lora_rank=4)
# Each row's two images: distinct colours, the preferred one's from the first list, the rejected one's from the
# second, under seeded noise so that no two rows encode alike (a row mixed up with another shows).
PREFERRED_COLOURS = [(230, 40, 40), (40, 200, 60), (250, 220, 30)]
REJECTED_COLOURS = [(30, 60, 230), (200, 40, 220), (20, 20, 20)]


def picture(rng, colour, width: int, height: int) -> np.ndarray:
    """(height, width, 3) uint8: ``colour`` under noise, in 2x2 blocks (so that halving it loses nothing)."""
    noise = rng.integers(0, 256, (height // 2, width // 2, 3))
    pixels = (0.6 * np.asarray(colour) + 0.4 * noise).astype(np.uint8)
    return pixels.repeat(2, axis=0).repeat(2, axis=1)


def pick_a_pic(path: Path, count: int = 12) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A Pick-a-Pic parquet file of ``count`` rows, every third one 96x64 and the others 64x64, image 0 preferred
    in every other row; returns each pair's key (01f's ``<file stem>-<row>``) -> (preferred, rejected) pixels."""
    rng = np.random.default_rng(1)
    rows, pairs = [], {}
    for i in range(count):
        width = 96 if i % 3 == 2 else 64
        preferred = picture(rng, PREFERRED_COLOURS[i % 3], width, 64)
        rejected = picture(rng, REJECTED_COLOURS[i % 3], width, 64)
        label = float(i % 2)  # 1: jpg_0 is preferred
        first, second = (preferred, rejected) if label else (rejected, preferred)
        rows.append({"caption": f"a {WORDS[i % len(WORDS)]} number {i}", "jpg_0": sd.data.shards.encode_png(first),
                     "jpg_1": sd.data.shards.encode_png(second), "label_0": label})
        pairs[f"{path.stem}-{i:06d}"] = (preferred, rejected)
    path.parent.mkdir(parents=True)
    schema = pa.schema([("caption", pa.string()), ("jpg_0", pa.binary()), ("jpg_1", pa.binary()),
                        ("label_0", pa.float64())])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=5)
    return pairs


def encode(shards: str, out: Path, *flags: str) -> int:
    return encode_latents.main(["--shards", shards, "--out", str(out), "--vae", "tiny", "--resolution", "64",
                                "--batch_size", "4", "--workers", "2", *flags])


def stage(name: str, *argv) -> int:
    return importlib.import_module(f"pipeline.{name}").main([str(a) for a in argv])


def latents_by_key(folder: Path, suffix: str = "") -> dict[str, np.ndarray]:
    """key -> its row of ``NNNNN[.WxH]<suffix>.npy``, read the way docs/latents.md lays a folder out: a bucketed
    shard's keys grouped by bucket in NNNNN.buckets.json's order, each group in its array's row order."""
    rows = {}
    for keys_file in sorted(folder.glob("*.keys.txt")):
        stem = keys_file.name[: -len(".keys.txt")]
        keys = keys_file.read_text().split()
        layout = folder / f"{stem}.buckets.json"
        if not layout.exists():
            arrays = [(np.load(folder / f"{stem}{suffix}.npy"), len(keys))]
        else:
            buckets = json.loads(layout.read_text())["buckets"]
            arrays = [(np.load(folder / f"{stem}.{b['size'][0]}x{b['size'][1]}{suffix}.npy"), b["count"])
                      for b in buckets]
        assert sum(count for _, count in arrays) == len(keys)
        start = 0
        for array, count in arrays:
            assert array.dtype == np.float16 and len(array) == count
            rows.update(zip(keys[start : start + count], array.astype(np.float32)))
            start += count
    return rows


def files_of(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def vae_means(images: list[np.ndarray]) -> np.ndarray:
    """The tiny VAE's posterior means of uint8 images (B, H, W, 3), in fp32, as fp16 stores them."""
    batch = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1
    with torch.no_grad():
        means = sd.model.load_vae("tiny").encode(batch).latent_dist.mean.numpy()
    return means.astype(np.float16).astype(np.float32)


def records_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    return make_base_pipeline(tmp_path_factory.mktemp("base") / "pipeline")


def test_pick_a_pic_to_a_dpo_run_through_bucketed_pair_latents(base_model, tmp_path):
    pairs = pick_a_pic(tmp_path / "pickapic" / "train-00000.parquet")
    shards = tmp_path / "shards"
    assert stage("01f_import_pairs", "--input", tmp_path / "pickapic", "--out", shards, "--shard_size", "8") == 0
    assert sorted(p.name for p in shards.glob("*.tar")) == ["00000.tar", "00001.tar"]
    buckets = ["--bucket_list", "64x64,96x64"]
    latents = tmp_path / "latents"
    assert encode(str(shards / "*.tar"), latents, "--pairs", *buckets) == 0

    # The rejected images as ordinary samples under the same keys, encoded at the same settings without --pairs.
    plain_shards = tmp_path / "rejected_shards"
    plain_shards.mkdir()
    for tar in sorted(shards.glob("*.tar")):
        samples, _ = sd.data.shards.read_shard(tar.read_bytes())
        sd.data.shards.write_shard(plain_shards / tar.name, [
            sd.data.shards.ShardSample(s.key, s.rejected, s.rejected_ext, s.caption) for s in samples])
    assert encode(str(plain_shards / "*.tar"), tmp_path / "plain", *buckets) == 0

    meta = json.loads((latents / "latents.json").read_text())
    assert (meta["pairs"], meta["complete"], meta["count"], meta["skipped"]) == (True, True, 12, {})
    seen = set()
    for layout_file in sorted(latents.glob("*.buckets.json")):
        stem = layout_file.name[: -len(".buckets.json")]
        for bucket in json.loads(layout_file.read_text())["buckets"]:
            name = f"{stem}.{bucket['size'][0]}x{bucket['size'][1]}"
            preferred, rejected = np.load(latents / f"{name}.npy"), np.load(latents / f"{name}.rejected.npy")
            assert rejected.dtype == np.float16 and rejected.shape == preferred.shape
            assert list(rejected.shape[1:]) == bucket["latent_shape"]
            seen.add((stem, tuple(bucket["size"]), tuple(bucket["latent_shape"])))
    assert seen == {(stem, size, shape) for stem in ("00000", "00001")  # both buckets in each of the two shards
                    for size, shape in (((64, 64), (4, 8, 8)), ((96, 64), (4, 8, 12)))}

    preferred, rejected = latents_by_key(latents), latents_by_key(latents, ".rejected")
    plain = latents_by_key(tmp_path / "plain")
    assert sorted(rejected) == sorted(plain) == sorted(pairs)
    for key, (preferred_pixels, _) in pairs.items():
        np.testing.assert_allclose(rejected[key], plain[key], atol=1e-3, err_msg=key)
        assert preferred[key].shape == rejected[key].shape == (4, 8, 12 if preferred_pixels.shape[1] == 96 else 8)
        assert np.abs(preferred[key] - rejected[key]).max() > 0.1, key  # the two images of a pair, not one twice
    # The buckets fit the images exactly, so each row is the VAE's mean of its key's rejected image as it was drawn.
    for width in (64, 96):
        keys = [key for key, (p, _) in pairs.items() if p.shape[1] == width]
        np.testing.assert_allclose(np.stack([rejected[k] for k in keys]), vae_means([pairs[k][1] for k in keys]),
                                   atol=1e-3)

    assert stage("04_preprocess_to_cache", "--input", shards / "*.tar", "--out", tmp_path / "captions",
                 "--tokenizer", "tiny") == 0
    assert stage("05_build_hf_dataset", "--captions", tmp_path / "captions", "--latents", latents,
                 "--out", tmp_path / "dataset", "--val_fraction", "0.2") == 0
    build = json.loads((tmp_path / "dataset" / "05_build_hf_dataset_summary.json").read_text())
    assert build["train"] + build["validation"] == 12 and build["dropped"]["no_latent"] == 0

    config = tmp_path / "dpo.yaml"
    config.write_text(yaml.safe_dump({**DPO, "datasets": [{"dataset": str(tmp_path / "dataset"),
                                                           "latents": str(latents), "weight": 1.0}],
                                      "init_from": str(base_model), "max_steps": 3, "out_dir": str(tmp_path / "run")}))
    assert SD_Train.main(["--config", str(config)]) == 0
    records = records_of(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert 0.0 <= record["reward_accuracy"] <= 1.0 and np.isfinite(record["reward_margin"])
    assert records[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)  # the model starts as its reference


def write_pairs(path: Path, pairs: dict[str, tuple[np.ndarray | None, np.ndarray | None]]) -> None:
    """A pair shard as 01f writes one: ``key.png`` the preferred image, ``key.rejected.png`` the rejected one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sd.data.shards.write_shard(path, [
        sd.data.shards.ShardSample(key, sd.data.shards.encode_png(preferred), "png", f"pair {key}",
                                   rejected=None if rejected is None else sd.data.shards.encode_png(rejected),
                                   rejected_ext="png")
        for key, (preferred, rejected) in pairs.items()])


def test_square_pairs_are_cut_alike_and_stored_beside_the_latents_in_key_order(tmp_path):
    rng = np.random.default_rng(2)
    pairs = {}
    for i in range(5):  # squares, and 96x64 pairs of which both images give their centre square, columns 16..80
        width = 64 if i % 2 else 96
        preferred = picture(rng, PREFERRED_COLOURS[i % 3], width, 64)
        rejected = picture(rng, REJECTED_COLOURS[i % 3], width, 64)
        # One rejected image at twice the preferred one's size: brought to its size first (2x2 blocks: exactly).
        pairs[f"k{i}"] = (preferred, rejected.repeat(2, axis=0).repeat(2, axis=1) if i == 2 else rejected, rejected)
    write_pairs(tmp_path / "shards" / "00000.tar", {key: pair[:2] for key, pair in pairs.items()})
    out = tmp_path / "latents"
    assert encode(str(tmp_path / "shards" / "*.tar"), out, "--pairs") == 0
    assert sorted(p.name for p in out.glob("00000*.npy")) == ["00000.npy", "00000.rejected.npy"]
    keys = (out / "00000.keys.txt").read_text().split()
    assert keys == list(pairs)
    latents, rejected = np.load(out / "00000.npy"), np.load(out / "00000.rejected.npy")
    assert rejected.dtype == np.float16 and rejected.shape == latents.shape == (5, 4, 8, 8)

    def square(pixels):
        left = (pixels.shape[1] - 64) // 2
        return pixels[:, left : left + 64]

    np.testing.assert_allclose(rejected.astype(np.float32), vae_means([square(pairs[k][2]) for k in keys]), atol=1e-3)
    np.testing.assert_allclose(latents.astype(np.float32), vae_means([square(pairs[k][0]) for k in keys]), atol=1e-3)
    meta = json.loads((out / "latents.json").read_text())
    assert (meta["pairs"], meta["latent_shape"], meta["count"]) == (True, [4, 8, 8], 5)


def test_pairs_with_flip_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        encode(str(tmp_path / "*.tar"), tmp_path / "out", "--pairs", "--flip")
    assert stop.value.code == 2
    assert "--pairs takes no --flip" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_samples_without_a_usable_rejected_image_are_skipped_counted_and_named(tmp_path, capsys):
    rng = np.random.default_rng(3)
    square_pair = lambda: (picture(rng, (200, 0, 0), 64, 64), picture(rng, (0, 0, 200), 64, 64))  # noqa: E731
    write_pairs(tmp_path / "shards" / "00000.tar", {
        "good0": square_pair(),
        "alone": (picture(rng, (200, 0, 0), 64, 64), None),
        "wide": (picture(rng, (200, 0, 0), 64, 64), picture(rng, (0, 0, 200), 96, 64)),
        "good1": square_pair()})
    out = tmp_path / "latents"
    assert encode(str(tmp_path / "shards" / "*.tar"), out, "--pairs") == 0
    report = json.loads((out / "00000.report.json").read_text())
    assert (report["encoded"], report["skipped"]) == (2, {"no_rejected": ["alone"], "rejected_mismatch": ["wide"]})
    meta = json.loads((out / "latents.json").read_text())
    assert (meta["count"], meta["skipped"]) == (2, {"no_rejected": 1, "rejected_mismatch": 1})
    assert (out / "00000.keys.txt").read_text().split() == ["good0", "good1"]
    assert np.load(out / "00000.rejected.npy").shape == np.load(out / "00000.npy").shape == (2, 4, 8, 8)

    # A folder encoded without --pairs is not one a --pairs run may add to: refused, and not a byte written.
    plain = tmp_path / "plain"
    assert encode(str(tmp_path / "shards" / "*.tar"), plain) == 0
    assert json.loads((plain / "latents.json").read_text())["skipped"] == {}  # without --pairs nothing is missing
    before = files_of(plain)
    capsys.readouterr()
    assert encode(str(tmp_path / "shards" / "*.tar"), plain, "--pairs") == 2
    err = capsys.readouterr().err
    assert "pairs=False" in err and "pairs=True" in err and "another --out" in err
    assert files_of(plain) == before
    # ... also when it was encoded before latents.json recorded pairs at all
    meta = json.loads((plain / "latents.json").read_text())
    del meta["pairs"]
    (plain / "latents.json").write_text(json.dumps(meta))
    before = files_of(plain)
    assert encode(str(tmp_path / "shards" / "*.tar"), plain, "--pairs") == 2
    assert "pairs=False" in capsys.readouterr().err and files_of(plain) == before


def test_two_ranks_train_a_dpo_lora_to_the_same_weights(base_model, tmp_path):
    config = tmp_path / "two.yaml"
    config.write_text(yaml.safe_dump({**DPO, "datasets": [make_pairs(tmp_path / "pairs", n_val=0)],
                                      "init_from": str(base_model), "max_steps": 4, "out_dir": str(tmp_path / "run")}))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(ROOT / "SD_Train.py"), "--config", str(config)], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    folder = tmp_path / "run" / "checkpoints" / sd.run_folder.step_dir_name(4)
    rank0, rank1 = (torch.load(folder / f"rng_rank{r}.pt", weights_only=True) for r in (0, 1))
    assert torch.equal(rank0["fingerprint"], rank1["fingerprint"])  # the ranks' weights agree
    assert not torch.equal(rank0["rng"]["noise"], rank1["rng"]["noise"])  # and they drew different noise
    records = records_of(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert 0.0 <= record["reward_accuracy"] <= 1.0 and np.isfinite(record["reward_margin"])
    assert records[0]["reward_margin"] == pytest.approx(0.0, abs=1e-6)  # at step 1 the model is its reference

"""The whole data path on a local folder: 01e -> encode_latents.py -> 04 -> 05 -> SD_Train.py."""

import importlib
import json
from pathlib import Path

import numpy as np
import torch

import encode_latents
import sd.data.training_data
import sd.distributed
import sd.model
import SD_Train

from shard_factory import image_bytes, random_image


def make_folder(folder: Path, count: int) -> None:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    for i in range(count):
        (folder / f"img{i:03d}.png").write_bytes(image_bytes(random_image(rng, 80, 96), "PNG"))
        (folder / f"img{i:03d}.txt").write_text(f"a picture number {i}")
    (folder / "broken.png").write_bytes(b"\x89PNG not really")
    (folder / "broken.txt").write_text("a broken picture")


def test_folder_to_training_run(tmp_path):
    make_folder(tmp_path / "src", 24)
    assert importlib.import_module("pipeline.01e_import_folder").main(
        ["--input", str(tmp_path / "src"), "--out", str(tmp_path / "shards"), "--layout", "flat",
         "--resolution", "64", "--shard_size", "10"]) == 0
    assert sorted(p.name for p in (tmp_path / "shards").glob("*.tar")) == ["00000.tar", "00001.tar", "00002.tar"]
    assert encode_latents.main(["--shards", str(tmp_path / "shards" / "*.tar"), "--out", str(tmp_path / "latents"),
                                "--vae", "tiny", "--resolution", "64", "--batch_size", "4", "--workers", "2"]) == 0
    assert importlib.import_module("pipeline.04_preprocess_to_cache").main(
        ["--input", str(tmp_path / "shards" / "*.tar"), "--out", str(tmp_path / "captions"), "--tokenizer", "tiny"]) == 0
    assert importlib.import_module("pipeline.05_build_hf_dataset").main(
        ["--captions", str(tmp_path / "captions"), "--latents", str(tmp_path / "latents"),
         "--out", str(tmp_path / "dataset"), "--val_fraction", "0.2"]) == 0

    build = json.loads((tmp_path / "dataset" / "05_build_hf_dataset_summary.json").read_text())
    assert build["train"] + build["validation"] == 24 and build["validation"] > 0
    assert build["dropped"]["no_latent"] == 0 and build["latents_without_caption"] == 0
    assert json.loads((tmp_path / "latents" / "latents.json").read_text())["count"] == 24

    # Opened the way the trainer opens it: every caption has its latent and its tokens.
    store = sd.data.training_data.LatentStore(tmp_path / "latents")
    train = sd.data.training_data.join_split(tmp_path / "dataset", "train", store)
    assert len(train) == build["train"] and train.input_ids.shape == (build["train"], 77)
    from datasets import load_from_disk

    rows = load_from_disk(str(tmp_path / "dataset"))["train"]
    tokenizer = sd.model.load_tokenizer("tiny")
    for key, caption, ids in zip(rows["key"], rows["caption"], train.input_ids):
        assert caption == f"a picture number {int(key.removeprefix('img'))}"
        assert ids.tolist() == sd.model.tokenize(tokenizer, [caption])[0].tolist()
    config = SD_Train.TrainConfig(
        datasets=[{"dataset": str(tmp_path / "dataset"), "latents": str(tmp_path / "latents"), "weight": 1.0}],
        unet="tiny", vae="tiny", text_encoder="tiny", precision="fp32", device="cpu", grad_checkpointing=False,
        batch_size=4, grad_accum=1, max_steps=3, warmup_steps=1, lr=1e-3, validate_every=0,
        out_dir=str(tmp_path / "run"), log_every=1)
    config.validate()
    assert SD_Train.train(config, sd.distributed.Dist(0, 1, 0, torch.device("cpu"), True)) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and all(np.isfinite(r["loss"]) for r in records)

"""Aspect-ratio buckets end to end: the bucket list and fitting (sd.data.buckets), bucketed latent shards
(encode_latents.py --buckets), batches of one shape over an epoch (sd.data.training_data), merging small buckets,
and an exact resume of a bucketed run (SD_Train.py)."""

import json
import logging
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

import encode_latents
import sd.data.buckets
import sd.data.shards
import sd.data.training_data
import sd.model
import sd.run_folder
import sd.train.config
import sd.train.memory
import sd.train.step
import sd.train.validation
import SD_Train

from data_factory import make_captions, make_dataset
from shard_factory import image_bytes, random_image

RES, STEP = 64, 16  # the tiny VAE at 64 px; buckets in 16 px steps (the tiny UNet halves the latents once)
# (height, width) of the test images and how many of each: three common aspect ratios and a rare one.
SIZES = {(48, 96): 21, (96, 48): 16, (64, 64): 16, (40, 120): 3}
BUCKET_OF_SIZE = {(48, 96): (80, 48), (96, 48): (48, 80), (64, 64): (64, 64), (40, 120): (96, 32)}


# ------------------------------------------------------------------------------------ geometry


def test_the_default_bucket_list_holds_sizes_of_about_the_base_pixel_count():
    buckets = sd.data.buckets.default_buckets(512)
    assert {(512, 512), (576, 448), (448, 576), (640, 384), (384, 640), (704, 320), (320, 704)} <= set(buckets)
    assert all(w % 64 == 0 and h % 64 == 0 for w, h in buckets)
    assert all(0.75 * 512**2 <= w * h <= 512**2 for w, h in buckets)  # never more pixels than the square
    assert {(h, w) for w, h in buckets} == set(buckets)  # every landscape size has its portrait
    assert max(w / h for w, h in buckets) == 4.0  # 1024x256
    assert [b[0] / b[1] for b in buckets] == sorted(b[0] / b[1] for b in buckets)
    assert sd.data.buckets.parse_bucket_list("512x512, 576X448") == [(512, 512), (576, 448)]
    for bad in ("512x500", "512", "512x512,512x512", "0x64"):
        with pytest.raises(ValueError):
            sd.data.buckets.parse_bucket_list(bad)


def test_each_image_goes_to_the_bucket_nearest_its_aspect_ratio():
    buckets = sd.data.buckets.default_buckets(RES, STEP)
    for (height, width), bucket in BUCKET_OF_SIZE.items():
        assert buckets[sd.data.buckets.nearest_bucket(width, height, buckets)] == bucket
    # In log ratio: 3:1 is nearer 4:1 than 1:1, and 2:1 and 1:2 are equally far from 1:1.
    assert sd.data.buckets.nearest_bucket(300, 100, [(64, 64), (128, 32)]) == 1
    assert sd.data.buckets.nearest_bucket(150, 100, [(64, 64), (128, 32)]) == 0
    assert sd.data.buckets.nearest_bucket(200, 100, [(32, 64), (64, 32)]) == 1
    assert sd.data.buckets.nearest_bucket(100, 200, [(32, 64), (64, 32)]) == 0


def test_fit_keeps_the_edges_that_a_square_crop_cuts_off():
    image = np.full((96, 160, 3), 255, dtype=np.uint8)  # 5:3, the aspect ratio of the 80x48 bucket
    image[:, :12] = (255, 0, 0)
    image[:, -12:] = (0, 0, 255)
    fitted, crop = sd.data.buckets.fit_to_bucket(image, (80, 48))
    assert fitted.shape == (48, 80, 3) and crop == (0, 0)
    assert fitted[:, :4, 0].min() > 200 and fitted[:, :4, 2].max() < 60  # red survives at the left edge
    assert fitted[:, -4:, 2].min() > 200 and fitted[:, -4:, 0].max() < 60  # blue at the right
    square = sd.data.shards.resize_center_crop(image, 64)
    assert (square[:, :, 1] > 200).all()  # the centre square is all white: both edges were cut
    # A 2:1 image in the 5:3 bucket loses only its excess width, centred; the offset is in scaled pixels.
    fitted, crop = sd.data.buckets.fit_to_bucket(np.zeros((100, 200, 3), dtype=np.uint8), (80, 48))
    assert fitted.shape == (48, 80, 3) and crop == (0, 8)  # 200 x 0.48 = 96 wide, 16 cut, 8 each side


def test_merging_folds_a_small_bucket_into_its_nearest_and_keeps_the_rest():
    counts = {(4, 12, 4): 3, (4, 10, 6): 21, (4, 8, 8): 16, (4, 6, 10): 16, (4, 4, 12): 2}
    target = sd.data.buckets.merge_small(counts, minimum=8)
    assert target == {(4, 12, 4): (4, 10, 6), (4, 10, 6): (4, 10, 6), (4, 8, 8): (4, 8, 8),
                      (4, 6, 10): (4, 6, 10), (4, 4, 12): (4, 6, 10)}
    assert sd.data.buckets.merge_small({(4, 8, 8): 2, (4, 6, 10): 3}, minimum=8) == {(4, 8, 8): (4, 6, 10),
                                                                                (4, 6, 10): (4, 6, 10)}
    latents = np.arange(2 * 4 * 4 * 12, dtype=np.float16).reshape(2, 4, 4, 12)
    assert sd.data.buckets.fit_latents(latents, (4, 6, 10)).shape == (2, 4, 6, 10)


# ------------------------------------------------------------------------------------ encoding


def build_shards(folder: Path) -> dict[str, tuple[int, int]]:
    """Two shards of images of the SIZES, interleaved; returns key -> (height, width)."""
    rng = np.random.default_rng(0)
    sizes = [size for size, count in SIZES.items() for _ in range(count)]
    order = rng.permutation(len(sizes))
    folder.mkdir(parents=True)
    samples, shape_of = [], {}
    for i, j in enumerate(order):
        key = f"k{i:03d}"
        shape_of[key] = sizes[j]
        samples.append(sd.data.shards.ShardSample(key, image_bytes(random_image(rng, *sizes[j]), "PNG"), "png",
                                             f"caption {i}", b"{}"))
    half = len(samples) // 2
    sd.data.shards.write_shard(folder / "00000.tar", samples[:half])
    sd.data.shards.write_shard(folder / "00001.tar", samples[half:])
    return shape_of


def encode(shards: Path, out: Path, *extra) -> int:
    return encode_latents.main(["--shards", str(shards / "*.tar"), "--out", str(out), "--vae", "tiny",
                                "--resolution", str(RES), "--batch_size", "4", "--workers", "2", *extra])


@pytest.fixture(scope="module")
def bucketed(tmp_path_factory):
    root = tmp_path_factory.mktemp("buckets")
    shape_of = build_shards(root / "shards")
    assert encode(root / "shards", root / "latents", "--buckets", "--bucket_step", str(STEP)) == 0
    keys = sorted(shape_of)
    make_captions(root / "captions", [(k, f"a picture {i % 4}") for i, k in enumerate(keys)], [])
    return root, shape_of


def test_encoding_writes_one_array_per_bucket_with_the_key_layout(bucketed):
    root, shape_of = bucketed
    out = root / "latents"
    meta = json.loads((out / "latents.json").read_text())
    assert meta["complete"] and meta["count"] == sum(SIZES.values()) and meta["latent_shape"] is None
    assert [tuple(b) for b in meta["buckets"]] == sd.data.buckets.default_buckets(RES, STEP)
    per_bucket = Counter()
    vae = sd.model.load_vae("tiny")
    for stem in ("00000", "00001"):
        layout = json.loads((out / f"{stem}.buckets.json").read_text())
        keys = (out / f"{stem}.keys.txt").read_text().split()
        start = 0
        for bucket in layout["buckets"]:
            width, height = bucket["size"]
            array = np.load(out / f"{stem}.{width}x{height}.npy")
            assert array.shape == (bucket["count"], 4, height // 8, width // 8) == (bucket["count"], *bucket["latent_shape"])
            group = keys[start : start + bucket["count"]]
            assert all(BUCKET_OF_SIZE[shape_of[k]] == (width, height) for k in group)
            assert [tuple(s) for s in layout["original_size"][start : start + len(group)]] == [shape_of[k] for k in group]
            per_bucket[width, height] += len(group)
            start += bucket["count"]
        # The latents are the VAE's posterior means of the fitted images.
        first = layout["buckets"][0]
        samples, _ = sd.data.shards.read_shard((root / "shards" / f"{stem}.tar").read_bytes())
        images = {s.key: sd.data.shards.decode_image(s.image, s.image_ext) for s in samples}
        fitted = sd.data.buckets.fit_to_bucket(images[keys[0]], tuple(first["size"]))[0]
        pixels = torch.from_numpy(fitted).permute(2, 0, 1)[None].float() / 127.5 - 1
        with torch.no_grad():
            expected = vae.encode(pixels).latent_dist.mean.numpy()
        stored = np.load(out / f"{stem}.{first['size'][0]}x{first['size'][1]}.npy")[:1].astype(np.float32)
        assert np.abs(stored - expected).max() < 2e-2  # fp16 storage
    assert per_bucket == {BUCKET_OF_SIZE[size]: n for size, n in SIZES.items()}
    store = sd.data.training_data.LatentStore(out)
    assert len(store) == sum(SIZES.values()) and store.sample_shape is None
    # batch_size: auto sizes the batch for a square of the largest bucket's pixel count (64x64 here).
    config = sd.train.config.TrainConfig(datasets=[{"dataset": "x", "latents": str(out)}])
    assert sd.train.memory.resolution_of(config) == 64
    assert sorted(store.shapes) == sorted((4, h // 8, w // 8) for w, h in BUCKET_OF_SIZE.values())
    assert sd.data.training_data.latent_keys(out) == (out / "00000.keys.txt").read_text().split() + \
        (out / "00001.keys.txt").read_text().split()


def test_a_rerun_resumes_and_another_setting_is_refused(bucketed, tmp_path):
    root, _ = bucketed
    out = root / "latents"
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.npy")}
    assert encode(root / "shards", out, "--buckets", "--bucket_step", str(STEP)) == 0  # all done: nothing rewritten
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.npy")} == before
    assert encode(root / "shards", out) == 2  # square crops into a bucketed folder
    assert encode(root / "shards", out, "--bucket_list", "64x64,80x48") == 2  # another bucket list
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.npy")} == before


def test_a_bad_bucket_list_stops_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        encode(tmp_path, tmp_path / "out", "--bucket_list", "64x60")
    assert stop.value.code == 2 and "--bucket_list: bucket 64x60" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------ batches


def mixed(root: Path, extra_square: bool = False) -> sd.data.training_data.MixedData:
    """The bucketed set (and a square folder beside it, as in a phase mixing both)."""
    store = sd.data.training_data.LatentStore(root / "latents")
    splits = [sd.data.training_data.join_split(root / "captions", "train", store)]
    if extra_square:
        square = root / "square"
        entry = make_dataset(square, n_train=16, n_val=0, size=8, prefix="q") if not square.exists() else \
            {"dataset": str(square / "captions"), "latents": str(square / "latents")}
        splits.append(sd.data.training_data.join_split(entry["dataset"], "train", sd.data.training_data.LatentStore(entry["latents"])))
    return sd.data.training_data.MixedData(splits, [len(s) for s in splits])  # weights in proportion: every sample once


@pytest.mark.parametrize("world_size", [1, 2])
def test_over_an_epoch_every_sample_is_seen_once_in_batches_of_one_shape(bucketed, world_size):
    root, shape_of = bucketed
    data = mixed(root)
    batch_size = 8 // world_size  # a global batch of 8 on 1 and on 2 ranks
    order = sd.data.training_data.epoch_order(data.sizes, data.weights, 0, 0)
    merged = data.merge_small(order, 8)
    assert merged == [((4, 4, 12), (4, 6, 10), 3)]  # the 3 images of 120x40 train in the 80x48 bucket
    seen, shapes = [], Counter()
    for rank in range(world_size):
        batches, flips = sd.data.training_data.epoch_batches(data, 0, 0, rank, world_size, batch_size)
        assert flips == [None] * len(batches) and all(len(b) == batch_size for b in batches)
        for batch in batches:
            latents, input_ids = data.batch(batch)
            assert latents.shape[0] == input_ids.shape[0] == batch_size
            shapes[tuple(latents.shape[1:])] += batch_size
            seen.extend(batch.tolist())
    assert sorted(seen) == list(range(len(data)))  # every sample once, none on two ranks
    # Per bucket: the images assigned to it, the merged ones with the bucket they joined.
    assert shapes == {(4, 6, 10): 21 + 3, (4, 10, 6): 16, (4, 8, 8): 16}
    # Ranks train the same bucket at every step, and the order is seeded by (seed, epoch).
    if world_size == 2:
        rank0, rank1 = (sd.data.training_data.epoch_batches(data, 0, 0, r, 2, 4)[0] for r in (0, 1))
        assert [data.shape_of(a) for a in rank0] == [data.shape_of(b) for b in rank1]
    again, _ = sd.data.training_data.epoch_batches(data, 0, 0, 0, world_size, batch_size)
    other, _ = sd.data.training_data.epoch_batches(data, 0, 1, 0, world_size, batch_size)
    assert all(np.array_equal(a, b) for a, b in zip(again, sd.data.training_data.epoch_batches(data, 0, 0, 0, world_size,
                                                                                   batch_size)[0]))
    assert not all(np.array_equal(a, b) for a, b in zip(again, other))


def test_merged_samples_are_cropped_and_resized_to_their_new_bucket(bucketed):
    root, shape_of = bucketed
    data = mixed(root)
    data.merge_small(sd.data.training_data.epoch_order(data.sizes, data.weights, 0, 0), 8)
    rare = [i for i, k in enumerate(data.splits[0].keys) if shape_of[k] == (40, 120)]
    latents, _ = data.batch(np.array(rare))
    store = data.splits[0].store
    stored = store.gather(data.splits[0].rows[rare])
    assert stored.shape[1:] == (4, 4, 12) and latents.shape[1:] == (4, 6, 10)
    assert np.array_equal(latents.numpy(), sd.data.buckets.fit_latents(stored, (4, 6, 10)))
    square = next(i for i, k in enumerate(data.splits[0].keys) if shape_of[k] == (64, 64))
    with pytest.raises(sd.data.training_data.DataError, match="one batch mixes latent shapes"):
        data.batch(np.array([rare[0], square]))


def test_remainders_are_left_out_and_counted_and_square_folders_mix_in(bucketed):
    root, _ = bucketed
    data = mixed(root, extra_square=True)
    assert len(data.shapes) == 4 and len(data) == sum(SIZES.values()) + 16
    order = sd.data.training_data.epoch_order(data.sizes, data.weights, 0, 0)
    data.merge_small(order, 12)
    report = {shape: (n, left) for shape, n, left in sd.data.training_data.bucket_report(data, order, 12)}
    # The square folder's 16 latents join the 64x64 bucket (16 + 16); 24 wide; 16 tall.
    assert report == {(4, 6, 10): (24, 0), (4, 10, 6): (16, 4), (4, 8, 8): (32, 8)}
    batches, _ = sd.data.training_data.epoch_batches(data, 0, 0, 0, 1, 12)
    assert len(batches) == 2 + 1 + 2
    assert sum(len(b) for b in batches) == len(order) - 12


def test_a_validation_set_over_several_buckets_is_cut_by_shape(bucketed):
    root, _ = bucketed
    data = mixed(root)
    batches = sd.data.training_data.shape_batches(data, np.arange(len(data)), 5)
    assert sorted(i for b in batches for i in b) == list(range(len(data)))
    assert all(len({tuple(data.shapes[t]) for t in data.target[data.bucket_of[b]]}) == 1 for b in batches)


# ------------------------------------------------------------------------------------ training


def run_config(root: Path, out: Path, **fields) -> Path:
    values = dict(datasets=[{"dataset": str(root / "captions"), "latents": str(root / "latents")}], unet="tiny",
                  vae="tiny", text_encoder="tiny", precision="fp32", device="cpu", grad_checkpointing=False,
                  batch_size=4, grad_accum=2, lr=1e-3, warmup_steps=1, ema_decay=0.9, log_every=1, save_steps=100,
                  validate_every=0, validation_prompts=["a picture 1"], validation_steps=2, cfg_dropout=0.1,
                  seed=0, max_steps=8, out_dir=str(out))
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump({**values, **fields}))
    return path


def state(run_dir: Path, step: int) -> dict:
    folder = run_dir / "checkpoints" / sd.run_folder.step_dir_name(step)
    tensors = {f"unet.{k}": v for k, v in load_file(folder / "unet.safetensors").items()}
    tensors.update({f"ema.{k}": v for k, v in load_file(folder / "ema.safetensors").items()})
    rng = torch.load(folder / "rng_rank0.pt", weights_only=True)["rng"]
    tensors.update(noise=rng["noise"], torch=rng["torch"])
    return tensors


@pytest.mark.slow
def test_a_bucketed_run_resumed_mid_epoch_is_bitwise_equal(bucketed, tmp_path, monkeypatch, caplog):
    root, _ = bucketed
    shapes = []
    real_step = sd.train.step.train_step

    def recording(step, micro_batches, *args, **kwargs):
        shapes.append([tuple(latents.shape) for latents, _ in micro_batches])
        return real_step(step, micro_batches, *args, **kwargs)

    monkeypatch.setattr(sd.train.step, "train_step", recording)
    caplog.set_level(logging.INFO, logger="sd_train")
    whole = run_config(root, tmp_path / "whole", validate_every=8)
    assert SD_Train.main(["--config", str(whole)]) == 0
    # 56 samples in global batches of 4: 24 + 16 + 16 = 14 micro-batches, 7 optimizer steps per epoch.
    assert "bucket 96x32: 3 samples, fewer than one global batch of 4; merged into bucket 80x48" in caplog.text
    assert "left out of each epoch: 0 of 56 samples" in caplog.text
    assert len(shapes) == 8 and all(s[0] == 4 for micro in shapes for s in micro)
    assert {s[1:] for micro in shapes for s in micro} == {(4, 6, 10), (4, 10, 6), (4, 8, 8)}
    records = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["loss"]) for r in records)
    assert (tmp_path / "whole" / "samples" / "step_00000008.png").exists()
    split = run_config(root, tmp_path / "split")
    assert SD_Train.main(["--config", str(split), "--stop_at_step", "3"]) == 0
    saved = torch.load(tmp_path / "split" / "checkpoints" / sd.run_folder.step_dir_name(3) / "train_state.pt", weights_only=True)
    assert (saved["epoch"], saved["position"]) == (0, 6)  # mid-epoch 0: 6 of its 14 micro-batches
    assert SD_Train.main(["--config", str(split)]) == 0  # resumes; crosses into epoch 1
    a, b = state(tmp_path / "whole", 8), state(tmp_path / "split", 8)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = [[json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
              for run in (tmp_path / "whole", tmp_path / "split")]
    assert losses[0] == losses[1]


def test_weighted_mixing_holds_with_buckets(bucketed):
    root, _ = bucketed
    data = mixed(root, extra_square=True)
    data.weights = [1.0, 3.0]  # a quarter of each epoch from the bucketed set, three quarters from the square one
    order = sd.data.training_data.epoch_order(data.sizes, data.weights, 0, 0)
    data.merge_small(order, 4)
    batches, _ = sd.data.training_data.epoch_batches(data, 0, 0, 0, 1, 4)
    seen = np.concatenate(batches)
    from_square = int((seen >= data.offsets[1]).sum())
    left_out = sum(left for *_, left in sd.data.training_data.bucket_report(data, order, 4))
    assert len(seen) == len(order) - left_out
    # The epoch order holds 18 and 54 (the square set repeated); the batches keep them but for the tails.
    assert int((order >= data.offsets[1]).sum()) == 54
    assert 54 - left_out <= from_square <= 54


def test_validation_samples_take_a_size_of_their_own(bucketed):
    root, _ = bucketed
    data = mixed(root)
    config = sd.train.config.TrainConfig(datasets=[{"dataset": "x", "latents": "y"}])
    assert sd.train.validation.validation_size(config, data) == (64, 64)  # the bucket nearest square
    config = sd.train.config.TrainConfig(datasets=[{"dataset": "x", "latents": "y"}], validation_width=96,
                                        validation_height=32)
    assert sd.train.validation.validation_size(config, data) == (96, 32)
    for width, height in ((96, 0), (60, 64)):
        bad = sd.train.config.TrainConfig(datasets=[{"dataset": "x", "latents": "y"}], validation_width=width,
                                         validation_height=height)
        with pytest.raises(sd.train.config.ConfigError, match="validation.width and validation.height"):
            bad.validate(check_paths=False)


def test_a_bucketed_run_compiles_one_static_graph_per_shape():
    import torch._dynamo.config as dynamo_config

    limit = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    before = getattr(dynamo_config, limit)
    try:
        assert sd.train.step.compile_options(1) == {}  # square: torch's defaults
        assert sd.train.step.compile_options(17) == {"dynamic": False}
        assert sd.train.step.compile_options(1, "reduce-overhead") == {"mode": "reduce-overhead"}
        assert sd.train.step.compile_options(17, "max-autotune-no-cudagraphs") == {
            "mode": "max-autotune-no-cudagraphs", "dynamic": False}
        assert getattr(dynamo_config, limit) >= 2 * 17  # every bucket keeps its graph (8 by default)
    finally:
        setattr(dynamo_config, limit, before)


@pytest.mark.slow
def test_two_ranks_train_a_bucketed_folder_in_step_and_it_samples_at_a_bucket_size(bucketed, tmp_path):
    import subprocess
    import sys

    from PIL import Image

    root, _ = bucketed
    # 2 ranks x batch 2: global batches of 4, 14 per epoch; 9 steps cross into epoch 1.
    config = run_config(root, tmp_path / "ddp", batch_size=2, grad_accum=1, max_steps=9, ema_decay=0.5)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(Path(SD_Train.__file__)), "--config", str(config)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    folder = tmp_path / "ddp" / "checkpoints" / sd.run_folder.step_dir_name(9)
    fingerprints = [torch.load(folder / f"rng_rank{r}.pt", weights_only=True)["fingerprint"] for r in range(2)]
    assert torch.equal(*fingerprints)  # the replicas agree after steps over several shapes
    assert "merged into bucket 80x48" in result.stderr
    # The trained model samples at a bucket's size through SD_ImageGen.py.
    import SD_ImageGen

    out = tmp_path / "samples"
    assert SD_ImageGen.main(["--ckpt", str(tmp_path / "ddp"), "--prompt", "a picture 1", "--n", "1", "--steps", "2",
                             "--width", "80", "--height", "48", "--device", "cpu", "--out", str(out)]) == 0
    images = [p for p in out.glob("*.png") if p.name != "grid.png"]
    assert len(images) == 1 and Image.open(images[0]).size == (80, 48)


def test_flipped_latents_of_a_bucketed_folder_mirror_their_bucket(bucketed, tmp_path):
    root, _ = bucketed
    out = tmp_path / "flip"
    assert encode(root / "shards", out, "--buckets", "--bucket_step", str(STEP), "--flip") == 0
    assert sorted(p.name for p in out.glob("00000.*.flip.npy")) == sorted(
        p.name.replace(".npy", ".flip.npy") for p in out.glob("00000.*x*.npy") if not p.name.endswith(".flip.npy"))
    store = sd.data.training_data.LatentStore(out, flip=True)
    rows = np.arange(len(store))
    plain = store.bucket_of_row
    for bucket in np.unique(plain):
        picked = rows[plain == bucket][:2]
        flipped = store.gather(picked, np.ones(len(picked), dtype=bool))
        assert flipped.shape == store.gather(picked).shape == (len(picked), *store.shapes[bucket])
        assert not np.array_equal(flipped, store.gather(picked))

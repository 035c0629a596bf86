"""Loss masks end to end: photo_mask.png at import -> key.mask.png in the shard -> NNNNN.mask.npy at
latent resolution -> the third tensor of a batch -> the loss of SD_Train.py with masked_loss."""

import importlib
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

import encode_latents
import sd.data.shards
import sd.data.training_data
import sd.settings
import sd.train.config
import SD_Train

from data_factory import BASE, make_dataset
from shard_factory import image_bytes, random_image

stage = importlib.import_module("pipeline.01e_import_folder")


def save(path: Path, array: np.ndarray, fmt: str = "PNG") -> None:
    path.write_bytes(image_bytes(array, fmt))


def block_means(mask: np.ndarray, block: int = 8) -> np.ndarray:
    """The hand computation of a latent-resolution mask: each block's mean grey level over 255."""
    h, w = mask.shape
    return mask.reshape(h // block, block, w // block, block).astype(np.float64).mean(axis=(1, 3)) / 255


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A folder with masks of every kind, imported at --resolution 32 --keep_aspect."""
    root = tmp_path_factory.mktemp("masks")
    src, out = root / "src", root / "shards"
    src.mkdir()
    rng = np.random.default_rng(0)
    # b's mask is constant on 2x2 blocks, so the import's exact halving (area filter) keeps `pattern` as is.
    pattern = rng.integers(0, 256, size=(32, 48), dtype=np.uint8)
    for name, size in (("a", (64, 96)), ("b", (64, 96)), ("c", (64, 64)), ("d", (64, 64)), ("e", (64, 64)),
                       ("g", (64, 96))):
        save(src / f"{name}.png", random_image(rng, *size))
        (src / f"{name}.txt").write_text(f"photo {name}")
    save(src / "b_mask.png", np.kron(pattern, np.ones((2, 2), dtype=np.uint8)))
    save(src / "d_mask.png", np.zeros((64, 80), dtype=np.uint8))  # another aspect ratio than d.png
    (src / "e_mask.png").write_bytes(b"not an image at all")
    save(src / "f_mask.png", np.zeros((64, 64), dtype=np.uint8))  # no f.png
    save(src / "g_mask.jpg", np.full((32, 48), 200, dtype=np.uint8), "JPEG")  # half size, same aspect, a JPEG
    assert stage.main(["--input", str(src), "--out", str(out), "--resolution", "32", "--keep_aspect"]) == 0
    return {"src": src, "out": out, "pattern": pattern}


def shard_masks(out: Path) -> dict:
    samples, truncated = sd.data.shards.read_shard((out / "00000.tar").read_bytes())
    assert truncated is None
    return {s.key: (Image.open(io.BytesIO(s.image)).size,
                    None if s.mask is None else np.asarray(Image.open(io.BytesIO(s.mask)))) for s in samples}


def test_import_carries_each_mask_beside_its_image_and_skips_bad_ones_by_name(imported):
    out = imported["out"]
    samples = shard_masks(out)
    assert sorted(samples) == ["a", "b", "c", "g"]  # no mask is an image; d and e go with their masks
    assert samples["a"][1] is None and samples["c"][1] is None
    size, mask = samples["b"]
    assert size == (48, 32) and mask.shape == (32, 48) and mask.dtype == np.uint8
    assert np.array_equal(mask, imported["pattern"])  # scaled as the image: 96x64 -> 48x32
    size, mask = samples["g"]
    assert size == (48, 32) and mask.shape == (32, 48) and np.abs(mask.astype(int) - 200).max() <= 2
    stats = json.loads((out / "00000_stats.json").read_text())
    assert stats["successes"] == 4 and stats["masked"] == 2
    assert stats["failed"] == {"bad_mask": 1, "mask_mismatch": 1}
    assert stats["examples"]["mask_mismatch"] == ["d_mask.png"] and stats["examples"]["bad_mask"] == ["e_mask.png"]
    summary = json.loads((out / "01e_import_folder_summary.json").read_text())
    assert summary["masked"] == 2 and summary["orphan_masks"] == {"count": 1, "examples": ["f_mask.png"]}


def test_import_cuts_the_mask_as_the_centre_square_of_its_image(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    save(src / "wide.png", random_image(np.random.default_rng(1), 64, 96))
    (src / "wide.txt").write_text("wide")
    mask = np.zeros((64, 96), dtype=np.uint8)
    mask[:, :40] = 255  # the centre square keeps columns 16..79: 24 white of 64, 12 of 32 once halved
    save(src / "wide_mask.png", mask)
    assert stage.main(["--input", str(src), "--out", str(out), "--resolution", "32"]) == 0
    size, got = shard_masks(out)["wide"]
    expected = np.zeros((32, 32), dtype=np.uint8)
    expected[:, :12] = 255
    assert size == (32, 32) and np.array_equal(got, expected)


def test_a_mask_added_after_the_import_is_refused_as_a_changed_input(imported, tmp_path, capsys):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    save(src / "x.png", random_image(np.random.default_rng(2), 32, 32))
    (src / "x.txt").write_text("x")
    assert stage.main(["--input", str(src), "--out", str(out), "--resolution", "32"]) == 0
    save(src / "x_mask.png", np.zeros((32, 32), dtype=np.uint8))
    assert stage.main(["--input", str(src), "--out", str(out), "--resolution", "32"]) == 2
    assert "different masks under --input" in capsys.readouterr().err


def encode(shards: Path, out: Path, *flags) -> None:
    assert encode_latents.main(["--shards", str(shards / "*.tar"), "--out", str(out), "--vae", "tiny",
                                "--resolution", "32", "--batch_size", "1", "--workers", "1", *flags]) == 0


def test_encode_writes_latent_resolution_masks_square_and_in_buckets_and_flipped(imported, tmp_path):
    pattern = imported["pattern"]  # b's mask as the shard holds it, 48x32
    # A second shard: a mask of another aspect ratio than its image is skipped at encoding too.
    square = random_image(np.random.default_rng(3), 32, 32)
    sd.data.shards.write_shard(tmp_path / "shards" / "00001.tar", [
        sd.data.shards.ShardSample("y", image_bytes(square, "PNG"), "png", "y", b"{}"),
        sd.data.shards.ShardSample("z", image_bytes(square, "PNG"), "png", "z", b"{}",
                                   mask=image_bytes(np.zeros((32, 48), dtype=np.uint8), "PNG"))])
    (tmp_path / "shards" / "00000.tar").write_bytes((imported["out"] / "00000.tar").read_bytes())

    encode(tmp_path / "shards", tmp_path / "square")  # centre squares: b keeps columns 8..39
    square_dir = tmp_path / "square"
    assert (square_dir / "00000.keys.txt").read_text().split() == ["a", "b", "c", "g"]
    masks = np.load(square_dir / "00000.mask.npy")
    assert masks.shape == (4, 1, 4, 4) and masks.dtype == np.float16
    assert (masks[[0, 2]] == 1).all()  # no mask: weight 1 (a comes before the shard's first mask)
    np.testing.assert_allclose(masks[1, 0], block_means(pattern[:, 8:40]), atol=5e-4)
    np.testing.assert_allclose(masks[3], 200 / 255, atol=0.01)
    assert not (square_dir / "00001.mask.npy").exists()  # a shard without a usable mask has no file
    report = json.loads((square_dir / "00001.report.json").read_text())
    assert report["skipped"] == {"mask_mismatch": ["z"]} and report["masked"] == 0
    assert json.loads((square_dir / "latents.json").read_text())["masked"] == 2
    # Encoded again, a shard without masks drops a mask file an earlier encoding of it left.
    np.save(square_dir / "00001.mask.npy", np.zeros((1, 1, 4, 4), dtype=np.float16))
    (square_dir / "00001.keys.txt").unlink()
    encode(tmp_path / "shards", square_dir)
    assert (square_dir / "00001.keys.txt").exists() and not (square_dir / "00001.mask.npy").exists()

    encode(tmp_path / "shards", tmp_path / "buckets", "--buckets", "--bucket_list", "32x32,48x32", "--flip")
    bucket_dir = tmp_path / "buckets"
    assert (bucket_dir / "00000.48x32.mask.npy").exists() and not (bucket_dir / "00000.32x32.mask.npy").exists()
    store = sd.data.training_data.LatentStore(bucket_dir, flip=True, masks=True)
    rows = np.array([store.row_of[key] for key in ("b", "b", "c", "a")])
    b, b_flipped = (store.gather_masks(rows[:2], np.array([False, True]))[:, 0])
    expected = block_means(pattern)  # the 48x32 bucket is b's size: nothing cut, nothing scaled
    np.testing.assert_allclose(b, expected, atol=5e-4)
    np.testing.assert_allclose(b_flipped, expected[:, ::-1], atol=5e-4)  # the mirrored image's mask
    assert (store.gather_masks(rows[2:3]) == 1).all() and store.gather_masks(rows[2:3]).shape == (1, 1, 4, 4)
    assert (store.gather_masks(rows[3:]) == 1).all() and store.gather_masks(rows[3:]).shape == (1, 1, 4, 6)


# ------------------------------------------------------------------------------ training


def masked_dataset(root: Path, left: float, right: float, n_train: int = 16, flip: bool = False) -> dict:
    """The toy dataset of data_factory with a mask of weight ``left`` on the left half of every latent
    and ``right`` on the right half."""
    entry = make_dataset(root, n_train=n_train, n_val=0, flip=flip)
    for latents in sorted(Path(entry["latents"]).glob("[0-9][0-9][0-9][0-9][0-9].npy")):
        rows, _, h, w = np.load(latents, mmap_mode="r").shape
        mask = np.full((rows, 1, h, w), right, dtype=np.float16)
        mask[..., : w // 2] = left
        np.save(latents.with_name(latents.name.replace(".npy", ".mask.npy")), mask)
    return entry


def train(root: Path, entry: dict, masked: bool) -> list[float]:
    config = root / "c.yaml"
    config.write_text(yaml.safe_dump({**BASE, "datasets": [entry], "max_steps": 2, "grad_accum": 1, "batch_size": 4,
                                      "masked_loss": masked, "out_dir": str(root / "run")}))
    assert SD_Train.main(["--config", str(config)]) == 0
    return [json.loads(line)["loss"] for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_masked_loss_weights_the_first_step_by_the_masks_and_complementary_masks_add_up(tmp_path):
    # Same seed and data: the same weights, noise and timesteps at step 1. Masks M and 1 - M split the
    # unmasked per-element error between them, so their first losses add up to the unmasked one.
    left = train(tmp_path / "left", masked_dataset(tmp_path / "left", 1.0, 0.0), masked=True)
    right = train(tmp_path / "right", masked_dataset(tmp_path / "right", 0.0, 1.0), masked=True)
    ignored = train(tmp_path / "ignored", masked_dataset(tmp_path / "ignored", 1.0, 0.0), masked=False)
    assert len(left) == len(right) == len(ignored) == 2
    assert math.isclose(left[0] + right[0], ignored[0], rel_tol=1e-5)
    assert 0.05 < left[0] / ignored[0] < 0.95 and not math.isclose(left[0], right[0], rel_tol=1e-3)
    # And the masks steer the update: the second steps train different weights.
    assert not math.isclose(left[1] + right[1], ignored[1], rel_tol=1e-5)


def test_masked_loss_without_masks_stops_naming_the_field(tmp_path, capsys):
    entry = make_dataset(tmp_path / "data", n_train=8, n_val=0)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**BASE, "datasets": [entry], "max_steps": 1, "masked_loss": True,
                                      "out_dir": str(tmp_path / "run")}))
    assert SD_Train.main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "data.masked_loss: true but no latent folder holds masks" in err and "data.masked_loss: false" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_batches_carry_masks_only_with_masked_loss_and_weight_one_where_a_folder_has_none(tmp_path):
    with_masks = masked_dataset(tmp_path / "m", 0.0, 1.0, n_train=4, flip=True)
    without = make_dataset(tmp_path / "plain", n_train=4, n_val=0, prefix="p", flip=True)

    def mixed(masks: bool):
        splits = [sd.data.training_data.join_split(e["dataset"], "train", sd.data.training_data.LatentStore(
            e["latents"], masks=masks, mmap=True, flip=True))
            for e in (with_masks, without)]
        return sd.data.training_data.MixedData(splits, [1.0, 1.0])

    assert len(mixed(False).batch(np.array([0, 5]))) == 2
    latents, ids, masks = mixed(True).batch(np.array([0, 5]), np.array([True, False]))
    assert masks.shape == (2, 1, 8, 8) and masks.dtype == latents.dtype
    assert (masks[0, :, :, :4] == 1).all() and (masks[0, :, :, 4:] == 0).all()  # flipped: 0 | 1 mirrored
    assert (masks[1] == 1).all()  # a folder without masks


def test_masked_loss_is_refused_for_dreambooth_folders_which_carry_no_masks():
    config = sd.train.config.TrainConfig(instance_dir="photos", instance_prompt="a photo of sks dog", masked_loss=True,
                                         max_steps=1)
    with pytest.raises(sd.train.config.ConfigError, match="data.masked_loss needs masks carried by encode_latents.py"):
        config.validate(check_paths=False)
    assert sd.train.config.FIELDS["data.masked_loss"].metadata["resume"].action == sd.settings.REFUSE  # the math

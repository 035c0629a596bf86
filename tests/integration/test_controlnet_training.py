"""ControlNet runs (``control``) on the tiny presets: conditioning images through encode_latents.py (cut and
mirrored as their images), exact resume, the base checked on resume, and the exported files sampling like
the run."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

import encode_latents
import sd.data.encode
import sd.data.shards
import sd.data.training_data
import sd.controlnet.model
import sd.formats
import sd.model
import sd.run_folder
import sd.sampling
import SD_ImageGen
import SD_Train
from data_factory import BASE, assert_bitwise_equal, checkpoint_state, make_base_pipeline, make_dataset

CONTROL = dict(BASE, control="seg", lr=5e-3, warmup_steps=0, batch_size=2, grad_accum=2, validation_prompts=[])
WEIGHTS = ("controlnet", "ema", "lora_base")  # the weight files of a ControlNet checkpoint


def square_at(row: int, size: int) -> np.ndarray:
    """``(size, size, 3)`` uint8: black with a white square of a quarter of the side, placed by ``row``."""
    image = np.zeros((size, size, 3), dtype=np.uint8)
    x, y = (row * 7) % (3 * size // 4), (row * 5) % (3 * size // 4)
    image[y : y + size // 4, x : x + size // 4] = 255
    return image


def control_dataset(root: Path, n_train: int = 16, n_val: int = 0, flip: bool = False) -> dict:
    """data_factory's toy dataset with a conditioning image ``seg`` per row, in encode_latents.py's files."""
    entry = make_dataset(root, n_train=n_train, n_val=n_val, flip=flip)
    for latents in sorted(Path(entry["latents"]).glob("[0-9][0-9][0-9][0-9][0-9].npy")):
        rows, _, h, _ = np.load(latents, mmap_mode="r").shape
        writer = sd.data.encode.PngRows(sd.data.encode.control_files(latents, "seg"))
        writer.append([sd.data.shards.encode_png(square_at(int(latents.stem) * 100 + r, 8 * h)) for r in range(rows)])
        writer.commit()
    return entry


# ------------------------------------------------------------------------------ the data path


def shard_with_controls(path: Path, count: int, width: int, height: int, without: tuple[int, ...] = ()) -> None:
    """Images of ``width`` x ``height`` whose conditioning image ``seg`` is white on its left third; sample
    ``i`` in ``without`` has none."""
    samples = []
    for i in range(count):
        image = np.full((height, width, 3), 40 * (i % 5), dtype=np.uint8)
        sample = sd.data.shards.ShardSample(f"s{i:03d}", sd.data.shards.encode_png(image), "png", f"a red circle {i}")
        if i not in without:
            control = np.zeros((height, width), dtype=np.uint8)
            control[:, : width // 3] = 255
            sd.data.shards.add_member(sample, "seg.png", sd.data.shards.encode_png(control))
        samples.append(sample)
    sd.data.shards.write_shard(path, samples)


@pytest.mark.parametrize("buckets", [False, True], ids=["square", "buckets"])
def test_encode_stores_conditioning_images_cut_as_their_images_and_the_trainer_mirrors_them(tmp_path, buckets):
    shards = tmp_path / "shards"
    shards.mkdir()
    shard_with_controls(shards / "00000.tar", 6, 48, 32, without=(4,))
    flags = ["--bucket_list", "48x32,32x32"] if buckets else []
    out = tmp_path / "latents"
    assert encode_latents.main(["--shards", str(shards / "*.tar"), "--out", str(out), "--vae", "tiny", "--resolution",
                                "32", "--control", "seg", "--flip", "--batch_size", "4", "--workers", "2", *flags]) == 0
    report = json.loads((out / "00000.report.json").read_text())
    assert report["skipped"] == {"no_control": ["s004"]} and report["encoded"] == 5
    assert json.loads((out / "latents.json").read_text())["control"] == ["seg"]
    store = sd.data.training_data.LatentStore(out, flip=True, control="seg")
    rows = np.arange(len(store))
    straight = store.gather_controls(rows)
    mirrored = store.gather_controls(rows, np.ones(len(rows), dtype=bool))
    width = 48 if buckets else 32  # the 48x32 bucket keeps the whole image; the square its centre 32x32
    left_third_white = np.zeros((32, 48), dtype=np.uint8)
    left_third_white[:, :16] = 255
    expected = left_third_white if buckets else left_third_white[:, 8:40]  # centre crop: 8 of the 16 columns
    assert straight.shape == (5, 3, 32, width)
    assert np.abs(straight.astype(int) - expected[None, None]).max() <= 1  # equal but for the scaling's rounding
    assert np.array_equal(mirrored, straight[..., ::-1])


def test_a_folder_without_the_conditioning_images_names_the_flag_that_makes_them(tmp_path):
    entry = make_dataset(tmp_path, n_train=4, n_val=0)
    with pytest.raises(sd.data.training_data.DataError, match="encode_latents.py --control canny"):
        sd.data.training_data.LatentStore(entry["latents"], control="canny")


def test_batches_end_with_the_conditioning_images_of_their_rows(tmp_path):
    entry = control_dataset(tmp_path, n_train=8)
    store = sd.data.training_data.LatentStore(entry["latents"], control="seg")
    split = sd.data.training_data.join_split(entry["dataset"], "train", store)
    data = sd.data.training_data.MixedData([split], [1.0])
    indices = np.array([3, 0, 5])
    latents, input_ids, control = data.batch(indices)
    assert control.dtype == torch.uint8 and control.shape == (3, 3, 64, 64)
    rows = split.rows[indices]
    for image, row in zip(control.numpy(), rows):
        shard, at = store.locations[row]
        assert np.array_equal(image, square_at(int(store.paths[shard].stem) * 100 + at, 64).transpose(2, 0, 1))


# ------------------------------------------------------------------------------ training runs


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    return make_base_pipeline(tmp_path_factory.mktemp("base") / "pipeline")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    return control_dataset(tmp_path_factory.mktemp("control_data"), n_train=16, n_val=4)


def train(root: Path, name: str, *flags: str, **fields) -> Path:
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**CONTROL, "out_dir": str(root / name), **fields}))
    assert SD_Train.main(["--config", str(path), *flags]) == 0
    return root / name


@pytest.fixture(scope="module")
def runs(base_model, data, tmp_path_factory):
    """A ControlNet run of 6 steps straight (``a``) and stopped at step 3, then resumed (``b``)."""
    root = tmp_path_factory.mktemp("controlnet_runs")
    Image.fromarray(square_at(1, 64)).save(root / "grid_control.png")
    common = dict(datasets=[data], init_from=str(base_model), max_steps=6, control_dropout=0.25, validate_every=6,
                  validation_prompts=["a red circle"], validation_controls=[str(root / "grid_control.png")])
    straight = train(root, "a", **common)
    train(root, "b", "--stop_at_step", "3", **common)  # mid-epoch (4 steps an epoch)
    return straight, train(root, "b", **common)


@pytest.mark.slow
def test_a_controlnet_run_stopped_and_resumed_equals_the_straight_run_bit_for_bit(runs, base_model):
    straight, resumed = runs
    a, b = checkpoint_state(straight, 6, WEIGHTS), checkpoint_state(resumed, 6, WEIGHTS)
    assert_bitwise_equal(a, b)
    folder = straight / "checkpoints" / sd.run_folder.step_dir_name(6)
    assert not (folder / "unet.safetensors").exists()  # the base is init_from's, never saved
    ema = load_file(folder / "ema.safetensors")
    assert ema and all(k.startswith("controlnet.") for k in ema)
    # The ControlNet trained: its zero convolutions are not zero any more.
    weights = load_file(folder / "controlnet.safetensors")
    assert weights["controlnet_mid_block.weight"].abs().max() > 0
    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][:6] == [1, 2, 3, 4, 5, 6]
    assert any("val_loss" in r for r in records) and all(np.isfinite(r["val_loss"]) for r in records if "val_loss" in r)
    grid = np.asarray(Image.open(straight / "samples" / "step_00000006.png").convert("RGB"))
    control = np.asarray(Image.open(straight.parent / "grid_control.png").convert("RGB"))
    shown = sd.sampling.grid_cell(grid, 0, 0, 64, 64, ["a red circle"], images=2)  # the control image, then the sample
    assert np.array_equal(shown, control)
    assert not np.array_equal(sd.sampling.grid_cell(grid, 0, 1, 64, 64, ["a red circle"], images=2), control)


@pytest.mark.slow
def test_a_controlnet_run_resumed_on_another_base_is_refused(runs, data, tmp_path, capsys):
    other = tmp_path / "other"
    sd.formats.export_diffusers(other, sd.model.build_unet("tiny", seed=9, from_scratch=False),
                                sd.model.load_vae("tiny"), sd.model.load_text_encoder("tiny"),
                                sd.model.load_tokenizer("tiny"))
    _, run = runs
    path = tmp_path / "again.yaml"
    path.write_text(yaml.safe_dump({**CONTROL, "out_dir": str(run), "datasets": [data], "init_from": str(other),
                                    "max_steps": 6, "control_dropout": 0.25}))
    capsys.readouterr()
    assert SD_Train.main(["--config", str(path)]) == 2
    assert f"init_from {other} is not the base model the ControlNet in" in capsys.readouterr().err


@pytest.mark.slow
def test_the_exported_files_sample_as_the_run_does(runs, base_model, tmp_path):
    _, run = runs
    control = tmp_path / "control.png"
    Image.fromarray(square_at(3, 64)).save(control)
    sampling = ["--prompt", "a red circle", "--control", str(control), "--n", "2", "--steps", "3", "--cfg", "3",
                "--device", "cpu"]
    assert SD_ImageGen.main(["--ckpt", str(run), *sampling, "--out", str(tmp_path / "run")]) == 0
    single, folder = tmp_path / "cn.safetensors", tmp_path / "cn_diffusers"
    assert SD_ImageGen.main(["--ckpt", str(run), "--export_controlnet", str(single)]) == 0
    assert SD_ImageGen.main(["--ckpt", str(run), "--export_controlnet", str(folder),
                             "--controlnet_format", "diffusers"]) == 0
    assert any(k.startswith("control_model.zero_convs.") for k in load_file(single))
    with safe_open(str(single), framework="pt") as handle:
        header = handle.metadata()
    assert (header["modelspec.architecture"], header["modelspec.title"]) == ("stable-diffusion-v1/controlnet", "cn")
    assert "modelspec.date" in header and "modelspec.resolution" in header  # from the run's checkpoint and data
    plain = tmp_path / "plain"
    assert SD_ImageGen.main(["--ckpt", str(base_model), "--prompt", "a red circle", "--n", "2", "--steps", "3",
                             "--cfg", "3", "--height", "64", "--width", "64", "--device", "cpu", "--out", str(plain)]) == 0

    def images(out: Path) -> list[np.ndarray]:
        return [np.asarray(Image.open(out / f"000_00000{i}.png")).astype(int) for i in range(2)]

    ours = images(tmp_path / "run")
    for source in (single, folder):
        out = tmp_path / f"samples_{source.stem}"
        assert SD_ImageGen.main(["--ckpt", str(base_model), "--controlnet", str(source), *sampling, "--out", str(out)]) == 0
        assert all(np.array_equal(a, b) for a, b in zip(images(out), ours))
    assert max(np.abs(a - b).max() for a, b in zip(images(plain), ours)) > 0  # the ControlNet changed the images
    record = json.loads((tmp_path / "run" / "images.json").read_text())[0]
    assert record["control"] == str(control) and record["control_scale"] == 1.0


@pytest.mark.slow
def test_a_controlnet_run_on_latents_without_conditioning_images_stops_before_training(base_model, tmp_path, capsys):
    entry = make_dataset(tmp_path / "plain", n_train=8, n_val=0)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**CONTROL, "out_dir": str(tmp_path / "run"), "datasets": [entry],
                                    "init_from": str(base_model), "max_steps": 2}))
    assert SD_Train.main(["--config", str(path)]) == 2
    assert "encode_latents.py --control seg" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_two_ranks_train_one_controlnet(base_model, data, tmp_path):
    """DDP wraps the frozen base and the ControlNet together; only the ControlNet's gradients are reduced. The
    save checks that both ranks hold the same weights (``ckpt.check_ranks_agree``)."""
    import subprocess
    import sys

    config = tmp_path / "two.yaml"
    config.write_text(yaml.safe_dump({**CONTROL, "out_dir": str(tmp_path / "run"), "datasets": [data],
                                      "init_from": str(base_model), "max_steps": 4, "grad_accum": 1}))
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(root / "SD_Train.py"), "--config", str(config)], cwd=root, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    weights = load_file(tmp_path / "run" / "checkpoints" / sd.run_folder.step_dir_name(4) / "controlnet.safetensors")
    assert weights["controlnet_mid_block.weight"].abs().max() > 0


@pytest.mark.slow
def test_controlnet_from_starts_a_run_from_a_trained_controlnet_of_any_source(runs, base_model, data, tmp_path):
    import sd.controlnet.model
    import sd.train.config

    _, run = runs
    folder = run / "checkpoints" / sd.run_folder.step_dir_name(6)
    ema = {k.removeprefix("controlnet."): v for k, v in load_file(folder / "ema.safetensors").items()}
    single = tmp_path / "cn.safetensors"
    assert SD_ImageGen.main(["--ckpt", str(run), "--export_controlnet", str(single)]) == 0
    for source in (run, single):  # a run of ours (its EMA), and the file ComfyUI loads
        config = sd.train.config.TrainConfig(**{**CONTROL, "datasets": [data], "init_from": str(base_model),
                                                "controlnet_from": str(source)})
        unet = sd.model.build_unet("tiny")
        sd.formats.load_unet_weights(str(base_model), unet)
        started = sd.controlnet.model.attach(config, unet).controlnet.state_dict()
        assert set(started) == set(ema) and all(torch.equal(started[k], ema[k]) for k in ema), source


def test_damaged_conditioning_image_files_are_named_with_the_fix(tmp_path):
    entry = control_dataset(tmp_path, n_train=8)
    latents = Path(entry["latents"])
    data, offsets = sd.data.encode.control_files(sorted(latents.glob("[0-9][0-9][0-9][0-9][0-9].npy"))[0], "seg")
    original = data.read_bytes()
    data.write_bytes(original[:-10])  # cut short: the offsets no longer end where the bytes do
    with pytest.raises(sd.data.training_data.DataError, match=f"{offsets.name}.*re-encode"):
        sd.data.training_data.LatentStore(latents, control="seg")
    data.write_bytes(original[:100] + b"\0" * (len(original) - 100))  # the right size, its first PNGs overwritten
    store = sd.data.training_data.LatentStore(latents, control="seg")
    with pytest.raises(sd.data.training_data.DataError, match="does not decode.*re-encode the shard"):
        store.gather_controls(np.arange(2))


@pytest.mark.slow
def test_a_controlnet_run_sampled_on_a_replaced_base_is_refused_unless_allowed(base_model, data, tmp_path, capsys):
    """After the run, its init_from folder is overwritten with another model: the base fingerprint saved with
    the run no longer matches it."""
    base = tmp_path / "base"
    shutil.copytree(base_model, base)
    run = train(tmp_path, "run", datasets=[data], init_from=str(base), max_steps=1, validate_every=0)
    shutil.rmtree(base)
    sd.formats.export_diffusers(base, sd.model.build_unet("tiny", seed=9, from_scratch=False),
                                sd.model.load_vae("tiny"), sd.model.load_text_encoder("tiny"),
                                sd.model.load_tokenizer("tiny"))
    control = tmp_path / "control.png"
    Image.fromarray(square_at(3, 64)).save(control)
    sampling = ["--ckpt", str(run), "--prompt", "a red circle", "--control", str(control), "--n", "1", "--steps", "2",
                "--device", "cpu"]
    capsys.readouterr()
    assert SD_ImageGen.main([*sampling, "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err
    assert f"{base} is not the base model the ControlNet in" in err and "--allow_other_base" in err
    assert not (tmp_path / "refused").exists()
    assert SD_ImageGen.main([*sampling, "--out", str(tmp_path / "allowed"), "--allow_other_base"]) == 0

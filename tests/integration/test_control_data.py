"""Conditioning images (ControlNet inputs) end to end: photo_canny.png beside photo.jpg -> 01e --control ->
key.canny.png -> encode_latents.py --control -> the control tensor of MixedData's batches, cut, scaled,
bucketed and mirrored exactly as the images; and 03b_derive_control.py's Canny edges."""

import importlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import encode_latents
import sd.data.buckets
import sd.data.shards
import sd.data.training_data
import sd.faults
from data_factory import make_captions
from shard_factory import image_bytes, random_image

IMPORT = importlib.import_module("pipeline.01e_import_folder")
DERIVE = importlib.import_module("pipeline.03b_derive_control")


def square(height: int, width: int, rows: tuple[int, int], cols: tuple[int, int]) -> np.ndarray:
    """``(height, width)`` uint8: black with a white block over ``rows`` x ``cols`` (ends excluded)."""
    pixels = np.zeros((height, width), dtype=np.uint8)
    pixels[rows[0] : rows[1], cols[0] : cols[1]] = 255
    return pixels


def save(path: Path, pixels: np.ndarray, fmt: str = "PNG") -> None:
    path.write_bytes(image_bytes(pixels, fmt))


# Each image with a conditioning image: its size and the white block of its photo_canny.png. The blocks'
# bounds are even, so halving (the import at 32 px) keeps them sharp: 0 and 255 only.
CANNY = {"wide": ((64, 96), (16, 32), (36, 52)), "tall": ((96, 64), (40, 56), (8, 24)), "sq": ((64, 64), (0, 16), (0, 16))}
# Where the blocks land at 32 px: the centre square, or with --keep_aspect the whole image, halved.
SQUARE = {"wide": ((8, 16), (10, 18)), "tall": ((12, 20), (4, 12)), "sq": ((0, 8), (0, 8))}
KEEP_ASPECT = {"wide": ((32, 48), (8, 16), (18, 26)), "tall": ((48, 32), (20, 28), (4, 12)), "sq": ((32, 32), (0, 8), (0, 8))}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """Images with conditioning images of every kind: good ones (wide, tall, sq), none (plain), one that
    does not decode (bad), one of another aspect ratio (odd), two for one image (two), one without its
    image (lonely); tall also has a loss mask."""
    src = tmp_path_factory.mktemp("control") / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    for name, ((height, width), rows, cols) in CANNY.items():
        save(src / f"{name}.png", random_image(rng, height, width))
        save(src / f"{name}_canny.png", square(height, width, rows, cols))
    for name in ("plain", "bad", "odd", "two"):
        save(src / f"{name}.png", random_image(rng, 64, 64))
    (src / "bad_canny.png").write_bytes(b"not an image at all")
    save(src / "odd_canny.png", np.zeros((64, 80), dtype=np.uint8))
    save(src / "two_canny.png", np.zeros((64, 64), dtype=np.uint8))
    save(src / "two_canny.jpg", np.zeros((64, 64), dtype=np.uint8), "JPEG")
    save(src / "lonely_canny.png", np.zeros((64, 64), dtype=np.uint8))
    save(src / "tall_mask.png", np.full((96, 64), 255, dtype=np.uint8))
    for image in src.glob("*.png"):
        if "_" not in image.stem:
            (src / f"{image.stem}.txt").write_text(f"a photo of {image.stem}")
    return src


def import_folder(src: Path, out: Path, *flags) -> Path:
    assert IMPORT.main(["--input", str(src), "--out", str(out), "--resolution", "32", "--shard_size", "4", *flags]) == 0
    return out


def encode(shards: Path, out: Path, *flags) -> int:
    return encode_latents.main(["--shards", str(shards / "*.tar"), "--out", str(out), "--vae", "tiny",
                                "--resolution", "32", "--batch_size", "2", "--workers", "1", "--flip", *flags])


def mixed(latents: Path, root: Path, **store) -> sd.data.training_data.MixedData:
    """The encoded images joined to captions, one dataset."""
    keys = [k for f in sorted(latents.glob("*.keys.txt")) for k in f.read_text().split()]
    captions = make_captions(root / f"captions_{latents.name}", [(k, f"a photo of {k}") for k in keys], [])
    store = sd.data.training_data.LatentStore(latents, flip=True, **store)
    return sd.data.training_data.MixedData([sd.data.training_data.join_split(captions, "train", store)], [1.0])


def shard_members(out: Path) -> dict[str, sd.data.shards.ShardSample]:
    samples = {}
    for tar in sorted(out.glob("*.tar")):
        shard, truncated = sd.data.shards.read_shard(tar.read_bytes())
        assert truncated is None
        samples.update({sample.key: sample for sample in shard})
    return samples


def png_pixels(data: bytes) -> np.ndarray:
    return sd.data.shards.decode_png(data)[0]  # grey: the first of the three equal channels


# ------------------------------------------------------------------------------ import


def test_import_carries_each_conditioning_image_cut_as_its_image_and_names_the_bad_ones(folder, tmp_path):
    out = import_folder(folder, tmp_path / "shards", "--control", "canny")
    samples = shard_members(out)
    assert sorted(samples) == ["plain", "sq", "tall", "wide"]  # no conditioning image became an image
    assert samples["plain"].controls == {} and samples["tall"].mask is not None
    for key, (rows, cols) in SQUARE.items():
        assert list(samples[key].controls) == ["canny"]
        assert np.array_equal(png_pixels(samples[key].controls["canny"]), square(32, 32, rows, cols)), key
    assert json.loads(samples["wide"].metadata)["control_sources"] == {"canny": "wide_canny.png"}
    stats = [json.loads((out / f"{i:05d}_stats.json").read_text()) for i in range(2)]
    assert sum(s["successes"] for s in stats) == 4 and [s["controls"] for s in stats] == [{"canny": 1}, {"canny": 2}]
    failed = {reason: s["examples"][reason] for s in stats for reason in s["failed"]}
    assert failed == {"bad_control": ["bad_canny.png"], "control_mismatch": ["odd_canny.png"],
                      "ambiguous_control": ["two_canny.jpg and two_canny.png"]}
    summary = json.loads((out / "01e_import_folder_summary.json").read_text())
    assert summary["controls"] == {"canny": 3} and summary["masked"] == 1
    assert summary["orphan_controls"] == {"canny": {"count": 1, "examples": ["lonely_canny.png"]}}

    # Without --control, photo_canny.png is an image like any other.
    plain = shard_members(import_folder(folder, tmp_path / "no_flag", "--default_caption", "a photo"))
    assert "wide_canny" in plain and all(not sample.controls for sample in plain.values())


def test_import_refuses_the_loss_masks_name_and_a_changed_control_list(folder, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        IMPORT.main(["--input", str(folder), "--out", str(tmp_path / "o"), "--control", "mask"])
    assert exit_info.value.code == 2 and "not 'mask'" in capsys.readouterr().err
    out = import_folder(folder, tmp_path / "shards")
    assert IMPORT.main(["--input", str(folder), "--out", str(out), "--resolution", "32", "--shard_size", "4",
                        "--control", "canny"]) == 2
    assert "use a fresh --out" in capsys.readouterr().err


# ------------------------------------------------------------------------------ encode and batches


@pytest.fixture(scope="module")
def square_run(folder, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("square")
    shards = import_folder(folder, root / "shards", "--control", "canny")
    assert encode(shards, root / "latents", "--control", "canny") == 0
    return {"root": root, "shards": shards, "latents": root / "latents"}


def test_encode_stores_pngs_skips_samples_without_one_and_names_them(square_run):
    latents = square_run["latents"]
    meta = json.loads((latents / "latents.json").read_text())
    assert meta["control"] == ["canny"] and meta["count"] == 3
    assert meta["skipped"] == {"no_control": 1} and meta["skipped_examples"] == {"no_control": ["plain"]}
    assert json.loads((latents / "00000.report.json").read_text())["skipped"] == {"no_control": ["plain"]}
    offsets = np.load(latents / "00001.canny.offsets.npy")
    assert offsets.dtype == np.int64 and offsets[0] == 0 and len(offsets) == 3
    assert offsets[-1] == (latents / "00001.canny.pngs").stat().st_size


def test_batches_return_the_conditioning_images_cut_and_mirrored_as_their_latents(square_run):
    data = mixed(square_run["latents"], square_run["root"], control="canny", masks=True)
    keys = data.splits[0].keys
    indices = np.array([keys.index(k) for k in ("wide", "tall", "sq", "wide")])
    flipped = np.array([False, True, False, True])
    latents, input_ids, masks, control = data.batch(indices, flipped)  # the mask before the control
    assert control.dtype == torch.uint8 and control.shape == (4, 3, 32, 32)
    assert latents.shape == (4, 4, 4, 4) and masks.shape == (4, 1, 4, 4)
    for image, key, mirrored in zip(control.numpy(), ("wide", "tall", "sq", "wide"), flipped):
        expected = square(32, 32, *SQUARE[key])
        assert np.array_equal(image, np.repeat((expected[:, ::-1] if mirrored else expected)[None], 3, axis=0)), key
    assert len(mixed(square_run["latents"], square_run["root"]).batch(indices)) == 2  # no control asked for


def test_a_folder_without_the_named_conditioning_images_names_the_shard_and_the_flag(square_run):
    with pytest.raises(sd.data.training_data.DataError,
                       match=r"00000\.depth\.pngs.*encode_latents\.py --control depth"):
        sd.data.training_data.LatentStore(square_run["latents"], control="depth")


def test_buckets_keep_the_whole_conditioning_image_and_a_merged_bucket_cuts_it_as_its_latents(folder, tmp_path):
    shards = import_folder(folder, tmp_path / "shards", "--control", "canny", "--keep_aspect")
    out = tmp_path / "latents"
    assert encode(shards, out, "--control", "canny", "--bucket_list", "48x32,32x48,32x32") == 0
    assert sorted(p.name for p in out.glob("*.pngs")) == ["00000.32x32.canny.pngs", "00001.32x48.canny.pngs",
                                                         "00001.48x32.canny.pngs"]
    data = mixed(out, tmp_path, control="canny")
    keys = data.splits[0].keys
    for key, ((height, width), rows, cols) in KEEP_ASPECT.items():
        index = np.array([keys.index(key)] * 2)
        _, _, control = data.batch(index, np.array([False, True]))
        expected = square(height, width, rows, cols)
        assert control.shape == (2, 3, height, width)
        assert np.array_equal(control[0, 0].numpy(), expected) and np.array_equal(control[1, 0].numpy(), expected[:, ::-1])
    # One global batch of 3: the one-sample buckets merge into the square one, whose shape they train at.
    merged = data.merge_small(np.arange(len(data)), 3)
    assert sorted(into for _, into, _ in merged) == [(4, 4, 4), (4, 4, 4)]
    indices = np.array([keys.index(k) for k in ("wide", "tall", "sq")])
    latents, _, control = data.batch(indices, np.array([True, False, False]))
    assert latents.shape == (3, 4, 4, 4) and control.shape == (3, 3, 32, 32)
    # The centre 32x32 of the 48x32 and 32x48 images, the region fit_latents keeps of their latents.
    wide = square(32, 32, (8, 16), (10, 18))
    for image, expected in zip(control[:, 0].numpy(), (wide[:, ::-1], square(32, 32, (12, 20), (4, 12)),
                                                          square(32, 32, (0, 8), (0, 8)))):
        assert np.array_equal(image, expected)


def test_encode_killed_after_a_shards_files_resumes_to_the_same_bytes(square_run, tmp_path, monkeypatch):
    def killed(name, key):
        if (name, key) == ("after_npy", "00001"):
            raise RuntimeError("killed after 00001's arrays")

    out = tmp_path / "latents"
    monkeypatch.setattr(sd.faults, "point", killed)
    assert encode(square_run["shards"], out, "--control", "canny") == 1
    assert (out / "00001.canny.offsets.npy").exists() and not (out / "00001.keys.txt").exists()
    monkeypatch.undo()
    assert encode(square_run["shards"], out, "--control", "canny") == 0
    reference = square_run["latents"]
    names = sorted(p.name for p in reference.iterdir() if p.name != "latents.json")
    assert sorted(p.name for p in out.iterdir() if p.name != "latents.json") == names
    for name in names:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    assert json.loads((out / "latents.json").read_text())["count"] == 3
    # Another control list into the same folder is refused before any work.
    assert encode(square_run["shards"], out, "--control", "canny,depth") == 2


# ------------------------------------------------------------------------------ 03b: derived Canny edges


def drawn_shard(path: Path, keys: list[str], broken: str | None = None) -> dict[str, np.ndarray]:
    """Samples whose image is a white rectangle on black (its corners moved by the key's index), as PNG;
    ``broken`` gets bytes that do not decode. Returns each key's rectangle as a boolean image."""
    samples, rectangles = [], {}
    for i, key in enumerate(keys):
        rectangle = square(64, 64, (12 + i, 40 + i), (20, 50 - i)) > 0
        rgb = np.repeat(rectangle[..., None] * np.uint8(255), 3, axis=2)
        data = b"\x89PNG\r\n\x1a\n nothing IEND\xaeB`\x82" if key == broken else image_bytes(rgb, "PNG")
        sample = sd.data.shards.ShardSample(key, data, "png", f"a white box {i}", b"{}")
        if i == 0:
            sample.mask = image_bytes(np.full((64, 64), 128, dtype=np.uint8), "PNG")
        samples.append(sample)
        rectangles[key] = rectangle
    sd.data.shards.write_shard(path, samples)
    return rectangles


def border(rectangle: np.ndarray) -> np.ndarray:
    """The pixels of a boolean block that touch the outside, and the outside pixels that touch it."""
    grown, shrunk = rectangle.copy(), rectangle.copy()
    for axis in (0, 1):
        for shift in (1, -1):
            grown |= np.roll(rectangle, shift, axis)
            shrunk &= np.roll(rectangle, shift, axis)
    return grown & ~shrunk


def test_derived_canny_edges_lie_on_the_drawn_rectangles_border(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    rectangles = drawn_shard(shards / "00000.tar", ["a", "b", "c"], broken="c")
    out = tmp_path / "canny"
    assert DERIVE.main(["--shards", str(shards / "*.tar"), "--out", str(out), "--kind", "canny"]) == 0
    samples = shard_members(out)
    assert sorted(samples) == ["a", "b"]
    stats = json.loads((out / "00000_stats.json").read_text())
    assert stats["successes"] == 2 and stats["failed"] == {"undecodable": 1} and stats["examples"] == {"undecodable": ["c"]}
    for key in ("a", "b"):
        edges = png_pixels(samples[key].controls["canny"])
        on_border = border(rectangles[key])
        assert set(np.unique(edges)) == {0, 255}
        assert not (edges.astype(bool) & ~on_border).any()  # nothing off the border
        # Every side is traced: each border row and column of the rectangle has an edge beside it.
        rows, cols = np.flatnonzero(rectangles[key].any(1)), np.flatnonzero(rectangles[key].any(0))
        for row in range(rows[0], rows[-1] + 1):
            assert edges[row, cols[0] - 1 : cols[0] + 1].any() and edges[row, cols[-1] : cols[-1] + 2].any()
        for col in range(cols[0], cols[-1] + 1):
            assert edges[rows[0] - 1 : rows[0] + 1, col].any() and edges[rows[-1] : rows[-1] + 2, col].any()
    assert samples["a"].mask is not None and samples["a"].caption == "a white box 0"  # the rest as it was
    # the first shard's conditioning images as files (for --control and validation_controls), with captions
    assert sorted(p.name for p in (out / "examples").iterdir()) == ["00.canny.png", "00.txt", "01.canny.png", "01.txt"]
    assert (out / "examples" / "01.canny.png").read_bytes() == samples["b"].controls["canny"]
    assert (out / "examples" / "00.txt").read_text() == "a white box 0\n"


def test_the_derive_stage_resumes_per_shard_and_refuses_other_thresholds(tmp_path, capsys):
    shards = tmp_path / "shards"
    shards.mkdir()
    drawn_shard(shards / "00000.tar", ["a", "b"])
    drawn_shard(shards / "00001.tar", ["c", "d"])
    out = tmp_path / "canny"
    argv = ["--shards", str(shards / "*.tar"), "--out", str(out), "--kind", "canny", "--low", "50", "--high", "150"]
    assert DERIVE.main(argv) == 0
    first = {name: (out / name).read_bytes() for name in ("00000.tar", "00001.tar")}
    mtime = (out / "00000.tar").stat().st_mtime_ns
    (out / "00001_stats.json").unlink()  # 00001 as a run killed before its done marker leaves it
    (out / "00001.tar").write_bytes(b"half")
    assert DERIVE.main(argv) == 0
    assert (out / "00000.tar").stat().st_mtime_ns == mtime
    assert {name: (out / name).read_bytes() for name in first} == first
    summary = json.loads((out / "03b_derive_control_summary.json").read_text())
    assert (summary["kept"], summary["shards_written"], summary["shards_already_done"]) == (4, 1, 1)
    capsys.readouterr()
    assert DERIVE.main([*argv[:-4], "--low", "100", "--high", "150"]) == 2
    assert "--low 50.0, not 100.0" in capsys.readouterr().err
    assert DERIVE.main(["--shards", str(shards / "*.tar"), "--out", str(shards), "--kind", "canny"]) == 2


def test_derived_edges_go_through_encode_latents(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    rectangles = drawn_shard(shards / "00000.tar", ["a", "b"])
    assert DERIVE.main(["--shards", str(shards / "*.tar"), "--out", str(tmp_path / "canny"), "--kind", "canny"]) == 0
    assert encode_latents.main(["--shards", str(tmp_path / "canny" / "*.tar"), "--out", str(tmp_path / "latents"),
                                "--vae", "tiny", "--resolution", "64", "--control", "canny"]) == 0
    store = sd.data.training_data.LatentStore(tmp_path / "latents", control="canny")
    control = store.gather_controls(np.array([store.row_of["b"]]))
    edges = png_pixels(shard_members(tmp_path / "canny")["b"].controls["canny"])
    assert np.array_equal(control[0, 0], edges) and not (control[0, 0].astype(bool) & ~border(rectangles["b"])).any()


def test_a_merged_buckets_conditioning_images_keep_the_region_of_their_latents():
    # A 40x32 image (5x4 latents) trained at 32x32: fit_latents keeps latent columns 0..3 ((5 - 4) // 2 = 0),
    # so the pixels kept are columns 0..31, not the centred 4..35 a crop of the pixels alone would keep.
    latents = np.broadcast_to(np.arange(5, dtype=np.float16), (1, 4, 4, 5))
    images = np.broadcast_to((np.arange(40) // 8).astype(np.uint8), (1, 3, 32, 40))
    kept = sd.data.buckets.fit_latents(latents, (4, 4, 4))
    fitted = sd.data.buckets.fit_images(images, (4, 4, 4))
    assert np.array_equal(kept[0, 0, 0], [0, 1, 2, 3])
    assert fitted.shape == (1, 3, 32, 32) and np.array_equal(fitted[0, 0, 0], np.arange(32) // 8)

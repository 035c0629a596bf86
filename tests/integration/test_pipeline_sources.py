"""The source stages 01b (DiffusionDB), 01c (JourneyDB) and 01d (COCO) on small locally built inputs."""

import gzip
import importlib
import io
import json
import tarfile
import zipfile

import numpy as np
import pytest

import sd.data.shards

from http_server import LoopbackServer
from shard_factory import image_bytes, random_image

RES = 64
DIFFUSIONDB = importlib.import_module("pipeline.01b_download_diffusiondb")
JOURNEYDB = importlib.import_module("pipeline.01c_download_journeydb_images")
COCO = importlib.import_module("pipeline.01d_download_coco")


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def make_image(seed: int, height: int, width: int, fmt: str) -> tuple[bytes, np.ndarray]:
    """Encoded bytes and the RGB pixels a decoder gets back from them."""
    data = image_bytes(random_image(np.random.default_rng(seed), height, width), fmt)
    return data, sd.data.shards.decode_image(data, {"PNG": "png", "JPEG": "jpg", "WEBP": "webp"}[fmt])


def zip_bytes(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def tgz_bytes(members: dict[str, bytes], folders: tuple[str, ...] = ()) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for folder in folders:
            info = tarfile.TarInfo(folder)
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def read_output(out_dir) -> dict[str, tuple[str, dict, np.ndarray]]:
    """key -> (caption, metadata, RGB pixels) over every shard of a stage's output."""
    samples = {}
    for tar in sorted(out_dir.glob("*.tar")):
        shard, truncated = sd.data.shards.read_shard(tar.read_bytes())
        assert truncated is None
        for sample in shard:
            assert sample.image_ext == "jpg" and sample.key not in samples
            samples[sample.key] = (sample.caption, json.loads(sample.metadata),
                                   sd.data.shards.decode_image(sample.image, "jpg"))
    return samples


def assert_same_picture(rgb: np.ndarray, original: np.ndarray) -> None:
    """The output is the original's short-side resize + centre crop (up to JPEG error)."""
    assert rgb.shape == (RES, RES, 3)
    expected = sd.data.shards.resize_center_crop(original, RES).astype(np.float32)
    assert np.abs(rgb.astype(np.float32) - expected).mean() < 6


def stats(out_dir, index: int) -> dict:
    return json.loads((out_dir / f"{index:05d}_stats.json").read_text())


def summary(out_dir, stage: str) -> dict:
    return json.loads((out_dir / f"{stage}_summary.json").read_text())


def mtimes(out_dir) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in out_dir.iterdir() if p.suffix in (".tar", ".json")
            and not p.name.endswith("_summary.json")}


@pytest.mark.parametrize("module, flags", [
    (DIFFUSIONDB, ["--parts", "--out", "--base_url", "--resolution", "--download_dir", "--keep_archives"]),
    (JOURNEYDB, ["--archives", "--annotations", "--out", "--base_url", "--caption", "--resolution",
                 "--download_dir", "--keep_archives"]),
    (COCO, ["--images", "--captions", "--out", "--instances", "--person_filter", "--min_person_height", "--seg",
            "--seg_category",
            "--shard_size", "--resolution", "--download_dir", "--keep_archives"]),
])
def test_help_lists_every_flag(module, flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert [flag for flag in flags if flag not in text] == []
    assert "--resolution RESOLUTION side of the square output images in pixels (default: 512)" in text


# ---------------------------------------------------------------------------------------------
# 01b DiffusionDB
# ---------------------------------------------------------------------------------------------


def diffusiondb_parts():
    """Part 1: two good images (PNG, WEBP), a corrupt one, one without an entry, one with an empty
    prompt. Part 4: one good image. Part 3 is not a zip; part 2 does not exist."""
    tall_png, tall_rgb = make_image(1, 120, 80, "PNG")
    wide_webp, wide_rgb = make_image(2, 70, 100, "WEBP")
    small_png, small_rgb = make_image(3, 64, 64, "PNG")
    part1 = {
        "tall one.v2.png": tall_png,
        "wide-img.webp": wide_webp,
        "corrupt.png": b"\x89PNG\r\n\x1a\n garbage that is not an image IEND\xaeB`\x82",
        "orphan.png": small_png,
        "empty.png": small_png,
        "part-000001.json": json.dumps({
            "tall one.v2.png": {"p": "a castle at dusk", "se": 11, "c": 7.0, "st": 50, "sa": 8},
            "wide-img.webp": {"p": " a red fox ", "se": 12, "c": 9.5, "st": 30, "sa": 1},
            "corrupt.png": {"p": "broken", "se": 1, "c": 7.0, "st": 50, "sa": 8},
            "empty.png": {"p": "", "se": 2, "c": 7.0, "st": 50, "sa": 8},
        }).encode(),
    }
    part4 = {"solo.png": small_png,
             "part-000004.json": json.dumps({"solo.png": {"p": "a lone tree", "se": 4, "c": 6, "st": 25,
                                                          "sa": 2}}).encode()}
    routes = {"/images/part-000001.zip": zip_bytes(part1), "/images/part-000003.zip": b"PK\x03\x04 not a zip at all",
              "/images/part-000004.zip": zip_bytes(part4)}
    return routes, {"ddb_1_tall_one": tall_rgb, "ddb_1_wide-img": wide_rgb, "ddb_4_solo": small_rgb}


def test_diffusiondb_parts_become_shards_with_prompts(tmp_path):
    routes, originals = diffusiondb_parts()
    out = tmp_path / "ddb"
    with LoopbackServer(routes) as server:
        argv = ["--parts", "1-4", "--out", str(out), "--base_url", f"{server.url}/images",
                "--resolution", str(RES), "--retries", "0"]
        assert DIFFUSIONDB.main(argv) == 0
        assert sorted(p.name for p in out.glob("*.tar")) == ["00001.tar", "00004.tar"]
        first = stats(out, 1)
        assert (first["successes"], first["failed"]) == (2, {"no_caption": 2, "undecodable": 1})
        assert sorted(first["examples"]["no_caption"]) == ["ddb_1_empty", "ddb_1_orphan"]
        assert (stats(out, 4)["successes"], stats(out, 4)["failed"]) == (1, {})
        result = summary(out, "01b_download_diffusiondb")
        assert (result["kept"], result["shards_written"], result["shards_already_done"]) == (3, 2, 0)
        assert result["dropped"] == {"bad_archive": 1, "missing_part": 1, "no_caption": 2, "undecodable": 1}
        assert result["failed_parts"] == {"bad_archive": [3], "missing_part": [2]}

        samples = read_output(out)
        assert sorted(samples) == sorted(originals)
        assert {k: caption for k, (caption, _, _) in samples.items()} == {
            "ddb_1_tall_one": "a castle at dusk", "ddb_1_wide-img": "a red fox", "ddb_4_solo": "a lone tree"}
        for key, (_, _, rgb) in samples.items():
            assert_same_picture(rgb, originals[key])
        meta = samples["ddb_1_wide-img"][1]
        assert {k: meta[k] for k in ("seed", "cfg", "steps", "sampler", "part", "file_name", "source")} == {
            "seed": 12, "cfg": 9.5, "steps": 30, "sampler": 1, "part": 1, "file_name": "wide-img.webp",
            "source": "diffusiondb"}
        assert (meta["original_width"], meta["original_height"], "p" in meta) == (100, 70, False)
        assert list((out / "_downloads").iterdir()) == []  # archives deleted, the bad zip too

        # Re-run: finished parts are neither downloaded nor rewritten; only the failed ones are retried.
        hits, before = dict(server.hits), mtimes(out)
        assert DIFFUSIONDB.main(argv) == 0
        assert server.hits == {**hits, "/images/part-000002.zip": 2, "/images/part-000003.zip": 2}
        assert mtimes(out) == before
        again = summary(out, "01b_download_diffusiondb")
        assert (again["kept"], again["shards_written"], again["shards_already_done"]) == (3, 0, 2)
        assert again["dropped"] == result["dropped"]


def test_diffusiondb_bad_range_exits_2_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        DIFFUSIONDB.main(["--parts", "5-1", "--out", str(tmp_path / "x")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("01b_download_diffusiondb.py: error: --parts: empty range '5-1' "
                                       "(see --help)\n")
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------------------------
# 01c JourneyDB
# ---------------------------------------------------------------------------------------------


def journeydb_inputs():
    aaa, aaa_rgb = make_image(10, 90, 130, "JPEG")
    bbb, bbb_rgb = make_image(11, 64, 96, "JPEG")
    ccc, ccc_rgb = make_image(12, 80, 80, "JPEG")
    evil, _ = make_image(13, 64, 64, "JPEG")
    archive0 = tgz_bytes({"./000/aaa.jpg": aaa, "000/bbb.jpg": bbb, "000/nocap.jpg": aaa,
                          "000/broken.jpg": bbb[: len(bbb) // 2], "../evil.jpg": evil}, folders=("000",))
    archive1 = tgz_bytes({"001/ccc.jpg": ccc})
    lines = [
        {"img_path": "./imgs/000/aaa.jpg", "prompt": "neon city, 8k", "Task2": {"Caption": "A city at night."}},
        {"img_path": "./imgs/000/bbb.jpg", "prompt": "a cat astronaut"},
        {"img_path": "./imgs/000/broken.jpg", "prompt": "broken"},
        {"img_path": "./imgs/000/evil.jpg", "prompt": "evil"},
        {"img_path": "./imgs/001/ccc.jpg", "prompt": "a blue vase", "Task2": {"Caption": "A vase."}},
        {"img_path": "./imgs/005/zzz.jpg", "prompt": "not requested"},
    ]
    jsonl = ("\n".join(json.dumps(line) for line in lines) + "\nnot json\n").encode()
    originals = {"jdb_000_aaa": aaa_rgb, "jdb_000_bbb": bbb_rgb, "jdb_001_ccc": ccc_rgb}
    return archive0, archive1, jsonl, originals


def test_journeydb_archives_become_shards_with_annotation_captions(tmp_path):
    archive0, archive1, jsonl, originals = journeydb_inputs()
    routes = {"/imgs/000.tgz": archive0, "/imgs/001.tgz": archive1, "/imgs/002.tgz": archive1[: len(archive1) // 2],
              "/anno.jsonl.tgz": tgz_bytes({"train_anno.jsonl": jsonl})}
    out = tmp_path / "jdb"
    with LoopbackServer(routes) as server:
        argv = ["--archives", "0-3", "--annotations", f"{server.url}/anno.jsonl.tgz", "--out", str(out),
                "--base_url", f"{server.url}/imgs", "--caption", "caption", "--resolution", str(RES),
                "--keep_archives", "--retries", "0"]
        assert JOURNEYDB.main(argv) == 0
        assert sorted(p.name for p in out.glob("*.tar")) == ["00000.tar", "00001.tar"]
        first = stats(out, 0)
        assert (first["successes"], first["failed"]) == (2, {"no_caption": 1, "truncated_image": 1, "unsafe_path": 1})
        assert first["examples"]["unsafe_path"] == ["../evil.jpg"]
        assert first["examples"]["no_caption"] == ["jdb_000_nocap"]
        result = summary(out, "01c_download_journeydb_images")
        assert (result["kept"], result["shards_written"], result["bad_annotation_lines"]) == (3, 2, 1)
        assert result["dropped"] == {"bad_archive": 1, "missing_archive": 1, "no_caption": 1,
                                     "truncated_image": 1, "unsafe_path": 1}
        assert result["failed_archives"] == {"bad_archive": [2], "missing_archive": [3]}

        samples = read_output(out)
        assert {k: caption for k, (caption, _, _) in samples.items()} == {
            "jdb_000_aaa": "A city at night.", "jdb_000_bbb": "a cat astronaut", "jdb_001_ccc": "A vase."}
        for key, (_, meta, rgb) in samples.items():
            assert_same_picture(rgb, originals[key])
        assert {k: samples["jdb_000_aaa"][1][k] for k in ("img_path", "prompt", "task2_caption", "archive",
                                                          "original_width", "original_height")} == {
            "img_path": "000/aaa.jpg", "prompt": "neon city, 8k", "task2_caption": "A city at night.", "archive": 0,
            "original_width": 130, "original_height": 90}
        kept = sorted(p.name for p in (out / "_downloads").iterdir())
        assert kept == ["000.tgz", "001.tgz", "anno.jsonl.tgz"]  # --keep_archives; the damaged 002 is deleted

        # With only finished archives requested, nothing is downloaded or rewritten, not even the
        # annotations (their cached copy is removed so that fetching them would show in the hits).
        (out / "_downloads" / "anno.jsonl.tgz").unlink()
        hits, before = dict(server.hits), mtimes(out)
        assert JOURNEYDB.main([*argv[:1], "0-1", *argv[2:]]) == 0
        assert server.hits == hits and mtimes(out) == before
        assert summary(out, "01c_download_journeydb_images")["shards_already_done"] == 2


def test_journeydb_local_gzip_annotations_and_prompt_captions(tmp_path):
    archive0, _, jsonl, _ = journeydb_inputs()
    source = tmp_path / "source"
    source.mkdir()
    (source / "000.tgz").write_bytes(archive0)
    (source / "anno.jsonl.gz").write_bytes(gzip.compress(jsonl))
    out = tmp_path / "jdb"
    assert JOURNEYDB.main(["--archives", "0", "--annotations", str(source / "anno.jsonl.gz"), "--out", str(out),
                           "--base_url", str(source), "--resolution", str(RES)]) == 0
    samples = read_output(out)
    assert {k: caption for k, (caption, _, _) in samples.items()} == {
        "jdb_000_aaa": "neon city, 8k", "jdb_000_bbb": "a cat astronaut"}
    assert (source / "000.tgz").exists()  # a local base_url is copied, never consumed


def test_journeydb_missing_annotations_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        JOURNEYDB.main(["--archives", "0", "--annotations", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.endswith("nope.jsonl does not exist (see --help)\n")


# ---------------------------------------------------------------------------------------------
# 01d COCO
# ---------------------------------------------------------------------------------------------


def coco_inputs(tmp_path):
    """Seven images (listed out of order): 1 and 7 have a tall person; 2 only a small one and a tall
    crowd box; 3 no person; 4 is missing from the zip; 5 is corrupt; 6 has no caption."""
    sizes = {1: (100, 60), 2: (100, 80), 3: (80, 120), 4: (100, 100), 5: (100, 100), 6: (100, 100), 7: (90, 70)}
    images = [{"id": i, "file_name": f"{i:012d}.jpg", "height": h, "width": w} for i, (h, w) in sizes.items()]
    images.reverse()
    pictures, originals = {}, {}
    for i, (h, w) in sizes.items():
        pictures[i], originals[f"coco_{i}"] = make_image(100 + i, h, w, "JPEG")
    pictures[5] = b"\xff\xd8 not really a jpeg \xff\xd9"
    del pictures[4]
    captions = [{"id": 20 + i, "image_id": i, "caption": f"image {i}"} for i in (1, 2, 3, 4, 5)]
    # Image 7's captions are listed out of id order: the first by id is the caption.
    captions += [{"id": 31, "image_id": 7, "caption": "a skier"},
                 {"id": 30, "image_id": 7, "caption": "a person skiing"}]
    person = lambda i, height, crowd=0: {"image_id": i, "category_id": 1, "bbox": [0, 0, 10, height], "iscrowd": crowd}
    instances = {"images": images, "categories": [{"id": 1, "name": "person"}, {"id": 18, "name": "dog"}],
                 "annotations": [person(1, 70), person(1, 20), person(2, 30), person(2, 95, crowd=1),
                                 {"image_id": 3, "category_id": 18, "bbox": [0, 0, 50, 70], "iscrowd": 0},
                                 person(4, 90), person(5, 90), person(6, 90), person(7, 50)]}
    (tmp_path / "captions.json").write_text(json.dumps({"images": images, "annotations": captions}))
    (tmp_path / "instances.json").write_text(json.dumps(instances))
    return pictures, originals


def test_coco_person_filter_from_a_downloaded_zip(tmp_path):
    pictures, originals = coco_inputs(tmp_path)
    images_zip = zip_bytes({f"train2017/{i:012d}.jpg": data for i, data in pictures.items()})
    out = tmp_path / "coco"
    with LoopbackServer({"/zips/train2017.zip": images_zip}) as server:
        argv = ["--images", f"{server.url}/zips/train2017.zip", "--captions", str(tmp_path / "captions.json"),
                "--instances", str(tmp_path / "instances.json"), "--person_filter", "--out", str(out),
                "--shard_size", "3", "--resolution", str(RES)]
        assert COCO.main(argv) == 0
        assert [(stats(out, i)["successes"], stats(out, i)["failed"]) for i in range(3)] == [
            (1, {"no_person": 1, "person_too_small": 1}),
            (0, {"missing_image": 1, "no_caption": 1, "undecodable": 1}),
            (1, {})]
        result = summary(out, "01d_download_coco")
        assert (result["kept"], result["shards_written"], result["images"]) == (2, 3, 7)
        assert result["dropped"] == {"missing_image": 1, "no_caption": 1, "no_person": 1, "person_too_small": 1,
                                     "undecodable": 1}
        samples = read_output(out)
        captions = {k: caption for k, (caption, _, _) in samples.items()}
        assert captions == {"coco_1": "image 1", "coco_7": "a person skiing"}
        for key, (_, _, rgb) in samples.items():
            assert_same_picture(rgb, originals[key])
        meta = samples["coco_7"][1]
        assert (meta["captions"], meta["image_id"], meta["file_name"]) == (
            ["a person skiing", "a skier"], 7, "000000000007.jpg")
        assert (meta["person_height_fraction"], meta["original_width"], meta["original_height"]) == (
            pytest.approx(50 / 90), 70, 90)
        assert list((out / "_downloads").iterdir()) == []  # the images zip is deleted once every shard is written

        hits, before = dict(server.hits), mtimes(out)
        assert COCO.main(argv) == 0
        assert server.hits == hits == {"/zips/train2017.zip": 1} and mtimes(out) == before
        assert summary(out, "01d_download_coco")["shards_already_done"] == 3


def test_coco_folder_without_filter_and_a_stricter_threshold(tmp_path):
    pictures, _ = coco_inputs(tmp_path)
    folder = tmp_path / "train2017"
    folder.mkdir()
    for i, data in pictures.items():
        (folder / f"{i:012d}.jpg").write_bytes(data)
    out = tmp_path / "all"
    assert COCO.main(["--images", str(folder), "--captions", str(tmp_path / "captions.json"), "--out", str(out),
                      "--resolution", str(RES)]) == 0
    assert sorted(read_output(out)) == ["coco_1", "coco_2", "coco_3", "coco_7"]
    assert "person_height_fraction" not in read_output(out)["coco_1"][1]
    assert summary(out, "01d_download_coco")["dropped"] == {"missing_image": 1, "no_caption": 1, "undecodable": 1}

    strict = tmp_path / "strict"  # image 7's person is 0.56 of its height, image 1's 0.70
    assert COCO.main(["--images", str(folder), "--captions", str(tmp_path / "captions.json"), "--out", str(strict),
                      "--instances", str(tmp_path / "instances.json"), "--person_filter",
                      "--min_person_height", "0.6", "--resolution", str(RES)]) == 0
    assert sorted(read_output(strict)) == ["coco_1"]
    assert summary(strict, "01d_download_coco")["dropped"]["person_too_small"] == 2


def test_coco_person_filter_needs_instances(tmp_path, capsys):
    coco_inputs(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        COCO.main(["--images", str(tmp_path), "--captions", str(tmp_path / "captions.json"),
                   "--out", str(tmp_path / "o"), "--person_filter"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "error: --person_filter needs --instances" in error
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------
# 01d COCO --seg: subject masks from polygons and run-length encodings
# ---------------------------------------------------------------------------------------------


def test_compressed_rle_strings_decode_to_their_hand_computed_counts():
    # Worked by hand from pycocotools' rleToString: 2, 3 and 1 are one group each ("2", "3", "1"); the
    # fourth count is stored as 6 - 3 = 3. 40 is 8 | 1 << 5: "X" (48 + 8 + 0x20, more to come), then "1";
    # the fourth, 5 - 40 = -35, is 29 | -2 << 5: "m" (48 + 29 + 0x20), then "N" (48 + 30, sign bit set).
    assert COCO.rle_string_counts("2313") == [2, 3, 1, 6]
    assert COCO.rle_string_counts("0X1:mN") == [0, 40, 10, 5]
    with pytest.raises(COCO.BadSegmentation, match="ends inside a count"):
        COCO.rle_string_counts("X")


def test_rle_runs_fill_the_columns_first():
    # 3 rows x 4 columns, column-major runs: 2 zeros, 3 ones, 1 zero, 6 ones. Column 0 is 0, 0, 1; column
    # 1 is 1, 1, 0; columns 2 and 3 are ones.
    expected = np.array([[0, 1, 1, 1],
                         [0, 1, 1, 1],
                         [1, 0, 1, 1]], dtype=np.uint8)
    assert np.array_equal(COCO.rle_mask([2, 3, 1, 6], 3, 4), expected)
    with pytest.raises(COCO.BadSegmentation, match="cover 11 pixels, not 3x4"):
        COCO.rle_mask([2, 3, 1, 5], 3, 4)


def rle_counts(mask: np.ndarray) -> list[int]:
    """COCO's runs of a 0/1 mask: column-major, alternating from a run of zeros (possibly empty)."""
    flat = mask.T.reshape(-1)
    changes = np.flatnonzero(np.diff(flat)) + 1
    runs = np.diff(np.concatenate([[0], changes, [len(flat)]])).tolist()
    return ([0] if flat[0] else []) + runs


def rle_string(counts: list[int]) -> str:
    """pycocotools' rleToString, written out for the test."""
    text = []
    for i, count in enumerate(counts):
        value = count - counts[i - 2] if i > 2 else count
        more = True
        while more:
            group = value & 0x1F
            value >>= 5
            more = value != -1 if group & 0x10 else value != 0
            text.append(chr(48 + (group | 0x20 if more else group)))
    return "".join(text)


def test_coco_seg_writes_the_union_of_the_person_instances_cut_as_the_image(tmp_path):
    import cv2

    pictures, _ = coco_inputs(tmp_path)
    folder = tmp_path / "train2017"
    folder.mkdir()
    for i, data in pictures.items():
        (folder / f"{i:012d}.jpg").write_bytes(data)
    # Image 1 (60 wide, 100 high): a person of two polygons and one as a compressed RLE; image 7 (70 x 90):
    # one crowd region as a plain RLE; image 3: only a dog; image 2: an RLE of the wrong size.
    triangle, square = [5, 10, 40, 12, 20, 60], [30, 70, 50, 70, 50, 95, 30, 95]
    block = np.zeros((100, 60), dtype=np.uint8)
    block[4:20, 44:58] = 1
    crowd = np.zeros((90, 70), dtype=np.uint8)
    crowd[50:90, 0:35] = 1
    instances = json.loads((tmp_path / "instances.json").read_text())
    person = lambda i, segmentation, crowd=0: {"image_id": i, "category_id": 1, "bbox": [0, 0, 10, 90],  # noqa: E731
                                               "iscrowd": crowd, "segmentation": segmentation}
    instances["annotations"] = [
        person(1, [triangle, square]),
        person(1, {"counts": rle_string(rle_counts(block)), "size": [100, 60]}),
        person(7, {"counts": rle_counts(crowd), "size": [90, 70]}, crowd=1),
        {"image_id": 3, "category_id": 18, "bbox": [0, 0, 50, 70], "iscrowd": 0, "segmentation": [[0, 0, 50, 0, 50, 70]]},
        person(2, {"counts": [8000], "size": [80, 100]})]
    (tmp_path / "instances.json").write_text(json.dumps(instances))
    out = tmp_path / "seg"
    assert COCO.main(["--images", str(folder), "--captions", str(tmp_path / "captions.json"), "--out", str(out),
                      "--instances", str(tmp_path / "instances.json"), "--seg", "--resolution", str(RES)]) == 0

    shard, _ = sd.data.shards.read_shard((out / "00000.tar").read_bytes())
    segs = {s.key: cv2.imdecode(np.frombuffer(s.controls["seg"], np.uint8), cv2.IMREAD_UNCHANGED) for s in shard}
    assert sorted(segs) == ["coco_1", "coco_3", "coco_7"]  # coco_2's RLE is not of its image's size
    assert summary(out, "01d_download_coco")["dropped"]["bad_segmentation"] == 1
    drawn = np.zeros((100, 60), dtype=np.uint8)
    for polygon in (triangle, square):
        cv2.fillPoly(drawn, [np.array(polygon, dtype=np.int32).reshape(-1, 2)], 255)
    drawn[block == 1] = 255
    assert np.array_equal(segs["coco_1"], sd.data.shards.resize_center_crop(drawn, RES))
    assert np.array_equal(segs["coco_7"], sd.data.shards.resize_center_crop(crowd * np.uint8(255), RES))
    assert segs["coco_3"].shape == (RES, RES) and not segs["coco_3"].any()  # a dog is not the subject
    meta = {s.key: json.loads(s.metadata) for s in shard}
    assert [meta[k]["seg_instances"] for k in ("coco_1", "coco_3", "coco_7")] == [3, 0, 1]


def test_coco_seg_needs_instances(tmp_path, capsys):
    coco_inputs(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        COCO.main(["--images", str(tmp_path), "--captions", str(tmp_path / "captions.json"),
                   "--out", str(tmp_path / "o"), "--seg"])
    assert exit_info.value.code == 2 and "error: --seg needs --instances" in capsys.readouterr().err

"""pipeline/01e_import_folder.py: local folders (flat, metadata, template layouts) -> image shards."""

import importlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import sd.data.shards

from shard_factory import image_bytes, random_image

ROOT = Path(__file__).resolve().parents[2]
stage = importlib.import_module("pipeline.01e_import_folder")
RES = ["--resolution", "64"]


def write_image(path: Path, rng, width: int, height: int, fmt: str = "PNG") -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = image_bytes(random_image(rng, height, width), fmt)
    path.write_bytes(data)
    return data


def write_tags(path: Path, tags, score=None) -> None:
    record = {"tags": tags, "id": 1}
    if score is not None:
        record["score"] = score
    path.write_text(json.dumps(record))


def read_output(out: Path) -> dict[str, dict]:
    """key -> caption, metadata, decoded image size and shard name, in shard order."""
    samples = {}
    for tar in sorted(out.glob("*.tar")):
        shard, truncated = sd.data.shards.read_shard(tar.read_bytes())
        assert truncated is None
        for sample in shard:
            size = Image.open(io.BytesIO(sample.image)).size
            samples[sample.key] = {"caption": sample.caption, "meta": json.loads(sample.metadata),
                                   "size": size, "ext": sample.image_ext, "shard": tar.name}
    return samples


def stats(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*_stats.json"))]


def summary(out: Path) -> dict:
    return json.loads((out / "01e_import_folder_summary.json").read_text())


# ---------------------------------------------------------------------------------------------
# flat layout
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flat_src(tmp_path_factory):
    src = tmp_path_factory.mktemp("flat")
    rng = np.random.default_rng(0)
    write_image(src / "one.png", rng, 96, 64)
    (src / "one.txt").write_text("a red square\n")
    write_image(src / "two.jpg", rng, 64, 64, "JPEG")
    (src / "two.txt").write_text("   \n")  # empty caption
    write_image(src / "three.png", rng, 64, 80)  # no caption file
    write_image(src / "nested" / "deeper" / "img.01.png", rng, 70, 100)
    (src / "nested" / "deeper" / "img.01.txt").write_text("nested caption")
    write_image(src / "big.png", rng, 300, 200)  # 60000 pixels, over --max_pixels 50000
    (src / "big.txt").write_text("too big")
    jpeg = image_bytes(random_image(rng, 64, 64), "JPEG")
    (src / "broken.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    (src / "broken.txt").write_text("cut off")
    write_image(src / ".hidden.png", rng, 64, 64)  # ignored: hidden
    write_image(src / ".ipynb_checkpoints" / "one-checkpoint.png", rng, 64, 64)  # ignored: hidden folder
    (src / "notes.md").write_text("not an image")
    return src


@pytest.fixture(scope="module")
def flat_run(flat_src, tmp_path_factory):
    out = tmp_path_factory.mktemp("flat_out") / "shards"
    argv = ["--input", str(flat_src), "--out", str(out), "--shard_size", "2", "--max_pixels", "50000", *RES]
    assert stage.main(argv) == 0
    return out, argv


def test_flat_layout_captions_keys_and_sizes(flat_run):
    out, _ = flat_run
    samples = read_output(out)
    assert list(samples) == ["nested__deeper__img_01", "one"]
    assert samples["one"]["caption"] == "a red square"
    assert samples["nested__deeper__img_01"]["caption"] == "nested caption"
    assert all(s["size"] == (64, 64) and s["ext"] == "jpg" for s in samples.values())
    meta = samples["one"]["meta"]
    assert (meta["source"], meta["original_width"], meta["original_height"]) == ("one.png", 96, 64)
    assert samples["nested__deeper__img_01"]["meta"]["source"] == "nested/deeper/img.01.png"
    assert samples["nested__deeper__img_01"]["meta"]["original_height"] == 100


def test_flat_layout_shard_split_and_skip_counts(flat_run):
    out, _ = flat_run
    # Sorted paths: big, broken | nested/deeper/img.01, one | three, two (.hidden.png ignored).
    assert sorted(p.name for p in out.glob("*.tar")) == ["00000.tar", "00001.tar", "00002.tar"]
    records = stats(out)
    assert [(r["count"], r["successes"], r["failed"]) for r in records] == [
        (2, 0, {"too_large": 1, "truncated_image": 1}),
        (2, 2, {}),
        (2, 0, {"no_caption": 2}),
    ]
    assert records[0]["examples"] == {"too_large": ["big.png"], "truncated_image": ["broken.jpg"]}
    assert records[2]["examples"] == {"no_caption": ["three.png", "two.jpg"]}
    assert read_output(out)["one"]["shard"] == "00001.tar"
    total = summary(out)
    assert total["kept"] == 2 and total["images"] == 6
    assert total["dropped"] == {"no_caption": 2, "too_large": 1, "truncated_image": 1}
    assert total["shards_written"] == 3


def test_rerun_is_a_noop(flat_run):
    out, argv = flat_run
    files = sorted(p for p in out.iterdir() if not p.name.endswith("_summary.json"))
    before = {p.name: p.stat().st_mtime_ns for p in files}
    assert stage.main(argv) == 0
    assert {p.name: p.stat().st_mtime_ns for p in sorted(out.iterdir()) if p in files} == before
    assert sorted(p.name for p in out.iterdir()) == sorted(before) + ["01e_import_folder_summary.json"]
    total = summary(out)
    assert (total["shards_written"], total["shards_already_done"], total["kept"]) == (0, 3, 2)
    assert total["dropped"] == {"no_caption": 2, "too_large": 1, "truncated_image": 1}


def test_a_rerun_with_other_options_into_the_same_folder_is_refused(flat_run, capsys):
    out, argv = flat_run
    assert stage.main([*argv, "--default_caption", "a photo"]) == 2
    assert "different options" in capsys.readouterr().err


def test_interrupted_run_resumes_only_missing_shards(flat_src, tmp_path):
    out = tmp_path / "shards"
    argv = ["--input", str(flat_src), "--out", str(out), "--shard_size", "2", "--max_pixels", "50000", *RES]
    assert stage.main(argv) == 0
    (out / "00001_stats.json").unlink()  # as if killed between the tar and its done marker
    kept_tar = (out / "00000.tar").stat().st_mtime_ns
    assert stage.main(argv) == 0
    total = summary(out)
    assert (total["shards_written"], total["shards_already_done"], total["kept"]) == (1, 2, 2)
    assert (out / "00000.tar").stat().st_mtime_ns == kept_tar
    assert list(read_output(out)) == ["nested__deeper__img_01", "one"]


def test_tiny_images_are_skipped_not_upscaled_and_the_console_names_the_first_skipped(tmp_path, capsys):
    src, rng = tmp_path / "src", np.random.default_rng(1)
    for name, side in (("icon", 12), ("thumb", 15), ("photo", 40), ("small", 16)):
        write_image(src / f"{name}.png", rng, side, side + 4)
        (src / f"{name}.txt").write_text(f"a {name}")
    write_image(src / "nocap.png", rng, 40, 40)
    out = tmp_path / "out"
    assert stage.main(["--input", str(src), "--out", str(out), *RES]) == 0  # at 64 px the minimum is 16
    assert sorted(read_output(out)) == ["photo", "small"]
    assert summary(out)["dropped"] == {"no_caption": 1, "too_small": 2}
    assert summary(out)["examples"] == {"no_caption": ["nocap.png"], "too_small": ["icon.png", "thumb.png"]}
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "no_caption 1 (nocap.png)" in line and "too_small 2 (icon.png, thumb.png)" in line
    # Another minimum is another import: refused into the same folder, accepted into a fresh one.
    assert stage.main(["--input", str(src), "--out", str(out), "--min_size", "0", *RES]) == 2
    assert "different options" in capsys.readouterr().err
    assert stage.main(["--input", str(src), "--out", str(tmp_path / "all"), "--min_size", "0", *RES]) == 0
    assert sorted(read_output(tmp_path / "all")) == ["icon", "photo", "small", "thumb"]
    # The default written out is the same import: a resume, not a refusal.
    assert stage.main(["--input", str(src), "--out", str(out), "--min_size", "16", *RES]) == 0


def test_a_folder_of_which_nothing_is_kept_fails_with_the_reason_and_the_fix(tmp_path, capsys):
    """32 images of 100 px at the default --resolution 512 (all under its 128 px minimum) once exited 0 with
    nothing imported; now 1, naming the reason, examples and the flag to change, with no shard left behind,
    so the command with the fix runs in the same --out."""
    src, rng = tmp_path / "src", np.random.default_rng(3)
    for index in range(32):
        write_image(src / f"p{index:02d}.png", rng, 100, 100)
        (src / f"p{index:02d}.txt").write_text("a photo")
    out = tmp_path / "out"
    assert stage.main(["--input", str(src), "--out", str(out)]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("01e_import_folder.py: error: kept nothing: too_small 32 (p00.png")
    assert "under 128 px" in error and "--resolution" in error and "--min_size 0" in error
    assert not list(out.glob("*.tar")) and not list(out.glob("*_stats.json"))
    assert summary(out)["kept"] == 0
    assert stage.main(["--input", str(src), "--out", str(out), *RES]) == 0
    assert len(read_output(out)) == 32


def test_the_console_names_at_most_three_skipped_files_per_reason(tmp_path, capsys):
    src, rng = tmp_path / "src", np.random.default_rng(2)
    for index in range(5):
        write_image(src / f"u{index}.png", rng, 40, 40)
    write_image(src / "z.png", rng, 40, 40)  # one kept: a stage that keeps nothing fails
    (src / "z.txt").write_text("a photo")
    out = tmp_path / "out"
    assert stage.main(["--input", str(src), "--out", str(out), "--shard_size", "2", *RES]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "no_caption 5 (u0.png, u1.png, u2.png, ...)" in line
    assert summary(out)["examples"]["no_caption"] == [f"u{index}.png" for index in range(5)]


def test_default_caption_fills_missing_and_empty_captions(flat_src, tmp_path):
    out = tmp_path / "shards"
    assert stage.main(["--input", str(flat_src), "--out", str(out), "--default_caption", "a photo",
                       "--caption_prefix", "sks, ", *RES]) == 0
    samples = read_output(out)
    assert {key: s["caption"] for key, s in samples.items()} == {
        "big": "sks, too big", "nested__deeper__img_01": "sks, nested caption", "one": "sks, a red square",
        "three": "sks, a photo", "two": "sks, a photo"}
    assert summary(out)["dropped"] == {"truncated_image": 1}
    assert samples["big"]["meta"]["original_width"] == 300


# ---------------------------------------------------------------------------------------------
# metadata layout
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def meta_src(tmp_path_factory):
    src = tmp_path_factory.mktemp("meta")
    rng = np.random.default_rng(1)
    write_image(src / "a.png", rng, 64, 96)
    write_tags(src / "a.json", ["1girl", "solo", "red hair", "smile", "watermark"], 7.5)
    write_image(src / "b.jpg", rng, 64, 64, "JPEG")
    write_tags(src / "b.json", ["1boy", "gore"], 9)
    write_image(src / "c.png", rng, 64, 64)
    write_tags(src / "c.json", ["cat"], 3.0)
    write_image(src / "d.png", rng, 64, 64)
    write_tags(src / "d.json", ["dog", "masterpiece"], 3.0)  # rescued: 3 + 3 bonus = 6
    write_image(src / "e.png", rng, 64, 64)
    write_tags(src / "e.json", ["tree"])  # no score
    png = image_bytes(random_image(rng, 64, 64), "PNG")
    (src / "g.png").write_bytes(png[: len(png) // 2])
    write_tags(src / "g.json", ["x"], 8)
    (src / "h.jpg").write_bytes(b"this is not a jpeg" * 10 + b"\xff\xd9")
    write_tags(src / "h.json", ["y"], 8)
    write_image(src / "i.png", rng, 64, 64)  # no metadata file
    write_image(src / "j.png", rng, 64, 64)
    write_tags(src / "j.png.json", ["bird", "gore_free"], 5)  # exactly --min_score; gallery-dl naming
    write_image(src / "sub" / "f.png", rng, 128, 64)
    write_tags(src / "sub" / "f.json", ["sky", "long hair", "long_hair"], 12)  # score_9 (clamped)
    write_image(src / "k.png", rng, 64, 64)
    write_tags(src / "k.json", ["watermark", "solo"], 8)  # no tag left after the map and --drop_tags
    (src / "tag_map.json").write_text(json.dumps({"red hair": "redhead", "watermark": "", "long hair": "long_hair"}))
    return src


META_FLAGS = ["--layout", "metadata", "--exclude_tags", "gore", "--drop_tags", "solo", "--rename", "smile=smiling",
              "--min_score", "5", "--tag_bonus", "masterpiece=3", "--score_tags", "--shard_size", "4"]


@pytest.fixture(scope="module")
def meta_run(meta_src, tmp_path_factory):
    out = tmp_path_factory.mktemp("meta_out") / "shards"
    argv = ["--input", str(meta_src), "--out", str(out), "--tag_map", str(meta_src / "tag_map.json"),
            *META_FLAGS, *RES]
    assert stage.main(argv) == 0
    return out


def test_metadata_layout_builds_captions_from_tags(meta_run):
    samples = read_output(meta_run)
    assert {key: s["caption"] for key, s in samples.items()} == {
        "a": "score_7, 1girl, redhead, smiling",  # solo dropped, watermark mapped to "", both renamed
        "d": "score_6, dog, masterpiece",  # 3.0 + bonus 3 passes --min_score 5
        "j": "score_5, bird, gore_free",  # only the whole tag "gore" excludes
        "sub__f": "score_9, sky, long_hair",  # "long hair" renamed onto a tag it already has: once
    }
    assert all(s["size"] == (64, 64) for s in samples.values())
    meta = samples["a"]["meta"]
    assert meta["tags"] == ["1girl", "redhead", "smiling"] and meta["score"] == 7.5
    assert (meta["source"], meta["original_width"], meta["original_height"]) == ("a.png", 64, 96)
    assert (samples["d"]["meta"]["score"], samples["d"]["meta"]["source_score"]) == (6.0, 3.0)
    assert samples["sub__f"]["meta"]["source"] == "sub/f.png"


def test_metadata_layout_skip_reasons(meta_run):
    # Sorted: a b c d | e g h i | j k sub/f
    records = stats(meta_run)
    assert [(r["successes"], r["failed"]) for r in records] == [
        (2, {"excluded_tag": 1, "low_score": 1}),
        (0, {"no_metadata": 1, "no_score": 1, "truncated_image": 1, "undecodable": 1}),
        (2, {"no_caption": 1}),
    ]
    assert records[0]["examples"] == {"excluded_tag": ["b.jpg"], "low_score": ["c.png"]}
    assert records[1]["examples"]["no_score"] == ["e.png"]
    total = summary(meta_run)
    assert total["kept"] == 4 and total["layout"] == "metadata"
    assert total["dropped"] == {"excluded_tag": 1, "low_score": 1, "no_caption": 1, "no_metadata": 1,
                                "no_score": 1, "truncated_image": 1, "undecodable": 1}


def test_without_a_bonus_the_low_score_image_is_dropped(meta_src, tmp_path):
    out = tmp_path / "shards"
    flags = [f for f in META_FLAGS if f not in ("--tag_bonus", "masterpiece=3")]
    assert stage.main(["--input", str(meta_src), "--out", str(out), *flags, *RES]) == 0
    assert summary(out)["dropped"]["low_score"] == 2
    assert "d" not in read_output(out)
    # Without the tag map, tags keep their source names (but --rename still applies).
    assert read_output(out)["a"]["caption"] == "score_7, 1girl, red hair, smiling, watermark"


def test_default_caption_replaces_an_empty_tag_list(meta_src, tmp_path):
    out = tmp_path / "shards"
    assert stage.main(["--input", str(meta_src), "--out", str(out), "--layout", "metadata", "--drop_tags", "solo",
                       "--tag_map", str(meta_src / "tag_map.json"), "--default_caption", "anime picture", *RES]) == 0
    samples = read_output(out)
    assert samples["k"]["caption"] == "anime picture" and samples["k"]["meta"]["tags"] == ["anime picture"]
    assert samples["b"]["caption"] == "1boy, gore"
    assert summary(out)["dropped"] == {"no_metadata": 1, "truncated_image": 1, "undecodable": 1}


@pytest.fixture(scope="module")
def shuffle_src(tmp_path_factory):
    src = tmp_path_factory.mktemp("shuffle")
    rng = np.random.default_rng(2)
    write_image(src / "p.png", rng, 64, 64)
    write_tags(src / "p.json", ["first", "second"] + [f"t{i}" for i in range(8)], -1.5)
    write_image(src / "q.png", rng, 64, 64)
    write_tags(src / "q.json", ["first", "second"] + [f"t{i}" for i in range(8)], -1.5)
    return src


TAGS = ["first", "second"] + [f"t{i}" for i in range(8)]


def shuffled_caption(src: Path, out: Path, *flags) -> str:
    assert stage.main(["--input", str(src), "--out", str(out), "--layout", "metadata", "--score_tags",
                       "--caption_prefix", "masterpiece", *flags, *RES]) == 0
    return read_output(out)["p"]["caption"]


def test_shuffled_tags_are_stable_across_runs_and_keep_the_first(shuffle_src, tmp_path):
    plain = shuffled_caption(shuffle_src, tmp_path / "plain")
    assert plain == "masterpiece, score_0, " + ", ".join(TAGS)  # score -1.5 clamps to score_0
    one = shuffled_caption(shuffle_src, tmp_path / "one", "--shuffle_tags")
    two = shuffled_caption(shuffle_src, tmp_path / "two", "--shuffle_tags")
    assert one == two and one != plain
    assert one.startswith("masterpiece, score_0, first, ")
    assert sorted(one.split(", ")[2:]) == sorted(TAGS)
    kept_two = shuffled_caption(shuffle_src, tmp_path / "k2", "--shuffle_tags", "--keep_first", "2")
    assert kept_two.startswith("masterpiece, score_0, first, second, ") and kept_two != plain
    other_seed = shuffled_caption(shuffle_src, tmp_path / "s1", "--shuffle_tags", "--seed", "1")
    assert other_seed != one and sorted(other_seed.split(", ")) == sorted(one.split(", "))
    assert read_output(tmp_path / "one")["p"]["meta"]["tags"] == one.split(", ")[2:]
    # Seeded per key: two images with the same tags get different orders.
    assert read_output(tmp_path / "one")["q"]["caption"] != one


def test_score_tag_omitted_and_no_score_kept_without_min_score(meta_src, tmp_path):
    out = tmp_path / "shards"
    assert stage.main(["--input", str(meta_src), "--out", str(out), "--layout", "metadata", "--score_tags", *RES]) == 0
    samples = read_output(out)
    assert samples["e"]["caption"] == "tree"
    assert samples["b"]["caption"] == "score_9, 1boy, gore"
    assert samples["c"]["caption"] == "score_3, cat"


# ---------------------------------------------------------------------------------------------
# template layout
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def faces_src(tmp_path_factory):
    src = tmp_path_factory.mktemp("root") / "faces"
    rng = np.random.default_rng(3)
    write_image(src / "n000001" / "0001_01.jpg", rng, 80, 100, "JPEG")
    write_image(src / "n000001" / "0002_01.jpg", rng, 80, 100, "JPEG")
    write_image(src / "n000002" / "0001_01.jpg", rng, 90, 90, "JPEG")
    write_image(src / "loose.png", rng, 64, 64)
    (src.parent / "names.json").write_text(json.dumps({"n000001": "Alice Smith"}))
    return src


def test_template_layout_uses_folder_names_and_the_map(faces_src, tmp_path):
    out = tmp_path / "shards"
    assert stage.main(["--input", str(faces_src), "--out", str(out), "--layout", "template",
                       "--template", "a photo of {folder}", "--template_map", str(faces_src.parent / "names.json"),
                       *RES]) == 0
    samples = read_output(out)
    assert {key: s["caption"] for key, s in samples.items()} == {
        "loose": "a photo of faces",  # at the top level the folder is --src itself
        "n000001__0001_01": "a photo of Alice Smith",
        "n000001__0002_01": "a photo of Alice Smith",
        "n000002__0001_01": "a photo of n000002",
    }
    assert samples["n000001__0001_01"]["meta"]["folder"] == "n000001"
    assert samples["n000002__0001_01"]["meta"]["original_width"] == 90
    assert all(s["size"] == (64, 64) for s in samples.values())


def test_template_layout_default_template(faces_src, tmp_path):
    out = tmp_path / "shards"
    assert stage.main(["--input", str(faces_src), "--out", str(out), "--layout", "template", *RES]) == 0
    assert {s["caption"] for s in read_output(out).values()} == {"a photo of a person"}
    assert summary(out)["kept"] == 4 and summary(out)["dropped"] == {}


# ---------------------------------------------------------------------------------------------
# --keep_aspect
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def aspect_src(tmp_path_factory):
    src = tmp_path_factory.mktemp("aspect")
    rng = np.random.default_rng(4)
    write_image(src / "square.png", rng, 90, 90)
    write_image(src / "tall.png", rng, 100, 160)
    write_image(src / "wide.jpg", rng, 200, 100, "JPEG")
    # 20000 x 10: its short side at 64 px would make a 128000 x 64 image; refused from the header.
    (src / "strip.png").write_bytes(image_bytes(np.zeros((10, 20000, 3), np.uint8), "PNG"))
    return src


def import_aspect(src: Path, out: Path, *flags) -> int:
    return stage.main(["--input", str(src), "--out", str(out), "--default_caption", "a photo", *flags, *RES])


# key -> (width, height) written at 64 px; the originals are 90x90, 100x160 and 200x100.
SIZES = {None: {"square": (64, 64), "tall": (64, 64), "wide": (64, 64)},
         "short": {"square": (64, 64), "tall": (64, 102), "wide": (128, 64)},  # 160 * 64 / 100 = 102.4
         "long": {"square": (64, 64), "tall": (40, 64), "wide": (64, 32)}}


@pytest.mark.parametrize("flags, mode", [([], None), (["--keep_aspect"], "short"), (["--keep_aspect", "long"], "long")])
def test_keep_aspect_scales_the_whole_image_by_its_short_or_long_side(aspect_src, tmp_path, flags, mode):
    out = tmp_path / "shards"
    assert import_aspect(aspect_src, out, *flags) == 0
    samples = read_output(out)
    assert {key: s["size"] for key, s in samples.items()} == SIZES[mode]
    for key, original in {"square": (90, 90), "tall": (100, 160), "wide": (200, 100)}.items():
        meta = samples[key]["meta"]
        assert (meta["original_width"], meta["original_height"]) == original
        assert (meta["width"], meta["height"]) == SIZES[mode][key]
    assert summary(out)["dropped"] == {"extreme_aspect": 1} and summary(out)["keep_aspect"] == mode
    if mode == "short":  # the whole width is kept: the left and right edges are the original's
        wide = sd.data.shards.decode_image((aspect_src / "wide.jpg").read_bytes(), "jpg")
        tar = sd.data.shards.read_shard((out / "00000.tar").read_bytes())[0]
        written = sd.data.shards.decode_image(next(s.image for s in tar if s.key == "wide"), "jpg")
        expected = sd.data.shards.resize_keep_aspect(wide, 64).astype(int)
        assert np.abs(written.astype(int) - expected).mean() < 8  # JPEG noise only


def test_a_rerun_with_another_keep_aspect_is_refused_like_another_resolution(aspect_src, tmp_path, capsys):
    out = tmp_path / "shards"
    assert import_aspect(aspect_src, out, "--keep_aspect") == 0
    assert import_aspect(aspect_src, out, "--keep_aspect", "short") == 0  # the same setting: a no-op
    assert summary(out)["shards_already_done"] == 1
    for flags in (["--keep_aspect", "long"], []):
        assert import_aspect(aspect_src, out, *flags) == 2
        assert "different options" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# keys and the command line
# ---------------------------------------------------------------------------------------------


def test_keys_are_unique_dotless_and_short():
    long = "x" * 150 + ".png"
    rels = ["a/b.png", "a/b.jpg", "a_b.png", "sub/dir/img.01.png", "é t.png", long]
    keys = stage.make_keys(rels)
    assert keys[2:5] == ["a_b", "sub__dir__img_01", "é_t"]
    assert keys[0].startswith("a__b_") and keys[1].startswith("a__b_") and keys[0] != keys[1]
    assert len(keys[5].encode()) <= stage.MAX_KEY_BYTES and keys[5].startswith("x" * 60)
    assert len(set(keys)) == len(keys) and not any("." in k or "/" in k for k in keys)
    # Pinned: a file keeps its key across runs and machines (the suffix is SHA-1 of the path).
    assert keys[:2] == ["a__b_7f9c894b", "a__b_4cfd2b8c"] and keys[5] == "x" * 70 + "_b656cb64"


def test_file_names_with_line_breaks_or_not_in_utf8_give_keys_every_reader_can_trust(tmp_path):
    src, rng = tmp_path / "src", np.random.default_rng(0)
    names = [b"caf\xe9", "line\u2028sep".encode(), b"new\nline", b"next\xc2\x85line"]  # \xe9: Latin-1, not UTF-8
    try:
        write_image(src / os.fsdecode(b"caf\xe9.png"), rng, 64, 64)
    except OSError:
        pytest.skip("this file system refuses names that are not UTF-8 (macOS's APFS)")
    for name in names:
        write_image(src / os.fsdecode(name + b".png"), rng, 64, 64)
        (src / os.fsdecode(name + b".txt")).write_text("a caption")
    out = tmp_path / "out"
    assert stage.main(["--input", str(src), "--out", str(out), *RES]) == 0
    samples = read_output(out)
    assert sorted(samples) == ["caf_", "line_sep", "new_line", "next_line"]
    assert all(sd.data.shards.is_valid_key(key) for key in samples)
    assert samples["caf_"]["meta"]["source"] == os.fsdecode(b"caf\xe9.png")


def bad_tag_map(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    return str(tmp_path / "bad.json")


@pytest.mark.parametrize("flags, message", [
    ([], "--input"),
    (["--resolution", "60"], "multiple of 8"),
    (["--shard_size", "0"], "--shard_size must be >= 1"),
    (["--layout", "metadata", "--tag_map", "BAD"], "bad.json"),
    (["--layout", "metadata", "--tag_map", "MISSING"], "missing.json"),
    (["--layout", "metadata", "--rename", "nothing"], "OLD=NEW"),
    (["--layout", "metadata", "--tag_bonus", "x=abc"], "is not a number"),
    (["--exclude_tags", "a"], "--exclude_tags does not apply to --layout flat"),
    (["--min_score", "0"], "--min_score does not apply"),
    (["--layout", "metadata", "--template", "x"], "--template does not apply"),
    (["--layout", "template", "--template_map", "BAD"], "bad.json"),
    (["--layout", "metadata", "--keep_first", "-1"], "--keep_first"),
    (["--keep_aspect", "wide"], "--keep_aspect: invalid choice"),
    (["--min_size", "-1"], "--min_size must be >= 0"),
])
def test_bad_command_lines_exit_2_with_one_line_before_any_work(tmp_path, capsys, flags, message):
    flags = [bad_tag_map(tmp_path) if f == "BAD" else str(tmp_path / "missing.json") if f == "MISSING" else f
             for f in flags]
    src = [] if not flags else ["--input", str(tmp_path)]
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        stage.main([*src, "--out", str(out), *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not out.exists()


def test_the_studio_scan_and_01e_skip_the_same_files_for_the_same_reasons(tmp_path):
    """One rule (sd.data.stages.check_import), two readers: 01e and the studio's Data page (sd.studio.data.scan_folder)
    on one folder with a few images each rule skips, some that two rules would (the first in the rules' order names
    it), an undecodable file and some kept."""
    from sd.studio import data

    src, rng = tmp_path / "src", np.random.default_rng(5)
    cases = {  # file: (width, height, the caption file's bytes or None for none), at --resolution 64: at least 16 px
        "kept_a": (64, 64, b"a square"), "kept_b": (96, 64, b"a wide one"), "sub/kept_c": (64, 80, b"a tall one"),
        "latin_a": (64, 64, "caf\xe9".encode("latin-1")), "latin_small": (8, 8, b"\xff\xfe"),
        "nocap_a": (64, 64, None), "nocap_empty": (64, 64, b"  \n"), "nocap_large": (260, 200, None),
        "large_a": (256, 200, b"big"), "large_strip": (1000, 100, b"big and long"),
        "strip_a": (320, 32, b"long"), "strip_b": (40, 400, b"tall"), "strip_small": (200, 10, b"thin"),
        "small_a": (12, 12, b"tiny"), "small_b": (15, 40, b"narrow"),
    }
    for name, (width, height, caption) in cases.items():
        write_image(src / f"{name}.png", rng, width, height)
        if caption is not None:
            (src / f"{name}.txt").write_bytes(caption)
    (src / "garbage.png").write_bytes(b"not an image at all")
    (src / "garbage.txt").write_text("a caption")
    (src / "garbage_nocap.png").write_bytes(b"not an image either")  # the caption's rules come first
    expected = {"bad_caption_encoding": ["latin_a.png", "latin_small.png"],
                "no_caption": ["garbage_nocap.png", "nocap_a.png", "nocap_empty.png", "nocap_large.png"],
                "too_large": ["large_a.png", "large_strip.png"],
                "extreme_aspect": ["strip_a.png", "strip_b.png", "strip_small.png"],
                "too_small": ["small_a.png", "small_b.png"], "undecodable": ["garbage.png"]}
    kept = ["kept_a.png", "kept_b.png", "sub/kept_c.png"]

    out = tmp_path / "out"
    assert stage.main(["--input", str(src), "--out", str(out), "--max_pixels", str(200 * 200), *RES]) == 0
    assert {reason: sorted(names) for reason, names in summary(out)["examples"].items()} == expected
    assert sorted(sample["meta"]["source"] for sample in read_output(out).values()) == kept

    scan = data.scan_folder(src, resolution=64, max_pixels=200 * 200)
    skipped = {}
    for rel, reason in scan.skipped:
        skipped.setdefault(reason, []).append(rel)
    assert {reason: sorted(names) for reason, names in skipped.items()} == expected
    assert scan.images == kept


def test_missing_or_imageless_src_folder_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        stage.main(["--input", str(tmp_path / "nope"), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and "is not a folder" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("no images here")
    assert stage.main(["--input", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "no images" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_help_lists_every_flag_with_its_default():
    result = subprocess.run([sys.executable, "pipeline/01e_import_folder.py", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    flags = ["--input", "--out", "--layout", "--resolution", "--shard_size", "--max_pixels", "--default_caption",
             "--caption_prefix", "--exclude_tags", "--drop_tags", "--tag_map", "--rename", "--min_score",
             "--tag_bonus", "--score_tags", "--shuffle_tags", "--keep_first", "--seed", "--template",
             "--template_map", "--keep_aspect", "--control", "--min_size", "--captions"]
    options = result.stdout.split("options:")[1]
    entries = {entry.split()[0].rstrip(","): " ".join(entry.split())
               for entry in re.split(r"\n  (?=-)", options) if entry.strip()}
    assert sorted(entries) == sorted(["-h", *flags])  # the old spelling --src is accepted, not shown
    for flag in flags:
        assert "(required)" in entries[flag] if flag in ("--input", "--out") else "(default: " in entries[flag], flag

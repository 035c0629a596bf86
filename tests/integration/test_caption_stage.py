"""pipeline/03c_caption_images.py: captions and tags by tiny random-weight models, for a folder and for shards.

The models are nonsense (random weights) except where a known answer is built in: a captioner forced to say
one word (sd/data/tiny_captioners.py) and a tagger whose scores follow the image's mean colour in BGR order.
"""

import importlib
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import sd.data.captioning
import sd.data.shards

from sd.data.tiny_captioners import tiny_blip, tiny_florence, tiny_tagger
from shard_factory import image_bytes

stage = importlib.import_module("pipeline.03c_caption_images")
ROOT = Path(__file__).resolve().parents[2]
COLOURS = {"red": (230, 20, 20), "blue": (20, 20, 230), "green": (40, 250, 40)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("caption_models")
    return {"blip": tiny_blip(root / "blip"), "cat": tiny_blip(root / "cat", force="cat"),
            "florence": tiny_florence(root / "florence"), "florence_a": tiny_florence(root / "florence_a", force="a"),
            "tagger": tiny_tagger(root / "tagger"), "tagger_single": tiny_tagger(root / "tagger_single", batched=False)}


def photo(colour: str, width: int = 48, height: int = 40, fmt: str = "PNG") -> bytes:
    return image_bytes(np.full((height, width, 3), COLOURS[colour], np.uint8), fmt)


def make_folder(root: Path) -> Path:
    """img0..img5 in red, blue, green (sub/ holds the odd ones); img0 has a caption; broken.jpg is cut off."""
    for i, colour in enumerate(["red", "blue", "green", "red", "blue", "green"]):
        path = root / ("sub" if i % 2 else "") / f"img{i}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(photo(colour))
    (root / "img0.txt").write_text("my own caption\n")
    (root / "broken.jpg").write_bytes(photo("red", fmt="JPEG")[:200])
    (root / "img0_mask.png").write_bytes(photo("red"))  # a loss mask: never captioned
    return root


def run(*argv) -> int:
    return stage.main([str(a) for a in argv])


def captions_of(out: Path) -> dict[str, str]:
    return {p.relative_to(out).as_posix(): p.read_text() for p in sorted(out.rglob("*.txt"))}


EXPECTED = {  # the forced captioner says "cat cat cat"; the tagger's tags follow the colours
    "img0.txt": "sks, my own caption\n",
    "img2.txt": "sks, cat cat cat, hatsune miku, long hair, ^_^\n",
    "img4.txt": "sks, cat cat cat, blue theme, long hair, ^_^\n",
    "sub/img1.txt": "sks, cat cat cat, blue theme, long hair, ^_^\n",
    "sub/img3.txt": "sks, cat cat cat, red theme, long hair, ^_^\n",
    "sub/img5.txt": "sks, cat cat cat, hatsune miku, long hair, ^_^\n",
}


def test_folder_captions_known_answer_review_and_import(tmp_path, models):
    src, out = make_folder(tmp_path / "photos"), tmp_path / "captions"
    assert run("--input", src, "--out", out, "--captioner", models["cat"], "--tagger", models["tagger"],
               "--max_length", 3, "--trigger", "sks", "--shard_size", 4, "--batch_size", 3) == 0
    assert captions_of(out) == EXPECTED
    summary = json.loads((out / "03c_caption_images_summary.json").read_text())
    assert summary["kept"] == 6 and summary["dropped"] == {"truncated_image": 1}
    assert summary["examples"]["truncated_image"] == ["broken.jpg"]
    assert sorted(p.name for p in src.rglob("*.txt")) == ["img0.txt"]  # nothing written into the photos' folder
    # The review: one page of six thumbnails with their captions, and the tag counts.
    sheet = Image.open(out / "review" / "sheet_0001.png")
    assert sheet.width > 5 * 256 and not (out / "review" / "sheet_0002.png").exists()
    table = (out / "review" / "tags.csv").read_text().splitlines()  # the tagger's tags: not sks, nor the sentence
    assert table == ["tag,images,share", "^_^,5,0.8333", "long hair,5,0.8333", "blue theme,2,0.3333",
                     "hatsune miku,2,0.3333", "red theme,1,0.1667"]
    # 01e imports the photos with these captions.
    shards = tmp_path / "shards"
    assert importlib.import_module("pipeline.01e_import_folder").main(
        ["--input", str(src), "--out", str(shards), "--captions", str(out), "--resolution", "32", "--min_size", "8"]) == 0
    with tarfile.open(shards / "00000.tar") as tar:
        imported = {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.name.endswith(".txt")}
    assert imported == {name.replace("/", "__"): text.strip() for name, text in EXPECTED.items()}


def test_changed_composition_rewrites_captions_without_the_models(tmp_path, models):
    src, out = make_folder(tmp_path / "photos"), tmp_path / "captions"
    blip = tiny_blip(tmp_path / "cat", force="cat")
    args = ["--input", src, "--out", out, "--captioner", blip, "--tagger", models["tagger"], "--max_length", 3]
    assert run(*args, "--existing", "replace") == 0
    first = captions_of(out)
    parts = {p: p.stat().st_mtime_ns for p in (out / "captioning").glob("*.parquet")}
    for file in blip.iterdir():  # a model that is gone: loading it would fail
        file.unlink()
    assert run(*args, "--existing", "join", "--tags_first", "--min_tag_count", 3, "--drop_tags", "long_hair",
               "--replace_underscores", "false", "--review_pages", 0) == 0
    # Every colour's tag is on 2 images, under --min_tag_count 3; ^_^ is on all six.
    assert captions_of(out)["img0.txt"] == "^_^, my own caption, cat cat cat\n"
    assert captions_of(out)["sub/img1.txt"] == "^_^, cat cat cat\n"
    assert {p: p.stat().st_mtime_ns for p in (out / "captioning").glob("*.parquet")} == parts
    assert first["img0.txt"] == "cat cat cat, red theme, long hair, ^_^\n"
    assert run(*args) == 2  # --existing keep: the parts hold no model output it could use


def test_other_models_are_refused_in_one_line(tmp_path, models, capsys):
    src, out = make_folder(tmp_path / "photos"), tmp_path / "captions"
    assert run("--input", src, "--out", out, "--captioner", "none", "--tagger", models["tagger"]) == 0
    capsys.readouterr()
    assert run("--input", src, "--out", out, "--captioner", "none", "--tagger", models["tagger_single"]) == 2
    error = capsys.readouterr().err.strip()
    assert "--tagger" in error and str(models["tagger"]) in error and len(error.splitlines()) == 1


def test_ranks_resume_and_match_one_process(tmp_path, models):
    src = make_folder(tmp_path / "photos")
    common = ["--input", src, "--captioner", models["blip"], "--tagger", models["tagger"], "--shard_size", 2,
              "--max_length", 4]
    assert run(*common, "--out", tmp_path / "one") == 0
    assert run(*common, "--out", tmp_path / "two", "--rank", 1, "--world_size", 2) == 0
    assert not captions_of(tmp_path / "two")  # rank 0's parts are missing: nothing written yet
    assert sorted(p.stem for p in (tmp_path / "two" / "captioning").glob("*.parquet")) == ["00001", "00003"]
    assert run(*common, "--out", tmp_path / "two", "--rank", 0, "--world_size", 2) == 0
    assert captions_of(tmp_path / "two") == captions_of(tmp_path / "one")
    # A part lost (its done marker gone) is made again, alone, to the same captions.
    (tmp_path / "one" / "captioning" / "00002_stats.json").unlink()
    others = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "one" / "captioning").glob("0000[013].parquet")}
    assert run(*common, "--out", tmp_path / "one") == 0
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "one" / "captioning").glob("0000[013].parquet")} == others
    assert captions_of(tmp_path / "one") == captions_of(tmp_path / "two")


def write_shard(path: Path, samples: list[tuple[str, bytes | None, str | None]]) -> None:
    sd.data.shards.write_shard(path, [sd.data.shards.ShardSample(key, image, "png", caption,
                                                                 json.dumps({"key": key, "caption": caption}).encode())
                                      for key, image, caption in samples])


def read_tar(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def test_shards_get_captions_and_tags_in_place_of_theirs(tmp_path, models):
    shards = tmp_path / "shards"
    shards.mkdir()
    write_shard(shards / "00000.tar", [("a", photo("red"), "old a"), ("b", photo("blue"), ""),
                                      ("bad", b"\x89PNG not an image", "x")])
    write_shard(shards / "00001.tar", [("c", photo("green"), "old c")])
    out = tmp_path / "out"
    args = ["--input", shards / "*.tar", "--out", out, "--captioner", models["cat"], "--tagger", models["tagger"],
            "--max_length", 2, "--existing", "replace"]
    assert run(*args) == 0
    first = read_tar(out / "00000.tar")
    assert first["a.txt"] == b"cat cat, red theme, long hair, ^_^" and first["b.txt"] == b"cat cat, blue theme, long hair, ^_^"
    assert first["a.png"] == photo("red")  # the image's bytes untouched
    meta = json.loads(first["a.json"])
    assert meta == {"key": "a", "caption": "cat cat, red theme, long hair, ^_^", "generated_caption": "cat cat",
                    "tags": ["red theme", "long hair", "^_^"]}
    assert not any(name.startswith("bad.") for name in first)
    stats = json.loads((out / "00000_stats.json").read_text())
    assert stats["successes"] == 2 and stats["failed"] == {"undecodable": 1} and stats["examples"]["undecodable"] == ["bad"]
    assert read_tar(out / "00001.tar")["c.txt"] == b"cat cat, hatsune miku, long hair, ^_^"
    # The same command again writes nothing; another trigger rewrites the shards from the kept parts.
    written = (out / "00000.tar").stat().st_mtime_ns
    assert run(*args) == 0 and (out / "00000.tar").stat().st_mtime_ns == written
    assert run(*args, "--trigger", "sks") == 0
    assert read_tar(out / "00000.tar")["a.txt"] == b"sks, cat cat, red theme, long hair, ^_^"
    # Keeping existing captions: no model runs on a captioned sample.
    kept = tmp_path / "kept"
    assert run("--input", shards / "*.tar", "--out", kept, "--captioner", models["cat"], "--max_length", 1) == 0
    assert read_tar(kept / "00000.tar")["a.txt"] == b"old a" and read_tar(kept / "00000.tar")["b.txt"] == b"cat"


def pil(colour: str, size=(40, 30)) -> Image.Image:
    return Image.new("RGB", size, COLOURS[colour])


def test_captioners_known_answers_and_batches(models):
    cpu, images = torch.device("cpu"), [pil("red"), pil("blue", (30, 50)), pil("green", (64, 64))]
    load = sd.data.captioning.load_captioner
    cat = load(str(models["cat"]), device=cpu, dtype=torch.float32, max_length=4)
    assert cat.caption(images) == ["cat cat cat cat"] * 3
    half = load(str(models["cat"]), device=cpu, dtype=torch.bfloat16, max_length=4)  # images cast as the weights
    assert next(half.model.parameters()).dtype == torch.bfloat16 and half.caption(images) == ["cat cat cat cat"] * 3
    prompted = load(str(models["cat"]), device=cpu, dtype=torch.float32, max_length=2, prompt="a picture of")
    assert prompted.caption(images[:1]) == ["cat cat"]  # the prompt is not part of the caption
    florence = load(str(models["florence_a"]), device=cpu, dtype=torch.float32, max_length=5)
    assert florence.family == "florence2" and florence.prompt == "<DETAILED_CAPTION>"
    assert florence.caption(images) == ["aaaa"] * 3  # the fifth new token is the end its config forces
    with pytest.raises(sd.data.captioning.ModelLoadError, match="task token"):
        load(str(models["florence"]), device=cpu, dtype=torch.float32, prompt="describe this")
    for name in ("blip", "florence"):  # a batch captions each image as it would alone
        model = load(str(models[name]), device=cpu, dtype=torch.float32, max_length=6)
        assert model.caption(images) == [model.caption([image])[0] for image in images]


def test_tagger_reads_bgr_pads_white_and_batches(models):
    batched = sd.data.captioning.load_tagger(str(models["tagger"]))
    single = sd.data.captioning.load_tagger(str(models["tagger_single"]))
    assert batched.batched and not single.batched and batched.size == 32
    images = [pil("red"), pil("blue"), pil("green", (32, 32))]
    found = batched.tag(images)
    assert found == single.tag(images)
    assert [tags[0][0] for tags in found] == ["red_theme", "blue_theme", "hatsune_miku"]
    red = dict((t, s) for t, s, _ in found[0])
    # Padded with white to a 40 x 40 square, a quarter of it white: a wrong channel order or padding would move it
    r, b = [(0.75 * COLOURS["red"][c] + 0.25 * 255) / 255 for c in (0, 2)]
    assert red["red_theme"] == pytest.approx(1 / (1 + np.exp(-(12 * (r - b) - 3))), abs=0.005)
    assert red["long_hair"] == pytest.approx(0.7311, abs=1e-4) and red["^_^"] == pytest.approx(0.6225, abs=1e-4)
    assert all(s >= sd.data.captioning.TAG_FLOOR for tags in found for _, s, _ in tags)
    assert "sensitive" in red  # 0.12: over the floor, under any threshold


def test_unloadable_models_stop_in_one_line_before_any_output(tmp_path, capsys, monkeypatch):
    src = make_folder(tmp_path / "photos")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for flags, named in ((["--captioner", "someone/no-such-captioner"], "someone/no-such-captioner"),
                         (["--captioner", "none", "--tagger", str(tmp_path / "nothing")], "nothing")):
        out = tmp_path / f"out_{len(flags)}"
        assert run("--input", src, "--out", out, *flags) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("03c_caption_images.py")]
        assert len(lines) == 1 and named in lines[0] and "local folder" in lines[0]
        assert not out.exists()  # nothing written, not even the folder


def test_command_line_refusals(tmp_path, capsys):
    src = make_folder(tmp_path / "photos")
    for flags, message in ((["--captioner", "none"], "at least one model"),
                           (["--threshold", "2"], "--threshold"), (["--rank", "0"], "go together"),
                           (["--out", str(src / "inside")], "inside --input")):
        try:
            code = run("--input", src, "--out", tmp_path / "out", *flags)
        except SystemExit as exit:
            code = exit.code
        assert code == 2 and message in capsys.readouterr().err, flags
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_tagged_captions_reach_a_lora_files_tag_frequency(tmp_path, models):
    """Captioned shards through encode_latents.py, stages 04 and 05: ss_tag_frequency counts the tagger's tags."""
    import encode_latents
    import sd.metadata

    shards = tmp_path / "shards"
    shards.mkdir()
    write_shard(shards / "00000.tar", [(f"k{i}", photo(colour), "") for i, colour in
                                      enumerate(["red", "blue", "green", "red", "red", "blue"])])
    out = tmp_path / "captioned"
    assert run("--input", shards / "*.tar", "--out", out, "--captioner", "none", "--tagger", models["tagger"]) == 0
    assert encode_latents.main(["--input", str(out / "*.tar"), "--out", str(tmp_path / "latents"), "--vae", "tiny",
                                "--resolution", "32", "--batch_size", "4", "--workers", "1"]) == 0
    assert importlib.import_module("pipeline.04_preprocess_to_cache").main(
        ["--input", str(out / "*.tar"), "--out", str(tmp_path / "captions"), "--tokenizer", "tiny"]) == 0
    assert importlib.import_module("pipeline.05_build_hf_dataset").main(
        ["--captions", str(tmp_path / "captions"), "--latents", str(tmp_path / "latents"),
         "--out", str(tmp_path / "dataset"), "--val_fraction", "0"]) == 0
    keys = sd.metadata.dataset_keys({"datasets": [{"dataset": str(tmp_path / "dataset"),
                                                   "latents": str(tmp_path / "latents")}]})
    assert json.loads(keys["ss_tag_frequency"]) == {"dataset": {"long hair": 6, "^_^": 6, "red theme": 3,
                                                                "blue theme": 2, "hatsune miku": 1}}
    table = (out / "review" / "tags.csv").read_text().splitlines()
    assert table[1:] == ["^_^,6,1.0000", "long hair,6,1.0000", "red theme,3,0.5000", "blue theme,2,0.3333",
                         "hatsune miku,1,0.1667"]


def test_the_readme_block_for_photos_without_captions_runs_as_written(tmp_path, models, monkeypatch):
    """The README's commands in a stranger's folder of uncaptioned photos, the hub's models replaced by the tiny
    ones (appended flags override the README's)."""
    from readme_commands import readme_block, run_command

    folder = tmp_path / "my_images"
    folder.mkdir()
    for i, colour in enumerate(["red", "blue", "green"] * 3):
        (folder / f"img{i}.png").write_bytes(photo(colour, 80, 64))
    monkeypatch.chdir(tmp_path)
    commands = readme_block("**Photos without captions.**")
    assert [line.split()[1] for line in commands] == ["pipeline/03c_caption_images.py", "pipeline/01e_import_folder.py"]
    for line in commands:
        run_command(line, {"pipeline/03c_caption_images.py": ["--captioner", str(models["cat"]), "--tagger",
                                                              str(models["tagger"]), "--max_length", "2"],
                           "pipeline/01e_import_folder.py": ["--resolution", "32", "--min_size", "8"]})
    assert (tmp_path / "data/mine/captions_txt/review/sheet_0001.png").is_file()
    assert (tmp_path / "data/mine/captions_txt/img0.txt").read_text() == "cat cat, red theme, long hair, ^_^\n"
    shard = read_tar(tmp_path / "data/mine/shards/00000.tar")
    assert sorted(name for name in shard if name.endswith(".txt")) == [f"img{i}.txt" for i in range(9)]
    assert shard["img1.txt"] == b"cat cat, blue theme, long hair, ^_^"


def test_an_unreadable_shard_is_named_and_the_rest_captioned(tmp_path, models):
    shards = tmp_path / "shards"
    shards.mkdir()
    write_shard(shards / "00000.tar", [("a", photo("red"), "")])
    (shards / "00001.tar").write_text("not a tar")
    out = tmp_path / "out"
    assert run("--input", shards / "*.tar", "--out", out, "--captioner", "none", "--tagger", models["tagger"]) == 0
    assert read_tar(out / "00000.tar")["a.txt"] == b"red theme, long hair, ^_^"
    summary = json.loads((out / "03c_caption_images_summary.json").read_text())
    assert summary["failed_shards"] == {"unreadable_input": ["00001"]} and not (out / "00001.tar").exists()
    write_shard(shards / "00001.tar", [("b", photo("blue"), "")])  # mended: the next run captions it
    assert run("--input", shards / "*.tar", "--out", out, "--captioner", "none", "--tagger", models["tagger"]) == 0
    assert read_tar(out / "00001.tar")["b.txt"] == b"blue theme, long hair, ^_^"
    assert json.loads((out / "03c_caption_images_summary.json").read_text())["failed_shards"] == {}


def test_the_tiny_models_try_the_stage_offline(tmp_path, monkeypatch):
    """--captioner tiny --tagger tiny: built here, no hub (HF_HUB_OFFLINE), a caption for every photo, the tags
    following the colours as the tiny tagger scores them."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src, out = make_folder(tmp_path / "photos"), tmp_path / "captions"
    assert run("--input", src, "--out", out, "--captioner", "tiny", "--tagger", "tiny", "--existing", "replace",
               "--max_length", 4) == 0
    captions = captions_of(out)
    assert sorted(captions) == sorted(EXPECTED) and all(text.strip() for text in captions.values())
    assert "red theme" in captions["sub/img3.txt"] and "blue theme" in captions["img4.txt"]
    assert "red theme" not in captions["img4.txt"]

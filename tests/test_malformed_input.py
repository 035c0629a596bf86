"""Every entry point fed malformed input: each case ends in a skipped-and-counted sample naming the
file, or a one-line error naming the file with exit status 2 and nothing half-written; never a
traceback. Stages are called in-process through their ``main(argv)``."""

import contextlib
import gzip
import importlib
import io
import json
import tarfile
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import encode_latents
import SD_Files
import SD_Pipeline
import SD_Shards
import SD_Tokenizer
from shard_factory import image_bytes, random_image

METADATA = importlib.import_module("pipeline.01_download_metadata")
DIFFUSIONDB = importlib.import_module("pipeline.01b_download_diffusiondb")
JOURNEYDB = importlib.import_module("pipeline.01c_download_journeydb_images")
COCO = importlib.import_module("pipeline.01d_download_coco")
IMPORT_FOLDER = importlib.import_module("pipeline.01e_import_folder")
FILTER = importlib.import_module("pipeline.02_filter_metadata")
DOWNLOAD_IMAGES = importlib.import_module("pipeline.03_download_images")
CAPTIONS = importlib.import_module("pipeline.04_preprocess_to_cache")
DATASET = importlib.import_module("pipeline.05_build_hf_dataset")
RES = 64
HTML = b"<!DOCTYPE html><html><body>404 Not Found</body></html>\n"


def png(seed: int = 0, height: int = 64, width: int = 64) -> bytes:
    return image_bytes(random_image(np.random.default_rng(seed), height, width), "PNG")


def zip_bytes(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def declare_size(archive: bytes, name: str, size: int) -> bytes:
    """Rewrite the uncompressed size the central directory declares for ``name`` (a lying header)."""
    entry = archive.index(b"PK\x01\x02")  # the first central directory entry
    while True:
        name_length = int.from_bytes(archive[entry + 28 : entry + 30], "little")
        if archive[entry + 46 : entry + 46 + name_length] == name.encode():
            return archive[: entry + 24] + size.to_bytes(4, "little") + archive[entry + 28 :]
        entry = archive.index(b"PK\x01\x02", entry + 46)


def stats_of(out, index: int) -> dict:
    return json.loads((out / f"{index:05d}_stats.json").read_text())


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


# ---------------------------------------------------------------------------------------------
# Archive members and files that inflate past their cap
# ---------------------------------------------------------------------------------------------


def test_zip_members_over_the_cap_are_skipped_and_named_before_they_are_read(tmp_path, monkeypatch):
    monkeypatch.setattr(SD_Pipeline, "MAX_MEMBER_BYTES", 1 << 20)
    prompts = {name: {"p": f"prompt of {name}"} for name in ("bomb.png", "good.png", "liar.png")}
    part = zip_bytes({"bomb.png": bytes(4 << 20), "good.png": png(), "liar.png": png(1),
                      "part-000001.json": json.dumps(prompts).encode()})
    part = declare_size(part, "liar.png", 3 << 30)  # says 3 GiB: refused without inflating anything
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "part-000001.zip").write_bytes(part)
    out = tmp_path / "shards"
    assert DIFFUSIONDB.main(["--parts", "1", "--out", str(out), "--base_url", str(tmp_path / "parts"),
                             "--resolution", str(RES), "--workers", "1"]) == 0
    stats = stats_of(out, 1)
    assert (stats["successes"], stats["failed"]) == (1, {"too_large_member": 2})
    assert stats["examples"]["too_large_member"] == ["bomb.png", "liar.png"]


def test_coco_zip_and_folder_images_over_the_cap_are_skipped_and_named(tmp_path, monkeypatch):
    monkeypatch.setattr(SD_Pipeline, "MAX_MEMBER_BYTES", 1 << 20)
    captions = {"images": [{"id": 1, "file_name": "1.png", "height": 64, "width": 64},
                           {"id": 2, "file_name": "2.png", "height": 64, "width": 64}],
                "annotations": [{"id": 10, "image_id": 1, "caption": "one"}, {"id": 11, "image_id": 2, "caption": "two"}]}
    (tmp_path / "captions.json").write_text(json.dumps(captions))
    (tmp_path / "images.zip").write_bytes(zip_bytes({"train2017/1.png": png(), "train2017/2.png": bytes(2 << 20)}))
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "1.png").write_bytes(png())
    (tmp_path / "folder" / "2.png").write_bytes(bytes(2 << 20))
    for source in ("images.zip", "folder"):
        out = tmp_path / f"out_{source}"
        assert COCO.main(["--images", str(tmp_path / source), "--captions", str(tmp_path / "captions.json"),
                          "--out", str(out), "--resolution", str(RES), "--workers", "1"]) == 0
        stats = stats_of(out, 0)
        assert (stats["successes"], stats["failed"], stats["examples"]) == (
            1, {"too_large_member": 1}, {"too_large_member": ["2.png"]})


def test_bounded_reads_stop_at_the_cap():
    archive = zipfile.ZipFile(io.BytesIO(zip_bytes({"big": bytes(5000), "small": b"x" * 10})))
    assert SD_Files.read_zip_member(archive, archive.getinfo("small"), 100) == b"x" * 10
    with pytest.raises(SD_Files.TooLarge, match="big declares 5000 bytes, over the cap of 100"):
        SD_Files.read_zip_member(archive, archive.getinfo("big"), 100)
    bomb = gzip.compress(bytes(10 << 20))  # 10 KB that inflate to 10 MB
    with pytest.raises(SD_Files.TooLarge, match="bomb.gz inflates past the cap of 1048576 bytes"):
        SD_Files.gunzip_bounded(bomb, 1 << 20, "bomb.gz")
    assert SD_Files.gunzip_bounded(gzip.compress(b"abc"), 3) == b"abc"
    with pytest.raises(ValueError, match="truncated"):
        SD_Files.gunzip_bounded(gzip.compress(bytes(1000))[:-12], 1 << 20)


def test_the_tokenizer_refuses_a_bpe_file_that_inflates_past_its_cap(tmp_path, monkeypatch):
    bomb = tmp_path / "bpe.txt.gz"
    bomb.write_bytes(gzip.compress(b"#version\n" + b"a b\n" * (1 << 20)))  # 4 MB of merges
    monkeypatch.setenv("SD_CLIP_BPE", str(bomb))
    monkeypatch.setattr(SD_Tokenizer, "MAX_BPE_TEXT_BYTES", 1 << 20)
    with pytest.raises(SD_Files.TooLarge, match=f"{bomb} inflates past the cap"):
        SD_Tokenizer._read_clip_bpe()


def files_in(folder) -> list[str]:
    return sorted(p.name for p in folder.rglob("*")) if folder.exists() else []


# ---------------------------------------------------------------------------------------------
# Image shards: keys, captions and contents as a tar holds them (encode_latents.py and stage 04)
# ---------------------------------------------------------------------------------------------


def raw_tar(path, members: list[tuple[str, bytes]]) -> None:
    """A tar with exactly these member names, however odd (write_shard would refuse nothing either)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def untrusted_shard(path) -> None:
    good, other = png(1), png(2)
    raw_tar(path, [
        ("good.png", good), ("good.txt", b"a good one"),
        ("../evil.png", good), ("../evil.txt", b"escapes the folder"),
        ("/abs.png", good), ("/abs.txt", b"absolute"),
        ("new\nline.png", good), ("new\nline.txt", b"would split keys.txt"),
        (".png", good), (".txt", b"empty key"),
        ("back\\slash.png", good), ("back\\slash.txt", b"windows path"),
        ("dup.png", good), ("dup.txt", b"first"), ("dup.png", other),
        ("latin.png", good), ("latin.txt", "café".encode("latin-1")),
        ("pngjpg.jpg", other), ("pngjpg.txt", b"a PNG named .jpg"),
        ("html.jpg", HTML), ("html.txt", b"an error page named .jpg"),
    ])
    (path.parent / "00000_stats.json").write_text("{not json")  # encode_latents reads it for its progress bar


BAD_KEYS = ["../evil", "/abs", "new\nline", "", "back\\slash"]


def test_encode_latents_skips_untrusted_keys_and_captions_and_decodes_by_content(tmp_path):
    untrusted_shard(tmp_path / "shards" / "00000.tar")
    out = tmp_path / "latents"
    assert encode_latents.main(["--shards", str(tmp_path / "shards" / "*.tar"), "--out", str(out), "--vae", "tiny",
                                "--resolution", str(RES), "--workers", "1"]) == 0
    assert (out / "00000.keys.txt").read_text().split("\n") == ["good", "pngjpg", ""]
    report = json.loads((out / "00000.report.json").read_text())
    assert report["skipped"] == {"bad_key": BAD_KEYS, "duplicate_key": ["dup"], "bad_caption_encoding": ["latin"],
                                 "undecodable": ["html"]}


def test_stage_04_skips_the_same_samples_with_the_same_reasons(tmp_path):
    untrusted_shard(tmp_path / "shards" / "00000.tar")
    out = tmp_path / "captions"
    assert CAPTIONS.main(["--input", str(tmp_path / "shards" / "*.tar"), "--out", str(out), "--tokenizer", "tiny"]) == 0
    stats = json.loads((out / "00000_stats.json").read_text())
    assert stats["failed"] == {"bad_caption_encoding": 1, "bad_key": 5, "duplicate_key": 1}
    assert sorted(stats["examples"]["bad_key"]) == sorted(BAD_KEYS)
    table = pq.read_table(out / "00000.parquet")
    assert table.column("key").to_pylist() == ["good", "pngjpg", "html"]  # 04 reads no pixels


@pytest.mark.parametrize("entry", ["encode_latents", "04"])
def test_an_unreadable_tar_is_counted_and_named_and_the_others_are_done(tmp_path, entry):
    from shard_factory import clean_shard

    clean_shard(tmp_path / "shards" / "00000.tar", ["k0"], np.random.default_rng(0))
    (tmp_path / "shards" / "00001.tar").mkdir()  # matches the glob, cannot be read
    out = tmp_path / "out"
    if entry == "encode_latents":
        assert encode_latents.main(["--shards", str(tmp_path / "shards" / "*.tar"), "--out", str(out), "--vae",
                                    "tiny", "--resolution", str(RES), "--workers", "1"]) == 0
        meta = json.loads((out / "latents.json").read_text())
        assert (meta["count"], meta["failed_shards"]) == (1, {"unreadable_tar": ["00001.tar"]})
    else:
        assert CAPTIONS.main(["--input", str(tmp_path / "shards" / "*.tar"), "--out", str(out),
                              "--tokenizer", "tiny"]) == 0
        summary = json.loads((out / "04_preprocess_to_cache_summary.json").read_text())
        assert (summary["kept"], summary["failed_shards"]) == (1, {"unreadable_tar": ["00001.tar"]})


# ---------------------------------------------------------------------------------------------
# 01e: a folder of the user's files
# ---------------------------------------------------------------------------------------------


def test_import_folder_counts_bad_caption_encodings_and_reads_images_by_content(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "good.png").write_bytes(png(1))
    (src / "good.txt").write_text("a good one")
    (src / "latin.png").write_bytes(png(2))
    (src / "latin.txt").write_bytes("café au lait".encode("latin-1"))
    (src / "really_png.jpg").write_bytes(png(3))
    (src / "really_png.txt").write_text("a PNG named .jpg")
    (src / "page.jpg").write_bytes(HTML)
    (src / "page.txt").write_text("an error page saved as .jpg")
    out = tmp_path / "shards"
    assert IMPORT_FOLDER.main(["--input", str(src), "--out", str(out), "--resolution", str(RES)]) == 0
    stats = stats_of(out, 0)
    assert (stats["successes"], stats["failed"]) == (2, {"bad_caption_encoding": 1, "undecodable": 1})
    assert stats["examples"] == {"bad_caption_encoding": ["latin.png"], "undecodable": ["page.jpg"]}
    samples, _ = SD_Shards.read_shard((out / "00000.tar").read_bytes())
    assert [s.key for s in samples] == ["good", "really_png"]

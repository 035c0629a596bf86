"""Every entry point fed malformed input: each case ends in a skipped-and-counted sample naming the
file, or a one-line error naming the file with exit status 2 and nothing half-written; never a
traceback. Stages are called in-process through their ``main(argv)``."""

import gzip
import importlib
import io
import json
import zipfile

import numpy as np
import pytest

import SD_Files
import SD_Pipeline
import SD_Tokenizer
from shard_factory import image_bytes, random_image

DIFFUSIONDB = importlib.import_module("pipeline.01b_download_diffusiondb")
COCO = importlib.import_module("pipeline.01d_download_coco")
RES = 64


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

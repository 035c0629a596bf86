import json

import numpy as np
import pytest

import SD_Pipeline
import SD_Shards
from http_server import LoopbackServer
from shard_factory import image_bytes, random_image


def test_download_retries_transient_errors_and_fails_fast_on_404(tmp_path):
    with LoopbackServer({"/a.bin": b"x" * 5000, "/flaky": b"y"},
                        failures={"/a.bin": [503, 500], "/flaky": [503, 502, 503]}) as server:
        path = SD_Pipeline.download(f"{server.url}/a.bin", tmp_path / "a.bin", backoff=0.01)
        assert path.read_bytes() == b"x" * 5000 and server.hits["/a.bin"] == 3
        SD_Pipeline.download(f"{server.url}/a.bin", tmp_path / "a.bin", backoff=0.01)
        assert server.hits["/a.bin"] == 3  # complete files are never fetched again
        with pytest.raises(SD_Pipeline.DownloadError, match="HTTP 404"):
            SD_Pipeline.download(f"{server.url}/missing", tmp_path / "m.bin", backoff=0.01)
        assert server.hits["/missing"] == 1 and not (tmp_path / "m.bin").exists()
        with pytest.raises(SD_Pipeline.DownloadError, match="gave up after 3 tries"):
            SD_Pipeline.download(f"{server.url}/flaky", tmp_path / "f.bin", retries=2, backoff=0.01)
        assert server.hits["/flaky"] == 3 and not (tmp_path / "f.bin").exists()


def test_download_resumes_a_partial_file(tmp_path):
    body = bytes(range(256)) * 40
    (tmp_path / "b.bin.part").write_bytes(body[:1000])
    with LoopbackServer({"/b.bin": body}) as server:
        SD_Pipeline.download(f"{server.url}/b.bin", tmp_path / "b.bin")
    assert (tmp_path / "b.bin").read_bytes() == body and not (tmp_path / "b.bin.part").exists()


def test_archive_member_paths_stay_inside_the_target(tmp_path):
    for name in ("images/a.jpg", "a.jpg", "./x/y.png"):
        assert SD_Pipeline.is_safe_member(name)
        assert tmp_path in SD_Pipeline.safe_extract_path(tmp_path, name).parents
    for name in ("../evil.jpg", "x/../../evil.jpg", "/etc/passwd", "C:/x.jpg", "..\\evil.jpg", ""):
        assert not SD_Pipeline.is_safe_member(name)
        with pytest.raises(ValueError, match="unsafe"):
            SD_Pipeline.safe_extract_path(tmp_path, name)


def test_parse_range():
    assert SD_Pipeline.parse_range("1-3,7, 2") == [1, 2, 3, 7]
    for bad in ("3-1", "a", "1-x"):
        with pytest.raises(ValueError):
            SD_Pipeline.parse_range(bad)


def test_image_sample_is_a_square_jpeg_with_metadata():
    data = image_bytes(random_image(np.random.default_rng(0), 300, 200), "PNG")
    sample = SD_Pipeline.image_sample("k1", data, "png", "a cat", 64, {"source": "test"})
    rgb = SD_Shards.decode_image(sample.image, "jpg")
    assert rgb.shape == (64, 64, 3) and sample.caption == "a cat" and sample.image_ext == "jpg"
    meta = json.loads(sample.metadata)
    assert (meta["original_width"], meta["original_height"], meta["source"]) == (200, 300, "test")
    with pytest.raises(SD_Shards.ImageSkip):
        SD_Pipeline.image_sample("k2", b"not an image\xff\xd9", "jpg", "x", 64)


def test_write_shard_marks_done_last_and_summary_adds_up(tmp_path):
    stats = SD_Pipeline.ShardStats()
    stats.skip("undecodable", "bad.jpg")
    samples = [SD_Shards.ShardSample("k0", b"\xff\xd8\xff\xd9", "jpg", "c", b"{}")]
    record = SD_Pipeline.write_shard(tmp_path, 3, samples, stats, source="x")
    assert SD_Pipeline.shard_done(tmp_path, 3) and not SD_Pipeline.shard_done(tmp_path, 2)
    assert record == {"count": 2, "successes": 1, "failed": {"undecodable": 1},
                      "examples": {"undecodable": ["bad.jpg"]}, "source": "x"}
    read, truncated = SD_Shards.read_shard((tmp_path / "00003.tar").read_bytes())
    assert truncated is None and [s.key for s in read] == ["k0"]
    summary = SD_Pipeline.Summary("test")
    summary.add_done(tmp_path / "00003_stats.json")
    result = summary.finish(tmp_path)
    assert (result["kept"], result["dropped"], result["shards_already_done"]) == (1, {"undecodable": 1}, 1)
    assert json.loads((tmp_path / "test_summary.json").read_text())["kept"] == 1

"""Data stages 00-03 (and 04, 05) on a full disk: one line on stderr and exit status 1, no temporary left,
the outputs finished before it intact, and the same command afterwards goes on from them."""

import errno
import importlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import sd.data.stages
import sd.files

import test_pipeline_sources as sources
from http_server import LoopbackServer
from test_pipeline_laion import laion_inputs, laion_row, write_parquet

pytestmark = pytest.mark.slow  # each stage run twice: kept out of make check


def stage(name: str):
    return importlib.import_module(f"pipeline.{name}")


def images_folder(root: Path) -> Path:
    rng = np.random.default_rng(0)
    for i in range(4):
        Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(root / f"img{i}.png")
        (root / f"img{i}.txt").write_text(f"picture {i}")
    return root


def demo_shards(root: Path) -> Path:
    assert stage("00_make_demo_data").main(["--out", str(root), "--count", "8", "--shard_size", "4", "--size", "32"]) == 0
    return root


def metadata_folder(root: Path) -> Path:
    for part in range(2):
        write_parquet(root / f"part-0000{part}.parquet", [laion_row(f"u/{part}/{i}", "x") for i in range(3)])
    return root


# stage, its command line for (input folder, output folder), what the input folder needs, the second output
CASES = {
    "00_make_demo_data": (lambda src, out: ["--out", str(out), "--count", "8", "--shard_size", "4", "--size", "32"],
                          None, "00001.tar"),
    "01_download_metadata": (lambda src, out: ["--out", str(out), "--local_dir", str(src)], metadata_folder,
                             "part-00001.parquet"),
    "01e_import_folder": (lambda src, out: ["--input", str(src), "--out", str(out), "--shard_size", "2",
                                            "--resolution", "32"], images_folder, "00001.tar"),
    "02_filter_metadata": (lambda src, out: ["--input", str(src / "*.parquet"), "--out", str(out)],
                           lambda root: laion_inputs(root).parent / "meta", "part-00001.parquet"),
    "03b_derive_control": (lambda src, out: ["--input", str(src / "*.tar"), "--out", str(out), "--kind", "canny"],
                           demo_shards, "00001.tar"),
}


def check_a_full_disk(name: str, argv: list[str], out: Path, second: str, monkeypatch, capsys) -> None:
    """Stage ``name`` run with ``argv`` while the disk fills at its output ``second``, then again with space."""
    original = sd.files.write_atomic

    def on_a_full_disk(path, write):
        if Path(path).name != second:
            return original(path, write)

        def fills_the_disk(tmp):
            write(tmp)  # part of it was written, then the disk was full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(path, fills_the_disk)

    monkeypatch.setattr(sd.files, "write_atomic", on_a_full_disk)
    capsys.readouterr()
    assert stage(name).main(argv) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"{name}.py: error: the disk is full") and "run the same command again" in last
    assert not [p for p in out.rglob(".*")], "a temporary is left"
    assert not (out / second).exists()
    kept = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and "_downloads" not in p.parts}  # archives go
    assert kept, "the output finished before the disk was full is kept"
    monkeypatch.setattr(sd.files, "write_atomic", original)  # space freed
    assert stage(name).main(argv) == 0
    assert (out / second).exists() and all(p.read_bytes() == data for p, data in kept.items())
    summary = json.loads(next(out.glob("*_summary.json")).read_text())
    assert summary["shards_already_done"] >= 1


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_full_disk_ends_the_stage_in_one_line_and_the_same_command_goes_on(name, tmp_path, monkeypatch, capsys):
    argv_of, make_input, second = CASES[name]
    src = tmp_path / "src"
    src.mkdir()
    if make_input is not None:
        src = make_input(src)
    out = tmp_path / "out"
    check_a_full_disk(name, argv_of(src, out), out, second, monkeypatch, capsys)


@pytest.mark.parametrize("name", ["01b_download_diffusiondb", "01c_download_journeydb_images", "01d_download_coco"])
def test_a_full_disk_ends_a_download_stage_in_one_line_and_the_same_command_goes_on(name, tmp_path, monkeypatch,
                                                                                   capsys):
    out = tmp_path / "out"
    if name == "01b_download_diffusiondb":
        routes, _ = sources.diffusiondb_parts()
        argv = lambda url: ["--parts", "1,4", "--out", str(out), "--base_url", f"{url}/images", "--resolution",
                            "32", "--retries", "0"]  # noqa: E731
        second = "00004.tar"
    elif name == "01c_download_journeydb_images":
        archive0, archive1, jsonl, _ = sources.journeydb_inputs()
        routes = {"/imgs/000.tgz": archive0, "/imgs/001.tgz": archive1,
                  "/anno.jsonl.tgz": sources.tgz_bytes({"train_anno.jsonl": jsonl})}
        argv = lambda url: ["--archives", "0-1", "--annotations", f"{url}/anno.jsonl.tgz", "--out", str(out),
                            "--base_url", f"{url}/imgs", "--resolution", "32", "--retries", "0"]  # noqa: E731
        second = "00001.tar"
    else:
        pictures, _ = sources.coco_inputs(tmp_path)
        routes = {"/zips/train2017.zip": sources.zip_bytes({f"train2017/{i:012d}.jpg": data
                                                            for i, data in pictures.items()})}
        argv = lambda url: ["--images", f"{url}/zips/train2017.zip", "--captions", str(tmp_path / "captions.json"),
                            "--out", str(out), "--shard_size", "3", "--resolution", "32"]  # noqa: E731
        second = "00001.tar"
    with LoopbackServer(routes) as server:
        check_a_full_disk(name, argv(server.url), out, second, monkeypatch, capsys)


def test_a_download_on_a_full_disk_is_not_retried_as_a_failed_download(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(sd.data.stages, "_fetch", full)
    slept = []
    monkeypatch.setattr(sd.data.stages.time, "sleep", slept.append)
    with pytest.raises(OSError) as error:
        sd.data.stages.download("http://127.0.0.1:9/x", tmp_path / "x", retries=3)
    assert error.value.errno == errno.ENOSPC and slept == []  # no backoff: waiting frees no space


def test_download_images_puts_unfinished_shards_down_to_a_full_disk_when_its_disk_is_full(tmp_path, monkeypatch,
                                                                                          capsys):
    """img2dataset's workers write the shards of stage 03 and report a full disk only in their own log:
    the stage says so when the shards did not finish and the output's disk has (almost) no space left.
    (On a real 24 KiB tmpfs: exit 1 with this line, then, the disk grown, the same command finished all
    five shards.)"""
    import shutil
    from collections import namedtuple

    with LoopbackServer({}) as server:
        write_parquet(tmp_path / "meta" / "part-00000.parquet", [laion_row(f"{server.url}/i{i}", f"c {i}")
                                                                 for i in range(3)])
    stage03 = stage("03_download_images")
    monkeypatch.setattr(stage03, "run_img2dataset", lambda *args, **kwargs: None)  # no shard finishes
    usage = namedtuple("usage", "total used free")
    for free, says_full in ((1 << 30, False), (4096, True)):
        monkeypatch.setattr(shutil, "disk_usage", lambda path, free=free: usage(1 << 40, (1 << 40) - free, free))
        capsys.readouterr()
        assert stage03.main(["--input", str(tmp_path / "meta"), "--out", str(tmp_path / "out")]) == 1
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("03_download_images.py: shards [0] did not finish") and "run the same command" in last
        assert (f"is full ({free} bytes free" in last) == says_full, last

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
import sd.data.shards
import sd.data.stages
import sd.files
import sd.tokenizer

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
    monkeypatch.setattr(sd.data.stages, "MAX_MEMBER_BYTES", 1 << 20)
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
    monkeypatch.setattr(sd.data.stages, "MAX_MEMBER_BYTES", 1 << 20)
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
    assert sd.files.read_zip_member(archive, archive.getinfo("small"), 100) == b"x" * 10
    with pytest.raises(sd.files.TooLarge, match="big declares 5000 bytes, over the cap of 100"):
        sd.files.read_zip_member(archive, archive.getinfo("big"), 100)
    bomb = gzip.compress(bytes(10 << 20))  # 10 KB that inflate to 10 MB
    with pytest.raises(sd.files.TooLarge, match="bomb.gz inflates past the cap of 1048576 bytes"):
        sd.files.gunzip_bounded(bomb, 1 << 20, "bomb.gz")
    assert sd.files.gunzip_bounded(gzip.compress(b"abc"), 3) == b"abc"
    with pytest.raises(ValueError, match="truncated"):
        sd.files.gunzip_bounded(gzip.compress(bytes(1000))[:-12], 1 << 20)


def test_the_tokenizer_refuses_a_bpe_file_that_inflates_past_its_cap(tmp_path, monkeypatch):
    bomb = tmp_path / "bpe.txt.gz"
    bomb.write_bytes(gzip.compress(b"#version\n" + b"a b\n" * (1 << 20)))  # 4 MB of merges
    monkeypatch.setenv("SD_CLIP_BPE", str(bomb))
    monkeypatch.setattr(sd.tokenizer, "MAX_BPE_TEXT_BYTES", 1 << 20)
    with pytest.raises(sd.files.TooLarge, match=f"{bomb} inflates past the cap"):
        sd.tokenizer._read_clip_bpe()


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
        ("line\u2028sep.png", good), ("line\u2028sep.txt", b"str.splitlines splits here too"),
        ("next\x85line.png", good), ("next\x85line.txt", b"and at U+0085"),
        ("not\udcffutf8.png", good), ("not\udcffutf8.txt", b"a name that is not UTF-8 cannot be written back"),
        (".png", good), (".txt", b"empty key"),
        ("back\\slash.png", good), ("back\\slash.txt", b"windows path"),
        ("dup.png", good), ("dup.txt", b"first"), ("dup.png", other),
        ("latin.png", good), ("latin.txt", "café".encode("latin-1")),
        ("pngjpg.jpg", other), ("pngjpg.txt", b"a PNG named .jpg"),
        ("html.jpg", HTML), ("html.txt", b"an error page named .jpg"),
    ])
    (path.parent / "00000_stats.json").write_text("{not json")  # encode_latents reads it for its progress bar


BAD_KEYS = ["../evil", "/abs", "new\nline", "line\u2028sep", "next\x85line", "not\udcffutf8", "", "back\\slash"]


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
    assert stats["failed"] == {"bad_caption_encoding": 1, "bad_key": len(BAD_KEYS), "duplicate_key": 1}
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
    samples, _ = sd.data.shards.read_shard((out / "00000.tar").read_bytes())
    assert [s.key for s in samples] == ["good", "really_png"]


# ---------------------------------------------------------------------------------------------
# 01b, 01c, 01d: archives and annotation files from the web
# ---------------------------------------------------------------------------------------------


def test_diffusiondb_odd_members_and_prompt_tables(tmp_path):
    webp = image_bytes(random_image(np.random.default_rng(5), 64, 64), "WEBP")
    prompts = {"webp.png": {"p": "a WebP named .png"}, "page.png": {"p": "an error page"}, "list.png": ["not", "a dict"],
               "number.png": {"p": 7}, "../up.png": {"p": "escapes"}}
    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "part-000001.zip").write_bytes(zip_bytes({
        "webp.png": webp, "page.png": HTML, "list.png": png(), "number.png": png(1), "../up.png": png(2),
        "part-000001.json": json.dumps(prompts).encode()}))
    (parts / "part-000002.zip").write_bytes(zip_bytes({"a.png": png(), "part-000002.json": b'{"a.png": {"p": "caf\xe9"}}'}))
    out = tmp_path / "shards"
    assert DIFFUSIONDB.main(["--parts", "1-2", "--out", str(out), "--base_url", str(parts), "--resolution", str(RES),
                             "--workers", "1"]) == 0
    stats = stats_of(out, 1)
    assert (stats["successes"], stats["failed"]) == (2, {"no_caption": 1, "undecodable": 1, "unsafe_path": 1})
    assert stats["examples"] == {"no_caption": ["ddb_1_list"], "undecodable": ["ddb_1_page"],
                                 "unsafe_path": ["../up.png"]}
    summary = json.loads((out / "01b_download_diffusiondb_summary.json").read_text())
    assert summary["failed_parts"] == {"bad_archive": [2]}  # its prompt table is not UTF-8 JSON
    assert not (out / "00002.tar").exists()


def test_journeydb_annotation_lines_that_are_not_utf8_are_counted(tmp_path):
    lines = [json.dumps({"img_path": "./imgs/000/a.jpg", "prompt": "a red fox"}).encode(),
             b'{"img_path": "./imgs/000/b.jpg", "prompt": "caf\xe9"}', b"[1, 2]", b'{"img_path": 5}']
    (tmp_path / "anno.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        for name in ("000/a.jpg", "000/b.jpg"):
            data = image_bytes(random_image(np.random.default_rng(0), 64, 64), "JPEG")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (tmp_path / "000.tgz").write_bytes(archive.getvalue())
    out = tmp_path / "shards"
    assert JOURNEYDB.main(["--archives", "0", "--annotations", str(tmp_path / "anno.jsonl"), "--out", str(out),
                           "--base_url", str(tmp_path), "--resolution", str(RES), "--workers", "1"]) == 0
    summary = json.loads((out / "01c_download_journeydb_images_summary.json").read_text())
    assert (summary["kept"], summary["bad_annotation_lines"], summary["dropped"]) == (1, 3, {"no_caption": 1})


COCO_CAPTIONS = {"images": [{"id": 1, "file_name": "1.png", "height": 64, "width": 64}],
                 "annotations": [{"id": 10, "image_id": 1, "caption": "one"}]}
COCO_PERSONS = {"categories": [{"id": 1, "name": "person"}],
                "annotations": [{"image_id": 1, "category_id": 1, "bbox": [0, 0, 5, 60]}]}


@pytest.mark.parametrize("which, content, message", [
    ("captions", b"{not json", "is not readable JSON"),
    ("captions", b'{"images": [], "annotations": [], "info": "caf\xe9"}', "is not readable JSON"),
    ("captions", json.dumps({"images": 5, "annotations": []}).encode(), "needs a list 'images'"),
    ("captions", json.dumps({**COCO_CAPTIONS, "images": [{"id": "1", "file_name": "1.png"}]}).encode(),
     "an entry of 'images' without integer id"),
    ("captions", json.dumps({**COCO_CAPTIONS, "annotations": [{"image_id": 1, "caption": "x"}]}).encode(),
     "an entry of 'annotations' without integer id, image_id"),
    ("captions", json.dumps({**COCO_CAPTIONS, "images": [{"id": 1, "file_name": "1.png", "height": "tall"}]}).encode(),
     "image 1 has height 'tall', not a positive number"),
    ("instances", json.dumps({**COCO_PERSONS, "annotations": [{"image_id": 1, "category_id": 1,
                                                               "bbox": [0, 0, 5, "x"]}]}).encode(),
     "has bbox [0, 0, 5, 'x'], not 4 numbers"),
    ("instances", json.dumps({"categories": {"person": 1}, "annotations": []}).encode(), "needs a list 'categories'"),
])
def test_coco_annotation_files_of_the_wrong_shape_are_one_line_naming_the_file(tmp_path, capsys, which, content,
                                                                              message):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "1.png").write_bytes(png())
    files = {"captions": json.dumps(COCO_CAPTIONS).encode(), "instances": json.dumps(COCO_PERSONS).encode()}
    files[which] = content
    for name, data in files.items():
        (tmp_path / f"{name}.json").write_bytes(data)
    out = tmp_path / "shards"
    code = COCO.main(["--images", str(tmp_path / "images"), "--captions", str(tmp_path / "captions.json"),
                      "--instances", str(tmp_path / "instances.json"), "--person_filter", "--out", str(out),
                      "--resolution", str(RES)])
    err = one_line_error(capsys)
    assert code == 2 and str(tmp_path / f"{which}.json") in err and message in err
    assert files_in(out) == []


# ---------------------------------------------------------------------------------------------
# Parquet tables: columns of another type than the stage reads
# ---------------------------------------------------------------------------------------------


def laion_table(**columns) -> pa.Table:
    base = {"URL": ["http://x/1", "http://x/2"], "TEXT": ["a cat", "a dog"], "WIDTH": [600, 600],
            "HEIGHT": [700, 700], "aesthetic": [7.0, 7.0], "similarity": [0.3, 0.3]}
    return pa.table({**base, **columns})


@pytest.mark.parametrize("column, values, kind", [
    ("URL", [1, 2], "int64"),
    ("TEXT", [b"a cat", b"a dog"], "binary"),
    ("aesthetic", [[7.0], [8.0]], "list<"),
    ("WIDTH", [{"px": 600}, {"px": 600}], "struct<px: int64>"),
])
@pytest.mark.parametrize("stage", ["02", "03"])
def test_laion_columns_of_the_wrong_type_are_one_line_naming_file_and_column(tmp_path, capsys, column, values, kind,
                                                                             stage):
    (tmp_path / "meta").mkdir()
    pq.write_table(laion_table(**{column: values}), tmp_path / "meta" / "part-0.parquet")
    out = tmp_path / "out"
    if stage == "02":
        code = FILTER.main(["--input", str(tmp_path / "meta" / "*.parquet"), "--out", str(out)])
    else:
        code = DOWNLOAD_IMAGES.main(["--input", str(tmp_path / "meta"), "--out", str(out), "--processes", "1"])
    err = one_line_error(capsys)
    assert code == 2 and str(tmp_path / "meta" / "part-0.parquet") in err and f"column {column!r}" in err
    assert kind in err
    assert files_in(out) == []


@pytest.mark.parametrize("stage", ["01", "02", "03"])
def test_a_file_that_is_not_parquet_is_counted_or_one_line_naming_it(tmp_path, capsys, stage):
    (tmp_path / "meta").mkdir()
    (tmp_path / "meta" / "part-0.parquet").write_bytes(HTML)
    out = tmp_path / "out"
    if stage == "01":
        assert METADATA.main(["--out", str(out), "--local_dir", str(tmp_path / "meta")]) == 0
        summary = json.loads((out / "01_download_metadata_summary.json").read_text())
        assert summary["dropped"] == {"unreadable_parquet": 1}
        assert summary["files"][0]["file"] == "part-0.parquet" and summary["files"][0]["rows"] is None
        return
    if stage == "02":
        code = FILTER.main(["--input", str(tmp_path / "meta" / "*.parquet"), "--out", str(out)])
    else:
        code = DOWNLOAD_IMAGES.main(["--input", str(tmp_path / "meta"), "--out", str(out), "--processes", "1"])
    err = one_line_error(capsys)
    assert code == 2 and f"{tmp_path / 'meta' / 'part-0.parquet'}: not a readable parquet file" in err
    assert files_in(out) == []


def caption_folder(tmp_path, table) -> tuple:
    captions, latents = tmp_path / "captions", tmp_path / "latents"
    captions.mkdir()
    latents.mkdir()
    if isinstance(table, bytes):
        (captions / "00000.parquet").write_bytes(table)
    else:
        pq.write_table(table, captions / "00000.parquet")
    (captions / "00000_stats.json").write_text('{"successes": 1}')
    np.save(latents / "00000.npy", np.zeros((1, 4, 8, 8), np.float16))
    (latents / "00000.keys.txt").write_text("k\n")
    return captions, latents


IDS = [[49406] + [49407] * 76]


@pytest.mark.parametrize("table, message", [
    (pa.table({"key": [1], "caption": ["c"], "input_ids": IDS}), "column 'key' holds int64, not text"),
    (pa.table({"key": [None], "caption": ["c"], "input_ids": IDS}, schema=pa.schema(
        [("key", pa.string()), ("caption", pa.string()), ("input_ids", pa.list_(pa.int64()))])),
     "column 'key' has 1 empty (null) values"),
    (pa.table({"key": ["k"], "caption": [b"c"], "input_ids": IDS}), "column 'caption' holds binary, not text"),
    (pa.table({"key": ["k"], "caption": ["c"], "input_ids": ["49406 49407"]}), "input_ids of type string are not 77"),
    (pa.table({"key": ["k"], "caption": ["c"], "input_ids": [[49406, 49407]]}), "input_ids of type list<"),
    (pa.table({"key": ["k"], "caption": ["c"]}), "lacks the columns ['input_ids']"),
    (HTML, "is not a readable parquet file"),
])
def test_stage_05_refuses_caption_tables_of_the_wrong_shape_naming_the_file(tmp_path, capsys, table, message):
    captions, latents = caption_folder(tmp_path, table)
    code = DATASET.main(["--captions", str(captions), "--latents", str(latents), "--out", str(tmp_path / "dataset")])
    err = one_line_error(capsys)
    assert code == 2 and f"{captions / '00000.parquet'}" in err and message in err
    assert not (tmp_path / "dataset").exists()


def test_stage_05_refuses_an_unfinished_or_damaged_latent_folder(tmp_path, capsys):
    captions, latents = caption_folder(tmp_path, pa.table({"key": ["k"], "caption": ["c"], "input_ids": IDS}))
    argv = ["--captions", str(captions), "--latents", str(latents), "--out", str(tmp_path / "dataset")]
    (latents / "latents.json").write_text('{"vae": "tiny", "complete": false}')
    assert DATASET.main(argv) == 2
    assert f"latent folder {latents} is not completely encoded" in one_line_error(capsys)
    (latents / "latents.json").write_text('{"vae": "tiny", "complete": true}')
    (latents / "00000.keys.txt").write_bytes(b"k\xff\n")
    assert DATASET.main(argv) == 2
    assert f"{latents / '00000.keys.txt'} is not readable UTF-8" in one_line_error(capsys)
    assert not (tmp_path / "dataset").exists()
    (latents / "00000.keys.txt").write_text("k\n")
    assert DATASET.main(argv) == 0


# ---------------------------------------------------------------------------------------------
# Downloads: a server that sends a range nobody asked for, or a body cut short
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def http_server(respond):
    """A loopback server answering every GET with ``respond(handler)``."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            respond(self)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def partial_from(body: bytes, start: int):
    """206 with the body from ``start``, whatever the request asked for."""

    def respond(handler):
        handler.send_response(206)
        handler.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        handler.send_header("Content-Length", str(len(body) - start))
        handler.end_headers()
        handler.wfile.write(body[start:])

    return respond


def cut_short(body: bytes):
    """200 announcing the whole body, then half of it and the connection closed."""

    def respond(handler):
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body[: len(body) // 2])
        handler.close_connection = True

    return respond


BODY = bytes(range(256)) * 40


def test_a_partial_reply_nobody_asked_for_is_refused(tmp_path):
    with http_server(partial_from(BODY, 100)) as url:
        with pytest.raises(sd.data.stages.DownloadError, match="partial content .bytes 100-10239/10240. that does not "
                                                           "start at byte 0"):
            sd.data.stages.download(f"{url}/f.bin", tmp_path / "f.bin", retries=0)
    assert files_in(tmp_path) == []


def test_a_resumed_download_answered_from_the_wrong_offset_is_refused(tmp_path):
    (tmp_path / "f.bin.part").write_bytes(BODY[:500])
    with http_server(partial_from(BODY, 0)) as url:  # 206 from byte 0 though byte 500 was asked for
        with pytest.raises(sd.data.stages.DownloadError, match="does not start at byte 500"):
            sd.data.stages.download(f"{url}/f.bin", tmp_path / "f.bin", retries=0)
    assert files_in(tmp_path) == []  # the partial file is dropped: the next try starts clean


def test_a_body_cut_short_is_retried_then_a_download_error(tmp_path):
    with http_server(cut_short(BODY)) as url:
        with pytest.raises(sd.data.stages.DownloadError, match="gave up after 2 tries"):
            sd.data.stages.download(f"{url}/f.bin", tmp_path / "f.bin", retries=1, backoff=0.01)
    assert not (tmp_path / "f.bin").exists()


def test_stages_count_or_name_a_download_that_went_wrong(tmp_path, capsys):
    with http_server(cut_short(zip_bytes({"a.png": png()}))) as url:
        out = tmp_path / "ddb"
        # its only part failed: nothing downloaded, which a later stage would find out (exit 1, the part named)
        assert DIFFUSIONDB.main(["--parts", "1", "--out", str(out), "--base_url", url, "--retries", "0"]) == 1
        summary = json.loads((out / "01b_download_diffusiondb_summary.json").read_text())
        assert summary["failed_parts"] == {"download_failed": [1]} and not (out / "00001.tar").exists()
        assert "01b_download_diffusiondb.py: error: kept nothing: download_failed 1 (1)" in capsys.readouterr().err
    capsys.readouterr()
    annotations = json.dumps({"img_path": "./imgs/000/a.jpg", "prompt": "a fox"}).encode() * 50
    with http_server(partial_from(annotations, 30)) as url:
        out = tmp_path / "jdb"
        code = JOURNEYDB.main(["--archives", "0", "--annotations", f"{url}/anno.jsonl", "--out", str(out),
                               "--base_url", url, "--retries", "0"])
        err = one_line_error(capsys)
        assert code == 2 and f"{url}/anno.jsonl" in err and "does not start at byte 0" in err
        assert files_in(out) == ["_downloads"]  # the download folder, empty


# ---------------------------------------------------------------------------------------------
# An output path that is a file
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", ["encode_latents", "01e", "02", "04", "05"])
def test_an_out_path_that_is_a_file_is_one_line_naming_it(tmp_path, capsys, entry):
    out = tmp_path / "taken"
    out.write_text("someone's file")
    (tmp_path / "src").mkdir()
    argv = {"encode_latents": ["--shards", str(tmp_path / "src" / "*.tar"), "--vae", "tiny"],
            "01e": ["--input", str(tmp_path / "src")], "02": ["--input", str(tmp_path / "src" / "*.parquet")],
            "04": ["--input", str(tmp_path / "src" / "*.tar")],
            "05": ["--captions", str(tmp_path / "src"), "--latents", str(tmp_path / "src")]}[entry]
    (tmp_path / "src" / "00000.tar").write_bytes(b"")  # so encode_latents gets past its glob
    main = {"encode_latents": encode_latents.main, "01e": IMPORT_FOLDER.main, "02": FILTER.main,
            "04": CAPTIONS.main, "05": DATASET.main}[entry]
    try:
        code = main([*argv, "--out", str(out)])
    except SystemExit as exit_info:  # the stages' parsers refuse it
        code = exit_info.code
    err = one_line_error(capsys)
    assert code == 2 and f"--out {out} is a file, not a folder" in err
    assert out.read_text() == "someone's file"

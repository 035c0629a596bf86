"""sd.studio.data: a folder read as stage 01e reads it (captions, sizes from the headers, the files it would skip and
why, the aspect-ratio buckets, pages), and only a caption 01e reads written back. That 01e and the scan skip the same
files for the same reasons: tests/integration/test_pipeline_import_folder.py."""

import pytest
from PIL import Image

from sd.studio import data


def test_folder_scan_reads_headers_names_skips_and_pages(tmp_path):
    folder = tmp_path / "photos"
    (folder / "sub").mkdir(parents=True)
    for i in range(60):
        Image.new("RGB", (96, 64) if i % 2 else (64, 64)).save(folder / ("sub" if i % 3 == 0 else "") / f"p{i:02d}.png")
        if i != 7:
            (folder / ("sub" if i % 3 == 0 else "") / f"p{i:02d}.txt").write_text(f"caption {i}")
    Image.new("RGB", (8, 8)).save(folder / "tiny.png")
    (folder / "tiny.txt").write_text("small")
    Image.new("RGB", (640, 64)).save(folder / "strip.png")
    (folder / "strip.txt").write_text("long")
    (folder / "broken.png").write_bytes(b"\x89PNG nothing")
    (folder / "broken.txt").write_text("a caption: 01e reads it first")
    (folder / "latin.png").write_bytes((folder / "p01.png").read_bytes())
    (folder / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    (folder / "p02_mask.png").write_bytes((folder / "p01.png").read_bytes())  # a loss mask, not an image
    scan = data.scan_folder(folder, resolution=64)
    assert sorted(scan.skipped) == [("broken.png", "undecodable"), ("latin.png", "bad_caption_encoding"),
                                    ("p07.png", "no_caption"), ("strip.png", "extreme_aspect"),
                                    ("tiny.png", "too_small")]
    assert len(scan.images) == 59 and scan.captions["sub/p03.png"] == "caption 3"
    assert scan.buckets == {"64x64": 59}  # 64 px recipes have one bucket; at 256 px the 3:2 images get their own
    # (tiny.png counts at --min_size 0; p07 has no caption)
    assert data.scan_folder(folder, resolution=256, min_size=0).buckets == {"256x256": 31, "320x192": 29}
    pages = [data.page_of(scan, n, 24) for n in (1, 2, 3, 9)]
    assert [len(p) for p in pages] == [24, 24, 11, 11]  # page 9 is past the end: the last one
    assert [rel for page in pages[:3] for rel, _ in page] == scan.images
    for name in ("../outside.png", str(tmp_path / "outside.png"), "p07.txt", "p02_mask.png", "missing.png"):
        with pytest.raises(ValueError, match="not an image that 01e_import_folder.py reads"):
            data.write_caption(folder, name, "words")
    assert not (tmp_path / "outside.txt").exists() and not (folder / "p02_mask.txt").exists()
    data.write_caption(folder, "p07.png", "  new words \n")
    assert (folder / "p07.txt").read_text() == "new words\n"
    assert ("p07.png", "no_caption") not in data.scan_folder(folder, resolution=64).skipped

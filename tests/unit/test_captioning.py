"""sd.data.captioning's caption composition and sd.data.review's contact sheets and tag table."""

from collections import Counter

import pytest
from PIL import Image

import sd.data.captioning as captioning
import sd.data.review as review

TAGS = [("hatsune_miku", 0.9, captioning.CHARACTER), ("long_hair", 0.8, captioning.GENERAL),
        ("general", 0.7, captioning.RATING), ("^_^", 0.5, captioning.GENERAL), ("sensitive", 0.3, captioning.RATING),
        ("smile", 0.3, captioning.GENERAL), ("rei_ayanami", 0.6, captioning.CHARACTER)]


def test_kept_tags_thresholds_order_underscores_and_drops():
    options = captioning.ComposeOptions()
    assert captioning.kept_tags(TAGS, options) == ["hatsune miku", "long hair", "^_^"]
    lower = captioning.ComposeOptions(threshold=0.25, character_threshold=0.5, rating_tags=True)
    assert captioning.kept_tags(TAGS, lower) == ["hatsune miku", "rei ayanami", "long hair", "^_^", "smile", "general"]
    raw = captioning.ComposeOptions(replace_underscores=False, drop_tags=("long hair",))
    assert captioning.kept_tags(TAGS, raw) == ["hatsune_miku", "^_^"]  # dropped in either spelling
    assert captioning.kept_tags(TAGS, captioning.ComposeOptions(drop_tags=("hatsune_miku",))) == ["long hair", "^_^"]


@pytest.mark.parametrize("tag, written", [("long_hair", "long hair"), ("holding_a_cup", "holding a cup"),
                                          ("^_^", "^_^"), ("o_o", "o_o"), ("x_x", "x_x"), ("(o)_(o)", "(o)_(o)"),
                                          ("||_||", "||_||"), ("1girl", "1girl")])
def test_emoticons_keep_their_underscores(tag, written):
    assert captioning.tag_text(tag, captioning.ComposeOptions()) == written


def test_compose_existing_trigger_order_and_counts():
    tags = ["long hair", "smile"]
    keep = captioning.ComposeOptions(trigger="sks")
    assert captioning.compose("my caption", "a girl", tags, keep) == "sks, my caption"
    assert captioning.compose("", "a girl", tags, keep) == "sks, a girl, long hair, smile"
    assert captioning.compose("sks woman", "a girl", tags, keep) == "sks woman"  # starts with the trigger already
    join = captioning.ComposeOptions(existing="join", tags_first=True)
    assert captioning.compose("my caption", "a girl", tags, join) == "long hair, smile, my caption, a girl"
    replace = captioning.ComposeOptions(existing="replace", min_tag_count=2)
    assert captioning.compose("my caption", "", tags, replace, Counter({"long hair": 2, "smile": 1})) == "long hair"
    assert captioning.compose("", "", [], replace) == ""  # nothing to say: the stage skips it as no_caption
    assert captioning.compose("", "", ["sks"], captioning.ComposeOptions(trigger="sks")) == "sks"  # not twice


def test_tag_counts_count_images_not_mentions():
    counts = captioning.tag_counts(["a, b, a", " b ,c,", ""])
    assert counts == Counter({"a": 1, "b": 2, "c": 1})


def test_clean_caption_takes_the_prompt_off_and_joins_lines():
    assert captioning.clean_caption("a photo of  a red\ncar ", "A photo of") == "a red car"
    assert captioning.clean_caption("a red car", "a photo of") == "a red car"


def test_contact_sheets_page_and_stop_at_max_pages(tmp_path):
    sheets = review.ContactSheets(tmp_path / "review", columns=3, rows=2, max_pages=2)
    for i in range(15):
        sheets.add(Image.new("RGB", (600, 300), (i * 15, 0, 0)) if i != 4 else None, f"caption {i} " * 30, f"img{i}")
    pages = sheets.close()
    assert [p.name for p in pages] == ["sheet_0001.png", "sheet_0002.png"] and sheets.full
    page = Image.open(pages[0])
    width, height = sheets.cell
    assert page.size == (3 * width + review.MARGIN, 2 * height + review.MARGIN)
    # The first thumbnail is the image scaled to 256 wide, centred in its cell: its colour is there.
    assert page.getpixel((review.MARGIN + 128, review.MARGIN + 128)) == (0, 0, 0)
    assert page.getpixel((review.MARGIN + width + 128, review.MARGIN + 128)) == (15, 0, 0)
    partial = review.ContactSheets(tmp_path / "partial", columns=3, rows=2)
    partial.add(Image.new("RGB", (10, 10)), "x")
    assert len(partial.close()) == 1 and Image.open(tmp_path / "partial" / "sheet_0001.png").size[1] == height + review.MARGIN


def test_caption_lines_wrap_and_cut():
    lines = review.caption_lines("word " * 100, 20, 3)
    assert len(lines) == 3 and all(len(line) <= 20 for line in lines) and lines[-1].endswith("...")
    assert review.caption_lines("", 20, 3) == ["(no caption)"]


def test_tag_table_sorted_by_count_then_name(tmp_path):
    review.write_tag_table(tmp_path / "tags.csv", Counter({"b": 2, "a": 2, "c": 5}), 10)
    assert (tmp_path / "tags.csv").read_text().splitlines() == ["tag,images,share", "c,5,0.5000", "a,2,0.2000",
                                                                "b,2,0.2000"]

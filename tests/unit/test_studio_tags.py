"""sd.studio.tags: the Data page's bulk tag edit. Counts as tags.csv counts them; each action's result on hand-made
captions; a preview writes nothing; apply then undo gives the files back byte for byte (created captions removed),
only the last edit undone; paths outside the roots, caption links out of them and bad tags refused with nothing
written; no .txt but an image's caption touched; the section builds inside a real gr.Blocks."""

import csv
import types

import pytest
from PIL import Image

import sd.data.review
from sd.studio import tags
from sd.studio.runs import Roots


def make_folder(folder, captions):
    """Tiny PNGs named by ``captions``' keys, each with its .txt holding the value (bytes or text; None: none)."""
    for name, caption in captions.items():
        image = folder / name
        image.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8)).save(image)
        if caption is not None:
            text = image.with_suffix(".txt")
            text.write_bytes(caption) if isinstance(caption, bytes) else text.write_text(caption)
    return folder


def snapshot(root):
    """Every file under ``root``: its bytes and modification time."""
    return {p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def contents(root):
    return {name: data for name, (data, _) in snapshot(root).items()}


def studio_at(root):
    return types.SimpleNamespace(roots=Roots([root]), workdir=root)


def caption(folder, name):
    return (folder / name).read_text()


def test_split_join_and_counts_match_a_hand_count_and_tags_csv(tmp_path):
    assert tags.split_tags(" a, ,b ,, c \n") == ["a", "b", "c"] and tags.join_tags(["a", "b"]) == "a, b"
    folder = make_folder(tmp_path / "photos", {
        "a.png": "1girl, solo, red hair", "b.png": "1girl,  smile, 1girl", "c.png": "solo, red hair, smile",
        "d.png": None, "e.png": "  \n", "sub/f.png": "1girl\n", "a_mask.png": "zzz"})  # a mask is no image
    (folder / "notes.txt").write_text("1girl, zzz")  # no image's caption
    rows = tags.tag_counts(folder)
    # by hand: 4 captioned images (a, b, c, f); 1girl on a, b (once) and f; the others on two each
    assert rows == [("1girl", 3, 0.75), ("red hair", 2, 0.5), ("smile", 2, 0.5), ("solo", 2, 0.5)]
    counts, images = tags.images_per_tag(folder)
    sd.data.review.write_tag_table(tmp_path / "tags.csv", counts, images)
    with open(tmp_path / "tags.csv", newline="") as handle:
        table = list(csv.reader(handle))
    assert table == [["tag", "images", "share"]] + [[tag, str(n), f"{share:.4f}"] for tag, n, share in rows]


def test_replace_merges_a_tag_the_caption_holds_already(tmp_path):
    folder = make_folder(tmp_path / "photos", {"a.png": "cat, kitty, cute", "b.png": "kitty, dog",
                                               "c.png": "kitty, cute, cat", "d.png": "x, x, dog", "e.png": None})
    kept = snapshot(folder)["d.txt"]
    done = tags.apply(folder, tags.Edit("replace", "kitty", new="cat"), tmp_path / "undo")
    assert done.changed == 3 and done.rows[0] == ("a.png", "cat, kitty, cute", "cat, cute")
    assert [caption(folder, f"{n}.txt") for n in "abc"] == ["cat, cute\n", "cat, dog\n", "cat, cute\n"]
    assert snapshot(folder)["d.txt"] == kept  # no kitty: not rewritten, its repeated x included
    assert not (folder / "e.txt").exists()


def test_drop_removes_the_tag_and_leaves_an_emptied_caption_empty(tmp_path):
    folder = make_folder(tmp_path / "photos", {"a.png": "a, b, c", "b.png": "b", "c.png": "a,c"})
    before = snapshot(folder)["c.txt"]
    assert tags.apply(folder, tags.Edit("drop", " b "), tmp_path / "undo").changed == 2
    assert caption(folder, "a.txt") == "a, c\n" and caption(folder, "b.txt") == "\n"
    assert snapshot(folder)["c.txt"] == before  # its tags unchanged: its spacing too


@pytest.mark.parametrize("position, first", [("end", "x, y, new"), ("start", "new, x, y")])
def test_add_skips_captions_holding_it_and_writes_one_for_images_without(tmp_path, position, first):
    folder = make_folder(tmp_path / "photos", {"a.png": "x, y", "b.png": "x, new", "c.png": None, "sub/d.png": ""})
    kept = snapshot(folder)["b.txt"]
    done = tags.apply(folder, tags.Edit("add", "new", position=position), tmp_path / "undo")
    assert done.changed == 3
    assert caption(folder, "a.txt") == first + "\n" and snapshot(folder)["b.txt"] == kept
    assert caption(folder, "c.txt") == "new\n" and caption(folder, "sub/d.txt") == "new\n"


def test_drop_rare_drops_tags_on_fewer_images_than_min_count(tmp_path):
    folder = make_folder(tmp_path / "photos", {"a.png": "common, rare1", "b.png": "common, mid",
                                               "c.png": "mid, common, mid", "d.png": "rare2"})
    edit = tags.Edit("drop_rare", "", min_count=2)  # common on 3 images, mid on 2 (c counts once), rare1/2 on 1
    assert tags.preview(folder, edit).rows == [("a.png", "common, rare1", "common"), ("d.png", "rare2", "")]
    tags.apply(folder, edit, tmp_path / "undo")
    assert [caption(folder, f"{n}.txt") for n in "abcd"] == ["common\n", "common, mid", "mid, common, mid", "\n"]
    assert tags.tag_counts(folder) == [("common", 3, 1.0), ("mid", 2, 2 / 3)]


def test_preview_writes_nothing_and_shows_the_first_rows(tmp_path):
    folder = make_folder(tmp_path / "photos", {"a.png": "x", "b.png": "y", "c.png": None, "d.png": "new, x",
                                               "latin.png": "caf\xe9, x".encode("latin-1")})
    before = snapshot(tmp_path)
    shown = tags.preview(folder, tags.Edit("add", "new", position="start"), limit=2)
    assert (shown.changed, shown.unreadable) == (3, 1)  # latin.txt is not UTF-8: left alone
    assert shown.rows == [("a.png", "x", "new, x"), ("b.png", "y", "new, y")]
    assert snapshot(tmp_path) == before  # no caption written, no undo folder made


def test_apply_then_undo_gives_back_every_byte_and_removes_created_captions(tmp_path):
    folder = make_folder(tmp_path / "photos", {"a.png": b"a,b\r\n", "b.png": b"  b , c  ", "c.png": None,
                                               "sub/d.png": "z, a"})
    before = contents(folder)
    done = tags.apply(folder, tags.Edit("add", "z", position="start"), tmp_path / "undo")
    assert done.changed == 3 and caption(folder, "c.txt") == "z\n"
    assert len(list((tmp_path / "undo").iterdir())) == 1
    assert tags.undo(folder, tmp_path / "undo") == (3, 0)
    assert contents(folder) == before and not (folder / "c.txt").exists()
    assert list((tmp_path / "undo").iterdir()) == []
    with pytest.raises(ValueError, match="nothing to undo"):
        tags.undo(folder, tmp_path / "undo")


def test_only_the_last_edit_is_undone_and_later_changes_are_counted(tmp_path):
    folder = make_folder(tmp_path / "photos", {"a.png": "a, b, c", "b.png": "b, c"})
    undo_dir = tmp_path / "undo"
    tags.apply(folder, tags.Edit("drop", "a"), undo_dir)
    tags.apply(folder, tags.Edit("drop", "c"), undo_dir)
    assert tags.apply(folder, tags.Edit("drop", "missing"), undo_dir).changed == 0  # keeps the undo of the last
    (folder / "b.txt").write_text("b, edited by hand")
    assert tags.undo(folder, undo_dir) == (2, 1)  # both restored; b had changed since the edit
    assert caption(folder, "a.txt") == "b, c\n" and caption(folder, "b.txt") == "b, c"  # as before the 2nd
    with pytest.raises(ValueError, match="nothing to undo"):
        tags.undo(folder, undo_dir)


def test_edit_refuses_bad_fields_naming_them():
    for fields, words in [(("rename", "a"), "action 'rename': one of replace, drop, add, drop_rare"),
                          (("drop", "  "), "tag: empty"), (("drop", "a, b"), "comma"),
                          (("add", "a\nb"), "line break"), (("replace", "a", "b,c"), "new tag 'b,c' holds a comma"),
                          (("replace", "a"), "new tag: empty"), (("replace", "a", "a"), "nothing would change"),
                          (("drop_rare", "", "", 1), "min count 1: a whole number of images, at least 2"),
                          (("add", "a", "", 0, "middle"), "position 'middle': start or end")]:
        with pytest.raises(ValueError, match=words):
            tags.Edit(*fields)


def test_handlers_refuse_paths_outside_the_roots_and_bad_values_writing_nothing(tmp_path):
    inside, outside = tmp_path / "inside", make_folder(tmp_path / "outside", {"a.png": "a, b"})
    make_folder(inside / "photos", {"a.png": "a, b"})
    page = tags.TagPage(studio_at(inside))
    before = snapshot(tmp_path)
    for path in (str(outside), "../outside", str(inside / "photos" / "a.png"), "", None):
        rows, status = page.apply(path, "drop", "a", "", 2, "end")
        assert rows == [] and status.startswith("**not written:** ")
        assert page.count(path)[1].startswith("**not written:** ")
        assert page.undo(path).startswith("**not written:** ")
    assert "outside the folders this studio was started with" in page.preview(str(outside), "drop", "a", "", 2,
                                                                              "end")[1]
    for values, words in [(("drop", "a, b", "", 2, "end"), "comma"), (("drop_rare", "", "", "lots", "end"),
                                                                        "min count 'lots'"),
                          (("drop_rare", "", "", 2.5, "end"), "min count 2.5"), ((None, "a", None, None, None),
                                                                                 "action ''")]:
        rows, status = page.apply("photos", *values)
        assert rows == [] and status.startswith("**not written:** ") and words in status
    assert snapshot(tmp_path) == before
    nothing = f"**not written:** nothing to undo: no edit of {(inside / 'photos').resolve()} is recorded"
    assert page.undo("photos") == nothing


def test_handlers_count_preview_apply_and_undo_in_the_studio(tmp_path):
    folder = make_folder(tmp_path / "photos", {"a.png": "a, b", "b.png": "b", "c.png": None})
    page = tags.TagPage(studio_at(tmp_path))
    assert page.count("photos") == ([["b", 2, 1.0], ["a", 1, 0.5]], "2 tags")
    before = contents(folder)
    rows, status = page.preview("photos", "add", "new", "", 2, "start")
    assert status == "3 captions would change" and rows[0] == ["a.png", "a, b", "new, a, b"]
    assert page.apply("photos", "add", "new", "", 2, "start") == (rows, "changed 3 captions; **Undo the last "
                                                                       "edit** puts them back")
    assert (tmp_path / ".studio" / "tag_undo").is_dir() and caption(folder, "c.txt") == "new\n"
    assert page.undo(str(folder)) == "restored 3 captions" and contents(folder) == before


def test_only_captions_of_images_01e_reads_are_touched(tmp_path):
    folder = make_folder(tmp_path / "photos", {"a.png": "a, x", "a_mask.png": "a, mask", "sub/b.png": None})
    (folder / "notes.txt").write_text("a, notes")
    (folder / ".hidden.png").write_bytes((folder / "a.png").read_bytes())
    (folder / ".hidden.txt").write_text("a, hidden")
    others = {name: data for name, data in contents(folder).items() if name in ("a_mask.txt", "notes.txt",
                                                                                 ".hidden.txt")}
    undo_dir = tmp_path / "undo"
    tags.apply(folder, tags.Edit("drop", "a"), undo_dir)
    tags.apply(folder, tags.Edit("add", "b"), undo_dir)
    assert caption(folder, "a.txt") == "x, b\n" and caption(folder, "sub/b.txt") == "b\n"
    now = contents(folder)
    assert {name: now[name] for name in others} == others
    assert sorted(name for name in now if name.endswith(".txt")) == [".hidden.txt", "a.txt", "a_mask.txt",
                                                                      "notes.txt", "sub/b.txt"]


def test_a_caption_linking_out_of_the_roots_refuses_the_edit(tmp_path):
    inside = tmp_path / "inside"
    folder = make_folder(inside / "photos", {"a.png": "a, b", "b.png": None})
    secret = tmp_path / "secret.txt"
    secret.write_text("a, secret")
    (folder / "b.txt").symlink_to(secret)
    page = tags.TagPage(studio_at(inside))
    before = snapshot(tmp_path)
    for status in (page.apply("photos", "drop", "a", "", 2, "end")[1], page.preview("photos", "drop", "a", "", 2,
                                                                                     "end")[1],
                   page.count("photos")[1]):
        assert status.startswith("**not written:** ") and "b.txt is outside the folders" in status
    assert snapshot(tmp_path) == before and not (inside / ".studio").exists()
    with pytest.raises(ValueError, match="b.txt is outside the folders"):
        tags.apply(folder, tags.Edit("drop", "a"), inside / "undo", Roots([inside]).check)
    assert snapshot(tmp_path) == before


def test_section_builds_inside_a_blocks_with_its_ids_and_api_names(tmp_path):
    gr = pytest.importorskip("gradio")
    with gr.Blocks() as blocks:
        folder = gr.Textbox(value="photos", elem_id="data-folder")
        tags.section(gr, studio_at(tmp_path), folder)
    ids = {getattr(block, "elem_id", None) for block in blocks.blocks.values()}
    assert {"tags-section", "tags-count", "tags-table", "tags-action", "tags-tag", "tags-new", "tags-min",
            "tags-position", "tags-preview", "tags-apply", "tags-undo", "tags-status", "tags-preview-table"} <= ids
    api_names = {fn.api_name for fn in blocks.fns.values()}
    assert {"tags_count", "tags_preview", "tags_apply", "tags_undo"} <= api_names
    table = next(block for block in blocks.blocks.values() if getattr(block, "elem_id", None) == "tags-table")
    assert table.postprocess([["b", 2, 1.0]]).data == [["b", 2, 1.0]] and table.postprocess([]).data == []

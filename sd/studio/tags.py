"""The Data page's bulk tag edit: one change made to every caption of an image folder, shown before it is
written and undone after.

A caption is the ``.txt`` beside an image (``photo.jpg`` -> ``photo.txt``, ``sd.studio.data.caption_path``), read
as comma-separated tags (booru style: ``1girl, solo, red hair``) and compared exactly, case included. Only the
captions of images that ``01e_import_folder.py`` reads (``sd.data.stages.list_images``) are read or written, never
another ``.txt``; an image without one has an empty caption, which only ``add`` writes. A caption that is not UTF-8,
not a file or over ``MAX_CAPTION_BYTES`` is left alone and counted as such. ``tag_counts`` gives the rows of
``tags.csv`` (``sd.data.review.write_tag_table``): images per tag, a tag counted once per caption, its share of the
images with a caption. An ``Edit`` is one of ``ACTIONS``; ``plan`` works out every caption it changes, before and
after, and both ``preview`` and ``apply`` call it, so a preview shows exactly what Apply then writes (Apply works
it out again from the settings shown; it does not rely on an earlier preview). A caption whose tags stay the same
is not rewritten, whatever its spacing; one left with no tag is written empty (01e then skips its image as
``no_caption``, as the Data page's scan shows).

``apply`` records every caption it is about to change (its text, or that there was no file) in one undo file per
folder, written before any caption; the next edit of the folder replaces it, so only the last edit can be undone.
``undo`` puts the recorded texts back byte for byte, removes the captions the edit created, and reports how many had
been changed again since (they are restored too). Every caption path goes through ``check`` (the studio's
``Roots.check``) before anything is read or written: a caption that links out of the roots refuses the whole edit.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Callable

import sd.data.stages
import sd.files
from sd.data.captioning import caption_tags
from sd.studio.data import caption_path

ACTIONS = {  # action -> what it does, as the page says it
    "replace": "every `tag` becomes `new tag` (a caption holding both keeps one)",
    "drop": "`tag` is removed from every caption",
    "add": "`tag` is added, at the start or the end, to every caption lacking it (an image without one gets one)",
    "drop_rare": "every tag carried by fewer than `min count` images is removed",
}
POSITIONS = ("end", "start")
MAX_CAPTION_BYTES = 1 << 20  # a caption file larger than this is not a caption: left alone
PREVIEW_ROWS = 20  # captions the page shows before and after
TABLE_ROWS = 1000  # tags the page's count table shows, most frequent first
Check = Callable[[Path], Path]


def split_tags(caption: str) -> list[str]:
    """A caption's tags in order, trimmed, empty pieces left out (what ``tags.csv`` counts)."""
    return caption_tags(caption)


def join_tags(tags: list[str]) -> str:
    return ", ".join(tags)


@dataclass
class Edit:
    action: str  # one of ACTIONS
    tag: str  # the tag replaced, dropped or added (unused by drop_rare)
    new: str = ""  # replace: the tag it becomes
    min_count: int = 0  # drop_rare: tags on fewer images than this are dropped
    position: str = "end"  # add: where the tag goes, "start" or "end"

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"action {self.action!r}: one of {', '.join(ACTIONS)}")
        self.tag, self.new = str(self.tag).strip(), str(self.new).strip()
        for name, value in (("tag", self.tag), ("new tag", self.new)):
            if any(mark in value for mark in ",\n\r"):
                raise ValueError(f"{name} {value!r} holds a comma or a line break: give one tag (a caption's "
                                 "comma-separated piece) and run one edit per tag")
        if self.action != "drop_rare" and not self.tag:
            raise ValueError(f"tag: empty; name the tag to {self.action}")
        if self.action == "replace" and not self.new:
            raise ValueError(f"new tag: empty; name the tag that replaces {self.tag!r} (drop removes it)")
        if self.action == "replace" and self.new == self.tag:
            raise ValueError(f"new tag {self.new!r} is the tag itself: nothing would change")
        if self.action == "drop_rare" and (not isinstance(self.min_count, int) or self.min_count < 2):
            raise ValueError(f"min count {self.min_count!r}: a whole number of images, at least 2 (tags on fewer "
                             "images are dropped; 1 drops none)")
        if self.position not in POSITIONS:
            raise ValueError(f"position {self.position!r}: start or end")

    def tags_after(self, tags: list[str], counts: Counter) -> list[str]:
        """``tags`` (one caption's) as this edit leaves them; ``counts``: images per tag (drop_rare)."""
        if self.action == "replace":
            if self.tag not in tags:
                return tags
            after = []
            for tag in (self.new if tag == self.tag else tag for tag in tags):
                if not (tag == self.new and tag in after):  # the caption held the new tag already: kept once
                    after.append(tag)
            return after
        if self.action == "drop":
            return [tag for tag in tags if tag != self.tag]
        if self.action == "add":
            if self.tag in tags:
                return tags
            return [self.tag, *tags] if self.position == "start" else [*tags, self.tag]
        return [tag for tag in tags if counts[tag] >= self.min_count]


@dataclass(frozen=True)
class Change:
    image: str  # relative path, as list_images gives it
    path: Path  # its caption file
    before: str | None  # the file's whole text; None: there was no file
    after: str  # the text written


@dataclass
class Preview:
    changed: int  # captions the edit changes
    rows: list[tuple[str, str, str]] = field(default_factory=list)  # (image, caption before, after), the first few
    unreadable: int = 0  # captions left alone: not UTF-8, not a file, or over MAX_CAPTION_BYTES


def read_caption_file(path: Path) -> str | None:
    """A caption file's whole text as it is on disk ("" when there is none), None when it is not UTF-8, not a
    file (a folder, a broken link) or over ``MAX_CAPTION_BYTES``."""
    if not os.path.lexists(path):
        return ""
    if not path.is_file():
        return None
    try:
        return sd.files.read_file_bounded(path, MAX_CAPTION_BYTES).decode("utf-8")
    except (UnicodeDecodeError, sd.files.TooLarge):
        return None


def captions(folder: Path, check: Check | None = None):
    """``(image, caption file, its text or None)`` of every image 01e reads in ``folder``, in its order, each
    caption file once (``photo.jpg`` and ``photo.png`` share ``photo.txt``); ``check`` sees every path first."""
    folder = Path(folder)
    seen = set()
    for image in sd.data.stages.list_images(folder)[0]:
        path = caption_path(folder, image)
        if path in seen:
            continue
        seen.add(path)
        if check is not None:
            check(path)
        yield image, path, read_caption_file(path)


def images_per_tag(folder: Path, check: Check | None = None) -> tuple[Counter, int]:
    """``(images per tag, images with a caption)``, counted as ``tags.csv`` counts them."""
    counts, images = Counter(), 0
    for _, _, text in captions(folder, check):
        if text and text.strip():
            images += 1
            counts.update(set(split_tags(text)))
    return counts, images


def tag_counts(folder: Path, check: Check | None = None) -> list[tuple[str, int, float]]:
    """``(tag, images, share)`` per tag of ``folder``'s captions, most frequent first, ties by name: the rows of
    ``tags.csv``, the share over the images with a caption."""
    counts, images = images_per_tag(folder, check)
    return [(tag, n, n / max(images, 1)) for tag, n in sorted(counts.items(), key=lambda pair: (-pair[1], pair[0]))]


def plan(folder: Path, edit: Edit, check: Check | None = None) -> tuple[list[Change], int]:
    """``(every caption the edit changes, captions left alone as unreadable)``; nothing is written."""
    counts = images_per_tag(folder, check)[0] if edit.action == "drop_rare" else Counter()
    changes, unreadable = [], 0
    for image, path, text in captions(folder, check):
        if text is None:
            unreadable += 1
            continue
        tags = split_tags(text)
        after = edit.tags_after(tags, counts)
        if after != tags:
            before = text if os.path.lexists(path) else None
            changes.append(Change(image, path, before, join_tags(after) + "\n"))
    return changes, unreadable


def preview(folder: Path, edit: Edit, limit: int = PREVIEW_ROWS, check: Check | None = None) -> Preview:
    """What ``apply`` would write: the number of captions changed and the first ``limit`` of them."""
    changes, unreadable = plan(folder, edit, check)
    return Preview(len(changes), shown_rows(changes, limit), unreadable)


def shown_rows(changes: list[Change], limit: int) -> list[tuple[str, str, str]]:
    return [(change.image, (change.before or "").strip(), change.after.strip()) for change in changes[:limit]]


def undo_file(folder: Path, undo_dir: Path) -> Path:
    """The folder's one undo file: named by a hash of its resolved path."""
    return Path(undo_dir) / (hashlib.sha256(str(Path(folder).resolve()).encode()).hexdigest()[:16] + ".json")


def apply(folder: Path, edit: Edit, undo_dir: Path, check: Check | None = None) -> Preview:
    """The edit written, each caption atomically, after the undo file that records what it replaces; an edit
    that changes nothing writes nothing (the undo file of the folder's last edit included)."""
    folder = Path(folder)
    changes, unreadable = plan(folder, edit, check)
    if changes:
        record = {"folder": str(folder.resolve()), "edit": asdict(edit),
                  "captions": [{"image": c.image, "before": c.before, "after": c.after} for c in changes]}
        sd.files.write_json_atomic(undo_file(folder, undo_dir), record)
        for change in changes:
            sd.files.write_text_atomic(change.path, change.after)
    return Preview(len(changes), shown_rows(changes, PREVIEW_ROWS), unreadable)


def recorded(folder: Path, record, check: Check | None = None) -> list[tuple[Path, str | None, str]]:
    """``(caption file, text before, text the edit wrote)`` of each caption an undo file records, every path
    checked before any is written: relative, without ``..``, through ``check``."""
    def damaged(why: str) -> ValueError:
        return ValueError(f"the undo file of {folder} is not one this studio wrote ({why}); delete it to start afresh")

    if not isinstance(record, dict) or record.get("folder") != str(Path(folder).resolve()):
        raise damaged("another folder's")
    entries = []
    for entry in record.get("captions") or []:
        if not isinstance(entry, dict):
            raise damaged("an entry that is not an object")
        image, before, after = (entry.get(key) for key in ("image", "before", "after"))
        if not (isinstance(image, str) and isinstance(after, str) and isinstance(before, (str, type(None)))):
            raise damaged("an entry without image, before and after")
        if PurePosixPath(image).is_absolute() or ".." in PurePosixPath(image).parts:
            raise damaged(f"image {image!r} outside the folder")
        path = caption_path(folder, image)
        if check is not None:
            check(path)
        entries.append((path, before, after))
    return entries


def undo(folder: Path, undo_dir: Path, check: Check | None = None) -> tuple[int, int]:
    """The folder's last edit undone: ``(captions restored, of them changed again since the edit)``. The texts it
    replaced go back byte for byte and the captions it created are removed, whether changed since or not; the undo
    file is deleted last (a failure part way leaves it, and undoing again finishes the job). A ValueError saying
    "nothing to undo" when no edit of the folder is recorded."""
    folder = Path(folder)
    path = undo_file(folder, undo_dir)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"nothing to undo: no edit of {folder} is recorded") from None
    except ValueError:
        raise ValueError(f"the undo file {path} is not JSON; delete it to start afresh") from None
    entries = recorded(folder, record, check)
    changed_since = 0
    for caption, before, after in entries:
        changed_since += read_caption_file(caption) != after
        if before is None:
            caption.unlink(missing_ok=True)
        else:
            sd.files.write_atomic(caption, lambda tmp, text=before: Path(tmp).write_bytes(text.encode("utf-8")))
    path.unlink()
    return len(entries), changed_since


def edit_from(action, tag, new, min_count, position) -> Edit:
    """An ``Edit`` from the page's values, whatever a client sends (None, text, a float count)."""
    try:
        count = float(min_count or 0)
        if not count.is_integer():
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"min count {min_count!r}: a whole number of images, e.g. 2") from None
    return Edit(str(action or ""), str(tag or ""), str(new or ""), int(count), str(position or "end"))


class TagPage:
    """The section's handlers, functions of the widgets' plain values: each resolves the folder inside the studio's
    roots (``studio.roots.check``) and every caption path through the same check; an error comes back as the
    status line and nothing is written. Apply and undo run one at a time."""

    def __init__(self, studio):
        self.roots = studio.roots
        self.undo_dir = Path(studio.workdir) / ".studio" / "tag_undo"
        self.writing = threading.Lock()

    def folder(self, path) -> Path:
        if not path:
            raise ValueError("image folder: empty; give the folder holding the images")
        folder = self.roots.check(str(path))
        if not folder.is_dir():
            raise ValueError(f"{path} is not a folder; give the folder holding the images")
        return folder

    def count(self, path) -> tuple[list[list], str]:
        try:
            rows = tag_counts(self.folder(path), self.roots.check)
        except (ValueError, TypeError, OSError) as error:
            return [], refused(error)
        shown = f" (the first {TABLE_ROWS} shown)" if len(rows) > TABLE_ROWS else ""
        return [[tag, n, round(share, 4)] for tag, n, share in rows[:TABLE_ROWS]], f"{len(rows)} tags{shown}"

    def preview(self, path, action, tag, new, min_count, position) -> tuple[list[list], str]:
        try:
            shown = preview(self.folder(path), edit_from(action, tag, new, min_count, position),
                            check=self.roots.check)
        except (ValueError, TypeError, OSError) as error:
            return [], refused(error)
        return [list(row) for row in shown.rows], f"{shown.changed} captions would change" + notes(shown)

    def apply(self, path, action, tag, new, min_count, position) -> tuple[list[list], str]:
        try:
            edit = edit_from(action, tag, new, min_count, position)
            with self.writing:
                done = apply(self.folder(path), edit, self.undo_dir, self.roots.check)
        except (ValueError, TypeError, OSError) as error:
            return [], refused(error)
        if not done.changed:
            return [], "nothing to change: no caption would differ" + notes(done)
        return [list(row) for row in done.rows], (f"changed {done.changed} captions; **Undo the last edit** puts "
                                                  "them back" + notes(done))

    def undo(self, path) -> str:
        try:
            with self.writing:
                restored, changed_since = undo(self.folder(path), self.undo_dir, self.roots.check)
        except (ValueError, TypeError, OSError) as error:
            return refused(error)
        since = f" ({changed_since} had changed since the edit: their later text is gone)" if changed_since else ""
        return f"restored {restored} captions{since}"


def refused(error: Exception) -> str:
    return f"**not written:** {error}"


def notes(shown: Preview) -> str:
    first = f" (the first {len(shown.rows)} shown)" if 0 < len(shown.rows) < shown.changed else ""
    unreadable = (f"; {shown.unreadable} captions are not UTF-8 text (or not a file, or over "
                  f"{MAX_CAPTION_BYTES} bytes) and are left alone") if shown.unreadable else ""
    return first + unreadable


def section(gr, studio, folder_box) -> None:
    """The Data page's "Bulk tag edit" accordion over the folder in ``folder_box``; called inside its Blocks."""
    page = TagPage(studio)
    with gr.Accordion("Bulk tag edit", open=False, elem_id="tags-section"):
        gr.Markdown("One change to every caption (`photo.txt` beside `photo.jpg`) of the image folder above: "
                    + "; ".join(f"**{name}**: {what}" for name, what in ACTIONS.items())
                    + ". **Preview** shows what **Apply** writes; **Undo the last edit** puts the captions back.",
                    elem_id="tags-help")
        count = gr.Button("Count tags", elem_id="tags-count")
        table = gr.Dataframe(headers=["tag", "images", "share"], label="tags, most frequent first",
                             interactive=False, elem_id="tags-table")
        with gr.Row():
            action = gr.Dropdown(list(ACTIONS), value="replace", label="action", elem_id="tags-action")
            tag = gr.Textbox(label="tag", elem_id="tags-tag")
            new = gr.Textbox(label="new tag (replace)", elem_id="tags-new")
            min_count = gr.Number(label="min count (drop_rare)", value=2, precision=0, minimum=2, elem_id="tags-min")
            position = gr.Radio(list(POSITIONS), value="end", label="position (add)", elem_id="tags-position")
        with gr.Row():
            show = gr.Button("Preview", elem_id="tags-preview")
            write = gr.Button("Apply", variant="primary", elem_id="tags-apply")
            back = gr.Button("Undo the last edit", elem_id="tags-undo")
        status = gr.Markdown(elem_id="tags-status")
        changes = gr.Dataframe(headers=["image", "before", "after"], label="captions changed", wrap=True,
                               interactive=False, elem_id="tags-preview-table")
    settings = [folder_box, action, tag, new, min_count, position]
    count.click(page.count, [folder_box], [table, status], api_name="tags_count")
    show.click(page.preview, settings, [changes, status], api_name="tags_preview")
    write.click(page.apply, settings, [changes, status], api_name="tags_apply")
    back.click(page.undo, [folder_box], [status], api_name="tags_undo")

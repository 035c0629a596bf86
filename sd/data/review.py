"""A dataset's captions laid out for reading before training: contact sheets and a tag-frequency table.

``ContactSheets`` takes ``(image, caption)`` pairs one at a time and writes a PNG page every
``columns x rows`` of them (``sheet_0001.png``...), each image as a thumbnail above its caption, wrapped;
only one page is held in memory. ``write_tag_table`` writes ``tags.csv``: each tag (a caption's
comma-separated piece) with the images carrying it and their share, most frequent first.
"""

from __future__ import annotations

import csv
import io
import textwrap
from collections import Counter
from pathlib import Path

import sd.files

THUMBNAIL = 256  # a thumbnail's longest side in pixels
CAPTION_LINES = 6  # lines of caption text under a thumbnail; a longer caption ends in "..."
FONT_SIZE = 13
MARGIN = 8


def font(size: int = FONT_SIZE):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow before 10.1: the fixed bitmap font
        return ImageFont.load_default()


class ContactSheets:
    """PNG pages of thumbnails with their captions under ``folder``; ``add`` each pair, then ``close``."""

    def __init__(self, folder: Path, columns: int = 5, rows: int = 4, max_pages: int | None = None):
        self.folder, self.columns, self.rows, self.max_pages = Path(folder), columns, rows, max_pages
        self.font = font()
        self.line_height = FONT_SIZE + 3
        self.chars = max(12, int(THUMBNAIL / (FONT_SIZE * 0.55)))  # characters a line holds, roughly
        self.cell = (THUMBNAIL + MARGIN, THUMBNAIL + CAPTION_LINES * self.line_height + 2 * MARGIN)
        self.pending: list = []
        self.pages: list[Path] = []

    @property
    def full(self) -> bool:
        return self.max_pages is not None and len(self.pages) >= self.max_pages

    def add(self, image, caption: str, name: str = "") -> None:
        """One PIL image (or None for one that could not be read) with its caption and, if given, its name."""
        if self.full:
            return
        thumbnail = None
        if image is not None:  # scaled to fill the cell's square, up or down, its aspect ratio kept
            from PIL import ImageOps

            thumbnail = ImageOps.contain(image.convert("RGB"), (THUMBNAIL, THUMBNAIL))
        self.pending.append((thumbnail, caption, name))
        if len(self.pending) == self.columns * self.rows:
            self.flush()

    def flush(self) -> None:
        from PIL import Image, ImageDraw

        if not self.pending or self.full:
            self.pending = []
            return
        rows = -(-len(self.pending) // self.columns)
        width, height = self.cell
        page = Image.new("RGB", (self.columns * width + MARGIN, rows * height + MARGIN), "white")
        draw = ImageDraw.Draw(page)
        for i, (thumbnail, caption, name) in enumerate(self.pending):
            x, y = MARGIN + (i % self.columns) * width, MARGIN + (i // self.columns) * height
            if thumbnail is None:
                draw.rectangle((x, y, x + THUMBNAIL - 1, y + THUMBNAIL - 1), outline="red")
                draw.text((x + 4, y + 4), "(unreadable)", fill="red", font=self.font)
            else:
                page.paste(thumbnail, (x + (THUMBNAIL - thumbnail.width) // 2, y + (THUMBNAIL - thumbnail.height) // 2))
            lines = caption_lines(caption, self.chars, CAPTION_LINES - bool(name))
            if name:
                lines = [shorten(name, self.chars)] + lines
            for j, line in enumerate(lines):
                colour = "grey" if name and j == 0 else "black"
                draw.text((x, y + THUMBNAIL + 4 + j * self.line_height), line, fill=colour, font=self.font)
        path = self.folder / f"sheet_{len(self.pages) + 1:04d}.png"
        self.folder.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        page.save(buffer, format="PNG", optimize=True)
        sd.files.write_atomic(path, lambda tmp: Path(tmp).write_bytes(buffer.getvalue()))
        self.pages.append(path)
        self.pending = []

    def close(self) -> list[Path]:
        self.flush()
        return self.pages


def shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def caption_lines(caption: str, width: int, lines: int) -> list[str]:
    """``caption`` wrapped to ``width`` characters, at most ``lines`` lines, the last ending in "..." when cut."""
    wrapped = textwrap.wrap(caption or "(no caption)", width) or [""]
    if len(wrapped) > lines:
        wrapped = wrapped[:lines]
        wrapped[-1] = shorten(wrapped[-1] + " ...", width) if len(wrapped[-1]) + 4 > width else wrapped[-1] + " ..."
    return wrapped


def write_tag_table(path: Path, counts: Counter, images: int) -> None:
    """``tags.csv``: ``tag,images,share`` per tag, most frequent first (ties by name)."""
    def write(tmp):
        with open(tmp, "w", newline="", encoding="utf-8") as file:
            writer = csv.writer(file)
            writer.writerow(["tag", "images", "share"])
            for tag, n in sorted(counts.items(), key=lambda pair: (-pair[1], pair[0])):
                writer.writerow([tag, n, f"{n / max(images, 1):.4f}"])

    path.parent.mkdir(parents=True, exist_ok=True)
    sd.files.write_atomic(path, write)

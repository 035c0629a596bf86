"""Preference pairs drawn from a model and judged: the folder ``pipeline/01g_draw_pairs.py`` draws into and the
studio's Prefer page answers in.

A draw folder ``OUT`` holds:

* ``candidates.jsonl``: one line per prompt, in prompt order, appended once that prompt's images are written:
  ``{"index": i, "prompt": "...", "images": ["candidates/000000_0.png", ...] (relative to OUT), "seeds": [...],
  "model": "...", "sampler": "...", "steps": N, "cfg": x, "width": W, "height": H}``;
* ``choices.jsonl``: the user's answers, one line each, appended and flushed to storage as it is given:
  ``{"index": i, "a": 0, "b": 1, "choice": "a" | "b" | "tie" | "skip", "at": "ISO time"}``. The last line of a
  question wins (an answer given again replaces the earlier one). The questions of prompt ``i`` are the pairs
  ``(a, b)``, ``a < b``, of its images, in order: one for two images, K(K-1)/2 for K.

A line cut off by a crash (no newline at the end) is not an answer; every whole line is.

``pipeline/01g_draw_pairs.py`` also keeps there ``scores.jsonl`` (a scorer's scores of each prompt's images) and
``shards/`` (the pairs as webdataset shards), both its own.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

CANDIDATES = "candidates.jsonl"
CHOICES = "choices.jsonl"
ANSWERS = ("a", "b", "tie", "skip")  # a: the first image is better; b: the second; tie; skip: not judged


class PreferenceError(ValueError):
    """A draw folder that cannot be read: the message names the file and line."""


def read_lines(path: Path) -> list[dict]:
    """The whole JSON lines of ``path`` (a last line without its newline, cut off by a crash, is left out)."""
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    whole = lines[:-1]  # the part after the last newline is empty, or a line not finished
    records = []
    for number, line in enumerate(whole, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise PreferenceError(f"{path}:{number}: not a JSON line ({error.msg})") from None
        if not isinstance(record, dict):
            raise PreferenceError(f"{path}:{number}: not a JSON object")
        records.append(record)
    return records


def read_candidates(folder: str | Path) -> list[dict]:
    """The prompts of a draw folder with their images, in prompt order (the last line of an index wins)."""
    path = Path(folder) / CANDIDATES
    by_index: dict[int, dict] = {}
    for number, record in enumerate(read_lines(path), 1):
        if not isinstance(record.get("index"), int) or not isinstance(record.get("images"), list):
            raise PreferenceError(f"{path}: line {number} has no integer index or no list of images")
        by_index[record["index"]] = record
    return [by_index[i] for i in sorted(by_index)]


def questions(candidates: list[dict]) -> list[tuple[int, int, int]]:
    """``(prompt index, a, b)`` of every pair of images to judge, in order."""
    return [(record["index"], a, b) for record in candidates
            for a in range(len(record["images"])) for b in range(a + 1, len(record["images"]))]


def read_choices(folder: str | Path) -> dict[tuple[int, int, int], str]:
    """The answer to each judged question, by ``(index, a, b)`` (the last given)."""
    path = Path(folder) / CHOICES
    answers = {}
    for number, record in enumerate(read_lines(path), 1):
        try:
            key = (int(record["index"]), int(record["a"]), int(record["b"]))
        except (KeyError, TypeError, ValueError):
            raise PreferenceError(f"{path}: line {number} lacks index, a or b") from None
        if record.get("choice") not in ANSWERS:
            raise PreferenceError(f"{path}: line {number}: choice must be one of {', '.join(ANSWERS)}")
        answers[key] = record["choice"]
    return answers


def append_choice(folder: str | Path, index: int, a: int, b: int, choice: str) -> dict:
    """Record one answer: a line appended to ``choices.jsonl`` and flushed to storage before this returns."""
    if choice not in ANSWERS:
        raise PreferenceError(f"choice must be one of {', '.join(ANSWERS)}, got {choice!r}")
    record = {"index": int(index), "a": int(a), "b": int(b), "choice": choice,
              "at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    append_line(Path(folder) / CHOICES, record)
    return record


def append_line(path: Path, record: dict) -> None:
    """``record`` appended to the JSON lines file ``path`` and flushed to storage before this returns. A line cut
    off by a crash (no newline at the end) is removed first: ended by a newline it would read as a whole line, one
    that is not JSON."""
    if path.exists() and path.stat().st_size:
        with open(path, "rb") as file:
            file.seek(-1, os.SEEK_END)
            whole = file.read(1) == b"\n"  # the last byte alone: the file is read whole only after a crash
        if not whole:
            data = path.read_bytes()
            os.truncate(path, data.rfind(b"\n") + 1)
    with open(path, "a", encoding="utf-8") as file:
        file.write(json.dumps(record) + "\n")
        file.flush()
        os.fsync(file.fileno())


def append_candidate(folder: str | Path, record: dict) -> None:
    """Record one prompt's drawn images (``candidates.jsonl``'s line, see above), once they are all written."""
    missing = [name for name in ("index", "prompt", "images", "seeds") if name not in record]
    if missing:
        raise PreferenceError(f"a candidates line needs {', '.join(missing)}")
    append_line(Path(folder) / CANDIDATES, record)


def judged_pairs(candidates: list[dict], answers: dict) -> list[tuple[int, int, int]]:
    """``(index, preferred, rejected)`` of every question answered a or b, in question order."""
    pairs = []
    for key in questions(candidates):
        choice = answers.get(key)
        if choice == "a":
            pairs.append((key[0], key[1], key[2]))
        elif choice == "b":
            pairs.append((key[0], key[2], key[1]))
    return pairs

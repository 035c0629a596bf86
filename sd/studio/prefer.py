"""The Prefer page: the user's own choice between two images of a draw folder, the answers that
``pipeline/01g_draw_pairs.py --scorer user`` turns into preference (Diffusion-DPO) pair shards.

A draw folder is ``sd.data.preference``'s (``candidates.jsonl`` from 01g, ``choices.jsonl`` the answers), read
and written only through its functions. It is read afresh at every call: a reload, or a studio started again,
continues at the first unanswered question, and 01g may still be adding prompts. Every value a client sends is
checked where it enters, as ``Studio``'s handlers check theirs: the folder resolves inside the studio's roots
and holds ``candidates.jsonl`` (its ``choices.jsonl`` and each image shown lie inside the roots too, links
followed), the question is one the folder asks, the side one of ``SIDES``; anything else is answered with
``{"error": ...}`` and nothing is written. An answer is on storage (``append_choice`` flushes it) before the
call returns. Which image of a question is shown on the left is decided by a hash of the question
(``shows_a_left``), the same at every visit, so a habit of picking one side does not become a preference; the
answer is recorded in the file's a/b terms.

The pairs command is 01g's own over the folder, with ``--scorer user`` and the drawing settings the folder was
drawn with (01g refuses a re-run with others), and its drawn prompts (a .csv the studio keeps in ROOT/.studio/
prompts/, since the folder does not name the prompts file): every prompt is drawn already, so no model is
loaded; the answers become pair shards in DIR/shards/.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import sd.data.stages
import sd.files
from sd.data.preference import CANDIDATES, CHOICES, append_choice, questions, read_candidates, read_choices
from sd.studio.jobs import python_command, shown
from sd.studio.runs import Roots

SIDES = ("left", "right", "tie", "skip")  # what the page's buttons say; left/right become a/b per question
SCRIPT = "pipeline/01g_draw_pairs.py"
# The drawing settings 01g records (its settings file's keys) and passes on a re-run, which must repeat them.
MODEL_FLAGS = ("--model", "--vae", "--text_encoder")  # a model: a path inside the roots, or a hub id
VALUE_FLAGS = ("--sampler", "--steps", "--cfg", "--width", "--height", "--seed", "--per_prompt", "--negative",
               "--clip_skip")
SWITCHES = ("--no_ema",)
FROM_CANDIDATES = ("model", "sampler", "steps", "cfg")  # what a candidates.jsonl line records of them
JOB = "prefer"
SEARCH_DEPTH = 4  # folders below a root looked into for draw folders
SEARCH_LIMIT = 200  # draw folders listed at most
QUESTION = re.compile(r"([0-9]+):([0-9]+):([0-9]+)")
# The page's keys: a document-wide listener, acting only while the Prefer page is the one shown and no text
# field has the focus; it clicks the button, so a key does exactly what the button does.
KEYS = """
if (!window.sdStudioPreferKeys) {
  window.sdStudioPreferKeys = true;
  const buttons = {"1": "prefer-left-button", "ArrowLeft": "prefer-left-button", "2": "prefer-right-button",
                   "ArrowRight": "prefer-right-button", "t": "prefer-tie", "s": "prefer-skip", "u": "prefer-back",
                   "Backspace": "prefer-back"};
  document.addEventListener("keydown", (event) => {
    const id = buttons[event.key.length === 1 ? event.key.toLowerCase() : event.key];
    if (!id || event.ctrlKey || event.metaKey || event.altKey || event.repeat) return;
    const target = event.target;
    if (target && (target.isContentEditable || ["INPUT", "TEXTAREA", "SELECT"].includes(target.tagName))) return;
    const button = document.getElementById(id);
    if (!button || button.offsetParent === null || button.disabled) return;
    event.preventDefault();
    button.click();
  });
}
"""


def question_text(key: tuple[int, int, int]) -> str:
    """A question as the page and the API name it: ``"prompt index:a:b"``."""
    return ":".join(str(number) for number in key)


def parse_question(text) -> tuple[int, int, int]:
    match = QUESTION.fullmatch(str(text or "").strip())
    if match is None:
        raise ValueError(f"question {text!r}: 'prompt index:a:b' (e.g. 3:0:1)")
    return tuple(int(number) for number in match.groups())


def shows_a_left(record: dict, a: int, b: int) -> bool:
    """Whether image ``a`` of the question (``record``'s prompt, images ``a`` and ``b``) is shown on the left: a
    bit of a hash of the prompt's index and text and the pair, the same in every session and on every machine."""
    digest = hashlib.sha256(json.dumps([record["index"], record.get("prompt", ""), a, b]).encode("utf-8")).digest()
    return digest[0] & 1 == 0


def recorded_choice(side: str, a_on_left: bool) -> str:
    """The answer in the file's terms (a, b, tie, skip) for a ``side`` the page gave."""
    if side not in SIDES:
        raise ValueError(f"side {side!r}: one of {', '.join(SIDES)}")
    if side in ("left", "right"):
        return "a" if (side == "left") == a_on_left else "b"
    return side


def side_of(choice: str, a_on_left: bool) -> str:
    """The page's side for an answer recorded as ``choice`` (``recorded_choice``'s inverse)."""
    if choice in ("a", "b"):
        return "left" if (choice == "a") == a_on_left else "right"
    return choice


def find_draw_folders(roots: Roots, depth: int = SEARCH_DEPTH, limit: int = SEARCH_LIMIT) -> list[Path]:
    """The folders holding ``candidates.jsonl`` under the roots, at most ``depth`` below one, sorted: no hidden
    folder is looked into, no link followed, nothing below a draw folder, at most ``limit`` of them."""
    found: set[Path] = set()
    for root in roots.folders:
        stack = [(root, 0)]
        while stack and len(found) < limit:
            folder, level = stack.pop()
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue
            if any(entry.name == CANDIDATES and entry.is_file() for entry in entries):
                found.add(folder)
                continue
            if level < depth:
                stack += [(Path(entry.path), level + 1) for entry in entries
                          if not entry.name.startswith(".") and entry.is_dir(follow_symlinks=False)]
    return sorted(found)


@dataclass
class Draw:
    """One draw folder as read now: its prompts by index, its questions in order and their answers."""
    folder: Path
    prompts: dict[int, dict]
    keys: list[tuple[int, int, int]]
    answers: dict[tuple[int, int, int], str]

    def first_open(self) -> int:
        """The position of the first unanswered question; ``len(keys)`` when every one is answered."""
        return next((i for i, key in enumerate(self.keys) if key not in self.answers), len(self.keys))

    def position(self, question) -> int:
        key = parse_question(question)
        if key not in self.keys:
            raise ValueError(f"question {question!r} is not one of {self.folder}'s")
        return self.keys.index(key)

    @property
    def answered(self) -> int:
        return sum(key in self.answers for key in self.keys)


class View(NamedTuple):
    """What the page shows, in the order of its outputs."""
    progress: str  # "12 of 40 answered" (Markdown)
    prompt: str
    left: str | None  # image files inside the roots
    right: str | None
    question: str  # "index:a:b" of the question shown, "" when none is
    result: dict  # {"written": record}, {"folder": ...}, or {"error": why}
    command: str  # the command that makes the pair shards (or why there is none)


EMPTY = View("", "", None, None, "", {}, "")


class PreferPage:
    """The Prefer page's handlers over a studio's roots; its pairs command runs as the studio's job ``prefer``."""

    def __init__(self, studio):
        self.studio, self.roots = studio, studio.roots
        self.writing = threading.Lock()  # one answer at a time: Gradio runs each button's calls in its own thread

    def read(self, path) -> Draw:
        """The draw folder ``path`` names (or its ``candidates.jsonl``), checked; a ValueError says what is refused."""
        if not isinstance(path, (str, Path)) or not str(path).strip():
            raise ValueError("pick a draw folder (one holding candidates.jsonl)")
        folder = self.roots.check(str(path).strip())
        if folder.name == CANDIDATES and folder.is_file():
            folder = folder.parent
        if not (folder / CANDIDATES).is_file():
            raise ValueError(f"{path} holds no {CANDIDATES}: not a draw folder (pipeline/01g_draw_pairs.py makes one)")
        for name in (CANDIDATES, CHOICES):  # a link out of the roots is neither read nor written
            self.roots.check(folder / name)
        candidates = read_candidates(folder)
        return Draw(folder, {record["index"]: record for record in candidates}, questions(candidates),
                    read_choices(folder))

    # -- the page's calls ----------------------------------------------------------------------------------------
    def folder_choices(self) -> list[str]:
        """The draw folders under the roots, as the folder field takes them (relative to the first root there)."""
        first = self.roots.folders[0]
        return [str(folder.relative_to(first)) if first in folder.parents else str(folder)
                for folder in find_draw_folders(self.roots)]

    def open(self, path) -> View:
        """The folder's first unanswered question."""
        try:
            draw = self.read(path)
        except (ValueError, OSError) as error:  # OutsideRoots and PreferenceError are ValueErrors
            return EMPTY._replace(result={"error": str(error)})
        return self.view(draw, draw.first_open(), {"folder": str(draw.folder)})

    def answer(self, path, question, side) -> View:
        """``side`` (left, right, tie, skip) written as the answer to ``question``, then the first unanswered one."""
        with self.writing:
            try:
                draw = self.read(path)
            except (ValueError, OSError) as error:
                return EMPTY._replace(result={"error": str(error)})
            try:
                key = draw.keys[draw.position(question)]
                choice = recorded_choice(side, shows_a_left(draw.prompts[key[0]], key[1], key[2]))
                record = append_choice(draw.folder, *key, choice)
            except (ValueError, OSError) as error:
                return self.refused(draw, question, error)
        draw.answers[key] = choice
        return self.view(draw, draw.first_open(), {"written": record, "side": side})

    def back(self, path, question) -> View:
        """The question before ``question`` (the last one when every one is answered and none is shown), to be
        answered again: the new answer replaces the earlier one (the file's last line for a question wins)."""
        try:
            draw = self.read(path)
        except (ValueError, OSError) as error:
            return EMPTY._replace(result={"error": str(error)})
        try:
            position = draw.position(question) if str(question or "").strip() else len(draw.keys)
        except ValueError as error:
            return self.refused(draw, question, error)
        return self.view(draw, max(position - 1, 0), {"folder": str(draw.folder)})

    def make_pairs(self, path) -> str:
        """``01g_draw_pairs.py --scorer user`` over the folder, run as the job ``prefer``: its command, shown."""
        try:
            command = self.pairs_command(self.read(path))
        except (ValueError, OSError) as error:
            return f"# not started: {error}"
        return self.studio.start(JOB, [command])

    def job_status(self) -> tuple[str, str]:
        return self.studio.status(JOB)

    # -- what they show ------------------------------------------------------------------------------------------
    def refused(self, draw: Draw, question, error: Exception) -> View:
        """The question asked again (the first unanswered when it is not one of the folder's), and why not."""
        try:
            position = draw.position(question)
        except ValueError:
            position = draw.first_open()
        return self.view(draw, position, {"error": str(error)})

    def view(self, draw: Draw, position: int, result: dict) -> View:
        total, answered = len(draw.keys), draw.answered
        progress = f"**{answered} of {total} answered**"
        try:
            command = shown(self.pairs_command(draw))
        except (ValueError, OSError) as error:
            command = f"# no command: {error}"
        if position >= total:
            note = "every question is answered: make the pair shards below" if total else \
                "no question yet: no prompt of candidates.jsonl has two images"
            return View(f"{progress}; {note}", "", None, None, "", result, command)
        key = draw.keys[position]
        record = draw.prompts[key[0]]
        a_on_left = shows_a_left(record, key[1], key[2])
        left, right = (key[1], key[2]) if a_on_left else (key[2], key[1])
        images, problems = [], []
        for number in (left, right):
            try:
                images.append(str(self.image(draw, record, number)))
            except ValueError as error:
                images.append(None)
                problems.append(str(error))
        if key in draw.answers:
            progress += f"; this one was answered: {side_of(draw.answers[key], a_on_left)}"
        if problems:
            result = {**result, "images": problems}
        return View(progress, str(record.get("prompt", "")), images[0], images[1], question_text(key), result, command)

    def image(self, draw: Draw, record: dict, number: int) -> Path:
        """Image ``number`` of a prompt: a file named relative to the folder, inside the roots."""
        rel = record["images"][number]
        if not isinstance(rel, str) or Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise ValueError(f"prompt {record['index']}: image {rel!r} is not a path inside {draw.folder}")
        path = self.roots.check(draw.folder / rel)
        if not path.is_file():
            raise ValueError(f"prompt {record['index']}: {rel} is missing")
        return path

    def pairs_command(self, draw: Draw) -> list[str]:
        """``01g_draw_pairs.py --scorer user`` over the folder with the drawing settings it was drawn with (a re-run
        with others is refused) and its drawn prompts: nothing is drawn again, the answers become pair shards."""
        models, values = drawing_flags(draw, self.roots)
        return python_command(SCRIPT, *models, "--prompts", self.prompts_file(draw), "--out", draw.folder,
                              "--scorer", "user", *values)

    def prompts_file(self, draw: Draw) -> Path:
        """The drawn prompts in index order, a .csv with a ``caption`` column as 01g's ``--prompts`` reads it (any
        letter, a line break too), kept in ROOT/.studio/prompts/ and written again only when they changed."""
        indexes = sorted(draw.prompts)
        gap = next((i for i, index in enumerate(indexes) if i != index), None)
        if gap is not None:
            raise ValueError(f"{draw.folder / CANDIDATES} has no prompt {gap} but later ones: run 01g with the prompts "
                             "file it was drawn from")
        prompts = [draw.prompts[index].get("prompt") for index in indexes]
        if not all(isinstance(prompt, str) and prompt.strip() for prompt in prompts):
            raise ValueError(f"{draw.folder / CANDIDATES}: every prompt must be text")
        table = io.StringIO()
        csv.writer(table, lineterminator="\n").writerows([["caption"], *([prompt] for prompt in prompts)])
        digest = hashlib.sha256(str(draw.folder).encode("utf-8")).hexdigest()[:12]
        path = self.studio.workdir / ".studio" / "prompts" / f"{draw.folder.name}-{digest}.csv"
        if not path.is_file() or path.read_text(encoding="utf-8") != table.getvalue():
            path.parent.mkdir(parents=True, exist_ok=True)
            sd.files.write_text_atomic(path, table.getvalue())
        return path


def recorded_settings(draw: Draw) -> dict:
    """The drawing settings 01g keeps in the folder (``{"--model": ..., "--steps": ...}``, written before its first
    image), else what candidates.jsonl records of them (a folder from before the settings file)."""
    path = sd.data.stages.settings_path(draw.folder, Path(SCRIPT).stem)
    if path.is_file():
        try:
            settings = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ValueError(f"{path} is unreadable ({error})") from None
        if not isinstance(settings, dict):
            raise ValueError(f"{path} is not a JSON object")
        return settings
    first = draw.prompts[min(draw.prompts)] if draw.prompts else {}
    return {f"--{name}": first.get(name) for name in FROM_CANDIDATES}


def drawing_flags(draw: Draw, roots: Roots) -> tuple[list[str], list[str]]:
    """The recorded drawing settings as 01g's flags: ``(model flags, the others)``. A model, VAE or text encoder is
    checked as a typed one is (inside the roots, or a hub id) and passed as recorded, since 01g compares the
    text; a value starting with '-' is passed as ``--flag=value``, so it never reads as a flag of its own."""
    settings = recorded_settings(draw)
    models, values = [], []
    for flag in MODEL_FLAGS + VALUE_FLAGS:
        value = settings.get(flag)
        if value is None or value == "":
            continue
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ValueError(f"the recorded {flag} {value!r} is not a value of that flag")
        text = str(value)
        if flag in MODEL_FLAGS:
            try:
                roots.source(text)
            except ValueError as error:
                raise ValueError(f"the recorded {flag}: {error}") from None
        (models if flag in MODEL_FLAGS else values).extend([f"{flag}={text}"] if text.startswith("-") else [flag, text])
    values += [flag for flag in SWITCHES if settings.get(flag) is True]
    return models, values


def page(gr, studio, polls: list, tab) -> None:
    """The Prefer page: a draw folder, its progress, the two images of a question, the answer buttons and keys,
    the command that makes the pair shards and its job."""
    prefer = PreferPage(studio)
    gr.Markdown("Your own choice between two images of a draw folder (`pipeline/01g_draw_pairs.py`): keys "
                "**1** or **←** the left is better, **2** or **→** the right, **t** a tie, **s** skip, **u** or "
                "**Backspace** back to the previous question (a new answer replaces the old). Each answer is written "
                "to the folder's `choices.jsonl` at once; opening the folder again continues where you stopped.")
    with gr.Row():
        folder = gr.Dropdown([], value="", allow_custom_value=True, label="draw folder (holding candidates.jsonl)",
                             elem_id="prefer-folder", scale=4)
        find = gr.Button("Find draw folders", elem_id="prefer-find")
        show = gr.Button("Open", variant="primary", elem_id="prefer-open")
    progress = gr.Markdown(elem_id="prefer-progress")
    prompt = gr.Textbox(label="prompt", interactive=False, elem_id="prefer-prompt")
    with gr.Row():
        left = gr.Image(label="left", type="filepath", interactive=False, elem_id="prefer-left")
        right = gr.Image(label="right", type="filepath", interactive=False, elem_id="prefer-right")
    with gr.Row():
        buttons = {"left": gr.Button("1 / ← left is better", elem_id="prefer-left-button"),
                   "right": gr.Button("2 / → right is better", elem_id="prefer-right-button"),
                   "tie": gr.Button("t: tie", elem_id="prefer-tie"),
                   "skip": gr.Button("s: skip", elem_id="prefer-skip")}
        back = gr.Button("u / Backspace: back", elem_id="prefer-back")
    question = gr.Textbox(label="question (prompt index:image a:image b)", interactive=False, elem_id="prefer-question")
    result = gr.JSON(label="last answer", elem_id="prefer-result")
    command = gr.Code(label="command: the answers into pair shards", language="shell", elem_id="prefer-command")
    make = gr.Button("Make the pair shards", elem_id="prefer-make")
    state = gr.Textbox(label="state", interactive=False, elem_id="prefer-state")
    log = gr.Textbox(label="log", lines=6, max_lines=6, autoscroll=True, elem_id="prefer-log")
    gr.HTML("", js_on_load=KEYS, elem_id="prefer-keys")
    shown_view = [progress, prompt, left, right, question, result, command]

    def answer_with(side):
        return lambda path, asked: prefer.answer(path, asked, side)

    def folders():
        return gr.Dropdown(choices=prefer.folder_choices())

    tab.select(folders, [], [folder], api_name="prefer_folders")
    find.click(folders, [], [folder], api_name="prefer_find")
    show.click(prefer.open, [folder], shown_view, api_name="prefer_open")
    for side, button in buttons.items():
        button.click(answer_with(side), [folder, question], shown_view, api_name=f"prefer_{side}")
    back.click(prefer.back, [folder, question], shown_view, api_name="prefer_back")
    make.click(prefer.make_pairs, [folder], [command], api_name="prefer_pairs")
    polls.append((prefer.job_status, [], [state, log]))

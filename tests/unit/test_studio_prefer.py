"""sd.studio.prefer: the Prefer page's questions in order, each answer on storage before the call returns, back
and a new answer that replaces, a new studio that continues where the last stopped, the sides shown mapped back
to the file's a/b, and every value a client sends checked where it enters (nothing written when refused, nothing
answered or shown without the login when the studio listens behind its token)."""

import http.cookiejar
import json
import socket
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from PIL import Image

from sd.data.preference import read_choices
from sd.studio.handlers import Studio
from sd.studio.prefer import PreferPage, find_draw_folders, recorded_choice, shows_a_left
from sd.studio.runs import Roots

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = "outside the folders this studio was started with"
PROMPTS = [("a red cat", 2), ("a blue dog", 3), ("a green bird", 4)]  # 1 + 3 + 6 questions
ORDER = ["0:0:1", "1:0:1", "1:0:2", "1:1:2", "2:0:1", "2:0:2", "2:0:3", "2:1:2", "2:1:3", "2:2:3"]


def write_draw(folder: Path, model: str = "stable-diffusion-v1-5/stable-diffusion-v1-5") -> Path:
    """A draw folder as 01g writes one: a tiny PNG per image, one candidates.jsonl line per prompt."""
    (folder / "candidates").mkdir(parents=True)
    lines = []
    for index, (prompt, count) in enumerate(PROMPTS):
        images = []
        for k in range(count):
            rel = f"candidates/{index:06d}_{k}.png"
            Image.new("RGB", (8, 8), (40 * index, 60 * k, 0)).save(folder / rel)
            images.append(rel)
        lines.append(json.dumps({"index": index, "prompt": prompt, "images": images, "seeds": list(range(count)),
                                 "model": model, "sampler": "ddim", "steps": 20, "cfg": 7.5, "width": 8, "height": 8}))
    (folder / "candidates.jsonl").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture
def prefer(tmp_path):
    """The page over a user's folder holding the draw folder draws/cats; jobs are recorded, not run."""
    work = tmp_path / "work"
    write_draw(work / "draws" / "cats")
    write_draw(tmp_path / "elsewhere" / "draw")
    studio = Studio(Roots([work]), ROOT)
    studio.started = []
    studio.start = lambda name, commands, **options: studio.started.append((name, commands)) or f"started {name}"
    return PreferPage(studio)


def folder_of(prefer) -> Path:
    return prefer.studio.workdir / "draws" / "cats"


def image_number(path: str) -> int:
    return int(Path(path).stem.split("_")[1])


def test_the_first_unanswered_question_its_progress_and_command(prefer):
    view = prefer.open("draws/cats")
    assert view.progress == "**0 of 10 answered**" and view.question == "0:0:1" and view.prompt == "a red cat"
    assert view.result == {"folder": str(folder_of(prefer))}
    assert {view.left, view.right} == {str(folder_of(prefer) / f"candidates/000000_{k}.png") for k in (0, 1)}
    prompts = prefer.studio.workdir / ".studio" / "prompts" / next(
        (prefer.studio.workdir / ".studio" / "prompts").iterdir()).name
    assert view.command == (f"python {ROOT}/pipeline/01g_draw_pairs.py --model stable-diffusion-v1-5/"
                            f"stable-diffusion-v1-5 --prompts {prompts} --out {folder_of(prefer)} --scorer user "
                            "--sampler ddim --steps 20 --cfg 7.5")  # what candidates.jsonl records
    assert prefer.open(str(folder_of(prefer) / "candidates.jsonl")).question == "0:0:1"  # the file names its folder


def test_an_answer_is_written_before_the_call_returns_and_the_next_is_shown(prefer):
    first = prefer.open("draws/cats")
    view = prefer.answer("draws/cats", first.question, "left")
    shown_left_was_a = image_number(first.left) == 0
    assert read_choices(folder_of(prefer)) == {(0, 0, 1): "a" if shown_left_was_a else "b"}
    assert view.result["written"]["choice"] == ("a" if shown_left_was_a else "b") and view.result["side"] == "left"
    assert view.question == "1:0:1" and view.progress == "**1 of 10 answered**" and view.prompt == "a blue dog"
    for question in ORDER[1:]:
        view = prefer.answer("draws/cats", question, "skip")
    assert view.question == "" and (view.left, view.right) == (None, None)
    assert view.progress.startswith("**10 of 10 answered**; every question is answered")
    assert "--scorer user" in view.command


def test_back_then_a_new_answer_replaces_the_earlier_one(prefer):
    prefer.answer("draws/cats", "0:0:1", "left")
    prefer.answer("draws/cats", "1:0:1", "tie")
    view = prefer.back("draws/cats", "1:0:2")
    assert view.question == "1:0:1" and view.progress == "**2 of 10 answered**; this one was answered: tie"
    assert prefer.back("draws/cats", "0:0:1").question == "0:0:1"  # the first has none before it
    view = prefer.answer("draws/cats", "1:0:1", "right")
    lines = (folder_of(prefer) / "choices.jsonl").read_text().splitlines()
    assert len(lines) == 3  # appended; the last line of a question wins
    right_is_b = shows_a_left({"index": 1, "prompt": "a blue dog"}, 0, 1)
    assert read_choices(folder_of(prefer))[(1, 0, 1)] == ("b" if right_is_b else "a")
    assert view.question == "1:0:2" and view.progress == "**2 of 10 answered**"
    for question in ORDER[2:]:
        prefer.answer("draws/cats", question, "tie")
    assert prefer.back("draws/cats", "").question == ORDER[-1]  # every one answered: back to the last


def test_a_new_studio_continues_at_the_first_unanswered_question(prefer):
    for question in ORDER[:3]:
        prefer.answer("draws/cats", question, "right")
    again = PreferPage(Studio(Roots([prefer.studio.workdir]), ROOT))
    view = again.open("draws/cats")
    assert view.question == "1:1:2" and view.progress == "**3 of 10 answered**"
    assert len(read_choices(folder_of(prefer))) == 3


def test_the_side_shown_maps_back_to_the_files_a_and_b(prefer):
    """For every question, the image shown on the left is the one the answer "left" records as better; the sides
    are the same at every visit and not always a on the left."""
    folder = folder_of(prefer)
    a_left = []
    for question in ORDER:
        view = prefer.open("draws/cats")
        assert view.question == question and prefer.open("draws/cats")[:5] == view[:5]  # the same at every visit
        side = ["left", "right"][len(a_left) % 2]
        prefer.answer("draws/cats", question, side)
        index, a, b = (int(n) for n in question.split(":"))
        preferred = image_number(view.left if side == "left" else view.right)
        recorded = read_choices(folder)[(index, a, b)]
        assert preferred == (a if recorded == "a" else b), (question, side, recorded)
        a_left.append(image_number(view.left) == a)
    assert True in a_left and False in a_left
    assert [recorded_choice(side, True) for side in ("left", "right", "tie", "skip")] == ["a", "b", "tie", "skip"]
    assert [recorded_choice(side, False) for side in ("left", "right", "tie", "skip")] == ["b", "a", "tie", "skip"]


@pytest.mark.parametrize("path", ["../elsewhere/draw", "{elsewhere}/draw", "draws/../../elsewhere/draw", "draws", "",
                                  None, "link_out", "~/draw"])
def test_a_folder_outside_the_roots_or_not_a_draw_folder_is_refused(prefer, path):
    elsewhere = prefer.studio.workdir.parent / "elsewhere"
    (prefer.studio.workdir / "link_out").symlink_to(elsewhere / "draw")
    path = path.format(elsewhere=elsewhere) if path else path
    for view in (prefer.open(path), prefer.answer(path, "0:0:1", "left"), prefer.back(path, "0:0:1")):
        assert set(view.result) == {"error"} and view.question == "" and view.left is None, view
    if path not in ("draws", "", None):
        assert OUTSIDE in prefer.open(path).result["error"]
    assert prefer.make_pairs(path).startswith("# not started:") and prefer.studio.started == []
    assert not list(prefer.studio.workdir.parent.glob("**/choices.jsonl"))


@pytest.mark.parametrize("question, side", [("9:0:1", "left"), ("0:1:0", "left"), ("0:0:2", "left"), ("x", "left"),
                                            ("", "left"), (None, "left"), ("0:0:1; rm", "left"), ("-1:0:1", "left"),
                                            ("0:0:1", "a"), ("0:0:1", "LEFT"), ("0:0:1", ""), ("0:0:1", None)])
def test_an_unknown_question_or_a_choice_not_allowed_writes_nothing(prefer, question, side):
    view = prefer.answer("draws/cats", question, side)
    assert set(view.result) == {"error"} and view.question == "0:0:1", view  # the question to answer, again
    assert not (folder_of(prefer) / "choices.jsonl").exists()


@pytest.mark.parametrize("question", ["9:0:1", "0:1:0", "x", "0:0:1; rm"])
def test_back_from_an_unknown_question_is_refused(prefer, question):
    view = prefer.back("draws/cats", question)
    assert set(view.result) == {"error"} and view.question == "0:0:1", view


def test_a_choices_file_that_links_out_of_the_roots_is_not_written(prefer):
    target = prefer.studio.workdir.parent / "elsewhere" / "victim.jsonl"
    (folder_of(prefer) / "choices.jsonl").symlink_to(target)
    view = prefer.answer("draws/cats", "0:0:1", "left")
    assert OUTSIDE in view.result["error"] and not target.exists()


def test_an_image_path_that_leaves_the_folder_is_not_shown(prefer):
    folder = folder_of(prefer)
    secret = prefer.studio.workdir.parent / "elsewhere" / "draw" / "candidates" / "000000_0.png"
    record = {"index": 0, "prompt": "x", "images": [str(secret), "../../../elsewhere/draw/candidates/000000_1.png"]}
    (folder / "candidates.jsonl").write_text(json.dumps(record) + "\n")
    view = prefer.open("draws/cats")
    assert (view.left, view.right, view.question) == (None, None, "0:0:1") and len(view.result["images"]) == 2


def test_the_draw_folders_under_the_roots_are_listed(prefer):
    work = prefer.studio.workdir
    write_draw(work / "deep" / "er" / "draw")
    write_draw(work / ".studio" / "hidden")
    (work / "inside_link").symlink_to(work / "draws")
    assert prefer.folder_choices() == ["deep/er/draw", "draws/cats"]
    assert find_draw_folders(Roots([work]), depth=2) == [work / "draws" / "cats"]


def test_the_pairs_command_repeats_the_recorded_drawing_settings_and_runs_as_a_job(prefer):
    """01g's settings file's values (a re-run with others is refused), the drawn prompts in a .csv it reads."""
    import csv

    folder, work = folder_of(prefer), prefer.studio.workdir
    (work / "runs" / "mine").mkdir(parents=True)
    settings = {"--model": str(work / "runs" / "mine"), "--sampler": "dpm++", "--steps": 30, "--cfg": 6.0,
                "--width": None, "--height": 8, "--seed": 7, "--per_prompt": 3, "--negative": "-blurry",
                "--no_ema": True, "--vae": "tiny", "--text_encoder": None, "--clip_skip": 2}
    (folder / "01g_draw_pairs.settings").write_text(json.dumps(settings))
    assert prefer.make_pairs("draws/cats") == "started prefer"
    (name, [words]), = prefer.studio.started
    prompts = work / ".studio" / "prompts" / next((work / ".studio" / "prompts").iterdir()).name
    assert name == "prefer" and words[1] == str(ROOT / "pipeline" / "01g_draw_pairs.py")
    assert words[2:] == ["--model", str(work / "runs" / "mine"), "--vae", "tiny", "--prompts", str(prompts), "--out",
                         str(folder), "--scorer", "user", "--sampler", "dpm++", "--steps", "30", "--cfg", "6.0",
                         "--height", "8", "--seed", "7", "--per_prompt", "3", "--negative=-blurry", "--clip_skip", "2",
                         "--no_ema"]
    with open(prompts, newline="", encoding="utf-8") as handle:
        assert [row["caption"] for row in csv.DictReader(handle)] == [prompt for prompt, _ in PROMPTS]
    for model in ("../elsewhere/model", str(work.parent / "elsewhere")):
        (folder / "01g_draw_pairs.settings").write_text(json.dumps({**settings, "--vae": model}))
        assert OUTSIDE in prefer.make_pairs("draws/cats") and len(prefer.studio.started) == 1
        assert prefer.open("draws/cats").command.startswith("# no command: the recorded --vae:")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(url: str, body: bytes, headers: dict, opener) -> tuple[int, bytes]:
    try:
        with opener.open(urllib.request.Request(url, data=body, headers=headers), timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.mark.slow
def test_without_the_token_nothing_is_answered_or_shown(tmp_path):
    """The studio behind its token (as --listen serves it): an answer, the page's first question and an image of
    the folder are refused before the login and nothing is written; after it the same answer is."""
    import SD_Studio
    from sd.studio.app import build, server_options

    work = tmp_path / "work"
    folder = write_draw(work / "draws" / "cats")
    pages = build(Roots([work]), ROOT)
    port, token = free_port(), "s3cret-tök€n"
    pages.launch(server_name="127.0.0.1", server_port=port, auth=SD_Studio.password_check(token),
                 allowed_paths=[str(work)], prevent_thread_lock=True, quiet=True, app_kwargs=server_options())
    base, json_header = f"http://127.0.0.1:{port}", {"Content-Type": "application/json"}
    answer = json.dumps({"data": ["draws/cats", "0:0:1"]}).encode()
    try:
        stranger = urllib.request.build_opener()
        for name in ("prefer_left", "prefer_open", "prefer_pairs"):
            code, _ = post(f"{base}/gradio_api/call/{name}", answer, json_header, stranger)
            assert code == 401, name
        image = folder / "candidates" / "000000_0.png"
        code, _ = post(f"{base}/gradio_api/file={image}", None, {}, stranger)
        assert code in (401, 403)
        assert not (folder / "choices.jsonl").exists()
        session = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
        login = urllib.parse.urlencode({"username": "studio", "password": token}).encode()
        assert post(f"{base}/login", login, {}, session)[0] == 200
        code, said = post(f"{base}/gradio_api/call/prefer_left", answer, json_header, session)
        assert code == 200
        with session.open(f"{base}/gradio_api/call/prefer_left/{json.loads(said)['event_id']}", timeout=60) as reply:
            assert "event: complete" in reply.read().decode()
        assert list(read_choices(folder)) == [(0, 0, 1)]
        assert post(f"{base}/gradio_api/file={image}", None, {}, session) == (200, image.read_bytes())
    finally:
        pages.close()

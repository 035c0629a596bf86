"""SD_Studio.py in a real browser (headless Chromium from the system's packages, driven by Playwright): a
stranger's folder of captioned images imported and encoded, a tiny run launched, its loss seen, stopped and
resumed, one image sampled and a LoRA trained and exported, each page's screenshot saved in the test's folder.

Chromium comes from the system (``.ci/run`` installs Debian's ``chromium``); ``CHROMIUM`` names another binary.
Without one the test is skipped, saying so.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


def browser_binary() -> str | None:
    if os.environ.get("CHROMIUM"):
        return os.environ["CHROMIUM"]
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def field(page, elem_id: str):
    return page.locator(f"#{elem_id} textarea, #{elem_id} input").first


def set_value(page, elem_id: str, value) -> None:
    box = field(page, elem_id)
    box.fill(str(value))
    box.press("Tab")


def wait_for(page, elem_id: str, predicate, timeout: float = 300, what: str = "") -> str:
    deadline = time.monotonic() + timeout
    value = ""
    while time.monotonic() < deadline:
        value = field(page, elem_id).input_value()
        if predicate(value):
            return value
        time.sleep(0.5)
    raise AssertionError(f"#{elem_id} never {what}: last {value!r}")


@pytest.fixture
def studio(tmp_path):
    """The studio serving a stranger's folder (their images, the repository's configs) on a free port."""
    rng = np.random.default_rng(0)
    images = tmp_path / "my_images"
    images.mkdir()
    for i in range(24):
        colour = [(220, 30, 30), (30, 30, 220)][i % 2]
        pixels = np.clip(np.array(colour) + rng.normal(0, 10, (48, 48, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(images / f"img{i:02d}.png")
        (images / f"img{i:02d}.txt").write_text(["a red picture", "a blue picture"][i % 2])
    (images / "no_caption.png").write_bytes((images / "img00.png").read_bytes())
    subject = tmp_path / "my_subject"
    subject.mkdir()
    for i in range(4):  # the LoRA recipe's batch of 4
        Image.fromarray(np.full((48, 48, 3), (40, 200, 40), np.uint8)).save(subject / f"s{i}.png")
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    port = free_port()
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "OMP_NUM_THREADS": "2"}
    server = subprocess.Popen([sys.executable, str(ROOT / "SD_Studio.py"), "--port", str(port)], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              start_new_session=True)
    said = [server.stdout.readline() for _ in range(2)]  # at once, then when it serves
    assert said[0] == "starting the studio ...\n" and said[1].startswith(f"SD studio on http://127.0.0.1:{port}"), said
    yield f"http://127.0.0.1:{port}/", tmp_path
    server.terminate()
    server.wait(60)


@pytest.mark.slow
def test_studio_imports_trains_stops_resumes_samples_and_exports_in_a_browser(studio):
    binary = browser_binary()
    if binary is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium, or CHROMIUM=PATH)")
    from playwright.sync_api import sync_playwright

    url, folder = studio
    shots = folder / "screenshots"
    shots.mkdir()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=binary, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1800})
        for _ in range(120):  # the server answers once Gradio is up
            try:
                page.goto(url)
                break
            except Exception:  # noqa: BLE001 - not listening yet
                time.sleep(0.5)
        page.wait_for_selector("#data-read", timeout=120_000)

        # Data: the folder read (one file skipped, with its reason), then imported, encoded and tokenised.
        set_value(page, "data-resolution", 32)
        page.click("#data-read")
        page.wait_for_selector("#data-summary :text('24 images')", timeout=120_000)
        assert "no_caption.png" in page.inner_text("#data-skipped") and "no_caption" in page.inner_text("#data-skipped")
        set_value(page, "data-vae", "tiny")
        set_value(page, "data-tokenizer", "tiny")
        page.click("#data-prepare")
        page.wait_for_selector("#data-command :text('01e_import_folder.py')", timeout=60_000)
        page.screenshot(path=shots / "data.png")
        wait_for(page, "data-state", lambda v: v in ("finished",) or v.startswith("failed"), what="finished")
        assert field(page, "data-state").input_value() == "finished", page.inner_text("#data-log")
        assert (folder / "data/mine/dataset").is_dir()

        # Train: a bad field is refused inline; a run another process trains shows that process.
        page.click("#tab-train-button")
        set_value(page, "train-run", "busy")
        set_value(page, "train-fields", "lr: -1")
        page.click("#train-launch")
        page.wait_for_selector("#train-verdict :text('refused')", timeout=60_000)
        assert "lr" in page.inner_text("#train-verdict")
        holder = subprocess.Popen([sys.executable, "-c", "import sys, time, sd.files\n"
                                   "sd.files.FolderLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(120)",
                                   str(folder / "runs" / "busy")], stdout=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            assert holder.stdout.readline().strip() == "held"
            set_value(page, "train-fields", "vae: tiny")
            page.click("#train-launch")
            page.wait_for_selector("#train-verdict :text('in use')", timeout=60_000)
            assert f"pid {holder.pid}" in page.inner_text("#train-verdict")
        finally:
            holder.kill()
            holder.wait()

        # The from-scratch recipe on the tiny models; loss seen, stopped, resumed to its end.
        set_value(page, "train-run", "mine")
        set_value(page, "train-fields", "vae: tiny\nsubject.image_size: 32\nbatch_size: 8\nmax_steps: 400\nsave_steps: 10\n"
                                        "log_every: 1\nvalidate_every: 0\nwarmup_steps: 5")
        page.click("#train-launch")
        page.wait_for_selector("#train-command :text('SD_Train.py')", timeout=60_000)
        wait_for(page, "train-last", lambda v: v.startswith("step ") and int(v.split(",")[0].split()[1]) >= 12,
                 timeout=600, what="showed step 12")
        page.screenshot(path=shots / "train.png")
        page.click("#train-stop")
        wait_for(page, "train-state", lambda v: v.startswith("mine: stopped") or v == "mine: finished", what="stopped")
        run = folder / "runs" / "mine"
        saved = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
        assert saved, "stopping saved no checkpoint"
        stopped_at = int(saved[-1].split("_")[1])
        end = stopped_at + 8
        set_value(page, "train-fields", "vae: tiny\nsubject.image_size: 32\nbatch_size: 8\nmax_steps: 400\nsave_steps: 10\n"
                                        f"log_every: 1\nvalidate_every: 0\nwarmup_steps: 5\nstop_at_step: {end}")
        page.click("#train-launch")  # the same command resumes (to 8 steps further, then stops as a signal would)
        wait_for(page, "train-state", lambda v: v == "mine: finished" or v.startswith("mine: failed"), timeout=600,
                 what="finished")
        assert field(page, "train-state").input_value() == "mine: finished", page.inner_text("#train-log")
        assert f"verified and loaded {run / 'checkpoints' / saved[-1]}" in \
            "\n".join(p.read_text() for p in folder.glob(".studio/jobs/*/log.txt"))
        assert (run / "checkpoints" / f"step_{end:08d}").is_dir()

        # Sample: one image from the run, its settings in the PNG.
        page.click("#tab-sample-button")
        set_value(page, "sample-run", "runs/mine")
        set_value(page, "sample-prompt", "a red picture")
        set_value(page, "sample-steps", 4)
        set_value(page, "sample-n", 1)
        page.click("#sample-go")
        wait_for(page, "sample-state", lambda v: v == "finished" or v.startswith("failed"), what="finished")
        pngs = [p for p in (folder / "samples" / "mine").glob("*.png") if p.name != "grid.png"]
        assert len(pngs) == 1 and "a red picture" in Image.open(pngs[0]).info.get("parameters", "")
        page.wait_for_selector("#sample-images img", timeout=60_000)
        page.screenshot(path=shots / "sample.png")

        # A LoRA on the subject from that run, then exported in the kohya layout.
        page.click("#tab-train-button")
        field(page, "train-preset").fill(str(ROOT / "configs/quickstart/lora.yaml"))
        field(page, "train-preset").press("Enter")
        set_value(page, "train-run", "my_lora")
        set_value(page, "train-fields", "init_from: runs/mine\nsubject.instance_dir: my_subject\n"
                                        "subject.instance_prompt: a photo of sks toy\nsubject.image_size: 32\nmax_steps: 6\n"
                                        "save_steps: 6\nvalidate_every: 0")
        page.click("#train-launch")
        for _ in range(120):
            if "my_lora" in page.inner_text("#train-command") or "refused" in page.inner_text("#train-verdict"):
                break
            time.sleep(0.5)
        assert "lora.yaml" in page.inner_text("#train-command"), page.inner_text("#train-verdict")
        wait_for(page, "train-state", lambda v: v == "my_lora: finished" or v.startswith("my_lora: failed"),
                 timeout=600, what="finished")
        assert field(page, "train-state").input_value() == "my_lora: finished", page.inner_text("#train-log")
        page.click("#tab-export-button")
        set_value(page, "export-run", "runs/my_lora")
        page.click("#export-go")
        wait_for(page, "export-state", lambda v: v == "finished" or v.startswith("failed"), what="finished")
        page.screenshot(path=shots / "export.png")
        assert field(page, "export-state").input_value() == "finished", page.inner_text("#export-log")
        browser.close()
    exported = folder / "exports" / "my_lora" / "lora.safetensors"
    from safetensors import safe_open

    with safe_open(exported, "pt") as handle:
        assert any(key.startswith("lora_unet_") for key in handle.keys())
    assert all((shots / f"{name}.png").stat().st_size > 10_000 for name in ("data", "train", "sample", "export"))


@pytest.mark.slow
def test_the_prefer_page_records_keyboard_answers_in_a_browser(studio):
    """A draw folder's four questions answered with the keys (1, Right, t, then u back and 2 again, s): each
    answer in choices.jsonl in the file's a/b terms, whichever side its images were shown on; then the page's
    01g command makes the three a/b answers into pair shards."""
    binary = browser_binary()
    if binary is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium, or CHROMIUM=PATH)")
    from playwright.sync_api import sync_playwright

    from sd.data.preference import read_choices
    from sd.studio.prefer import recorded_choice, shows_a_left

    url, folder = studio
    draw = folder / "draws" / "cats"
    (draw / "candidates").mkdir(parents=True)
    drawn = {"model": "stable-diffusion-v1-5/stable-diffusion-v1-5", "sampler": "ddim", "steps": 20, "cfg": 7.5}
    records = [{"index": 0, "prompt": "a red cat", "images": [], "seeds": [0, 1, 2], **drawn},
               {"index": 1, "prompt": "a blue dog", "images": [], "seeds": [3, 4], **drawn}]
    for record, count in zip(records, (3, 2)):
        for k in range(count):
            record["images"].append(f"candidates/{record['index']:06d}_{k}.png")
            Image.new("RGB", (32, 32), (120 * record["index"], 80 * k, 200)).save(draw / record["images"][-1])
    (draw / "candidates.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=binary, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1400})
        for _ in range(120):
            try:
                page.goto(url)
                break
            except Exception:  # noqa: BLE001 - not listening yet
                time.sleep(0.5)
        page.click("#tab-prefer-button", timeout=120_000)
        set_value(page, "prefer-folder", "draws/cats")
        page.click("#prefer-open")
        wait_for(page, "prefer-question", lambda v: v == "0:0:1", timeout=60, what="showed 0:0:1")
        left_shown = page.locator("#prefer-left img").first.get_attribute("src")
        assert left_shown.endswith("000000_0.png" if shows_a_left(records[0], 0, 1) else "000000_1.png")
        for key, after in (("1", "0:0:2"), ("ArrowRight", "0:1:2"), ("t", "1:0:1"), ("u", "0:1:2"), ("2", "1:0:1"),
                           ("s", "")):
            page.keyboard.press(key)
            wait_for(page, "prefer-question", lambda v: v == after, timeout=60, what=f"showed {after!r} after {key}")
        assert "4 of 4 answered" in page.inner_text("#prefer-progress")
        assert "--scorer user" in page.inner_text("#prefer-command")
        page.click("#prefer-make")
        wait_for(page, "prefer-state", lambda v: v == "finished" or v.startswith("failed"), timeout=120,
                 what="finished")
        assert field(page, "prefer-state").input_value() == "finished", field(page, "prefer-log").input_value()
        browser.close()
    sides = {(0, 0, 1): "left", (0, 0, 2): "right", (0, 1, 2): "right", (1, 0, 1): "skip"}
    assert read_choices(draw) == {key: recorded_choice(side, shows_a_left(records[key[0]], key[1], key[2]))
                                  for key, side in sides.items()}
    assert len((draw / "choices.jsonl").read_text().splitlines()) == 5  # the tie, then its replacement
    pairs = []  # 01g's key of a pair: <index>_<preferred>_<rejected>
    for a, b in ((0, 1), (0, 2), (1, 2)):
        preferred, rejected = (a, b) if read_choices(draw)[(0, a, b)] == "a" else (b, a)
        pairs.append(f"000000_{preferred}_{rejected}.rejected.png")
    with tarfile.open(draw / "shards" / "00000.tar") as shard:
        assert sorted(name for name in shard.getnames() if name.endswith(".rejected.png")) == sorted(pairs)


def serve_studio(folder: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "OMP_NUM_THREADS": "1"}
    env.pop("SD_STUDIO_TOKEN", None)
    server = subprocess.Popen([sys.executable, str(ROOT / "SD_Studio.py"), "--port", str(port)], cwd=folder,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              start_new_session=True)
    said = [server.stdout.readline() for _ in range(2)]
    assert said[1].startswith(f"SD studio on http://127.0.0.1:{port}"), said
    return server


def api(base: str, path: str, body: dict | None = None) -> dict:
    """The studio's HTTP API as a user's shell calls it: curl (urllib where there is no curl)."""
    url = f"{base}api{path}"
    if shutil.which("curl"):
        command = ["curl", "-sS", "--max-time", "60", url]
        if body is not None:
            command += ["-X", "POST", "-H", "Content-Type: application/json", "-d", json.dumps(body)]
        return json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    import urllib.request

    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


def until(predicate, timeout: float = 300, what: str = ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"never {what}")


@pytest.mark.slow
def test_a_queue_of_two_runs_outlives_a_restart_of_the_studio_in_a_browser(tmp_path):
    """A folder picked on the Data page and a tag of its captions replaced (previewed, applied, undone); two tiny
    runs queued on the Train page; a memory estimate submitted with curl runs beside them at once; the
    studio stopped and started again while the first trains: the new one follows it, and when it is stopped
    (with curl) the second starts, after it, and finishes."""
    binary = browser_binary()
    if binary is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium, or CHROMIUM=PATH)")
    from data_factory import make_dataset
    from playwright.sync_api import sync_playwright

    data = make_dataset(tmp_path / "data" / "toy", n_train=16, n_val=0)
    recipe = tmp_path / "toy.yaml"
    recipe.write_text(json.dumps({"datasets": [data], "unet": "tiny", "vae": "tiny", "text_encoder": "tiny",
                                  "precision": "fp32", "device": "cpu", "grad_checkpointing": False, "batch_size": 2,
                                  "lr": 1e-3, "warmup_steps": 1, "log_every": 1, "save_steps": 5,
                                  "validate_every": 0, "validation_data_captions": 0, "max_steps": 3}))
    cats = tmp_path / "my_images" / "cats"
    cats.mkdir(parents=True)
    captions = {"a": "cat, red", "b": "cat, blue, red", "c": "cat, sks"}
    for name, caption in captions.items():
        Image.new("RGB", (32, 32)).save(cats / f"{name}.png")
        (cats / f"{name}.txt").write_text(caption + "\n")
    port = free_port()
    server = serve_studio(tmp_path, port)
    base = f"http://127.0.0.1:{port}/"
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=binary, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1600})
            page.goto(base)
            page.wait_for_selector("#data-read", timeout=120_000)
            # The folder picked (not typed), its tags counted, one replaced after a preview, then undone.
            set_value(page, "data-folder", ".")
            field(page, "data-folder").press("Enter")
            for name, path in (("my_images", "my_images"), ("cats", "my_images/cats")):
                page.click("#data-pick input")
                page.get_by_role("option", name=name, exact=True).click()
                wait_for(page, "data-folder", lambda v: v == path, timeout=60, what=f"moved into {path}")
            page.click("#tags-section button >> nth=0")
            page.click("#tags-count")
            until(lambda: "blue" in page.inner_text("#tags-table"), timeout=60, what="shown blue")
            set_value(page, "tags-tag", "red")
            set_value(page, "tags-new", "crimson")
            page.click("#tags-preview")
            until(lambda: "crimson" in page.inner_text("#tags-preview-table"), timeout=60, what="shown crimson")
            assert all((cats / f"{n}.txt").read_text() == c + "\n" for n, c in captions.items())  # only shown
            page.click("#tags-apply")
            until(lambda: (cats / "b.txt").read_text() == "cat, blue, crimson\n", timeout=60, what="applied")
            assert (cats / "c.txt").read_text() == "cat, sks\n"
            page.click("#tags-undo")
            until(lambda: all((cats / f"{n}.txt").read_text() == c + "\n" for n, c in captions.items()), timeout=60,
                  what="undone")
            page.click("#tab-train-button")
            field(page, "train-preset").fill(str(recipe))
            field(page, "train-preset").press("Enter")
            time.sleep(2)  # the recipe's change sets the run name (its out_dir's, else as it is) after a moment
            for run, fields in (("first", "max_steps: 100000\nsave_steps: 20"), ("second", "max_steps: 3")):
                set_value(page, "train-run", run)
                set_value(page, "train-fields", fields)
                page.click("#train-launch")
                until(lambda: any(job["name"] == f"train_{run}" for job in api(base, "/jobs")["jobs"]) or
                      "refused" in page.inner_text("#train-verdict"), timeout=60, what=f"queued {run}")
                assert "refused" not in page.inner_text("#train-verdict"), page.inner_text("#train-verdict")
            wait_for(page, "train-state", lambda v: v == "second: queued: 0 jobs ahead", what="queued")
            estimate = api(base, "/jobs", {"kind": "estimate", "recipe": str(recipe), "run": "first", "card_gb": 8})
            assert estimate["waits"] is False and estimate["state"] == "running"  # beside the run, not after it
            done = until(lambda: (job := api(base, f"/jobs/{estimate['id']}?lines=40"))["state"] in
                         ("finished", "failed") and job, what="estimated")
            assert (done["state"], done["described"]) == ("finished", "estimate done")
            assert any("Predicted device memory" in line for line in done["log"])
            first, second = (api(base, "/jobs?state=running&state=queued")["jobs"][::-1])
            assert (first["name"], first["state"], second["name"], second["state"]) == \
                ("train_first", "running", "train_second", "queued")
            until(lambda: (tmp_path / "runs/first/metrics.jsonl").exists(), what="trained a step")
            browser.close()
        server.send_signal(2)  # Ctrl-C: the studio stops, its running job goes on
        said = server.communicate(timeout=120)[0]
        assert "1 job(s) go on: train_first" in said, said
        assert api_free(port)
        port = free_port()
        server = serve_studio(tmp_path, port)
        base = f"http://127.0.0.1:{port}/"
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=binary, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1600})
            page.goto(base)
            page.click("#tab-jobs-button")
            page.wait_for_selector("#jobs-table :text('train_second')", timeout=60_000)
            table = page.inner_text("#jobs-table")
            assert "training" in table and "queued: 0 jobs ahead" in table, table
            page.click("#tab-train-button")
            set_value(page, "train-run", "first")
            seen = int(wait_for(page, "train-last", lambda v: v.startswith("step "), what="followed").split(",")[0]
                       .split()[1])
            wait_for(page, "train-last", lambda v: v.startswith("step ") and int(v.split(",")[0].split()[1]) > seen,
                     what="moved on after the restart")
            assert api(base, f"/jobs/{first['id']}/stop", {})["state"] == "stopping"
            ended = until(lambda: (job := api(base, f"/jobs/{second['id']}"))["state"] in ("finished", "failed")
                          and job, what="second ended")
            stopped = api(base, f"/jobs/{first['id']}")
            assert stopped["state"] == "stopped" and ended["state"] == "finished", (stopped, ended)
            assert ended["started"] >= stopped["ended"]
            assert list((tmp_path / "runs/first/checkpoints").glob("step_*/COMPLETE"))  # it saved when stopped
            set_value(page, "train-run", "second")
            wait_for(page, "train-state", lambda v: v == "second: finished", what="shown finished")
            page.click("#tab-jobs-button")
            page.screenshot(path=tmp_path / "jobs.png")
            browser.close()
    finally:
        server.send_signal(2)
        server.communicate(timeout=120)
        from sd.studio.queue import Queue

        left = Queue(tmp_path / ".studio", tmp_path)  # a job a failed assertion left running is killed
        for job in left.list(("running", "stopping")):
            if left.alive(job):
                os.killpg(job.pid, 9)
        left.close()


def api_free(port: int) -> bool:
    """Nothing answers on the port any more (the studio is gone)."""
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0

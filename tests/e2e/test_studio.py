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

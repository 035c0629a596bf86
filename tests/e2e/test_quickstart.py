"""The README's quick starts 2 and 3, run as written on a folder of a user's own captioned images and
pictures of one subject, at a smaller size, and checked for pictures that are not noise.

Each command of the README's code blocks runs in this process (``python X.py ARGS`` as ``X.main(ARGS)``,
in a folder holding only the user's images and a link to ``configs/``), with these changes, each
appended so it overrides what the README says: 32 px instead of 64 (``--resolution``, ``--image_size``)
and fewer steps (the LoRA's 150 instead of 300 gave the same samples' colours, 6 of 8). Quick start 1, ``make demo``, is tests/e2e/test_demo.py.
"""

import importlib
import json
import os
import re
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from demo.evaluate import classify  # noqa: E402

DEMO_DATA = importlib.import_module("pipeline.00_make_demo_data")
SIZE = 32
COLOURS = {name: DEMO_DATA.PALETTE[name] for name in ("red", "green", "blue", "yellow")}
SUBJECT = ("yellow", "triangle")  # a shape none of the user's captions has
# What each command gets appended (its last value wins): the smaller size, and steps that fit the suite.
SMALLER = {
    "pipeline/01e_import_folder.py": ["--resolution", str(SIZE)],
    "train_vae.py": ["--resolution", str(SIZE), "--max_steps", "400", "--save_steps", "400"],
    "encode_latents.py": ["--resolution", str(SIZE)],
    "SD_Train.py": ["--max_steps", "400", "--save_steps", "200"],
    "SD_ImageGen.py": ["--steps", "20", "--n", "4", "--cfg", "3"],
}
SMALLER_LORA = {"SD_Train.py": ["--image_size", str(SIZE), "--max_steps", "150", "--save_steps", "150"],
                "SD_ImageGen.py": ["--steps", "20", "--n", "8", "--cfg", "3"]}


def readme_block(title: str) -> list[str]:
    """The commands of the ```bash block that follows the README paragraph starting with ``title``."""
    text = (ROOT / "README.md").read_text()
    start = text.index(title)
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S).group(1)
    lines = [line.split("  #")[0].strip() for line in block.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def run_command(line: str, extra: dict[str, list[str]]) -> None:
    words = shlex.split(line)
    assert words[0] == "python", line
    script = words[1]
    module_name = script.removesuffix(".py").replace("/", ".")
    module = importlib.import_module(module_name)
    argv = words[2:] + extra.get(script, [])
    code = module.main(argv)
    assert code in (0, None), f"{line} -> exit {code}"


def draw_folder(folder: Path, pairs: list[tuple[str, str]], caption, seed: int) -> None:
    folder.mkdir()
    rng = np.random.default_rng(seed)
    for i, (colour, shape) in enumerate(pairs):
        image, _ = DEMO_DATA.draw_shape(colour, shape, 64, rng, DEMO_DATA.PALETTE)
        Image.fromarray(image).save(folder / f"img_{i:04d}.png")
        if caption:
            (folder / f"img_{i:04d}.txt").write_text(caption(colour, shape))


def scores(folder: Path, palette: dict) -> list[tuple[str | None, str | None]]:
    return [classify(np.asarray(Image.open(p).convert("RGB")), palette)
            for p in sorted(folder.glob("0*.png"))]


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """A stranger's working folder: their images, the repository's configs, nothing else."""
    pairs = [(c, s) for c in COLOURS for s in ("circle", "square")] * 40  # 320 images, 8 captions
    draw_folder(tmp_path / "my_images", pairs, lambda c, s: f"a {c} {s}", seed=0)
    draw_folder(tmp_path / "my_subject", [SUBJECT] * 12, None, seed=1)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "2"))
    return tmp_path


def test_quick_starts_2_and_3_as_written_give_the_prompted_pictures(user_folder):
    commands = readme_block("**2. Your images: a model from scratch.**")
    assert [shlex.split(c)[1] for c in commands] == [
        "pipeline/01e_import_folder.py", "train_vae.py", "encode_latents.py", "pipeline/04_preprocess_to_cache.py",
        "pipeline/05_build_hf_dataset.py", "SD_Train.py", "SD_ImageGen.py"]
    for line in commands[:-1]:
        run_command(line, SMALLER)
    stats = json.loads((user_folder / "runs" / "my_vae" / "vae_stats.json").read_text())
    assert stats["psnr_db"] > stats["psnr_db_start"] + 5, stats
    # The samples of every caption the user had: right colour and shape, not noise.
    samples = {}
    for colour in COLOURS:
        for shape in ("circle", "square"):
            out = user_folder / "samples" / f"{colour}_{shape}"
            run_command(commands[-1].replace('"a red circle"', f'"a {colour} {shape}"')
                        .replace("samples/mine", str(out)), SMALLER)
            samples[(colour, shape)] = scores(out, COLOURS)
    found = [(c, s) == got for (c, s), gots in samples.items() for got in gots]
    colours = [c == got[0] for (c, _), gots in samples.items() for got in gots]
    shapes = [s == got[1] for (_, s), gots in samples.items() for got in gots]
    assert len(colours) == 8 * 4
    print(f"from scratch: colour {np.mean(colours):.2f}, shape {np.mean(shapes):.2f}, both {np.mean(found):.2f}")
    assert np.mean(colours) >= 0.6 and np.mean(shapes) >= 0.6, (np.mean(colours), np.mean(shapes), samples)
    assert np.mean(found) >= 0.4

    lora = readme_block("**3. Your subject: a LoRA.**")
    assert [shlex.split(c)[1] for c in lora] == ["SD_Train.py", "SD_ImageGen.py", "SD_ImageGen.py"]
    assert all('"a photo of sks toy"' in line for line in lora[:2])  # the prompt the samples are judged on
    base_out = user_folder / "samples" / "base"
    # The base model on the same prompt, for comparison: the README's sampling line pointed at runs/mine.
    run_command(lora[1].replace("runs/my_lora", "runs/mine").replace("samples/my_lora", str(base_out)), SMALLER_LORA)
    for line in lora:
        run_command(line, SMALLER_LORA)
    base = scores(base_out, COLOURS)
    tuned = scores(user_folder / "samples" / "my_lora", COLOURS)
    print("LoRA quick start, base then LoRA:", base, tuned)
    colour = [got[0] == SUBJECT[0] for got in tuned]
    assert np.mean(colour) >= 0.6 and np.mean(colour) > np.mean([got[0] == SUBJECT[0] for got in base]) + 0.4
    assert (user_folder / "my_lora.safetensors").stat().st_size > 0

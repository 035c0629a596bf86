"""The package as a wheel: built from the tree without the network, installed into an empty folder, every module
under ``sd/`` imports from there (not from the checkout, which an editable install would hide) without any of the
extras installed; its requirements are what training needs, the studio's, the tagger's, the engines' and the test
tools' packages extras; a part used without its extra says in one line which extra to install."""

import os
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

# pyproject.toml's extras and the packages each must hold, none of them a requirement of the library itself.
EXTRAS = {"studio": {"gradio"}, "caption": {"onnxruntime", "onnx"}, "engines": {"pyspark", "ray"},
          "test": {"pytest", "pytest-xdist", "playwright"}}
# Run first by the interpreter (a sitecustomize module on PYTHONPATH): the extras' packages are not there.
WITHOUT_EXTRAS = "import sys\nfor name in {names!r}:\n    sys.modules[name] = None  # ModuleNotFoundError on import\n"

IMPORT_ALL = """
import importlib, pkgutil, sys
import sd
assert sd.__path__[0].startswith(sys.argv[1]), sd.__path__
names = [m.name for m in pkgutil.walk_packages(sd.__path__, "sd.")]
for name in names:
    importlib.import_module(name)
print(len(names))
"""

# Each part that needs an extra, used without it: its one line.
USED_WITHOUT_EXTRAS = """
import sys
from pathlib import Path

import sd.cli
import sd.data.captioning
import sd.data.tiny_captioners
import sd.studio.app
import sd.studio.runs

for use in (lambda: sd.studio.app.build(sd.studio.runs.Roots([Path.cwd()]), Path.cwd(), Path.cwd()),
            lambda: sd.data.captioning.load_tagger("tiny"), lambda: sd.data.captioning.load_tagger("wd14"),
            lambda: sd.data.tiny_captioners.tiny_tagger(Path("tagger"))):
    try:
        use()
    except (sd.cli.MissingExtra, sd.data.captioning.ModelLoadError) as error:
        print(error)
"""


def source_tree(folder: Path) -> Path:
    """What the build reads, copied (setuptools writes build/ and *.egg-info beside the sources)."""
    for name in ("pyproject.toml", "requirements.txt"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, folder / name)
    for name in ("sd", "pipeline", "bench", "demo"):
        shutil.copytree(ROOT / name, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
    return folder


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp_path = tmp_path_factory.mktemp("wheel")
    build = tmp_path / "build"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "--wheel-dir",
                    str(build), str(source_tree(tmp_path / "source"))], check=True, cwd=tmp_path, capture_output=True)
    (built,) = build.glob("sd1_train-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> dict:
    """The wheel installed into an empty folder, and the environment that imports from it with no extra there."""
    target, blocker = tmp_path_factory.mktemp("installed"), tmp_path_factory.mktemp("without_extras")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", "--target",
                    str(target), str(wheel)], check=True, capture_output=True)
    modules = sorted({name.replace("-", "_") for names in EXTRAS.values() for name in names} | {"xdist"})
    (blocker / "sitecustomize.py").write_text(WITHOUT_EXTRAS.format(names=modules))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), str(target)])}
    return {"target": target, "env": env, "blocker": blocker}


def test_the_wheel_installs_and_every_module_imports_from_it_without_the_extras(wheel, installed, tmp_path):
    with zipfile.ZipFile(wheel) as archive:
        packed = {Path(name).parent.as_posix() for name in archive.namelist() if name.endswith("__init__.py")}
    in_tree = {p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "sd").rglob("__init__.py")}
    assert in_tree <= packed, f"left out of the wheel: {sorted(in_tree - packed)}"

    probe = subprocess.run([sys.executable, "-c", "import gradio"], env=installed["env"], capture_output=True,
                           text=True)
    assert probe.returncode == 1 and "ModuleNotFoundError" in probe.stderr  # the extras are out of reach
    imported = subprocess.run([sys.executable, "-c", IMPORT_ALL, str(installed["target"])], cwd=tmp_path,
                              capture_output=True, text=True, env=installed["env"])
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert int(imported.stdout.split()[-1]) == len(list((ROOT / "sd").rglob("*.py"))) - 1  # all but sd itself


def test_the_wheel_requires_what_training_needs_and_offers_the_rest_as_extras(wheel):
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(archive.read(name).decode("utf-8"))
    requirements = [Requirement(text) for text in metadata.get_all("Requires-Dist")]
    core = {r.name.lower() for r in requirements if r.marker is None}
    assert {"torch", "diffusers", "transformers", "safetensors", "datasets", "peft"} <= core
    assert not core & set().union(*EXTRAS.values()), "a package of an extra is a requirement of the library"
    assert set(metadata.get_all("Provides-Extra")) == set(EXTRAS)
    for extra, names in EXTRAS.items():
        held = {r.name.lower() for r in requirements if r.marker is not None and r.marker.evaluate({"extra": extra})}
        assert held == names, extra


def test_a_part_used_without_its_extra_names_the_extra_in_one_line(installed, tmp_path):
    used = subprocess.run([sys.executable, "-c", USED_WITHOUT_EXTRAS], cwd=tmp_path, capture_output=True, text=True,
                          env=installed["env"])
    assert used.returncode == 0, used.stderr[-3000:]
    assert used.stdout.splitlines() == [
        "the studio needs its extra: pip install -e .[studio] (gradio is not installed)",
        "tagger tiny: the tagger needs its extra: pip install -e .[caption] (onnxruntime is not installed); "
        "onnxruntime-gpu runs it on a GPU",
        "tagger SmilingWolf/wd-swinv2-tagger-v3: the tagger needs its extra: pip install -e .[caption] "
        "(onnxruntime is not installed); onnxruntime-gpu runs it on a GPU",
        "the tiny tagger needs its extra: pip install -e .[caption] (onnx is not installed)"]

    # The studio's command, from a checkout installed without the studio's extra: one line and exit status 2.
    studio = subprocess.run([sys.executable, str(ROOT / "SD_Studio.py"), "--root", str(tmp_path)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(installed["blocker"])})
    assert studio.returncode == 2, studio.stderr[-3000:]
    assert studio.stderr.splitlines() == [
        "SD_Studio.py: the studio needs its extra: pip install -e .[studio] (gradio is not installed)"]

"""The package as a wheel: built from the tree without the network, installed into an empty folder, every
module under ``sd/`` imports from there (not from the checkout, which an editable install would hide)."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

IMPORT_ALL = """
import importlib, pkgutil, sys
import sd
assert sd.__path__[0].startswith(sys.argv[1]), sd.__path__
names = [m.name for m in pkgutil.walk_packages(sd.__path__, "sd.")]
for name in names:
    importlib.import_module(name)
print(len(names))
"""


def source_tree(folder: Path) -> Path:
    """What the build reads, copied (setuptools writes build/ and *.egg-info beside the sources)."""
    for name in ("pyproject.toml", "requirements.txt", "SD_Model.py"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, folder / name)
    for name in ("sd", "pipeline", "bench", "demo"):
        shutil.copytree(ROOT / name, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def test_the_wheel_installs_and_every_module_imports_from_it(tmp_path):
    build = tmp_path / "build"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "--wheel-dir",
                    str(build), str(source_tree(tmp_path / "source"))], check=True, cwd=tmp_path, capture_output=True)
    (wheel,) = build.glob("sd1_train-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        packed = {Path(name).parent.as_posix() for name in archive.namelist() if name.endswith("__init__.py")}
    in_tree = {p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "sd").rglob("__init__.py")}
    assert in_tree <= packed, f"left out of the wheel: {sorted(in_tree - packed)}"

    target = tmp_path / "installed"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", "--target",
                    str(target), str(wheel)], check=True, capture_output=True)
    imported = subprocess.run([sys.executable, "-c", IMPORT_ALL, str(target)], cwd=tmp_path, capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": str(target)})
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert int(imported.stdout.split()[-1]) == len(list((ROOT / "sd").rglob("*.py"))) - 1  # all but sd itself

"""DESIGN.md's layering: inference code (sampling, exports, loaders) reads run folders through the low-floor
readers and never imports ``sd/train/``."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INFERENCE = ["SD_ImageGen.py", *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "sd" / "imagegen").glob("*.py"))),
             "sd/sampling.py", "sd/formats.py", "sd/metadata.py", "sd/run_folder.py",
             "sd/posthoc_ema.py", "sd/lora/formats.py", "sd/lora/dora.py", "sd/embedding/formats.py",
             "sd/embedding/tokens.py", "sd/controlnet/formats.py", "sd/flow.py", "sd/reflow.py", "SD_Reflow.py"]


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


@pytest.mark.parametrize("name", INFERENCE)
def test_inference_code_never_imports_the_trainer(name):
    assert (ROOT / name).is_file()
    trainer = sorted(m for m in imported_modules(ROOT / name) if m == "sd.train" or m.startswith("sd.train."))
    assert not trainer, f"{name} imports {trainer}"

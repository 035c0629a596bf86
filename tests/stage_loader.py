"""Import a pipeline stage script (their names start with digits) as a module, to call its main()."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_stage(name: str):
    path = ROOT / "pipeline" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"stage_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

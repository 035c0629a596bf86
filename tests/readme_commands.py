"""The README's code blocks, read and run as a user would type them (tests of the guides)."""

import importlib
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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

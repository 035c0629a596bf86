"""What the repository holds for its readers: the design files and docs a test cites are in it (ARCHITECTURE.md,
README.md, docs/), never one kept somewhere else."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CITED = re.compile(r"\b(?:[A-Z][A-Z_]*\.md|docs/[\w/.-]+\.md)\b")  # capitals at the top, or under docs/ (not notes.md)


def test_every_design_file_or_doc_a_test_cites_is_in_the_repository():
    cited = {(str(path.relative_to(ROOT)), name) for path in (ROOT / "tests").rglob("*.py")
             for name in CITED.findall(path.read_text(encoding="utf-8"))}
    assert {("tests/unit/test_layering.py", "ARCHITECTURE.md"), ("tests/data_factory.py", "docs/data.md")} <= cited
    assert sorted((test, name) for test, name in cited if not (ROOT / name).is_file()) == []

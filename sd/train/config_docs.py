"""``docs/config.md``, generated from the config's fields: the top-level fields by group, then each section, every
field with its default, allowed values and doc (``make docs`` writes it; a test keeps it in sync)."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import yaml

from sd.settings import default_of
from sd.train.config import AUTO_BATCH, AUTO_COUNTS, FIELDS, FLAT_NAMES, SECTIONS, TOP, TrainConfig, kind_of


def top_groups() -> list[tuple[str, list[str]]]:
    """The top-level fields in the order and groups of ``TrainConfig``'s source (its ``# -- name ---`` comments)."""
    groups: list[tuple[str, list[str]]] = []
    for line in inspect.getsource(TrainConfig).splitlines():
        heading = re.match(r"\s*# -- (.+?) -+\s*$", line)
        name = re.match(r"    (\w+): \w+ = ", line)
        if heading:
            groups.append((heading.group(1), []))
        elif name and name.group(1) in TOP:
            groups[-1][1].append(name.group(1))
    return [(title, names) for title, names in groups if names]


def groups() -> list[tuple[str, str, list[str]]]:
    """``(title, what it is, dotted field names)`` of every group of docs/config.md."""
    found = [(title, "", names) for title, names in top_groups()]
    for name, cls in SECTIONS.items():
        found.append((f"{name}:", " ".join((cls.__doc__ or "").split()),
                      [f"{name}.{f.name}" for f in dataclasses.fields(cls)]))
    return found


def describe_default(name: str) -> str:
    value = default_of(FIELDS[name])
    if name in AUTO_COUNTS and value == AUTO_BATCH:
        return "auto"
    if value in ("", [], None):
        return "(none)"
    if isinstance(value, (list, dict)):
        return f"`{yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()}`"
    return f"`{str(value).lower() if isinstance(value, bool) else value}`"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def reference_markdown() -> str:
    lines = ["# Training config reference", "",
             "Every field of a training YAML, generated from the fields' own docs (`make docs` rewrites this file; a "
             "test keeps it in sync). The top-level fields come first; each section after them belongs to the "
             "component that reads it and is written as a mapping (`lora: {rank: 8, alpha: 8}`), its fields as flags "
             "with the section's name before them (`--lora.rank 8`). The flat names the config had before its "
             "sections (`lora_rank: 8`, `--lora_rank 8`, in the last column) are read into them. A YAML may start "
             "with `extends: base.yaml`; every flag overrides the YAML.", ""]
    for title, what, names in groups():
        lines += [f"## {title[0].upper()}{title[1:]}" if not title.endswith(":") else f"## `{title}`", ""]
        if what:
            lines += [what, ""]
        lines += ["| field | default | allowed | what it does | flat name |", "|---|---|---|---|---|"]
        for name in names:
            f = FIELDS[name]
            allowed = f.metadata["allowed"].describe(kind_of(f)) if f.metadata.get("allowed") else ""
            flat = f"`{FLAT_NAMES[name]}`" if name in FLAT_NAMES else ""
            lines.append(f"| `{name}` | {_cell(describe_default(name))} | {_cell(allowed)} | "
                         f"{_cell(f.metadata['help'])} | {flat} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if argv:
        Path(argv[0]).write_text(reference_markdown())
    else:
        print(reference_markdown(), end="")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])

"""The Train page's settings: the recipes a client may name, its field lines, every path-valued field of the
config confined to the studio's roots, the trainer's own verdict and the command.

A run's settings are a recipe (``--config``: one of the repository's, or a YAML file inside a root), an optional
card recipe (a second ``--config``), the run folder (``runs/NAME``: the run name decides ``out_dir``) and
``field: value`` lines. Before anything runs, every field that can hold a path (``PATH_FIELDS``,
``MODEL_FIELDS``, the ``datasets`` entries' folders, ``controlnet.validation_images``), whichever of those three
set it and by whichever name (``subject.instance_dir`` or ``instance_dir``, a section's mapping or a line),
is resolved against the first root (where the trainer runs) and must lie inside a root; a model field may also
be a hub id or ``tiny``. The config is then made and validated by the trainer's own functions
(``sd.train.config_loading.config_values``, ``make_config``): no working directory is changed, no parser is reused.
"""

from __future__ import annotations

import sys
from pathlib import Path

import sd.train.config as config
import sd.train.config_loading as config_loading
from sd.cli import load_yaml
from sd.studio.jobs import python_command
from sd.studio.runs import OutsideRoots, Roots

PRESET_FOLDERS = ("configs/quickstart", "configs/finetune", "configs/hardware")
# By their names in sd.train.config.FIELDS, which config_values gives whatever name a YAML or a line used.
PATH_FIELDS = ("subject.instance_dir", "subject.class_dir", "eval.prompts", "eval.reference")  # a file or folder
MODEL_FIELDS = ("init_from", "vae", "text_encoder", "tokenizer", "controlnet.init_from", "eval.clip_model")  # or hub
FILE_LISTS = ("controlnet.validation_images",)  # lists of files
RUN_FIELD = "out_dir"  # the run name's: never a field line


def presets(repository: Path, kind: str = "") -> list[tuple[str, str]]:
    """``(name, name)`` of the repository's recipes (``configs/quickstart/lora.yaml``; ``kind``: only those whose
    folder names it): the page names a recipe by its place in the repository, never by where that is on disk."""
    return [(name, name) for folder in PRESET_FOLDERS if kind in folder
            for name in (str(p.relative_to(repository)) for p in sorted((Path(repository) / folder).glob("*.yaml")))]


def recipe(value: str, repository: Path, roots: Roots) -> Path:
    """The YAML file a ``--config`` of the page names: one of the repository's recipes (by its name or full
    path), or a file inside a root whose ``extends`` chain stays inside the roots too; else OutsideRoots."""
    listed = [Path(repository) / name for name, _ in presets(repository)]
    for path in listed:
        if value in (str(path), str(path.relative_to(repository))):
            return path
    path = roots.check(value)
    if not path.is_file():
        raise OutsideRoots(f"recipe {value}: neither one of the repository's recipes nor a YAML file inside the "
                           "studio's folders")
    chain, current = {path}, path
    while (base := extends_of(current)) is not None:  # read_yaml's chain: each file's extends, beside that file
        try:
            current = roots.check(current.parent / base)
        except OutsideRoots as error:
            raise OutsideRoots(f"recipe {value} extends {base}: {error}") from None
        if current in chain:
            break  # a loop: read_yaml says so
        chain.add(current)
    return path


def extends_of(path: Path) -> str | None:
    try:
        loaded = load_yaml(path.read_text())
    except (OSError, ValueError):
        return None  # unreadable: the trainer's verdict names the file
    base = loaded.get("extends") if isinstance(loaded, dict) else None
    return None if base is None else str(base)


def parse_fields(text: str) -> list[str]:
    """``field: value`` lines (``lr: 1e-4``, ``lora.rank: 8``) -> ``--field value`` flags (the trainer checks names,
    values, types and ranges); never ``out_dir`` (the run name decides the run folder), and no value that the
    command line would read as a flag of its own (``-`` first, other than a number)."""
    flags = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, colon, value = line.partition(":")
        name = name.strip()
        if not colon or not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(f"line {number}: {line!r} is not 'field: value'")
        if name == RUN_FIELD:
            raise ValueError(f"line {number}: out_dir is the run name's (runs/NAME): set the run name instead")
        value = value.strip()
        if value.startswith("-") and not is_number(value):
            raise ValueError(f"line {number}: {name}'s value {value!r} would read as a flag: no '-' first")
        flags += [f"--{name}", value]
    return flags


def is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def confined(values: dict, roots: Roots) -> dict:
    """``values`` with every path-valued field resolved inside ``roots`` (relative paths against the first root,
    where the trainer runs); hub ids and ``tiny`` stay as written. OutsideRoots or ConfigError names the field."""
    values = dict(values)

    def check(name: str, value, resolve) -> str:
        try:
            return resolve(value)
        except OutsideRoots as error:
            raise OutsideRoots(f"{name}: {error}") from None

    for name in PATH_FIELDS:
        if values.get(name):
            values[name] = check(name, values[name], lambda v: str(roots.check(str(v))))
    for name in MODEL_FIELDS:
        if values.get(name):
            values[name] = check(name, values[name], roots.source)
    for name in FILE_LISTS:
        values[name] = [check(f"{name}[{i}]", v, lambda v: str(roots.check(str(v))))
                        for i, v in enumerate(values.get(name) or [])]
    datasets = []
    for i, entry in enumerate(values.get("datasets") or []):
        if not isinstance(entry, dict):
            raise config.ConfigError(f"datasets[{i}]: expected a mapping with dataset, latents, weight")
        datasets.append({key: check(f"datasets[{i}].{key}", value, lambda v: str(roots.check(str(v))))
                         if key in ("dataset", "latents") else value for key, value in entry.items()})
    values["datasets"] = datasets
    return values


def check_training(preset: str, hardware: str | None, run_dir: Path, fields: list[str], workdir: Path,
                   roots: Roots | None = None) -> str:
    """The trainer's own verdict on the settings ("" when they are good), without loading a model, after every
    path-valued field is confined to ``roots`` (default: ``workdir`` alone); paths resolve against ``workdir``."""
    roots = roots or Roots([workdir])
    workdir = Path(workdir)
    if len(fields) % 2 or not all(flag.startswith("--") for flag in fields[::2]):
        return f"the fields {fields} are not --field value pairs"
    overrides = {flag[2:]: value for flag, value in zip(fields[::2], fields[1::2])}
    if RUN_FIELD in overrides:
        return "out_dir is the run name's (runs/NAME): set the run name instead"
    recipes = [workdir / path for path in [preset] + ([hardware] if hardware else [])]
    try:
        values = config_loading.config_values(recipes, overrides, where="the fields")
        values = confined({**values, RUN_FIELD: str(roots.check(run_dir))}, roots)
        config_loading.make_config(values, check_paths=False)
    except (config.ConfigError, ValueError, OSError) as error:  # OutsideRoots is a ValueError
        return str(error)
    return ""


def training_command(preset: str, hardware: str | None, run_dir: Path, fields: list[str], gpus: int) -> list[str]:
    configs = ["--config", preset] + (["--config", hardware] if hardware else [])
    tail = [*configs, "--out_dir", str(run_dir), *fields]
    if gpus > 1:
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={gpus}",
                python_command("SD_Train.py")[1], *tail]
    return python_command("SD_Train.py", *tail)


def gpus_present() -> int:
    """The GPUs ``nvidia-smi -L`` lists (CUDA_VISIBLE_DEVICES counted when set), at least 1 (the CPU)."""
    import os
    import subprocess

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return max(1, len([d for d in visible.split(",") if d.strip()]))
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 1
    return max(1, sum(line.startswith("GPU ") for line in listed.splitlines()))


def recipe_run_name(path: Path) -> str | None:
    """The run folder's name a recipe writes to (its ``out_dir``), or None."""
    try:
        out_dir = (load_yaml(Path(path).read_text()) or {}).get(RUN_FIELD)
    except (OSError, ValueError, AttributeError):
        return None
    return Path(str(out_dir)).name if out_dir else None


def field_reference() -> list[list[str]]:
    """``[name, default, allowed, what it does]`` of every field, in docs/config.md's order."""
    import sd.train.config_docs

    rows = []
    for _, _, names in sd.train.config_docs.groups():
        for name in names:
            f = config.FIELDS[name]
            allowed = f.metadata["allowed"].describe(config.kind_of(f)) if f.metadata.get("allowed") else ""
            rows.append([name, sd.train.config_docs.describe_default(name).strip("`"), allowed, f.metadata["help"]])
    return rows

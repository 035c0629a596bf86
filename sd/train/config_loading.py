"""Reading a training config: YAML files (each with its ``extends`` chain) and ``--field value`` flags, each value
converted to its field's type, flat names of before read into their sections, unknown names suggested; the
model fields inherited from ``init_from`` (a run's, a single file's, a diffusers folder's); ``--estimate_memory``'s flags; ``global_batch`` resolved for a world
size. ``sd.train.config`` holds the fields and their checks; this module turns text into them.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
from pathlib import Path

import sd.cli
import sd.model
from sd.cli import ConfigError, load_yaml
from sd.run_folder import LEGACY_KEYS, read_saved_config
from sd.settings import default_of
from sd.train.config import (AUTO_BATCH, AUTO_COUNTS, FIELDS, FLAT_NAMES, SECTIONS, TrainConfig, canonical,
                             kind_of)


def coerce(name: str, value):
    """Convert a YAML or command-line value to the type of the field ``name`` (as FIELDS has it), or say what was
    expected."""
    kind = kind_of(FIELDS[name])
    if name in AUTO_COUNTS and isinstance(value, str) and value.strip().lower() == "auto":
        return AUTO_BATCH
    if kind == "bool":
        try:
            return sd.cli.parse_bool(value)
        except Exception:
            pass
    elif kind in ("int", "float"):
        if isinstance(value, str):  # YAML reads 1e-6 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if kind == "float":
                return float(value)
            if float(value).is_integer():
                return int(value)
    elif kind == "str":
        return "" if value is None else str(value)
    elif kind == "list":
        if isinstance(value, str):
            try:
                value = load_yaml(value)
            except ValueError as error:
                raise ConfigError(f"{name}: {error}") from None
        if isinstance(value, list):
            return value
        if isinstance(value, (str, dict)):
            return [value]
    raise ConfigError(f"{name}: expected {kind}, got {value!r}")


def unknown_field(name: str, where: str) -> ConfigError:
    """The error for a name no field has, with the likeliest one meant: a section's field by a close name in that
    section, a top-level field written inside a section, or any field or flat name of before close to it."""
    section, _, field = name.rpartition(".")
    if name in SECTIONS:
        hint = f"; {name} is a section: give its fields, --{name}.{dataclasses.fields(SECTIONS[name])[0].name} VALUE"
    elif section in SECTIONS and field in FIELDS:
        hint = f"; {field} is a top-level field: write '{field}', not in {section}:"
    else:
        inside = [f"{section}.{f.name}" for f in dataclasses.fields(SECTIONS[section])] if section in SECTIONS else []
        close = difflib.get_close_matches(name, inside, n=1) or difflib.get_close_matches(
            name, [*FIELDS, *LEGACY_KEYS], n=1)
        hint = f"; did you mean '{canonical(close[0])}'?" if close else ""
    return ConfigError(f"unknown config field '{name}' in {where}{hint}")


def read_values(given: dict, where: str, flat: list | None = None) -> dict:
    """``{field: value}`` as FIELDS names them, each of its field's type, from what a YAML or the command line
    gives: top-level fields, sections as mappings, a section's fields by dotted or flat name. The flat names found
    are added to ``flat``; an unknown name is a ConfigError naming ``where``."""
    values, spelled = {}, {}

    def put(field: str, spelling: str, value) -> None:
        if field in spelled:  # which of the two wins would be a guess
            raise ConfigError(f"{where}: {spelled[field]} and {spelling} are one field ({field}): keep one")
        spelled[field] = spelling
        values[field] = coerce(field, value)

    for name, value in given.items():
        if name in SECTIONS and name not in LEGACY_KEYS and not isinstance(value, dict):
            example = dataclasses.fields(SECTIONS[name])[0].name
            raise ConfigError(f"{name} in {where}: a section, written as a mapping of its fields ({name}: "
                              f"{{{example}: ...}}, or --{name}.{example} on the command line), got {value!r}")
        if name in SECTIONS and isinstance(value, dict):
            for field, inner in value.items():
                dotted = f"{name}.{field}"
                if dotted not in FIELDS:
                    raise unknown_field(dotted, where)
                put(dotted, f"{name}: {{{field}: ...}}", inner)
            continue
        if canonical(name) not in FIELDS:
            raise unknown_field(name, where)
        if name != canonical(name) and flat is not None:
            flat.append(name)
        put(canonical(name), name, value)
    return values


class Parser(sd.cli.ArgumentParser):
    """Unknown or malformed flags become ConfigErrors, reported like every other config mistake."""

    def error(self, message):
        raise ConfigError(message)


def build_parser(description: str = "") -> sd.cli.ArgumentParser:
    """``--config`` plus one flag per field (``--lr``, ``--lora.rank``; the flat names work too, unlisted); a bool
    field also works as a bare flag (``--compile``)."""
    parser = Parser(description=description)
    parser.add_argument("--config", action="append", metavar="YAML",
                        help="phase YAML; flags override its fields. Given again, each later file overrides the "
                             "earlier ones' fields (a card's recipe over a phase: --config "
                             "configs/phases/p1_laion_broad.yaml --config configs/hardware/24gb.yaml)")
    for name, f in FIELDS.items():
        kind = kind_of(f)
        extra = {"nargs": "?", "const": "true"} if kind == "bool" else {}
        allowed = f"; allowed: {f.metadata['allowed'].describe(kind)}" if f.metadata["allowed"] else ""
        parser.add_argument(f"--{name}", metavar="VALUE",
                            help=f"{f.metadata['help']} (default: {default_of(f)!r}{allowed})", **extra)
        if name in FLAT_NAMES:
            parser.add_argument(f"--{FLAT_NAMES[name]}", metavar="VALUE", help=argparse.SUPPRESS, **extra)
    estimate = parser.add_argument_group("memory estimate (no training, no data, no GPU needed)")
    estimate.add_argument("--estimate_memory", nargs="?", const="true", default="false", metavar="BOOL",
                          help="print the predicted peak device memory of one training step of this config, "
                               "broken down, and the largest micro-batch that fits --gpu_memory_gb; ends with "
                               "one JSON line (peak_gb, max_batch, ...)")
    estimate.add_argument("--gpu_memory_gb", type=float, default=None, metavar="GB",
                          help="the card's memory in GB (1e9 bytes) for --estimate_memory (default: this "
                               "machine's CUDA device, else 24 GiB = 25.77)")
    estimate.add_argument("--resolution", type=int, default=None, metavar="PX",
                          help="image size for --estimate_memory (default: the first dataset's latents, else 512)")
    estimate.add_argument("--world_size", default=None, metavar="N",
                          help="GPUs of the run for --estimate_memory: above 1, each GPU's step in DDP (the "
                               "gradients in DDP's buckets, global_batch split over N GPUs) (default: the "
                               "WORLD_SIZE environment variable as torchrun sets it, else 1)")
    return parser


def read_yaml(path: Path, seen: tuple = (), flat: list | None = None) -> dict:
    """A config YAML's fields as FIELDS names them (``read_values``), its ``extends`` chain resolved (the file's
    own fields win)."""
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if path.resolve() in seen:
        raise ConfigError(f"{path}: 'extends' loops back to itself")
    try:
        loaded = sd.cli.load_yaml_file(path) or {}
    except ValueError as error:
        raise ConfigError(str(error)) from None
    except OSError as error:  # a folder, no permission
        raise ConfigError(f"{path}: cannot be read ({sd.cli.first_line(error)})") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: expected a mapping of config fields")
    values = {}
    base = loaded.pop("extends", None)
    if base is not None:
        values.update(read_yaml(path.parent / str(base), seen + (path.resolve(),), flat))
    values.update(read_values(loaded, str(path), flat))
    return values


def load_config(argv=None, description: str = "", check_paths: bool = True) -> TrainConfig:
    """YAML from ``--config`` (each with its ``extends``; several: later over earlier), then ``--field value``
    overrides; validated (``check_paths``: see ``TrainConfig.validate``)."""
    args, unknown = build_parser(description).parse_known_args(argv)
    if unknown:
        flag = next((u for u in unknown if u.startswith("--")), unknown[0])
        raise unknown_field(flag.lstrip("-").split("=")[0], "the command line")
    given = {name: value for name, value in vars(args).items()
             if value is not None and (name in FIELDS or name in LEGACY_KEYS)}
    flat: list = []
    values = config_values(args.config or [], given, flat=flat)
    return make_config(values, check_paths, flat)


def config_values(configs: list, overrides: dict, where: str = "the command line", flat: list | None = None) -> dict:
    """The fields of the YAML files ``configs`` (later over earlier), then ``overrides`` (field -> value as
    written after ``--field``), each as its field's type and by its name in FIELDS: what ``load_config`` reads,
    for a caller that holds the parts rather than a command line (the studio). An unknown field is a ConfigError
    naming ``where``; the flat names read are added to ``flat``."""
    values = {}
    for path in configs:
        values.update(read_yaml(Path(path), flat=flat))
    values.update(read_values(overrides, where, flat))
    return values


def make_config(values: dict, check_paths: bool = True, flat: list | tuple = ()) -> TrainConfig:
    """The validated config of ``values`` (``config_values``), with what ``init_from``'s run was built with;
    ``flat``: the flat names the values were given by (``TrainConfig.flat_keys``)."""
    config = TrainConfig(**inherit_model(values))
    object.__setattr__(config, "flat_keys", tuple(dict.fromkeys(flat)))
    config.validate(check_paths)
    return config


# What a run's weights were built with: a run started from them (init_from) takes these from its
# config.yaml unless its own config names them.
INHERITED = ("unet", "vae", "text_encoder", "tokenizer")


def inherit_model(values: dict) -> dict:
    """``values`` with the INHERITED fields that ``init_from``'s config.yaml (a run or checkpoint folder
    of ours) has and ``values`` does not name. A named one that differs from the saved one is a
    ConfigError naming both: the weights would not fit, or would meet other latents or text. An
    unreadable config.yaml is left to the loading of ``init_from``, which names the damaged file."""
    source = values.get("init_from")
    if source and Path(source).is_file():
        return inherit_from_file(values, source)
    if source and (Path(source) / "model_index.json").is_file():  # a diffusers pipeline folder
        return inherit_from_folder(values, source)
    saved_path = Path(source) / "config.yaml" if source else None
    if saved_path is None or not saved_path.is_file():
        return values
    try:
        saved = read_saved_config(saved_path)
    except (OSError, ValueError):  # damaged: loading init_from names it, as for any damaged file there
        return values
    values = dict(values)
    for name in INHERITED:
        if name not in saved:
            continue
        if name not in values:
            values[name] = saved[name]
        elif values[name] != saved[name]:
            raise ConfigError(f"{name}: this config names {values[name]!r}, but init_from {source} was trained with "
                              f"{saved[name]!r} ({saved_path}); leave {name} out to take the run's, or set it to "
                              f"{saved[name]!r}")
    return values
def inherit_from_file(values: dict, source: str) -> dict:
    """``values`` with what the single file ``init_from`` holds and ``values`` does not name: its VAE and text
    encoder (``vae`` / ``text_encoder``: the file) and its UNet's preset (``unet``). A file without one keeps
    the default (the run's log says so). An unreadable file is left to the loading of ``init_from``."""
    try:
        file = sd.model.open_file(source)
    except sd.model.LoadError:
        return values
    values = dict(values)
    for name in ("vae", "text_encoder"):
        if name not in values and name in file.parts:
            values[name] = source
    if "unet" not in values and "unet" in file.parts:
        values["unet"] = sd.model.file_preset(file, "unet") or default_of(FIELDS["unet"])
    return values


def inherit_from_folder(values: dict, source: str) -> dict:
    """``values`` with the VAE and the text encoder (with its tokenizer) of the diffusers folder ``init_from``
    where it has them and ``values`` does not name them."""
    folder = Path(source)
    values = dict(values)
    if "vae" not in values and (folder / "vae" / "config.json").is_file():
        values["vae"] = source
    tokenizer_there = (folder / "tokenizer").is_dir() or "tokenizer" in values
    if "text_encoder" not in values and (folder / "text_encoder" / "config.json").is_file() and tokenizer_there:
        values["text_encoder"] = source
    return values


def estimate_flags(argv=None) -> tuple[bool, float | None, int | None, int]:
    """``--estimate_memory``, ``--gpu_memory_gb``, ``--resolution``, ``--world_size`` of a command line."""
    args, _ = build_parser().parse_known_args(argv)
    try:
        estimate = sd.cli.parse_bool(args.estimate_memory)
    except Exception:
        raise ConfigError(f"--estimate_memory: expected true or false, got {args.estimate_memory!r}") from None
    if args.gpu_memory_gb is not None and not args.gpu_memory_gb > 0:
        raise ConfigError(f"--gpu_memory_gb must be > 0, got {args.gpu_memory_gb}")
    if args.resolution is not None and (args.resolution <= 0 or args.resolution % 8):
        raise ConfigError(f"--resolution must be a positive multiple of 8, got {args.resolution}")
    return estimate, args.gpu_memory_gb, args.resolution, world_size_flag(args.world_size)


def world_size_flag(value: str | None) -> int:
    """``--world_size``: a positive whole number; without it torchrun's ``WORLD_SIZE``, else 1."""
    source = "--world_size"
    if value is None:
        value, source = os.environ.get("WORLD_SIZE"), "the WORLD_SIZE environment variable"
        if value is None:
            return 1
    try:
        world_size = int(str(value).strip())
    except ValueError:
        world_size = 0
    if world_size < 1:
        raise ConfigError(f"{source} must be a positive whole number of GPUs, got {value!r}")
    return world_size


def largest_batch_for(global_batch: int, world_size: int, at_most: int) -> int:
    """The largest micro-batch up to ``at_most`` that makes ``global_batch`` on ``world_size`` GPUs in
    whole accumulation steps; 0 when none does."""
    return next((b for b in range(at_most, 0, -1) if global_batch % (b * world_size) == 0), 0)


def resolve_global_batch(config: TrainConfig, world_size: int) -> TrainConfig:
    """``global_batch`` set: the config with ``grad_accum`` that makes it on ``world_size`` GPUs; a
    batch that cannot make it exactly is a ConfigError naming the settings that can."""
    if not config.global_batch:
        return config
    per_step = config.batch_size * world_size
    if config.global_batch % per_step == 0:
        return dataclasses.replace(config, grad_accum=config.global_batch // per_step)
    options = []
    smaller = largest_batch_for(config.global_batch, world_size, config.batch_size)
    if smaller:
        options.append(f"batch_size {smaller} (grad_accum {config.global_batch // (smaller * world_size)})")
    bigger = -(-config.global_batch // per_step) * per_step
    options.append(f"global_batch {bigger} with lr {config.lr * bigger / config.global_batch:.3g} (the linear "
                   f"scaling rule; the recipe's lr is for {config.global_batch})")
    raise ConfigError(f"global_batch {config.global_batch} is not a whole number of steps of batch_size "
                      f"{config.batch_size} on {world_size} GPU(s) ({per_step} images each): use "
                      + " or ".join(options))



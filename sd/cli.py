"""Command-line conventions shared by every script.

- Flags are never abbreviated (``--min_lr`` must not silently mean ``--min_lr_ratio``).
- A boolean flag means the same thing everywhere: ``--flag`` alone or ``--flag true`` turns it on,
  ``--flag false`` turns it off (``1/0``, ``yes/no`` too).
- A renamed flag keeps its old spelling as a hidden alias; ``--help`` shows the new one.
- An error the user can fix is one line naming the flag, and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import yaml


class ConfigError(ValueError):
    """A setting that cannot work, in one line naming the field and how to fix it: the command stops
    before any work (exit status 2)."""


TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")


def parse_bool(text) -> bool:
    """``true/false``, ``1/0``, ``yes/no``, ``on/off`` (any case), or a bool."""
    if isinstance(text, bool):
        return text
    word = str(text).strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_auto_bool(text) -> bool | None:
    """``auto`` (None: decided later, e.g. by what a checkpoint records) or a bool as ``parse_bool`` reads it."""
    if str(text).strip().lower() == "auto":
        return None
    try:
        return parse_bool(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected auto, true or false, got {text!r}") from None


class ArgumentParser(argparse.ArgumentParser):
    """``argparse`` with abbreviations off, defaults shown in ``--help`` and one-line errors."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def add_bool(self, *names: str, default: bool = False, help: str = "", **kwargs):
        """A boolean flag: ``--x``, ``--x true`` and ``--x false`` all work."""
        return self.add_argument(*names, nargs="?", const=True, default=default, type=parse_bool,
                                 metavar="BOOL", help=help, **kwargs)

    def add_alias(self, old: str, new_dest: str, **kwargs):
        """Accept ``old`` as a hidden spelling of the flag whose destination is ``new_dest``."""
        return self.add_argument(old, dest=new_dest, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the module docstring's layout and appends each flag's default to its help (unless the help
    already states it, e.g. ``(default: OUT/_downloads)``)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("%(default)" in text or "(default:" in text or action.default in (None, argparse.SUPPRESS, False)
                or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


def first_line(error) -> str:
    """The first non-empty line of an error's message (some libraries' messages run over several): what
    a one-line error shows of a cause."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


class MissingExtra(ImportError):
    """A part whose packages are an extra of the project (``pyproject.toml``'s optional dependencies), used
    where they are not installed: one line naming the extra that installs them."""


def import_extra(module: str, extra: str, what: str):
    """``module`` imported, or ``MissingExtra``: "WHAT needs its extra: pip install -e .[EXTRA] (MODULE is not
    installed)". The parts that need an extra import it where they use it, so the rest imports without it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        package = (error.name or module).split(".")[0]  # the package, also when a module inside it was asked for
        message = f"{what} needs its extra: pip install -e .[{extra}] ({package} is not installed)"
        raise MissingExtra(message) from error


def duration(seconds: float) -> str:
    """``42 s``, ``7.5 min``, ``3.2 h``: a time a person reads at a glance."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


YAML_NODES = 100_000  # a config's values with every alias expanded: far above any config, far below an alias bomb


YAML_BYTES = 16 * 2**20  # a config is a few KB; this many bytes is no config


def load_yaml_file(path: str | Path):
    """``load_yaml`` of a file, of which at most ``YAML_BYTES`` are read (a huge file or a device such as
    /dev/zero is refused, not read into memory). A ValueError names the file; OSError when it cannot be read."""
    with open(path, "rb") as handle:
        chunks, size = [], 0
        while size <= YAML_BYTES and (chunk := handle.read(1 << 16)):  # in pieces: read(YAML_BYTES) would
            chunks.append(chunk)  # allocate its whole 16 MiB up front for a file of a few KB
            size += len(chunk)
        data = b"".join(chunks)
    if len(data) > YAML_BYTES:
        raise ValueError(f"{path}: over {YAML_BYTES // 2**20} MiB, too large for a config YAML")
    try:
        return load_yaml(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: {first_line(error)}") from error


def load_yaml(text: str):
    """``yaml.safe_load`` of a config, refusing one whose aliases expand past ``YAML_NODES`` values (a
    few hundred bytes of nested aliases expand to billions: the "billion laughs"). A ValueError says
    what is wrong (invalid YAML or the expansion)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if expanded_size(node) > YAML_NODES:
            raise ValueError(f"its aliases (*name) expand to more than {YAML_NODES} values; write the values out")
        return loader.construct_document(node)
    except yaml.YAMLError as error:
        raise ValueError(f"not valid YAML ({str(error).splitlines()[0]})") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    finally:
        loader.dispose()


def expanded_size(node: yaml.Node) -> int:
    """The values under ``node`` counted as if every alias were written out (each shared node once
    per reference), computed once per distinct node."""
    sizes: dict[int, int] = {}

    def size(n: yaml.Node) -> int:
        if id(n) not in sizes:
            children = [c for pair in n.value for c in pair] if isinstance(n, yaml.MappingNode) else \
                n.value if isinstance(n, yaml.SequenceNode) else []
            sizes[id(n)] = min(1 + sum(size(c) for c in children), YAML_NODES + 1)
        return sizes[id(n)]

    return size(node)


def looks_like_hub_id(text: str) -> bool:
    """Whether ``text`` has the form of a model hub id, ``owner/name`` (not a path such as ``./x`` or ``/x``)."""
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "/"))


def view_of(cls, config, **values):
    """The part of ``config`` that one component reads: the dataclass ``cls`` filled from ``config``'s
    fields of the same names (those it has; the others keep their defaults), then from ``values``.
    The component then depends on a few named settings, not on the whole config."""
    import dataclasses

    taken = {f.name: getattr(config, f.name) for f in dataclasses.fields(cls) if f.name not in values
             and hasattr(config, f.name)}
    return cls(**taken, **values)

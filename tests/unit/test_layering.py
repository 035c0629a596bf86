"""ARCHITECTURE.md's layering: the package has no import circle and no import that runs up its floors ("Dependencies
between rooms"), counting the imports inside functions; no module of ``sd`` imports an entry point; inference code
(sampling, exports, loaders) reads run folders through the low-floor readers and never imports ``sd/train/``."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INFERENCE = ["SD_ImageGen.py", *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "sd" / "imagegen").glob("*.py"))),
             "sd/sampling.py", "sd/formats.py", "sd/metadata.py", "sd/run_folder.py",
             "sd/posthoc_ema.py", "sd/lora/formats.py", "sd/lora/dora.py", "sd/embedding/formats.py",
             "sd/embedding/tokens.py", "sd/controlnet/formats.py", "sd/flow.py", "sd/reflow.py", "SD_Reflow.py"]

# ARCHITECTURE.md's "Dependencies between rooms" as floors, the ground first: a module may import modules of its own
# floor and of the floors below it, never of one above. A module's floor is that of the longest name here that is
# it or a package holding it; every module of sd/ must have one (a new room is placed here when it is made).
FLOORS = [
    ["sd.cli", "sd.files", "sd.faults", "sd.training_mode", "sd.settings"],  # import nothing of ours
    ["sd.runtime", "sd.distributed", "sd.tokenizer", "sd.run_folder", "sd.posthoc_ema", "sd.original_layout"],  # the other helpers
    ["sd.embedding"],  # embedding only files
    ["sd.model", "sd.flow"],  # model only tokenizer and embedding.tokens
    ["sd.data", "sd.lora", "sd.sampling", "sd.metadata"],  # data, lora and sampling on model
    ["sd.formats"],  # formats on lora.adapters, sampling and run_folder
    ["sd.controlnet", "sd.evaluation", "sd.vae", "sd.model_weights", "sd.lora.tools", "sd.checkpoint_merge"],
    ["sd.imagegen"],
    ["sd.reflow"],
    ["sd.lora.mode", "sd.embedding.mode", "sd.controlnet.mode"],  # the training modes, each in its room
    ["sd.train"],  # train sits on all of them
    ["sd.studio"],  # the studio builds the commands of all the others
]
# Up the floors today, and only these (none: each room's mode.py implements sd.training_mode.Mode, on the ground).
KNOWN_UP: set[tuple[str, str]] = set()
ENTRY_POINTS = {path.stem for path in ROOT.glob("*.py")} | {"pipeline", "bench", "demo", "tests"}


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def package_modules(package: Path) -> dict[str, Path]:
    """``{dotted name: file}`` of every module of ``package`` and its sub-packages (a package by its own name)."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph(package: Path) -> dict[str, set[str]]:
    """``{module: the package's modules it imports}``, at its top or inside a function; ``from P import m`` counts
    the module ``P.m`` where there is one, else ``P``; the root package itself (no code) is left out."""
    modules = package_modules(package)
    graph = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importing module's package, up level - 1
                    parent = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                inner = {f"{base}.{alias.name}" for alias in node.names} & modules.keys()
                targets.update(inner or {base})
        graph[name] = {outermost_module(t, modules) for t in targets} - {None, name, package.name}
    return {name: targets for name, targets in graph.items() if name != package.name}


def outermost_module(name: str, modules) -> str | None:
    """``name`` or the nearest package above it that is a module of ours (``sd.x.func`` -> ``sd.x``), or None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: each set of modules that import one another round a loop (Tarjan's strongly connected
    components of more than one module), sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def floor_of(module: str, floors: list[list[str]]) -> int | None:
    matches = [(len(name), level) for level, names in enumerate(floors) for name in names
               if module == name or module.startswith(name + ".")]
    return max(matches)[1] if matches else None


def up_imports(graph: dict[str, set[str]], floors: list[list[str]]) -> set[tuple[str, str]]:
    """``(importer, imported)`` for each import of a module on a higher floor than its importer's."""
    return {(name, target) for name, targets in graph.items() for target in targets
            if floor_of(target, floors) > floor_of(name, floors)}


@pytest.fixture(scope="module")
def graph():
    return import_graph(ROOT / "sd")


def test_every_module_has_a_floor(graph):
    assert not [name for name in graph if floor_of(name, FLOORS) is None], "place each new module in FLOORS"


def test_the_package_has_no_import_circle(graph):
    assert circles(graph) == []


def test_no_import_runs_up_the_floors(graph):
    found = up_imports(graph, FLOORS)
    assert found - KNOWN_UP == set(), "these imports run up ARCHITECTURE.md's floors: move the code they need down"
    assert KNOWN_UP - found == set(), "no longer up the floors: delete these from KNOWN_UP"


def test_no_library_module_imports_an_entry_point():
    wrong = {str(path.relative_to(ROOT)): sorted(m for m in imported_modules(path) if m.split(".")[0] in ENTRY_POINTS)
             for path in (ROOT / "sd").rglob("*.py")}
    assert {name: found for name, found in wrong.items() if found} == {}


def test_circles_and_up_imports_are_found_inside_functions_too(tmp_path):
    """The checks themselves, on a made-up package: a circle closed by an import inside a function, a constant
    taken from a module that imports its importer (``from room import b``), and an import up the floors."""
    room = tmp_path / "room"
    room.mkdir()
    (room / "__init__.py").write_text("")
    (room / "a.py").write_text("import room.b\n")
    (room / "b.py").write_text("def f():\n    import room.a\n")
    (room / "c.py").write_text("from room import d\n")
    (room / "d.py").write_text("from room.c import NAME\n")
    (room / "low.py").write_text("def f():\n    from room.high import g\n")
    (room / "high.py").write_text("")
    graph = import_graph(room)
    assert circles(graph) == [["room.a", "room.b"], ["room.c", "room.d"]]
    floors = [["room.low"], ["room.a", "room.b", "room.c", "room.d"], ["room.high"]]
    assert up_imports(graph, floors) == {("room.low", "room.high")}


@pytest.mark.parametrize("name", INFERENCE)
def test_inference_code_never_imports_the_trainer(name):
    assert (ROOT / name).is_file()
    trainer = sorted(m for m in imported_modules(ROOT / name) if m == "sd.train" or m.startswith("sd.train."))
    assert not trainer, f"{name} imports {trainer}"

"""Imports go one way: each layer of docs/architecture.md imports only the layers below it, and
no two modules import each other (directly or around a circle).

The imports are read from the source with :mod:`ast` (every ``import`` / ``from ... import``,
including those inside functions; ``if TYPE_CHECKING:`` blocks are annotations only and not
counted), with the package-dir mapping of pyproject.toml applied (``core`` -> ``ferrule``,
``converters`` -> ``ferrule.converters``, ``plugins`` -> ``ferrule.plugins``). Plugin tests
and the tests folder are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"core": "ferrule", "converters": "ferrule.converters", "plugins": "ferrule.plugins"}

#: bottom first; a unit is a top-level module or package of ``ferrule`` (``ferrule.plugins`` and
#: ``ferrule.converters`` count as one unit each). A unit may import its own layer and the layers
#: below; the cycle test keeps same-layer imports one way.
LAYERS: list[tuple[str, set[str]]] = [
    ("foundation", {"ferrule", "ferrule.compat", "ferrule.lazy_jit", "ferrule.user_errors", "ferrule.fs", "ferrule.formats",
                    "ferrule.config_translation", "ferrule.losses", "ferrule.offload", "ferrule.envs",
                    "ferrule.engine_settings"}),
    ("contract", {"ferrule.contract"}),
    ("mapping", {"ferrule.mapping", "ferrule.media", "ferrule.chat", "ferrule.tmlv0"}),
    ("engines", {"ferrule.megatron", "ferrule.rollout"}),
    ("lora", {"ferrule.lora"}),
    ("sync", {"ferrule.sync"}),
    ("assembly", {"ferrule.plugins", "ferrule.conformance"}),
    ("converters", {"ferrule.converters"}),
    ("launchers", {"ferrule.rl", "ferrule.serve"}),
    ("cli", {"ferrule.cli", "ferrule.__main__"}),
]


def _module_files(root: Path) -> dict[str, Path]:
    mods = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root / folder)
            if "tests" in rel.parts:
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([package, *parts])] = path
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(module: str, path: Path) -> list[tuple[str, int]]:
    """``(dotted name, line)`` of every ferrule name imported by ``module`` at run time."""
    is_package = path.name == "__init__.py"
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((target, node.lineno))
            out.extend((f"{target}.{alias.name}", node.lineno) for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return [(name, line) for name, line in out if name == "ferrule" or name.startswith("ferrule.")]


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """``{module: {imported ferrule module: first line}}`` (a name resolves to its longest module prefix)."""
    mods = _module_files(root)
    graph: dict[str, dict[str, int]] = {}
    for module, path in mods.items():
        edges = graph.setdefault(module, {})
        for name, line in _imported_names(module, path):
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != module:
                edges.setdefault(name, line)
    return graph


def unit_of(module: str) -> str:
    """``ferrule.X`` of ``ferrule.X.Y...`` (the root ``ferrule`` is its own unit)."""
    return ".".join(module.split(".")[:2])


def layer_of(unit: str) -> int:
    for i, (_, units) in enumerate(LAYERS):
        if unit in units:
            return i
    raise AssertionError(f"{unit} is in no layer of tests/test_layering.py LAYERS; add it (and to docs/architecture.md)")


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    bad = []
    for module, edges in sorted(graph.items()):
        here = layer_of(unit_of(module))
        for target, line in sorted(edges.items()):
            if target == "ferrule":  # the package root: the pluggy markers, imported by every layer
                continue
            there = layer_of(unit_of(target))
            if there > here:
                bad.append(f"{module} (layer {LAYERS[here][0]}) imports {target} (layer {LAYERS[there][0]}) "
                           f"at line {line}")
    return bad


#: the folders above core/: the core imports nothing of them, not even in a function (the commands that
#: drive a converter live in ``ferrule.converters`` and ``ferrule.cli`` mounts them by "module:attr" name)
ABOVE_CORE = ("ferrule.converters", "ferrule.plugins")


def core_reaches_out(graph: dict[str, dict[str, int]]) -> list[str]:
    """Imports from a module of ``core/`` into ``converters/`` or ``plugins/`` (the layer table allows
    ``ferrule.cli`` -> ``ferrule.converters``; the folders do not: ``core/`` is what the others build on)."""
    def outside(module: str) -> bool:
        return any(module == top or module.startswith(top + ".") for top in ABOVE_CORE)

    return [f"{module} imports {target} at line {line}"
            for module, edges in sorted(graph.items()) if not outside(module)
            for target, line in sorted(edges.items()) if outside(target)]


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w == "ferrule":
                continue
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(cycles)


@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, int]]:
    return import_graph()


def test_every_module_has_a_layer(graph):
    assert sorted({unit_of(m) for m in graph if not any(unit_of(m) in u for _, u in LAYERS)}) == []


def test_every_unit_of_the_layers_exists(graph):
    """No stale row: a unit that moved away (``ferrule.specs`` into ``ferrule.contract``) leaves LAYERS, and
    with it docs/architecture.md's table, which the test below holds to LAYERS."""
    units = {unit_of(m) for m in graph}
    assert sorted(u for _, us in LAYERS for u in us if u not in units) == []


def test_no_layer_imports_one_above_it(graph):
    assert upward_imports(graph) == []


def test_no_import_cycles(graph):
    assert import_cycles(graph) == []


def test_core_imports_nothing_of_the_converters_or_plugins(graph):
    assert core_reaches_out(graph) == []


def family_cross_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """Imports from one in-tree family's package into another's (``ferrule.plugins.X`` -> ``ferrule.plugins.Y``)."""
    def family(module: str) -> str | None:
        parts = module.split(".")
        return parts[2] if len(parts) > 2 and parts[:2] == ["ferrule", "plugins"] else None

    return [f"{module} imports {target} at line {line}" for module, edges in sorted(graph.items())
            for target, line in sorted(edges.items())
            if family(module) and family(target) and family(module) != family(target)]


def test_no_family_imports_another(graph):
    """What two families share lives in the core (issue 43: Inkling-2 imported Inkling's layers and config
    helpers; they are ferrule.megatron.shared_layers and ferrule.config_translation.layer_types now)."""
    assert family_cross_imports(graph) == []
    assert family_cross_imports({"ferrule.plugins.inkling2.layers": {"ferrule.plugins.inkling.layers": 25}}) == [
        "ferrule.plugins.inkling2.layers imports ferrule.plugins.inkling.layers at line 25"]


def test_a_command_importing_a_converter_inside_a_function_is_caught(tmp_path):
    """The defect this check was added for: ``ferrule check`` and ``ferrule convert`` were modules of
    ``ferrule.cli`` importing ``ferrule.converters`` inside their command functions (a two-file tree)."""
    (tmp_path / "core" / "cli").mkdir(parents=True)
    (tmp_path / "converters").mkdir()
    (tmp_path / "core" / "cli" / "check.py").write_text(
        "def check_command():\n    from ferrule.converters.check import run_check\n    run_check()\n")
    (tmp_path / "converters" / "check.py").write_text("def run_check(): ...\n")
    assert core_reaches_out(import_graph(tmp_path)) == [
        "ferrule.cli.check imports ferrule.converters.check at line 2"]


def test_the_graph_sees_function_level_and_relative_imports(graph):
    # a function-local import hid the old cycles; the graph must see such imports, or the two tests
    # above pass for the wrong reason (ferrule.contract.registry resolves providers inside functions)
    assert "ferrule.contract.specs" in graph["ferrule.contract.registry"]
    assert "ferrule.contract.registry" in graph["ferrule.cli"]  # inside a command (the CLI's torch-free boundary)
    assert "ferrule.megatron.towers" in graph["ferrule.megatron.provider"]  # relative, inside a function


@pytest.mark.parametrize("module, source, reintroduced", [
    # the cycles that issue 23 removed, put back one at a time into an otherwise clean graph
    ("ferrule.megatron.engine", "from ferrule.lora import apply_lora\n", "engine -> lora"),
    ("ferrule.contract.registry", "def f():\n    from ferrule.megatron.towers import attach_towers\n", "registry -> engine"),
    ("ferrule.lora.peft_experts", "from .peft_format import PEFT_PREFIX\n", "lora three-file circle"),
    ("ferrule.lora.peft_format", "from ferrule.rl.checkpoints import find_run_checkpoint\n", "lora -> launcher"),
    ("ferrule.converters.export", "from ferrule.rl.checkpoints import find_run_checkpoint\n", "export -> launcher"),
])
def test_each_removed_cycle_would_fail(tmp_path, module, source, reintroduced):
    """The checks above fail on each cycle of the old layout (an import added to a copy of the tree)."""
    import shutil

    for folder in PACKAGE_DIRS:
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("tests", "__pycache__"))
    path = _module_files(tmp_path)[module]
    path.write_text(path.read_text() + "\n\n" + source)
    graph = import_graph(tmp_path)
    problems = upward_imports(graph) + [" <-> ".join(c) for c in import_cycles(graph)]
    assert problems, f"{reintroduced} went unnoticed"


def _doc_layers() -> list[tuple[str, set[str]]]:
    """The layer table of docs/architecture.md: ``(layer, {ferrule.unit, ...})`` per row, bottom first."""
    import re

    rows = []
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"[a-z]+", cells[0]) and cells[1].startswith("`"):
            rows.append((cells[0], {f"ferrule.{u}" for u in re.findall(r"`([\w.]+)`", cells[1])}))
    return rows


def test_architecture_doc_lists_the_same_layers_and_units():
    """docs/architecture.md's table draws LAYERS: the same layers in the same order, the same units in each
    (the package root ``ferrule`` is said in prose below the table)."""
    assert _doc_layers() == [(name, units - {"ferrule"}) for name, units in LAYERS]


def test_no_ferrule_code_imports_an_old_path():
    """The old paths of ferrule.compat are for users' code: ferrule itself, its example plugin and the
    benchmarks import the new ones."""
    from ferrule.compat import MOVED_MODULES, RENAMED_NAMES

    old = set(MOVED_MODULES) | {f"{m}.{name}" for m, name in RENAMED_NAMES}
    found = []
    for folder in ("core", "converters", "plugins", "examples", "bench"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if {"tests", "build"} & set(path.relative_to(ROOT).parts):  # build/: a pip wheel's stale copy
                continue
            found += [f"{path.relative_to(ROOT)}:{line} imports {name}"
                      for name, line in _imported_names("x.y", path) if name in old]
    assert found == []



def test_no_ferrule_code_takes_a_name_through_a_public_facade():
    """A public facade (ferrule.compat.PUBLIC_FACADES) re-exports names of the modules it was split into for
    users; ferrule itself imports each such name from the module that defines it, so no split module stays
    importable under its old name only for ferrule's sake."""
    from ferrule.compat import PUBLIC_FACADES

    re_exported = set()
    for facade, sources in PUBLIC_FACADES.items():
        path = ROOT / "core" / Path(*facade.split(".")[1:]).with_suffix(".py")
        names = {name for name, _ in _imported_names(facade, path)}
        got = {f"{facade}.{name.rsplit('.', 1)[1]}" for name in names if name.rsplit(".", 1)[0] in sources}
        assert got, f"{facade} re-exports nothing of {sources}: drop it from PUBLIC_FACADES"
        re_exported |= got
    found = []
    for folder in ("core", "converters", "plugins"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "tests" in path.relative_to(ROOT).parts:
                continue
            prefix = ("ferrule",) if folder == "core" else ("ferrule", folder)
            module = ".".join(prefix + path.relative_to(ROOT / folder).with_suffix("").parts)
            found += [f"{path.relative_to(ROOT)}:{line} imports {name}"
                      for name, line in _imported_names(module, path) if name in re_exported]
    assert found == []

def test_old_paths_are_the_moved_modules_with_a_warning():
    """Each old module path of ferrule.compat imports the new module itself (one object) and warns,
    naming the new path; a renamed attribute warns and is the new object."""
    import importlib
    import sys

    from ferrule.compat import MOVED_MODULES

    for old, new in MOVED_MODULES.items():
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=f"{old} moved to {new};"):
            module = importlib.import_module(old)
        assert module is importlib.import_module(new)
        assert module.__spec__.name == new  # the shared module keeps its own spec
    import ferrule.mapping
    from ferrule.mapping.vocabulary import ParamMapping

    with pytest.warns(DeprecationWarning, match="ferrule.mapping.Mapping is renamed ParamMapping"):
        assert ferrule.mapping.Mapping is ParamMapping
    with pytest.raises(AttributeError, match="has no attribute 'Mappings'"):
        ferrule.mapping.Mappings

"""The layers and the one direction their imports point (docs/architecture.md).

Reads every ``.py`` file of the repository's packages with :mod:`ast` (nothing is
imported): ``import x`` and ``from x import y`` anywhere in a file, function bodies
included, relative imports resolved, plus dotted strings that name one of our modules
(the CLI's ``importlib`` list of subcommand modules, ``python -m`` command lines).
"""

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: Lowest first. A module may import its own package and lower layers; never a higher
#: layer, nor another package of its own layer (the two services stay independent).
#: ``disco_cli`` (the command line and the benchmarks) is the top: nothing imports it.
LAYERS = (("disco",), ("protos",), ("draft_service", "target_service"), ("orchestrator",), ("deploy",),
          ("disco_cli",))

#: Inside the core, lowest first: the modules directly in ``disco/`` (the shared vocabulary),
#: then its sub-packages by concern. Same rule: down only, never across one level.
DISCO_LAYERS = (("disco",), ("disco.speculation", "disco.models"), ("disco.engines",), ("disco.offline",))

_PACKAGES = {package for packages in LAYERS for package in packages}


@dataclass(frozen=True)
class Arrow:
    """One reference from a module of ours to another module of ours."""

    source: str  # importing module, e.g. "orchestrator.cli"
    file: str  # its path relative to the root
    line: int
    target: str  # the module it reaches, e.g. "disco_cli.commands.ray"
    text: str  # the statement (or string literal) as written
    is_import: bool  # False: a dotted string naming a module

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.text} -> {self.target}"


def rank(module: str) -> int:
    top = module.split(".")[0]
    return next(number for number, packages in enumerate(LAYERS) if top in packages)


def room(module: str) -> str:
    """The room of a core module: its sub-package (``disco.engines``), or ``disco`` for the
    modules directly in ``disco/``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or f"{parts[0]}.{parts[-1]}" in _DISCO_ROOMS else parts[0]


_DISCO_ROOMS = {room for rooms in DISCO_LAYERS for room in rooms}


def disco_rank(module: str) -> int:
    return next(number for number, rooms in enumerate(DISCO_LAYERS) if room(module) in rooms)


def find_modules(root: Path) -> dict[str, Path]:
    """``{dotted module name: file}`` for every ``.py`` file of the layered packages."""
    modules = {}
    for package in sorted(_PACKAGES):
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def find_arrows(root: Path) -> list[Arrow]:
    """Every reference between modules of ours, in file and line order."""
    modules = find_modules(root)
    arrows = []
    for source, path in modules.items():
        text = path.read_text()
        file = str(path.relative_to(root))
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text, filename=file)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                written = (line.partition("#")[0] for line in lines[node.lineno - 1:node.end_lineno])
                statement = " ".join(" ".join(written).split())
                for target in _imported(node, source, path, modules):
                    if target.split(".")[0] in _PACKAGES and target != source:
                        arrows.append(Arrow(source, file, node.lineno, target, statement, True))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value \
                    and node.value in modules and node.value != source:  # dotted: "disco" is also a prog name
                arrows.append(Arrow(source, file, node.lineno, node.value, repr(node.value), False))
    return sorted(arrows, key=lambda arrow: (arrow.file, arrow.line, arrow.target))


def _imported(node: ast.Import | ast.ImportFrom, source: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """The modules one statement reaches: ``from a import b`` reaches the module ``a.b`` when
    there is one, else ``a``; a name we do not have reaches its longest prefix we have."""

    def known(name: str) -> str:
        parts = name.split(".")
        return next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in modules), name)

    if isinstance(node, ast.Import):
        return list(dict.fromkeys(known(alias.name) for alias in node.names))
    base = node.module or ""
    if node.level:  # relative: from the file's package, one level up per extra dot
        package = (source if path.name == "__init__.py" else source.rpartition(".")[0]).split(".")
        base = ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])])
    return list(dict.fromkeys(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else known(base)
                              for alias in node.names))


def upward(arrows: list[Arrow]) -> list[Arrow]:
    """Arrows to a higher layer, or across to another package of the same layer; inside
    the core, the same between its rooms (:data:`DISCO_LAYERS`)."""
    return [arrow for arrow in arrows
            if rank(arrow.target) > rank(arrow.source)
            or (rank(arrow.target) == rank(arrow.source) and arrow.target.split(".")[0] != arrow.source.split(".")[0])
            or _upward_in_core(arrow)]


def _upward_in_core(arrow: Arrow) -> bool:
    if arrow.source.split(".")[0] != "disco" or arrow.target.split(".")[0] != "disco":
        return False
    source, target = disco_rank(arrow.source), disco_rank(arrow.target)
    return target > source or (target == source and room(arrow.target) != room(arrow.source))


def cycles(arrows: list[Arrow]) -> list[list[Arrow]]:
    """The import statements of every group of modules that import each other (Tarjan's
    strongly connected components, size > 1); dotted strings are not imports."""
    graph: dict[str, list[str]] = {}
    for arrow in arrows:
        if arrow.is_import:
            graph.setdefault(arrow.source, []).append(arrow.target)
            graph.setdefault(arrow.target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == module:
                    break
            if len(component) > 1:
                components.append(component)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return [[arrow for arrow in arrows if arrow.is_import and arrow.source in group and arrow.target in group]
            for group in components]


def test_every_layered_package_is_read():
    modules = find_modules(REPO)
    for packages in LAYERS:
        for package in packages:
            assert package in modules, f"no {package}/__init__.py: LAYERS is out of date"
    assert len(modules) > 60
    assert any(arrow.target == "disco_cli.commands.serve" for arrow in find_arrows(REPO))  # a CLI string
    for rooms in DISCO_LAYERS[1:]:
        for name in rooms:
            assert name in modules, f"no {name.replace('.', '/')}/__init__.py: DISCO_LAYERS is out of date"


#: The core's own modules directly in ``disco/`` at most; the rest live in its rooms.
MAX_CORE_MODULES = 10


def test_the_core_is_split_into_rooms_by_concern():
    direct = sorted(path.name for path in (REPO / "disco").glob("*.py"))
    rooms = sorted(path.parent.name for path in (REPO / "disco").glob("*/__init__.py"))
    assert len(direct) <= MAX_CORE_MODULES, direct
    assert len(rooms) >= 3, rooms
    for name in rooms:
        assert ast.get_docstring(ast.parse((REPO / "disco" / name / "__init__.py").read_text())), \
            f"disco/{name}/__init__.py should say what the room holds and what it may import"


def test_the_serving_path_never_imports_the_offline_tooling():
    bad = [arrow for arrow in find_arrows(REPO) if arrow.target.startswith("disco.offline")
           and not arrow.source.startswith(("disco.offline", "disco_cli"))]
    assert not bad, "only disco.offline itself and the command line import disco.offline:\n" + "\n".join(map(str, bad))


def test_nothing_imports_the_command_line():
    bad = [arrow for arrow in find_arrows(REPO) if arrow.target.split(".")[0] == "disco_cli"
           and arrow.source.split(".")[0] != "disco_cli"]
    assert not bad, "disco_cli/ is the top layer:\n" + "\n".join(map(str, bad))


def test_no_argparse_below_the_command_line():
    found = [str(path.relative_to(REPO)) for package in ("orchestrator", "draft_service", "target_service", "deploy")
             for path in sorted((REPO / package).rglob("*.py")) if "argparse" in path.read_text()]
    assert not found, f"parsing arguments is the command line's job (disco_cli/): {found}"


def test_imports_point_down_the_layers():
    bad = upward(find_arrows(REPO))
    order = " <- ".join("/".join(packages) for packages in LAYERS)
    assert not bad, f"imports against the layer order ({order}):\n" + "\n".join(map(str, bad))


def test_orchestrator_never_imports_deploy():
    bad = [arrow for arrow in find_arrows(REPO) if arrow.source.startswith("orchestrator")
           and arrow.target.split(".")[0] == "deploy"]
    assert not bad, "orchestrator/ must not import deploy/:\n" + "\n".join(map(str, bad))


def test_no_import_cycles():
    found = cycles(find_arrows(REPO))
    assert not found, "import cycles:\n" + "\n\n".join("\n".join(map(str, group)) for group in found)


def test_the_checks_catch_hand_made_violations(tmp_path):
    files = {
        "disco/__init__.py": "",
        "disco/a.py": "def f():\n    from . import b\n",  # function-level, relative
        "disco/b.py": "import disco.a\n",  # closes a cycle with disco.a
        "disco/engines/__init__.py": "",
        "disco/engines/kv.py": "from disco.offline import records\nfrom disco.models import int4\n",  # up; down
        "disco/models/__init__.py": "",
        "disco/models/int4.py": "from disco.speculation import loop\n",  # across one level
        "disco/offline/__init__.py": "",
        "disco/offline/records.py": "from disco.models import int4\n",  # allowed: down
        "disco/speculation/__init__.py": "",
        "disco/speculation/loop.py": "",
        "protos/__init__.py": "",
        "draft_service/__init__.py": "from target_service import servicer\n",  # across one layer
        "target_service/__init__.py": "",
        "target_service/servicer.py": "",
        "orchestrator/__init__.py": "",
        "orchestrator/launch.py": "MODULES = ('disco_cli.main',)\n",  # a string naming a higher module
        "deploy/__init__.py": "",
        "disco_cli/__init__.py": "",
        "disco_cli/main.py": "from deploy import ray_head\nfrom orchestrator import launch\n",  # allowed: down
        "deploy/ray_head.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    arrows = find_arrows(tmp_path)
    assert [str(arrow) for arrow in upward(arrows)] == [
        "disco/engines/kv.py:1: from disco.offline import records -> disco.offline.records",
        "disco/models/int4.py:1: from disco.speculation import loop -> disco.speculation.loop",
        "draft_service/__init__.py:1: from target_service import servicer -> target_service.servicer",
        "orchestrator/launch.py:1: 'disco_cli.main' -> disco_cli.main",
    ]
    assert [[str(arrow) for arrow in group] for group in cycles(arrows)] == [[
        "disco/a.py:2: from . import b -> disco.b",
        "disco/b.py:1: import disco.a -> disco.a",
    ]]


#: A file past this many lines is a design smell (docs/architecture.md); generated stubs aside.
MAX_SOURCE_LINES = 500


def test_no_source_file_is_over_500_lines():
    too_long = []
    for package in sorted(_PACKAGES) + ["tests"]:
        for path in sorted((REPO / package).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            lines = len(path.read_text().splitlines())
            if lines > MAX_SOURCE_LINES:
                too_long.append(f"{path.relative_to(REPO)}: {lines}")
    assert not too_long, too_long

"""The package's layering, read from the source: every import counts, lazy ones included.

The order (docs/design.md has the table): a package imports only packages of a lower
rank, and modules of its own package. The pod side imports only `common`, `data`,
`errors` and Prefect; `runner` and `worker` never import each other; no module
imports itself back through any chain of imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kinetic_prefect

PACKAGE_ROOT = Path(kinetic_prefect.__file__).parent

# Lower rank first; a package may import any package of a lower rank.
RANKS = {
    "errors": 0,
    "common": 1,
    "data": 2,
    "outputs": 3,
    "pod": 3,
    "launch": 3,
    "blocks": 4,
    "backends": 5,
    "runner": 6,
    "worker": 6,
    "cli": 7,
    "plugin": 7,
    "__init__": 8,
}
# Narrower than their rank allows.
ONLY = {
    "pod": {"errors", "common", "data"},
    "outputs": {"errors", "common", "data"},
}
POD_FORBIDDEN_THIRD_PARTY = ("kubernetes_asyncio", "typer", "prefect_kubernetes")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = {_module_name(path): path for path in PACKAGE_ROOT.rglob("*.py")}


def _imports(module: str) -> set[str]:
    """Every name `module` imports anywhere in its source, as absolute dotted names."""
    path = SOURCES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            anchor = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join([*anchor, *([node.module] if node.module else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _own_modules(names: set[str]) -> set[str]:
    """The package's modules among `names` (a `from pkg import name` may name a module or not)."""
    return {n for n in names if n in SOURCES}


def _package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _edges() -> dict[str, set[str]]:
    return {m: _own_modules(_imports(m)) - {m} for m in SOURCES}


def test_every_package_imports_only_lower_layers():
    wrong = []
    for module, imported in _edges().items():
        own = _package_of(module)
        for target in imported:
            other = _package_of(target)
            if other == own or other == "__init__" and target == "kinetic_prefect":
                continue
            allowed = ONLY.get(own)
            if allowed is not None and other not in allowed or RANKS[other] >= RANKS[own]:
                wrong.append(f"{module} -> {target}")

    assert wrong == []


def test_no_import_cycle_between_modules():
    edges = _edges()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])

    assert cycles == []


def test_runner_and_worker_never_import_each_other():
    crossing = [
        f"{m} -> {t}"
        for m, targets in _edges().items()
        for t in targets
        if {_package_of(m), _package_of(t)} == {"runner", "worker"}
    ]

    assert crossing == []


def test_the_pod_side_imports_no_kubernetes_client_or_cli():
    pod_modules = sorted(m for m in SOURCES if _package_of(m) == "pod")
    offending = {
        m: sorted(n for n in _imports(m) if n.split(".")[0] in POD_FORBIDDEN_THIRD_PARTY)
        for m in pod_modules
    }

    assert pod_modules, "no modules found under kinetic_prefect/pod"
    assert offending == dict.fromkeys(pod_modules, [])


def test_the_gcs_credentials_block_reaches_no_kubernetes_client():
    """A pod unpickles result storage holding `KineticGcpCredentials`: importing its module
    (and every module of ours it imports) must not import prefect-kubernetes. The package
    `__init__`s it passes through import their names lazily (tests/pod checks that at run time)."""
    edges, reached, todo = _edges(), set(), ["kinetic_prefect.blocks.credentials"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(edges[module])
    offending = {
        m: sorted(n for n in _imports(m) if n.split(".")[0] in POD_FORBIDDEN_THIRD_PARTY)
        for m in reached
    }

    assert "kinetic_prefect.blocks.cluster" not in reached
    assert {m: found for m, found in offending.items() if found} == {}


def _private_prefect_uses(module: str) -> list[str]:
    """Prefect names starting with `_` that `module` imports, or reads off a Prefect import."""
    path = SOURCES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    bound: dict[str, str] = {}
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "prefect":
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "prefect":
                    bound[alias.asname or alias.name.split(".")[0]] = alias.name
    for name in _imports(module):
        parts = name.split(".")
        if parts[0] == "prefect" and any(p.startswith("_") for p in parts[1:]):
            uses.append(name)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            uses.append(f"{bound[node.value.id]}.{node.attr}")
    return sorted(set(uses))


def test_private_prefect_api_is_used_only_in_prefect_modules():
    private = {
        m: _private_prefect_uses(m)
        for m in SOURCES
        if not m.rsplit(".", 1)[-1].startswith("prefect_")
    }

    assert {m: uses for m, uses in private.items() if uses} == {}


def test_at_the_top_level_only_the_public_modules():
    top = sorted(p.name for p in PACKAGE_ROOT.glob("*.py"))

    assert top == ["__init__.py", "errors.py", "plugin.py"]
    # `blocks` is a package so that a pod imports one block type's module, not both.
    assert sorted(p.name for p in (PACKAGE_ROOT / "blocks").glob("*.py")) == [
        "__init__.py",
        "cluster.py",
        "credentials.py",
        "schema.py",
    ]


def _tests_named_in(module: Path) -> list[str]:
    import re

    return sorted(set(re.findall(r"`(test_\w+)`", module.read_text())))


def _marked_lowest(test: str) -> bool:
    """Whether `def test` exists in tests/ and carries the `lowest_prefect` mark (or its module)."""
    import re

    for path in (PACKAGE_ROOT.parent / "tests").rglob("test_*.py"):
        text = path.read_text()
        # The decorators above the function (a mark on one of its params counts too).
        found = re.search(rf"\n\n\n((?:(?!\n\n\n).)*?)def {test}\(", text, re.DOTALL)
        if found:
            module_mark = re.search(r"^pytestmark = .*lowest_prefect", text, re.MULTILINE)
            return bool(module_mark) or "lowest_prefect" in found.group(1)
    return False


def test_every_prefect_adapter_names_its_tests_and_they_run_on_the_lowest_prefect_too():
    adapters = sorted(PACKAGE_ROOT.rglob("prefect_*.py"))
    named = {str(a.relative_to(PACKAGE_ROOT)): _tests_named_in(a) for a in adapters}

    assert [module for module, tests in named.items() if not tests] == []
    unmarked = [(m, t) for m, tests in named.items() for t in tests if not _marked_lowest(t)]
    assert unmarked == [], "mark these @pytest.mark.lowest_prefect (make test-lowest runs them)"

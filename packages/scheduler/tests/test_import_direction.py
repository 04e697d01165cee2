"""The folders of ``tandem.scheduler`` import one way: each may import only the folders
listed before it (and the shared root modules), so the tree reads as the architecture.
Imports under ``if TYPE_CHECKING`` are annotations, not arrows, and are not counted."""

from __future__ import annotations

import ast
from pathlib import Path

import tandem.scheduler

PACKAGE = Path(tandem.scheduler.__file__).parent
# Lowest first. "core" is the package's root modules: the config, the request and the
# messages between the policy and the runner.
ORDER = [
    "text",
    "sampling",
    "core",
    "kv",
    "schedule",
    "disagg",
    "kernels",
    "attention",
    "models",
    "parallel",
    "speculative",
    "runner",
    "engine",
]
FRONT_DOOR = {"__init__", "__main__"}  # the package's public names re-exported


def _folder(module: str) -> str:
    """The folder of ``tandem.scheduler.<module>`` ("core" for root modules)."""
    head = module.partition(".")[0]
    return head if (PACKAGE / head).is_dir() else "core"


def _runtime_imports(tree: ast.Module) -> list[str]:
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
            found.extend(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _edges() -> list[tuple[str, str]]:
    """(importing module, imported module), both relative to ``tandem.scheduler``."""
    modules = {
        ".".join(path.relative_to(PACKAGE).with_suffix("").parts) for path in PACKAGE.rglob("*.py")
    }
    edges = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        for target in _runtime_imports(ast.parse(path.read_text())):
            if not target.startswith("tandem.scheduler."):
                continue
            rel = target.removeprefix("tandem.scheduler.")
            if rel in modules or f"{rel}.__init__" in modules:
                edges.append((name, rel.removesuffix(".__init__")))
    return edges


def test_every_folder_has_a_place_in_the_order():
    folders = {
        _folder(".".join(p.relative_to(PACKAGE).with_suffix("").parts))
        for p in PACKAGE.rglob("*.py")
    }
    folders -= {"__init__", "__main__"}
    assert folders == set(ORDER), "a new folder needs its place in ORDER"


def test_imports_between_folders_run_one_way():
    wrong = []
    for source, target in _edges():
        if source.split(".")[-1] in FRONT_DOOR and _folder(source) == "core":
            continue
        a, b = _folder(source), _folder(target)
        if a != b and ORDER.index(b) > ORDER.index(a):
            wrong.append(f"{source} ({a}) imports {target} ({b})")
    assert not wrong, "imports against the folders' order:\n" + "\n".join(wrong)


def test_the_policy_never_imports_the_forward_side():
    """The host-only policy talks to the runner through ``messages.Runner`` only."""
    forward = {"runner", "models", "attention", "kernels", "speculative", "parallel", "disagg"}
    seen = [
        f"{s} imports {t}"
        for s, t in _edges()
        if _folder(s) == "schedule" and _folder(t) in forward
    ]
    assert not seen, "\n".join(seen)


def test_the_order_is_checked_by_a_real_edge():
    """The parser sees the arrows it judges (an empty edge list would pass anything)."""
    edges = set(_edges())
    assert ("schedule.scheduler", "messages") in edges
    assert ("engine.wiring", "schedule.scheduler") in edges

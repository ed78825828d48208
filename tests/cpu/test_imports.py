"""Imports point down the data flow (STYLE.md rule 13): no import circle anywhere in the
package, counting imports inside functions too (a lazy import hides a circle, it does not
remove it); the vLLM side never imports the Serve side; each room of the Serve side
(`engram_ray/serve/__init__.py`) imports of it only what sits below it."""

from __future__ import annotations

import ast
import tomllib
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVE = "engram_ray.serve"
# What each room of engram_ray.serve may import of engram_ray.serve besides itself
# (engram_ray/serve/__init__.py; `app` assembles them all).
ROOM_MAY_IMPORT = {
    "settings": (),
    "edge": ("settings",),
    "deploy": ("settings",),
    "member": ("settings", "edge.fingerprint"),
}


def package_modules() -> dict[str, Path]:
    """{module name: file} of every module pyproject installs (its package-dir mapping)."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = setuptools.get("package-dir", {})
    modules = {}
    for package in setuptools["packages"]:
        folder = REPO / folders.get(package, package.replace(".", "/"))
        for path in folder.glob("*.py"):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            modules[name] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """{module: the package modules it imports anywhere in its file}."""
    graph = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph.get(module, ()):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def room_of(module: str) -> str | None:
    """'settings', 'edge', ... for a module of engram_ray.serve's rooms; None otherwise."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and ".".join(parts[:2]) == SERVE else None


def may_import(room: str, target: str) -> bool:
    allowed = (room, *ROOM_MAY_IMPORT[room])
    inside = target[len(SERVE) + 1:]
    return any(inside == a or inside.startswith(a + ".") for a in allowed)


def test_no_import_circle_in_the_package():
    modules = package_modules()
    assert "engram_ray.serve.member.server" in modules and len(modules) > 100
    assert circles(import_graph(modules)) == []


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_the_vllm_side_never_imports_the_serve_side():
    graph = import_graph(package_modules())
    wrong = {m: sorted(t for t in targets if t.startswith(("engram_ray.serve", "engram_ray.local")))
             for m, targets in graph.items() if m.startswith("engram_ray.vllm")}
    assert {m: t for m, t in wrong.items() if t} == {}


def test_each_room_of_the_serve_side_imports_only_what_lies_below_it():
    graph = import_graph(package_modules())
    rooms = {m: room_of(m) for m in graph if room_of(m) in ROOM_MAY_IMPORT}
    assert set(rooms.values()) == set(ROOM_MAY_IMPORT)  # every room has modules
    wrong = {m: sorted(t for t in graph[m] if t.startswith(SERVE + ".")
                       and not may_import(room, t))
             for m, room in rooms.items()}
    assert {m: t for m, t in wrong.items() if t} == {}
    parts = [m for m, room in rooms.items() if room == "member"
             and m != "engram_ray.serve.member.server"]
    assert not [m for m in parts if "engram_ray.serve.member.server" in graph[m]]


def test_the_room_rule_can_fail():
    assert not may_import("edge", "engram_ray.serve.member.server")
    assert not may_import("member", "engram_ray.serve.edge.ingress")
    assert may_import("member", "engram_ray.serve.edge.fingerprint")
    assert not may_import("settings", "engram_ray.serve.app")


def test_every_module_over_300_lines_says_why_near_its_top():
    """STYLE.md rule 2: a file past about 300 lines is asking to be split; one that stays
    longer says why in an `# Over 300 lines:` comment within its first 60 lines."""
    long = {name: path for name, path in package_modules().items()
            if len(path.read_text().splitlines()) > 300}
    assert long  # the check sees the long files (8 on 2026-12-06)
    silent = [name for name, path in long.items()
              if "# Over 300 lines:" not in "\n".join(path.read_text().splitlines()[:60])]
    assert silent == []

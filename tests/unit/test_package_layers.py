"""The layers of the package: the two fleets touch only through the buffer and the weight push (nothing the
generator imports, directly or through other modules of the package, at the top or inside a function, is under
``async_rlhf.learner``), and no package reaches itself through imports (issue 46: driver -> learner -> prebuild
-> driver was one such circle)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "async_rlhf"


def module_file(name: str) -> Path | None:
    """The source file of an ``async_rlhf`` module name (a package's ``__init__.py``), None if not ours."""
    if name != "async_rlhf" and not name.startswith("async_rlhf."):
        return None
    rel = Path(*name.split(".")[1:])
    for path in (PACKAGE / rel / "__init__.py", (PACKAGE / rel).with_suffix(".py")):
        if path.is_file():
            return path
    return None


def imported_modules(path: Path) -> set[str]:
    """Every ``async_rlhf`` module a file imports anywhere in it (``from a.b import c`` counts ``a.b`` and, when
    ``a.b.c`` is a module, that too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names
                         if module_file(f"{node.module}.{alias.name}") is not None)
    return {name for name in found if module_file(name) is not None}


def reachable(start: list[str]) -> dict[str, str]:
    """Every module reachable from ``start`` through imports, each with the module that first imported it."""
    seen: dict[str, str] = {name: "" for name in start}
    todo = list(start)
    while todo:
        name = todo.pop()
        path = module_file(name)
        assert path is not None, name
        for dep in sorted(imported_modules(path)):
            if dep not in seen:
                seen[dep] = name
                todo.append(dep)
    return seen


def chain(seen: dict[str, str], name: str) -> str:
    links = [name]
    while seen[links[-1]]:
        links.append(seen[links[-1]])
    return " <- ".join(links)


def test_generator_imports_nothing_of_the_learner() -> None:
    generator = sorted(f"async_rlhf.generator.{p.stem}" for p in (PACKAGE / "generator").glob("*.py")
                       if p.stem != "__init__")
    assert "async_rlhf.generator.actor" in generator
    seen = reachable(generator)
    assert "async_rlhf.evaluation" in seen, "the walk must follow imports made inside functions"
    offending = [chain(seen, name) for name in seen if name.startswith("async_rlhf.learner")]
    assert not offending, "the generator imports the learner's package: " + "; ".join(offending)


def test_the_walk_finds_an_import_inside_a_function(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from async_rlhf.learner.device import Placer\n    return Placer\n")
    assert "async_rlhf.learner.device" in imported_modules(source)


def unit_of(module: str) -> str:
    """The package-level unit of a module: its subpackage (``async_rlhf.driver.cluster`` -> ``driver``) or, for a
    module at the top, the module (``async_rlhf.prebuild`` -> ``prebuild``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(package: Path = PACKAGE) -> dict[str, dict[str, str]]:
    """unit -> {unit it imports: one module-level import that makes the edge, "a.b -> c.d"}, over every file of the
    package, imports inside functions included (a lazy import is still a dependency)."""
    edges: dict[str, dict[str, str]] = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        module = ".".join(("async_rlhf", *(parts[:-1] if parts[-1] == "__init__" else parts)))
        here = unit_of(module)
        for dep in sorted(imported_modules(path)):
            there = unit_of(dep)
            if there not in (here, "async_rlhf"):
                edges.setdefault(here, {}).setdefault(there, f"{module} -> {dep}")
    return edges


def find_cycle(edges: dict[str, dict[str, str]]) -> list[str]:
    """One cycle of units (first unit repeated at the end), or [] when the graph has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(unit: str) -> list[str]:
        state[unit] = 1
        path.append(unit)
        for nxt in sorted(edges.get(unit, {})):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[unit] = 2
        return []

    for unit in sorted(edges):
        if unit not in state:
            found = visit(unit)
            if found:
                return found
    return []


def describe_cycle(cycle: list[str], edges: dict[str, dict[str, str]]) -> str:
    return " -> ".join(cycle) + " (" + "; ".join(edges[a][b] for a, b in zip(cycle, cycle[1:])) + ")"


def test_the_packages_import_each_other_without_a_circle() -> None:
    """Start-up reads top to bottom only if the packages do (issue 46): no package (or top-level module) of
    ``async_rlhf`` reaches itself through imports, at the top or inside functions. A new circle fails here, named
    with the import that makes each of its edges; break it by moving the function to the lower side."""
    edges = package_graph()
    assert {"driver", "learner", "prebuild", "buffer", "generator"} <= set(edges), "the walk found too few packages"
    assert "policy_source" in edges["prebuild"], "prebuild resolves the tiny policy through policy_source"
    cycle = find_cycle(edges)
    assert not cycle, "the packages import each other in a circle: " + describe_cycle(cycle, edges)


def test_a_circle_between_packages_is_found_and_named(tmp_path: Path, monkeypatch) -> None:
    """A made-up package whose units a -> b -> c -> a circle (b's edge made inside a function)."""
    root = tmp_path / "async_rlhf"
    for pkg in ("a", "b"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "a" / "x.py").write_text("from async_rlhf.b.y import f\n")
    (root / "b" / "y.py").write_text("def f():\n    from async_rlhf.c import g\n")
    (root / "c.py").write_text("from async_rlhf.a.x import h\n")
    monkeypatch.setitem(globals(), "PACKAGE", root)  # module_file resolves names under the package walked
    edges = package_graph(root)
    cycle = find_cycle(edges)
    assert cycle == ["a", "b", "c", "a"]
    assert describe_cycle(cycle, edges) == ("a -> b -> c -> a (async_rlhf.a.x -> async_rlhf.b.y; async_rlhf.b.y -> "
                                            "async_rlhf.c; async_rlhf.c -> async_rlhf.a.x)")
    assert find_cycle({"a": {"b": ""}, "b": {"c": ""}}) == []

"""The two fleets touch only through the buffer and the weight push: nothing the generator imports, directly or
through other modules of the package, at the top or inside a function, is under ``async_rlhf.learner``."""

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

"""The rooms of the package and which way imports may run (docs/architecture.md): a module imports only
from its own room or a lower one, lazy imports inside functions included, so no arrow runs back up."""

from __future__ import annotations

import ast
from pathlib import Path

import qklab

SRC = Path(qklab.__file__).parent

# lowest first; a room may import from its own rank and below
RANKS = {
    "atomic": 0, "version": 0, "errors": 0, "fields": 0,
    "methods": 1, "data": 1,
    "config": 2,
    "model": 3,
    "parallel": 4,
    "rundir": 5,
    "diagnostics": 6,
    "train": 7,
    "study": 8,
    "report": 9,
    "hf": 10,
    "integrations": 11,
    "cli": 12, "__main__": 12,
}


def _room(module: str) -> str | None:
    """'qklab.train.trainer' -> 'train'; the package itself (its lazy ``qklab.attach``) is the façade."""
    parts = module.split(".")
    return parts[1] if parts[0] == "qklab" and len(parts) > 1 else None


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every qklab import in the file, at any depth."""
    out = []
    pkg = ".".join(("qklab", *path.relative_to(SRC).with_suffix("").parts))
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("qklab.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = pkg.split(".")[: -node.level] if path.name != "__init__.py" else pkg.split(".")[: 1 - node.level]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            if mod == "qklab":  # from qklab import parallel (a room), or __version__ (the package's own)
                out += [(node.lineno, f"qklab.{a.name}") for a in node.names if a.name in RANKS]
            elif mod.startswith("qklab."):
                out.append((node.lineno, mod))
    return out


def test_every_room_is_ranked():
    rooms = {p.stem if p.is_file() else p.name for p in SRC.iterdir()
             if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").is_file())}
    assert rooms == set(RANKS), f"rank the new rooms in RANKS: {sorted(rooms ^ set(RANKS))}"


def test_no_import_runs_from_a_lower_room_to_a_higher_one():
    wrong = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if rel == Path("__init__.py"):
            continue
        here = rel.parts[0].removesuffix(".py")
        for line, mod in _imports(path):
            there = _room(mod)
            if there is not None and there != here and RANKS[there] > RANKS[here]:
                wrong.append(f"{rel}:{line} ({here}) imports {mod} ({there})")
    assert not wrong, "imports that run up:\n" + "\n".join(wrong)


def test_train_and_diagnostics_do_not_import_each_other():
    def uses(room: str, other: str) -> list[str]:
        return [f"{p.relative_to(SRC)}:{ln}" for p in (SRC / room).rglob("*.py")
                for ln, m in _imports(p) if _room(m) == other]

    assert not uses("diagnostics", "train")
    assert uses("train", "diagnostics")  # the trainer measures; the readers meet it in rundir/


def _module(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(("qklab", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def test_no_import_cycle_between_modules():
    """No module imports, at any depth (lazy imports inside functions too), one that leads back to it (the
    package root, the façade, aside)."""
    modules = {_module(p): p for p in SRC.rglob("*.py")}

    def targets(m: str, path: Path) -> set[str]:  # "from qklab.report import controls" names the submodule
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                out |= subs or {node.module}
        # the package itself is the façade: ``qklab.attach`` and friends import lazily from the rooms, and a room
        # takes only ``__version__`` from it, so an arrow into it closes no loop a reader must follow
        return {t for t in out if t in modules and t not in (m, "qklab")}

    graph = {m: targets(m, p) for m, p in modules.items()}
    cycles, seen = [], set()

    def walk(m: str, stack: list[str]) -> None:  # depth first; a module met again on the stack closes a cycle
        for n in sorted(graph[m]):
            if n in stack:
                cycles.append(" -> ".join(stack[stack.index(n):] + [n]))
            elif n not in seen:
                seen.add(n)
                walk(n, [*stack, n])

    for m in sorted(graph):
        if m not in seen:
            seen.add(m)
            walk(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


METHOD_NAMES = ("qkclip", "quack", "qknorm", "qkmap", "softcap", "quest", "ssmax", "qkguard", "compositional",
                "qk_lr_multiplier", "upper_qk_slowdown")


def _outside_methods():
    """(path relative to the package, AST node) of every node of every module outside ``methods/``."""
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if rel.parts[0] != "methods":
            yield from ((rel, node) for node in ast.walk(ast.parse(path.read_text())))


def _constants(nodes: list) -> list:
    """The constants among ``nodes``, a tuple's elements included."""
    return [c.value for n in nodes for c in (n.elts if isinstance(n, ast.Tuple) else [n])
            if isinstance(c, ast.Constant)]


def test_no_method_name_is_tested_outside_methods():
    """Code outside ``methods/`` asks a method or controller for a flag, never compares its name: a comparison
    with a method's name (``== "qkclip"``, ``!= "quack"``, ``in ("qknorm", ...)``) there is a leak."""
    leaks = [f"{rel}:{node.lineno}: {ast.unparse(node)}" for rel, node in _outside_methods()
             if isinstance(node, ast.Compare) and set(_constants([node.left, *node.comparators])) & set(METHOD_NAMES)]
    assert not leaks, "method names tested outside methods/:\n" + "\n".join(leaks)


def _names_a_method(text) -> bool:
    """'quack_', 'qkclip', '.quack_wq': a string spelling a method's name or a prefix of its metrics."""
    t = text.strip("._") if isinstance(text, str) else ""
    return bool(t) and (t in METHOD_NAMES or t.split("_")[0] in METHOD_NAMES)


def test_no_method_prefix_is_matched_outside_methods():
    """Code outside ``methods/`` finds a method's metrics through what the method declares
    (``QKController.head_series_prefix``), never by a prefix it spells: ``k.startswith("quack_")`` there is a
    leak."""
    leaks = [f"{rel}:{node.lineno}: {ast.unparse(node)}" for rel, node in _outside_methods()
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr in ("startswith", "endswith") and any(map(_names_a_method, _constants(node.args)))]
    assert not leaks, "method prefixes matched outside methods/:\n" + "\n".join(leaks)

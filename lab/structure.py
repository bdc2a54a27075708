"""The package's structure read from its source (ast; nothing is imported or run): the import graph of its
modules, its cycles, and its floors — the order in which its parts may import one another, bottom first.

``tests/test_imports.py`` asserts on it (no cycles, no climbs, the model seam, the wall between product and
lab); this module also draws it:

    python -m lab.structure --out docs/img/floors.png              # this checkout's floors and imports
    python -m lab.structure --root DIR --out before.png            # another checkout (e.g. a git worktree)

Every top-level module or subpackage of ``megareshard`` is a box on its floor; an arrow goes from a module to
each one it imports (annotation-only imports included), grey when it goes down or across, red when it climbs;
parts no floor holds sit on their own row at the bottom, and the modules of a cycle are drawn in red.
"""
from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["FLOORS", "import_statements", "import_graph", "cycles", "reach", "path_to", "unit_graph", "climbs", "draw", "main"]


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_block(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def import_statements(body: list[ast.stmt], annotations: bool = False):
    """The import statements that run, at any depth of statements (functions, classes, if/try/with/for
    bodies), except under ``if TYPE_CHECKING:`` (those too with ``annotations``). Only statements are visited:
    imports are statements."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif _type_checking_block(node) and not annotations:
            yield from import_statements(node.orelse)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                inner = getattr(node, field, None)
                if isinstance(inner, list):
                    yield from import_statements(inner, annotations)


def import_graph(root: Path, package: str, external: dict[str, set[str]] | None = None,
                 annotations: bool = False) -> dict[str, set[str]]:
    """``{module: modules of the package its imports run}`` for every ``.py`` under ``root/package``;
    ``external``, when given, receives ``{module: top-level names of the other packages it imports}``."""
    files = {_module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        here = mod if path.name == "__init__.py" else mod.rpartition(".")[0]  # what `from .` means
        deps: set[str] = set()
        for node in import_statements(tree.body, annotations):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = here
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = (base + ("." + node.module if node.module else "")) if node.level else node.module
                targets = [target] + [f"{target}.{a.name}" for a in node.names]  # `from pkg import submodule`
            if external is not None and targets[0].split(".")[0] != package:
                external.setdefault(mod, set()).add(targets[0].split(".")[0])
            for t in targets:
                parts = t.split(".")
                for i in range(1, len(parts) + 1):
                    name = ".".join(parts[:i])
                    inside = mod == name or mod.startswith(name + ".")  # its own package: already running
                    if name in files and name != mod and not (i < len(parts) and inside):
                        deps.add(name)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def reach(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module ``start``'s imports run, each with the module that imports it (to show the path)."""
    seen: dict[str, str] = {}
    todo = [start]
    while todo:
        v = todo.pop()
        for w in graph[v]:
            if w not in seen and w != start:
                seen[w] = v
                todo.append(w)
    return seen


def path_to(seen: dict[str, str], start: str, target: str) -> str:
    chain = [target]
    while chain[-1] != start:
        chain.append(seen[chain[-1]])
    return " -> ".join(reversed(chain))


#: the floors of the package, bottom first: a module imports only its own floor and those below (annotation-only
#: imports included). Each entry is a top-level module or subpackage of ``megareshard``; a new one must be placed.
FLOORS = [
    ("configuration", {"config", "config_fields", "registry", "compile_config", "flag_checks", "megatron_flags"}),
    ("building blocks", {"parallel", "data", "tensor_parallel", "compile_boundary", "optim", "launch", "tracking",
                         "resharding", "plugins", "kernel_record"}),
    ("models and the pipeline", {"model_spec", "models", "pipeline", "memory"}),
    ("plans and checkpoints", {"checkpoint", "planner", "run_plan", "generation", "generation_kv", "transfer"}),
    ("assembly", {"config_checks", "input_checks", "inputs", "components", "run_setup", "train_report", "fast_path",
                  "generators", "train_checkpoints", "train_grads"}),
    ("front doors", {"arguments", "training", "cli", "entry"}),
]


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``{unit: units it imports}`` where a unit is a top-level module or subpackage of the package."""
    def unit(mod: str) -> str | None:
        parts = mod.split(".")
        return parts[1] if len(parts) > 1 else None

    out: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        u = unit(mod)
        if u is not None:
            out.setdefault(u, set()).update(v for v in map(unit, deps) if v is not None and v != u)
    return out


def climbs(units: dict[str, set[str]], floors: list[tuple[str, set[str]]]) -> list[str]:
    """'a (floor) -> b (higher floor)' for every import that goes up, and every unit no floor holds."""
    level = {u: i for i, (_, members) in enumerate(floors) for u in members}
    out = [f"{u} is on no floor" for u in sorted(units) if u not in level]
    for u in sorted(set(units) & set(level)):
        for v in sorted(units[u]):
            if v in level and level[v] > level[u]:
                out.append(f"{u} ({floors[level[u]][0]}) -> {v} ({floors[level[v]][0]})")
    return out


def draw(units: dict[str, set[str]], floors: list[tuple[str, set[str]]], out: str, title: str) -> None:
    """The floors as rows of boxes (bottom floor at the bottom), the imports as arrows (module docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    level = {u: i for i, (_, members) in enumerate(floors) for u in members if u in units}
    rows = [(name, sorted(u for u in members if u in units)) for name, members in floors]
    unplaced = sorted(u for u in units if u not in level)
    if unplaced:
        rows = [("on no floor", unplaced)] + rows
    in_cycle = {u for comp in cycles(units) for u in comp}
    width = max(len(r) for _, r in rows)
    pos = {}
    for y, (_, members) in enumerate(rows):
        for x, u in enumerate(members):
            pos[u] = ((x + 0.5) * width / max(len(members), 1), y)
    fig, ax = plt.subplots(figsize=(max(10, 1.45 * width), 1.25 * len(rows) + 1.2))
    for u in sorted(units):
        for v in sorted(units[u]):
            climb = (u in level and v in level and level[v] > level[u]) or (u not in level or v not in level)
            (x0, y0), (x1, y1) = pos[u], pos[v]
            ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                        arrowprops=dict(arrowstyle="-|>", lw=1.4 if climb else 0.5, alpha=0.9 if climb else 0.25,
                                        color="#c0392b" if climb else "#7f8c8d", shrinkA=11, shrinkB=11,
                                        connectionstyle="arc3,rad=0.08"))
    for u, (x, y) in pos.items():
        ax.text(x, y, u, ha="center", va="center", fontsize=8,
                bbox=dict(boxstyle="round,pad=0.3", fc="#fdecea" if u in in_cycle else "#eef3f8",
                          ec="#c0392b" if u in in_cycle else "#34495e", lw=0.8))
    for y, (name, _) in enumerate(rows):
        ax.text(-0.3, y, name, ha="right", va="center", fontsize=9, style="italic", color="#34495e")
    n_climb = sum(1 for u in units for v in units[u]
                  if (u in level and v in level and level[v] > level[u]) or u not in level or v not in level)
    ax.set_title(f"{title}: {len(units)} parts, {sum(len(d) for d in units.values())} import arrows, "
                 f"{n_climb} climbing (red), {len(cycles(units))} cycle(s)", fontsize=10, wrap=True)
    ax.set_xlim(-3.2, width + 0.3)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.structure", description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(ROOT), help="the checkout to read (default: this one)")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--title", default="megareshard's floors")
    a = ap.parse_args(argv)
    units = unit_graph(import_graph(Path(a.root), "megareshard", annotations=True))
    draw(units, FLOORS, a.out, a.title)
    for line in climbs(units, FLOORS):
        print(f"climbs: {line}")
    for comp in cycles(units):
        print(f"cycle: {' <-> '.join(comp)}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The package's import structure, read from the source (ast; nothing is imported or run).

* no import cycles between the modules of ``megareshard/``;
* the model seam: the pipeline engine (``megareshard/pipeline/*``) and the trainer
  (``megareshard/training.py``) import no model — directly or through anything they import, the
  models' configuration (``models.config``) and the recomputation hook (``models.recompute``)
  aside; the models (``megareshard/models/*``) reach no pipeline module, nor the trainer or the
  command-line module (``arguments``); the seam itself (``megareshard/model_spec/*``) reaches none of them;
* the schedule IR (``import megareshard.pipeline``) imports no torch;
* the wall: the product (``megareshard/``, the entry points, ``tools/``) never imports the lab (``lab/``:
  what measures, emulates and breaks it), which imports the product.
* the product finds itself by being installed: no file of ``megareshard/``, ``tools/`` or the entry points
  touches ``sys.path``; every console script of ``pyproject.toml`` names a ``main`` of the package, and every
  user tool ``tools/NAME.py`` is one of them (``megareshard.cli.NAME``) run as Megatron-LM's tools run.

An import counts when it runs: module level and inside functions, not under ``if TYPE_CHECKING:``.
Importing ``a.b.c`` also runs ``a/b/__init__.py`` (unless the importer lives inside ``a.b``).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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


def _imports(body: list[ast.stmt], annotations: bool = False):
    """The import statements that run, at any depth of statements (functions, classes, if/try/with/for
    bodies), except under ``if TYPE_CHECKING:`` (those too with ``annotations``). Only statements are visited:
    imports are statements."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif _type_checking_block(node) and not annotations:
            yield from _imports(node.orelse)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                inner = getattr(node, field, None)
                if isinstance(inner, list):
                    yield from _imports(inner, annotations)


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
        for node in _imports(tree.body, annotations):
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


def _in(mod: str, *prefixes: str) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def violations(graph: dict[str, set[str]], sources: list[str], forbidden: tuple[str, ...],
               allowed: tuple[str, ...] = ()) -> list[str]:
    """For each source module, every forbidden module its imports reach (transitively), with the path."""
    out = []
    for src in sources:
        seen = reach(graph, src)
        for mod in sorted(seen):
            if _in(mod, *forbidden) and mod not in allowed:
                out.append(path_to(seen, src, mod))
    return out


PIPELINE_AND_TRAINER_MAY_REACH = ("megareshard.models", "megareshard.models.config", "megareshard.models.recompute")


_EXTERNAL: dict[str, set[str]] = {}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    _EXTERNAL.clear()
    return import_graph(ROOT, "megareshard", _EXTERNAL)


def test_no_import_cycles(graph):
    assert "megareshard.training" in graph and "megareshard.pipeline.runtime" in graph  # the tree was read
    assert cycles(graph) == []
    assert cycles(import_graph(ROOT, "megareshard", annotations=True)) == []   # annotation-only imports too


#: the floors of the package, bottom first: a module imports only its own floor and those below (annotation-only
#: imports included). Each entry is a top-level module or subpackage of ``megareshard``; a new one must be placed.
FLOORS = [
    ("configuration", {"config", "config_fields", "registry", "compile_config", "flag_checks", "megatron_flags"}),
    ("building blocks", {"parallel", "data", "tensor_parallel", "compile_boundary", "optim", "launch", "tracking",
                         "fast_path", "resharding", "plugins"}),
    ("models and the pipeline", {"model_spec", "models", "pipeline", "memory"}),
    ("plans and checkpoints", {"checkpoint", "planner", "run_plan", "generation", "transfer"}),
    ("assembly", {"config_checks", "inputs", "components", "run_setup", "train_report"}),
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


def test_no_floor_imports_a_higher_one():
    """The floors above, with annotation-only imports counted: configuration at the bottom, imported by all and
    importing nothing else of ours; the front doors (the command line, the trainer, the tools) at the top."""
    units = unit_graph(import_graph(ROOT, "megareshard", annotations=True))
    assert climbs(units, FLOORS) == []
    assert units["config"] == set()                     # the configuration types import nothing else of ours


def test_pipeline_and_trainer_import_no_model(graph):
    sources = [m for m in graph if _in(m, "megareshard.pipeline")] + ["megareshard.training"]
    direct = [f"{s} -> {d}" for s in sources for d in sorted(graph[s]) if _in(d, "megareshard.models")]
    assert direct == []
    assert violations(graph, sources, ("megareshard.models",), PIPELINE_AND_TRAINER_MAY_REACH) == []


def test_models_import_no_pipeline_trainer_or_arguments(graph):
    sources = [m for m in graph if _in(m, "megareshard.models")]
    assert "megareshard.models.gpt_spec" in sources and "megareshard.models.utransformer_spec" in sources
    forbidden = ("megareshard.pipeline", "megareshard.training", "megareshard.arguments")
    assert violations(graph, sources, forbidden) == []


def test_the_seam_imports_no_model_pipeline_trainer_or_arguments(graph):
    sources = [m for m in graph if _in(m, "megareshard.model_spec")]
    forbidden = ("megareshard.models", "megareshard.pipeline", "megareshard.training", "megareshard.arguments")
    assert violations(graph, sources, forbidden) == []


def test_the_schedule_ir_imports_no_torch(graph):
    """``import megareshard.pipeline`` (schedules as data: generators, lowering, validator, simulator, and the
    stage graph they share with the model specs) stays free of torch: tools plan and draw without it."""
    face = "megareshard.pipeline"
    modules = [face, *reach(graph, face)]
    assert "megareshard.model_spec.graph" in modules
    assert [m for m in sorted(modules) if "torch" in _EXTERNAL.get(m, ())] == []


def test_the_product_never_imports_the_lab(graph):
    """The wall between product and lab: no module of the package, no entry point and no user tool imports
    ``lab`` (at module level or inside a function); the wheel ships ``megareshard`` only."""
    assert [m for m in sorted(_EXTERNAL) if "lab" in _EXTERNAL[m]] == []
    scripts = sorted(ROOT.glob("*.py")) + sorted((ROOT / "tools").glob("*.py"))
    assert scripts
    offenders = []
    for path in scripts:
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            offenders += [f"{path.relative_to(ROOT)} imports {n}" for n in names if n.split(".")[0] == "lab"]
    assert offenders == []
    lab_imports: dict[str, set[str]] = {}
    import_graph(ROOT, "lab", lab_imports)  # and the lab does import the product
    assert any("megareshard" in names for names in lab_imports.values())


def test_tools_import_the_package_not_one_another():
    """A user tool is a script on the package: what two tools share lives in ``megareshard`` (a tool that imported
    another would need that tool's directory on ``sys.path``: the hidden second package the wall removed)."""
    tools = sorted((ROOT / "tools").glob("*.py"))
    names = {p.stem for p in tools}
    assert {"preprocess_data", "train_tokenizer"} <= names
    offenders = []
    for path in tools:
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            offenders += [f"{path.name} imports {m}" for m in mods
                          if m.split(".")[0] in names or m.split(".")[0] == "tools"]
    assert offenders == []


def test_the_cli_modules_import_no_other_tool(graph):
    """The tools moved into the package (``megareshard/cli``) keep the rule: what two tools share lives in the
    package outside ``megareshard.cli``."""
    tools = [m for m in graph if _in(m, "megareshard.cli") and m != "megareshard.cli"]
    assert "megareshard.cli.checkpoint_util" in tools and "megareshard.cli.generate" in tools
    assert [f"{m} imports {d}" for m in sorted(tools) for d in sorted(graph[m]) if _in(d, "megareshard.cli")] == []


def _touches_sys_path(tree: ast.AST) -> list[int]:
    """Lines that name ``sys.path`` (read, insert, append, assign), import ``path`` from ``sys`` or call
    ``site.addsitedir``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and (
                (node.value.id, node.attr) in (("sys", "path"), ("site", "addsitedir"))):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module in ("sys", "site") and any(
                a.name in ("path", "addsitedir") for a in node.names):
            lines.append(node.lineno)
    return sorted(lines)


def test_no_product_file_touches_sys_path():
    """The package is installed (``pip install -e .``, the README's setup): no module of ``megareshard/``, no
    user tool and no entry point puts a directory on ``sys.path`` to find it."""
    files = (sorted((ROOT / "megareshard").rglob("*.py")) + sorted(ROOT.glob("*.py"))
             + sorted((ROOT / "tools").glob("*.py")))
    assert ROOT / "pretrain_gpt.py" in files and ROOT / "tools" / "checkpoint_util.py" in files
    offenders = [f"{p.relative_to(ROOT)}:{line}" for p in files
                 for line in _touches_sys_path(ast.parse(p.read_text(encoding="utf-8"), filename=str(p)))]
    assert offenders == []
    assert _touches_sys_path(ast.parse("import sys\nsys.path.insert(0, 'x')\nfrom sys import path\n")) == [2, 3]


def _console_scripts() -> dict[str, str]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


def _top_level_main(module: str, attr: str) -> bool:
    """``module`` is a file of this tree that defines ``attr`` at module level as a function taking ``argv``
    (default None), the way ``main(argv=None) -> int`` is called by a console script and by the tests."""
    path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
    if not path.is_file():
        return False
    for node in ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body:
        if isinstance(node, ast.FunctionDef) and node.name == attr:
            args = node.args
            return bool(args.args) and args.args[0].arg == "argv" and len(args.defaults) >= len(args.args) and \
                isinstance(args.defaults[0], ast.Constant) and args.defaults[0].value is None
    return False


def test_console_scripts_name_a_main_and_every_tool_has_one():
    """``[project.scripts]``: each entry is ``module:main`` with ``main(argv=None)`` defined in that module of
    the package; each ``tools/NAME.py`` is ``megareshard-NAME`` (dashes) on ``megareshard.cli.NAME:main``, and
    the script imports that module (it is a wrapper: the code lives in the package)."""
    scripts = _console_scripts()
    assert scripts["megareshard-run"] == "megareshard.launch.launcher:main"
    bad = [f"{name} = {target}" for name, target in sorted(scripts.items())
           if target.count(":") != 1 or target.split(":")[1] != "main" or not _top_level_main(*target.split(":"))]
    assert bad == []
    tools = sorted((ROOT / "tools").glob("*.py"))
    assert len(tools) == 8
    for path in tools:
        module = f"megareshard.cli.{path.stem}"
        assert scripts.get("megareshard-" + path.stem.replace("_", "-")) == f"{module}:main", path.name
        imported = set()
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body):
            imported |= ({a.name for a in node.names} if isinstance(node, ast.Import)
                         else {node.module or ""} | {f"{node.module}.{a.name}" for a in node.names})
        assert module in imported, path.name


def test_the_floor_check_catches_a_climb_and_an_unplaced_unit():
    units = {"config": {"training"}, "training": {"config"}, "newcomer": set()}
    assert climbs(units, [("bottom", {"config"}), ("top", {"training"})]) == [
        "newcomer is on no floor", "config (bottom) -> training (top)"]


def test_the_checks_catch_a_cycle_and_a_forbidden_import(tmp_path):
    """The same checks on a made-up package with one cycle and one forbidden path: both are found."""
    pkg = tmp_path / "toy"
    (pkg / "models").mkdir(parents=True)
    (pkg / "pipeline").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "__init__.py").write_text("from .gpt import Model\n")
    (pkg / "models" / "gpt.py").write_text("from ..model_spec import Spec\nclass Model: ...\n")
    (pkg / "models" / "config.py").write_text("X = 1\n")
    (pkg / "spec.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .models import gpt\n"
                                 "class Spec: ...\n")
    (pkg / "pipeline" / "__init__.py").write_text("")
    (pkg / "pipeline" / "runtime.py").write_text("def f():\n    from ..helpers import g\n")
    (pkg / "helpers.py").write_text("from .models.config import X\nfrom . import loop_b\n")
    (pkg / "loop_b.py").write_text("import toy.helpers\n")
    external: dict[str, set[str]] = {}
    g = import_graph(tmp_path, "toy", external)
    assert cycles(g) == [["toy.helpers", "toy.loop_b"]]
    assert external == {"toy.spec": {"typing"}}
    assert "toy.models.gpt" not in g["toy.spec"]  # TYPE_CHECKING imports do not run
    # helpers -> models.config runs models/__init__, which imports the model
    assert violations(g, ["toy.pipeline.runtime"], ("toy.models",), ("toy.models.config",)) == [
        "toy.pipeline.runtime -> toy.helpers -> toy.models",
        "toy.pipeline.runtime -> toy.helpers -> toy.models -> toy.models.gpt"]

"""The package's import structure, read from the source (ast; nothing is imported or run; the reading and the
floors are ``lab/structure.py``, which also draws them).

* no import cycles between the modules of ``megareshard/``, annotation-only imports included;
* the floors (``lab.structure.FLOORS``): configuration at the bottom, importing nothing else of ours, then the
  building blocks, the models and the pipeline, the plans and checkpoints, the assembly, the front doors; no
  part imports one on a higher floor (annotation-only imports included);
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

An import counts when it runs: module level and inside functions, not under ``if TYPE_CHECKING:`` (except for
the cycles and floors, where annotation-only imports count too).
Importing ``a.b.c`` also runs ``a/b/__init__.py`` (unless the importer lives inside ``a.b``).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lab.structure import FLOORS, climbs, cycles, import_graph, import_statements, path_to, reach, unit_graph

ROOT = Path(__file__).resolve().parents[1]


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
        for node in import_statements(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body):
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
        for node in import_statements(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body):
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
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11 on")
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
        for node in import_statements(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body):
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


def test_every_file_of_the_package_is_one_a_reader_can_hold():
    """No file of ``megareshard/`` over 600 lines (split along its sections instead)."""
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "megareshard").rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 600}
    assert long == {}

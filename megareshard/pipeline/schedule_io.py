"""``--pipeline-schedule-file``: read a schedule written as data, check it against the run, validate it.

Two forms, both `Schedule`'s own writers and parsers (`schedule.py`):

* the IR's text form (`Schedule.dumps` / `Schedule.loads`)::

      # megareshard pipeline schedule: 1f1b
      stages 2 microbatches 4
      stage 0: F0 F1 B0 F2 B1 F3 B2 B3
      stage 1: F0 B0 F1 B1 F2 B2 F3 B3

* CSV when the file name ends in ``.csv`` (`Schedule.to_csv` / `Schedule.from_csv`): one row per
  mesh, the mesh number then one action per cell (``0,F0,F1,B0,...``); the ``#stages`` header row
  may be left out (the rows are the stages, the largest microbatch + 1 the microbatch count).

A file may hold compute actions only (F, B, or I + W; the runtime lowers it, adding the
communication) or a lowered program (with SEND/RECV/WAIT actions, run as written), and ``R``
actions where the gradient reductions start (with ``--overlap-grad-reduce``; without them
the pass in `grad_reduce.py` places them).

Every problem is one line naming the offending action by mesh, position in the mesh's program
(from 0; in CSV the cell after the mesh number is action 0) and text, and why:
``--pipeline-schedule-file s.txt: mesh 1 action 4 'B2@1': backward before its forward (F2@1 is
not earlier)``.
"""
from __future__ import annotations

from pathlib import Path

from ..config_fields import ConfigError
from .grad_reduce import has_grad_reduce
from .schedule import PipelineGraph, Schedule, ScheduleError
from .validate import validate

__all__ = ["load_schedule_file", "describe_error"]


def describe_error(e: ScheduleError) -> str:
    """One line: ``mesh M action I 'TEXT': why`` when the error names an action, else its first line."""
    if e.located:
        return f"mesh {e.mesh} action {e.index} {e.action!r}: {e.why}"
    return str(e).splitlines()[0]


def load_schedule_file(path: str, *, num_meshes: int, num_microbatches: int, graph: PipelineGraph | None = None,
                       overlap_grad_reduce: bool = False) -> Schedule:
    """Read `path` and check it for a run with `num_meshes` pipeline stages (one per mesh) and
    `num_microbatches`; with `graph`, the file's stage graph must be it (skip edges included).
    Raises `ConfigError` (one line, the file named) on any problem; returns the validated schedule."""
    where = f"--pipeline-schedule-file {path}"
    p = Path(path)
    try:
        sched = Schedule.load(p)
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it ({e.strerror or e})") from None
    except ScheduleError as e:
        raise ConfigError(f"{where}: {describe_error(e)}") from None
    if sched.virtual:
        raise ConfigError(f"{where}: its placement {list(sched.placement or ())} puts several stages on a mesh "
                          "(virtual stages); a schedule file runs one stage per mesh (the model chunks are built from "
                          "--pipeline-schedule and the virtual-pipeline flags)")
    if sched.num_meshes != num_meshes:
        raise ConfigError(f"{where}: it has {sched.num_meshes} stage program(s) but --pipeline-model-parallel-size "
                          f"is {num_meshes}")
    if sched.num_microbatches != num_microbatches:
        raise ConfigError(f"{where}: it is written for {sched.num_microbatches} microbatches but this run has "
                          f"{num_microbatches} (global batch / (micro batch × dp))")
    if graph is not None and sched.graph != graph:
        def edges(g: PipelineGraph) -> str:
            return ", ".join(map(str, g.skip_edges)) or "none"

        raise ConfigError(f"{where}: its skip edges ({edges(sched.graph)}) are not the model's ({edges(graph)}); "
                          "list the model's skip edges as 'edge SRC->DST:NAME' lines")
    if has_grad_reduce(sched) and not overlap_grad_reduce:
        at = next((m, i, a) for m, acts in enumerate(sched.actions) for i, a in enumerate(acts) if a.kind.is_reduce)
        raise ConfigError(f"{where}: mesh {at[0]} action {at[1]} {at[2].text(True)!r}: gradient-reduction actions "
                          "need --overlap-grad-reduce (without it the reduction runs after the program)")
    try:
        validate(sched)
    except ScheduleError as e:
        raise ConfigError(f"{where}: {describe_error(e)}") from None
    return sched

"""Looped BFS (PyTorch's ScheduleLoopedBFS): mesh p holds stages p, p+P, ..., runs every microbatch's
forward through its first stage, then its next stage, ..., then the backwards in reverse."""
from megareshard.pipeline import Action, ActionKind, PipelineGraph, Schedule
from megareshard.pipeline.schedules import ScheduleKind, round_robin


def build(P: int, m: int, V: int, graph: PipelineGraph) -> Schedule:
    programs = []
    for p in range(P):
        mine = [v * P + p for v in range(V)]  # round robin: stage v·P + p on mesh p
        forwards = [Action(ActionKind.F, mb, s) for s in mine for mb in range(m)]
        backwards = [Action(ActionKind.B, mb, s) for s in reversed(mine) for mb in range(m)]
        programs.append(forwards + backwards)
    return Schedule(graph, m, programs, "looped-bfs", round_robin(P, V))


def live_bound(P: int, m: int, V: int, delay_wgrad: bool) -> list[int]:
    return [m * V] * P  # every forward of the mesh runs before its first backward


LOOPED_BFS = ScheduleKind("looped-bfs", build, stages_per_mesh=None, live_bound=live_bound)

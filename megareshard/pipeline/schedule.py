"""Pipeline schedule IR: actions, the stage graph, per-stage action lists, text form.

A schedule is *data* (docs/design.md §4): for every stage, the ordered list of actions its
ranks execute. Generators produce compute-only lists (F, B, I, W); `lowering.lower`
adds the communication actions; `validate` checks them; `simulate` times them; the
runtime executes them. Keeping it data means every one of those steps can be unit
tested on CPU without processes.

Text form of one action (``str(action)`` / `parse_action`)::

    F3  B3  I3  W3            compute on microbatch 3
    F3@5                      the same on stage 5 (a program holding several stages)
    R   R@5                   start the stage's data-parallel gradient reduction (no microbatch;
                              inserted by `grad_reduce.insert_grad_reduce`, --overlap-grad-reduce)
    SF3->1                    SEND_F: send mb 3's activation along edge <me>->1
    RF3<-0   WF3<-0           RECV_F (post a non-blocking receive) / WAIT_F (block on it)
    SB3->0                    SEND_B: send mb 3's gradient back along edge 0-><me>
    RB3<-1   WB3<-1           RECV_B / WAIT_B: the gradient of edge <me>->1
    SF3->3:skip               a named (skip) edge; chain edges have the empty name

The arrow always points the way the data moves; the number after it is the *peer*
stage; the executing stage is the line's stage unless the action ends in ``@stage``,
so the edge is recoverable.

Schedule text (`Schedule.dumps` / `Schedule.loads`)::

    # megareshard pipeline schedule
    stages 4 microbatches 8
    edge 0->3:skip
    stage 0: F0 F1 ...
    stage 1: ...

With virtual stages (a mesh running several stages) the placement is listed and each
line is one mesh's program, every action naming its stage::

    stages 4 microbatches 4
    placement 0,1,0,1
    mesh 0: F0@0 F1@0 F0@2 ...

Chain edges i->i+1 are implicit; only skip edges are listed.
"""

from __future__ import annotations

from types import MappingProxyType

import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Iterable, Iterator, Sequence

__all__ = [
    "ActionKind",
    "Edge",
    "PipelineGraph",
    "Action",
    "Schedule",
    "ScheduleError",
    "parse_action",
    "COMPUTE_KINDS",
    "COMM_KINDS",
]


class ScheduleError(ValueError):
    """A schedule is malformed, inconsistent with its graph, or deadlocks.

    Errors about one action also carry where it is: ``mesh`` (the program), ``index`` (its
    position in that program, from 0), ``action`` (its text, ``@stage`` included) and ``why``
    (the reason alone), so a schedule file's loader can name the offending cell.
    """

    def __init__(self, message: str, *, mesh: int | None = None, index: int | None = None,
                 action: str | None = None, why: str | None = None) -> None:
        super().__init__(message)
        self.mesh, self.index, self.action, self.why = mesh, index, action, why

    @property
    def located(self) -> bool:
        return self.mesh is not None and self.index is not None


class ActionKind(str, Enum):
    """What one action does. Compute kinds first, then communication kinds."""

    F = "F"  # forward of one microbatch
    B = "B"  # full backward (input + weight gradients)
    I = "I"  # input-gradient backward: what the previous stage waits for  # noqa: E741
    W = "W"  # weight-gradient backward (delayed, runs the weight-grad store)
    R = "R"  # start the stage's data-parallel gradient reduction (asynchronous; no microbatch)
    SEND_F = "SEND_F"  # start sending an activation downstream (non-blocking)
    RECV_F = "RECV_F"  # post a receive of an activation from upstream (non-blocking)
    WAIT_F = "WAIT_F"  # block until that activation has arrived
    SEND_B = "SEND_B"  # start sending a gradient upstream (non-blocking)
    RECV_B = "RECV_B"  # post a receive of a gradient from downstream (non-blocking)
    WAIT_B = "WAIT_B"  # block until that gradient has arrived

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        """A cross-stage transfer (SEND/RECV/WAIT on an edge)."""
        return self in COMM_KINDS

    @property
    def is_reduce(self) -> bool:
        """R: the stage's data-parallel gradient reduction (neither compute nor an edge transfer)."""
        return self is ActionKind.R

    @property
    def direction(self) -> str:
        """'F' for activations (src->dst), 'B' for gradients (dst->src); '' otherwise."""
        return self.value[-1] if self.is_comm else ""


COMPUTE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W})
COMM_KINDS = frozenset(k for k in ActionKind if k not in COMPUTE_KINDS and k is not ActionKind.R)

_COMM_PREFIX = MappingProxyType({
    ActionKind.SEND_F: "SF", ActionKind.RECV_F: "RF", ActionKind.WAIT_F: "WF",
    ActionKind.SEND_B: "SB", ActionKind.RECV_B: "RB", ActionKind.WAIT_B: "WB",
})
_PREFIX_COMM = MappingProxyType({v: k for k, v in _COMM_PREFIX.items()})
# Which end of the edge executes each comm kind: True = the edge's src stage.
_ON_SRC = MappingProxyType({
    ActionKind.SEND_F: True, ActionKind.RECV_F: False, ActionKind.WAIT_F: False,
    ActionKind.SEND_B: False, ActionKind.RECV_B: True, ActionKind.WAIT_B: True,
})


@dataclass(frozen=True, order=True)
class Edge:
    """A tensor that crosses stages: produced by `src`'s F, consumed by `dst`'s F.

    Its gradient flows back: produced by `dst`'s B/I, consumed by `src`'s B/I.
    Chain edges (i -> i+1) have the empty name; skip edges carry a name so that
    several tensors between the same pair of stages stay distinguishable.
    """

    src: int
    dst: int
    name: str = ""

    def __post_init__(self) -> None:
        if self.src < 0 or self.dst <= self.src:
            raise ScheduleError(
                f"edge {self.src}->{self.dst}: need 0 <= src < dst (stages are in "
                f"topological order; a pipeline edge never points backwards)")
        if self.name and not re.fullmatch(r"\w+", self.name):
            raise ScheduleError(f"edge {self.src}->{self.dst}: name {self.name!r} must be "
                                f"a word ([A-Za-z0-9_]+)")

    @property
    def is_chain(self) -> bool:
        return self.name == "" and self.dst == self.src + 1

    def __str__(self) -> str:
        return f"{self.src}->{self.dst}" + (f":{self.name}" if self.name else "")


def _as_edge(e: "Edge | Sequence") -> Edge:
    if isinstance(e, Edge):
        return e
    t = tuple(e)
    if len(t) == 2:
        return Edge(int(t[0]), int(t[1]), f"skip{t[0]}_{t[1]}")
    if len(t) == 3:
        return Edge(int(t[0]), int(t[1]), str(t[2]))
    raise ScheduleError(f"skip edge {e!r}: expected (src, dst) or (src, dst, name)")


@dataclass(frozen=True)
class PipelineGraph:
    """The DAG of stages: chain edges i->i+1 plus optional skip edges.

    `skip_edges` accepts `Edge`s or (src, dst[, name]) tuples; an unnamed tuple gets
    the name ``skip{src}_{dst}``. Edges are kept sorted so that every consumer of the
    graph (lowering, runtime) sees them in one deterministic order.
    """

    num_stages: int
    skip_edges: tuple[Edge, ...] = ()

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ScheduleError(f"num_stages={self.num_stages}: need at least 1 stage")
        skips = tuple(sorted(_as_edge(e) for e in self.skip_edges))
        for e in skips:
            if e.dst >= self.num_stages:
                raise ScheduleError(f"skip edge {e}: stage {e.dst} does not exist "
                                    f"(num_stages={self.num_stages})")
            if e.name == "":
                raise ScheduleError(f"skip edge {e}: skip edges need a non-empty name")
        if len(set(skips)) != len(skips):
            raise ScheduleError(f"duplicate skip edges in {[str(e) for e in skips]}")
        object.__setattr__(self, "skip_edges", skips)
        # derived once: lowering, simulation and the runtime ask for these per action
        chain = tuple(Edge(i, i + 1) for i in range(self.num_stages - 1))
        edges = tuple(sorted(chain + skips))
        object.__setattr__(self, "_edges", edges)
        object.__setattr__(self, "_in", {s: tuple(e for e in edges if e.dst == s) for s in range(self.num_stages)})
        object.__setattr__(self, "_out", {s: tuple(e for e in edges if e.src == s) for s in range(self.num_stages)})

    @property
    def edges(self) -> tuple[Edge, ...]:
        return self._edges  # type: ignore[attr-defined]

    def in_edges(self, stage: int) -> tuple[Edge, ...]:
        """Edges whose activation stage `stage`'s F needs."""
        return self._in.get(stage, ())  # type: ignore[attr-defined]

    def out_edges(self, stage: int) -> tuple[Edge, ...]:
        """Edges whose gradient stage `stage`'s B/I needs (none on the last stage)."""
        return self._out.get(stage, ())  # type: ignore[attr-defined]

    def find_edge(self, src: int, dst: int, name: str = "") -> Edge:
        e = Edge(src, dst, name)
        if e not in self.edges:
            raise ScheduleError(f"edge {e} is not in the graph (edges: "
                                f"{', '.join(map(str, self.edges)) or 'none'})")
        return e


@dataclass(frozen=True)
class Action:
    """One step of one program: what a stage does to a microbatch.

    `stage` is the executing stage (a mesh's program may hold several: virtual stages);
    `edge` is set for communication actions only.
    """

    kind: ActionKind
    mb: int
    stage: int
    edge: Edge | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ActionKind(self.kind))
        if self.mb < 0:
            raise ScheduleError(f"action {self.kind.value}{self.mb}: negative microbatch")
        if self.kind.is_comm:
            if self.edge is None:
                raise ScheduleError(f"{self.kind.value} mb {self.mb}: comm action needs an edge")
            end = self.edge.src if _ON_SRC[self.kind] else self.edge.dst
            if end != self.stage:
                raise ScheduleError(
                    f"{self.kind.value} mb {self.mb} on edge {self.edge} runs on stage "
                    f"{end}, not on stage {self.stage}")
        elif self.edge is not None:
            raise ScheduleError(f"action {self.kind.value}{self.mb} has an edge (only transfers have one)")
        if self.kind.is_reduce and self.mb != 0:
            raise ScheduleError(f"R of stage {self.stage} names microbatch {self.mb}: a stage's gradient "
                                "reduction covers every microbatch (write R)")

    @property
    def peer(self) -> int | None:
        """The stage at the other end of a comm action's edge."""
        if self.edge is None:
            return None
        return self.edge.dst if self.stage == self.edge.src else self.edge.src

    @property
    def key(self) -> tuple[Edge | None, str, int]:
        """(edge, direction, mb): what a SEND/RECV/WAIT triple has in common."""
        return (self.edge, self.kind.direction, self.mb)

    def text(self, with_stage: bool = False) -> str:
        """The text form; ``with_stage`` appends ``@stage`` (programs holding several stages)."""
        at = f"@{self.stage}" if with_stage else ""
        if self.kind.is_reduce:
            return f"R{at}"
        if self.kind.is_compute:
            return f"{self.kind.value}{self.mb}{at}"
        arrow = "->" if self.kind in (ActionKind.SEND_F, ActionKind.SEND_B) else "<-"
        name = f":{self.edge.name}" if self.edge.name else ""
        return f"{_COMM_PREFIX[self.kind]}{self.mb}{arrow}{self.peer}{name}{at}"

    def __str__(self) -> str:
        return self.text()


_COMPUTE_RE = re.compile(r"([FBIW])(\d+)(?:@(\d+))?")
_REDUCE_RE = re.compile(r"R(?:@(\d+))?")
_COMM_RE = re.compile(r"([SRW][FB])(\d+)(->|<-)(\d+)(?::(\w+))?(?:@(\d+))?")


def parse_action(text: str, stage: int) -> Action:
    """Inverse of `Action.text`: an action executed by `stage` unless the text names one (``F3@4``)."""
    t = text.strip()
    m = _REDUCE_RE.fullmatch(t)
    if m:
        return Action(ActionKind.R, 0, int(m[1]) if m[1] else stage)
    m = _COMPUTE_RE.fullmatch(t)
    if m:
        return Action(ActionKind(m[1]), int(m[2]), int(m[3]) if m[3] else stage)
    m = _COMM_RE.fullmatch(t)
    if not m:
        raise ScheduleError(f"stage {stage}: cannot parse action {text!r} (expected e.g. "
                            f"F3, I3, W3, B3, R, SF3->1, RF3<-0, WF3<-0, SB3->0, RB3<-1, F3@4)")
    kind = _PREFIX_COMM[m[1]]
    arrow_ok = (m[3] == "->") == (kind in (ActionKind.SEND_F, ActionKind.SEND_B))
    if not arrow_ok:
        raise ScheduleError(f"stage {stage}: {text!r}: sends use '->', receives '<-'")
    me = int(m[6]) if m[6] else stage
    peer, name = int(m[4]), m[5] or ""
    src, dst = (me, peer) if _ON_SRC[kind] else (peer, me)
    return Action(kind, int(m[2]), me, Edge(src, dst, name))


@dataclass
class Schedule:
    """Per-mesh programs plus the graph and the placement they run on.

    `actions[m]` is mesh m's program, executed in order by every rank of the mesh; each
    action names the stage it runs. `placement[s]` is the mesh of stage s (default: stage s
    on mesh s, one stage per mesh); a mesh holding several stages holds *virtual stages*
    (interleaved, V-shaped placements). An edge between two stages of one mesh is a local
    hand-off: no communication. A schedule is *lowered* once it contains communication actions.
    """

    graph: PipelineGraph
    num_microbatches: int
    actions: list[list[Action]] = field(default_factory=list)
    name: str = ""
    placement: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.num_microbatches < 1:
            raise ScheduleError(f"num_microbatches={self.num_microbatches}: need >= 1")
        P = self.graph.num_stages
        place = tuple(range(P)) if self.placement is None else tuple(int(x) for x in self.placement)
        if len(place) != P:
            raise ScheduleError(f"placement {list(place)} names {len(place)} stages but the graph has {P}")
        meshes = max(place) + 1
        empty = sorted(set(range(meshes)) - set(place))
        if min(place) < 0 or empty:
            raise ScheduleError(f"placement {list(place)}: meshes must be numbered 0..{meshes - 1}, each holding "
                                f"a stage (empty: {empty})")
        self.placement = place
        if not self.actions:
            self.actions = [[] for _ in range(meshes)]
        if len(self.actions) != meshes:
            raise ScheduleError(f"schedule has {len(self.actions)} programs but the placement has {meshes} meshes")

    @property
    def num_stages(self) -> int:
        return self.graph.num_stages

    @property
    def num_meshes(self) -> int:
        return len(self.actions)

    @property
    def virtual(self) -> bool:
        """True when some mesh holds several stages."""
        return self.num_meshes < self.num_stages

    def mesh_of(self, stage: int) -> int:
        return self.placement[stage]  # type: ignore[index]

    def stages_of(self, mesh: int) -> tuple[int, ...]:
        return tuple(s for s, m in enumerate(self.placement) if m == mesh)  # type: ignore[arg-type]

    def is_local(self, edge: Edge) -> bool:
        """An edge between two stages of one mesh: a local hand-off, no communication."""
        return self.mesh_of(edge.src) == self.mesh_of(edge.dst)

    @property
    def is_lowered(self) -> bool:
        return any(a.kind.is_comm for acts in self.actions for a in acts)

    def compute_only(self) -> "Schedule":
        """The schedule with every comm and R action removed (undoes `lower` and `insert_grad_reduce`)."""
        return Schedule(self.graph, self.num_microbatches,
                        [[a for a in acts if a.kind.is_compute] for acts in self.actions],
                        self.name, self.placement)

    def __iter__(self) -> Iterator[list[Action]]:
        return iter(self.actions)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        return (self.graph == other.graph and self.num_microbatches == other.num_microbatches
                and self.actions == other.actions and self.placement == other.placement)

    # ---------------------------------------------------------------- text form
    def dumps(self) -> str:
        lines = ["# megareshard pipeline schedule" + (f": {self.name}" if self.name else ""),
                 f"stages {self.num_stages} microbatches {self.num_microbatches}"]
        lines += [f"edge {e}" for e in self.graph.skip_edges]
        if self.virtual:
            lines.append("placement " + ",".join(map(str, self.placement)))  # type: ignore[arg-type]
            lines += [f"mesh {m}: " + " ".join(a.text(True) for a in acts) for m, acts in enumerate(self.actions)]
        else:
            lines += [f"stage {s}: " + " ".join(map(str, acts)) for s, acts in enumerate(self.actions)]
        return "\n".join(lines) + "\n"

    @classmethod
    def loads(cls, text: str) -> "Schedule":
        header: tuple[int, int] | None = None
        name = ""
        skips: list[Edge] = []
        placement: tuple[int, ...] | None = None
        rows: dict[int, list[str]] = {}
        for lineno, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if line.startswith("# megareshard pipeline schedule:"):
                name = line.split(":", 1)[1].strip()
            if not line or line.startswith("#"):
                continue
            m = re.fullmatch(r"stages\s+(\d+)\s+microbatches\s+(\d+)", line)
            if m:
                header = (int(m[1]), int(m[2]))
                continue
            m = re.fullmatch(r"edge\s+(\d+)->(\d+):(\w+)", line)
            if m:
                skips.append(Edge(int(m[1]), int(m[2]), m[3]))
                continue
            m = re.fullmatch(r"placement\s+([\d,\s]+)", line)
            if m:
                placement = tuple(int(x) for x in m[1].replace(" ", "").split(",") if x)
                continue
            m = re.fullmatch(r"(?:stage|mesh)\s+(\d+):(.*)", line)
            if m:
                k = int(m[1])
                if k in rows:
                    raise ScheduleError(f"line {lineno}: program {k} listed twice")
                rows[k] = m[2].split()
                continue
            raise ScheduleError(f"line {lineno}: cannot parse {raw!r}")
        if header is None:
            raise ScheduleError("missing 'stages P microbatches M' line")
        graph = PipelineGraph(header[0], tuple(skips))
        meshes = (max(placement) + 1) if placement else graph.num_stages
        if set(rows) != set(range(meshes)):
            raise ScheduleError(f"expected lines for programs 0..{meshes - 1}, got {sorted(rows)}")
        acts = [[_parse_at(t, k, i) for i, t in enumerate(rows[k])] for k in range(meshes)]
        return cls(graph, header[1], acts, name, placement)

    def to_csv(self) -> str:
        """CSV: ``#``-comment header, then one row per program: mesh,action,action,..."""
        lines = [f"#stages,{self.num_stages},microbatches,{self.num_microbatches}"]
        lines += [f"#edge,{e.src},{e.dst},{e.name}" for e in self.graph.skip_edges]
        if self.virtual:
            lines.append("#placement," + ",".join(map(str, self.placement)))  # type: ignore[arg-type]
        lines += [",".join([str(m)] + [a.text(self.virtual) for a in acts]) for m, acts in enumerate(self.actions)]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_csv(cls, text: str) -> "Schedule":
        """Inverse of `to_csv`. The ``#`` header rows may be left out of a hand-written file: then the
        stages are the rows (or the ``#placement`` row's length) and the microbatches the largest
        microbatch named + 1."""
        out = []
        virtual = False
        if not any(line.strip().startswith("#stages") for line in text.splitlines()):
            text = _csv_header(text) + text
        for line in text.splitlines():
            cells = [c.strip() for c in line.split(",")]
            if not cells or cells == [""]:
                continue
            if cells[0] == "#stages":
                out.append(f"stages {cells[1]} microbatches {cells[3]}")
            elif cells[0] == "#edge":
                out.append(f"edge {cells[1]}->{cells[2]}:{cells[3]}")
            elif cells[0] == "#placement":
                out.append("placement " + ",".join(cells[1:]))
                virtual = True
            elif cells[0].startswith("#"):
                continue
            else:
                out.append(f"{'mesh' if virtual else 'stage'} {cells[0]}: " + " ".join(c for c in cells[1:] if c))
        return cls.loads("\n".join(out))

    def save(self, path: str | Path) -> None:
        """Write CSV if the suffix is .csv, else the `dumps` text."""
        p = Path(path)
        p.write_text(self.to_csv() if p.suffix == ".csv" else self.dumps())

    @classmethod
    def load(cls, path: str | Path) -> "Schedule":
        p = Path(path)
        text = p.read_text()
        return cls.from_csv(text) if p.suffix == ".csv" else cls.loads(text)


def _parse_at(text: str, mesh: int, index: int) -> Action:
    """`parse_action` for the `index`-th cell of mesh `mesh`'s program; errors say where."""
    try:
        return parse_action(text, mesh)
    except ScheduleError as e:
        why = str(e).split(": ", 1)[1] if str(e).startswith(f"stage {mesh}: ") else str(e)
        raise ScheduleError(f"mesh {mesh} action {index} {text!r}: {why}", mesh=mesh, index=index, action=text,
                            why=why) from None


def _csv_header(text: str) -> str:
    """The ``#stages`` row of a CSV schedule written without one (see `Schedule.from_csv`)."""
    rows, placement, top = 0, None, -1
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if not cells or cells == [""]:
            continue
        if cells[0] == "#placement":
            placement = [c for c in cells[1:] if c]
        if cells[0].startswith("#"):
            continue
        rows += 1
        for c in cells[1:]:
            m = re.match(r"[A-Z]+(\d+)", c)
            if m and not c.startswith("R@") and c != "R":
                top = max(top, int(m[1]))
    stages = len(placement) if placement else rows
    if top < 0:
        raise ScheduleError("CSV schedule: no action names a microbatch (and there is no #stages row)")
    return f"#stages,{stages},microbatches,{top + 1}\n"


def actions_of(schedule: Schedule, kinds: Iterable[ActionKind]) -> list[list[Action]]:
    """Per-stage lists filtered to `kinds` (helper for tests and tools)."""
    ks = set(kinds)
    return [[a for a in acts if a.kind in ks] for acts in schedule.actions]

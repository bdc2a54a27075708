"""What each rank holds of a model, as boxes of the global tensors — pure Python, no torch, no processes.

A model is a list of `ParamInfo` (global name, global shape *without* vocabulary padding, dtype, the tensor-parallel
dim, whether its rows are a padded vocabulary) — what checkpoints store under ``model.<name>``. A rank holds
`Box`es: one region ``[start, stop)`` per dim of one global tensor (a tp slice, at ZeRO-3 its row chunk, with the
vocabulary padding cut off, exactly as `checkpoint/state.py`'s ``_model_box`` / ``_cut`` describe a saved piece).
``local`` is the name of the tensor on that rank the box fills (the tied output-layer copy of a last pipeline stage
is ``output_layer.weight`` holding the word embedding's box).

`layout_boxes` describes a GPT layout analytically (tp, pp with virtual stages, dp, ZeRO-3 row chunks, padded
vocabulary, and the MoE expert tensors' split over ep and etp) for the planner's own tests and for destinations; a
running trainer's source boxes are read from its parameters instead (`megareshard.transfer`), so the planner never
guesses how the trainer split anything.

**Expert tensors** (``ParamInfo.expert_dim`` not None): an MoE layer's stacked expert weights ``[E, out, in]`` and
biases ``[E, out]`` (`models/moe/experts.py`). Their description is layout-independent: the global ``[E, ...]``
shape, ``partition_dim`` -1, and ``expert_dim`` the dim expert tensor parallelism splits (``fc1``/``fc1_gate``/
``fc1_up``: 1, ``fc2.weight``: 2, ``fc2.bias``: -1, not split). A stage's ``tp × dp`` ranks ``j = dp_rank · tp +
tp_rank`` are read as the expert grid of `parallel/expert_topology.py` (etp innermost, then ep, then edp): rank j
holds experts ``[ep_rank · E/ep, (ep_rank + 1) · E/ep)`` and, on ``expert_dim``, its etp rank's ``1/etp`` — exactly
the ``expert_box`` every expert parameter carries (tests/resharding/test_weight_transfer_boxes.py builds the models
at many layouts and compares).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

__all__ = ["ParamInfo", "Box", "layout_boxes", "ITEMSIZE", "stage_of_param", "even_layer_ranges"]

ITEMSIZE = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8, "int64": 8, "int32": 4,
            "uint8": 1, "int8": 1}

_LAYER = re.compile(r"^layers\.(\d+)\.")


@dataclass(frozen=True)
class ParamInfo:
    """One global tensor of the model."""

    name: str
    shape: tuple[int, ...]  # global, vocabulary padding excluded (what a checkpoint stores)
    dtype: str  # torch dtype name without ``torch.``: float32, bfloat16, ...
    partition_dim: int = -1  # the dim tensor parallelism splits (-1: replicated over tp)
    vocab_padded: bool = False  # dim 0 is a vocabulary padded to a multiple of divisible_by × tp
    expert_dim: int | None = None  # an MoE expert tensor [E, ...]: the dim etp splits (-1: none); None: not one

    @property
    def itemsize(self) -> int:
        try:
            return ITEMSIZE[self.dtype]
        except KeyError:
            raise ValueError(f"parameter {self.name}: dtype {self.dtype!r} has no known size "
                             f"(known: {', '.join(ITEMSIZE)})") from None

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.itemsize


@dataclass(frozen=True)
class Box:
    """A region of global tensor ``name`` held (source) or needed (destination) by one rank."""

    name: str
    region: tuple[tuple[int, int], ...]  # [start, stop) per dim of the global (unpadded) tensor
    local: str = ""  # the rank's own tensor the box lives in ("" = ``name``)

    @property
    def local_name(self) -> str:
        return self.local or self.name

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.region)

    @property
    def numel(self) -> int:
        n = 1
        for a, b in self.region:
            n *= b - a
        return n


def even_layer_ranges(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Layers ``[start, stop)`` of each of ``stages`` stages, split as evenly as possible (first ones larger)."""
    if stages < 1 or num_layers < stages:
        raise ValueError(f"{num_layers} layers cannot fill {stages} pipeline stages (each needs at least one layer)")
    q, r = divmod(num_layers, stages)
    out, start = [], 0
    for s in range(stages):
        stop = start + q + (1 if s < r else 0)
        out.append((start, stop))
        start = stop
    return out


def stage_of_param(name: str, layer_ranges: Sequence[tuple[int, int]]) -> int:
    """The pipeline stage (index into ``layer_ranges``) holding parameter ``name`` of a GPT: embeddings on the
    first, the final norm and the output layer on the last, ``layers.i.*`` where layer i is."""
    m = _LAYER.match(name)
    if m:
        i = int(m.group(1))
        for s, (a, b) in enumerate(layer_ranges):
            if a <= i < b:
                return s
        raise ValueError(f"parameter {name}: layer {i} is in no stage (stages hold layers {list(layer_ranges)})")
    if name.startswith("embedding."):
        return 0
    return len(layer_ranges) - 1


def _tp_region(p: ParamInfo, tp: int, tp_rank: int, divisible_by: int) -> list[tuple[int, int]]:
    """The tp slice of ``p`` on ``tp_rank`` in padded coordinates, before the vocabulary cut."""
    region = [(0, s) for s in p.shape]
    if p.partition_dim < 0 or tp == 1 and not p.vocab_padded:
        return region
    d = p.partition_dim
    full = p.shape[d]
    if p.vocab_padded and d == 0:
        multiple = divisible_by * tp
        full = -(-full // multiple) * multiple
    elif full % tp:
        raise ValueError(f"parameter {p.name}: dim {d} of size {full} is not divisible by tensor-parallel size {tp}")
    per = full // tp
    region[d] = (tp_rank * per, (tp_rank + 1) * per)
    return region


def _zero3_rows(region: list[tuple[int, int]], dp: int, dp_rank: int) -> list[tuple[int, int]]:
    """ZeRO-3's row chunk of a (padded) tp slice (`optim/zero_shards.py`: ceil(rows / dp) rows per dp rank)."""
    a, b = region[0] if region else (0, 1)
    rows = b - a
    chunk = -(-rows // dp)
    start = min(dp_rank * chunk, rows)
    stop = min(start + chunk, rows)
    return [(a + start, a + stop)] + list(region[1:])


def _cut(p: ParamInfo, region: list[tuple[int, int]]) -> tuple[tuple[int, int], ...] | None:
    """The region inside the real tensor (vocabulary padding removed); None when nothing real is left."""
    out = []
    for (a, b), s in zip(region, p.shape):
        a, b = min(a, s), min(b, s)
        if b <= a:
            return None
        out.append((a, b))
    return tuple(out)


def _expert_region(p: ParamInfo, j: int, ep: int, etp: int) -> tuple[tuple[int, int], ...]:
    """The box of expert tensor ``p`` on the stage's rank ``j`` (= dp_rank · tp + tp_rank) of an (ep, etp) grid."""
    region = [(0, s) for s in p.shape]
    e = p.shape[0] // ep
    ep_rank, etp_rank = (j // etp) % ep, j % etp
    region[0] = (ep_rank * e, (ep_rank + 1) * e)
    if p.expert_dim is not None and p.expert_dim >= 0 and etp > 1:
        w = p.shape[p.expert_dim] // etp
        region[p.expert_dim] = (etp_rank * w, (etp_rank + 1) * w)
    return tuple(region)


def _check_experts(params: list[ParamInfo], tp: int, dp: int, ep: int, etp: int, zero3: bool) -> None:
    """One line with the numbers when the expert tensors cannot be split over (ep, etp) in a tp × dp stage."""
    experts = [p for p in params if p.expert_dim is not None]
    if ep < 1 or etp < 1:
        raise ValueError(f"expert-parallel size {ep} and expert-tensor-parallel size {etp} must be >= 1")
    if not experts:
        return
    if (tp * dp) % (ep * etp):
        raise ValueError(f"ep {ep} × etp {etp} = {ep * etp} does not divide the {tp * dp} ranks of a stage "
                         f"(tp {tp} × dp {dp})")
    if zero3 and dp > 1:
        raise ValueError("ZeRO-3 row chunks of expert tensors are not described (the trainer refuses MoE at ZeRO-3)")
    for p in experts:
        if p.shape[0] % ep:
            raise ValueError(f"parameter {p.name}: {p.shape[0]} experts are not divisible by expert-parallel size {ep}")
        d = p.expert_dim
        if d >= 0 and etp > 1 and p.shape[d] % etp:
            raise ValueError(f"parameter {p.name}: dim {d} of size {p.shape[d]} is not divisible by "
                             f"expert-tensor-parallel size {etp}")


def layout_boxes(params: Iterable[ParamInfo], ranks: Sequence[int], *, tp: int = 1, pp: int = 1, dp: int = 1,
                 virtual: int = 1, zero3: bool = False, divisible_by: int = 128, num_layers: int | None = None,
                 tied: bool = True, layer_ranges: Sequence[tuple[int, int]] | None = None, ep: int = 1,
                 etp: int | None = None) -> dict[int, list[Box]]:
    """Per rank of ``ranks``, the boxes a GPT in layout (tp, pp, dp) holds. Ranks are placed tp innermost, then dp,
    then pp (the default order ``tp-dp-pp``): ``ranks[tp_rank + tp·(dp_rank + dp·pp_rank)]``. With ``virtual`` V
    there are pp·V stages, stage s on pp rank s mod pp (interleaved). ``zero3``: each dp rank holds its row chunk
    of the tp slice (else the whole slice, on every dp replica). Tied embeddings with pp·V > 1: the last stage
    holds the word embedding as its ``output_layer.weight``. ``layer_ranges``: layers of each stage (default even).
    MoE expert tensors are split over ``ep`` and ``etp`` (default tp) inside each stage (module docstring)."""
    params = list(params)
    if tp < 1 or pp < 1 or dp < 1 or virtual < 1:
        raise ValueError(f"tp {tp}, pp {pp}, dp {dp} and virtual stages {virtual} must all be >= 1")
    etp = tp if etp is None else etp
    _check_experts(params, tp, dp, ep, etp, zero3)
    need = tp * pp * dp
    if len(ranks) != need:
        raise ValueError(f"layout tp {tp} × pp {pp} × dp {dp} needs {need} ranks, got {len(ranks)} ({list(ranks)})")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"layout ranks {list(ranks)} list a rank twice")
    stages = pp * virtual
    if layer_ranges is None:
        if num_layers is None:
            num_layers = 1 + max((int(m.group(1)) for m in (_LAYER.match(p.name) for p in params) if m), default=-1)
        layer_ranges = even_layer_ranges(num_layers, stages) if stages > 1 else [(0, max(num_layers, 1))]
    elif len(layer_ranges) != stages:
        raise ValueError(f"{len(layer_ranges)} layer ranges for pp {pp} × virtual {virtual} = {stages} stages")
    out: dict[int, list[Box]] = {r: [] for r in ranks}
    embedding = "embedding.word_embeddings.weight"
    for p in params:
        stage = stage_of_param(p.name, layer_ranges)
        holders = [(stage, p.name)]
        if p.name == embedding and tied and stages > 1:
            holders.append((stages - 1, "output_layer.weight"))
        for st, local in holders:
            pr = st % pp
            for d in range(dp):
                for t in range(tp):
                    if p.expert_dim is not None:
                        cut = _expert_region(p, d * tp + t, ep, etp)
                        out[ranks[t + tp * (d + dp * pr)]].append(Box(p.name, cut))
                        continue
                    region = _tp_region(p, tp, t, divisible_by)
                    if zero3 and dp > 1:
                        region = _zero3_rows(region, dp, d)
                    cut = _cut(p, region)
                    if cut is not None:
                        out[ranks[t + tp * (d + dp * pr)]].append(Box(p.name, cut, "" if local == p.name else local))
    return out

"""How ZeRO lays one parameter out over data parallelism, and the flat buffers its collectives move.

Layout (FSDP2-style, per parameter). Every parameter ``p`` (this rank's tp slice) is viewed as
``rows × row_size`` with ``rows = p.shape[0]`` (a 0-d parameter is one row). Over the dp group of
size ``D`` it is split along dim 0 into ``D`` chunks of ``chunk = ceil(rows / D)`` rows
(``torch.chunk`` semantics): dp rank ``r`` owns rows ``[r·chunk, min((r+1)·chunk, rows))`` — the
last ranks may own fewer rows, or none. In the communication buffers every chunk is padded with
zero rows to ``chunk`` rows, so a bucket is ``D`` equal segments (rank-major: segment r holds rank
r's chunk of every parameter of the bucket, one after the other) and one ``reduce_scatter`` /
``all_gather`` moves it; the padding never reaches optimizer state. Each piece of optimizer state is
therefore a regular box of the full parameter: global shape + offset along dim 0 (combined with the
tp slice for the full-model view, see ``ShardInfo``), which is what reshardable checkpoints need.

Packing a bucket's gradients into that rank-major layout, and unpacking an all-gathered bucket into
parameters, are the copies ZeRO pays on top of the collectives. Both run as one call over the
bucket when PyTorch has the ops FSDP2 uses for the same layout (``torch._chunk_cat`` to pack,
``torch.split_with_sizes_copy`` to unpack); otherwise as at most two copies per parameter.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ShardInfo", "ShardEntry", "Bucket", "pack_grads", "unpack_rows"]

_chunk_cat = getattr(torch, "_chunk_cat", None)


@dataclass(frozen=True)
class ShardInfo:
    """Where this rank's optimizer shard of one parameter lies.

    ``local_shape``: the parameter on this rank (its tp slice). ``dp_offset``/``dp_rows``:
    the shard's rows along dim 0 of ``local_shape``. ``global_shape``/``global_offset``/
    ``shard_shape``: the same box in the FULL model tensor (tp slice composed with the dp
    rows; for a vocab-parallel embedding the global shape includes the vocabulary padding).
    """

    name: str
    local_shape: tuple[int, ...]
    dp_offset: int
    dp_rows: int
    chunk_rows: int
    shard_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    decay: bool


class ShardEntry:
    """One parameter's shard: its rows, fp32 master and (ZeRO-3) the parameter's own shard at rest.

    ``master``: the fp32 tensor the inner optimizer steps. At stages 1/2 with an fp32 parameter it
    is a view of the parameter's own rows (``master_is_view``); otherwise a separate fp32 copy.
    ``shard`` (stage 3 only): the parameter's rows held between gathers, in the parameter's dtype
    (the master itself for an fp32 parameter); ``padded`` the parameter's storage seen as ``D``
    chunks of ``chunk`` rows, which an all-gather fills (see ``megareshard.optim.zero3``).
    """

    __slots__ = ("name", "param", "rows", "row_size", "chunk", "start", "stop", "master", "master_is_view",
                 "info", "defer", "shard", "padded", "expert")

    def __init__(self, name: str, param: torch.nn.Parameter, dp: int, dp_rank: int, tp: int, tp_rank: int,
                 decay: bool, *, sharded_params: bool = False) -> None:
        self.name, self.param = name, param
        shape = tuple(param.shape)
        self.rows = shape[0] if shape else 1
        self.row_size = param.numel() // self.rows if self.rows else 0
        self.chunk = -(-self.rows // dp)
        self.start = min(dp_rank * self.chunk, self.rows)
        self.stop = min(self.start + self.chunk, self.rows)
        n = self.stop - self.start
        shard_shape = (n, *shape[1:]) if shape else (n,)
        gshape, goff = list(shape) or [1], [0] * max(len(shape), 1)
        # an MoE expert weight (models/moe/experts.py) names its box in the full [experts, out, in] tensor: sharded
        # over the expert-data-parallel ranks (``dp``/``dp_rank`` are theirs), never over tp
        self.expert = getattr(param, "expert_box", None) is not None
        if self.expert:
            gshape, goff = list(param.expert_box[0]), list(param.expert_box[1])
        elif getattr(param, "tensor_model_parallel", False) and tp > 1:
            d = param.partition_dim
            goff[d] = tp_rank * gshape[d]
            gshape[d] *= tp
        goff[0] += self.start
        self.info = ShardInfo(name, shape, self.start, n, self.chunk, shard_shape, tuple(gshape), tuple(goff), decay)
        self.defer = False
        self.shard = self.padded = None
        if sharded_params:  # ZeRO-3: the sharder lays master and shard out in its unit's buffer
            self.master, self.master_is_view = None, param.dtype == torch.float32
            return
        rows_view = param.detach().view(self.rows, self.row_size)[self.start:self.stop]
        if param.dtype == torch.float32:
            self.master = rows_view.view(shard_shape)       # shares the parameter's storage
            self.master_is_view = True
        else:
            self.master = rows_view.float().view(shard_shape).clone()
            self.master_is_view = False

    @property
    def seg(self) -> int:
        """Elements of one dp rank's (padded) chunk in a bucket."""
        return self.chunk * self.row_size

    def param_rows(self) -> torch.Tensor:
        return self.param.detach().view(self.rows, self.row_size)


class Bucket:
    """Parameters whose gradients travel in one reduce-scatter (or all-reduce), and whose updated rows in one
    all-gather: ``D`` segments of ``seg`` elements, each entry at its offset inside every segment."""

    __slots__ = ("entries", "offsets", "seg", "dtype", "ready", "defer", "launched", "expert", "split")

    def __init__(self, entries: list[ShardEntry]) -> None:
        self.entries = entries
        self.offsets, off = [], 0
        for e in entries:
            self.offsets.append(off)
            off += e.seg
        self.seg = off                      # elements per dp rank
        # one rank's segment cut into each entry's rows and its padding, alternately: one split, not two slices
        # and two views an entry
        self.split = [n for e in entries for n in ((e.stop - e.start) * e.row_size,
                                                   e.seg - (e.stop - e.start) * e.row_size)]
        self.dtype = entries[0].param.dtype
        self.ready: set[int] = set()
        self.defer = any(e.defer for e in entries)
        self.launched = 0
        self.expert = entries[0].expert     # expert weights: reduced over the expert-data-parallel group

    def has_grads(self) -> bool:
        return any(e.param.grad is not None for e in self.entries)


def pack_grads(b: Bucket, D: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The bucket's local gradients in the rank-major layout (zero-padded chunks): ``D × seg`` elements of
    ``dtype``. A parameter without a gradient contributes zeros."""
    flat = torch.empty(D * b.seg, dtype=dtype, device=device)
    grads = []
    for e in b.entries:
        g = e.param.grad
        grads.append((g.detach() if g is not None else torch.zeros(e.param.shape, dtype=e.param.dtype,
                                                                     device=device)).reshape(e.rows, e.row_size))
    if _chunk_cat is not None:   # one kernel (dp 1 too: a plain concatenation), not a copy per parameter
        _chunk_cat(grads, 0, D, out=flat.view(D, b.seg))
        return flat
    grid = flat.view(D, b.seg)
    for g, e, off in zip(grads, b.entries, b.offsets):
        _pack_one(grid[:, off:off + e.seg], g, e, D)
    return flat


def _pack_one(region: torch.Tensor, g: torch.Tensor, e: ShardEntry, D: int) -> None:
    """``region`` (``D × chunk·row_size``, strided) <- ``g`` (``rows × row_size``), zero-padded."""
    full = e.rows // e.chunk if e.chunk else 0          # complete chunks
    if full:
        region[:full].copy_(g[:full * e.chunk].reshape(full, e.seg))
    if full < D:
        rest = region[full].view(e.chunk, e.row_size)
        rem = e.rows - full * e.chunk
        if rem:
            rest[:rem].copy_(g[full * e.chunk:])
        rest[rem:].zero_()
        if full + 1 < D:
            region[full + 1:].zero_()


def unpack_rows(grid: torch.Tensor, b: Bucket, D: int, skip_rank: int | None = None) -> None:
    """Copy an all-gathered bucket (``grid``: ``D × seg``) into every entry's parameter rows (unpadded storage:
    ZeRO 1/2's model parameters), at most two copies per entry. ``skip_rank``: rows this rank already holds."""
    for e, off in zip(b.entries, b.offsets):
        if not e.row_size:
            continue
        region = grid[:, off:off + e.seg]
        rows = e.param_rows()
        full = e.rows // e.chunk if e.chunk else 0
        if skip_rank is None or skip_rank >= full:
            if full:
                rows[:full * e.chunk].view(full, e.seg).copy_(region[:full])
        else:  # around this rank's own rows
            if skip_rank:
                rows[:skip_rank * e.chunk].view(skip_rank, e.seg).copy_(region[:skip_rank])
            if skip_rank + 1 < full:
                rows[(skip_rank + 1) * e.chunk:full * e.chunk].view(full - skip_rank - 1, e.seg).copy_(
                    region[skip_rank + 1:full])
        rem = e.rows - full * e.chunk
        if rem and skip_rank != full:
            rows[full * e.chunk:].copy_(region[full].view(e.chunk, e.row_size)[:rem])

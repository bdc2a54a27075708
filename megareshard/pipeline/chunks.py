"""The model chunks one rank holds: one module per pipeline stage placed on its mesh (virtual stages).

With one stage per mesh a rank holds one stage module and the runtime calls it directly. With
virtual stages (interleaved: stage ``v·P + p`` on mesh p; zbv: stages p and 2P−1−p) the rank
holds a `ModelChunks`: the modules of its stages, keyed by stage. It is one ``nn.Module`` to the
trainer, so the optimizer, the gradient clipping, the checkpoints and the full-gradient gathers see
every chunk's parameters under their *model* names (a chunk's names are its stage module's own,
which already carry global layer indices: ``layers.5.…``), whatever the placement. A parameter two
chunks share (zbv's tied word embedding, the first and the last stage on mesh 0) appears once.
"""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch
from torch import nn

__all__ = ["ModelChunks", "build_chunks", "stages_on"]


def stages_on(placement: Sequence[int], mesh: int) -> list[int]:
    """The stages placed on ``mesh``, in model order."""
    return [s for s, m in enumerate(placement) if m == mesh]


class ModelChunks(nn.Module):
    """This rank's stage modules (model chunks), keyed by stage; parameters under their model names."""

    def __init__(self, chunks: dict[int, nn.Module], num_stages: int) -> None:
        super().__init__()
        if not chunks:
            raise ValueError("a rank holds at least one model chunk")
        self.stages = tuple(sorted(chunks))
        self.num_stages = num_stages
        self.chunks = nn.ModuleDict({str(s): chunks[s] for s in self.stages})
        mods = list(self.chunks.values())
        self.sequence_parallel = any(getattr(m, "sequence_parallel", False) for m in mods)
        self.tied_embedding = all(getattr(m, "tied_embedding", True) for m in mods)
        self.streams = getattr(mods[0], "streams", None)

    def chunk(self, stage: int) -> nn.Module:
        """The module of ``stage`` (KeyError naming the held stages when this rank does not hold it)."""
        try:
            return self.chunks[str(stage)]
        except KeyError:
            raise KeyError(f"stage {stage} is not held here (this rank holds stages {list(self.stages)})") from None

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """Every chunk's parameters under the chunk's own names (model names), each parameter once."""
        seen: set[int] = set()
        for s in self.stages:
            for name, p in self.chunks[str(s)].named_parameters(prefix=prefix, recurse=recurse,
                                                                 remove_duplicate=remove_duplicate):
                if remove_duplicate and id(p) in seen:
                    continue
                seen.add(id(p))
                yield name, p

    def output_weight(self) -> torch.Tensor:
        """The tied weight this rank holds: the first stage's word embedding, else the last stage's output copy."""
        if 0 in self.stages:
            return self.chunk(0).output_weight()
        if self.num_stages - 1 in self.stages:
            return self.chunk(self.num_stages - 1).output_weight()
        raise RuntimeError(f"stages {list(self.stages)} hold neither the first nor the last stage: no tied weight")

    def set_wgrad_store(self, store) -> None:
        for m in self.chunks.values():
            m.set_wgrad_store(store)

    def configure_attention(self, micro_batch_size: int) -> list[str]:
        """Every chunk's attention kernel (the model's ``configure_attention``); one line per distinct choice."""
        lines: list[str] = []
        for m in self.chunks.values():
            lines += [line for line in m.configure_attention(micro_batch_size) if line not in lines]
        return lines

    def compile_regions(self, opts) -> list[str]:
        """Every chunk's compiled regions (the model's ``compile_regions``), named with their stage."""
        return [f"stage {s} {name}" for s in self.stages for name in self.chunk(s).compile_regions(opts)]

    def forward(self, *args, **kwargs):  # pragma: no cover - the runtime calls chunk(stage)
        raise RuntimeError("ModelChunks is run by the pipeline runtime, one chunk (stage) at a time")


def build_chunks(layouts: Sequence, placement: Sequence[int], mesh: int,
                 build_stage: Callable[[object], nn.Module]) -> ModelChunks:
    """`ModelChunks` of the stages on ``mesh``; ``build_stage(layout)`` builds one stage's module.

    When the first and the last stage share the mesh (zbv) and both hold the tied word embedding,
    the last stage's output layer takes the first stage's very Parameter: one weight, one
    gradient (both uses accumulate into it), no cross-rank tied reduction.
    """
    chunks = {s: build_stage(layouts[s]) for s in stages_on(placement, mesh)}
    last = len(layouts) - 1
    if 0 in chunks and last in chunks and last != 0:
        head = chunks[last]
        if getattr(head, "tied_embedding", False) and hasattr(head, "output_layer"):
            head.output_layer.weight = chunks[0].output_weight()
    return ModelChunks(chunks, len(layouts))

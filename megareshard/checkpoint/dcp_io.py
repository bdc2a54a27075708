"""Where megareshard meets torch.distributed.checkpoint (DCP): the planners that write and read boxes of global
tensors, and thin save/load calls. Imported on the first save or load (``format.py``, ``megatron_io.py``), not with
the trainer: DCP imports DTensor, over a second of start-up that a run which never checkpoints does not pay.

* ``save_pieces`` / ``load_pieces``: megareshard's own format. A tensor in ``boxes`` (key -> (global shape,
  offset)) is written as the chunk at its offset of a global tensor (a DCP ``SHARD`` write item) and read back as
  this rank's box of the saved tensor; other tensors are read whole; objects are pickled.
* ``load_boxes``: Megatron-LM's ``torch_dist`` files, several boxes of one stored tensor into request tensors, and
  the raw bytes of stored objects (never unpickled).
* ``save_whole``: a plain single-process DCP save (the ``torch_dist`` export).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties)
from torch.distributed.checkpoint.planner import LoadPlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import (_create_read_item_for_byteio,
                                                          create_read_items_for_chunk_list)

Boxes = dict[str, tuple[tuple[int, ...], tuple[int, ...]]]

__all__ = ["save_pieces", "load_pieces", "load_boxes", "save_whole", "read_metadata"]


class _PieceSavePlanner(DefaultSavePlanner):
    """Default planner whose tensors in ``boxes`` are written as chunks of a global tensor."""

    def __init__(self, boxes: Boxes) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes = boxes

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            box = self.boxes.get(item.index.fqn)
            if box is not None:
                t = self.state_dict[item.index.fqn]
                offsets = torch.Size(box[1])
                item = WriteItem(index=MetadataIndex(item.index.fqn, offsets), type=WriteItemType.SHARD,
                                 tensor_data=TensorWriteData(
                                     chunk=ChunkStorageMetadata(offsets=offsets, sizes=t.size()),
                                     properties=TensorProperties.create_from_tensor(t),
                                     size=torch.Size(box[0])))
            items.append(item)
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self.boxes:
            return self.state_dict[index.fqn]
        return super().lookup_object(index)


class _PieceLoadPlanner(DefaultLoadPlanner):
    """Reads each tensor in ``boxes`` as the chunk at its offset of the saved global tensor;
    other tensors are read whole; objects are unpickled into the state dict."""

    def __init__(self, boxes: Boxes) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=False)
        self.boxes = boxes

    def create_local_plan(self) -> LoadPlan:
        requests = []
        md_all = self.metadata.state_dict_metadata
        for fqn, obj in self.state_dict.items():
            if fqn not in md_all:
                raise RuntimeError(f"missing key in checkpoint: {fqn}")
            md = md_all[fqn]
            if isinstance(md, BytesStorageMetadata):
                requests.append(_create_read_item_for_byteio(MetadataIndex(fqn), 0, MetadataIndex(fqn), 0, 0))
                continue
            gshape, offset = self.boxes.get(fqn, (tuple(obj.shape), (0,) * obj.dim()))
            if tuple(md.size) != tuple(gshape):
                raise RuntimeError(f"{fqn}: saved global shape {tuple(md.size)} != expected {tuple(gshape)}")
            chunk = ChunkStorageMetadata(offsets=torch.Size(offset), sizes=obj.size())
            requests += create_read_items_for_chunk_list(fqn, md, [chunk])
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]


class _BoxLoadPlanner(DefaultLoadPlanner):
    """Reads boxes of stored tensors into request tensors (several boxes of one stored tensor allowed) and
    the raw bytes of stored objects (never unpickled)."""

    def __init__(self, requests: dict[str, tuple[str, tuple[int, ...], tuple[int, ...]]], objects: list[str]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True)
        self.requests, self.object_keys, self.raw = requests, objects, {}

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata
        items = []
        for rid, (fqn, offset, size) in self.requests.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(size))
            for it in create_read_items_for_chunk_list(fqn, md[fqn], [chunk]):
                items.append(dataclasses.replace(it, dest_index=dataclasses.replace(it.dest_index, fqn=rid)))
        for fqn in self.object_keys:
            items.append(_create_read_item_for_byteio(MetadataIndex(fqn), 0, MetadataIndex(fqn), 0, 0))
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]

    def load_bytes(self, read_item, value) -> None:
        self.raw[read_item.dest_index.fqn] = value.read()


class _Writer(FileSystemWriter):
    """DCP's file writer (one file per rank, fsynced) that calls ``before_metadata`` once the data files are
    written and before the metadata is (a test hook kills the process there)."""

    def __init__(self, path: str, before_metadata: Callable[[], None] | None) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self._before_metadata = before_metadata

    def finish(self, metadata: Metadata, results) -> None:
        if self._before_metadata is not None:
            self._before_metadata()
        super().finish(metadata, results)


def save_pieces(state: dict[str, Any], path: str, boxes: Boxes, *, process_group=None, no_dist: bool,
                before_metadata: Callable[[], None] | None = None) -> None:
    """Write ``state`` into ``path``: collective over ``process_group`` unless ``no_dist``."""
    dcp.save(state, storage_writer=_Writer(path, before_metadata), planner=_PieceSavePlanner(boxes),
             process_group=process_group, no_dist=no_dist)


def load_pieces(state: dict[str, Any], path: str, boxes: Boxes, *, process_group=None, no_dist: bool) -> None:
    """Fill ``state``'s tensors (their boxes) and objects from ``path``: collective unless ``no_dist``."""
    dcp.load(state, storage_reader=FileSystemReader(path), planner=_PieceLoadPlanner(boxes),
             process_group=process_group, no_dist=no_dist)


def load_boxes(state: dict[str, torch.Tensor], path: str,
               requests: dict[str, tuple[str, tuple[int, ...], tuple[int, ...]]], objects: list[str], *,
               no_dist: bool) -> dict[str, bytes]:
    """Fill each request tensor ``state[rid]`` with the box ``requests[rid]`` = (stored key, offset, size); returns
    the raw bytes of the stored ``objects``."""
    planner = _BoxLoadPlanner(requests, objects)
    dcp.load(state, storage_reader=FileSystemReader(path), planner=planner, no_dist=no_dist)
    return planner.raw


def save_whole(state: dict[str, Any], path: str) -> None:
    """A single-process DCP save of whole tensors and objects (one file, fsynced)."""
    dcp.save(state, storage_writer=FileSystemWriter(path, single_file_per_rank=True, sync_files=True),
             planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False), no_dist=True)


def read_metadata(path: str) -> Metadata:
    """The DCP metadata of the checkpoint directory ``path`` (DCP's own errors propagate)."""
    return FileSystemReader(path).read_metadata()

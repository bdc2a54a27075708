"""Where megareshard meets torch.distributed.checkpoint (DCP): the planners that write and read boxes of global
tensors, and thin save/load calls. Imported on the first save or load (``format.py``, ``megatron_io.py``), not with
the trainer: DCP imports DTensor, over a second of start-up that a run which never checkpoints does not pay.

* ``save_pieces`` / ``load_pieces``: megareshard's own format. A tensor in ``boxes`` (key -> (global shape,
  offset)) is written as the chunk at its offset of a global tensor (a DCP ``SHARD`` write item) and read back as
  this rank's box of the saved tensor; other tensors are read whole; objects are pickled.
* ``load_boxes``: Megatron-LM's ``torch_dist`` files, several boxes of one stored tensor into request tensors, and
  the raw bytes of stored objects (never unpickled).
* ``save_whole``: a plain single-process DCP save (the ``torch_dist`` export).

Every read goes through ``DataOnlyReader``: DCP's file reader, except that the ``.metadata`` pickle, the stored
objects and the tensor items are unpickled by ``safe_pickle`` (DCP's own reader calls ``pickle.load`` and
``torch.load(weights_only=False)``, which run whatever a planted ``__reduce__`` names).
"""
from __future__ import annotations

import dataclasses
import io
import os
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.futures import Future
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import (_create_read_item_for_byteio,
                                                          create_read_items_for_chunk_list)

from .errors import CheckpointError
from .safe_pickle import load_plain, load_torch

Boxes = dict[str, tuple[tuple[int, ...], tuple[int, ...]]]

__all__ = ["save_pieces", "load_pieces", "load_boxes", "save_whole", "read_metadata", "DataOnlyReader"]


class DataOnlyReader(FileSystemReader):
    """DCP's file reader with every pickle read as data (``safe_pickle``): the ``.metadata``, the stored objects
    (through ``load_bytes`` of the planners below, which ask ``object_source``) and the tensor items. Items
    written through a storage transform (compression, an extension) are refused: megareshard and Megatron-LM
    write none, and their readers would be code named by the file. The metadata is read once, by the first
    ``read_metadata`` (``_reader`` calls it before DCP does, so a refusal is ours, not a DCP warning with a
    traceback)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._metadata: Metadata | None = None

    def read_metadata(self) -> Metadata:     # no **kwargs: DCP then never falls back to per-rank metadata files
        if self._metadata is not None:
            return self._metadata
        path = os.path.join(str(self.path), ".metadata")
        with open(path, "rb") as f:
            metadata = load_plain(f, path)
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        self._metadata = metadata
        return metadata

    def object_source(self, index: MetadataIndex) -> str:
        """The file holding the stored item ``index`` and its key, for messages."""
        return f"{os.path.join(str(self.path), self.storage_data[index].relative_path)} (item {index.fqn})"

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for rel, items in per_file.items():
            path = os.path.join(str(self.path), rel)
            with open(path, "rb") as stream:
                for req in items:
                    info = self.storage_data[req.storage_index]
                    if getattr(info, "transform_descriptors", None):
                        raise CheckpointError(f"{path} (item {req.storage_index.fqn}) was written through storage "
                                              f"transforms {list(info.transform_descriptors)}, which megareshard "
                                              "does not read")
                    stream.seek(info.offset)
                    data = io.BytesIO(stream.read(info.length))
                    if req.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(req, data)
                        continue
                    tensor = load_torch(data, self.object_source(req.storage_index))
                    if not isinstance(tensor, torch.Tensor):
                        raise CheckpointError(f"{self.object_source(req.storage_index)} holds a "
                                              f"{type(tensor).__name__} where a tensor was recorded")
                    for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                        tensor = tensor.narrow(dim, start, length)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != tensor.size():
                        raise CheckpointError(f"{self.object_source(req.storage_index)}: a stored box of "
                                              f"{tuple(tensor.size())} where {tuple(target.size())} was recorded")
                    target.copy_(tensor)
                    planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut


def _reader(path: str) -> DataOnlyReader:
    reader = DataOnlyReader(path)
    reader.read_metadata()
    return reader


def _load_object(planner, read_item, value: io.BytesIO) -> Any:
    """A stored object of ``planner``'s load, read as data (DCP's default ``load_bytes`` unpickles anything)."""
    reader = planner.reader
    return load_torch(value, reader.object_source(read_item.storage_index))


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

    def load_bytes(self, read_item, value) -> None:
        self.state_dict[read_item.dest_index.fqn] = _load_object(self, read_item, value)


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
    planner = _PieceLoadPlanner(boxes)
    planner.reader = _reader(path)
    dcp.load(state, storage_reader=planner.reader, planner=planner, process_group=process_group, no_dist=no_dist)


def load_boxes(state: dict[str, torch.Tensor], path: str,
               requests: dict[str, tuple[str, tuple[int, ...], tuple[int, ...]]], objects: list[str], *,
               no_dist: bool) -> dict[str, bytes]:
    """Fill each request tensor ``state[rid]`` with the box ``requests[rid]`` = (stored key, offset, size); returns
    the raw bytes of the stored ``objects``."""
    planner = _BoxLoadPlanner(requests, objects)
    dcp.load(state, storage_reader=_reader(path), planner=planner, no_dist=no_dist)
    return planner.raw


def save_whole(state: dict[str, Any], path: str) -> None:
    """A single-process DCP save of whole tensors and objects (one file, fsynced)."""
    dcp.save(state, storage_writer=FileSystemWriter(path, single_file_per_rank=True, sync_files=True),
             planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False), no_dist=True)


def read_metadata(path: str) -> Metadata:
    """The DCP metadata of the checkpoint directory ``path``, read as data (a refusal or a read error propagates)."""
    return DataOnlyReader(path).read_metadata()

"""Every pickled byte a checkpoint holds is read as data: one unpickler, one allowlist, one refusal.

A pickle is a program: unpickling calls whatever callables it names (``os.system`` in a planted ``__reduce__``),
and torch's DCP reads its ``.metadata`` with plain ``pickle.load`` and its stored objects with
``torch.load(weights_only=False)``. Every reader of a checkpoint in megareshard goes through this module instead:

* ``load_plain(file, source)``: a plain pickle stream (DCP's ``.metadata``, through ``dcp_io``'s reader);
* ``load_torch(file_or_buffer, source)``: a ``torch.save`` file or buffer (DCP's stored objects and tensor items,
  Megatron-LM's ``common.pt`` and ``model_optim_rng.pt``, ``checkpoint_util.py import``'s ``.pt``).

The unpickler's ``find_class`` is the only door through which a pickle reaches code, and it opens only for
``ALLOWED``: containers, numbers, ``torch.Size``, dtypes, layouts, devices, torch's tensor rebuild functions,
numpy arrays (RNG states), ``argparse.Namespace`` (Megatron's arguments), paths and DCP's metadata dataclasses
and enums. Classes of the frameworks whose checkpoints we read (``megatron.*``, ``transformer_engine.*``: the
enums in Megatron's arguments, Transformer Engine's extra state) become inert ``Opaque`` records of their
arguments, never imported. Anything else is refused before it is built, in one ``CheckpointError`` line naming
the file and the class.
"""
from __future__ import annotations

import _compat_pickle
import importlib
import io
import pickle
import warnings
from typing import IO, Any

import torch

from .errors import CheckpointError

__all__ = ["ALLOWED", "FOREIGN_MODULES", "Opaque", "DataOnlyUnpickler", "load_plain", "load_torch"]

# (module, name) pairs built as themselves: resolved on first use, so a name a torch version lacks is refused
# like any other, not an import error
ALLOWED: frozenset[tuple[str, str]] = frozenset({
    ("collections", "OrderedDict"), ("collections", "defaultdict"), ("argparse", "Namespace"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex"),
    ("builtins", "bytearray"), ("builtins", "range"), ("_codecs", "encode"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib._local", "PosixPath"),
    ("pathlib._local", "PurePosixPath"),
    ("torch", "Size"), ("torch", "device"), ("torch", "Tensor"), ("torch.nn.parameter", "Parameter"),
    ("torch.serialization", "_get_layout"), ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3"),
    ("torch._utils", "_rebuild_parameter"), ("torch._utils", "_rebuild_parameter_with_state"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
    *(("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorProperties", "ChunkStorageMetadata",
        "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")),
    *(("torch.distributed.checkpoint.planner", n) for n in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem", "LoadItemType",
        "BytesIOWriteData")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),     # older torch's DCP metadata
    ("torch.distributed._shard.metadata", "ShardMetadata"),
})
# packages whose classes a Megatron-LM checkpoint pickles (enums in its arguments, Transformer Engine's extra
# state): read as inert records, never imported
FOREIGN_MODULES: tuple[str, ...] = ("megatron", "transformer_engine")
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class Opaque:
    """An inert record of a class from ``FOREIGN_MODULES`` (an enum, a config object): its arguments and state."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{type(self).__module__}.{type(self).__name__} {self.args!r}>"


def _numpy_dtype_class(module: str, name: str) -> bool:
    return module == "numpy.dtypes" and name.endswith("DType")     # numpy >= 1.25 pickles dtypes by class


class DataOnlyUnpickler(pickle.Unpickler):
    """A ``pickle.Unpickler`` whose ``find_class`` returns only what ``ALLOWED`` names (plus torch's dtypes,
    layouts and memory formats, and inert records of ``FOREIGN_MODULES``); ``source`` names the file in the
    refusal."""

    source = "a checkpoint file"

    def find_class(self, module: str, name: str) -> Any:
        # protocol 2 (torch.save's) names Python 2's modules (``__builtin__.set``): pickle's own mapping
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if (module, name) in ALLOWED or _numpy_dtype_class(module, name):
            try:
                return getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError):
                pass
        elif module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            return getattr(torch, name)
        elif module.split(".")[0] in FOREIGN_MODULES:
            return type(name, (Opaque,), {"__module__": module})
        raise CheckpointError(f"{self.source}: refused to build {module}.{name}: a checkpoint is read as data only "
                              "(tensors, numbers, strings, containers), and this is none of them")


def _unpickler_for(source: str) -> type[DataOnlyUnpickler]:
    return type("DataOnlyUnpickler", (DataOnlyUnpickler,), {"source": source})


class _PickleModule:
    """What ``torch.load(pickle_module=...)`` needs: an ``Unpickler`` class and a ``load`` (torch's reader of the
    old, non-zip format unpickles its header records with ``load``: that one is data-only too)."""

    __name__ = "megareshard_data_only_pickle"

    def __init__(self, source: str) -> None:
        self.Unpickler = _unpickler_for(source)

    def load(self, file: IO[bytes], **kwargs: Any) -> Any:
        return self.Unpickler(file, **kwargs).load()


def load_plain(file: IO[bytes], source: str) -> Any:
    """Unpickle a plain pickle stream (not a ``torch.save`` archive) as data."""
    return _unpickler_for(source)(file).load()


def load_torch(f: str | IO[bytes] | bytes, source: str | None = None, *, mmap: bool = False) -> Any:
    """``torch.load`` (to the CPU) of a file path, a buffer or bytes, every pickle in it read as data."""
    if isinstance(f, (bytes, bytearray)):
        f = io.BytesIO(f)
    source = source or (f if isinstance(f, str) else "a checkpoint buffer")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # torch's note on weights_only=False: the pickle module is ours
        return torch.load(f, map_location="cpu", pickle_module=_PickleModule(source), weights_only=False, mmap=mmap)

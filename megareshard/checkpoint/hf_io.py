"""Hugging Face model directories in and out (``checkpoint_util.py import-hf`` / ``export-hf``): a local directory
or a hub name (the local cache first, a download unless offline), ``config.json`` and safetensors weights
mapped by ``models/hf.py``, the tokenizer written as ``AutoTokenizer`` reads it (``models/hf_tokenizer.py``)."""
from __future__ import annotations

import dataclasses
import json
import os
import re

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..data.tokenizer import TokenizerError
from ..generation import recorded_tokenizer
from ..models import hf as hf_map
from ..models.config import ModelConfig
from ..models.hf_tokenizer import HFTokenizerExport, write_hf_tokenizer
from .convert import model_config_from_dict, writable_destination, write_imported
from .errors import CheckpointError
from .format import Piece, check_files, read_info, read_metadata, read_pieces, resolve_checkpoint_dir

__all__ = ["resolve_hf_source", "hf_tokenizer_record", "import_hf", "export_hf"]


def _safetensors():
    try:
        import safetensors.torch as st
    except ImportError:
        raise CheckpointError("Hugging Face checkpoints need the safetensors package: pip install safetensors") from None
    return st


# what import-hf reads of a hub repository: the config, the weights, the tokenizer
_HF_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                "tokenizer.model", "vocab.json", "merges.txt"]


def _hf_offline() -> bool:
    from huggingface_hub import constants
    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def resolve_hf_source(name: str) -> tuple[str, str | None]:
    """(a local directory, how it was found) for ``import-hf``'s source: an existing path as it is (how: None);
    otherwise a hub repository id (``org/model``) through ``huggingface_hub``: its snapshot in the local cache
    (``HF_HUB_CACHE`` / ``HF_HOME``) first, else a download unless ``HF_HUB_OFFLINE`` forbids one."""
    if os.path.exists(name) or not re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", name):
        return name, None
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise CheckpointError(f"{name} is not a directory here, and reading a Hugging Face Hub name needs "
                              "huggingface_hub: pip install huggingface_hub (or transformers)") from None

    def complete(path: str) -> bool:
        return os.path.isfile(os.path.join(path, "config.json")) and any(
            os.path.isfile(os.path.join(path, f)) for f in ("model.safetensors", "model.safetensors.index.json"))

    try:
        path = snapshot_download(name, local_files_only=True, allow_patterns=_HF_PATTERNS)
        if complete(path):
            return path, f"{name} from the local Hugging Face cache ({path})"
    except LocalEntryNotFoundError:
        pass
    except Exception as e:  # noqa: BLE001 (a malformed cache, a bad repository id)
        raise CheckpointError(f"{name}: not a directory here, and the Hugging Face cache cannot give it: "
                              f"{_first_line(e)}") from None
    if _hf_offline():
        raise CheckpointError(f"{name} is neither a directory here nor in the local Hugging Face cache "
                              f"({_hf_cache()}) with its config.json and safetensors weights, and HF_HUB_OFFLINE "
                              "forbids a download")
    try:
        path = snapshot_download(name, allow_patterns=_HF_PATTERNS)
    except Exception as e:  # noqa: BLE001 (no network, no such repository, a gated one: the hub's own errors)
        raise CheckpointError(f"{name} is not a directory here and could not be downloaded from the Hugging Face "
                              f"Hub: {type(e).__name__}: {_first_line(e)}") from None
    return path, f"{name} downloaded from the Hugging Face Hub into {path}"


def _hf_cache() -> str:
    from huggingface_hub import constants
    return constants.HF_HUB_CACHE


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


def hf_tokenizer_record(hf_dir: str) -> dict | None:
    """The tokenizer record (``tokenizer_record``'s form) of a Hugging Face directory with a ``tokenizer.json``."""
    if not os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        return None
    return {"type": "HuggingFaceTokenizer", "model": os.path.abspath(hf_dir), "vocab_file": None, "merge_file": None}


def import_hf(hf_dir: str, out_dir: str, force: bool = False) -> tuple[str, ModelConfig]:
    """A fresh checkpoint (iteration 0, weights only) from a Hugging Face Llama, GPT-2, Mixtral or Qwen3-MoE
    directory (or a hub name,
    through ``resolve_hf_source``). Its tokenizer, when the directory has a ``tokenizer.json``, is recorded
    (generate.py and export-hf use it)."""
    writable_destination(out_dir, force)
    hf_dir, _ = resolve_hf_source(hf_dir)
    cfg_path = os.path.join(hf_dir, "config.json")
    try:
        with open(cfg_path) as f:
            hf_cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {cfg_path}: {e}") from None
    st = _safetensors()
    try:
        cfg = hf_map.model_config_from_hf(hf_cfg)      # the config first: a bad one names its key, not a tensor
    except hf_map.HFInteropError as e:
        raise CheckpointError(f"{hf_dir}: {e}") from None
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"cannot read {index}: {type(e).__name__}: {e} (expected a weight_map)") from None
    else:
        files = ["model.safetensors"]
    hf_sd = {}
    for name in files:
        path = os.path.join(hf_dir, name)
        if not os.path.exists(path):
            raise CheckpointError(f"{path} is missing (only safetensors checkpoints are read)")
        try:
            hf_sd.update(st.load_file(path))
        except Exception as e:  # noqa: BLE001 (safetensors raises its own error type for a bad file)
            first = (str(e).strip().splitlines() or [""])[0][:160]
            raise CheckpointError(f"{path} ({os.path.getsize(path)} bytes) is not a readable safetensors file: "
                                  f"{first} (truncated or corrupt?)") from None
    try:
        model = hf_map.state_dict_from_hf(hf_sd, cfg)
    except hf_map.HFInteropError as e:
        raise CheckpointError(f"{hf_dir}: {e}") from None
    common = {"iteration": 0, "imported_from_hf": hf_cfg.get("model_type")}
    return write_imported(model, None, common, dataclasses.asdict(cfg), 0, hf_dir, out_dir,
                           hf_tokenizer_record(hf_dir)), cfg


def export_hf(path: str, hf_dir: str, force: bool = False, tokenizer: dict | None = None):
    """``config.json`` + ``model.safetensors`` (Llama, GPT-2, Mixtral or Qwen3-MoE) of a checkpoint's weights, and its
    tokenizer (``tokenizer``, a ``tokenizer_record``, else the one the checkpoint records) as files
    ``AutoTokenizer`` loads with its bos/eos/pad ids in ``config.json`` and ``generation_config.json``
    (``megareshard/models/hf_tokenizer.py``); returns (the config, what was written of the tokenizer)."""
    writable_destination(hf_dir, force)
    st = _safetensors()
    ckpt = resolve_checkpoint_dir(path)
    info = read_info(ckpt)
    saved = info.get("model_config")
    if not saved:
        raise CheckpointError(f"{ckpt} records no model configuration: the architecture cannot be told")
    cfg = model_config_from_dict(saved)
    md = read_metadata(ckpt)
    check_files(ckpt, read_info(ckpt), md)
    tensors = {k: Piece(torch.empty(tuple(v.size), dtype=v.properties.dtype), tuple(v.size), (0,) * len(v.size))
               for k, v in md.state_dict_metadata.items()
               if isinstance(v, TensorStorageMetadata) and k.startswith("model.")}
    read_pieces(ckpt, tensors, [], no_dist=True)
    model = {k[len("model."):]: p.tensor for k, p in tensors.items()}
    try:
        hf_cfg = hf_map.hf_config_from_model_config(cfg)
        hf_sd = hf_map.state_dict_to_hf(model, cfg)
    except hf_map.HFInteropError as e:
        raise CheckpointError(f"{ckpt}: {e}") from None
    record = tokenizer or recorded_tokenizer(info)
    os.makedirs(hf_dir, exist_ok=True)
    try:
        tok = write_hf_tokenizer(record, hf_dir, cfg.vocab_size)
    except TokenizerError as e:
        if tokenizer:
            raise CheckpointError(f"the tokenizer given ({record['type']}) cannot be exported: {e}") from None
        tok = HFTokenizerExport(f"none written: the tokenizer {ckpt} records ({record['type']}) cannot be read here "
                                f"({e}); give --tokenizer-type with its files to export it", unreadable=True)
    ids = {k: (v if v is not None and 0 <= v < cfg.vocab_size else None) for k, v in tok.special_ids().items()}
    outside = {k: v for k, v in tok.special_ids().items() if v is not None and ids[k] is None}
    if outside:
        raise CheckpointError(f"the tokenizer's {', '.join(f'{k} {v}' for k, v in outside.items())} is outside the "
                              f"model's vocabulary of {cfg.vocab_size}: it is not this model's tokenizer")
    hf_cfg.update(ids)        # null where there is none: no architecture default (GPT-2's 50256) stands in
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)
    if ids["eos_token_id"] is not None:
        gen = {k: v for k, v in ids.items() if v is not None}
        gen.setdefault("pad_token_id", ids["eos_token_id"])   # generate pads a batch with eos when there is no pad
        with open(os.path.join(hf_dir, "generation_config.json"), "w") as f:
            json.dump(gen, f, indent=2)
    st.save_file(hf_sd, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    return hf_cfg, tok

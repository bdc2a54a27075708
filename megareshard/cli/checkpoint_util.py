"""Inspect, export and import megareshard checkpoints (single process, no process group needed).

    python tools/checkpoint_util.py inspect CKPT            # CKPT: a root with `latest`, or iter_N
    python tools/checkpoint_util.py inspect CKPT --json     # the same, machine-readable
    python tools/checkpoint_util.py inspect CKPT --summary  # without the per-key listing
    python tools/checkpoint_util.py export CKPT OUT.pt [--weights-only]
    python tools/checkpoint_util.py import IN.pt OUTDIR [--iteration N] [--weights-only]
    python tools/checkpoint_util.py import-hf HF_DIR OUTDIR     # Llama, GPT-2, Mixtral, Qwen3-MoE (safetensors)
    python tools/checkpoint_util.py import-hf org/model OUTDIR  # a hub name: the local cache, else a download
    python tools/checkpoint_util.py export-hf CKPT HF_DIR       # with the checkpoint's tokenizer

Every writing command refuses a destination that exists and is not empty — another model's files, a
training root whose ``latest`` the import would move — saying what is there and writing nothing,
unless ``--force`` is given (``writable_destination``, the one check they all call). Writing into a
checkpoint root also takes its lock (``megareshard/checkpoint/lock.py``): a running job's ``--save``
directory is refused even with ``--force``.

``export`` writes ONE consolidated state dict, usable outside the framework with
``torch.load(OUT.pt, weights_only=True)``::

    {"format": "megareshard-export", "format_version": 1, "iteration": int,
     "model": {global name: full tensor},            # vocabulary unpadded, tied weight once
     "optimizer": {global name: {"master", "exp_avg", "exp_avg_sq", "step"}},   # unless --weights-only
     "model_config": {...}, "layout": {...}, "common": {...}}   # schedule, data position, args, W&B id

``import`` turns such a file (or a plain ``{name: tensor}`` dict of full tensors with the
model's global names) into a fresh checkpoint directory ``OUTDIR/iter_N`` + ``OUTDIR/latest``
that the trainer loads in any layout (``--load OUTDIR``; ``--finetune`` for weights only).

``import-hf`` reads a Hugging Face ``LlamaForCausalLM``, ``GPT2LMHeadModel``, ``MixtralForCausalLM`` or
``Qwen3MoeForCausalLM`` directory (``config.json`` and ``model.safetensors``, or shards listed in
``model.safetensors.index.json``), derives the architecture flags from the config, writes a fresh checkpoint
recording them and prints them, quoted for a shell (pass them with ``--load OUTDIR --finetune``); a directory's
``tokenizer.json`` is recorded as its tokenizer. A name that is not a path (``org/model``) is a Hugging Face Hub
repository, read through ``huggingface_hub``: its snapshot in the local cache (``HF_HUB_CACHE`` / ``HF_HOME``),
else downloaded unless ``HF_HUB_OFFLINE`` is set; the tool says which. ``export-hf`` writes a checkpoint's weights
back as ``config.json`` + ``model.safetensors`` that ``from_pretrained`` loads, and the tokenizer the checkpoint records
(or the tokenizer flags name) as files ``AutoTokenizer.from_pretrained`` loads, its bos/eos/pad ids in
``config.json`` and ``generation_config.json`` (``megareshard/models/hf_tokenizer.py``; null ids when there is
no tokenizer). The mappings are ``megareshard/models/hf.py`` (routers and experts: ``megareshard/models/hf_moe.py``),
the conversion ``megareshard/checkpoint/hf_io.py``; needs the ``safetensors`` package.

``import-megatron`` reads a Megatron-LM checkpoint (``torch_dist``, or the per-rank ``torch`` format
``mp_rank_TT[_PPP]/model_optim_rng.pt``; a root with ``latest_checkpointed_iteration.txt`` or an
``iter_NNNNNNN`` directory), derives the architecture from its saved arguments, writes a fresh
checkpoint of its weights and prints the flags; the tokenizer flags given (Megatron-LM's ``--tokenizer-type``,
``--tokenizer-model``, ``--vocab-file``, ``--merge-file``), else the tokenizer the saved arguments name when its
files are here, are recorded in it (``tools/generate.py`` and ``export-hf`` need no tokenizer flag afterwards),
and the tokenizer's size is the vocabulary kept (``pretrain_gpt.py --load DIR`` and ``tools/generate.py --load
DIR`` also read a Megatron-LM checkpoint directly). ``export-megatron`` writes a checkpoint's weights as a
``torch_dist`` checkpoint that Megatron-Core's ``dist_checkpointing.load`` reads into a model of the same
configuration (``--tensor-model-parallel-size``: the tp it will be loaded at, which sets the vocabulary padding).
Like every writing command here, neither writes into a non-empty directory unless ``--force``. The mappings are
``megareshard/checkpoint/megatron.py``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megareshard.checkpoint import (FORMAT_VERSION, CheckpointError, Piece, check_files, metadata_summary, read_info,
                                    read_metadata, read_pieces, resolve_checkpoint_dir)
from megareshard.checkpoint.convert import model_tensors, writable_destination, write_imported
from megareshard.checkpoint.hf_io import export_hf, import_hf, resolve_hf_source
from megareshard.checkpoint.manager import describe_layout
from megareshard.checkpoint.megatron import args_from_model_config, to_megatron
from megareshard.checkpoint.megatron_io import MegatronCheckpoint, write_torch_dist
from megareshard.checkpoint.megatron_load import open_checked, read_full
from megareshard.checkpoint.safe_pickle import load_torch
from megareshard.data.tokenizer import (TokenizerError, build_recorded_tokenizer, build_tokenizer,
                                        tokenizer_record)
from megareshard.generation import TOKENIZER_FLAGS
from megareshard.models import hf as hf_map

EXPORT_FORMAT = "megareshard-export"
_model_tensors = model_tensors          # the name the tests and older scripts use


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def inspect(path: str, as_json: bool = False, out=None, list_keys: bool = True) -> dict:
    out = sys.stdout if out is None else out  # looked up per call: a default bound at import outlives a redirect
    ckpt = resolve_checkpoint_dir(path)
    info = read_info(ckpt)
    md = read_metadata(ckpt)
    check_files(ckpt, info, md)
    keys = metadata_summary(md)
    report = {"path": ckpt, "format_version": info["format_version"], "iteration": info["iteration"],
              "layout": info.get("layout"), "model_config": info.get("model_config"),
              "consumed_samples": info.get("consumed_samples"), "wandb_run_id": info.get("wandb_run_id"),
              "has_optimizer": info.get("has_optimizer"), "has_rng": info.get("has_rng"),
              "files": info.get("files", {}), "keys": keys}
    if as_json:
        print(json.dumps(report, indent=1, sort_keys=True), file=out)
        return report
    lay = info.get("layout") or {}
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p(f"checkpoint {ckpt}")
    p(f"  format version {info['format_version']}, iteration {info['iteration']}, consumed samples "
      f"{info.get('consumed_samples')}, W&B run {info.get('wandb_run_id')}")
    if lay.get("tp") is not None:
        p(f"  saved layout: {describe_layout(lay)}; stage layers {lay.get('stage_layers')}")
    else:
        p("  saved layout: (imported: none)")
    if info.get("model_config"):
        mc = info["model_config"]
        p("  model: " + ", ".join(f"{k} {mc[k]}" for k in ("num_layers", "hidden_size", "num_attention_heads",
                                                            "ffn_hidden_size", "vocab_size", "seq_length") if k in mc))
    total_files = sum(info.get("files", {}).values())
    p(f"  files: {len(info.get('files', {}))}, {_human(total_files)} on disk")
    groups: dict[str, list[int]] = {}
    for k, v in keys.items():
        g = "objects" if v["kind"] == "object" else ("model" if k.startswith("model.") else
                                                     ".".join(k.split(".")[:2]))
        groups.setdefault(g, [0, 0])
        groups[g][0] += 1
        groups[g][1] += v.get("bytes", 0)
    for g, (n, b) in sorted(groups.items()):
        p(f"  {g:<22} {n:5d} key(s) {_human(b):>12}")
    if not list_keys:
        return report
    p("  keys:")
    for k, v in keys.items():
        if v["kind"] == "object":
            p(f"    {k:<60} object")
        else:
            p(f"    {k:<60} {str(tuple(v['shape'])):<18} {v['dtype']:<9} {v['chunks']:3d} chunk(s) "
              f"{_human(v['bytes'])}")
    return report


def export(path: str, out_path: str, weights_only: bool = False, force: bool = False) -> dict:
    """One consolidated state dict of full, unpadded tensors (see the module docstring)."""
    writable_destination(out_path, force)
    ckpt = resolve_checkpoint_dir(path)
    info = read_info(ckpt)
    md = read_metadata(ckpt)
    check_files(ckpt, info, md)
    tensors = {}
    for k, v in md.state_dict_metadata.items():
        if not isinstance(v, TensorStorageMetadata):
            continue
        if weights_only and not k.startswith("model."):
            continue
        tensors[k] = Piece(torch.empty(tuple(v.size), dtype=v.properties.dtype), tuple(v.size), (0,) * len(v.size))
    objects = read_pieces(ckpt, tensors, ["common"], no_dist=True)
    common = objects["common"]
    model = {k[len("model."):]: p.tensor for k, p in tensors.items() if k.startswith("model.")}
    result = {"format": EXPORT_FORMAT, "format_version": FORMAT_VERSION, "iteration": info["iteration"],
              "model": model, "model_config": info.get("model_config"), "layout": info.get("layout"),
              "common": {k: v for k, v in common.items() if k not in ("layout", "model_config")}}
    if not weights_only:
        optim: dict[str, dict[str, torch.Tensor]] = {}
        for k, p in tensors.items():
            if k.startswith("optim."):
                _, kind, name = k.split(".", 2)
                optim.setdefault(name, {})[kind] = p.tensor
        if optim:
            result["optimizer"] = optim
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    torch.save(result, out_path)
    return result


def import_(in_path: str, out_dir: str, iteration: int | None = None, weights_only: bool = False,
            force: bool = False) -> str:
    """A fresh checkpoint (``out_dir/iter_N``, ``out_dir/latest``) from an exported or plain state dict."""
    writable_destination(out_dir, force)
    try:
        data = load_torch(in_path)          # as data: nothing in the file runs (megareshard/checkpoint/safe_pickle.py)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"cannot read {in_path}: {type(e).__name__}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{in_path} holds a {type(data).__name__}, expected a dict of tensors")
    if "model" in data and isinstance(data["model"], dict):
        model, optim = data["model"], (None if weights_only else data.get("optimizer"))
        common = dict(data.get("common") or {})
        model_cfg = data.get("model_config")
    else:
        model, optim, common, model_cfg = data, None, {}, None
    bad = [k for k, v in model.items() if not torch.is_tensor(v)]
    if bad:
        raise CheckpointError(f"{in_path}: entries {bad[:5]} are not tensors")
    it = int(iteration if iteration is not None else data.get("iteration", 0) if "model" in data else 0)
    if iteration is not None or "model" not in data:
        common.update({"iteration": it})
    return write_imported(model, optim, common, model_cfg, it, in_path, out_dir)


def megatron_tokenizer(src: str, tokenizer: dict | None) -> tuple[dict | None, object | None, list[str]]:
    """(the tokenizer record to keep, the tokenizer built from it or None, notes) for a Megatron-LM checkpoint:
    ``tokenizer`` (the flags given) when given, else the one its saved arguments name (Megatron-LM's
    tokenizer_type, tokenizer_model, vocab_file, merge_file) when its files are here."""
    if tokenizer is not None:
        if tokenizer["type"] == "NullTokenizer":
            return tokenizer, None, []
        try:
            return tokenizer, build_recorded_tokenizer(tokenizer, 0), []
        except TokenizerError as e:
            raise CheckpointError(str(e)) from None
    args = MegatronCheckpoint(src).args
    saved = {k: args.get(k) for k in TOKENIZER_FLAGS[:4]}
    if not saved["tokenizer_type"]:
        return None, None, []
    record = tokenizer_record(argparse.Namespace(**saved))
    if record["type"] == "NullTokenizer":
        return record, None, []
    try:
        return record, build_recorded_tokenizer(record, 0), []
    except TokenizerError as e:
        return None, None, [f"the run's tokenizer ({record['type']}) cannot be read here ({e}): give "
                            "--tokenizer-type with --tokenizer-model (or --vocab-file and --merge-file) to record it, "
                            "so that tools/generate.py and export-hf need no tokenizer flags"]


def import_megatron(src: str, out_dir: str, vocab_size: int | None = None, force: bool = False,
                    tokenizer: dict | None = None):
    """A fresh checkpoint (iteration 0, weights only) from a Megatron-LM checkpoint, recording its tokenizer
    (``megatron_tokenizer``; its vocabulary is the model's unless ``vocab_size`` is given); returns (path, config,
    notes)."""
    writable_destination(out_dir, force)
    record, tok, notes = megatron_tokenizer(src, tokenizer)
    if vocab_size is None and tok is not None:
        vocab_size = tok.vocab_size           # Megatron-LM pads the tokenizer's vocabulary: the rest is padding
    opened = open_checked(src, vocab_size)
    model = read_full(opened)
    common = {"iteration": 0, "imported_from_megatron": {"format": opened.ckpt.format,
                                                         "iteration": opened.ckpt.iteration}}
    path = write_imported(model, None, common, dataclasses.asdict(opened.cfg), 0, opened.ckpt.path, out_dir,
                           record)
    return path, opened.cfg, opened.notes + notes


def export_megatron(path: str, out_dir: str, tp: int = 1, force: bool = False) -> str:
    """A Megatron-LM ``torch_dist`` checkpoint of a checkpoint's weights, for Megatron-Core at tensor parallelism
    ``tp``; returns its iteration directory."""
    writable_destination(out_dir, force)
    if tp < 1:
        raise CheckpointError(f"--tensor-model-parallel-size must be at least 1, got {tp}")
    ckpt, info, cfg, model = model_tensors(path)
    tensors, objects = to_megatron(model, cfg, tp)
    saved = info.get("args") or {}
    tokenizer = (saved.get("data") or {}).get("tokenizer_type") if isinstance(saved, dict) else None
    args = argparse.Namespace(**args_from_model_config(cfg, tp, {"tokenizer_type": tokenizer}))
    common = {"args": args, "checkpoint_version": 3.0, "iteration": int(info["iteration"])}
    return write_torch_dist(out_dir, int(info["iteration"]), tensors, objects, common)


def _add_tokenizer_flags(parser, default: str) -> None:
    """Megatron-LM's tokenizer flags (the names pretrain_gpt.py and generate.py take)."""
    g = parser.add_argument_group(f"tokenizer ({default})")
    g.add_argument("--tokenizer-type", default=None)
    g.add_argument("--tokenizer-model", default=None, help="a sentencepiece model, or a Hugging Face tokenizer's "
                                                           "directory (HuggingFaceTokenizer)")
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)


def _tokenizer_flags(args) -> dict | None:
    """The tokenizer record of the tokenizer flags given (None when none is), checked by building it."""
    given = {k: getattr(args, k, None) for k in TOKENIZER_FLAGS[:4]}
    if not any(given.values()):
        return None
    if given["tokenizer_type"] != "NullTokenizer":
        try:
            build_tokenizer(given["tokenizer_type"], tokenizer_model=given["tokenizer_model"],
                            vocab_file=given["vocab_file"], merge_file=given["merge_file"])
        except TokenizerError as e:
            raise CheckpointError(str(e)) from None
    return tokenizer_record(argparse.Namespace(**given))


def _say_tokenizer(ckpt: str) -> None:
    rec = read_info(ckpt).get("tokenizer")
    if rec:
        print(f"recorded its tokenizer: {rec['type']} {rec.get('model') or rec.get('vocab_file') or ''}".rstrip()
              + " (generate.py and export-hf use it)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="checkpoint_util.py", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("inspect", help="layout, iteration, keys, shapes, sizes")
    a.add_argument("ckpt")
    a.add_argument("--json", action="store_true")
    a.add_argument("--summary", action="store_true", help="totals per group only, no per-key listing")
    b = sub.add_parser("export", help="one consolidated, unpadded state dict (.pt)")
    b.add_argument("ckpt")
    b.add_argument("out")
    b.add_argument("--weights-only", action="store_true", help="model weights only (no optimizer state)")
    b.add_argument("--force", action="store_true", help="overwrite an existing OUT")
    c = sub.add_parser("import", help="a fresh checkpoint from an exported or plain state dict")
    c.add_argument("input")
    c.add_argument("out_dir")
    c.add_argument("--iteration", type=int, default=None, help="iteration to record (default: the file's, or 0)")
    c.add_argument("--weights-only", action="store_true", help="drop optimizer state from the input")
    c.add_argument("--force", action="store_true", help="write into a non-empty OUT_DIR (a root's latest moves to "
                                                        "the imported iteration)")
    d = sub.add_parser("import-hf", help="a fresh checkpoint from a Hugging Face Llama, GPT-2, Mixtral or Qwen3-MoE "
                                         "directory")
    d.add_argument("hf_dir")
    d.add_argument("out_dir")
    d.add_argument("--force", action="store_true", help="write into a non-empty OUT_DIR (a root's latest moves to "
                                                        "the imported iteration)")
    e = sub.add_parser("export-hf", help="a checkpoint's weights as a Hugging Face Llama, GPT-2, Mixtral or "
                                         "Qwen3-MoE directory")
    e.add_argument("ckpt")
    e.add_argument("hf_dir")
    e.add_argument("--force", action="store_true", help="overwrite the files of a non-empty HF_DIR")
    _add_tokenizer_flags(e, "default: the one the checkpoint records")
    g = sub.add_parser("import-megatron", help="a fresh checkpoint from a Megatron-LM checkpoint (torch_dist or "
                                               "per-rank torch files)")
    g.add_argument("megatron_dir")
    g.add_argument("out_dir")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="the tokenizer's vocabulary (default: from the saved arguments); rows past it are padding")
    g.add_argument("--force", action="store_true", help="write into a non-empty OUT_DIR")
    _add_tokenizer_flags(g, "default: the one the run's saved arguments name, when its files are here; recorded in "
                            "the checkpoint for generate.py and export-hf, and its vocabulary is the model's")
    h = sub.add_parser("export-megatron", help="a checkpoint's weights as a Megatron-LM torch_dist checkpoint")
    h.add_argument("ckpt")
    h.add_argument("megatron_dir")
    h.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="the tensor parallelism Megatron-LM will load it at (sets the vocabulary padding)")
    h.add_argument("--force", action="store_true", help="write into a non-empty DIR")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "inspect":
            inspect(args.ckpt, args.json, list_keys=not args.summary)
        elif args.cmd == "export":
            res = export(args.ckpt, args.out, args.weights_only, args.force)
            n = sum(t.numel() for t in res["model"].values())
            print(f"exported iteration {res['iteration']}: {len(res['model'])} weights ({n:,} parameters)"
                  + (f", optimizer state of {len(res['optimizer'])} parameters" if "optimizer" in res else "")
                  + f" -> {args.out}")
        elif args.cmd == "import-hf":
            writable_destination(args.out_dir, args.force)       # before a download
            src, found = resolve_hf_source(args.hf_dir)
            if found:
                print(f"reading {found}")
            path, cfg = import_hf(src, args.out_dir, args.force)
            _say_tokenizer(path)
            print(f"imported {args.hf_dir} -> {path}; train it with --load {args.out_dir} --finetune "
                  + shlex.join(hf_map.megatron_flags(cfg)))   # quoted: --moe-layer-freq [1,0,1] is a glob
        elif args.cmd == "import-megatron":
            path, cfg, notes = import_megatron(args.megatron_dir, args.out_dir, args.vocab_size, args.force,
                                               _tokenizer_flags(args))
            for note in notes:
                print(f"note: {note}")
            _say_tokenizer(path)
            print(f"imported {args.megatron_dir} -> {path}; train it with --load {args.out_dir} --finetune "
                  + shlex.join(hf_map.megatron_flags(cfg)))
        elif args.cmd == "export-megatron":
            path = export_megatron(args.ckpt, args.megatron_dir, args.tensor_model_parallel_size, args.force)
            print(f"exported {args.ckpt} -> {path} (Megatron-LM torch_dist, vocabulary padded for tensor parallelism "
                  f"{args.tensor_model_parallel_size}, weights only: load it in Megatron-LM with --load "
                  f"{args.megatron_dir} --finetune)")
        elif args.cmd == "export-hf":
            hf_cfg, tok = export_hf(args.ckpt, args.hf_dir, args.force, _tokenizer_flags(args))
            print(f"exported {args.ckpt} -> {args.hf_dir} ({hf_cfg['architectures'][0]}: config.json, model.safetensors)")
            ids = ", ".join(f"{k} {v}" for k, v in tok.special_ids().items() if v is not None) or "no special ids"
            line = f"tokenizer: {tok.description}" + (f" ({', '.join(tok.files)}; {ids})" if tok.files else f" ({ids})")
            if tok.unreadable:
                print(f"warning: {line}", file=sys.stderr)
            else:
                print(f"  {line}")
            if tok.mismatch:
                print(f"warning: the exported tokenizer encodes a text differently from the checkpoint's: "
                      f"{tok.mismatch}; check it before using the export", file=sys.stderr)
        else:
            path = import_(args.input, args.out_dir, args.iteration, args.weights_only, args.force)
            print(f"imported {args.input} -> {path} (load it with --load {args.out_dir})")
    except CheckpointError as e:
        print(f"checkpoint_util.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

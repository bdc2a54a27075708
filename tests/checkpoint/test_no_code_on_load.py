"""A checkpoint never runs code: a pickle whose ``__reduce__`` would write a marker file, planted in each pickled
file of real checkpoints (ours: ``.metadata``, each stored object, a tensor item; Megatron-LM ``torch_dist``:
``.metadata``, ``common.pt``; Megatron-LM per-rank ``model_optim_rng.pt``; an exported ``.pt``), given to every
reader: ``pretrain_gpt.py --load`` (one rank, and two ranks in another layout), ``--finetune``,
``tools/generate.py``, every ``tools/checkpoint_util.py`` command that reads one. The marker never appears, the
reader stops with one line naming the file and the class, the planted checkpoint is unchanged and no checkpoint
is written. Megatron-Core's own checkpoints get the same in tests/checkpoint/test_megatron_interop.py.

Each planted checkpoint is consistent apart from the pickle (sizes and checksums in ``checkpoint.json`` match
the planted bytes, as a careful attacker would make them): the unpickler is what stops it, not a checksum.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import shutil
import sys
import zlib
from pathlib import Path

import pytest
import torch

from megareshard.checkpoint import CheckpointError
from megareshard.checkpoint.format import Piece, read_info, read_metadata, read_pieces
from megareshard.checkpoint.megatron import args_from_model_config, to_megatron
from megareshard.checkpoint.megatron_io import write_torch_dist
from megareshard.checkpoint.safe_pickle import load_plain, load_torch
from megareshard.models import hf as hf_map
from megareshard.models.config import ModelConfig
from tests.harness import run_pretrain

from ._helpers import load_tool

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--vocab-size", "100", "--hidden-dropout", "0", "--attention-dropout", "0"]
RUN = ["--mock-data", *MODEL, "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
       "--lr-warmup-iters", "0", "--device", "cpu"]


class Plant:
    """Unpickling it runs ``touch MARKER`` (what a hostile checkpoint does with ``os.system``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


# ---- making planted checkpoints ------------------------------------------------------------------------------
def _reseal(ckpt: Path) -> None:
    """checkpoint.json's sizes and checksums made to match the files as they are now."""
    info = json.loads((ckpt / "checkpoint.json").read_text())
    for name in info["files"]:
        info["files"][name] = (ckpt / name).stat().st_size
        info["crc32"][name] = zlib.crc32((ckpt / name).read_bytes())
    (ckpt / "checkpoint.json").write_text(json.dumps(info))


def _read_all(ckpt: Path) -> tuple[dict[str, Piece], dict]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    md = read_metadata(str(ckpt))
    pieces = {k: Piece(torch.empty(tuple(v.size), dtype=v.properties.dtype), tuple(v.size), (0,) * len(v.size))
              for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    names = [k for k in md.state_dict_metadata if k not in pieces]
    return pieces, read_pieces(str(ckpt), pieces, names, no_dist=True)


def _plant(src: Path, dst: Path, where: str, marker: Path) -> Path:
    """A copy of the checkpoint root ``src`` at ``dst`` with the planted pickle ``where``: ``.metadata``, a stored
    object's key, or ``tensor`` (one tensor item's bytes)."""
    from megareshard.checkpoint.dcp_io import save_pieces
    shutil.copytree(src, dst)
    ckpt = dst / (src / "latest").read_text().strip()
    if where == ".metadata":
        (ckpt / ".metadata").write_bytes(pickle.dumps(Plant(marker)))
    elif where == "tensor":
        md = read_metadata(str(ckpt))
        index = next(i for i in md.storage_data if i.fqn.startswith("model."))
        data = ckpt / md.storage_data[index].relative_path
        buf = io.BytesIO()
        torch.save(Plant(marker), buf)
        offset = data.stat().st_size
        with open(data, "ab") as f:
            f.write(buf.getvalue())
        md.storage_data[index].offset, md.storage_data[index].length = offset, len(buf.getvalue())
        (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    else:
        pieces, objects = _read_all(ckpt)
        objects[where] = Plant(marker)
        for f in ckpt.iterdir():
            if f.name != "checkpoint.json":
                f.unlink()
        save_pieces({**{k: p.tensor for k, p in pieces.items()}, **objects}, str(ckpt), {}, no_dist=True)
    _reseal(ckpt)
    return dst


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    """A real checkpoint (iteration 2: model, optimizer, common state, one rank's RNG states) written by
    pretrain_gpt.py, and its planted copies."""
    work = tmp_path_factory.mktemp("ours")
    assert _main("pretrain_gpt", [*RUN, "--train-iters", "2", "--save", str(work / "real")])[0] == 0
    planted = {}
    for where in (".metadata", "common", "rng.rank0", "tensor"):
        planted[where] = _plant(work / "real", work / f"planted-{where}", where, work / f"marker-{where}")
    return work, planted


def _main(entry: str, argv: list[str]) -> tuple[int, str]:
    """``tools/X.py``'s or ``X.py``'s main in this process: (exit code, stderr). One line is asserted by callers."""
    import contextlib
    sys.path.insert(0, str(ROOT / "tools") if entry != "pretrain_gpt" else str(ROOT))
    try:
        mod = __import__(entry)
    finally:
        sys.path.pop(0)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = mod.main(argv)
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def _assert_refused(code, err: str, marker: Path, planted_file: str) -> None:
    assert code not in (0, None), err
    assert err.count("\n") <= 1 and "Traceback" not in err, err          # one line
    assert f"refused to build {os.system.__module__}.system" in err and planted_file in err, err
    assert not marker.exists(), "the planted pickle ran"


# ---- the unpickler itself ----------------------------------------------------------------------------------------
def test_data_loads_and_code_is_refused_in_every_pickle_format(tmp_path):
    import numpy as np   # torch's and megatron-core's dependency: installed with the test extra
    data = {"args": argparse.Namespace(lr=1e-3, params_dtype=torch.bfloat16), "path": Path("/x"),
            "rng": (torch.get_rng_state(), np.random.get_state(), np.arange(3, dtype=np.uint32)),
            "t": torch.arange(6.0).view(2, 3), "p": torch.nn.Parameter(torch.ones(2)), "size": torch.Size([2]),
            "layout": torch.strided, "set": {1, 2}, "od": __import__("collections").OrderedDict(a=1)}
    for zipped in (True, False):                    # torch.save's archive and its old stream format
        f = tmp_path / f"ok-{zipped}.pt"
        torch.save(data, f, _use_new_zipfile_serialization=zipped)
        back = load_torch(str(f))
        assert back["args"] == data["args"] and back["path"] == data["path"] and back["set"] == {1, 2}
        assert torch.equal(back["t"], data["t"]) and isinstance(back["p"], torch.nn.Parameter)
        assert back["rng"][1][0] == "MT19937" and (back["rng"][1][1] == data["rng"][1][1]).all()
        bad = tmp_path / f"bad-{zipped}.pt"
        torch.save({"x": Plant(tmp_path / "m")}, bad, _use_new_zipfile_serialization=zipped)
        with pytest.raises(CheckpointError, match=f"^{bad}: refused to build .*system"):
            load_torch(str(bad))
    with pytest.raises(CheckpointError, match="^F: refused to build builtins.eval"):
        load_plain(io.BytesIO(b"cbuiltins\neval\n(S'1'\ntR."), "F")      # eval('1'), protocol 0
    # Megatron's and Transformer Engine's classes are inert records, never imported
    rec = load_plain(io.BytesIO(b"cmegatron.core.enums\nModelType\n(I1\ntR."), "F")
    assert type(rec).__module__ == "megatron.core.enums" and rec.args == (1,)
    assert not (tmp_path / "m").exists()


# ---- our checkpoints ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", [".metadata", "common", "rng.rank0", "tensor"])
def test_pretrain_load_and_finetune_refuse_every_planted_pickle(ours, where, tmp_path):
    work, planted = ours
    root, marker = planted[where], work / f"marker-{where}"
    before = _snapshot(root)
    code, err = _main("pretrain_gpt", [*RUN, "--train-iters", "4", "--load", str(root), "--save", str(tmp_path / "a")])
    _assert_refused(code, err, marker, str(root / "iter_0000002"))
    assert _snapshot(root) == before and not list((tmp_path / "a").glob("iter_*"))
    code, err = _main("pretrain_gpt", [*RUN, "--train-iters", "1", "--load", str(root), "--finetune"])
    if where == "rng.rank0":       # --finetune reads the weights alone, never the RNG states: it trains
        assert code == 0 and not marker.exists(), err
    else:
        _assert_refused(code, err, marker, str(root / "iter_0000002"))
    assert _snapshot(root) == before


# which planted file each reader reads: the weights' readers never open the RNG states, `inspect` reads the
# metadata alone; a reader that does not read the planted pickle must work and leave no marker either
READS = {"inspect": {".metadata"}, "export": {".metadata", "tensor", "common"},
         "export-hf": {".metadata", "tensor"}, "export-megatron": {".metadata", "tensor"},
         "generate": {".metadata", "tensor"}}


def test_tools_refuse_every_planted_pickle(ours, tmp_path):
    work, planted = ours
    tool = load_tool()
    for where, root in planted.items():
        marker, ckpt = work / f"marker-{where}", str(root / "iter_0000002")
        for argv in (["inspect", str(root)], ["export", str(root), str(tmp_path / "out.pt")],
                     ["export-hf", str(root), str(tmp_path / "hf")],
                     ["export-megatron", str(root), str(tmp_path / "meg")],
                     ["generate", "--load", str(root), "--prompt", "1 2", "--tokenizer-type", "NullTokenizer",
                      "--vocab-size", "100", "--max-new-tokens", "2"]):
            code, err = _main("generate", argv[1:]) if argv[0] == "generate" else _main_tool(tool, argv)
            if where in READS[argv[0]]:
                _assert_refused(code, err, marker, ckpt)
                assert not any((tmp_path / d).exists() for d in ("out.pt", "hf", "meg"))
            else:
                assert code in (0, None) and not marker.exists(), (where, argv[0], err)
            for d in ("hf", "meg"):
                shutil.rmtree(tmp_path / d, ignore_errors=True)
            (tmp_path / "out.pt").unlink(missing_ok=True)
    # an exported .pt given to `import`
    bad = tmp_path / "planted.pt"
    torch.save({"model": {"w": torch.ones(1)}, "common": Plant(work / "marker-pt")}, bad)
    code, err = _main_tool(tool, ["import", str(bad), str(tmp_path / "imported")])
    _assert_refused(code, err, work / "marker-pt", str(bad))
    assert not (tmp_path / "imported").exists()


def _main_tool(tool, argv: list[str]) -> tuple[int, str]:
    import contextlib
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = tool.main(argv)
    return code, err.getvalue()


def test_two_ranks_in_another_layout_refuse_it(ours, tmp_path):
    """dp 2 with ZeRO 1 loading the one-rank checkpoint (a relayout) whose ``common`` object is planted: the
    object is read inside DCP's collective load; both ranks stop, the job prints the line once."""
    work, planted = ours
    root = planted["common"]
    before = _snapshot(root)
    log = str(tmp_path / "rank{}.log")
    codes = run_pretrain([*RUN, "--train-iters", "4", "--zero-stage", "1", "--load", str(root),
                          "--save", str(tmp_path / "save")], 2, log, timeout=120)
    assert codes == [1, 1], codes
    logs = "".join(Path(log.format(r)).read_text() for r in range(2))
    lines = [ln for ln in logs.splitlines() if "refused to build" in ln]
    assert len(lines) == 1 and f"{os.system.__module__}.system" in lines[0] and str(root / "iter_0000002") in lines[0]
    assert "Traceback" not in logs and not (work / "marker-common").exists()
    assert _snapshot(root) == before and not list((tmp_path / "save").glob("iter_*"))


# ---- Megatron-LM files (written by our torch_dist writer and laid out by hand; Megatron-Core's own in
# ---- test_megatron_interop.py) ------------------------------------------------------------------------------------
CFG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=16,
                  max_position_embeddings=16, vocab_size=100, hidden_dropout=0.0, attention_dropout=0.0)


def _megatron(root: Path, where: str, marker: Path) -> Path:
    from megareshard.checkpoint.megatron import our_shape, sources
    g = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(our_shape(name, CFG), generator=g) for name in sources(CFG)}
    args = argparse.Namespace(**args_from_model_config(CFG, 1, None))
    if where == "legacy":
        d = root / "iter_0000010" / "mp_rank_00"
        d.mkdir(parents=True)
        torch.save({"args": args, "iteration": 10, "rng_state": Plant(marker)}, d / "model_optim_rng.pt")
        (root / "latest_checkpointed_iteration.txt").write_text("10")
        return d / "model_optim_rng.pt"
    t, o = to_megatron(weights, CFG, tp=1)
    write_torch_dist(str(root), 10, t, o, {"args": args, "checkpoint_version": 3.0, "iteration": 10})
    planted = root / "iter_0000010" / where
    if where == ".metadata":
        planted.write_bytes(pickle.dumps(Plant(marker)))
    else:
        torch.save({"args": args, "iteration": 10, "checkpoint_version": Plant(marker)}, planted)
    return planted


@pytest.mark.parametrize("where", [".metadata", "common.pt", "legacy"])
def test_megatron_checkpoints_refuse_planted_pickles(where, tmp_path):
    marker = tmp_path / "marker"
    planted = _megatron(tmp_path / "meg", where, marker)
    before = _snapshot(tmp_path / "meg")
    flags = hf_map.megatron_flags(CFG)
    code, err = _main("pretrain_gpt", ["--mock-data", *flags, "--seq-length", "16", "--micro-batch-size", "2",
                                       "--global-batch-size", "4", "--lr", "1e-3", "--lr-warmup-iters", "0",
                                       "--device", "cpu", "--train-iters", "2", "--load", str(tmp_path / "meg"),
                                       "--save", str(tmp_path / "save")])
    _assert_refused(code, err, marker, str(planted))
    code, err = _main_tool(load_tool(), ["import-megatron", str(tmp_path / "meg"), str(tmp_path / "ours")])
    _assert_refused(code, err, marker, str(planted))
    assert _snapshot(tmp_path / "meg") == before
    assert not (tmp_path / "ours").exists() and not list((tmp_path / "save").glob("iter_*"))


def test_real_checkpoint_reads_as_before(ours):
    """The unplanted checkpoint: every tensor and object read through the data-only reader equals what DCP's
    own reader gives (torch.load of everything, as before this reader existed), bit for bit."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    work, _ = ours
    ckpt = work / "real" / (work / "real" / "latest").read_text().strip()
    pieces, objects = _read_all(ckpt)
    dcp_to_torch_save(str(ckpt), str(work / "all.pt"))
    reference = torch.load(work / "all.pt", weights_only=False)     # our own file, written just now
    assert set(reference) == set(pieces) | set(objects)
    for k, p in pieces.items():
        assert torch.equal(p.tensor, reference[k]), k
    assert objects["common"] == reference["common"]
    assert all(torch.equal(a, b) for a, b in zip(objects["rng.rank0"]["torch"], reference["rng.rank0"]["torch"])) \
        if isinstance(objects["rng.rank0"], dict) and "torch" in objects["rng.rank0"] else True
    assert read_info(str(ckpt))["iteration"] == 2

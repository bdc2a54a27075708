"""NCCL's rules, checked on gloo: a recording mode for every torch.distributed call.

NCCL (the GPU backend this framework targets) differs from gloo in three ways that a
CPU-only test suite would never notice:

1. point-to-point messages between two ranks pair up **in issue order**; tags are ignored;
2. every member of a communicator must issue the **same collectives in the same order**;
3. a communicator is driven from **one thread** (concurrent calls from several threads on
   one communicator are undefined behaviour).

With ``MEGARESHARD_NCCL_CHECK=DIR`` in the environment (or ``install(DIR)``), every
torch.distributed operation issued in this process goes through a recorder that

* forces every point-to-point tag to 0 (so gloo pairs messages exactly as NCCL would: by
  issue order per (group, sender, receiver));
* records, per process group, the operations this rank issues — kind, peer or root,
  element count, dtype, and a label the caller may attach with ``label(...)`` (the
  resharding executor labels each message with its edge, run, task and message index);
* records which operations were issued as one group (``batch_isend_irecv``, NCCL's
  ncclGroupStart/End): ``batches(DIR)`` counts them per rank and group;
* raises ``NcclRuleViolation`` at once when a group is driven from a second thread.

Each rank writes its record to ``DIR/rank{N}.json`` (``dump()``, also at interpreter exit);
``check_logs(DIR)`` then compares the ranks' records and returns every violation:

* a collective sequence that differs between two members of a group;
* a point-to-point message that pairs with the wrong one: the k-th send from x to y in a
  group must equal the k-th receive at y from x (count, dtype and label), and every send
  has its receive.

``python -m megareshard.parallel.nccl_check DIR`` prints the verdict (exit 1 on violations).

A group outside torch's registry (a weight transfer's group joined across jobs through a rendezvous of its own,
``megareshard.resharding.weight_transfer.group``) is announced with ``register_group``: its operations go to a
record of their own, ``DIR/group-NAME/rank{K}.json`` in the group's ranks, which ``check_logs`` reads like any
other once every member's record is in that directory (two jobs: copy both jobs' files there).
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["ENV", "NcclRuleViolation", "install", "maybe_install", "installed", "label", "set_label",
           "set_op_labels", "dump", "check_logs", "batches", "recorded_batches", "register_group", "op_batch"]

ENV = "MEGARESHARD_NCCL_CHECK"
"""Environment variable: a directory for the per-rank records; set it to turn the checking mode on."""

_P2P = ("isend", "irecv", "send", "recv")
_COLLECTIVES = ("broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
                "all_to_all_single", "barrier", "monitored_barrier", "gather", "scatter", "all_gather_object",
                "broadcast_object_list", "gather_object", "scatter_object_list")


class NcclRuleViolation(RuntimeError):
    """An operation that NCCL would pair wrongly, order differently, or see from two threads."""


class _Recorder:
    """This process's record: per group name, the operations issued, and the issuing thread."""

    def __init__(self, log_dir: str, rank: int | None = None, world: int | None = None) -> None:
        self.log_dir = log_dir
        self.rank, self.world = rank, world  # None: this process's default group's (a joined group's: its own)
        self.joined: dict[Any, _Recorder] = {}  # a group outside torch's registry -> its own record
        self.ops: dict[str, list[list[Any]]] = defaultdict(list)
        self.groups: dict[str, list[int]] = {}
        self.owner: dict[str, tuple[int, str]] = {}  # group -> (thread ident, thread name)
        self.batches: dict[str, list[list[int]]] = defaultdict(list)  # group -> [first op index, op count]
        self.violations: list[str] = []
        self.lock = threading.Lock()
        self.local = threading.local()
        self.originals: dict[tuple[Any, str], Callable] = {}
        self.depth = threading.local()  # object collectives call other collectives: record the outer one

    # ---- what is recorded ---------------------------------------------------------------------
    def group_name(self, group: Any) -> str:
        g = group if group is not None else c10d._get_default_group()
        name = getattr(g, "group_name", None) or str(id(g))
        if name not in self.groups:
            try:
                self.groups[name] = list(dist.get_process_group_ranks(g))
            except Exception:  # pragma: no cover - a group this rank is not in
                self.groups[name] = []
        return name

    def of(self, group: Any) -> "_Recorder":
        """The record ``group``'s operations go to: its own for a joined group, else this one."""
        return self.joined.get(group, self) if group is not None else self

    def record(self, group: Any, entry: list[Any]) -> None:
        sub = self.of(group)
        if sub is not self:
            sub.record(group, entry)
            return
        name = self.group_name(group)
        me = threading.current_thread()
        with self.lock:
            owner = self.owner.setdefault(name, (me.ident, me.name))
            if owner[0] != me.ident:
                msg = (f"rank {self.my_rank()}: group {name} (ranks {self.groups[name]}) driven from thread "
                       f"{me.name!r} after thread {owner[1]!r}: {entry[0]} {entry[1:]}")
                self.violations.append(msg)
                raise NcclRuleViolation(msg)
            queued = getattr(self.local, "op_labels", None)
            text = queued.pop(0) if queued else getattr(self.local, "label", None)
            self.ops[name].append(entry + [text])

    def my_rank(self) -> int:
        return self.rank if self.rank is not None else dist.get_rank()

    def dump(self) -> str:
        for sub in list(self.joined.values()):
            sub.dump()
        if self.rank is None and not dist.is_initialized():
            return ""
        path = Path(self.log_dir, f"rank{self.my_rank()}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        with self.lock:
            world = self.world if self.world is not None else dist.get_world_size()
            data = {"rank": self.my_rank(), "world": world, "groups": self.groups,
                    "ops": self.ops, "batches": self.batches, "violations": self.violations}
            path.write_text(json.dumps(data))
        return str(path)


_STATE: dict[str, _Recorder] = {}  # the one recorder of this process, once installed (a debug mode, like TORCH_DISTRIBUTED_DEBUG)


def installed() -> bool:
    return "rec" in _STATE


def _numel(t: Any) -> int | None:
    return int(t.numel()) if isinstance(t, torch.Tensor) else None


def _dtype(t: Any) -> str | None:
    return str(t.dtype).replace("torch.", "") if isinstance(t, torch.Tensor) else None


def _global_peer(group: Any, peer: int | None, group_peer: int | None) -> int:
    if peer is not None:
        return int(peer)
    g = group if group is not None else c10d._get_default_group()
    return int(dist.get_global_rank(g, group_peer))


def _wrap_p2p(rec: _Recorder, name: str, orig: Callable) -> Callable:
    peer_kw, gpeer_kw = ("dst", "group_dst") if name in ("isend", "send") else ("src", "group_src")
    kind = "send" if name in ("isend", "send") else "recv"

    def wrapper(tensor, *args, **kwargs):
        names = (peer_kw, "group", "tag", gpeer_kw)
        bound = dict(zip(names, args))
        bound.update(kwargs)
        bound["tag"] = 0  # NCCL ignores tags: pair by issue order only
        group = bound.get("group")
        if rec.of(group) is not rec:  # a joined group: its record is in its own ranks
            peer = int(bound[gpeer_kw] if bound.get(gpeer_kw) is not None else bound[peer_kw])
        else:
            peer = _global_peer(group, bound.get(peer_kw), bound.get(gpeer_kw))
        rec.record(group, [kind, peer, _numel(tensor), _dtype(tensor)])
        return orig(tensor, **bound)

    wrapper.__wrapped__ = orig
    return wrapper


def _wrap_collective(rec: _Recorder, name: str, orig: Callable) -> Callable:
    import inspect

    params = list(inspect.signature(orig).parameters)
    gpos = params.index("group") if "group" in params else None  # every collective names it "group"

    def wrapper(*args, **kwargs):
        depth = getattr(rec.depth, "n", 0)
        if depth == 0:
            group = kwargs.get("group")
            if group is None and gpos is not None and len(args) > gpos:
                group = args[gpos]
            first = args[0] if args else next(iter(kwargs.values()), None)
            root = kwargs.get("src", kwargs.get("dst"))
            if root is None and name in ("broadcast", "reduce", "gather", "scatter") and len(args) > 1:
                root = args[1]
            obj = name.endswith("_object") or name.endswith("_object_list")
            # an all-to-all's sizes differ per rank by design (split sizes): its kind and dtype must match
            sized = not obj and not name.startswith("all_to_all")
            rec.record(group, [name, root, _numel(first) if sized else None, None if obj else _dtype(first)])
        rec.depth.n = depth + 1
        try:
            return orig(*args, **kwargs)
        finally:
            rec.depth.n = depth

    wrapper.__wrapped__ = orig
    return wrapper


def _wrap_batch(rec: _Recorder, orig: Callable) -> Callable:
    """``batch_isend_irecv``: its operations are recorded one by one (the wrapped isend/irecv it calls),
    and the group they formed as (index of the first, count) in the group's record."""

    def wrapper(p2p_op_list, *args, **kwargs):
        group = p2p_op_list[0].group if p2p_op_list else None
        with _batch(rec, group):
            return orig(p2p_op_list, *args, **kwargs)

    wrapper.__wrapped__ = orig
    return wrapper


@contextlib.contextmanager
def _batch(rec: _Recorder, group: Any) -> Iterator[None]:
    sub = rec.of(group)
    name = sub.group_name(group)
    with sub.lock:
        first = len(sub.ops[name])
    yield
    with sub.lock:
        sub.batches[name].append([first, len(sub.ops[name]) - first])


@contextlib.contextmanager
def op_batch(group: Any) -> Iterator[None]:
    """The operations issued inside the block on ``group`` went out as one group (what ``batch_isend_irecv``
    records by itself; for a joined group, which it cannot take). A no-op when the mode is off."""
    rec = _STATE.get("rec")
    if rec is None:
        yield
        return
    with _batch(rec, group):
        yield


def register_group(group: Any, name: str, rank: int, world: int) -> None:
    """Record ``group`` — a process group outside torch's registry, ``world`` ranks, this process ``rank`` in it —
    in a record of its own (``DIR/group-NAME/``, in the group's ranks). A no-op when the mode is off."""
    rec = _STATE.get("rec")
    if rec is None:
        return
    sub = _Recorder(str(Path(rec.log_dir, f"group-{name}")), rank, world)
    sub.groups[getattr(group, "group_name", None) or str(id(group))] = list(range(world))
    rec.joined[group] = sub


def install(log_dir: str) -> None:
    """Route every torch.distributed operation of this process through the recorder (idempotent)."""
    if installed():
        return
    rec = _Recorder(log_dir)
    for mod in (dist, c10d):
        for name in _P2P + _COLLECTIVES:
            orig = getattr(mod, name, None)
            if orig is None:
                continue
            base = getattr(orig, "__wrapped__", orig)
            make = _wrap_p2p if name in _P2P else _wrap_collective
            key = (mod, name)
            rec.originals[key] = orig
            # one wrapper per function object, shared by both modules (batch_isend_irecv checks `op is isend`)
            shared = rec.originals.get(("wrapper", name))
            if shared is None or getattr(shared, "__wrapped__", None) is not base:
                shared = make(rec, name, base)
                rec.originals[("wrapper", name)] = shared
            setattr(mod, name, shared)
        orig = getattr(mod, "batch_isend_irecv", None)
        if orig is not None:
            rec.originals[(mod, "batch_isend_irecv")] = orig
            shared = rec.originals.get(("wrapper", "batch_isend_irecv"))
            if shared is None:
                shared = rec.originals[("wrapper", "batch_isend_irecv")] = _wrap_batch(
                    rec, getattr(orig, "__wrapped__", orig))
            setattr(mod, "batch_isend_irecv", shared)
    _STATE["rec"] = rec
    atexit.register(dump)


def maybe_install() -> bool:
    """Install when ``MEGARESHARD_NCCL_CHECK`` names a directory; True if the mode is on."""
    d = os.environ.get(ENV)
    if d:
        install(d)
    return installed()


@contextlib.contextmanager
def label(text: str) -> Iterator[None]:
    """Attach ``text`` to the operations this thread issues inside the block (no-op when not installed)."""
    rec = _STATE.get("rec")
    if rec is None:
        yield
        return
    prev = getattr(rec.local, "label", None)
    rec.local.label = text
    try:
        yield
    finally:
        rec.local.label = prev


def dump() -> str:
    """Write this rank's record (``DIR/rank{N}.json``); returns the path ('' when not installed)."""
    rec = _STATE.get("rec")
    return rec.dump() if rec is not None else ""


# ---- the check (pure: reads the records) --------------------------------------------------------
def check_logs(log_dir: str, max_report: int = 20) -> list[str]:
    """Every violation of NCCL's rules in the per-rank records under ``log_dir`` (empty: all good)."""
    logs = {}
    for p in sorted(Path(log_dir).glob("rank*.json")):
        d = json.loads(p.read_text())
        logs[d["rank"]] = d
    if not logs:
        return [f"no records under {log_dir} (was {ENV} set in every rank?)"]
    out: list[str] = []
    world = max(d["world"] for d in logs.values())
    missing = sorted(set(range(world)) - set(logs))
    if missing:
        out.append(f"ranks {missing} wrote no record")
    for d in logs.values():
        out += d["violations"]
    groups: dict[str, list[int]] = {}
    for d in logs.values():
        groups.update(d["groups"])
    for g, members in sorted(groups.items()):
        # collectives: the same sequence on every member
        seqs = {r: [op for op in logs[r]["ops"].get(g, []) if op[0] not in ("send", "recv")]
                for r in members if r in logs}
        if seqs:
            ref_rank = min(seqs)
            ref = seqs[ref_rank]
            for r, s in seqs.items():
                if s != ref:
                    k = next((i for i, (a, b) in enumerate(zip(s, ref)) if a != b), min(len(s), len(ref)))
                    out.append(f"group {g} (ranks {members}): rank {r}'s collective #{k} "
                               f"{s[k] if k < len(s) else 'missing'} differs from rank {ref_rank}'s "
                               f"{ref[k] if k < len(ref) else 'missing'} ({len(s)} vs {len(ref)} collectives)")
        # point-to-point: the k-th send x->y pairs with the k-th receive at y from x
        sends: dict[tuple[int, int], list] = defaultdict(list)
        recvs: dict[tuple[int, int], list] = defaultdict(list)
        for r in members:
            for op in logs.get(r, {"ops": {}})["ops"].get(g, []):
                if op[0] == "send":
                    sends[(r, op[1])].append(op[2:])
                elif op[0] == "recv":
                    recvs[(op[1], r)].append(op[2:])
        for pair in sorted(set(sends) | set(recvs)):
            s, rv = sends.get(pair, []), recvs.get(pair, [])
            for k in range(max(len(s), len(rv))):
                a = s[k] if k < len(s) else None
                b = rv[k] if k < len(rv) else None
                if a != b:
                    out.append(f"group {g}: message #{k} from rank {pair[0]} to rank {pair[1]} pairs send {a} "
                               f"with receive {b} (count, dtype, label)")
                    break
        if len(out) >= max_report:
            break
    return out[:max_report]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m megareshard.parallel.nccl_check DIR", file=sys.stderr)
        return 2
    bad = check_logs(argv[0])
    for line in bad:
        print(line)
    n_ops = sum(len(v) for p in Path(argv[0]).glob("rank*.json") for v in json.loads(p.read_text())["ops"].values())
    print(f"nccl_check: {n_ops} operations recorded, {'no violations' if not bad else f'{len(bad)} violation(s)'}")
    return 1 if bad else 0


def set_label(text: str | None) -> None:
    """Label the operations this thread issues from now on (cheap no-op when not installed)."""
    rec = _STATE.get("rec")
    if rec is not None:
        rec.local.label = text


def set_op_labels(texts: list[str] | None) -> None:
    """Label this thread's next operations one each, in order (a group issued by one call, whose operations
    belong to different messages); then ``set_label``'s label again. Cheap no-op when not installed."""
    rec = _STATE.get("rec")
    if rec is not None:
        rec.local.op_labels = list(texts) if texts else None


def recorded_batches() -> list[int]:
    """This process's operation groups so far (their sizes, every communicator, in the order recorded per
    communicator); empty when the checking mode is off."""
    rec = _STATE.get("rec")
    if rec is None:
        return []
    with rec.lock:
        return [n for b in rec.batches.values() for _, n in b]


def batches(log_dir: str) -> dict[int, dict[str, list[int]]]:
    """Per rank and group: the sizes of the operation groups it issued (``batch_isend_irecv``), in order."""
    out: dict[int, dict[str, list[int]]] = {}
    for p in sorted(Path(log_dir).glob("rank*.json")):
        d = json.loads(p.read_text())
        out[d["rank"]] = {g: [n for _, n in b] for g, b in d.get("batches", {}).items()}
    return out


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

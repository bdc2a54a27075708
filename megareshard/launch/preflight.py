"""Pre-flight at start-up: did every rank join, where is each one, is the placement sane?

``init_process_group`` on its own either hangs until its (long) timeout or fails with an
error that names nobody when a node never started. We rendezvous through the same TCP
store first: every rank registers (host, local rank, pid), every rank waits for all
registrations up to a deadline, and a miss is reported by rank and by host. The process
group is then built on that store, so nothing is dialled twice.
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ..parallel.topology import Topology


class PreflightError(RuntimeError):
    """Ranks missing at start-up, or a rendezvous that cannot be reached."""


@dataclass(frozen=True)
class RankInfo:
    rank: int
    host: str
    local_rank: int
    pid: int


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise PreflightError(f"environment variable {name} is not set: launch with torchrun (or set RANK, "
                             "WORLD_SIZE, MASTER_ADDR, MASTER_PORT yourself)")
    return int(value)


def _store(addr: str, port: int, rank: int, world: int, timeout_s: float) -> dist.TCPStore:
    # Same rule as torch's env:// rendezvous: under torchrun the agent already hosts the store.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        return dist.TCPStore(addr, port, world, is_master=(rank == 0 and not agent_store),
                             timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
                             multi_tenant=not agent_store)
    except (RuntimeError, TimeoutError) as e:
        raise PreflightError(f"rank {rank} could not reach the rendezvous store at {addr}:{port} within "
                             f"{timeout_s:.0f}s ({e}); is node 0 running and MASTER_ADDR/MASTER_PORT right?") from e


def preflight_rendezvous(backend: str, timeout_s: float = 300.0, comm_timeout_s: float = 600.0) -> list[RankInfo]:
    """Register, wait for every rank (naming the missing ones on timeout), then init the process group."""
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), _env_int("MASTER_PORT")
    store = _store(addr, port, rank, world, timeout_s)
    # restarts reuse the agent's store: keep each attempt's keys apart
    prefix = f"megareshard/preflight/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    me = RankInfo(rank, socket.gethostname(), int(os.environ.get("LOCAL_RANK", "0")), os.getpid())
    store.set(prefix + str(rank), json.dumps(me.__dict__))
    keys = [prefix + str(r) for r in range(world)]
    hosting = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            present = [r for r, k in enumerate(keys) if store.check([k])]
            if len(present) == world:
                break
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(present))
                joined: dict[str, list[int]] = {}
                for r in present:
                    joined.setdefault(json.loads(store.get(keys[r]))["host"], []).append(r)
                where = "; ".join(f"{h}: ranks {_ranges(rs)}" for h, rs in sorted(joined.items()))
                if hosting:  # keep the store up a moment so the other ranks can report too
                    time.sleep(min(3.0, timeout_s))
                raise PreflightError(f"{len(missing)} of {world} ranks did not join within {timeout_s:.0f}s: "
                                     f"missing ranks {_ranges(missing)}; joined: {where}. Did every node start, "
                                     "with the same --nnodes and --nproc-per-node?")
            time.sleep(0.05)
    except dist.DistError as e:
        raise PreflightError(f"rank {rank} lost the rendezvous store at {addr}:{port} while waiting for the other "
                             f"ranks ({e}); rank 0 stopped first — its log says why") from e
    infos = [RankInfo(**json.loads(store.get(k))) for k in keys]
    # per attempt too: a restarted job must not read the previous attempt's gloo addresses
    dist.init_process_group(backend, store=dist.PrefixStore(prefix + "pg", store), rank=rank, world_size=world,
                            timeout=timedelta(seconds=comm_timeout_s))
    return infos


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(f"{start}-{r}" if r != start else f"{r}")
            start = None
    return ", ".join(out)


def rank_map_table(infos: list[RankInfo], topo: Topology, experts: tuple[int, ...] | None = None) -> str:
    """One line per host: which ranks it runs and each one's (pp stage, tp, dp) coordinates; with ``experts``
    (ep, etp) or (ep, etp, num_experts) of an MoE run also its expert coordinates (etp, ep, edp:
    parallel/expert_topology.py) and, given the number of experts, which experts it holds."""
    from ..parallel.expert_topology import expert_coords

    by_host: dict[str, list[RankInfo]] = {}
    for info in infos:
        by_host.setdefault(info.host, []).append(info)
    title = topo.describe()
    per = None
    if experts:
        ep, etp = experts[0], experts[1]   # etp None: each stage's tp (per-stage layouts)
        if getattr(topo, "per_stage", False):
            title += f"; experts ep {ep} × etp {etp if etp is not None else 'the stage tp'} in each stage"
        else:
            title += f"; experts ep {ep} × etp {etp} × edp {max(topo.tp * topo.dp // (ep * etp), 1)}"
        if len(experts) > 2 and experts[2]:
            per = experts[2] // ep
            title += f", {experts[2]} per MoE layer, {per} per rank"
    lines = [f"rank map ({title}):"]
    for host, members in by_host.items():
        cells = []
        for info in sorted(members, key=lambda i: i.rank):
            c = topo.coords(info.rank)
            extra = ""
            if experts:
                e = expert_coords(topo, info.rank, experts[0], experts[1])
                extra = f" ep{e['ep']} etp{e['etp']} edp{e['edp']}"
                if per:
                    extra += f" experts {e['ep'] * per}" + (f"-{(e['ep'] + 1) * per - 1}" if per > 1 else "")
            cells.append(f"r{info.rank}[pp{c.pp} tp{c.tp} dp{c.dp}{extra}]")
        lines.append(f"  {host}: " + " ".join(cells))
    return "\n".join(lines)


def tp_placement_warnings(infos: list[RankInfo], topo: Topology) -> list[str]:
    """Tensor-parallel groups that span real hosts (their traffic is the heaviest: 8·b·s·h per layer)."""
    host = {i.rank: i.host for i in infos}
    warnings = []
    for group in topo.groups("tp"):
        hosts = sorted({host[r] for r in group})
        if len(hosts) > 1:
            warnings.append(f"tensor-parallel group {list(group)} spans hosts {', '.join(hosts)}: its all-reduces "
                            f"cross the network; make tp {topo.tp} divide the processes per node and keep tp "
                            "innermost in --rank-order")
    per_host = {}
    for i in infos:
        per_host[i.host] = per_host.get(i.host, 0) + 1
    if len(set(per_host.values())) > 1:
        warnings.append("hosts run different numbers of ranks: " +
                        ", ".join(f"{h} {n}" for h, n in sorted(per_host.items())))
    return warnings

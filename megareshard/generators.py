"""Generator replicas in the same job as the trainer (issue #50): ``--generator-layouts tp2,tp1`` dedicates the
LAST ranks of the launch to one replica per entry, each at its tp (an MoE model's experts split inside those
ranks over ``epM`` / ``etpK``: `config.generators.ReplicaLayout`); the trainer keeps the first ranks
(world = trainer ranks + the sum of the generators' tp). After every ``--transfer-interval`` optimizer steps
(and after the last one) the trainer's weights move to every replica by a planned weight transfer
(`megareshard.transfer`, planned once and cached); the replicas then continue ``--generator-prompts`` greedily
with a key/value cache and tensor parallelism (`generation_kv.py`) and print::

    generator tp2 (step 3): 'def main(' -> 'self, x):\\n    return'

**Process groups.** Every rank of the launch creates, in one order, the trainer's group (ranks ``[0, T)``),
each replica's tp group and, for a replica that splits an MoE model's experts otherwise than Megatron's default
(``tp4ep2``: ep 2 · etp 2 inside its 4 tp ranks), that replica's expert groups. On a trainer rank the trainer's
group is then the *default* group for the whole run
(``dist.get_world_size()`` is T, every group the trainer creates is made inside it, under its own store prefix),
so the trainer runs unchanged on its ranks, and the launch's world group carries only this module's traffic:

* a control broadcast from rank 0 before each action (``[kind, iteration]``: plan, transfer or stop), so that the
  generators follow whatever the trainer does (a resume, an early exit, no training at all); a generator waits for
  it on the launch's store, where rank 0 announces each one (`_control`);
* the transfer's own construction (object all-gathers) and runs (point-to-point plus one all-reduce).

Both sides issue these in the same order (NCCL's rules). The trainer waits only for the transfer: a generator
samples after it, and the next collective it meets is the next control broadcast, which the trainer issues
after its next N steps. A transfer's report (bytes, seconds, rate, fraction of the network bound) goes into the
step's record (``transfer_*`` fields: the metrics file) and onto its log line.

**A rank that dies** is a peer failure on both sides: the control broadcasts, the planning and the transfers are
watchdog activities on the trainer's ranks (the trainer's watchdog) and on the generators' (one of their own; the
wait for the trainer's next message and the planning have no time limit, a transfer and its sampling
``--comm-timeout``), so every
survivor ends with the watchdog's one line naming its rank, what it was doing and that a peer died (exit 1),
whichever side died. The transfer only reads the trainer's weights, and a step whose transfer failed is not
saved: the newest complete checkpoint is the last step before it, as the trainer alone would have saved it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, TextIO

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .checkpoint.lock import lock_save_dir
from .config import Config
from .config.generators import parse_generator_layouts
from .config_fields import ConfigError
from .generation_kv import greedy_kv
from .inputs import resolve_vocab
from .launch import PeerFailure, Watchdog, is_communication_error
from .models import GPTModel
from .models.moe import route_dropless
from .parallel import ParallelContext
from .parallel.expert_topology import expert_groups
from .parallel.topology import Topology
from .transfer import Destination, WeightTransfer

__all__ = ["GeneratorLaunch", "split_launch", "pretrain_with_generators", "read_prompts", "transfer_observers"]

STOP, PLAN, PUSH = 0, 1, 2

#: fn(event) on every generator rank after each transfer and its sampling (tests): event holds ``step``, ``replica``
#: (its index), ``tp``, ``tp_rank``, ``model`` (the replica's GPTModel), ``samples`` ([(prompt ids, all ids)]),
#: ``report`` (the transfer's)
transfer_observers: list[Callable[[dict[str, Any]], None]] = []

DEFAULT_PROMPTS = ("def main(", "import os\n", "class ")
DEFAULT_ID_PROMPTS = ("1 2 3", "7 8 9 10")


@dataclass
class GeneratorLaunch:
    """How a launch is split: the trainer's ranks ``[0, trainer)`` and the replicas on the last ones."""

    world: int
    trainer: int
    replicas: list[Destination]
    world_group: Any                 # the launch's default group: the transfer's and the control's
    trainer_group: Any               # ranks [0, trainer) (NON_GROUP_MEMBER elsewhere)
    tp_groups: list[Any]             # each replica's tp group (None for tp 1; NON_GROUP_MEMBER elsewhere)
    rank: int
    store: Any = None                # the launch's rendezvous store (the control messages' announcements)
    controls: int = 0                # control messages so far
    # this rank's expert groups, if its replica splits an MoE model's experts otherwise than ep 1 · etp tp:
    # family -> (group or None for one rank, members as replica-local ranks)
    expert_groups: dict[str, tuple[Any, tuple[int, ...]]] = dataclasses.field(default_factory=dict)

    @property
    def replica_index(self) -> int | None:
        return next((i for i, d in enumerate(self.replicas) if self.rank in d.ranks), None)

    def name(self, i: int) -> str:
        label = _label(self.replicas[i])
        same = [d for d in self.replicas if _label(d) == label]
        return f"generator {label}" if len(same) == 1 else f"generator {i} {label}"


def _label(d: Destination) -> str:
    return d.name.split("_", 1)[1]


def split_launch(cfg: Config, world: int) -> GeneratorLaunch:
    """Collective over the launch's (default) group: the trainer's group, each replica's tp group and its expert
    groups (a replica that splits an MoE model's experts otherwise than ep 1 · etp tp), created in the same order
    on every rank."""
    layouts = parse_generator_layouts(cfg.generators.generator_layouts)
    trainer = world - sum(lay.tp for lay in layouts)
    if trainer < 1:
        raise ConfigError(f"--generator-layouts {cfg.generators.generator_layouts} needs "
                          f"{sum(lay.tp for lay in layouts)} ranks for the generators but the launch has {world}")
    replicas, start = [], trainer
    for i, lay in enumerate(layouts):
        replicas.append(Destination(f"gen{i}_{lay.label}", tuple(range(start, start + lay.tp)), tp=lay.tp, ep=lay.ep,
                                    etp=None if lay.expert_tp == lay.tp else lay.expert_tp))
        start += lay.tp
    world_group = c10d._get_default_group()
    trainer_group = dist.new_group(list(range(trainer)))
    tp_groups = [dist.new_group(list(d.ranks)) if d.tp > 1 else None for d in replicas]
    rank, mine = dist.get_rank(), {}
    for d in replicas:   # every rank creates every replica's expert groups, in one order (dist.new_group's rule)
        if d.ep == 1 and d.expert_tp == d.tp:
            continue   # the tp group serves: Megatron's default expert layout
        for fam, groups in expert_groups(Topology(d.tp, tp=d.tp, nproc_per_node=d.tp), d.ep, d.expert_tp).items():
            for members in groups:
                handle = dist.new_group([d.ranks[m] for m in members]) if len(members) > 1 else None
                if rank in (d.ranks[m] for m in members):
                    mine[fam] = (handle, members)
    return GeneratorLaunch(world, trainer, replicas, world_group, trainer_group, tp_groups, rank,
                           c10d._get_default_store(), expert_groups=mine)


@contextlib.contextmanager
def _default_group(group):
    """``group`` is the default process group of this process inside the block (the trainer's world)."""
    before = c10d._world.default_pg
    c10d._world.default_pg = group
    try:
        yield
    finally:
        c10d._world.default_pg = before


_IDLE = timedelta(days=7)  # how long a generator may wait for the trainer's next message


def _control(launch: GeneratorLaunch, device: torch.device, kind: int = 0, step: int = 0) -> tuple[int, int]:
    """The control broadcast from rank 0 over the launch: (kind, iteration). Rank 0 announces it on the launch's
    store first, and a generator waits for that before it joins the broadcast: between transfers the trainer may
    train for longer than any collective may take (NCCL's watchdog aborts one past its timeout, --comm-timeout),
    and nothing is posted while it waits. A rank 0 that dies takes the store with it, or the launcher stops all."""
    launch.controls += 1
    key = f"megareshard/generators/control/{launch.controls}"
    if launch.rank == 0:
        launch.store.set(key, "1")
    elif launch.rank >= launch.trainer:
        launch.store.wait([key], _IDLE)
    t = torch.tensor([kind, step], dtype=torch.int64, device=device)
    dist.broadcast(t, src=0, group=launch.world_group)
    k, s = t.tolist()
    return int(k), int(s)


def read_prompts(cfg: Config, tokenizer) -> list[tuple[str, list[int]]]:
    """The prompts (text, ids): --generator-prompts texts separated by |, or a file of one per line; without a
    tokenizer (mock data) each prompt is token ids separated by spaces."""
    g, vocab = cfg.generators, cfg.model.vocab_size
    text = g.generator_prompts
    if text and os.path.isfile(text):
        with open(text, encoding="utf-8") as f:
            texts = [line.rstrip("\n") for line in f if line.strip()]
    elif text:
        texts = [t for t in text.split("|") if t]
    else:
        texts = list(DEFAULT_PROMPTS if tokenizer is not None else DEFAULT_ID_PROMPTS)
    if not texts:
        raise ConfigError(f"--generator-prompts {text!r} holds no prompt")
    out = []
    for t in texts:
        if tokenizer is None:
            if not all(w.isdigit() for w in t.split()) or not t.split():
                raise ConfigError(f"--generator-prompts: without a tokenizer (mock data) a prompt is token ids "
                                  f"separated by spaces, got {t!r}")
            ids = [int(w) for w in t.split()]
        else:
            ids = list(tokenizer.encode(t))
        if not ids:
            raise ConfigError(f"--generator-prompts: {t!r} encodes to no tokens")
        bad = sorted({i for i in ids if not 0 <= i < vocab})
        if bad:
            raise ConfigError(f"--generator-prompts: {t!r} encodes to id(s) {bad[:5]} outside the model's "
                              f"vocabulary of {vocab}")
        out.append((t, ids))
    return out


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids) if tokenizer is not None else " ".join(map(str, ids))


def _replica_context(launch: GeneratorLaunch, i: int) -> ParallelContext:
    """The replica's ParallelContext (local ranks 0..tp-1; its tp group and expert groups the ones `split_launch`
    made)."""
    d = launch.replicas[i]
    local = d.ranks.index(launch.rank)
    ctx = ParallelContext(topology=Topology(d.tp, tp=d.tp, nproc_per_node=d.tp), rank=local)
    every = tuple(range(d.tp))
    for name in ("tp", "mp", "stage", "etp", "etp_ep"):
        ctx.groups[name], ctx.group_ranks[name] = launch.tp_groups[i], every
    for name in ("pp", "dp", "ep", "edp"):
        ctx.groups[name], ctx.group_ranks[name] = None, (local,)
    ctx.groups["embedding"], ctx.group_ranks["embedding"] = None, (local,)
    for name, (group, members) in launch.expert_groups.items():   # experts split over ep × etp in the tp ranks
        ctx.groups[name], ctx.group_ranks[name] = group, members
    return ctx


def _serve(cfg: Config, launch: GeneratorLaunch, device: torch.device, out: TextIO) -> None:
    """A generator rank: follow the trainer's control messages; after each transfer sample every prompt. A peer
    that dies ends it with its watchdog's line (a `PeerFailure`), as on the trainer's ranks."""
    dog = Watchdog(cfg.launch.comm_timeout, launch.rank)
    try:
        _serve_watched(cfg, launch, device, out, dog)
    except BaseException as e:
        if dog.failure is not None and not isinstance(e, PeerFailure):
            raise PeerFailure(dog.failure) from None
        raise
    finally:
        dog.stop()


def _serve_watched(cfg: Config, launch: GeneratorLaunch, device: torch.device, out: TextIO, dog: Watchdog) -> None:
    i = launch.replica_index
    d, me = launch.replicas[i], launch.name(i)
    everyone = f"collective over all {launch.world} ranks of the launch"
    cfg, tokenizer = resolve_vocab(cfg)
    prompts = read_prompts(cfg, tokenizer)
    ctx = _replica_context(launch, i)
    mem = cfg.memory
    dtype = torch.bfloat16 if mem.bf16 else torch.float16 if mem.fp16 else torch.float32
    wt = model = None
    while True:
        with dog.activity(f"{me}: waiting for the trainer's next control message (broadcast from rank 0, "
                          f"{everyone})", timed=False):  # the trainer trains meanwhile: no time limit
            kind, step = _control(launch, device)
        if kind == STOP:
            return
        if kind == PLAN:
            with dog.activity(f"{me}: planning the weight transfer ({everyone})", timed=False):  # a big plan: long
                wt = WeightTransfer(launch.replicas, group=launch.world_group,
                                    bucket_mb=cfg.generators.transfer_bucket_mb)
            mcfg = dataclasses.replace(wt.model_config, hidden_dropout=0.0, attention_dropout=0.0)
            model = GPTModel(mcfg, ctx, seed=cfg.training.seed, device=device, params_dtype=dtype).eval()
            route_dropless(model)   # MoE: no capacity at inference, as Megatron-Core's inference router
            continue
        with dog.activity(f"{me}: weight transfer after iteration {step} ({everyone})"):
            report = wt.run(into=model)
        samples = []
        with dog.activity(f"{me}: sampling after iteration {step} (its tp group, ranks {list(d.ranks)})"):
            for text, ids in prompts:
                full = greedy_kv(model, ids, max_new_tokens=cfg.generators.generator_max_new_tokens)
                samples.append((ids, full))
                if ctx.tp_rank() == 0:
                    print(f"{me} (step {step}): {text!r} -> {_decode(tokenizer, full[len(ids):])!r}",
                          file=out, flush=True)
        for fn in transfer_observers:
            fn({"step": step, "replica": i, "tp": d.tp, "tp_rank": ctx.tp_rank(), "model": model,
                "samples": samples, "report": report})


class _TrainerSide:
    """A trainer rank's part: plan the transfer once the trainer is built, push after every N-th step."""

    def __init__(self, cfg: Config, launch: GeneratorLaunch, device: torch.device, out: TextIO) -> None:
        self.cfg, self.launch, self.device, self.out = cfg, launch, device, out
        self.wt: WeightTransfer | None = None

    def prepare(self, trainer) -> None:
        g = self.cfg.generators
        # untimed: planning a big model's transfer may outlast --comm-timeout; its errors are still reported
        with trainer._activity(f"planning the weight transfer to the generators ({self._everyone})", timed=False):
            _control(self.launch, self.device, PLAN, trainer.iteration)
            self.wt = WeightTransfer(self.launch.replicas, model=trainer.model, ctx=trainer.ctx,
                                     optimizer=trainer.optimizer, group=self.launch.world_group,
                                     bucket_mb=g.transfer_bucket_mb)
        if self.launch.rank == 0:
            p = self.wt.plan
            names = ", ".join(f"{self.launch.name(i)} on ranks {list(d.ranks)}"
                              for i, d in enumerate(self.launch.replicas))
            print(f"megareshard: weight transfer to {names} after every {g.transfer_interval} step(s): "
                  f"{p.wire_bytes / 2**20:.2f} MiB on the wire in {len(p.buckets)} bucket(s) of <= "
                  f"{g.transfer_bucket_mb:g} MiB, {p.num_steps} step(s)", file=self.out, flush=True)
        trainer.step_end_actions.append(self.after_step)

    def after_step(self, trainer, rec: dict[str, Any]) -> None:
        it, last = trainer.iteration, trainer.cfg.training.train_iters
        if it % self.cfg.generators.transfer_interval and it != last:
            return
        self.wt.refresh_sources(trainer.model, trainer.ctx, trainer.optimizer)
        with trainer._activity(f"weight transfer after iteration {it} ({self._everyone})"):
            _control(self.launch, self.device, PUSH, it)
            r = self.wt.run()
        rec.update(transfer_bytes=r["bytes"], transfer_s=r["seconds"], transfer_gbps=r["rate_gbps"],
                   transfer_bound_s=r["bound_s"], transfer_bound_fraction=r["bound_fraction"])

    @property
    def _everyone(self) -> str:
        return f"collective over all {self.launch.world} ranks of the launch"

    def finish(self) -> None:
        """Tell the generators to stop (after the trainer's watchdog stopped: a dead peer is reported here)."""
        try:
            _control(self.launch, self.device, STOP, -1)
        except Exception as e:
            if not is_communication_error(e):
                raise
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise PeerFailure(f"rank {self.launch.rank}: 'telling the generators to stop ({self._everyone})' failed: "
                              f"{type(e).__name__}: {first} (a peer rank died, stalled or lost its network)") from None


def _trainer_nproc(trainer: int) -> str | None:
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is None or trainer % int(local) == 0:
        return local
    return str(trainer if trainer < int(local) else math.gcd(trainer, int(local)))


def pretrain_with_generators(cfg: Config, out: TextIO, model_spec, device: torch.device, world: int, infos: list,
                             run_trainer: Callable[..., list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """``pretrain`` of a launch with --generator-layouts (called by `training.pretrain` after the process group
    is up): the trainer ranks run ``run_trainer`` (``training._pretrain``) on their own world with the transfer
    as a step-end action; the generator ranks serve. Returns the trainer's records ([] on a generator)."""
    if model_spec is not None and getattr(model_spec, "name", "gpt") != "gpt":
        raise ConfigError(f"--generator-layouts needs the GPT model (pretrain_gpt.py); this run trains "
                          f"{model_spec.name!r}")
    if world < 2 or not dist.is_initialized():
        raise ConfigError(f"--generator-layouts {cfg.generators.generator_layouts} needs a distributed launch "
                          f"(the generators take the last ranks), got {world} rank(s)")
    launch = split_launch(cfg, world)
    try:
        if launch.rank >= launch.trainer:
            _serve(cfg, launch, device, out)
            return []
        side = _TrainerSide(cfg, launch, device, out)
        local = _trainer_nproc(launch.trainer)
        before = os.environ.get("LOCAL_WORLD_SIZE")
        save_lock = None
        if local is not None:
            os.environ["LOCAL_WORLD_SIZE"] = local
        try:
            with _default_group(launch.trainer_group):
                # one job per --save; the lock agrees over the trainer's ranks only
                save_lock = lock_save_dir(cfg.checkpoint.save, out) if cfg.checkpoint.save else None
                records = run_trainer(cfg, out, model_spec, device, launch.trainer,
                                      [x for x in infos if x.rank < launch.trainer], side.prepare)
        finally:
            if before is not None:
                os.environ["LOCAL_WORLD_SIZE"] = before
            if save_lock is not None:
                save_lock.release()
        side.finish()
        return records
    finally:
        for g in (launch.trainer_group, *launch.tp_groups, *(h for h, _ in launch.expert_groups.values())):
            if g is not None and g is not dist.GroupMember.NON_GROUP_MEMBER:
                with contextlib.suppress(Exception):
                    dist.destroy_process_group(g)

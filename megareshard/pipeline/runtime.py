"""Pipeline runtime: execute this mesh's lowered action list on every rank of the mesh.

A mesh (the ranks of one pp coordinate) holds one stage, or several (virtual stages: interleaved,
zbv): then the rank holds one model chunk per stage (`chunks.ModelChunks`) and keeps every piece of
state per (stage, microbatch). An edge between two stages of one mesh is a *local hand-off*: no
communication, no action; the consumer's F takes the producer's output detached as a leaf that
requires grad (exactly what a received tensor is), and its B hands the leaf's gradient back as the
producer's received output gradient. Every other edge — the one from the last mesh back to the
first included — is an ordinary cross-mesh resharding edge.

Every rank of a mesh runs the same list (SPMD inside the mesh: its tp collectives line
up because the lists are identical); stage boundaries go through the `EdgeComm`
resharders built once per edge (`comm.py`). What each action does is the contract
written down in `lowering.py`:

=========  ===============================================================================
F(mb)      the model's forward step on mb (``forward_step``, its spec's) for the action's stage:
           stage 0 reads the batch; others the WAIT_F tensors or the local hand-off, made leaves
           that require grad; the last stage's step returns mb's share of the loss, accumulated
           into the reported loss.
SEND_F     start the forward resharder on the output; keep handle and tensor. When the send
           is retired (below) the output's *data* is freed (Megatron's
           ``deallocate_output_tensor``) when no autograd node saved it, keeping only the graph.
RECV_F/B   post what the posting plan puts here (early posting: this receive, non-blocking).
WAIT_F/B   post what the plan puts here, then block on the receive — the only blocking
           communication.
B(mb)      backward from the loss (last stage) or from the WAIT_B gradient; keeps the
           input gradient for SEND_B; releases mb's tensors.
I(mb)      the same with a weight-gradient store *for mb* attached: the weight GEMMs are
           queued, not run. Keying the store by mb makes ``W(mb)`` run exactly mb's work
           whatever order a schedule puts the W's in.
W(mb)      flush mb's store (this is where the weight gradients appear).
SEND_B     start the backward resharder on the input gradient.
=========  ===============================================================================

R          (``--overlap-grad-reduce``) ``grad_reduce_handler(stage)``: the trainer starts the stage's
           data-parallel gradient reduction asynchronously (`grad_reduce.py` places R right after
           the stage's last W, or B); the trainer waits for it before the optimizer step.

**Posting and retiring** (`posting.py`, one plan per program, the same on every rank): every operation is
issued from the thread that runs the schedule — no hand-off — except on communicators where this rank
forwards (`resharding/streams.py`). Under ``--pipeline-recv-posting early`` (gloo's default) a receive is
posted at its RECV; under ``grouped``/``mixed`` (NCCL's) a receive on a communicator that also carries sends
goes out in one group with the last send to the same peer before its WAIT (a compute's sends wait for the
last of them and go together), or at the WAIT; the plan is checked against NCCL's ordering when the program is
built and a schedule that would hang is refused naming the action. No thread waits for sends: gloo reports a
send complete only to a waiter, so a send is waited where its completion is already known — after the first
action that follows, causally, the receiver's WAIT (for an activation, at the latest the WAIT for its
gradient, before its B); the rest at the end of the step. Sent activations are held that long
(``last_stats['sent_held_peak']``, predicted by `posting.held_sends_peak`): on the 1F1B family about as many
as the microbatches in flight.

After the list: without R actions, the ``finalize_grads`` hook (sequence-parallel, data-parallel
and tied-embedding gradient reductions, blocking), then every send not yet retired is waited, then the
loss is summed over the pipeline group so every rank (in particular the logging rank, last
stage tp0 dp0) holds it.

This module holds the runtime's construction (``from_edges``, the programs and their posting plans) and the
loop of one step (``__call__``); what each action does, and the step's state, are `step_actions.py`'s.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..config_fields import ConfigError
from ..parallel import ParallelContext
from .backward import can_free_outputs
from .comm import EdgeComm, EdgeTensor, build_edge_comms, shared_mesh_pairs
from .generators import forward_only, generate
from .grad_reduce import has_grad_reduce, insert_grad_reduce
from .lowering import lower
from .posting import PostingPlan, check_nccl, plan_posting, split_pairs
from .hooks import ActionHook, HookSet, TraceHook, WatchdogHook
from .schedule import Action, Edge, PipelineGraph, Schedule, ScheduleError
from .schedules import ScheduleKind, get_schedule
from .stage import StageLayout
from .step_actions import StepActions, _Step
from .traces import gather_trace, write_trace
from .validate import validate

if TYPE_CHECKING:  # annotations only
    from .plan import PipelinePlan

__all__ = ["PipelineRuntime", "RECV_POSTINGS", "resolve_recv_posting", "gather_trace", "write_trace"]

RECV_POSTINGS = ("auto", "early", "grouped", "mixed")
"""``--pipeline-recv-posting``'s values (`posting.py`; `resolve_recv_posting` turns auto into the backend's)."""


def resolve_recv_posting(value: str, backend: str) -> str:
    """auto: "mixed" on NCCL (grouped where NCCL's ordering allows it), "early" on gloo; "early" is refused on NCCL
    (a receive posted early on a communicator that also carries sends would queue in front of them)."""
    if value not in RECV_POSTINGS:
        raise ValueError(f"--pipeline-recv-posting must be one of {', '.join(RECV_POSTINGS)}, got {value!r}")
    nccl = backend == "nccl"
    if value == "auto":
        return "mixed" if nccl else "early"
    if value == "early" and nccl:
        raise ConfigError("--pipeline-recv-posting early needs gloo: on NCCL a receive posted early on a communicator "
                          "that also carries sends queues in front of them (use auto, mixed or grouped)")
    return value


class PipelineRuntime(StepActions):
    """Runs the pipeline's forward/backward over one global batch; a Trainer ``forward_backward_fn``.

    ``runtime(model, microbatches, device, autocast_dtype=None, backward=True)`` returns the
    mean loss of this dp rank's microbatches on every rank of the pipeline (detached). ``model`` is
    the stage module, or a `ModelChunks` holding one module per stage on this mesh.
    ``placement[s]`` is the mesh (pp rank) of stage s (default: stage s on mesh s); ``layouts`` has
    one entry per stage.
    """

    finalizes_grads = True  # the trainer must not reduce gradients again after a step

    def __init__(self, ctx: ParallelContext, graph: PipelineGraph, layouts: Sequence[StageLayout],
                 comms: dict[Edge, EdgeComm], *, schedule: str | ScheduleKind, forward_step: Callable[..., Any],
                 delay_wgrad: bool = False, finalize_grads: Callable[[], None] | None = None,
                 record_trace: bool = False, lookahead: int = 1, schedule_file: Schedule | None = None,
                 placement: Sequence[int] | None = None, recv_posting: str = "early",
                 shared_pairs: frozenset[frozenset[int]] = frozenset()) -> None:
        self.ctx, self.graph, self.layouts, self.comms = ctx, graph, list(layouts), comms
        if recv_posting not in RECV_POSTINGS[1:]:
            raise ValueError(f"recv_posting must be one of {', '.join(RECV_POSTINGS[1:])} (resolved), got {recv_posting!r}")
        # when receives are posted (posting.py): "early" (gloo), "grouped" or "mixed" (NCCL's ordering, proven);
        # shared_pairs: the mesh pairs whose two directions share communicators (comm.shared_mesh_pairs)
        self.recv_posting, self.shared_pairs = recv_posting, frozenset(shared_pairs)
        # the model's forward step (``ModelSpec.forward_step``): batch and received tensors in, the
        # stage's outputs by edge name out — or, on the last stage, the microbatch's share of the loss
        self.forward_step = forward_step
        self.stage = ctx.pp_rank()  # this rank's mesh: the trace's row, the lowered program's index
        self.num_stages = graph.num_stages
        self.placement = tuple(placement) if placement is not None else tuple(range(self.num_stages))
        if len(self.placement) != self.num_stages or len(self.layouts) != self.num_stages:
            raise ValueError(f"the graph has {self.num_stages} stages but the placement names {len(self.placement)} "
                             f"and there are {len(self.layouts)} layouts")
        self.num_meshes = max(self.placement) + 1
        if self.num_meshes != ctx.pp_size:
            raise ValueError(f"the placement {list(self.placement)} uses {self.num_meshes} meshes but pp is "
                             f"{ctx.pp_size}")
        self.stages = tuple(s for s, m in enumerate(self.placement) if m == self.stage)  # this mesh's, model order
        self.virtual_stages = self.num_stages // self.num_meshes
        self.local_edges = frozenset(e for e in graph.edges if self.placement[e.src] == self.placement[e.dst])
        # Several edges per stage (U-Transformer skip tensors): the forward step takes the received
        # tensors and returns the outputs keyed by edge name ("" for the chain edge).
        self._in = {s: graph.in_edges(s) for s in self.stages}
        self._out = {s: graph.out_edges(s) for s in self.stages}
        self._chain_in = {s: next((e for e in self._in[s] if e.is_chain), None) for s in self.stages}
        self._skip_in = {s: [e for e in self._in[s] if not e.is_chain] for s in self.stages}
        # this mesh's first stage's edges (one stage per mesh: the stage's)
        self.in_edges, self.out_edges = self._in[self.stages[0]], self._out[self.stages[0]]
        # Stages with different dp: every rank's loss is the mean over its dp share, and each stage's
        # dp reduction averages. So the gradient a stage receives is dp(sender) × dL/dx of its share,
        # while its own gradients must be dp(self) × that (their dp-average is then dL/dθ): scale
        # each received gradient by dp(src)/dp(dst). 1 — no multiply at all — in uniform layouts.
        dp_of = [lay.mesh.shape[0] for lay in self.layouts]
        self._grad_scale = {e: dp_of[e.src] / dp_of[e.dst] for s in self.stages for e in self._out[s]
                            if dp_of[e.src] != dp_of[e.dst]}
        # the schedule's kind itself when given (the plan resolved it), or a registered name
        self.schedule_kind = schedule if isinstance(schedule, ScheduleKind) else get_schedule(schedule)
        self.schedule_name, self.delay_wgrad = self.schedule_kind.name, delay_wgrad
        self.finalize_grads = finalize_grads
        # --overlap-grad-reduce: the trainer's fn(stage) that starts a stage's dp gradient reduction; when set,
        # training programs get an R action per stage (grad_reduce.py) and finalize_grads is not called
        self.grad_reduce_handler: Callable[[int], None] | None = None
        # --pipeline-schedule-file: the validated schedule to run instead of generating one (schedule_io.py)
        self.schedule_file = schedule_file
        self.lookahead = lookahead
        # what watches or shapes the actions from outside the loop (hooks.py): the trainer's watchdog, the
        # trace, a benchmark's paced compute; set before a step (resolved once per step)
        self.hooks: list[ActionHook] = []
        self._trace: TraceHook | None = None
        if record_trace:
            self.enable_trace()
        self.last_trace: list[dict[str, Any]] = []
        self.last_stats: dict[str, int] = {}
        self._programs: dict[tuple[int, bool, bool], list[Action]] = {}
        self._schedules: dict[tuple[int, bool], Schedule] = {}
        self._plans: dict[tuple[int, bool, bool], PostingPlan] = {}
        self._free_outputs = can_free_outputs()

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_edges(cls, ctx: ParallelContext, graph: PipelineGraph, layouts: Sequence[StageLayout],
                   edges: Sequence[EdgeTensor], plan: PipelinePlan, *, forward_step: Callable[..., Any],
                   finalize_grads: Callable[[], None] | None = None,
                   record_trace: bool = False) -> "PipelineRuntime":
        """Any stage graph (chain and skip edges): each edge's declared tensor (global shape, dtype, both
        ends' mesh and spec), its own forward and backward resharders; ``forward_step`` runs a stage on
        a microbatch (``ModelSpec.forward_step``); everything else from the resolved `plan`. Collective over
        the world. With virtual stages (``len(layouts) > pp``) the stages sit on the plan's placement; edges
        between two stages of one mesh and layout are local hand-offs and get no resharders.
        """
        schedule_file = None
        if plan.schedule_file is not None:  # checked against the model's graph before any collective
            from .schedule_io import load_schedule_file

            schedule_file = load_schedule_file(plan.schedule_file, num_meshes=ctx.pp_size,
                                               num_microbatches=plan.num_microbatches, graph=graph,
                                               overlap_grad_reduce=plan.overlap_grad_reduce)
        placement = plan.placement
        if len(layouts) != len(placement) or plan.num_meshes != ctx.pp_size:
            raise ValueError(f"{len(layouts)} stage layouts on pp {ctx.pp_size}, but the plan places "
                             f"{len(placement)} stages on {plan.num_meshes} meshes")
        local = frozenset(e for e in graph.edges if placement[e.src] == placement[e.dst])
        for e in local:
            a, b = layouts[e.src], layouts[e.dst]
            if a.mesh != b.mesh or a.hidden_spec != b.hidden_spec:  # pragma: no cover - one layout per mesh
                raise ValueError(f"edge {e} joins two stages of mesh {placement[e.src]} with different layouts")
        posting = resolve_recv_posting(plan.recv_posting, dist.get_backend() if dist.is_initialized() else "gloo")
        rt = cls(ctx, graph, layouts, {}, schedule=plan.kind or plan.schedule, forward_step=forward_step,
                 delay_wgrad=plan.delay_wgrad, finalize_grads=finalize_grads, record_trace=record_trace,
                 schedule_file=schedule_file, placement=placement, recv_posting=posting)
        # mixed posting: the mesh pairs whose programs cannot group under NCCL's ordering keep a communicator per
        # direction (decided from the programs alone, the same on every rank, before any communicator exists)
        split = frozenset()
        if posting == "mixed":
            split = split_pairs([rt.lowered(plan.num_microbatches, True), rt.lowered(plan.num_microbatches, False)])
        rt.comms = build_edge_comms(graph, [d for d in edges if d.edge not in local], strategy=plan.strategy,
                                    scheduler=plan.scheduler, chunks=plan.chunks, skip=local,
                                    split=split, placement=placement)
        rt.shared_pairs = shared_mesh_pairs(rt.comms, placement)
        try:  # the programs' posting plans: a schedule that would hang under NCCL's ordering is refused here
            rt.program(plan.num_microbatches, True)
            rt.program(plan.num_microbatches, False)
        except ScheduleError as e:
            from .schedule_io import describe_error

            how = plan.recv_posting if plan.recv_posting == posting else f"{plan.recv_posting} = {posting}"
            what = f"--pipeline-schedule-file {plan.schedule_file}" if plan.schedule_file is not None else \
                f"--pipeline-schedule {plan.schedule}"
            hint = "; --pipeline-recv-posting mixed keeps such pairs on a communicator per direction" \
                if posting == "grouped" else ""
            raise ConfigError(f"{what}: {describe_error(e)} (--pipeline-recv-posting {how}{hint})") from None
        return rt

    def training_schedule(self, num_microbatches: int) -> Schedule:
        """Every mesh's lowered training program: the schedule file's or the generated one, with R actions
        when a gradient-reduction handler is registered; validated (once per microbatch count)."""
        key = (num_microbatches, self.grad_reduce_handler is not None)
        if key not in self._schedules:
            self._schedules[key] = self._training_schedule(num_microbatches)
        return self._schedules[key]

    def _training_schedule(self, num_microbatches: int) -> Schedule:
        if self.schedule_file is not None:
            sched = self.schedule_file
            if sched.num_microbatches != num_microbatches:
                raise ValueError(f"the schedule file is written for {sched.num_microbatches} microbatches, this "
                                 f"step has {num_microbatches}")
        else:
            sched = generate(self.schedule_kind, self.num_meshes, num_microbatches, self.delay_wgrad, self.graph,
                             virtual_stages=self.virtual_stages if self.virtual_stages > 1 else None)
        if tuple(sched.placement) != self.placement:
            raise ValueError(f"schedule {sched.name or self.schedule_name} places the stages on meshes "
                             f"{list(sched.placement)}, but the model chunks were built for {list(self.placement)}")
        if self.grad_reduce_handler is not None:
            sched = insert_grad_reduce(sched)
        elif has_grad_reduce(sched):
            raise ValueError("the schedule holds gradient-reduction (R) actions but no grad_reduce_handler is "
                             "registered (--overlap-grad-reduce)")
        low = sched if sched.is_lowered else lower(sched, lookahead=self.lookahead)
        validate(low)
        return low

    def _program_key(self, num_microbatches: int, train: bool) -> tuple[int, bool, bool]:
        return (num_microbatches, train, self.grad_reduce_handler is not None)

    def lowered(self, num_microbatches: int, train: bool = True) -> Schedule:
        """Every mesh's lowered program for a step (training: `training_schedule`; evaluation: each mesh runs its
        stages in model order, F0..F(m-1) each)."""
        if train:
            return self.training_schedule(num_microbatches)
        return lower(forward_only(self.graph, num_microbatches, self.placement), lookahead=self.lookahead)

    def program(self, num_microbatches: int, train: bool = True) -> list[Action]:
        """This mesh's lowered action list (cached per microbatch count), with its posting plan (`posting.py`):
        under grouped posting proven to run under NCCL's ordering, or refused naming the action that would hang."""
        key = self._program_key(num_microbatches, train)
        if key not in self._programs:
            low = self.lowered(num_microbatches, train)
            grouped = self.recv_posting != "early"
            plan = plan_posting(low, "grouped" if grouped else "early", self.shared_pairs)
            if grouped:
                check_nccl(low, plan)
            self._programs[key] = low.actions[self.stage]
            self._plans[key] = plan
        return self._programs[key]

    def posting_plan(self, num_microbatches: int, train: bool = True) -> PostingPlan:
        """The posting plan of a step's program (`posting.py`): where each receive is posted, each send retired."""
        self.program(num_microbatches, train)
        return self._plans[self._program_key(num_microbatches, train)]

    def describe(self) -> str:
        virtual = (f" on {self.num_meshes} meshes ({self.virtual_stages} virtual stages each, placement "
                   f"{','.join(map(str, self.placement))}; {len(self.local_edges)} local hand-off edge(s))"
                   if self.virtual_stages > 1 else "")
        what = (f"the schedule file's {self.schedule_file.name or 'program'}" if self.schedule_file is not None
                else f"schedule {self.schedule_name}{' + delayed weight gradients' if self.delay_wgrad else ''}")
        lines = [f"pipeline: {self.num_stages} stages{virtual}, {what}"
                 + (", each stage's gradient reduction started by an R action" if self.grad_reduce_handler else "")]
        lines += ["  " + lay.describe() for lay in self.layouts]
        for e, c in self.comms.items():
            lines.append(f"  edge {e}: {c.decl.shape} {c.decl.dtype} {c.fwd.strategy} "
                         f"({c.fwd.plan.scheduler}, {len(c.fwd.plan.tasks)} task(s) forward, "
                         f"{len(c.bwd.plan.tasks)} backward)")
        return "\n".join(lines)

    # ---- one step ------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the edges' communicators and their stream threads (every rank, after the last step; a process
        that builds one runtime after another must, or gloo's threads pile up and slow the later ones)."""
        streams = {id(r.streams): r.streams for c in self.comms.values() for r in (c.fwd, c.bwd)}
        for s in streams.values():
            s.close(destroy_groups=True)
        self.comms = {}

    def __call__(self, model: torch.nn.Module, microbatches: list[dict[str, torch.Tensor]], device: torch.device,
                 autocast_dtype: torch.dtype | None = None, backward: bool = True,
                 scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        train = backward and torch.is_grad_enabled()
        st = _Step(list(microbatches), train, torch.zeros((), dtype=torch.float32, device=device), device,
                   autocast_dtype, scale_loss=scale_loss)
        prog, plan = self.program(len(st.microbatches), train), self._plans[self._program_key(len(st.microbatches), train)]
        hooks = HookSet(self.hooks)
        stats = st.stats
        st.send_done = hooks.send_done
        for h in hooks.start_step:
            h(stats, train)
        sends, posts, retire = plan.sends[self.stage], plan.posts[self.stage], plan.retire[self.stage]
        try:
            for i, a in enumerate(prog):
                kind = a.kind
                for h in hooks.before:
                    h(a, stats)
                try:
                    if kind.is_compute:
                        self._compute(model, a, st)
                        self._count_live(a, st)
                    elif kind.is_reduce:
                        self._reduce_grads(a)
                    else:
                        self._communicate(a, st, sends.get(i, ()), posts.get(i, ()))
                except BaseException as e:
                    for h in hooks.after:
                        h(a, stats, e)
                    raise
                for h in hooks.after:
                    h(a, stats, None)
                for item in retire.get(i, ()):  # sends known complete: the receiver's reply has arrived
                    sent = st.sends.pop(item, None)
                    if sent is not None:
                        self._finish_send(sent, st)
            if train and self.finalize_grads is not None and not any(a.kind.is_reduce for a in prog):
                self.finalize_grads()  # after the last W (or B), while the last sends drain
            for sent in st.sends.values():
                self._finish_send(sent, st)
            st.sends.clear()
            for h in hooks.end_step:
                h(stats)
        finally:  # after a failure the unfinished sends are dropped: one may never complete
            model_set = getattr(model, "set_wgrad_store", None)
            if callable(model_set):
                model_set(None)
        if st.stores and any(len(s) for s in st.stores.values()):
            raise RuntimeError(f"mesh {self.stage}: weight-gradient work of (stage, microbatch) {sorted(st.stores)} "
                               "was queued by I but never run by a W")
        loss = st.loss
        if self.num_meshes > 1 and self.ctx.per_stage_layouts:
            # no one-rank-per-stage group: the last stage's ranks contribute their dp shard's loss
            # / (tp × dp) to a world sum, so every rank holds the global mean (dp-mean is a no-op)
            if self.num_stages - 1 in self.stages:
                loss = loss / (self.ctx.tp_size * self.ctx.dp_size)
            dist.all_reduce(loss)
        elif self.num_meshes > 1:
            dist.all_reduce(loss, group=self.ctx.pp_group)  # only the last stage holds a non-zero loss
        if train:  # evaluation steps do not overwrite what the last training step recorded
            self.last_stats = stats
            if self._trace is not None:
                self.last_trace = self._trace.records
        return loss.detach()

    def enable_trace(self) -> None:
        """Record the timeline of each training step from now on (``last_trace``; a `TraceHook`)."""
        if self._trace is None:
            self._trace = TraceHook(self.stage)
            self.hooks.append(self._trace)

    def watch(self, watchdog: Any) -> None:
        """Name every action to the hang watchdog (`launch.Watchdog`) while it runs (a `WatchdogHook`)."""
        self.hooks.append(WatchdogHook(watchdog, self.describe_action))

    def describe_action(self, a: Action) -> str:
        """What the hang watchdog reports if this action outlasts --comm-timeout (e.g. 'stage 1 action WF3<-0
        (microbatch 3, peer stage 0 on ranks [0, 1])': waiting for microbatch 3's activation from stage 0)."""
        where = f"stage {self.stage}" if self.virtual_stages == 1 else f"mesh {self.stage} stage {a.stage}"
        peer = a.peer
        with_peer = "" if peer is None else \
            f", peer stage {peer} on ranks {list(self.layouts[peer].mesh.flat_ranks)}"
        return f"{where} action {a} (microbatch {a.mb}{with_peer})"

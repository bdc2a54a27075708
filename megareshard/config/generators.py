"""`GeneratorConfig`: generator replicas in the same job as the trainer (issue #50). The last ranks of the launch
sample from the trainer's weights, pushed to them after every N-th optimizer step by a planned weight transfer
(``megareshard/generators.py``)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from .fields import ConfigError
from .fields import config_field as _f

__all__ = ["GeneratorConfig", "ReplicaLayout", "parse_generator_layouts"]


@dataclass
class GeneratorConfig:
    """Generator replicas on the last ranks of the launch, fed the trainer's weights as it trains."""

    generator_layouts: str | None = _f(None, "one generator replica per entry, each its tensor-parallel size, e.g. "
                                             "tp2,tp1 (an MoE model's experts split inside a replica's tp ranks: "
                                             "tp4ep2, expert-tensor-parallel size tp/ep, or tp4ep2etp1): the replicas "
                                             "take the LAST ranks of the launch (world = the "
                                             "trainer's ranks + the sum of the generators' tp), receive the weights "
                                             "after every --transfer-interval optimizer steps and greedily continue "
                                             "--generator-prompts with a key/value cache between updates")
    transfer_interval: int = _f(1, "push the trainer's weights to the generator replicas after every N-th "
                                   "optimizer step (and after the last one)", metavar="N")
    transfer_bucket_mb: float = _f(64.0, "the weight transfer's staging bound: the MiB of flat buckets (small "
                                         "tensors packed together) a rank holds at once, over all the senders it "
                                         "receives from")
    generator_prompts: str | None = _f(None, "the generators' prompts: texts separated by |, or a file of one prompt "
                                             "per line (default: three short code prompts)")
    generator_max_new_tokens: int = _f(16, "tokens each generator replica adds to every prompt (greedy)")


@dataclass(frozen=True)
class ReplicaLayout:
    """One generator replica's layout: ``tp`` ranks; an MoE model's experts split inside them over ``ep`` and
    ``etp`` (``ep × etp`` divides tp; ranks that hold the same expert shards are its expert-data-parallel copies)."""

    tp: int
    ep: int = 1
    etp: int | None = None   # None: tp / ep

    @property
    def expert_tp(self) -> int:
        return self.tp // self.ep if self.etp is None else self.etp

    @property
    def label(self) -> str:
        return f"tp{self.tp}" + (f"ep{self.ep}" if self.ep > 1 else "") + ("" if self.etp is None else f"etp{self.etp}")


_ENTRY = re.compile(r"(?:tp)?(\d+)(?:ep(\d+))?(?:etp(\d+))?")


def parse_generator_layouts(text: str | None) -> list[ReplicaLayout]:
    """``"tp2,tp4ep2,tp4ep2etp1"`` -> one `ReplicaLayout` per entry; one line with the entry on a bad one."""
    if not text:
        return []
    out = []
    for entry in text.split(","):
        m = _ENTRY.fullmatch(entry.strip().lower())
        nums = [int(g) for g in m.groups() if g is not None] if m else []
        if not m or min(nums) < 1:
            raise ConfigError(f"--generator-layouts {text}: entry {entry.strip()!r} is not tpN, tpNepM or tpNepMetpK "
                              "with every number >= 1 (e.g. tp2,tp4ep2: one replica per entry)")
        tp, ep, etp = int(m.group(1)), int(m.group(2) or 1), None if m.group(3) is None else int(m.group(3))
        e = max(tp // ep, 1) if etp is None else etp
        if tp % ep or tp % (ep * e):
            raise ConfigError(f"--generator-layouts {text}: entry {entry.strip()!r}: expert-parallel size {ep} × "
                              f"expert-tensor-parallel size {e} does not divide its tensor-parallel size {tp} (a "
                              "replica's experts are split inside its tp ranks)")
        out.append(ReplicaLayout(tp, ep, etp))
    return out


def trainer_world_size(cfg, world_size: int) -> int:
    """The ranks the trainer keeps of a launch of ``world_size`` once the generator replicas of ``cfg.generators``
    took the last ones; checks the generator flags against the model and the launch (one line with the numbers).
    Without --generator-layouts: ``world_size``."""
    from .model import check_model_shape
    from .moe import check_moe_config, expert_width, grouped_gemm_refusal

    g = cfg.generators
    layouts = parse_generator_layouts(g.generator_layouts)
    if not layouts:
        return world_size
    if g.transfer_interval < 1:
        raise ConfigError(f"--transfer-interval must be at least 1, got {g.transfer_interval}")
    if not g.transfer_bucket_mb > 0:
        raise ConfigError(f"--transfer-bucket-mb must be positive, got {g.transfer_bucket_mb}")
    if g.generator_max_new_tokens < 1:
        raise ConfigError(f"--generator-max-new-tokens must be at least 1, got {g.generator_max_new_tokens}")
    m = cfg.model
    for i, lay in enumerate(layouts):
        tp, name = lay.tp, f"generator replica {i} ({lay.label})"
        groups = m.num_query_groups if m.group_query_attention else m.num_attention_heads
        if m.num_attention_heads % tp or groups % tp:
            raise ConfigError(f"--generator-layouts {g.generator_layouts}: {name}'s tensor-parallel size {tp} does "
                              f"not divide --num-attention-heads {m.num_attention_heads} and the "
                              f"{groups} key/value head(s) (--num-query-groups)")
        check_model_shape(m, tp, tp_name=f"{name}'s tensor-parallel size")
        if m.num_experts is None and (lay.ep > 1 or lay.etp is not None):
            raise ConfigError(f"--generator-layouts {g.generator_layouts}: {name} sets an expert layout, which needs "
                              "--num-experts (a dense model has no experts to split)")
        try:   # MoE: a replica's experts split over ep × etp inside its tp ranks, without sequence parallelism
            check_moe_config(m, tp, lay.ep, lay.expert_tp, training=False)
        except ConfigError as e:
            raise ConfigError(f"--generator-layouts {g.generator_layouts}: {name}: {e}") from None
        if m.num_experts is not None and m.moe_grouped_gemm:   # the replica runs them too, at its own width
            why = grouped_gemm_refusal(m.hidden_size, expert_width(m) // lay.expert_tp,
                                       2 if cfg.memory.bf16 or cfg.memory.fp16 else 4)
            if why is not None:
                raise ConfigError(f"--generator-layouts {g.generator_layouts}: {name}: {why}")
    tps = [lay.tp for lay in layouts]
    trainer = world_size - sum(tps)
    need = cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size
    if cfg.parallel.stage_layouts:
        need = 1
    if trainer < need or trainer % need:
        raise ConfigError(f"--generator-layouts {g.generator_layouts} takes the last {sum(tps)} of the {world_size} "
                          f"ranks, leaving {max(trainer, 0)} to the trainer, which needs a multiple of "
                          f"tp {cfg.parallel.tensor_model_parallel_size} × pp "
                          f"{cfg.parallel.pipeline_model_parallel_size} = {need}: launch "
                          f"{max(need, need * -(-max(trainer, 1) // need)) + sum(tps)} ranks")
    return trainer

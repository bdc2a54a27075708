"""``--torch-compile-scope model`` (issue #53 part 2's "whole-model compile for small models"): the GPT compiled as
one graph, embedding to loss, gives the eager model's loss and gradients within the bounds of regional compilation
(tests/test_fast_path.py: aot_eager, the same graphs and kernels as eager up to reassociated sums), in one dynamo
graph with no break at dropout 0; Megatron's default dropout breaks it at the RNG streams and still trains like
eager; where the model is not one graph (pipeline stages, tensor parallelism, recomputation, experts, the
U-Transformer) it is refused in one line."""
from __future__ import annotations

import io

import pytest
import torch

from megareshard.arguments import ConfigError, parse_args
from megareshard.compile_config import CompileOptions
from megareshard.models.gpt import GPTModel
from megareshard.parallel import ParallelContext
from megareshard.training import Trainer, build_context
from tests.tolerances import U

TINY = ["--mock-data", "--vocab-size", "250", "--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--device", "cpu",
        "--seed", "5", "--train-iters", "3", "--log-interval", "100"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
WHOLE = ["--torch-compile", "--torch-compile-backend", "aot_eager", "--torch-compile-scope", "model"]


def _model(extra=()):
    cfg = parse_args(TINY + NO_DROPOUT + ["--cross-entropy-loss-fusion", *extra], world_size=1)
    return GPTModel(cfg.model, ParallelContext.single_process(), seed=9)


def test_the_whole_model_is_one_graph_with_eager_numbers():
    import torch._dynamo
    from torch._dynamo.utils import counters

    tokens = torch.randint(0, 250, (2, 17), generator=torch.Generator().manual_seed(2))
    results = []
    for scope in (None, "model"):
        model = _model()
        names = list(model.state_dict())
        if scope:
            torch._dynamo.reset()
            counters.clear()
            assert model.compile_regions(CompileOptions("aot_eager", scope="model")) == ["model"]
        loss = model(tokens=tokens[:, :-1], labels=tokens[:, 1:]).mean()
        loss.backward()
        assert list(model.state_dict()) == names  # compiled in place: no _orig_mod. in any name
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}))
    assert counters["stats"]["unique_graphs"] == 1 and sum(counters["graph_break"].values()) == 0, \
        (dict(counters["stats"]), dict(counters["graph_break"]))
    (l0, g0), (l1, g1) = results
    assert abs(l1 - l0) <= 8 * U * abs(l0)
    for name, g in g0.items():  # one backward: its gradient sums reassociated at most (tests/tolerances.py)
        assert (g1[name] - g).abs().max() <= 128 * U * g.abs().max() + 1e-30, name


def _losses(extra: list[str]) -> tuple[list[float], str]:
    cfg = parse_args(TINY + extra, world_size=1)
    ctx, _ = build_context(cfg, 1)
    out = io.StringIO()
    trainer = Trainer(cfg, ctx, torch.device("cpu"), out=out)
    losses = [r["loss"] for r in trainer.train()]
    trainer.close()
    return losses, out.getvalue()


def test_with_megatrons_dropout_it_trains_like_eager():
    """Dropout 0.1 (Megatron's default): the masks come from megareshard's RNG streams, outside the graph (breaks),
    so the compiled run draws the eager run's masks: the first loss within the compiled bound of one forward
    (8 U, as above), the next two within 1e-5 (reassociated sums carried through two AdamW steps at lr 1e-3), while
    dropping nothing at all moves these losses by more than 5e-5 (asserted: the bound tells masks apart)."""
    eager, _ = _losses(["--no-torch-compile"])
    whole, text = _losses(WHOLE)
    assert "torch.compile (backend aot_eager, mode default) of the whole model as one region" in text, text
    assert len(whole) == 3 and abs(whole[0] - eager[0]) <= 8 * U * abs(eager[0]), (eager, whole)
    assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(eager, whole)), (eager, whole)
    undropped, _ = _losses(["--no-torch-compile"] + NO_DROPOUT)
    assert all(abs(a - b) > 5e-5 * abs(a) for a, b in zip(eager, undropped)), (eager, undropped)


@pytest.mark.parametrize("extra, world, says", [
    (["--pipeline-model-parallel-size", "2", "--num-layers", "4"], 2, "--pipeline-model-parallel-size 2 (each stage is its own module)"),
    (["--tensor-model-parallel-size", "2"], 2, "--tensor-model-parallel-size 2"),
    (["--recompute-granularity", "full"], 1, "--recompute-granularity full"),
    (["--num-experts", "2"], 1, "--num-experts 2"),
], ids=["pp", "tp", "recompute", "moe"])
def test_a_model_that_is_not_one_graph_is_refused_in_one_line(extra, world, says):
    with pytest.raises(ConfigError) as e:
        parse_args(TINY + WHOLE + extra, world_size=world)
    msg = str(e.value)
    assert says in msg and "use --torch-compile-scope layers" in msg and "\n" not in msg, msg
    parse_args(TINY + WHOLE[:-1] + ["layers"] + extra, world_size=world)   # the default scope serves it
    parse_args(TINY + ["--no-torch-compile", "--torch-compile-scope", "model"] + extra, world_size=world)  # no compile


def test_the_u_transformer_refuses_the_whole_model_scope():
    from megareshard.models.utransformer import UTransformerModel

    with pytest.raises(ConfigError, match="the U-Transformer compiles its Transformer blocks only"):
        UTransformerModel.compile_regions(object.__new__(UTransformerModel), CompileOptions("aot_eager", scope="model"))

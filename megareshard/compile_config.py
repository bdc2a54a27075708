"""The compile flags moved to ``megareshard/config/compile.py`` (the configuration types' floor, which imports
nothing else of ours); this module keeps every import site of them working, and holds the two checks that ask
torch's dynamo (no configuration type imports torch): `check_compile_config` and `compiler_failure`."""
from .config import compile as _moved
from .config.compile import CompileConfig
from .config.fields import ConfigError

globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__")})


def compiler_failure(e: BaseException) -> bool:
    """Whether ``e`` is torch.compile's (dynamo's, or a backend's: BackendCompilerFailed, InductorError, ...)."""
    import torch._dynamo.exc as exc

    kinds = [exc.TorchDynamoException]
    if hasattr(exc, "FailOnRecompileLimitHit"):  # not a TorchDynamoException
        kinds.append(exc.FailOnRecompileLimitHit)
    return isinstance(e, tuple(kinds))


#: torch.compile modes that turn on inductor's CUDA graphs (``torch._inductor.list_mode_options``)
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def check_compile_scope(cfg) -> None:
    """``--torch-compile-scope model`` compiles the model as one graph: refused in one line where the model is not
    one graph — several pipeline stages, tensor-parallel collectives between its layers, recomputation's replay,
    experts' token routing (data-dependent shapes)."""
    c = cfg.compile
    if c.torch_compile is False or c.torch_compile_scope != "model":
        return
    p, mem = cfg.parallel, cfg.memory
    why = [what for cond, what in (
        (p.pipeline_model_parallel_size > 1, f"--pipeline-model-parallel-size {p.pipeline_model_parallel_size} "
                                             "(each stage is its own module)"),
        (p.tensor_model_parallel_size > 1, f"--tensor-model-parallel-size {p.tensor_model_parallel_size} (its "
                                           "collectives split the graph at every layer)"),
        (mem.recompute_granularity is not None, f"--recompute-granularity {mem.recompute_granularity} (the replay "
                                                "is its own region)"),
        (cfg.model.num_experts is not None, f"--num-experts {cfg.model.num_experts} (token routing has "
                                            "data-dependent shapes)")) if cond]
    if why:
        raise ConfigError(f"--torch-compile-scope model compiles the whole model as one graph, which this run cannot "
                          f"give: {'; '.join(why)}; use --torch-compile-scope layers")


def check_compile_config(c: CompileConfig) -> None:
    """The backend must be one torch.compile knows (checked before anything is built; the default, inductor,
    without importing the compiler); a mode that cannot train is refused (issue #53 part 3)."""
    if c.torch_compile is not False and c.torch_compile_mode in CUDA_GRAPH_MODES:
        raise ConfigError(f"--torch-compile-mode {c.torch_compile_mode} cannot train here: it turns on inductor's CUDA "
                          "graphs, which give a compiled region's next run the memory of its outputs while the "
                          "backward still needs them (reduce-overhead on an H200: 'accessing tensor output of "
                          "CUDAGraphs that has been overwritten by a subsequent run', the logits, at the first "
                          "backward); use default or max-autotune-no-cudagraphs")
    if c.torch_compile is False or c.torch_compile_backend == "inductor":
        return
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=()) + ["inductor"]
    if c.torch_compile_backend not in known:
        raise ConfigError(f"--torch-compile-backend {c.torch_compile_backend} is not a torch.compile backend; "
                          f"known: {', '.join(sorted(set(known)))}")
    if c.torch_compile_mode != "default" and c.torch_compile_backend != "inductor":
        raise ConfigError(f"--torch-compile-mode {c.torch_compile_mode} needs --torch-compile-backend inductor "
                          f"(modes are inductor's), got {c.torch_compile_backend}")

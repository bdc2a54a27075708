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


def check_compile_config(c: CompileConfig) -> None:
    """The backend must be one torch.compile knows (checked before anything is built; the default, inductor,
    without importing the compiler)."""
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

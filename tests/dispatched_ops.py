"""Which aten operations a piece of code dispatches, in order (on a GPU each is usually a kernel launch): the tests
that count a step's operations record them with this mode."""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class DispatchedOps(TorchDispatchMode):
    """``with DispatchedOps() as mode: ...`` leaves ``mode.ops``: each dispatched op's name (``"aten.mul_"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))

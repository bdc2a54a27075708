"""The user tools, one module each with ``main(argv=None) -> int``: ``checkpoint_util``, ``preprocess_data``,
``train_tokenizer``, ``generate``, ``plan_layout``, ``show_topology``, ``calibrate_cluster``, ``plot_schedule``.

Three ways to run one, the same arguments and messages (``--help``'s program name is ``NAME.py``):
``megareshard-NAME`` (the console scripts of ``pyproject.toml``, dashes for underscores),
``python tools/NAME.py`` (Megatron-LM's habit: a thin script on the installed package, `as_script`) and
``python -m megareshard.cli.NAME``. Importing this package imports none of them.
"""
from __future__ import annotations

import sys
from types import ModuleType


def as_script(namespace: dict, tool: ModuleType) -> None:
    """What ``tools/NAME.py`` is: given its ``globals()`` and the tool's module, the script's ``main`` is the
    tool's and its other names reach the tool's (``__getattr__``: code that imports the script, ``import
    generate`` with tools/ on the path, sees the tool); run as a script, it exits with ``main()``'s code."""
    namespace["main"] = tool.main
    namespace["__getattr__"] = lambda name: getattr(tool, name)
    if namespace["__name__"] == "__main__":
        sys.exit(tool.main())

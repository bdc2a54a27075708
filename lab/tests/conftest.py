"""The lab's tests: they run from the repository root like the lab itself, and share the product tests' fixtures.

The lab is not installed (it runs from a checkout), so every process the lab's tools start must find it:
the repository root goes first on PYTHONPATH for the whole session."""
import os

from lab import env_with_root
from tests.conftest import stdlib_text  # noqa: F401 (a fixture, shared)

os.environ["PYTHONPATH"] = env_with_root()["PYTHONPATH"]

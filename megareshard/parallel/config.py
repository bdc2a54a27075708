"""Moved to ``megareshard/config/parallel.py`` (the configuration types' floor, which imports nothing else of ours);
this module keeps every import site of it working."""
from ..config import parallel as _moved

globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__")})

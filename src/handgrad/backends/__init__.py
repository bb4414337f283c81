"""Backends: the same ops under the same names. `get_backend(name)` returns the module."""
import importlib

BACKENDS = ("cpu", "gpu")


def get_backend(name):
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    return importlib.import_module(f"handgrad.backends.{name}")

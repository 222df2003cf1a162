"""vx's version: the one place it is written (the package metadata and `vx.__version__` read it here)."""

__version__ = "0.1.0"

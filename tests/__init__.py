"""vx's tests: a package, so that every test imports its shared helpers as `tests.support.<module>` from the
repository root (pytest puts the root on sys.path, being the first folder above `tests/` without an `__init__.py`)."""

"""The package version, read by pyproject.toml and `dp-runtime --version`."""

__version__ = "0.1.0"

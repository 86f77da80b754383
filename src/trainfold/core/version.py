"""The library's version: one owner, the installed package's metadata (``pyproject.toml``'s ``version``)."""

from __future__ import annotations

from importlib import metadata

__all__ = ["library_version"]


def library_version() -> str:
    """Return the installed trainfold's version, or ``"unknown"`` when it runs from a source tree.

    >>> library_version() == metadata.version("trainfold")
    True
    """
    try:
        return metadata.version("trainfold")
    except metadata.PackageNotFoundError:
        return "unknown"

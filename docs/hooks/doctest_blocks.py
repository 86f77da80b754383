"""A griffe extension for the API reference: each docstring example (``>>>`` lines and their output) is shown as a
Python code block, so its output (``[0.0, 0.5]``) is not read as Markdown (a link reference)."""

from __future__ import annotations

from typing import Any

import griffe


def fenced(text: str) -> str:
    """Wrap every run of doctest lines (from ``>>>`` to the next blank line) in a ```` ```python ```` fence."""
    out: list[str] = []
    inside = False
    for line in text.splitlines():
        starts = line.lstrip().startswith(">>>")
        if starts and not inside:
            out.append("```python")
            inside = True
        elif inside and not line.strip():
            out.append("```")
            inside = False
        out.append(line)
    if inside:
        out.append("```")
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    """Fence the doctests of every object's docstring."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fenced(obj.docstring.value)

"""Filter and map over a streaming source: positions stay the unfiltered ones, so resumes stay exact.

>>> import itertools
>>> class Count:  # a stand-in source: the row at position p is p
...     num_rows = 10
...     def rows(self, start):
...         return ((p + 1, p % 10) for p in itertools.count(start))
>>> odd = Filtered(Count(), lambda r: r % 2 == 1).map(lambda r: r * 10)
>>> list(itertools.islice(odd.rows(4), 3))  # (position after, row)
[(6, 50), (8, 70), (10, 90)]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import attrs

__all__ = ["Filtered", "Mapped", "empty_epoch_error"]


def empty_epoch_error(fn: Any, num_rows: int, epoch: int) -> ValueError:
    """The error of a filter that kept none of the ``num_rows`` rows of ``epoch`` (the stream would never yield)."""
    return ValueError(
        f"the filter {getattr(fn, '__qualname__', fn)!r} kept none of the {num_rows} rows of epoch "
        f"{epoch} of the source: a stream of no rows cannot make a batch; check the filter "
        "(or the columns it reads)"
    )


@attrs.frozen(eq=False)
class _Derived:
    """Rows derived from ``base``'s at its positions: the same epoch length and fingerprint, and more
    transforms on top."""

    base: Any

    @property
    def num_rows(self) -> int:
        """Rows of one epoch of the base (before any filter: how many one keeps is unknown until read)."""
        return int(self.base.num_rows)

    @property
    def seed(self) -> int:
        """The base's seed (the order's)."""
        return int(self.base.seed)

    @property
    def shuffle_window(self) -> int:
        """The base's window: rows read, shuffled and transformed together (``trainfold.data.readers``)."""
        return int(self.base.shuffle_window)

    def fingerprint(self) -> int:
        """The base's fingerprint (a transform's code is not fingerprinted)."""
        return int(self.base.fingerprint())

    def sample_id(self, position: int) -> int:
        """The base's identity of the row at ``position`` (a transform keeps the row's identity)."""
        return int(self.base.sample_id(position))

    def filter(self, fn: Callable[[Any], bool]) -> Filtered:
        """Keep the rows ``fn`` accepts."""
        return Filtered(self, fn)

    def map(self, fn: Callable[[Any], Any]) -> Mapped:
        """Transform each row."""
        return Mapped(self, fn)


@attrs.frozen(eq=False)
class Filtered(_Derived):
    """The rows of ``base`` that ``fn`` accepts, at their unfiltered positions.

    ``fn`` sees the row only, which is a pure function of its position, so the kept rows are too: a
    resume from a position yields exactly the rows an uninterrupted stream yields after it. A filter
    that keeps no row of a whole epoch raises ``ValueError`` (the stream would never end).
    """

    fn: Callable[[Any], bool]

    def rows(self, start: int) -> Iterator[tuple[int, Any]]:
        """Yield ``(position after, row)`` for each kept row from ``start`` on."""
        n = self.num_rows
        clean_from = -(-start // n) * n  # the first epoch read from its first row
        kept_since = None
        for pos, row in self.base.rows(start):
            if self.fn(row):
                kept_since = pos
                yield pos, row
            elif pos % n == 0 and pos - n >= clean_from and (kept_since is None or kept_since <= pos - n):
                raise empty_epoch_error(self.fn, n, pos // n - 1)

    def row_at(self, position: int) -> Any:
        """The base's row at ``position``, which the caller knows this filter keeps (:meth:`window_rows` said so)."""
        return self.base.row_at(position)

    def window_rows(self, epoch: int, k: int) -> list[tuple[int, Any]]:
        """The kept rows of the base's window ``k`` of ``epoch``, with their positions (what :meth:`rows` yields)."""
        return [(pos, row) for pos, row in self.base.window_rows(epoch, k) if self.fn(row)]


@attrs.frozen(eq=False)
class Mapped(_Derived):
    """The rows of ``base`` transformed by ``fn`` (positions unchanged)."""

    fn: Callable[[Any], Any]

    def rows(self, start: int) -> Iterator[tuple[int, Any]]:
        """Yield ``(position after, fn(row))`` from ``start`` on."""
        for pos, row in self.base.rows(start):
            yield pos, self.fn(row)

    def row_at(self, position: int) -> Any:
        """The base's row at ``position``, transformed."""
        return self.fn(self.base.row_at(position))

    def window_rows(self, epoch: int, k: int) -> list[tuple[int, Any]]:
        """The base's window ``k`` of ``epoch``, transformed, with the rows' positions (what :meth:`rows` yields)."""
        return [(pos, self.fn(row)) for pos, row in self.base.window_rows(epoch, k)]

"""CRC-32 (zlib's) of a file's pieces computed apart and combined: the whole file's CRC without a serial pass.

``combine(crc_a, crc_b, len_b)`` is the CRC-32 of ``a + b`` from the CRCs of ``a`` and ``b`` and the
length of ``b`` (zlib's ``crc32_combine``): appending ``len_b`` bytes multiplies ``a``'s CRC by
``x^(8 len_b)`` modulo the CRC polynomial over GF(2) (the pre- and post-conditioning cancel), so
combining costs O(log len_b) polynomial products of 32 bits, not a pass over the bytes.

``crc32(data, value=0)`` is zlib's function, or ISA-L's (``pip install isal``: the same CRC-32 with
carry-less multiplication, ~3x zlib's speed) when that is installed; the values are the same.

>>> import zlib
>>> a, b = b"trainfold ", b"checkpoint"
>>> combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
True
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Iterable

__all__ = ["combine", "combine_all", "crc32", "CRC32_BY"]

crc32: Callable[..., int] = zlib.crc32
CRC32_BY = "zlib"
try:  # an optional accelerator with the same values: ISA-L's crc32 (PCLMULQDQ)
    from isal.isal_zlib import crc32  # type: ignore[no-redef]

    CRC32_BY = "isal"
except ImportError:  # pragma: no cover - depends on the environment
    pass

_POLY = 0xEDB88320  # the CRC-32 polynomial, bit-reflected (bit 31 is x^0)


def _multiply(a: int, b: int) -> int:
    """Return ``a * b`` modulo the polynomial, both 32-bit reflected polynomials over GF(2)."""
    m = 1 << 31
    p = 0
    while a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _powers() -> tuple[int, ...]:
    """``x^(2^k)`` modulo the polynomial for k = 0..63."""
    out = [1 << 30]  # x^1
    for _ in range(63):
        out.append(_multiply(out[-1], out[-1]))
    return tuple(out)


_X2N = _powers()


@functools.lru_cache(maxsize=64)
def _shift(n: int) -> int:
    """Return ``x^(8 n)`` modulo the polynomial: the factor appending ``n`` bytes applies to a CRC."""
    p = 1 << 31  # x^0
    k = 3  # 8 n = n * 2^3
    while n:
        if n & 1:
            p = _multiply(_X2N[k % 64], p)
        n >>= 1
        k += 1
    return p


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """Return the CRC-32 of ``a + b`` given ``crc32(a)``, ``crc32(b)`` and ``len(b)``.

    >>> import zlib
    >>> combine(zlib.crc32(b"abc"), zlib.crc32(b""), 0) == zlib.crc32(b"abc")
    True
    >>> combine(3, 4, -1)
    Traceback (most recent call last):
    ...
    ValueError: len_b must be >= 0 (the length of the second piece in bytes), got -1
    """
    if len_b < 0:
        raise ValueError(f"len_b must be >= 0 (the length of the second piece in bytes), got {len_b}")
    return _multiply(_shift(len_b), crc_a) ^ crc_b


def combine_all(pieces: Iterable[tuple[int, int]], crc: int = 0) -> int:
    """Return the CRC-32 of the pieces concatenated after the bytes whose CRC is ``crc``; a piece is ``(crc, length)``.

    >>> import zlib
    >>> parts = [b"one ", b"two ", b"three"]
    >>> combine_all((zlib.crc32(p), len(p)) for p in parts) == zlib.crc32(b"".join(parts))
    True
    """
    for piece_crc, length in pieces:
        crc = combine(crc, piece_crc, length)
    return crc

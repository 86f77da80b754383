"""One setting, declared once: ``setting(...)`` is the attrs field that says everything about it.

A field's annotation is its type; its ``Setting`` (in the field's metadata) holds its range, its choices,
whether it must be finite, the values trainfold refuses with why, its HF/TRL name and whether it changes
the run's trajectory (``trainfold.ckpt.run_identity`` reads that). ``setting_problems`` checks any attrs
record declared so, subclasses included, and reports every problem at once.

>>> @attrs.frozen
... class Args:
...     rate: float = setting(0.1, range="(0, inf)", hf="learning_rate")
...     mode: str = setting("a", choices=("a", "b"), trajectory=False)
...     steps: int | None = None
>>> setting_problems(Args(rate=float("nan"), mode="c", steps="5"))[0]
['rate=nan is not a finite number', "mode='c' is not one of ['a', 'b']", "steps must be int or None, got '5' (str)"]
>>> spec_of(attrs.fields(Args).rate).hf, spec_of(attrs.fields(Args).steps).hf
('learning_rate', 'steps')
"""

from __future__ import annotations

import functools
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from trainfold.ckpt.run_identity import TRAJECTORY

__all__ = [
    "Setting",
    "Interval",
    "setting",
    "redeclared",
    "spec_of",
    "setting_problems",
    "type_problem",
    "as_declared",
    "default_of",
    "ONE_PROCESS",
]

SPEC = "trainfold.setting"  # the metadata key of a field's Setting
ONE_PROCESS = "rows are prepared in this process (TRL's datasets.map(num_proc=...) is not used)"


@attrs.frozen
class Interval:
    """A closed or open interval, read from ``"[0, 1)"``, ``"(0, inf)"``, ``"[1, inf)"``.

    >>> Interval.parse("[0, 1)").phrase(), Interval.parse("(0, inf)").phrase(), Interval.parse("[1, inf)").phrase()
    ('in [0, 1)', '> 0', 'a positive int')
    """

    lo: float
    hi: float
    lo_closed: bool = True
    hi_closed: bool = True
    text: str = ""

    @classmethod
    def parse(cls, text: str) -> Interval:
        """Return the interval ``text`` writes (``[`` or ``(``, two numbers or ``inf``, ``]`` or ``)``)."""
        lo, hi = (_number(part.strip()) for part in text[1:-1].split(","))
        return cls(lo, hi, text[0] == "[", text[-1] == "]", text)

    def __contains__(self, value: float) -> bool:
        above = value >= self.lo if self.lo_closed else value > self.lo
        below = value <= self.hi if self.hi_closed else value < self.hi
        return above and below

    def phrase(self) -> str:
        """Return how an error says the interval: ``> 0``, ``>= 1``, ``in [0, 1)``."""
        if math.isinf(self.hi) and self.lo == 1 and self.lo_closed and isinstance(self.lo, int):
            return "a positive int"
        if math.isinf(self.hi):
            return f"{'>=' if self.lo_closed else '>'} {self.lo:g}"
        return f"in {self.text}"


_SAME = "<same name>"


def _number(text: str) -> float:
    try:
        return int(text)
    except ValueError:
        return float(text)


@attrs.frozen
class Setting:
    """What one field's metadata says about its setting (see the module doc)."""

    range: Interval | None = None
    choices: tuple[Any, ...] | None = None  # the values it takes
    refuse: Mapping[Any, str] = attrs.field(factory=dict)  # value -> why trainfold does not do it
    only: tuple[Any, str] | None = None  # (the one value trainfold does, why others are refused)
    finite: bool = True  # a float value must be finite
    hf: str | None = _SAME  # its name in transformers' TrainingArguments or TRL's config; None: trainfold's own
    trajectory: bool | str = True  # False: bookkeeping; "length": the run's length; "samples": the sample order
    check: Callable[[str, Any], str | None] | None = None  # one more check (name, value): why it is wrong, or None
    hint: str = ""  # the fix an error suggests
    doc: str = ""


def setting(
    default: Any = attrs.NOTHING,
    *,
    range: str | None = None,
    choices: tuple[Any, ...] | None = None,
    refuse: Mapping[Any, str] | None = None,
    only: tuple[Any, str] | None = None,
    finite: bool = True,
    hf: str | None = _SAME,
    trajectory: bool | str = True,
    check: Callable[[str, Any], str | None] | None = None,
    hint: str = "",
    doc: str = "",
    converter: Callable[[Any], Any] | None = None,
) -> Any:
    """Return an ``attrs.field`` whose metadata declares the setting (see ``Setting``); ``converter``: as attrs'."""
    spec = Setting(
        Interval.parse(range) if range is not None else None,
        choices,
        dict(refuse or {}),
        only,
        finite,
        hf,
        trajectory,
        check,
        hint,
        doc,
    )
    return attrs.field(default=default, metadata={SPEC: spec, TRAJECTORY: trajectory}, converter=converter)


def redeclared(field: attrs.Attribute, default: Any, **changes: Any) -> Any:  # type: ignore[type-arg]
    """Return ``field`` (a base class's) with another default: a subclass's peer default, the rest unchanged but
    for ``changes`` to its ``Setting`` (e.g. ``only=``: a value the subclass's algorithm cannot take).

    >>> @attrs.frozen
    ... class Base:
    ...     packed: bool = setting(False, hf="packing")
    >>> @attrs.frozen
    ... class Sub(Base):
    ...     packed: bool = redeclared(attrs.fields(Base).packed, False, only=(False, "no packing here"))
    >>> spec_of(attrs.fields(Sub).packed).hf, setting_problems(Sub(packed=True))[0]
    ('packing', ['packed=True is not supported: no packing here; set packed=False'])
    """
    metadata = dict(field.metadata)
    if changes:
        spec = attrs.evolve(spec_of(field), **changes)
        metadata.update({SPEC: spec, TRAJECTORY: spec.trajectory})
    return attrs.field(default=default, metadata=metadata, converter=field.converter)


def spec_of(field: attrs.Attribute) -> Setting:  # type: ignore[type-arg]
    """Return the field's ``Setting`` (a plain one, its HF name its own, for a field declared without ``setting``)."""
    spec: Setting = field.metadata.get(SPEC, Setting(trajectory=field.metadata.get(TRAJECTORY, True)))
    return spec if spec.hf != _SAME else attrs.evolve(spec, hf=field.name)


@functools.cache
def _hints(cls: Any) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _tuple_of(kind: Any) -> Any:
    """Return X of a ``tuple[X, ...]`` annotation (also inside ``... | None``), or None."""
    for part in (kind, *typing.get_args(kind)):
        if typing.get_origin(part) is tuple:
            return typing.get_args(part)[0]
    return None


def as_declared(cls: type, settings: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``settings`` with lists (and a lone str, where the field takes only a tuple) as the fields' tuples.

    >>> @attrs.frozen
    ... class Args:
    ...     names: tuple[str, ...] = ("labels",)
    ...     weights: tuple[float, ...] | None = None
    >>> as_declared(Args, {"names": "a", "weights": [1, 0.5]})
    {'names': ('a',), 'weights': (1.0, 0.5)}
    """
    hints, out = _hints(cls), dict(settings)
    for name, value in settings.items():
        item = _tuple_of(hints.get(name))
        kind = hints.get(name)
        takes_str = kind is str or (
            typing.get_origin(kind) in (typing.Union, types.UnionType) and str in typing.get_args(kind)
        )
        if item is None or not (isinstance(value, list) or (isinstance(value, str) and not takes_str)):
            continue
        values = [value] if isinstance(value, str) else value
        out[name] = tuple(
            float(v) if item is float and isinstance(v, int) and not isinstance(v, bool) else v for v in values
        )
    return out


def default_of(field: attrs.Attribute, record: Any) -> Any:  # type: ignore[type-arg]
    """Return ``field``'s default for ``record`` (a factory's value, computed from ``record`` where it takes it)."""
    default: Any = field.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        return default.factory(record) if default.takes_self else default.factory()
    return default


def _matches(value: Any, kind: Any) -> bool:
    origin, parts = typing.get_origin(kind), typing.get_args(kind)
    if kind is Any:
        return True
    if kind is type(None) or kind is None:
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, p) for p in parts)
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is tuple:
        return isinstance(value, tuple) and all(_matches(v, parts[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    if origin is not None and str(origin) == "collections.abc.Callable":
        return callable(value)
    return isinstance(value, origin or kind)


def _say(kind: Any) -> str:
    origin, parts = typing.get_origin(kind), typing.get_args(kind)
    if kind is type(None):
        return "None"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_say(p) for p in parts)
    if kind is float:
        return "int or float"
    if origin is tuple:
        return "tuple"
    if origin is dict:
        return "dict"
    return getattr(kind, "__name__", str(kind))


def type_problem(name: str, value: Any, kind: Any) -> str | None:
    """Return why ``value`` is not of the annotated type ``kind``, or None.

    >>> type_problem("num_epochs", True, int), type_problem("num_epochs", 3, int)
    ('num_epochs must be int, got True (bool)', None)
    """
    if _matches(value, kind):
        return None
    return f"{name} must be {_say(kind)}, got {value!r} ({type(value).__name__})"


def _value_problems(name: str, value: Any, spec: Setting) -> list[str]:
    hint = f" ({spec.hint})" if spec.hint else ""
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{name}={value} is not a finite number{hint}"] if spec.finite else []
    out = []
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    if spec.range is not None and numeric and value not in spec.range:
        out.append(f"{name} must be {spec.range.phrase()}, got {value!r}{hint}")
    hashable = isinstance(value, typing.Hashable)
    if spec.choices is not None and hashable and value not in spec.choices and value not in spec.refuse:
        out.append(f"{name}={value!r} is not one of {list(spec.choices)}{hint}")
    if hashable and value in spec.refuse:
        out.append(f"{name}={value!r} is not supported: {spec.refuse[value]}")
    if spec.only is not None and value != spec.only[0]:
        out.append(f"{name}={value!r} is not supported: {spec.only[1]}; set {name}={spec.only[0]!r}")
    if spec.check is not None and (why := spec.check(name, value)) is not None:
        out.append(why)
    return out


def setting_problems(record: Any) -> tuple[list[str], set[str]]:
    """Return every problem of ``record``'s settings one by one, and the names of the wrongly typed ones.

    Each field is checked against its annotation, then (when its type is right) its ``Setting``:
    finite, range, choices, refused values and its own check.
    """
    cls, out, bad = type(record), [], set()
    hints = _hints(cls)  # type: ignore[arg-type]  # a class is hashable; typeshed says type[Any] is not
    for field in attrs.fields(cls):
        value = getattr(record, field.name)
        wrong = type_problem(field.name, value, hints[field.name])
        if wrong is not None:
            out.append(wrong)
            bad.add(field.name)
            continue
        out += _value_problems(field.name, value, spec_of(field))
    return out, bad

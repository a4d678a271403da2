"""The kinds of value a configuration key holds, one small object each.

A kind knows how its value is written in TOML and in an environment variable, how it is
rendered back, and the rule every value of it keeps however a section was built. A section's
field names its kind in its metadata (:func:`field`); loading and rendering ask the kind.
"""

from __future__ import annotations

import datetime
import re
import typing
from typing import Any, Final

import attrs

from hubd.errors import ConfigError
from hubd.units import format_duration, parse_duration, positive

__all__ = [
    "Choice",
    "Duration",
    "Flag",
    "Integer",
    "Kind",
    "Strings",
    "Text",
    "check_fields",
    "field",
    "kind_of",
    "metadata",
    "problem",
    "toml_type",
]

_KIND: Final = "hubd.config.kind"
_T = typing.TypeVar("_T")


def problem(key: str, text: str) -> ConfigError:
    """The one shape of a configuration error: what to fix first, then what is wrong."""
    return ConfigError(f"{key}: {text}")


class Kind(typing.Protocol):
    @property
    def expected(self) -> str:
        """What a TOML value of this kind must be, for the error when it is not."""

    def from_toml(self, key: str, raw: object) -> Any:
        """Check a TOML value and convert it (``raw`` already has the right TOML type)."""

    def from_env(self, key: str, text: str) -> Any:
        """Parse an environment variable's text."""

    def display(self, value: Any) -> Any:
        """The value as the config file writes it."""

    def check(self, key: str, value: Any) -> None:
        """The rule every value keeps, however the section was built."""


@attrs.frozen
class Text:
    expected: str = "a string"

    def from_toml(self, key: str, raw: object) -> Any:
        return _typed(key, raw, str, self.expected)

    def from_env(self, key: str, text: str) -> Any:
        return text

    def display(self, value: Any) -> Any:
        return value

    def check(self, key: str, value: Any) -> None:
        pass


@attrs.frozen
class Integer(Text):
    expected: str = "an integer"

    def from_toml(self, key: str, raw: object) -> Any:
        if isinstance(raw, bool):
            raise _wrong(key, self.expected, raw)
        return _typed(key, raw, int, self.expected)

    def from_env(self, key: str, text: str) -> Any:
        if not re.fullmatch(r"\s*[+-]?[0-9]+\s*", text):
            raise problem(key, f"must be an integer, not {text!r}")
        return int(text)


_TRUE: Final = frozenset({"true", "1", "yes"})
_FALSE: Final = frozenset({"false", "0", "no"})


@attrs.frozen
class Flag(Text):
    expected: str = "true or false"

    def from_toml(self, key: str, raw: object) -> Any:
        return _typed(key, raw, bool, self.expected)

    def from_env(self, key: str, text: str) -> Any:
        word = text.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
        raise problem(key, f"must be true/false, 1/0 or yes/no, not {text!r}")


@attrs.frozen
class Duration(Text):
    """Written ``"500ms"``, ``"30s"``, ``"2m"``, ``"1h"``, ``"1m30s"`` or a bare number of
    seconds; held as positive, finite ``float`` seconds."""

    expected: str = 'a duration such as "30s"'

    def from_toml(self, key: str, raw: object) -> Any:
        if isinstance(raw, bool) or not isinstance(raw, str | int | float):
            raise _wrong(key, self.expected, raw)
        return self.from_env(key, raw)

    def from_env(self, key: str, text: str | float) -> Any:
        try:
            return parse_duration(text)
        except ValueError as exc:
            raise problem(key, str(exc)) from None

    def display(self, value: Any) -> Any:
        return format_duration(value)

    def check(self, key: str, value: Any) -> None:
        try:
            positive(value, value)
        except ValueError as exc:
            raise problem(key, str(exc)) from None


@attrs.frozen
class Strings(Text):
    expected: str = "an array of strings"

    def from_toml(self, key: str, raw: object) -> Any:
        items = _typed(key, raw, list, self.expected)
        for index, item in enumerate(items):
            if not isinstance(item, str):
                raise problem(f"{key}[{index}]", f"must be a string, not {toml_type(item)}")
        return tuple(items)

    def from_env(self, key: str, text: str) -> Any:
        return tuple(item.strip() for item in text.split(",") if item.strip())

    def display(self, value: Any) -> Any:
        return list(value)


@attrs.frozen
class Choice(Text):
    """A string restricted to the values of a ``Literal`` type."""

    values: tuple[str, ...] = ()

    @classmethod
    def of(cls, literal: object) -> Choice:
        return cls(values=typing.get_args(literal))

    def from_toml(self, key: str, raw: object) -> Any:
        return self.from_env(key, _typed(key, raw, str, self.expected))

    def from_env(self, key: str, text: str) -> Any:
        word = text.strip().lower()
        self.check(key, word if word in self.values else text)
        return word

    def check(self, key: str, value: Any) -> None:
        if value not in self.values:
            raise problem(key, f"must be one of {', '.join(self.values)}; not {value!r}")


def field(kind: Kind, default: _T) -> _T:
    """A section field of ``kind``."""
    value: _T = attrs.field(default=default, metadata=metadata(kind))
    return value


def metadata(kind: Kind) -> dict[str, Kind]:
    """The metadata of a section field of ``kind``."""
    return {_KIND: kind}


def kind_of(attribute: attrs.Attribute[Any]) -> Kind:
    kind: Kind = attribute.metadata[_KIND]
    return kind


def check_fields(section: str, instance: Any) -> None:
    """Every field of ``instance`` keeps its kind's rule."""
    for attribute in attrs.fields(type(instance)):
        kind_of(attribute).check(f"{section}.{attribute.name}", getattr(instance, attribute.name))


def _typed(key: str, raw: object, kind: type[Any], expected: str) -> Any:
    if not isinstance(raw, kind):
        raise _wrong(key, expected, raw)
    return raw


def _wrong(key: str, expected: str, raw: object) -> ConfigError:
    return problem(key, f"must be {expected}, not {toml_type(raw)}")


def toml_type(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, datetime.date | datetime.time):
        return "a date/time"
    return type(value).__name__

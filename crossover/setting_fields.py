"""How a `CROSSOVER_*` setting is declared and read: a record's field made by `setting(...)`, which carries a
`Setting` (the variable, the typed default, the parser, the help), and the parsers the settings use.

A parser turns the variable's text into the value, or raises a `SettingError` that names the variable and
the text. The declarations themselves are `crossover.settings`.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from crossover.errors import CrossoverError

__all__ = ["Parse", "Setting", "SettingError", "batch_caps", "boolean", "choice", "cpu_list", "declared",
           "device_index", "integer", "nested", "number", "parse_cpu_list", "read_fields", "setting", "text",
           "trimmed", "upper_text"]


class SettingError(CrossoverError, ValueError):
    """A `CROSSOVER_*` variable or flag has a value we cannot use."""


Parse = Callable[[str, str], Any]
"""(variable, its text) -> the value; a `SettingError` naming the variable when the text is no such value."""


@dataclass(frozen=True)
class Setting:
    """One `CROSSOVER_*` variable: its name, its default, how its text is read, and what it means.

    `shown` is the docs table's default where the field's default is not what a rank gets (one worked
    out at start: the daemon's socket, the script's name)."""

    env: str
    default: Any
    parse: Parse
    meaning: str
    shown: Optional[str] = None

    def is_set(self, environ: Optional[Mapping[str, str]] = None) -> bool:
        """Whether the variable has a value (a blank one is none)."""
        return bool((os.environ if environ is None else environ).get(self.env, "").strip())

    def read(self, environ: Optional[Mapping[str, str]] = None) -> Any:
        """The variable's value in `environ` (the process's environment), or the default when it is unset."""
        raw = (os.environ if environ is None else environ).get(self.env, "")
        return self.parse(self.env, raw) if raw.strip() else self.default

    def default_text(self) -> str:
        """The default as a user would write it: docs/settings.md's column."""
        if self.shown is not None:
            return self.shown
        value = self.default
        if isinstance(value, bool):
            return "1" if value else "0"
        if isinstance(value, float):
            return f"{value:g}"
        if isinstance(value, tuple):
            return ",".join(map(str, value))
        return str(value)


def setting(env: str, default: Any, parse: Parse, meaning: str, shown: Optional[str] = None) -> Any:
    """A record's field that is the variable `env`: the field's default is the setting's."""
    return field(default=default, metadata={"setting": Setting(env, default, parse, meaning, shown)})


def nested(record: type) -> Any:
    """A record's field that is another record of settings, read with it."""
    return field(default_factory=record, metadata={"record": record})


def declared(record: type) -> list[Setting]:
    """Every setting a record declares, its nested records' included, in field order."""
    found: list[Setting] = []
    for f in dataclasses.fields(record):
        if "setting" in f.metadata:
            found.append(f.metadata["setting"])
        elif "record" in f.metadata:
            found += declared(f.metadata["record"])
    return found


def read_fields(record: type, environ: Optional[Mapping[str, str]]) -> dict[str, Any]:
    """Each declared field's value from the environment, nested records built the same way."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(record):
        if "setting" in f.metadata:
            values[f.name] = f.metadata["setting"].read(environ)
        elif "record" in f.metadata:
            values[f.name] = f.metadata["record"](**read_fields(f.metadata["record"], environ))
    return values


# ---- parsers: (variable, text) -> value -------------------------------------------------------------


def text(_name: str, raw: str) -> str:
    """Any text, as given."""
    return raw


def trimmed(_name: str, raw: str) -> str:
    """Any text, without the blanks around it."""
    return raw.strip()


def upper_text(_name: str, raw: str) -> str:
    return raw.upper()


def boolean(name: str, raw: str) -> bool:
    word = raw.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise SettingError(f"{name}={word!r} is not a boolean (use 1 or 0)")


def _number(name: str, raw: str, lo: Any, hi: Any, convert: Callable[[str], Any], what: str) -> Any:
    raw = raw.strip()
    try:
        value = convert(raw)
    except ValueError:
        raise SettingError(f"{name}={raw!r} is not {what}") from None
    if not lo <= value <= hi:
        raise SettingError(f"{name}={raw} is outside {lo}..{hi}")
    return value


def integer(lo: int, hi: int) -> Parse:
    """An int within lo..hi."""
    return lambda name, raw: int(_number(name, raw, lo, hi, int, "an integer"))


def number(lo: float, hi: float) -> Parse:
    """A float within lo..hi."""
    return lambda name, raw: float(_number(name, raw, lo, hi, float, "a number"))


def choice(options: tuple[str, ...], allow_empty: bool = False) -> Parse:
    """One of `options`, in any case (`allow_empty`: the default, empty, is none of them)."""
    def parse(name: str, raw: str) -> str:
        word = raw.strip().lower()
        if word not in options:
            empty = " or empty" if allow_empty else ""
            raise SettingError(f"{name}={word!r} is not one of {', '.join(options)}{empty}")
        return word
    return parse


def device_index(name: str, raw: str) -> int:
    try:
        index = int(raw)
    except ValueError:
        raise SettingError(f"{name}={raw!r} is not an integer") from None
    if index < -1:
        raise SettingError(f"{name}={index} must be -1 or a device index")
    return index


def parse_cpu_list(raw: str) -> tuple[int, ...]:
    """`0-3,8` -> (0, 1, 2, 3, 8): the kernel's cpu-list format, sorted, without repeats."""
    cores: set[int] = set()
    for part in raw.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise SettingError(f"{raw!r} is not a cpu list such as 0-3,8") from None
        if first < 0 or last < first:
            raise SettingError(f"{raw!r}: {part!r} is not a range of core numbers")
        cores.update(range(first, last + 1))
    return tuple(sorted(cores))


def cpu_list(name: str, raw: str) -> tuple[int, ...]:
    try:
        return parse_cpu_list(raw.strip())
    except SettingError as exc:
        raise SettingError(f"{name}: {exc}") from None


def batch_caps(name: str, raw: str) -> tuple[int, ...]:
    """One int, or one per rank (`64,64,32`), each at least 1."""
    raw = raw.strip()
    try:
        values = tuple(int(item) for item in raw.split(","))
    except ValueError:
        raise SettingError(f"{name}={raw!r} is not an int or a comma-separated list of ints") from None
    if any(value < 1 for value in values):
        raise SettingError(f"{name}={raw!r}: every cap must be >= 1")
    return values

"""Checks of one setting's value, each failing with a one-line `ConfigError` that names the
value and what is allowed. `ako.config` checks a whole run with them, and each strategy's
registry entry (`ako.strategies.base.Option`) checks its own options."""

from __future__ import annotations

import math
from dataclasses import dataclass


class ConfigError(ValueError):
    """Bad configuration; the message is one line naming the value and what is allowed."""


def show(value) -> str:
    """A value as the user wrote it: true/false for booleans, quoted strings."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def choice(what: str, value: str, allowed) -> None:
    """Raise ConfigError unless `value` is one of `allowed`."""
    if not isinstance(value, str) or value not in allowed:
        raise ConfigError(f"unknown {what} {value!r:.80}: choose one of {', '.join(allowed)}")


def integer(name: str, value, low: int, high: int | None = None, hint: str = "") -> int:
    """`value` (an int, or its text) as an int in [low, high]; `hint` adds other allowed forms."""
    allowed = f"must be an integer >= {low}" + ("" if high is None else f" and <= {high}") + hint
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{name} {show(value)}: {allowed}")
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{name} {show(value)}: {allowed}") from None
    if number < low or (high is not None and number > high):
        raise ConfigError(f"{name} {show(value)}: {allowed}")
    return number


def number(name, value, low, high=math.inf, low_open=False, high_open=False) -> float:
    """`value` (a number, or its text) as a finite float between `low` and `high`, each bound
    open or closed."""
    lo = f"> {low:g}" if low_open else f">= {low:g}"
    hi = "" if high == math.inf else (f" and < {high:g}" if high_open else f" and <= {high:g}")
    allowed = f"must be a number {lo}{hi}"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{name} {show(value)}: {allowed}")
    try:
        result = float(value)
    except ValueError:
        raise ConfigError(f"{name} {show(value)}: {allowed}") from None
    below = result <= low if low_open else result < low
    above = result >= high if high_open else result > high
    if not math.isfinite(result) or below or above:
        raise ConfigError(f"{name} {show(value)}: {allowed}")
    return result


@dataclass(frozen=True)
class Integer:
    """An option's check (`ako.strategies.base.Option.check`): an integer in [low, high], or
    also the text "auto" when `auto`. A class, not a lambda, so that strategies pickle."""

    name: str
    low: int
    high: int | None = None
    auto: bool = False

    def __call__(self, value, config=None):
        if self.auto and value == "auto":
            return value
        return integer(self.name, value, self.low, self.high, hint=" or 'auto'" if self.auto else "")


@dataclass(frozen=True)
class Number:
    """An option's check: a finite number in [low, high]."""

    name: str
    low: float
    high: float

    def __call__(self, value, config=None):
        return number(self.name, value, self.low, self.high)


def misfit(what: str, error: Exception) -> ConfigError:
    """ConfigError for saved state `what` (a checkpoint file or a shard) that torch refuses to
    load: the error's type and the first line of its message."""
    text = str(error).strip()
    why = text.splitlines()[0][:160] if text else ""
    return ConfigError(f"{what}: damaged, it does not fit this run ({type(error).__name__}: {why})")

"""A user's own model or data set named on the command line as `package.module:factory`, and
the same name for a factory the API was given, so that config.toml records it for `--resume`,
`torchrun` and sweep files."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable

from ako.checks import ConfigError


def is_spec(name: str) -> bool:
    """Whether `name` names a factory (`package.module:factory`) rather than a built-in."""
    return isinstance(name, str) and ":" in name and not name.startswith("text:")  # text:PATH is a data set


def import_factory(setting: str, spec: str) -> Callable:
    """The callable `spec` names ("package.module:function", attributes may be dotted), imported
    with the current directory on the path as `python -m` has it. Raises ConfigError (one line)
    when the module or the name is not there, or importing it fails."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{setting} {spec!r}: expected package.module:factory")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # the console script's path starts at its bin directory
    try:
        target = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ConfigError(f"{setting} {spec!r}: no module named {e.name!r} (run from the directory that holds it, "
                          "or put it on PYTHONPATH)") from None  # fmt: skip
    except Exception as e:  # the user's module failed while importing: say how, in one line
        raise ConfigError(f"{setting} {spec!r}: importing {module_name} failed: {type(e).__name__}: {first_line(e)}") from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{setting} {spec!r}: module {module_name} has no {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{setting} {spec!r}: {attribute} is not callable")
    return target


def spec_of(fn: Callable | None) -> str | None:
    """`module:qualname` of a function or class that importing that name gives back (not one
    of `__main__`, which another process cannot import by that name; not a lambda, a nested
    function, a bound method, a partial or a callable object), else None."""
    if not (inspect.isfunction(fn) or inspect.isclass(fn)):
        return None
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module in ("__main__", "__mp_main__") or "<" in name:
        return None
    target = sys.modules.get(module)
    for part in name.split("."):
        target = getattr(target, part, None)
    return f"{module}:{name}" if target is fn else None


def call_factory(setting: str, spec: str, factory: Callable, *args):
    """`factory(*args)`, with whatever it raises as a one-line ConfigError naming `spec`."""
    try:
        return factory(*args)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{setting} {spec!r} raised {type(e).__name__}: {first_line(e)}") from None


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, at most 200 characters."""
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else "(no message)"

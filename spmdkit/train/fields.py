"""How a config field is declared and checked: its `tyro.conf.arg` marker (one-line help, short flags), the
reading of those markers, and the type check that guards values tyro did not parse (library calls, TOML, JSON).
Imports no JAX."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

import tyro

from spmdkit.errors import SpmdkitError


def arg(help: str, *flags: str) -> Any:
    """A config field's `Annotated` marker: its one-line help and the short flags the command line also accepts."""
    return tyro.conf.arg(help=help, aliases=flags or None)


def field_docs(cls: type) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Each field of a config section -> (its help, its short flags), read from its `tyro.conf.arg` marker."""
    docs = {}
    for name, hint in typing.get_type_hints(cls, include_extras=True).items():
        arg = next((m for m in getattr(hint, "__metadata__", ()) if hasattr(m, "aliases")), None)
        docs[name] = (arg.help or "", tuple(arg.aliases or ())) if arg else ("", ())
    return docs


def require(ok: bool, message: str) -> None:
    if not ok:
        raise SpmdkitError(message)


def _conforms(value: Any, hint: Any) -> bool:
    """Whether `value` has the type `hint` declares (int, float, str, bool, Literal, X | None, tuple[int, ...]);
    a bool is not an int, an int is a float; other hints are not checked."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return value is None
    if origin is Literal:
        return any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in args)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, a) for a in args)
    if origin is tuple:
        return isinstance(value, tuple) and all(_conforms(v, args[0]) for v in value)
    if hint in (int, float):
        return isinstance(value, int | float if hint is float else int) and not isinstance(value, bool)
    return isinstance(value, hint) if hint in (str, bool) else True


def check_types(section: Any, name: str) -> None:
    """SpmdkitError naming the first field of a config section whose value is not of its declared type (tyro parses
    the command line's types itself; this guards library calls, TOML and JSON configs)."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if not _conforms(value, hints[f.name]):
            wanted = str(hints[f.name]).replace("typing.", "").replace("<class '", "").replace("'>", "")
            raise SpmdkitError(f"{name}.{f.name}={value!r} must be of type {wanted}")

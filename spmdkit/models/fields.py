"""How every config section declares a field, `name: Annotated[type, arg(help, *flags)] = default` (tyro, docs/cli.md
and the preflight read the marker), and `check_types`, the one type check of values tyro did not parse. In `models/`,
the lowest layer with a config section, so `data/` and `train/` import it too. No JAX (nor does tyro import it)."""

from __future__ import annotations

import dataclasses
import functools
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
        marker = next((m for m in getattr(hint, "__metadata__", ()) if hasattr(m, "aliases")), None)
        docs[name] = (marker.help or "", tuple(marker.aliases or ())) if marker else ("", ())
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


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The field types of a config section, evaluated once (sections are built often: the planner's search)."""
    return typing.get_type_hints(cls)


def check_types(section: Any, name: str) -> None:
    """SpmdkitError naming the first field of a config section whose value is not of its declared type (tyro parses
    the command line's types itself; this guards library calls, TOML, JSON and saved configs). A list given for a
    tuple field (TOML and JSON have no tuples) becomes a tuple first."""
    hints = _hints(type(section))
    for f in dataclasses.fields(section):
        value, hint = getattr(section, f.name), hints[f.name]
        if isinstance(value, list) and tuple in {typing.get_origin(h) for h in (hint, *typing.get_args(hint))}:
            object.__setattr__(section, f.name, value := tuple(value))
        if not _conforms(value, hint):
            wanted = str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")
            raise SpmdkitError(f"{name}.{f.name}={value!r} must be of type {wanted}")

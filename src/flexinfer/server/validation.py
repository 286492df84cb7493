"""A request body's validation errors in its client's terms: one line for
the 400's message, and the field at fault for its `param`.

pydantic reports a field of a union type (`prompt: str | list[str] |
list[int] | list[list[int]]`, a message's `content`) once per alternative,
each located by the alternative's internal name (`prompt.list[int].0`,
`content.list[TextPart].0.type`, `function-after[...]` where a validator
wraps one): that is pydantic's schema, not the API. Here the location of an
error is read against the request model's own annotations, so a union is
recognised by its type, whatever pydantic names its members; its errors
become one: the field, what it accepts ("a string or a list of strings"),
and, where one alternative got further into the value than the others, that
alternative's own complaint.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

# At most this many problems in one message; a count says how many more there were.
_MOST_PROBLEMS = 4

# Leaf types as the API's documentation says them: (one, several).
_NAMES: dict[Any, tuple[str, str]] = {str: ("a string", "strings"), int: ("an integer", "integers"),
                                      float: ("a number", "numbers"), bool: ("true or false", "booleans"),
                                      dict: ("an object", "objects")}


def validation_message(model: type[BaseModel], errors: Sequence[dict]) -> tuple[str, str | None]:
    """One readable line from pydantic's `errors` of validating `model`, and
    the top-level field they concern (the first one's)."""
    # In pydantic's order: a problem's line, or the location of a union
    # field, whose line is made once all its members' errors are in.
    problems: list[str | tuple] = []
    unions: dict[tuple, tuple[Any, list[tuple[Any, tuple, dict]]]] = {}  # loc -> (type, [(member, rest, error)])
    param = None
    for error in errors:
        loc = tuple(error.get("loc", ()))
        if param is None and loc:
            param = str(loc[0])
        found = _union_in(model, loc)
        if found is None:
            problems.append(f"{_path(loc) or 'body'}: {_said(error)}")
            continue
        at, union = found
        if loc[:at] not in unions:
            problems.append(loc[:at])
            unions[loc[:at]] = (union, [])
        unions[loc[:at]][1].append((loc[at], loc[at + 1:], error))
    lines = [p if isinstance(p, str) else _union_problem(p, *unions[p]) for p in problems]
    more = f" (and {len(lines) - _MOST_PROBLEMS} more)" if len(lines) > _MOST_PROBLEMS else ""
    return "; ".join(lines[:_MOST_PROBLEMS]) + more, param


def _union_problem(loc: tuple, union: Any, tries: list[tuple[Any, tuple, dict]]) -> str:
    """What a union field accepts, and the complaint of the one member that
    went deepest into the value (where one did: a list of the right kind
    with one wrong item)."""
    accepted = [_describe(member) for member in _members(union)]
    said = f"{_path(loc)}: expected " + (", ".join(accepted[:-1]) + " or " + accepted[-1] if len(accepted) > 1
                                         else accepted[0])
    deepest = max(len(rest) for _, rest, _ in tries)
    closest = {label for label, rest, _ in tries if len(rest) == deepest}
    if deepest == 0 or len(closest) != 1:
        return said
    details = [f"{_path(loc + rest)}: {_said(error)}" for label, rest, error in tries if label in closest]
    return f"{said}; {', '.join(details[:2])}"


def _union_in(model: type[BaseModel], loc: tuple) -> tuple[int, Any] | None:
    """(index in `loc` of the member label, the union type) where `loc` runs
    into a union field of `model`, else None."""
    kind: Any = model
    for index, part in enumerate(loc):
        kind = _unwrapped(kind)
        if _is_union(kind):
            return index, kind
        origin = typing.get_origin(kind)
        if isinstance(kind, type) and issubclass(kind, BaseModel) and part in kind.model_fields:
            kind = kind.model_fields[part].annotation
        elif origin is list and isinstance(part, int):
            kind = typing.get_args(kind)[0]
        elif origin is dict:
            kind = typing.get_args(kind)[1]
        else:
            return None
    return None


def _unwrapped(kind: Any) -> Any:
    """`kind` without Annotated, and without None where it is an optional single type (`int | None`:
    pydantic reports no member label for it)."""
    while True:
        if typing.get_origin(kind) is typing.Annotated:
            kind = typing.get_args(kind)[0]
        elif _is_union(kind) and len(_members(kind)) == 1:
            kind = _members(kind)[0]
        else:
            return kind


def _is_union(kind: Any) -> bool:
    return typing.get_origin(kind) in (typing.Union, types.UnionType)


def _members(union: Any) -> list[Any]:
    """A union's members but None (null is a value of the field, not a type a client mistakes)."""
    return [member for member in typing.get_args(union) if member is not type(None)]


def _describe(kind: Any, several: bool = False) -> str:
    """A type as the API's documentation says it: "a list of strings"."""
    kind = _unwrapped(kind)
    origin = typing.get_origin(kind)
    if origin is list:
        inner = _describe(typing.get_args(kind)[0], several=True)
        return f"lists of {inner}" if several else f"a list of {inner}"
    if _is_union(kind):
        return " or ".join(_describe(member, several) for member in _members(kind))
    if origin is typing.Literal:
        return " or ".join(repr(value) for value in typing.get_args(kind))
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        one, many = getattr(kind, "API_NAMES", _NAMES[dict])
        return many if several else one
    one, many = _NAMES.get(origin or kind, (str(kind), str(kind)))
    return many if several else one


def _said(error: dict) -> str:
    """pydantic's message, without its own words for what it validates
    ("instance of StreamOptions", "Value error, ")."""
    if error.get("type") == "model_type":
        return "expected an object"
    message = str(error.get("msg", ""))
    return message.removeprefix("Value error, ")


def _path(loc: tuple) -> str:
    return ".".join(str(part) for part in loc)

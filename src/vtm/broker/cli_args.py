"""What vtmd's and vtmctl's command lines share: a parser whose --help shows
every default and whose errors are one line, and the argparse types of what
they take: UTF-8 text, a size (src/vtm/sizes.py), a priority (the protocol's
int32), a count and a number of seconds, each checked where it is typed."""

from __future__ import annotations

import argparse
import math
import os

import vtm
from vtm.sizes import parse_size


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: ...)" to a flag's help, except where there is no
    value to show (None, or off for an on/off switch): such a help says what
    the absence means."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """HelpFormatter for this parser and its sub-commands (argparse builds
    them of the parent's class), and a bad argument reported in one line,
    `PROG: error: ...`, status 2, like every other error of these commands."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog.split()[0]}: error: {message} (see `{self.prog} --help`)\n")


def add_version(parser: argparse.ArgumentParser) -> None:
    """--version: the `vtm` distribution's (vtm.__version__)."""
    parser.add_argument("--version", action="version", version=f"{parser.prog} {vtm.__version__}")


def utf8(text: str) -> str:
    """argparse type: text the broker is sent (protobuf strings are UTF-8).
    argv bytes that are not UTF-8 reach Python as lone surrogates, which
    protobuf and gRPC raised on, a traceback; shown as the bytes given."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"not valid UTF-8: {os.fsencode(text)!r}") from None
    return text


def size(text: str) -> int:
    """argparse type: a size in bytes (vtm.sizes)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


INT32 = (-(1 << 31), (1 << 31) - 1)


def _parse(text: str, kind: type, what: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def priority(text: str) -> int:
    """argparse type: a priority, an int32 as the protocol carries it."""
    value = _parse(text, int, "an integer")
    if not INT32[0] <= value <= INT32[1]:
        raise argparse.ArgumentTypeError(f"{value} is out of range: a priority is from {INT32[0]} to {INT32[1]}")
    return value


def count(text: str) -> int:
    """argparse type: a whole number, 0 or more."""
    value = _parse(text, int, "a whole number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {value}")
    return value


def seconds(text: str) -> float:
    """argparse type: a finite number of seconds, more than 0."""
    value = _parse(text, float, "a number of seconds")
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {text}")
    return value
